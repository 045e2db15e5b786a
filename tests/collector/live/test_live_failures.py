"""First failure and ranks never heard, on real runs: a plain DDP loop (tests/collector/live/
failure_loop.py, gloo, 4 ranks under torchrun) into one real collector with the built-in rules.

Runs: `data` (rank 2's data loading 150 ms slower from step 10), `kill` (rank 3 sends itself SIGKILL at step 25; torchrun then ends the others, whose own
SIGTERM handler closes their hooks), `late` (rank 1 sleeps 40 s after the DDP model is built,
before its Tracer starts: its peers block in DDP's all-reduce of step 0, a collective it has not
joined), `early` (rank 1 exits before its Tracer starts: never heard at all; its peers fail in
their first all-reduce). Ground truths are the injections: the rank, the step.
Heartbeats and shipments every second (TRACETOP_HEARTBEAT_S / TRACETOP_FLUSH_S = 1) keep the
runs short; the thresholds are the built-in 15 s. One rule is added to the built-in ones: an info
memory budget of 1 MiB, which every rank that reports a step breaches, so that every step judged
updates an alert of each reporting rank (what `kill` asks of the steps judged without rank 3)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from collector.live.rules import DEFAULTS_TOML
from tests.collector.live.judged import wait_judged
from tests.collector.util import sql
from tests.support import ROOT
from tests.support.services import start_collector
from tests.support.torchrun import launch
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow

LOOP = str(ROOT / "tests" / "collector" / "live" / "failure_loop.py")
KILL_RANK, KILL_STEP = 3, 25
DATA_RANK, DATA_MS, DATA_STEP = 2, 150, 10  # 150 ms of data wait on ~30 ms steps (5x the step's compute)
LATE_RANK, LATE_S = 1, 40
#: breached by every rank on every step it reports (its RSS is far over 1 MiB): an alert per rank,
#: updated on each step judged (an SLA, info: no incident, nothing critical beside the faults)
EVERY_STEP_RULE = """
[rule.every_step]
signal = "memory"
used_of_budget_above = 0.90
budget_mb = 1
for_steps = 1
severity = "info"
kind = "sla"
"""


def _alerts(addr: str, run_id: str) -> list[dict]:
    return sql(addr, f"SELECT * FROM alerts WHERE run_id = '{run_id}' ORDER BY first_ns").to_pylist()


def _run(c, tmp, run_id: str, args: list[str]):
    """One run to its end; its environment passed, not set in os.environ (`late` runs in a thread)."""
    env = dict(os.environ, TRACETOP_ENDPOINT=c.addr, TRACETOP_RUN_ID=run_id, TRACETOP_HEARTBEAT_S="1",
               TRACETOP_FLUSH_S="1")
    return launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", LOOP,
                   *args], timeout_s=400, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live_failures")
    rules = tmp / "rules.toml"
    rules.write_text(DEFAULTS_TOML + EVERY_STEP_RULE)
    c = start_collector(tmp, listen="unix", extra_args=["--rules", str(rules)], metrics=True)
    out: dict = {"collector": c}
    try:
        # `late` spends LATE_S seconds with its rank 1 asleep and its peers blocked in an all-reduce
        # (idle): the other runs go meanwhile, each with its own run_id, torchrun and job token
        with ThreadPoolExecutor(1) as pool:
            late = pool.submit(_run, c, tmp, "late", ["--steps", "10", "--late", f"{LATE_RANK}:{LATE_S}"])
            out["kill"] = _run(c, tmp, "kill", ["--steps", "80", "--kill", f"{KILL_RANK}@{KILL_STEP}",
                                             "--timeout-s", "20"])
            out["kill_end"] = time.time_ns()
            out["early"] = _run(c, tmp, "early", ["--steps", "20", "--die-early", str(LATE_RANK)])
            out["data"] = _run(c, tmp, "data", ["--steps", "30", "--slow-data", f"{DATA_RANK}:{DATA_MS}@{DATA_STEP}"])
            out["late"] = late.result()

        def judged(run_id: str):
            got = [a for a in _alerts(c.addr, run_id) if a["signal"] == "first_failure" and a["fired_ns"]]
            return got or None

        # the runs stopped: every rank closed or silent for 15 s, then the first failure is named
        out["kill_alerts"] = wait_for(lambda: judged("kill") and _alerts(c.addr, "kill"), 90, "kill's first_failure",
                                      lambda: _alerts(c.addr, "kill"), every_s=0.5)
        out["early_alerts"] = wait_for(lambda: judged("early") and _alerts(c.addr, "early"), 90,
                                       "early's first_failure", lambda: _alerts(c.addr, "early"), every_s=0.5)
        # every run's last step judged (`kill`'s at the 15 s deadline, without rank 3), then the rows
        out["kill_metrics"] = wait_judged(c, "kill", "late", "data")
        out["late_alerts"] = _alerts(c.addr, "late")
        out["data_alerts"] = _alerts(c.addr, "data")
        out["kill_alerts"] = _alerts(c.addr, "kill")
        out["late_first_row"] = sql(c.addr, f"SELECT min(start_ns) FROM heartbeat WHERE run_id = 'late' AND "
                                            f"rank = {LATE_RANK}").column(0)[0].as_py()
        out["kill_last_step_row"] = sql(c.addr, f"SELECT coalesce(max(step), -1) FROM step WHERE run_id = 'kill' AND "
                                                f"rank = {KILL_RANK}").column(0)[0].as_py()
        # every step of `kill` stored, and the ranks that reported it
        stored = sql(c.addr, "SELECT step, list(rank ORDER BY rank) AS ranks FROM step WHERE run_id = 'kill' AND step >= 0 "
                             "GROUP BY step").to_pylist()
        out["kill_step_ranks"] = {r["step"]: set(r["ranks"]) for r in stored}
        out["kill_beats"] = sql(c.addr, "SELECT rank, step, phase, start_ns FROM heartbeat WHERE run_id = 'kill' "
                                         "ORDER BY start_ns").to_pylist()
        yield out
    finally:
        c.stop()


def test_a_killed_rank_is_named_the_first_failure_once_when_torchrun_ends_the_others(runs):
    r = runs["kill"]
    assert r.rc != 0 and f"rank {KILL_RANK}: SIGKILL at step {KILL_STEP}" in r.output, r.output[-3000:]
    alerts = runs["kill_alerts"]
    ff = [a for a in alerts if a["signal"] == "first_failure"]
    assert len(ff) == 1, json.dumps(alerts, default=str)[:3000]
    a = ff[0]
    assert a["rank"] == KILL_RANK and a["severity"] == "critical", (a["message"], runs["kill_beats"][-12:])
    assert f"rank {KILL_RANK} failed first" in a["message"] and "without its clean close" in a["message"]
    # its last step as last heard: no earlier than its last STEP row stored, no later than the kill
    # (how far before the kill that row is depends on the machine's load: a shipment's lag)
    assert runs["kill_last_step_row"] <= int(json.loads(a["labels"])["step"]) <= KILL_STEP, (a, runs["kill_last_step_row"])
    # one critical alert for the failure: no silent_rank / stuck_collective beside it naming anyone
    crit = [a for a in alerts if a["severity"] == "critical"]
    assert [x["signal"] for x in crit] == ["first_failure"], crit
    # fired within 20 s of the run's end (the 15 s of silence that says it stopped, plus a tick)
    assert (a["fired_ns"] - runs["kill_end"]) / 1e9 < 20 + 5, (a["fired_ns"], runs["kill_end"])


def test_steps_judged_after_the_killed_rank_stopped_count_incomplete_and_their_alerts_name_it_missing(runs):
    """Rank 3's rows stop at its last step stored (what its hooks had shipped before the SIGKILL);
    its peers report later steps (to the one they failed in) without it. Each such step is judged
    at the 15 s deadline without rank 3: /metrics counts it for the run, and each alert updated on
    it (every rank's on every step: EVERY_STEP_RULE) says which ranks it was judged on. The
    ground truth is the rank the test killed and the STEP rows stored."""
    last3 = runs["kill_last_step_row"]
    ranks = runs["kill_step_ranks"]  # step -> the ranks whose STEP row is stored
    after = sorted(s for s in ranks if s > last3)
    assert after and all(KILL_RANK not in ranks[s] for s in after), (last3, ranks)
    short = sorted(s for s, rk in ranks.items() if len(rk) < 4)  # after, and any other step a row of missed
    m = runs["kill_metrics"]
    assert m['tracetop_run_live_steps_incomplete_total{run_id="kill"}'] == len(short), (short, after)
    assert m['tracetop_run_live_last_incomplete_step{run_id="kill"}'] == after[-1]
    updated = [a for a in runs["kill_alerts"] if a["last_step"] > last3]
    assert updated, json.dumps(runs["kill_alerts"], default=str)[:3000]
    for a in updated:
        said = re.findall(r"; judged on (\d+) of (\d+) ranks \(missing: ([\d, ]+)\)", a["message"])
        assert len(said) == 1, a["message"]
        n, world, missing = int(said[0][0]), int(said[0][1]), {int(x) for x in said[0][2].split(", ")}
        assert KILL_RANK in missing and world == 4, a["message"]
        assert missing == set(range(4)) - ranks[a["last_step"]] and n == len(ranks[a["last_step"]]), (a, ranks)
    # the steps rank 3 reported are judged on every rank: the alerts last updated there say nothing of the kind
    assert not [a["message"] for a in runs["kill_alerts"] if 0 <= a["last_step"] <= last3 and
                a["last_step"] not in short and "; judged on" in a["message"]]


def test_a_rank_that_starts_late_is_named_never_heard_while_its_peers_wait(runs):
    assert runs["late"].rc == 0, runs["late"].output[-3000:]
    alerts = runs["late_alerts"]
    un = [a for a in alerts if a["signal"] == "unheard_rank"]
    assert [a["rank"] for a in un] == [LATE_RANK], json.dumps(alerts, default=str)[:3000]
    a = un[0]
    assert a["fired_ns"] and a["fired_ns"] < runs["late_first_row"], (a, runs["late_first_row"])
    assert f"rank {LATE_RANK} of 4 was never heard from" in a["message"]
    assert "wait in" in a["message"] and "all_reduce" in a["message"], a["message"]
    assert a["state"] == "resolved"  # it was heard once its Tracer started
    # the run ended cleanly: nothing else critical
    assert [x["signal"] for x in alerts if x["severity"] == "critical"] == ["unheard_rank"], alerts


def test_a_rank_that_dies_before_its_first_heartbeat_is_the_first_failure(runs):
    assert runs["early"].rc != 0
    ff = [a for a in runs["early_alerts"] if a["signal"] == "first_failure"]
    assert [a["rank"] for a in ff] == [LATE_RANK], runs["early_alerts"]
    assert "never heard" in ff[0]["message"], ff[0]["message"]


def test_a_slow_data_loader_is_named_with_cause_data_not_the_network(runs):
    assert runs["data"].rc == 0, runs["data"].output[-3000:]
    alerts = runs["data_alerts"]
    ds = [a for a in alerts if a["signal"] == "data_stall" and a["fired_ns"]]
    assert [a["rank"] for a in ds] == [DATA_RANK], json.dumps(alerts, default=str)[:3000]
    a = ds[0]
    assert json.loads(a["labels"])["cause"] == "data" and "data-loader straggler" in a["message"], a
    assert DATA_STEP <= a["first_step"] and a["fired_step"] <= DATA_STEP + 5, a  # named within 5 steps of onset
    assert not [x for x in alerts if x["signal"] == "straggler"], alerts  # not a compute straggler
    # where the network rules fire, they say whose data loading the wait is
    for x in alerts:
        if x["signal"] in ("comm_share", "grad_sync") and x["first_step"] >= DATA_STEP + 2:
            assert f"rank {DATA_RANK}'s data loading" in x["message"], x
