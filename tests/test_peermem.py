"""rankmesh.peermem: strided views as byte runs (checked against numpy's own element addresses),
and reads from a real child process (its array rebuilt here from the same seed), refused reads
(a child under a seccomp filter; under Yama, a reader outside the declared tracer's tree), bad
addresses and reads cut short by the kernel."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rankmesh.errors import PeerReadError
from rankmesh.peermem import (
    COALESCE_GAP,
    IOV_MAX,
    allow_peer_reads,
    coalesce,
    namespace_id,
    read_process,
    segments,
    strided_segments,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux-only")

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}


def element_addresses(view: np.ndarray) -> np.ndarray:
    """Address of every element of ``view`` in row-major order, from numpy's index arithmetic alone."""
    base = view.__array_interface__["data"][0]
    idx = np.indices(view.shape).reshape(view.ndim, -1) if view.ndim else np.zeros((0, 1), dtype=np.int64)
    return base + (idx * np.array(view.strides, dtype=np.int64)[:, None]).sum(axis=0)


def expand(runs: np.ndarray, itemsize: int) -> np.ndarray:
    """Element addresses a list of runs covers, in order."""
    out = [np.arange(int(a), int(a) + int(n), itemsize) for a, n in runs]
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def random_view(rng: np.random.Generator) -> np.ndarray:
    ndim = int(rng.integers(1, 5))
    shape = tuple(int(rng.integers(1, 7)) for _ in range(ndim))
    dtype = rng.choice([np.float32, np.float64, np.int16, np.uint8])
    base = np.zeros(tuple(s * 2 + 1 for s in shape), dtype=dtype)
    if rng.random() < 0.5:  # a transposed parent: strides out of order
        base = base.transpose(rng.permutation(ndim))
    index = tuple(slice(int(rng.integers(0, 2)), None, int(rng.integers(1, 3))) for _ in range(ndim))
    view = base[index]
    return view[tuple(slice(0, s) for s in shape)] if view.ndim == ndim else view


def test_segments_match_numpy_element_addresses() -> None:
    rng = np.random.default_rng(7)
    for _ in range(300):
        view = random_view(rng)
        runs = segments(view)
        assert runs.dtype == np.uint64 and runs.shape[1] == 2
        np.testing.assert_array_equal(expand(runs, view.itemsize), element_addresses(view))
        # runs are merged: no run ends where the next one starts
        assert not np.any(runs[:-1, 0] + runs[:-1, 1] == runs[1:, 0])


def test_segments_of_torch_views_and_edge_cases() -> None:
    t = torch.arange(24 * 10, dtype=torch.float32).reshape(24, 10)
    view = t[3:20, 2:9]  # 17 rows of 7 elements, row stride 10
    runs = segments(view)
    assert runs.tolist() == [[t.data_ptr() + ((3 + i) * 10 + 2) * 4, 28] for i in range(17)]
    assert segments(t[5:9]).tolist() == [[t.data_ptr() + 50 * 4, 4 * 40]]  # whole rows: one run
    assert segments(t[0, 0]).tolist() == [[t.data_ptr(), 4]]  # 0-dim
    assert segments(t[3:3]).shape == (0, 2)
    assert strided_segments(1000, (), (), 8).tolist() == [[1000, 8]]
    with pytest.raises(ValueError, match="negative strides"):
        strided_segments(0, (2,), (-1,), 4)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU"):
            segments(t.cuda())


CHILD = """
import sys, numpy as np
a = np.random.default_rng(int(sys.argv[1])).standard_normal((300, 70)).astype(np.float32)
print(a.__array_interface__["data"][0], flush=True)
sys.stdin.readline()
"""


