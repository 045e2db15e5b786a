"""Two more closed-loop runs (real collector with its live engine feeding the controller, real 2-rank
reference runs):

- bubble, advise mode: PP2 with 2 micro-batches (the 1F1B bubble is at least 1/3) and a bubble
  threshold of 0.30: the controller proposes more micro-batches and nothing else happens until a
  person approves; then both ranks change at one step and the bubble falls.
- the leak (--inject-mem-growth), auto mode: memory no batch shape can fix. At most
  max_actions_per_problem (2) changes, then one "cannot fix" (an actions row, and an alert the live
  sinks receive: a webhook, a real Alertmanager, OTLP), and nothing more: the micro-batch only ever
  goes down (no oscillation)."""

from __future__ import annotations

import statistics

import pytest

from tests.collector.control.harness import changes, loop_run, wait_for
from tests.collector.export.tools import Alertmanager, OtlpReceiver, Receiver
from tracetop.wire import tracetop_pb2 as pb

# alone: the bubble's fall is wall clock between the two stage processes; beside another
# multi-process job each stage waits on the other being scheduled and the fall is lost (seen once in a
# two-worker suite run: 0.351 -> 0.355; quiet 0.366 -> 0.252; beside two CPU burners 0.354 -> 0.296)
pytestmark = [pytest.mark.slow, pytest.mark.alone]
AFTER = 10  # the bubble's steps compared after the change (and before it)
BUBBLE_STEPS = 60  # the bound: the run ends (--stop-file) once the AFTER steps after the change have run


def _by_rank(rows):
    by = {}
    for r in rows:
        by.setdefault(r["rank"], []).append(r)
    return by


@pytest.fixture(scope="module")
def bubble(tmp_path_factory):
    run = "loop-bubble-1"
    out = {}
    # The small model (7 M parameters): with tiny, DeepSpeed's per-instruction overhead outweighs the
    # compute on this CPU and more micro-batches do not shrink the bubble (measured: 0.69 -> 0.70).
    with loop_run(tmp_path_factory.mktemp("bubble"), run,
                  ["--model", "small", "--pp", "2", "--micro-batch", "8", "--micro-batches", "2", "--steps", str(BUBBLE_STEPS)],
                  controller="advise", toml="[controller]\ntick_s = 0.5\ncooldown_s = 1\n"
                  "cooldown_steps = 3\nverify_steps = 100\nbubble_threshold = 0.30\n") as lp:
        client, t = lp.client, lp.trainer
        p = wait_for(lambda: client.sql("SELECT * FROM actions WHERE state = 'proposed'"), 300, "a proposal", t.output)[0]
        out["proposal"] = p
        seen = client.sql(f"SELECT max(step) AS s FROM step WHERE run_id = '{run}'")[0]["s"]
        wait_for(lambda: client.sql(f"SELECT max(step) AS s FROM step WHERE run_id = '{run}'")[0]["s"] >= seen + 5,
                 120, "5 more steps")
        out["while_proposed"] = client.action(p["action_id"])
        client.op(pb.APPROVE, p["action_id"])
        out["applied"] = client.wait_action(p["action_id"], ("applied", "verified", "rejected", "lost"))
        # the run ends (--stop-file) once the AFTER steps after the change the test compares have run
        out["stop"] = t.stop_after(1, at_least=(out["applied"]["step"] or 0) + AFTER + 1)
        out["rc"] = t.wait()
        out["steps"] = lp.run_rows("step", "rank, step, micro_batch, micro_batches")
        out["bubble"] = client.sql(f"SELECT stage, step, bubble_rate FROM bubble_by_stage WHERE run_id = '{run}'")
        out["log"] = t.output()
    return out


