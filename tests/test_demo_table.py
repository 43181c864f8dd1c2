"""The demo's terminal output without Ray: the table fits 120 columns, its legend and footer match the
mode, a redirected stdout hears of the start-up at once, and nothing lands on the progress bar's line.

Expected values are written by hand from what a reader of a 120-column terminal must see, not from
the code under test.
"""

from __future__ import annotations

import io
import logging
import sys

import pytest

from rankmesh.demo import (
    DemoConfig,
    DemoResult,
    IterationStats,
    format_summary,
    _table_header,
    _table_row,
)
from rankmesh.demo_async import AsyncTally

PHASES = ("gen", "logp", "ref", "values", "adv", "upd_actor", "upd_critic", "refit", "total")


def stats(iteration: int = 0, rollout_diff: float = 2.6e-06, seconds: float = 0.128, **values: float) -> IterationStats:
    """A row of the table as the demo measures it (the defaults: the first synchronous iteration)."""
    fields = dict(actor_loss=-2.515e-08, critic_loss=0.05935, score=0.273, kl=0.0, logprob_diff=1.9e-06, ref_diff=0.0,
                  actor_loss_after=-1.031e-01, critic_loss_after=0.04357)
    fields.update(values)
    return IterationStats(iteration=iteration, rollout_diff=rollout_diff, times={p: seconds for p in PHASES}, **fields)


#: The widest values a run can show: a thousandth iteration, losses and a kl of either sign in the
#: tens, a reward of 1, a 10-minute phase (a hang's timeout) in a 40-minute iteration.
EXTREME = stats(iteration=999, actor_loss=-12.345678, actor_loss_after=-98.7654, critic_loss=123.456,
                critic_loss_after=99.99, score=1.0, kl=-12.3456, logprob_diff=0.0, rollout_diff=9.99e-99,
                seconds=600.0)
EXTREME.times["total"] = 2400.0


@pytest.mark.parametrize("row", [stats(), EXTREME], ids=["typical", "extreme"])
def test_a_row_fits_a_120_column_terminal(row):
    line = _table_row(row)
    assert len(line) <= 120, f"{len(line)} columns: {line!r}"


@pytest.mark.parametrize("staleness", [None, 1])
def test_header_legend_and_rows_fit_120_columns_and_line_up(staleness):
    header = _table_header(DemoConfig(async_staleness=staleness)).splitlines()
    assert all(len(line) <= 120 for line in header), max(header, key=len)
    # Every row is as wide as the header's last line, whatever its values: the columns line up.
    assert len(_table_row(stats())) == len(_table_row(EXTREME)) == len(header[-1])


def test_a_column_that_does_not_apply_shows_a_dash_and_the_async_legend_says_why():
    # Asynchronously, a batch may hold no row the trained weights made: roll diff does not apply.
    row = _table_row(stats(iteration=1, rollout_diff=float("nan")))
    assert "nan" not in row
    assert row.split()[8] == "-"  # iter, actor loss before/after, critic loss before/after, score, kl, logp diff, roll diff
    legend = _table_header(DemoConfig(async_staleness=1))
    assert '"-" if the batch holds none' in " ".join(legend.split())


def test_the_legend_matches_the_mode():
    sync = " ".join(_table_header(DemoConfig()).split())
    asynchronous = " ".join(_table_header(DemoConfig(async_staleness=1)).split())
    # Synchronously the loss after the update is seen through the refit rollout and starts at ratio 1;
    # with --async-staleness neither holds: the rollout is refit replica by replica, rows are older.
    for claim in ("from the refit rollout's log-probs", "the ratio starts at 1"):
        assert claim in sync
        assert claim not in asynchronous
    assert "from the actor's log-probs" in asynchronous
    assert "logp diff: max |actor log-prob" in sync and "logp diff: max |actor log-prob" in asynchronous