@pytest.fixture()
def child():
    """A child process holding seeded 300x70 float32 data; yields (pid, address, the same data rebuilt here)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "11"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        addr = int(proc.stdout.readline())
        yield proc.pid, addr, np.random.default_rng(11).standard_normal((300, 70)).astype(np.float32)
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=10)


def test_read_a_strided_region_of_another_process(child) -> None:
    pid, addr, want = child
    # remote: rows 10..290, columns 5..61 (56 runs of 56 elements each row); local: the transpose of
    # a wider buffer, so local runs are single elements (15680 of them: many IOV_MAX batches)
    region = (slice(10, 290), slice(5, 61))
    remote = strided_segments(addr + (10 * 70 + 5) * 4, (280, 56), (70, 1), 4)
    out = np.full((60, 300), -1.0, dtype=np.float32)
    local_view = out.T[:280, :56]
    local = segments(local_view)
    assert len(local) > 4 * IOV_MAX and len(remote) == 280
    assert read_process(pid, remote, local) == 280 * 56 * 4
    np.testing.assert_array_equal(local_view, want[region])
    assert (out[56:] == -1).all() and (out[:, 280:] == -1).all()  # nothing outside the view written


def test_runs_cut_differently_on_both_sides(child) -> None:
    pid, addr, want = child
    n = 300 * 70 * 4
    remote = [(addr + lo, min(12, n - lo)) for lo in range(0, n, 12)]  # 7000 runs of 12 bytes
    got = np.zeros(300 * 70, dtype=np.float32)
    base = got.__array_interface__["data"][0]
    local = [(base + lo, min(20, n - lo)) for lo in range(0, n, 20)]  # 4200 runs of 20 bytes
    assert read_process(pid, remote, local) == n
    np.testing.assert_array_equal(got.reshape(300, 70), want)


def test_coalesced_reads_skip_the_gaps_into_scratch(child) -> None:
    pid, addr, want = child
    rng = np.random.default_rng(3)
    for _ in range(40):
        # a random strided box of the child's 300x70 array, read into a random strided local view
        r0, c0 = int(rng.integers(0, 150)), int(rng.integers(0, 35))
        rs, cs = int(rng.integers(1, 4)), int(rng.integers(1, 3))
        rows, cols = int(rng.integers(1, (300 - r0) // rs + 1)), int(rng.integers(1, (70 - c0) // cs + 1))
        remote = strided_segments(addr + (r0 * 70 + c0) * 4, (rows, cols), (70 * rs, cs), 4)
        out = np.full((cols + 3, rows + 2), -1.0, dtype=np.float32)
        local_view = out.T[1 : rows + 1, :cols]
        spans, into = coalesce(remote, segments(local_view))
        # every gap of this box is under COALESCE_GAP bytes, so the whole box is one remote span
        assert len(spans) == 1 and int(spans[0, 1]) == int(remote[-1, 0] + remote[-1, 1] - remote[0, 0])
        read_process(pid, spans, into)
        np.testing.assert_array_equal(local_view, want[r0 : r0 + rows * rs : rs, c0 : c0 + cols * cs : cs])
        outside = np.ones(out.shape, dtype=bool)
        outside.T[1 : rows + 1, :cols] = False
        assert (out[outside] == -1).all()
        # and into a contiguous buffer (one local run: coalesce's short path)
        dense = np.full((rows + 1, cols), -1.0, dtype=np.float32)
        spans, into = coalesce(remote, segments(dense[:rows]))
        read_process(pid, spans, into)
        np.testing.assert_array_equal(dense[:rows], want[r0 : r0 + rows * rs : rs, c0 : c0 + cols * cs : cs])
        assert (dense[rows] == -1).all()


def test_coalesce_keeps_gaps_above_its_limit() -> None:
    remote = np.array([[1000, 8], [1016, 8], [1024 + 8 + COALESCE_GAP + 1, 8]], dtype=np.uint64)
    local = np.array([[50, 24]], dtype=np.uint64)
    spans, into = coalesce(remote, local)
    assert spans.tolist() == [[1000, 24], [1024 + 8 + COALESCE_GAP + 1, 8]]
    # the local stream: bytes 50..58, the 8-byte gap into scratch (outside the local buffer), then 58..74
    stream = [(int(a), int(b)) for a, b in into]
    assert stream[0] == (50, 8) and stream[1][1] == 8 and not 50 <= stream[1][0] < 74
    rest = stream[2:]
    assert rest[0][0] == 58 and sum(b for _, b in rest) == 16
    assert all(a1 + b1 == a2 for (a1, b1), (a2, _) in zip(rest, rest[1:]))
    assert coalesce(remote, local, max_gap=0)[0].tolist() == remote.tolist()


def test_a_read_cut_short_resumes_then_names_the_bad_address(child) -> None:
    pid, addr, want = child
    got = np.zeros(2 * 70, dtype=np.float32)
    base = got.__array_interface__["data"][0]
    # the first row is readable; the second remote run is at an address the child has not mapped,
    # so the kernel copies the first run and stops: the retry from there fails with EFAULT
    remote = [(addr, 280), (8, 280)]
    with pytest.raises(PeerReadError, match=f"pid {pid}.*not mapped") as info:
        read_process(pid, remote, [(base, 560)])
    assert info.value.errno == errno.EFAULT and not info.value.refused
    np.testing.assert_array_equal(got[:70], want[0])


def test_mismatched_totals_and_a_missing_process() -> None:
    a = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match="16 bytes but remote runs 12"):
        read_process(os.getpid(), [(a.ctypes.data, 12)], segments(a))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(PeerReadError, match="no such process") as info:
        read_process(dead.pid, [(a.ctypes.data, 16)], segments(a))
    assert info.value.errno == errno.ESRCH and info.value.refused
    assert read_process(os.getpid(), [], []) == 0


REFUSED_CHILD = """
import json, sys, numpy as np
from rankmesh.errors import PeerReadError
from rankmesh.peermem import read_process, segments
from tests.seccomp_filter import forbid_process_vm_readv
pid, addr = int(sys.argv[1]), int(sys.argv[2])
out = np.zeros(8, dtype=np.float32)
read_process(pid, [(addr, 32)], segments(out))   # allowed before the filter
before = out.tolist()
forbid_process_vm_readv()
try:
    read_process(pid, [(addr, 32)], segments(np.zeros(8, dtype=np.float32)))
    print(json.dumps({"before": before, "error": None}))