def test_bubble_proposal_waits_for_a_person_then_applies_and_the_bubble_falls(bubble):
    assert bubble["rc"] == 0, bubble["log"][-3000:]
    p = bubble["proposal"]
    assert (p["rule"], p["kind"], p["value"], p["proposed_by"], p["approved_by"]) == ("bubble", "micro_batch", 4,
                                                                                     "controller", None), p
    assert "above 30%" in p["reason"] and "2 micro-batches over 2 stages" in p["reason"]
    assert bubble["while_proposed"]["state"] == "proposed"  # 5 steps later, nothing sent
    a = bubble["applied"]
    assert a["approved_by"] == "person:test" and a["ranks_applied"] == 2, a
    s = a["step"]
    for rows in list(_by_rank(bubble["steps"]).values()):
        assert changes(rows)[0] == (s, (4, 4)), changes(rows)
        assert all(r["micro_batch"] == 8 for r in rows if r["step"] < s)  # nothing before the approval
    rates = {}
    for r in bubble["bubble"]:
        rates.setdefault(r["step"], []).append(r["bubble_rate"])
    mean = {k: statistics.mean(v) for k, v in rates.items() if len(v) == 2}  # over both stages
    assert all(k in mean for k in range(s + 1, s + AFTER + 1)), (s, bubble["stop"], sorted(mean))  # ran, stored
    before = statistics.median(v for k, v in mean.items() if s - AFTER <= k < s)
    after = statistics.median(v for k, v in mean.items() if s + 1 <= k <= s + AFTER)
    assert after < before - 0.03, (before, after)


@pytest.fixture(scope="module")
def leak(tmp_path_factory):
    run = "loop-leak-1"
    out = {}
    tmp = tmp_path_factory.mktemp("leak")
    # the live alert sinks, real receivers (tests/collector/export/tools.py): a webhook, an Alertmanager, OTLP
    hook, am_hook, otlp = Receiver(), Receiver(), OtlpReceiver()
    am = Alertmanager(tmp, am_hook.url)
    sinks = ["--webhook", hook.url, "--alertmanager", am.url, "--otlp", otlp.addr, "--otlp-interval-s", "0.5"]
    try:
        with _leak(tmp, run, sinks) as lp:
            client, t = lp.client, lp.trainer
            wait_for(lambda: client.sql("SELECT * FROM actions WHERE state = 'cannot_fix'"), 400, "cannot fix",
                     lambda: client.sql("SELECT action_id, state, value, reason FROM actions"))
            out["alert"] = wait_for(lambda: client.sql(
                f"SELECT * FROM alerts WHERE run_id = '{run}' AND rule = 'controller_cannot_fix'"), 30,
                "the cannot-fix alert in the alerts table")[0]
            out["hook"] = wait_for(lambda: [a for b in hook.bodies for a in b["alerts"]
                                            if a["rule"] == "controller_cannot_fix"], 30, "the webhook's POST")
            out["am"] = wait_for(lambda: [a for a in am.alerts() if a["labels"]["alertname"] == "controller_cannot_fix"],
                                 30, "the alert in Alertmanager's GET /api/v2/alerts")
            # OTLP counts the engine's alerts by run, severity and state: the cannot-fix one is among
            # the run's firing critical alerts (compared with the alerts table at the same moment)
            key = ("tracetop.alerts", (("run_id", run), ("severity", "critical"), ("state", "firing")))

            def otlp_counts_it():
                n = client.sql(f"SELECT count(*) AS n FROM alerts WHERE run_id = '{run}' AND severity = 'critical' "
                               "AND state = 'firing'")[0]["n"]
                got = otlp.points().get(key, (0, ""))[0]
                return got == n and (n, got)

            out["otlp"] = wait_for(otlp_counts_it, 30, "OTLP's firing critical count to include it",
                                   lambda: (otlp.points().get(key), client.sql(
                                       f"SELECT rule, severity, state FROM alerts WHERE run_id = '{run}'")))
            # given up: LEAK_AFTER more steps (the controller's cooldown and verification, twice over)
            # in which nothing more may be proposed, then the run ends (--stop-file), not at the bound
            out["stop"] = t.stop_after(LEAK_AFTER)
            out["rc"] = t.wait()
            out["actions"] = client.sql("SELECT * FROM actions ORDER BY try_cast(action_id AS INT)")
            out["steps"] = lp.run_rows("step", "rank, step, micro_batch, micro_batches")
            out["log"] = t.output()
    finally:
        am.close()
        for r in (hook, am_hook, otlp):
            r.close()
    return out


