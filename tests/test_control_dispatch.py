"""The dispatch modes whose calls may take a call session, run from the backend-neutral matrix on the Ray path.

``tests/test_ray_dispatch.py`` runs the whole matrix (tests/dispatch_matrix.py) on the default
path, where blocking calls with inline arguments go through the group's call session; here the
modes whose calls carry inline arguments (lists of items, replicated values, rank zero, all to
all) run again with ``RANKMESH_CONTROL=ray``, one Ray task per rank.  Data modes (DataProto)
take the Ray path on both, so they are not repeated.  Its groups (one per world size, as in
test_ray_dispatch) run in processes from the session's host bank (tests/hosts.py).
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from rankmesh.backends.ray.executor import CONTROL_ENV  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from tests import dispatch_matrix  # noqa: E402
from tests.test_ray_dispatch import HostCache  # noqa: E402


@pytest.fixture(scope="module")
def ray_path_cache(host_bank):
    cache = HostCache(host_bank)
    yield cache
    cache.close()


@pytest.fixture
def group_factory(ray_path_cache, monkeypatch):
    """The matrix's groups with ``RANKMESH_CONTROL=ray`` (read when each group is built)."""

    def make(worker_cls, mesh=None, *, meshes=None, init_args=(), init_kwargs=None):
        mesh = mesh if mesh is not None else RankMesh(dp=1)
        if mesh.world_size > 8:
            pytest.skip("the Ray-path subset keeps to the matrix's meshes of at most 8 ranks")
        monkeypatch.setenv(CONTROL_ENV, "ray")
        wg = ray_path_cache.get(worker_cls, mesh, meshes, init_args, init_kwargs, key_extra=("ray",))
        assert set(wg._executor.control_paths()) == {"ray"}
        return wg

    return make


test_list_mode_routing_on_ray = dispatch_matrix.test_list_mode_routing
test_replicated_modes_on_ray = dispatch_matrix.test_replicated_modes
test_execute_rank_zero_mode_on_ray = dispatch_matrix.test_execute_rank_zero_mode
test_all_to_all_on_ray = dispatch_matrix.test_all_to_all