except PeerReadError as exc:
    print(json.dumps({"before": before, "errno": exc.errno, "refused": exc.refused, "error": str(exc)}))
"""


def test_a_refused_read_says_why_and_how() -> None:
    from tests.seccomp_filter import supported

    if not supported():
        pytest.skip("seccomp filter for this machine not written")
    data = np.arange(8, dtype=np.float32) + 0.5
    assert allow_peer_reads(os.getpid()) in (True, False)  # our descendants may read us; Yama absent: False
    proc = subprocess.run([sys.executable, "-c", REFUSED_CHILD, str(os.getpid()), str(data.ctypes.data)],
                          env=ENV, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["before"] == data.tolist()
    assert report["errno"] == errno.EPERM and report["refused"] is True
    assert f"pid {os.getpid()}" in report["error"] and "seccomp" in report["error"]


def test_namespace_id_is_shared_with_a_child() -> None:
    ours = namespace_id()
    assert ours is not None
    out = subprocess.run([sys.executable, "-c", "from rankmesh.peermem import namespace_id; print(list(namespace_id()))"],
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout) == list(ours)


def test_bfloat16_and_transposed_views_through_coalesced_reads() -> None:
    # torch views numpy cannot describe (bfloat16), a transposed source, a column block: read
    # from this very process (a real process_vm_readv of our own pid), checked with torch.equal
    src = torch.randn(40, 64).to(torch.bfloat16)
    dst = torch.zeros(64, 40, dtype=torch.bfloat16)
    for src_view, dst_view in [
        (src[:, 16:48], dst[:32].T),  # column block (short runs with gaps) into a transposed local view
        (src.T[8:24], dst[40:56]),  # a transposed source: runs of one element, out of address order
    ]:
        remote, local = coalesce(segments(src_view), segments(dst_view))
        assert read_process(os.getpid(), remote, local) >= src_view.numel() * 2
        assert torch.equal(dst_view, src_view)
    assert not dst[56:].any()


# --- Yama: a declared tracer admits itself and its descendants, no other process -------------------
# Real processes, with the kernel deciding: a source that declares a stand-in for the raylet as its
# tracer, one reader started by that stand-in and one started beside it, all three with the same
# unprivileged credentials (root, as on the test machines, passes Yama through CAP_SYS_PTRACE: so
# children of a root test drop to uid/gid 65534 after importing what they need).

NOBODY = 65534
YAMA = Path("/proc/sys/kernel/yama/ptrace_scope")


def _yama_scope() -> int | None:
    try:
        return int(YAMA.read_text())
    except (OSError, ValueError):
        return None


def _drop() -> str:
    """Code that leaves root for uid/gid 65534 (nothing when not root: no CAP_SYS_PTRACE to lose)."""
    return f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})" if os.geteuid() == 0 else ""


YAMA_SOURCE = """
import ctypes, json, os, sys
import numpy as np
from rankmesh.peermem import allow_peer_reads, available
available()  # load the C library while the files are still readable
data = np.arange(16, dtype=np.float64) * 1.5
{drop}
ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: changing uid cleared it
declared = allow_peer_reads(int(sys.argv[1]))
print(json.dumps({{"pid": os.getpid(), "addr": data.ctypes.data, "declared": declared, "uid": os.getuid()}}), flush=True)
sys.stdin.readline()  # keep the array until the readers are done
"""

YAMA_READER = """
import json, os, sys
import numpy as np
from rankmesh.errors import PeerReadError
from rankmesh.peermem import available, read_process, segments
available()
out = np.zeros(16, dtype=np.float64)
{drop}
try:
    read_process(int(sys.argv[1]), [(int(sys.argv[2]), out.nbytes)], segments(out))
    print(json.dumps({{"read": out.tolist(), "uid": os.getuid()}}))