LEAK_AFTER = 20


def _leak(tmp, run: str, collector_args: list[str]):
    return loop_run(tmp, run,
                  # both ranks 60 ms slower a step (no straggler): the run must outlast the controller's
                  # two actions and their verification in wall time; on a quiet machine 130 plain steps
                  # took 8.8 s and ended before the second action was sent
                  ["--micro-batch", "4", "--micro-batches", "2", "--steps", "250", "--memory-budget-mb", "500",
                   "--inject-mem-growth", "0:6", "--inject-straggler", "0:60", "--inject-straggler", "1:60"],
                  controller="auto", toml="[controller]\ntick_s = 0.5\ncooldown_s = 1\n"
                  "cooldown_steps = 5\nverify_steps = 5\nmax_actions_per_problem = 2\n"
                  # the memory policy's bound is under test, not verification: on this loaded
                  # 2-core machine 5-step medians of throughput swing by half (seen: one
                  # rolled back at 0.5, then the run went 4 -> 2 -> 4 -> 1)
                  "max_throughput_drop = 0.9\n", collector_args=collector_args)


def test_the_leak_gets_at_most_the_configured_actions_then_cannot_fix(leak):
    assert leak["rc"] == 0, leak["log"][-3000:]
    acts = leak["actions"]
    changes_made = [a for a in acts if a["kind"] in ("micro_batch", "offload")]
    gave_up = [a for a in acts if a["state"] == "cannot_fix"]
    assert 1 <= len(changes_made) <= 2, acts
    assert all(a["rule"] == "memory" and a["state"] in ("applied", "verified") for a in changes_made), changes_made
    assert len(gave_up) == 1 and gave_up[0] is acts[-1], acts  # nothing after giving up
    assert max(r["step"] for r in leak["steps"]) == leak["stop"] - 1  # ... in the LEAK_AFTER steps run after it
    assert "cannot fix" in gave_up[0]["reason"] and "leak" in gave_up[0]["reason"]
    by = _by_rank(leak["steps"])
    assert changes(by[0]) == changes(by[1])  # every change on both ranks at one step
    for rows in by.values():
        mbs = [r["micro_batch"] for r in rows]
        assert mbs == sorted(mbs, reverse=True)  # only ever down: no oscillation


def test_cannot_fix_reaches_the_live_alert_sinks(leak):
    """The give-up is an alert the live sinks receive, not only an actions row: the `alerts` table,
    a webhook's POST, a real Alertmanager, and OTLP's alert count."""
    gave_up = [a for a in leak["actions"] if a["state"] == "cannot_fix"][0]
    row = leak["alert"]
    assert (row["state"], row["severity"], row["signal"]) == ("firing", "critical", "memory"), row
    assert row["message"] == gave_up["reason"] and "leak" in row["message"]
    (posted,) = leak["hook"]
    assert (posted["state"], posted["run_id"], posted["labels"]) == ("firing", "loop-leak-1", {"problem": "memory"}), posted
    assert posted["message"] == gave_up["reason"]
    (am,) = leak["am"]
    labels = dict(am["labels"])
    assert labels.pop("incident") == row["incident_id"] == row["id"], am  # an incident of its own
    assert labels == {"alertname": "controller_cannot_fix", "run_id": "loop-leak-1", "severity": "critical",
                      "scope": "run", "kind": "fault", "incident_role": "cause", "problem": "memory"}, am
    assert am["annotations"]["summary"] == gave_up["reason"]
    n, got = leak["otlp"]
    assert n >= 1 and got == n
