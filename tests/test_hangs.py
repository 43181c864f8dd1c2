"""The pure half of hang localization: naming a group by mesh axes, grouping ranks by place, the text.

No Ray: records are built by hand, and expected groups are derived by hand from megatron's order
(``tp-cp-ep-dp-pp``, first axis fastest).  One test captures a real thread of this process.
"""

from __future__ import annotations

import dataclasses

import pickle
import threading
import time

import pytest

from rankmesh.errors import FetchTimeoutError, HangError
from rankmesh.hangs import Collective, Frame, HangReport, ProcessStacks, RankHang, ThreadStack, capture_process, name_group
from rankmesh.hangs.capture import innermost_user_frame, is_library_file
from rankmesh.hangs.report import DEAD, NO_ANSWER, STUCK, group_by_place
from rankmesh.mesh import RankCoords, RankMesh


# ----- naming a process group by the mesh -----------------------------------------------------


def test_name_group_tp2_dp2():
    mesh = RankMesh(tp=2, dp=2)  # rank = tp + 2*dp
    assert name_group(mesh, [0, 2]) == "dp" and name_group(mesh, (3, 1)) == "dp"
    assert name_group(mesh, [0, 1]) == "tp" and name_group(mesh, [2, 3]) == "tp"
    assert name_group(mesh, [0, 1, 2, 3]) == "world"
    assert name_group(mesh, [0, 3]) == "unnamed"
    assert name_group(None, [0, 2]) == "unnamed"


def test_name_group_combinations_and_expert_view():
    mesh = RankMesh(tp=2, dp=2, pp=2)  # rank = tp + 2*dp + 4*pp
    assert name_group(mesh, [1, 5]) == "pp"  # tp1 dp0, pp varies
    assert name_group(mesh, [4, 6]) == "dp"  # tp0 pp1, dp varies
    assert name_group(mesh, [0, 1, 4, 5]) == "tp-pp"  # megatron's model-parallel group of rank 0
    assert name_group(mesh, [2, 3, 6, 7]) == "tp-pp"
    assert name_group(mesh, [0, 1, 2, 3]) == "tp-dp"
    moe = RankMesh(dp=4, ep=2)  # expert view: rank = ep + 2*edp
    assert name_group(moe, [0, 1]) == "ep" and name_group(moe, [2, 3]) == "ep"
    assert name_group(moe, [0, 2]) == "expert dp"
    assert name_group(moe, [0, 1, 2, 3]) == "world"


# ----- grouping and text ---------------------------------------------------------------------


def stacks(place: Frame | None, collective: Collective | None = None) -> ProcessStacks:
    frames = tuple(f for f in (place,) if f is not None) + (Frame("execute", "/x/rankmesh/backends/ray/host.py", 200),)
    if collective is not None:
        frames = (Frame(collective.op, "/t/torch/distributed/distributed_c10d.py", 3252),) + frames
    return ProcessStacks(1234, (ThreadStack(1, "Dummy-1", frames, call=True),), place, collective)


STEP = Frame("step", "/job/train.py", 40)
SLEEPER = Frame("wait_for_data", "/job/data.py", 12)