except PeerReadError as exc:
    print(json.dumps({{"errno": exc.errno, "refused": exc.refused, "error": str(exc), "uid": os.getuid()}}))
"""

#: The raylet's stand-in: prints its pid, then runs the reader as its own child for "pid addr".
YAMA_TRACER = """
import os, subprocess, sys
print(os.getpid(), flush=True)
pid, addr = sys.stdin.readline().split()
out = subprocess.run([sys.executable, "-c", sys.argv[1], pid, addr], capture_output=True, text=True, timeout=60)
print(out.stdout.strip().splitlines()[-1] if out.returncode == 0 else "ERROR " + out.stderr[-2000:], flush=True)
sys.stdin.readline()
"""


def _reader_report(stdout: str) -> dict:
    assert not stdout.startswith("ERROR"), stdout
    return json.loads(stdout)


def test_only_the_declared_tracer_and_its_descendants_may_read() -> None:
    scope = _yama_scope()
    if scope is None:
        pytest.skip("Yama is not in this kernel (no /proc/sys/kernel/yama/ptrace_scope): PR_SET_PTRACER has no effect")
    if scope != 1:
        pytest.skip(f"Yama ptrace_scope is {scope}, not 1: a declared tracer admits nobody extra (0: everyone, 2/3: no one)")
    reader = YAMA_READER.format(drop=_drop())
    popen = dict(env=ENV, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tracer = subprocess.Popen([sys.executable, "-c", YAMA_TRACER, reader], **popen)
    source = None
    try:
        tracer_pid = int(tracer.stdout.readline())
        source = subprocess.Popen([sys.executable, "-c", YAMA_SOURCE.format(drop=_drop()), str(tracer_pid)], **popen)
        line = source.stdout.readline()
        assert line, source.stderr.read()
        src = json.loads(line)
        assert src["declared"] is True  # Yama accepted the tracer
        # inside the tracer's tree: the stand-in's own child
        tracer.stdin.write(f"{src['pid']} {src['addr']}\n")
        tracer.stdin.flush()
        inside = _reader_report(tracer.stdout.readline().strip())
        # outside it: a child of this test process, with the same credentials
        out = subprocess.run([sys.executable, "-c", reader, str(src["pid"]), str(src["addr"])],
                             env=ENV, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        outside = _reader_report(out.stdout.strip().splitlines()[-1])
    finally:
        for proc in (source, tracer):
            if proc is not None:
                proc.stdin.close()
                proc.wait(timeout=30)
    unprivileged = os.getuid() if os.geteuid() else NOBODY
    assert src["uid"] == inside["uid"] == outside["uid"] == unprivileged
    assert inside.get("read") == [1.5 * i for i in range(16)], inside
    assert outside.get("errno") == errno.EPERM and outside["refused"] is True, outside
    assert f"pid {src['pid']}" in outside["error"] and "PR_SET_PTRACER" in outside["error"]


def test_the_tracer_must_be_a_pid() -> None:
    for bad in (0, -1, None, "1", True):
        with pytest.raises(ValueError, match="tracer_pid"):
            allow_peer_reads(bad)  # type: ignore[arg-type]
