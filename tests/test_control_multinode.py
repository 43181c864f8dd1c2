"""Node agents on a simulated multi-node cluster: one Ray task per node per call, both control paths.

The scenarios run in the shared simulated cluster's driver process (``simulated_cluster``,
tests/drivers.py), which returns one JSON report.  One 6-rank group spans ``node_a`` (4 ranks)
and ``node_c`` (2 ranks); the driver sits on the CPU-less head, so no rank shares its node and
every rank is served by its node's agent.  The same scenarios run with the agents in a tree
(``agent_fanout=1``: the controller sends to ``node_a``'s agent, which forwards ``node_c``'s share),
and with ``RANKMESH_CONTROL=ray``.  Which path a call took is read from the workers (the thread
that ran it), not from the group.
"""

from __future__ import annotations

import pytest

PATHS = ("agent", "tree", "ray")


def scenarios(cluster) -> dict:
    """Runs inside the driver process: every scenario on both paths, one report."""
    import gc
    import os
    import threading
    import time

    import ray

    import torch

    import rankmesh
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.backends.ray.agent import subtree
    from rankmesh.backends.ray.tasks import output_refs
    from rankmesh.data import DataProto
    from rankmesh.errors import AgentLostError, FetchTimeoutError, HangError, WorkerDiedError, WorkerError
    from rankmesh.mesh import RankMesh
    from tests.control_workers import TP2, ControlWorker, kill_after

    report: dict = {}
    # One group for the three paths (each ends by replacing a killed rank): it starts on Ray's
    # tasks, then takes the agents, flat and then in a tree.
    os.environ["RANKMESH_CONTROL"] = "ray"
    wg = RayWorkerGroup(RayResourcePool([4, 2], use_gpu=False), RayClassWithInitArgs(ControlWorker),
                        meshes={TP2: RankMesh(tp=2, dp=3)}, on_rank_death="keep")
    os.environ.pop("RANKMESH_CONTROL")
    for path in ("ray", "agent", "tree"):
        if path != "ray":
            wg.set_control("auto", agent_fanout=1 if path == "tree" else None)
        wg.history()  # what the previous path ran
        got: dict = {}
        got["echo"] = wg.echo("x")
        got["tops"] = len(getattr(wg._executor.session, "tops", []))
        got["threads"] = [sorted({t for _, _, t in log}) for log in wg.history()]
        got["paths"] = wg._executor.control_paths()
        got["agents"] = len(getattr(wg._executor.session, "agents", {}))
        got["nodes"] = len({i["node_id"] for i in wg._hosts.info})
        got["per_rank"] = wg.per_rank([1, 2, 3, 4, 5, 6])
        # Twice: the first call of a selection carries its plans to the agents, the second its key alone.
        got["shifted"] = [wg.shifted([10, 20, 30, 40, 50, 60]) for _ in range(2)]
        # Calls that carry no tensor leave the agents of forked ranks without torch (read from each
        # agent's mappings).  A Ray actor's handle imports its class's module (rankmesh's host, and
        # torch with it) in every process that unpickles it, an agent included.
        got["agents_with_torch"] = []
        for agent in getattr(wg._executor.session, "agents", {}).values() if wg._hosts.forking is not None else ():
            with open(f"/proc/{ray.get(agent.pid.remote(), timeout=30)}/maps") as maps:
                got["agents_with_torch"].append("libtorch" in maps.read())
        got["forked"] = wg._hosts.forking is not None
        # Data calls: a batch split by dp, and a future handed to the next call (the agents fetch neither).
        before = dict(wg._executor.stats.by_carrier)
        batch = DataProto.from_dict({"x": torch.arange(6)})
        got["rows"] = wg.rows_now(batch).batch["y"].tolist()
        got["total"] = wg.total(wg.rows_later(batch))
        got["data_carriers"] = {k: v - before.get(k, 0) for k, v in wg._executor.stats.by_carrier.items()
                                if v != before.get(k, 0)}
        # A non-blocking call's handles are ObjectRefs of the ranks' outputs (what verl's execute_all_async
        # gives), and its ranks' errors come back through them, naming the rank.
        before = dict(wg._executor.stats.by_carrier)
        handles = output_refs(wg.slow_append("handles", 0.0).handles)  # as the verl layer's execute_all_async
        got["handles"] = [type(h).__name__ for h in handles]
        got["handle_values"] = ray.get(handles, timeout=60)
        try:
            wg.slow_append("bad", "not seconds").get()
            got["future_error"] = None
        except WorkerError as exc:
            got["future_error"] = {"rank": exc.rank, "text": str(exc)}
        got["future_carriers"] = {k: v - before.get(k, 0) for k, v in wg._executor.stats.by_carrier.items()
                                  if v != before.get(k, 0)}
        # An unread non-blocking call whose future reads every rank's output: the references the
        # controller holds for it (the entries new in Ray's reference table in this process).
        core = ray._private.worker.global_worker.core_worker
        gc.collect()
        held = set(core.get_all_reference_counts())
        unread_every = wg.slow_append("counted", 0.0)
        got["every_refs"] = len(set(core.get_all_reference_counts()) - held)
        got["every_values"] = unread_every.get()
        del unread_every
        # Outputs over Ray's inline size stay in their ranks' stores; the joined answer names them.
        got["every_big"] = [[len(b), b[0], b[-1]] for b in wg.call_ranks("big", [(200_000,)] * 6, blocking=False).get()]
        # rankmesh.wait asks about the joined answers (one per top agent), not about each rank.
        waited = wg.slow_append("waited", 1.0)
        got["waits"] = len(waited.waits)
        got["wait_running"] = len(rankmesh.wait([waited], timeout=0.2)[0])
        got["wait_finished"] = len(rankmesh.wait([waited], timeout=60)[0])
        got["waited_values"] = waited.get()
        # Its get() past its timeout: the ranks still running are named, and the next call queues behind them.
        try:
            wg.slow_append("late", 1.5).get(timeout=0.5)
            got["future_hang"] = None
        except FetchTimeoutError as exc:
            got["future_hang"] = sorted(exc.ranks)
        got["after_future_hang"] = wg.echo("after late")
        # A non-blocking call over tp2 x dp3 whose future reads the collect ranks (tp0) alone: the agents
        # send back their references only (counted in tests/test_bench_control_scale.py); every rank runs it.
        wg.history()
        got["tp2_rows"] = wg.rows_tp2_later(DataProto.from_dict({"x": torch.arange(6)})).get().batch["y"].tolist()
        got["tp2_ran"] = [[v for m, v, _ in log if m == "rows_tp2_later"] for log in wg.history()]
        # One piece read by every rank (four on one node), each writing into it: nobody sees another's write.
        got["scribble"] = wg.scribble(DataProto.from_dict({"x": torch.tensor([100, 200])}))
        # A data call's failure names its rank; one past its deadline is a HangError, and the next
        # call (inline) queues behind it on those ranks.
        try:
            wg.rows_fail_on(DataProto.from_dict({"x": torch.tensor([3])}))
        except WorkerError as exc:
            got["data_error"] = {"rank": exc.rank, "text": str(exc)}
        wg.history()
        try:
            wg.with_timeout(1.0).rows_nap(DataProto.from_dict({"x": torch.tensor([2.5])}))
            got["data_hang"] = None
        except HangError as exc:
            got["data_hang"] = sorted(exc.ranks)
        got["after_data_hang"] = wg.echo("after")
        got["after_data_hang_order"] = [[m for m, _, _ in log] for log in wg.history()]
        # Nothing of a data call stays referenced by the controller once it returned.
        gc.collect()
        held = len(core.get_all_reference_counts())
        for _ in range(3):
            wg.rows_now(batch)
            wg.total(wg.rows_later(batch))  # a future handed along: its refs travel under Ray's serialization
        end = time.monotonic() + 10
        while True:
            gc.collect()
            got["refs_left"] = len(core.get_all_reference_counts()) - held
            if got["refs_left"] <= 0 or time.monotonic() > end:
                break
            time.sleep(0.2)
        wg.history()
        future = wg.slow_append("first", 0.3)
        wg.echo("second")
        future.get()
        got["order"] = [[(m, v) for m, v, _ in log] for log in wg.history()]
        try:
            wg.fail_on(4)
        except WorkerError as exc:
            got["error"] = {"rank": exc.rank, "text": str(exc)}
        got["after_error"] = wg.echo(1)
        # A call too big for a ring slot takes Ray's tasks, through agents as on one node (one size rule).
        wg.history()
        got["big"] = wg.call_ranks("count_args", [tuple(range(300_000))] * 6)
        got["big_threads"] = [sorted({t for _, _, t in log}) for log in wg.history()]
        if path != "ray":
            # Two threads calling the group through the agents: each gets its own answers.
            answers: dict[int, list] = {0: [], 1: []}

            def caller(tid: int) -> None:
                for i in range(15):
                    answers[tid].append(wg.echo(f"{tid}-{i}"))

            callers = [threading.Thread(target=caller, args=(t,)) for t in (0, 1)]
            for t in callers:
                t.start()
            for t in callers:
                t.join(120)
            got["threads_ok"] = all(answers[t] == [[f"{t}-{i}"] * 6 for i in range(15)] for t in (0, 1))
            # The top agent dies during a call while every rank lives: its ranks are not declared dead.
            session = wg.executor.session
            top = session.tops[0]
            served = sorted(r for n in subtree(top, session.children) for r in session.by_node[n])
            agent = session.agents[top]
            threading.Timer(0.5, lambda: ray.kill(agent, no_restart=True)).start()
            try:
                wg.sleep(2.0)
                got["agent_lost"] = {"type": None}
            except (AgentLostError, WorkerDiedError) as exc:
                got["agent_lost"] = {"type": type(exc).__name__, "ranks": exc.ranks, "served": served, "text": str(exc)}
            got["usable"] = wg.failed is None
            got["after_agent_lost"] = wg.echo("again")
            # A future still unread when the agents are replaced (a new tree here; a recovery does the
            # same): its outputs' owners, the old agents, are kept until the next replacement.
            fanout = wg.executor.agent_fanout
            wide = DataProto.from_dict({"x": torch.arange(6).unsqueeze(1).repeat(1, 20_000)})  # 160 KB a row: stored
            unread = wg.rows_later(wide)
            time.sleep(0.5)  # let the ranks finish: the outputs exist before their owners could go
            wg.set_control("auto", agent_fanout=fanout + 1)
            got["new_agents"] = wg.echo("new tree")
            try:
                got["future_after_new_agents"] = unread.get().batch["y"][:, 0].tolist()
            except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                got["future_after_new_agents"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            # Unread across two changes whose agents each sent non-blocking calls: every set of agents
            # that owns an output somebody still references is kept, however many changes later.
            unread = wg.rows_later(wide)
            time.sleep(0.5)
            wg.set_control("auto", agent_fanout=fanout + 2)
            wg.slow_append("from the second agents", 0.0).get()  # these agents own outputs too
            wg.set_control("auto", agent_fanout=fanout + 3)
            got["kept_while_unread"] = wg.executor.kept_agents
            try:
                got["future_after_two_changes"] = unread.get().batch["y"][:, 0].tolist()
            except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                got["future_after_two_changes"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            wg.echo("third agents")
            # Once nothing references their outputs, the kept agents end at the next change.
            del unread, future, handles
            gc.collect()
            time.sleep(1.0)  # the owners hear of the dropped references
            wg.set_control("auto", agent_fanout=fanout)
            wg.echo("agents back")  # started again before the timed kill below
            got["kept_once_dropped"] = wg.executor.kept_agents
            # A kept agent that dies (its node's crash, say) loses the outputs it owns, but not its
            # ranks: reading the future says so, and the group stays usable.
            orphan = wg.rows_later(wide)
            orphan_every = wg.slow_append("orphan", 0.0)  # a future of every rank's output, joined by its agents
            time.sleep(0.5)
            wg.set_control("auto", agent_fanout=fanout + 1)
            wg.echo("after orphan")
            for kept in wg.executor._retired:
                for agent in kept.agents.values():
                    ray.kill(agent, no_restart=True)
            # A read right after the kill may still find the outputs (measured: at 0.5 s it did, at 2 s
            # Ray had freed them and raised OwnerDiedError): nothing is lost until Ray has seen the owner die.
            time.sleep(3.0)
            try:
                orphan.get()
                got["orphan"] = {"type": None}
            except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                got["orphan"] = {"type": type(exc).__name__, "ranks": getattr(exc, "ranks", None), "text": str(exc)}
            try:
                got["orphan_every"] = {"type": None, "values": orphan_every.get()}
            except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                got["orphan_every"] = {"type": type(exc).__name__, "ranks": getattr(exc, "ranks", None), "text": str(exc)}
            del orphan, orphan_every
            got["usable_after_orphan"] = wg.failed is None
            got["after_orphan"] = wg.echo("after orphan read")
            wg.set_control("auto", agent_fanout=fanout)
            wg.echo("agents back again")
        agents = {node: agent._actor_id.hex() for node, agent in getattr(wg.executor.session, "agents", {}).items()}
        killed = kill_after(wg._hosts.info[5]["pid"], 0.5)
        try:  # rank 5 would sleep 20 s, the others 3 s: the replacement's drain waits for them
            wg.call_ranks("sleep", [(3.0,)] * 5 + [(20.0,)])
        except WorkerDiedError as exc:
            got["died"] = {"ranks": exc.ranks, "after_s": time.monotonic() - killed["at"]}
        # The dead rank replaced by a new process: the next call's session takes over the node
        # agents the death retired (both nodes keep ranks), rather than starting new ones.
        wg.replace_dead_ranks()
        got["after_replacement"] = wg.echo("replaced")
        got["agents_before"] = agents
        got["agents_after"] = {node: agent._actor_id.hex()
                               for node, agent in getattr(wg.executor.session, "agents", {}).items()}
        report[path] = got
    wg.shutdown()
    return report


@pytest.fixture(scope="module")
def report(simulated_cluster) -> dict:
    return simulated_cluster.run("tests.test_control_multinode:scenarios")


@pytest.mark.parametrize("path", PATHS)
def test_a_group_across_nodes_runs_every_call_on_both_paths(report, path):
    got = report[path]
    assert got["echo"] == ["x"] * 6
    assert got["nodes"] == 2
    assert got["paths"] == ["ray" if path == "ray" else "agent"] * 6
    assert got["agents"] == (0 if path == "ray" else 2)
    assert got["tops"] == {"agent": 2, "tree": 1, "ray": 0}[path]  # agents the controller sends to
    session_thread = [["rankmesh-session"]] * 6
    assert (got["threads"] == session_thread) == (path != "ray")
    assert got["per_rank"] == [10, 21, 32, 43, 54, 65]  # value * 10 + rank, by hand
    assert got["shifted"] == [[10, 21, 32, 43, 54, 65]] * 2  # the dp rank's value + rank, by hand, both calls
    # A node agent of forked ranks loads torch only to read a tensor.
    assert got["agents_with_torch"] == ([False] * got["agents"] if got["forked"] else [])
    assert got["rows"] == [0, 11, 22, 33, 44, 55]  # row x = rank: x * 10 + rank, by hand
    assert got["total"] == [[0, 11, 22, 33, 44, 55]] * 6  # every rank fetched the future's rows itself
    # Blocking and non-blocking data calls take the agents (a non-blocking call's outputs are ObjectRefs
    # its agents own), or Ray's tasks on the ray path.
    assert got["data_carriers"] == ({"ray": 3} if path == "ray" else {"agent": 3})
    assert got["future_carriers"] == ({"ray": 2} if path == "ray" else {"agent": 2})
    assert got["handles"] == ["ObjectRef"] * 6 and got["handle_values"] == [None] * 6
    # Unread, a future of every rank's output costs the controller one reference per rank on Ray's
    # tasks (it owns each task's return), and through the agents two per top agent (its subtree's
    # answer, joined once every rank finished, and where each rank's output is), whatever the ranks.
    assert got["every_refs"] == (6 if path == "ray" else 2 * got["tops"])
    assert got["every_values"] == [None] * 6
    assert got["every_big"] == [[200_000, r, r] for r in range(6)]  # rank r's bytes are all r, by hand
    assert got["waits"] == (6 if path == "ray" else got["tops"])
    assert (got["wait_running"], got["wait_finished"], got["waited_values"]) == (0, 1, [None] * 6)
    assert got["future_hang"] == list(range(6)) and got["after_future_hang"] == ["after late"] * 6
    # tp2 x dp3, ranks tp-fastest: dp replica d is ranks 2d, 2d + 1 with rows 2d, 2d + 1; tp0 answers.
    assert got["tp2_rows"] == [0, 10, 22, 32, 44, 54]  # x * 10 + rank of ranks 0, 2, 4, by hand
    assert got["tp2_ran"] == [[2]] * 6  # two rows per dp replica, on both of its tp ranks
    assert got["future_error"]["rank"] == 0 and "cannot be interpreted as an integer" in got["future_error"]["text"]
    assert got["scribble"] == [[100 + r + 1, 200 + r + 1] for r in range(6)]  # copy-on-write: each rank its own write
    assert got["refs_left"] <= 0  # nothing pinned
    assert got["data_error"]["rank"] == 3 and "rank 3 refuses the batch" in got["data_error"]["text"]
    assert got["data_hang"] == list(range(6))
    assert got["after_data_hang"] == ["after"] * 6
    assert got["after_data_hang_order"] == [["rows_nap", "echo"]] * 6  # the abandoned call first, then the next
    assert got["order"] == [[["slow", "first"], ["echo", "second"]]] * 6  # JSON turns tuples into lists
    assert got["error"]["rank"] == 4 and "rank 4 refuses" in got["error"]["text"]
    assert got["after_error"] == [1] * 6


@pytest.mark.parametrize("path", ["agent", "tree"])
def test_a_future_outlives_the_agents_that_sent_its_call(report, path):
    """Expected by hand: rows_later gives x * 10 + rank, one row per rank (dp=6); each output is
    over Ray's inline size, so it lives in its rank's node's store, owned by the agent that sent it."""
    got = report[path]
    assert got["new_agents"] == ["new tree"] * 6
    assert got["future_after_new_agents"] == [0, 11, 22, 33, 44, 55]
    assert got["future_after_two_changes"] == [0, 11, 22, 33, 44, 55]
    # Kept: the agents that sent the unread call, and the ones after them (their outputs were read but
    # are still referenced by the test's own earlier futures until it drops them).
    assert got["kept_while_unread"] >= 1
    assert got["kept_once_dropped"] == 0
    # Killed while a future it owns is unread: every rank lives, so this is no rank's death.
    assert got["orphan"]["type"] == "AgentLostError", got["orphan"]
    assert got["orphan"]["ranks"] == [0, 1, 2, 3, 4, 5]
    assert "lost with its owner" in got["orphan"]["text"] and "the rank lives" in got["orphan"]["text"]
    # The same for a future of every rank's output, which its agents joined: unless the controller
    # already holds the (small) outputs, which Ray may have handed it while it waited on them.
    every = got["orphan_every"]
    if every["type"] is None:
        assert every["values"] == [None] * 6, every
    else:
        assert every["type"] == "AgentLostError" and every["ranks"] == [0, 1, 2, 3, 4, 5], every
        assert "lost with its owner" in every["text"], every
    assert got["usable_after_orphan"] is True
    assert got["after_orphan"] == ["after orphan read"] * 6


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_killed_on_another_node_is_named_within_two_seconds(report, path):
    """The agent sees the rank's pidfd at once; Ray's own detection (the fallback) may take longer."""
    died = report[path]["died"]
    assert died["ranks"] == [5]
    assert died["after_s"] < (10.0 if path == "ray" else 2.0)


@pytest.mark.parametrize("path", PATHS)
def test_a_replaced_rank_is_served_by_the_node_agents_that_served_its_group_before(report, path):
    """A replacement keeps both nodes, so the session after it takes over the agents the death
    retired (a new agent is a new Ray worker process: seconds the call after a replacement
    would wait); on Ray's path there are none."""
    got = report[path]
    assert got["after_replacement"] == ["replaced"] * 6
    assert len(got["agents_before"]) == (0 if path == "ray" else 2)
    assert got["agents_after"] == got["agents_before"]


@pytest.mark.parametrize("path", PATHS)
def test_a_call_too_big_for_a_ring_slot_takes_rays_tasks_on_every_path(report, path):
    """T1: the same size rule on one node and through agents: 1.5 MB of arguments take Ray's tasks."""
    got = report[path]
    assert got["big"] == [300_000] * 6
    assert all("rankmesh-session" not in threads for threads in got["big_threads"])


@pytest.mark.parametrize("path", ("agent", "tree"))
def test_two_threads_calling_one_group_across_nodes_get_their_own_answers(report, path):
    """T6, through the agents."""
    assert report[path]["threads_ok"]


@pytest.mark.parametrize("path", ("agent", "tree"))
def test_a_dead_top_agent_is_blamed_on_the_ranks_it_served_which_live(report, path):
    """A top agent killed mid-call: the ranks of its subtree (its own node's, flat; all six in the tree)
    are alive, so the error is AgentLostError naming exactly them, no rank is declared dead, and the next
    call starts new agents."""
    got = report[path]
    lost = got["agent_lost"]
    assert lost["type"] == "AgentLostError", lost
    assert lost["ranks"] == lost["served"], lost
    assert len(lost["served"]) in ((2, 4) if path == "agent" else (6,)), lost  # one node of [4, 2], or the whole tree
    assert got["usable"] and got["after_agent_lost"] == ["again"] * 6


def test_the_agent_tree_is_breadth_first_with_fanout_children_each():
    """Hand-derived: 7 nodes, fanout 2 -> tops a, b; a: c, d; b: e, f; c: g."""
    from rankmesh.backends.ray.agent import agent_tree, subtree

    tops, children = agent_tree(list("abcdefg"), 2)
    assert tops == ["a", "b"]
    assert children == {"a": ["c", "d"], "b": ["e", "f"], "c": ["g"], "d": [], "e": [], "f": [], "g": []}
    assert subtree("a", children) == ["a", "c", "d", "g"] and subtree("b", children) == ["b", "e", "f"]
    assert agent_tree(list("abc"), 8) == (["a", "b", "c"], {"a": [], "b": [], "c": []})  # flat
    with pytest.raises(ValueError, match="fanout"):
        agent_tree(["a"], 0)