def report(after_s: float = 3.0) -> HangReport:
    # tp2 dp4 by hand (rank = tp + 2*dp): only the axes of size > 1 are shown.
    tp_dp = lambda r: RankCoords(tp=r % 2, dp=r // 2, shown=("tp", "dp"))  # noqa: E731
    hangs = (
        RankHang(1, tp_dp(1), "n0", STUCK, stacks(STEP, Collective("all_reduce", (1, 5), "dp"))),
        RankHang(2, tp_dp(2), "n0", STUCK, stacks(SLEEPER)),
        RankHang(3, tp_dp(3), "n1", STUCK, stacks(STEP, Collective("all_reduce", (3, 7), "dp"))),
        RankHang(6, tp_dp(6), "n1", DEAD, detail="The actor died unexpectedly"),
        RankHang(7, tp_dp(7), "n1", NO_ANSWER, detail="did not answer within 2 s"),
    )
    return HangReport("compute", after_s, hangs, finished=(0, 4, 5), gather_s=0.05)


def test_the_roots_of_a_hang_are_the_silent_ranks_and_those_stuck_in_their_own_code():
    """What on_hang="kill" kills (by hand from report()): rank 7 gave no answer (a stopped process)
    and rank 2 runs the call in user code; ranks 1 and 3 wait in an all-reduce (for someone else),
    rank 6 is dead already, and a rank not running the call (waiting for its turn) is no root."""
    idle = dataclasses.replace(stacks(None), busy=False)
    hangs = (*report().hangs, RankHang(8, None, "n1", STUCK, idle))
    assert HangReport("compute", 3.0, hangs, finished=(0,)).roots == [2, 7]
    waiting = tuple(h for h in report().hangs if h.rank in (1, 3)) + (RankHang(8, None, "n1", STUCK, idle),)
    assert HangReport("compute", 3.0, waiting, finished=(0,)).roots == []  # nobody to blame: nothing is killed


def test_ranks_at_one_place_are_grouped():
    places = group_by_place(report().hangs)
    assert [[h.rank for h in p] for p in places] == [[1, 3], [2], [6], [7]]
    # Same collective on the same axis but another user frame is another place.
    other = RankHang(9, None, None, STUCK, stacks(Frame("eval_step", "/job/train.py", 80), Collective("all_reduce", (9, 11), "dp")))
    assert [[h.rank for h in p] for p in group_by_place([*report().hangs, other])][0] == [1, 3]
    assert len(group_by_place([*report().hangs, other])) == 5


def test_report_text_names_ranks_coords_nodes_places_and_finished():
    text = report().text()
    lines = text.splitlines()
    assert lines[0] == "5 of 8 ranks unfinished after 3 s; where they are (asked in 0.05 s):"
    assert lines[1] == "  ranks 1, 3 (tp1 dp0, tp1 dp1) on nodes n0, n1: all_reduce on dp groups [1, 5], [3, 7] in step (/job/train.py:40)"
    assert "  rank 2 (tp0 dp1) on node n0: in wait_for_data (/job/data.py:12)" in lines
    assert "  rank 6 (tp0 dp3) on node n1: process dead (The actor died unexpectedly)" in lines
    assert "  rank 7 (tp1 dp3) on node n1: no stacks (did not answer within 2 s)" in lines
    assert lines[-1] == "  finished: ranks 0, 4, 5"
    assert "      step (/job/train.py:40)" in lines  # the stack, innermost first, out to the user's frame
    assert report().dead == [6] and report().unfinished == [1, 2, 3, 6, 7]
    # tp2 cp2 dp2 pp2, rank = tp + 2*cp + 4*dp + 8*pp: rank 5 is tp1 cp0 dp1 pp0.
    assert RankMesh(tp=2, cp=2, dp=2, pp=2).rank_coords(5).label() == "tp1 cp0 dp1 pp0"


def test_one_collective_reads_like_the_issue():
    c = Collective("all_reduce", (1, 3), "dp")
    assert str(c) == "all_reduce on dp group [1, 3]"
    assert str(Collective("barrier", (0, 1, 2, 3), "world")) == "barrier on world group [0, 1, 2, 3]"
    assert str(Collective("recv", (0, 4), "pp", peer=4)) == "recv on pp group [0, 4] (peer rank 4)"


def test_hang_error_is_a_fetch_timeout_and_pickles():
    r = report()
    err = HangError("compute", [1, 2, 3, 6, 7], 3.0, r)
    assert isinstance(err, FetchTimeoutError) and isinstance(err, TimeoutError)
    assert str(err).splitlines()[0] == "compute: ranks [1, 2, 3, 6, 7] did not finish within 3 s"
    assert str(err).splitlines()[1:] == r.text().splitlines()
    assert err.finished == [0, 4, 5] and [h.rank for h in err.hangs] == [1, 2, 3, 6, 7]
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.report == r and again.ranks == err.ranks


# ----- capturing this process ------------------------------------------------------------------


def blocked_here(event: threading.Event) -> None:
    event.wait(10)


def test_capture_finds_a_blocked_thread_and_its_function():
    event = threading.Event()
    thread = threading.Thread(target=blocked_here, args=(event,), name="blocked")
    thread.start()
    try:
        time.sleep(0.05)
        got = capture_process(thread.ident)
    finally:
        event.set()
        thread.join()
    call = got.threads[0]
    assert call.call and call.name == "blocked" and got.busy
    assert got.place.function == "blocked_here" and got.place.file == __file__
    assert call.frames[0].function == "wait"  # innermost first: threading's wait, then the caller
    assert got.collective is None
    assert threading.get_ident() not in [t.ident for t in got.threads]  # the asking thread is left out
    idle = capture_process(None)
    assert not idle.busy and idle.place is None


def test_library_frames_are_not_user_frames():
    assert is_library_file(threading.__file__) and is_library_file(pytest.__file__) is False
    assert is_library_file("<frozen importlib._bootstrap>")
    frames = (Frame("wait", threading.__file__, 300), Frame("mine", __file__, 10))
    assert innermost_user_frame(frames) == frames[1]


def test_demo_refuses_a_hang_rank_outside_the_actor_group(capsys):
    from rankmesh.cli import main

    assert main(["demo", "--hang-rank", "8", "--no-progress"]) == 2  # the demo's actor is tp2·pp2·dp2: 8 ranks
    assert "--hang-rank 8 is not a rank of the actor group (ranks 0..7)" in capsys.readouterr().err
