"""The memory files of large call arguments and outputs (``rankmesh.backends.ray.files``), in one process.

The reuse rule is what keeps a rank's input from changing under it: a file is written again only
once its writer's ``Mapped`` is gone and every reader it was sent to reported each opening let
go.  These tests drive a pool and its readers in this process (a reader opens the file through
``/proc/self/fd``, as a rank does through the controller's), with expected values written by hand.
The same rule across real processes: ``tests/test_ray_dispatch.py`` (a rank that keeps its input)
and ``tests/test_control_plane.py`` (files reused call after call).
"""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

pytest.importorskip("ray")

from rankmesh.backends.ray import files  # noqa: E402
from rankmesh.errors import BackendError  # noqa: E402


def write(pool: files.FilePool, value: float, n: int = 1 << 18) -> files.Mapped:
    found = files.mapped(np.full(n, value, dtype=np.float32), pool, 1 << 10)
    assert found is not None
    return found


def read(m: files.Mapped) -> np.ndarray:
    """What a reader gets: the pickled Mapped, opened (a read-only view over the file)."""
    return pickle.loads(pickle.dumps(m))


def report(pool: files.FilePool, reader: str) -> None:
    gc.collect()
    pool.released(reader, files.take_released([pool.token]))


def test_a_file_is_written_again_only_after_the_writer_and_every_reader_let_go():
    pool = files.FilePool()
    first = write(pool, 1.0)
    number = first.file.number
    first.expect(["a", "b"])
    view_a, view_b = read(first), read(first)
    assert (float(view_a[0]), float(view_b[-1])) == (1.0, 1.0)
    del first  # the writer is done; both readers still hold views
    del view_a
    report(pool, "a")
    second = write(pool, 2.0)  # "b" still reads: a new file
    assert second.file.number != number and pool.reused == 0
    assert float(view_b[0]) == 1.0
    del view_b
    report(pool, "b")
    third = write(pool, 3.0)  # now the first file is free again
    assert third.file.number == number and pool.reused == 1
    assert float(read(third)[0]) == 3.0
    pool.close()


def test_a_report_of_an_earlier_use_frees_nothing():
    pool = files.FilePool()
    first = write(pool, 1.0)
    first.expect(["a"])
    key = first.key
    view = read(first)
    del first, view
    report(pool, "a")
    again = write(pool, 2.0)  # the same file, its next use
    again.expect(["a"])
    assert again.key[1] == key[1] and again.key[2] == key[2] + 1
    pool.released("a", [key])  # a late duplicate of the first use's report
    del again
    gc.collect()
    assert pool.free == 0  # the second use's reader has not let go
    pool.close()


def test_a_closed_pool_writes_nothing_and_closes_a_file_once_its_writer_is_done():
    pool = files.FilePool()
    first = write(pool, 1.0)
    first.expect(["never-opens"])
    pickled = pickle.dumps(first)
    pool.close()
    assert files.mapped(np.zeros(1 << 18, dtype=np.float32), pool, 1 << 10) is None
    assert float(pickle.loads(pickled)[0]) == 1.0  # still open while its Mapped lives (a retry may send it)
    files.forget([pool.token])
    del first
    gc.collect()
    assert len(pool) == 0
    with pytest.raises(BackendError, match="is gone"):
        pickle.loads(pickled)


def test_free_files_beyond_the_kept_bytes_are_closed():
    pool = files.FilePool(keep_bytes=1 << 20)  # room for one 1 MiB file
    made = [write(pool, float(i)) for i in range(3)]
    del made
    gc.collect()
    assert (len(pool), pool.free) == (1, 1)
    pool.close()
