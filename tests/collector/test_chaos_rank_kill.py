"""Ranks killed -9 mid-step (the short form of `tracetop bench chaos --scenario rank-kill`): one
real 4-rank reference-trainer run on gloo, each rank its own process; ranks 1 and 3 ship through a
real node agent (its disk spool), ranks 0 and 2 straight to a real collector; rank 1 (agent) and
rank 2 (direct) SIGKILL themselves in the middle of the same step. Ground truths: the injected
step, the trainer's own per-rank step logs (the steps each rank completed), the kills' exit
signal, and the ingest log's seqs."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.bench.chaos import rank_kill_held
from collector.bench.rank_kill import rank_kill

pytestmark = pytest.mark.slow

KILLED, KILL_STEP = (1, 2), 15


def test_ranks_killed_mid_step_direct_and_through_the_agent(tmp_path: Path) -> None:
    r = rank_kill(tmp_path, via="mixed", nproc=4, steps=20, kill_step=KILL_STEP, kill_ranks=KILLED,
                  baseline=False, heartbeat_s=0.2)  # several heartbeats before the kill, even on a quiet machine
    print(r)
    assert {r["killed"][k]["ships_via"] for k in KILLED} == {"agent", "direct"}
    for k in KILLED:
        kr = r["killed"][k]
        assert kr["by_sigkill"] and kr["kill_seen_at_step"] == KILL_STEP, r
        assert kr["steps_done"] == KILL_STEP  # steps 0..KILL_STEP-1 completed, then the kill mid-step
        # what it handed on is stored once, and that is a prefix of its steps (it ships in order)
        assert kr["stored_is_prefix"] and kr["stored"] + kr["lost"] == KILL_STEP, r
    assert r["duplicates"] == 0 and r["lost_survivors"] == 0, r
    # what was only in a killed rank's memory is lost, and counted: a survivor on the node read the
    # killed rank's progress record at its close (trainer_hooks/progress.py; >=: a shipment stored
    # just before the kill, not yet acked, is counted too) ...
    assert r["lost"] == sum(r["killed"][k]["lost"] for k in KILLED) and r["gaps_recorded"] >= r["lost"], r
    # ... but never silently: one unclosed row per killed source, with the exact last seq stored, and
    # the silent-rank alert names each; the survivors closed cleanly, so they get neither
    assert r["unclosed_ranks"] == list(KILLED) and r["unclosed_last_seq_exact"], r
    assert [u["dropped"] for u in r["unclosed_rows"]] == [0, 0]  # the collector's own row claims no number
    assert {a["rank"] for a in r["silent_rank_alerts"]} == set(KILLED), r
    assert all("without its clean close" in a["message"] for a in r["silent_rank_alerts"])
    assert r["lost_unmarked"] == 0 and rank_kill_held(r), r
    # telemetry never holds the survivors: they end in their own failure path, well inside their
    # gloo timeout (60 s)
    assert set(r["survivor_rc"]) == {0, 3} and r["survivor_exit_after_kill_s"] < 55, r
    assert r["collector_exit_code"] == 0 and r["agent_exit_code"] == 0, r