def result(staleness: int | None) -> DemoResult:
    its = [stats(0), stats(1, rollout_diff=float("nan") if staleness else 1.9e-06)]
    tally = None if staleness is None else AsyncTally(staleness, rows_generated=64, rows_trained=64, lags=[0, 1],
                                                       max_lag=1, refit_bytes=[84992] * 4)
    return DemoResult(DemoConfig(iterations=2, async_staleness=staleness), rollout_replicas=4, refit_bytes=[339968] * 2,
                      refit_minimum_bytes=339968, final_rollout_diff=1.4e-06, iterations=its, asynchronous=tally,
                      logprob_max_diff=1.9e-06, final_logprob_max_diff=1.4e-06, replica_max_diff=0.0,
                      final_weights_sha256="5fde9ed3073c5da2")


def test_the_footer_says_on_policy_only_when_it_is():
    assert "(on-policy)" in format_summary(result(None))
    summary = format_summary(result(1))
    assert "on-policy" not in summary
    assert "nan" not in summary  # the rollout's max diff is over the rows where it applies
    assert "max diff 2.6e-06" in summary


def test_a_redirected_stdout_hears_of_the_start_up_before_it_begins(monkeypatch):
    """Start-up takes most of a run (a minute on 2 cores): a log must not sit empty through it."""
    import rankmesh.backends.ray.runtime as runtime
    from rankmesh.demo import run_demo

    class Stop(Exception):
        pass

    def no_ray(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(runtime, "ensure_ray", no_ray)
    out = io.StringIO()  # not a terminal
    with pytest.raises(Stop):
        run_demo(DemoConfig(progress=False), out)
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("starting the groups"), lines
    # cpu_demo: actor+ref tp2·pp2·dp2, critic tp2·dp2, rollout dp4.
    assert "actor+ref: 8 ranks, critic: 4, rollout: 4" in lines[0]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_counts_iterations_and_gives_no_eta_during_start_up():
    from rankmesh.demo import _progress_bar

    screen = Terminal()
    bar = _progress_bar(DemoConfig(iterations=4), screen)
    shown = str(bar)
    assert "<" not in shown and "/s" not in shown and "/4" not in shown, shown  # no ETA, rate or count yet
    bar.start_iterations()
    bar.update(1)
    shown = str(bar)
    assert "1/4" in shown, shown  # the start-up is not one of the steps
    bar.close()


def test_while_the_bar_is_live_log_records_go_above_it(monkeypatch):
    """A line written onto the bar's line would start after the bar's text; tqdm.write clears it first."""
    from rankmesh.demo import _progress_bar

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    handler = logging.StreamHandler(sys.stderr)  # as the rankmesh command installs it
    log = logging.getLogger("rankmesh")
    monkeypatch.setattr(log, "handlers", [handler])
    monkeypatch.setattr(log, "propagate", False)
    bar = _progress_bar(DemoConfig(iterations=4), screen)
    logging.getLogger("rankmesh.backends.ray.group").warning("update_actor: replaced ranks [5]")
    bar.close()
    text = screen.getvalue()
    # The line begins where the bar was cleared (a carriage return), not after the bar's text.
    assert "\rupdate_actor: replaced ranks [5]\n" in text, repr(text)
    assert handler.stream is screen  # put back as it was


def test_the_summary_counts_a_handled_rank_death_without_repeating_its_report():
    """The group's warning gave the replacement's time split when it happened; the summary only counts it."""
    killed = result(None)
    killed.config.kill_rank, killed.config.kill_at_iteration = 5, 2
    killed.replacements = [dict(ranks=[5], peers={5: 7}, coords={}, old_nodes={5: "127.0.0.1"}, new_nodes={5: "127.0.0.1"},
                                moved={5: False}, stuck=[], from_spares=[], spare_paid={}, new_pids={5: 11170},
                                detected_s=0.64, drain_s=1.40, start_s=1.94, import_s=3.10, init_s=0.17, restore_s=0.05,
                                check_s=0.04, total_s=6.70)]
    lines = [line for line in format_summary(killed).splitlines() if "[5]" in line or "rank 5" in line]
    assert lines == ["rank deaths handled: 1 (--kill-rank 5 in iteration 2): ranks [5] replaced in place in 6.70s, "
                     "update_actor retried"]
