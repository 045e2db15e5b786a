"""The command path end to end: a real collector, a real 2-rank reference run (PP2, gloo), a
person's commands through Control.Submit. One run carries four commands in turn:

A  set-micro-batch 2          -> applied on both ranks at one step (the STEP rows and the
                                 trainer's own per-rank logs agree), samples per step unchanged
B  set-micro-batch 1          -> rank 1 refuses (--inject-refuse-command): rank 0 undoes it at
                                 the same boundary, no step runs with it, the reason is stored
C  rollback A                 -> back to 4 x 4 on both ranks at one step; A marked rolled_back
D  set-micro-batch 8          -> dropped before rank 0 (TRACETOP_TEST_DROP_COMMANDS): lost, nothing applied
"""

from __future__ import annotations

import pytest

from tests.collector.control import harness
from tests.collector.control.harness import changes, wait_for
from tracetop.wire import tracetop_pb2 as pb

pytestmark = pytest.mark.slow
RUN = "loop-ref-1"
K = 5
#: command boundaries the run goes on for after the lost command is settled
AFTER_D_BOUNDARIES = 8
STEPS = 400  # the bound: the test stops the run (--stop-file) once it has seen D settled


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
    out = {}
    with harness.loop_run(tmp_path_factory.mktemp("loop"), RUN,
                          ["--pp", "2", "--steps", str(STEPS), "--micro-batch", "4", "--micro-batches", "4",
                           "--inject-straggler", "0:40", "--inject-refuse-command", "1:micro_batch=1"],
                          collector_args=["--command-ttl-s", "8"], command_every_steps=K,
                          env={"TRACETOP_TEST_DROP_COMMANDS": "micro_batch=8"}) as lp:
        client, t = lp.client, lp.trainer
        wait_for(lambda: client.sql(f"SELECT count(*) AS n FROM run_start WHERE run_id = '{RUN}'")[0]["n"] == 2,
                 300, "both ranks' RUN_START", t.output)
        a = client.set_micro_batch(RUN, 2)
        out["A"] = client.wait_action(a.action_id, ("applied", "rejected", "lost", "inconsistent"))
        b = client.set_micro_batch(RUN, 1)
        out["B"] = client.wait_action(b.action_id, ("applied", "rejected", "lost", "inconsistent"))
        cr = client.op(pb.ROLLBACK, a.action_id)
        out["C"] = client.wait_action(cr.action_id, ("applied", "rejected", "lost", "inconsistent"))
        out["A_after"] = client.action(a.action_id)
        d = client.set_micro_batch(RUN, 8)
        out["D"] = client.wait_action(d.action_id, ("applied", "rejected", "lost", "inconsistent"), timeout_s=120)
        # D is settled: AFTER_D_BOUNDARIES more command boundaries (nothing may change in them),
        # then every rank ends at one step (--stop-file) instead of running out the 400
        out["stop"] = t.stop_after(AFTER_D_BOUNDARIES * K)
        out["rc"] = t.wait()
        out["steps"] = lp.run_rows("step", "rank, step, micro_batch, micro_batches, samples")
        out["ranks"] = client.sql("SELECT * FROM action_ranks ORDER BY action_id, rank")
        out["trainer"] = t.rank_rows()
        out["log"] = t.output()
    return out


def _by_rank(rows):
    by = {}
    for r in rows:
        by.setdefault(r["rank"], []).append(r)
    return by


def test_a_applied_on_every_rank_at_the_same_step(loop_run):
    a = loop_run["A"]
    assert loop_run["rc"] == 0, loop_run["log"][-3000:]
    assert a["state"] == "applied", a
    assert a["ranks_applied"] == 2 and a["step"] % K == 0
    c = loop_run["C"]
    assert c["state"] == "applied" and c["rollback_of"] == a["action_id"], c
    expected = [(a["step"], (2, 8)), (c["step"], (4, 4))]
    stored = _by_rank(loop_run["steps"])
    assert sorted(stored) == [0, 1]
    for rank, rows in stored.items():
        assert changes(rows) == expected, (rank, changes(rows))
        assert {r["micro_batch"] * r["micro_batches"] for r in rows} == {16}  # samples per step unchanged
        assert [r["step"] for r in rows] == list(range(loop_run["stop"]))
    # the trainer's own account of what it ran, per rank: the same steps
    for rank, rows in loop_run["trainer"].items():
        assert changes(rows) == expected, (rank, changes(rows))
        assert {r["global_batch"] for r in rows} == {16}


def test_the_stop_file_ends_every_rank_at_the_step_written(loop_run):
    """--stop-file: every rank ends before the step the test wrote (not at --steps), rc 0, and the
    last step's rows of every rank are stored (the hooks closed normally)."""
    stop = loop_run["stop"]
    assert loop_run["rc"] == 0, loop_run["log"][-3000:]
    assert stop < STEPS
    assert f"stopping before step {stop}: " in loop_run["log"], loop_run["log"][-3000:]
    stored = _by_rank(loop_run["steps"])
    assert sorted(stored) == sorted(loop_run["trainer"]) == [0, 1]
    for rank in (0, 1):
        assert [r["step"] for r in stored[rank]] == list(range(stop)), rank
        assert [r["step"] for r in loop_run["trainer"][rank]] == list(range(stop)), rank


def test_b_refused_by_one_rank_is_applied_by_none(loop_run):
    b = loop_run["B"]
    assert b["state"] == "rejected", b
    assert b["ranks_refused"] == 1 and b["ranks_undone"] == 1
    assert "rank 1" in b["outcome"] and "injected" in b["outcome"]
    ranks = {r["rank"]: r for r in loop_run["ranks"] if r["action_id"] == b["action_id"] and r["stage"] != "received"}
    assert ranks[1]["stage"] == "refused" and "--inject-refuse-command" in ranks[1]["message"]
    assert ranks[0]["stage"] == "undone" and "rank 1 could not apply it" in ranks[0]["message"]
    assert ranks[0]["step"] == ranks[1]["step"] == b["step"]
    for rows in list(_by_rank(loop_run["steps"]).values()) + list(loop_run["trainer"].values()):
        assert all(r["micro_batch"] != 1 for r in rows)  # no step ever ran with it


def test_c_rollback_marks_the_original(loop_run):
    a = loop_run["A_after"]
    assert a["state"] == "rolled_back", a
    assert f"action {loop_run['C']['action_id']}" in a["verification"]


def test_d_lost_before_rank_0_applies_nowhere(loop_run):
    d = loop_run["D"]
    assert d["state"] == "lost", d
    assert "nothing was applied" in d["outcome"]
    assert not [r for r in loop_run["ranks"] if r["action_id"] == d["action_id"]]
    for rows in list(_by_rank(loop_run["steps"]).values()) + list(loop_run["trainer"].values()):
        assert all(r["micro_batch"] != 8 for r in rows)
