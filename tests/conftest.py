"""Shared pytest fixtures.

Ray: one local Ray for the whole test session (starting one costs seconds and every actor is a
process, so tests share it and reuse worker groups through module-scoped fixtures).  It binds to
127.0.0.1 only.

Process reuse across modules: modules that need only *some* group of N processes borrow running
ones from the host bank (``host_bank``, tests/hosts.py); they run back to back, right after the
forking modules, and the bank's processes stop as soon as the last of them is done.

Simulated multi-node clusters: Ray allows one cluster connection per process, so they live in
driver processes (tests/drivers.py).  Modules whose scenarios leave the nodes alone share ONE
cluster and ONE driver (``simulated_cluster``); they run back to back, and the cluster is shut
down as soon as the last of them is done.  Scenarios that remove nodes own a cluster each
(``tests.drivers.run_module``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Must be set before anything imports ray: Ray reads it once, at import time.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray's log monitor looks for new log files ten times a second until a session has 1,000 of them;
# a test session starts hundreds of worker processes, and the log monitors of a run used 40
# CPU-seconds.  With the threshold at 0 they look twice a second (lines of files they know still
# stream at ten a second): 25 CPU-seconds.  The variable reaches every Ray the session starts,
# drivers' and scripts' too.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
# The suite's groups fork their ranks from a warm process per node unless a test names "ray" (a
# rank in its own Ray worker imports torch and rankmesh again: 3.6 CPU-seconds, a megatron rank
# 6.7).  Tests about what only a Ray actor does (Ray called inside a rank, copy-on-write receive
# from Ray's store, tight timeouts through Ray's tasks) start theirs with process_model="ray".
# The variable reaches every driver and script the session starts.
os.environ.setdefault("RANKMESH_PROCESS_MODEL", "fork")

import pytest  # noqa: E402

#: Logical CPUs declared for the session's Ray: enough for 8-12 one-CPU actors at once next to
#: the host bank's idle processes (tests/hosts.py).
RAY_TEST_CPUS = 32
#: Object store for the session: large enough for the 64 MiB transport tests, small enough to
#: be polite on a shared machine.
RAY_TEST_OBJECT_STORE = 1024 * 1024 * 1024


#: The checkout's source trees that Ray workers and test drivers import.
COMPILED_TREES = ("src/rankmesh", "tests", "scripts")


def pytest_sessionstart(session):
    """Compile the checkout's modules to bytecode once, before any process imports them.

    With PYTHONDONTWRITEBYTECODE set (this machine sets it) Python writes no bytecode, so every
    Ray worker and driver process would compile rankmesh and the test modules from source again:
    about 0.12 CPU-seconds per process, and a run starts 400 of them.  Python still reads
    bytecode that is there and current (the variable only stops writing), so compiling once here
    is enough; a source edited later is recompiled as usual, by its mtime.
    """
    if not sys.dont_write_bytecode:
        return  # Python writes bytecode on first import itself
    import compileall

    root = Path(__file__).resolve().parents[1]
    for tree in COMPILED_TREES:
        if (root / tree).is_dir():
            compileall.compile_dir(root / tree, quiet=1)


@pytest.fixture(scope="session")
def ray_session():
    """The session's local Ray (started on first use, shut down at the end of the session)."""
    ray = pytest.importorskip("ray")
    from rankmesh.backends.ray.runtime import ensure_ray

    conn = ensure_ray(num_cpus=RAY_TEST_CPUS, object_store_memory=RAY_TEST_OBJECT_STORE)
    yield conn
    if conn.started_here:
        ray.shutdown()


@pytest.fixture(scope="session")
def host_bank(ray_session):
    """Running host processes lent to groups module after module (tests.hosts.HostBank); its users
    run back to back, and it is closed as soon as the last of them is done."""
    from tests.hosts import HostBank

    bank = HostBank()
    yield bank
    bank.close()


@pytest.fixture(scope="session")
def simulated_cluster():
    """The shared simulated cluster (tests.drivers.SharedCluster): started on first use, closed after its last user."""
    pytest.importorskip("ray")
    from tests.drivers import SharedCluster

    cluster = SharedCluster()
    yield cluster
    cluster.close()


def _uses(item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def _uses_simulated_cluster(item) -> bool:
    return _uses(item, "simulated_cluster")


#: Session fixtures that hold processes: each is closed after the last test that uses it.
CLOSED_AFTER_LAST_USER = ("simulated_cluster", "host_bank")


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are finalized (they give processes back)
def pytest_runtest_teardown(item, nextitem):
    """Close the shared simulated cluster and the host bank once no later test needs them (their
    processes cost memory, and the bank's hold CPUs that later tests reserve)."""
    for name in CLOSED_AFTER_LAST_USER:
        if _uses(item, name) and not any(_uses(i, name) for i in _later_items(item, nextitem)):
            fixture = item.funcargs.get(name) if hasattr(item, "funcargs") else None
            if fixture is not None:
                fixture.close()


def _later_items(item, nextitem):
    items = item.session.items
    start = items.index(nextitem) if nextitem is not None else len(items)
    return items[start:]


#: Test modules that fork the pytest process (tests/megatron_workers.run_forked; test_mesh asks
#: megatron its questions in two forked processes).  Forking a process whose Ray driver is
#: connected corrupts the driver's gRPC channels (later Ray calls hang), so these run first,
#: before any test starts the session's Ray.
FORKING_MODULES = ("test_megatron_check.py", "test_megatron_model.py", "test_mesh.py", "test_one_rank_per_gpu.py")


def pytest_collection_modifyitems(config, items):
    """Run forking tests first, then the host bank's users back to back, and the shared simulated
    cluster's users last, back to back; run the Ray dispatch matrix grouped by mesh (cached groups
    get reused)."""
    forking = [i for i in items if i.path.name in FORKING_MODULES]
    rest = [i for i in items if i.path.name not in FORKING_MODULES]
    shared = [i for i in rest if _uses_simulated_cluster(i)]
    rest = [i for i in rest if not _uses_simulated_cluster(i)]
    # Whole modules move, so that a module's fixtures are set up once.
    banked_modules = {i.path for i in rest if _uses(i, "host_bank")}
    banked = [i for i in rest if i.path in banked_modules]
    items[:] = forking + banked + [i for i in rest if i.path not in banked_modules] + shared
    module = "test_ray_dispatch.py"
    positions = [i for i, item in enumerate(items) if item.path.name == module]
    if not positions:
        return
    chosen = [items[i] for i in positions]

    def mesh_key(pair):
        index, item = pair
        callspec = getattr(item, "callspec", None)
        mesh = callspec.params.get("mesh_name", "") if callspec is not None else ""
        return (mesh, index)

    ordered = [item for _, item in sorted(enumerate(chosen), key=mesh_key)]
    for pos, item in zip(positions, ordered):
        items[pos] = item
