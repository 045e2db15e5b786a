"""The rebalance policy on hand-made inputs (no processes): the shares, the decision and its undo,
the verification, the refusals, and the service keeping what is in force (a real DuckDB store in
memory) and rolling it back. The trainer's side of the arithmetic: the weighted replica losses
average to the global batch's mean."""

from __future__ import annotations

import math

import pytest

from collector.control import rebalance as rb
from collector.control.check import RunShape, refusal
from collector.control.policy import ControlInputs, Settings
from collector.control.service import ControlError, ControlService
from collector.ingest.schema import open_store
from collector.live.model import Alert
from tracetop.wire import tracetop_pb2 as pb
from trainer_hooks.rebalance import Rebalance

S = Settings()


def straggler(rank: int) -> Alert:
    return Alert(rule="straggler", signal="straggler", severity="warning", state="firing", run_id="r", scope="rank",
                 labels={"rank": str(rank)}, first_step=20, last_step=26, first_ns=0, last_ns=0, value=40.0,
                 threshold=15.0, message=f"rank {rank} computes 40 ms longer")


def inputs(compute_ms, *, alerts=(), dp=4, tp=1, pp=1, mb=8, mbs=2) -> ControlInputs:
    world = len(compute_ms)
    return ControlInputs("r", 30, world, dp, pp, 1, mb, mbs, False, alerts=tuple(alerts), tp=tp,
                         compute_ms=tuple(compute_ms))


def test_split_is_proportional_to_speed_in_whole_granules_and_keeps_the_total():
    # 4 replicas, one 50 % slower per sample: 9, 9, 9, 5 of 32 (its 5 x 1.5 = 7.5 < 9)
    assert rb.split([1, 1, 1, 1 / 1.5], 32) == (9, 9, 9, 5)
    assert rb.split([1, 1, 1, 1 / 1.5], 64) == (18, 18, 17, 11)  # the step: 18 sample-times, not 16 x 1.5 = 24
    assert rb.split([1, 1, 1, 0.5], 32, granule=4, minimum=4) == (12, 8, 8, 4)  # a pipeline: multiples of M
    assert rb.split([1, 1, 1, 0.01], 32, minimum=2) == (10, 10, 10, 2)  # every replica keeps its micro-batches
    assert rb.split([1, 1], 3, minimum=2) == ()  # cannot: 2 + 2 > 3
    assert rb.split([1, math.nan], 16) == ()


def test_replica_of_follows_deepspeeds_pipe_data_model_order():
    assert [rb.replica_of(r, tp=1, dp=4) for r in range(4)] == [0, 1, 2, 3]
    # tp 2, dp 2, pp 2: rank = (pipe x dp + data) x tp + model
    assert [rb.replica_of(r, tp=2, dp=2) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_a_firing_straggler_gets_the_shares_of_its_speed_and_the_reason_says_why():
    d = rb.decide(inputs([80, 80, 80, 120], alerts=[straggler(3)]), (), -1, S)
    assert (d.outcome, d.kind, d.value, d.rule) == ("act", "rebalance", 3, "rebalance")
    assert d.values == (18, 18, 17, 11) and sum(d.values) == 64
    assert "rank 3 (replica 3)" in d.reason and "7.50 ms" in d.reason and "5.00 ms" in d.reason
    assert "global batch stays 64" in d.reason


def test_no_alert_no_rebalance_and_a_blip_too_small_to_move_a_sample_holds():
    assert rb.decide(inputs([80, 80, 80, 120]), (), -1, S) is None  # not persistent: the rule has not fired
    d = rb.decide(inputs([80, 80, 80, 81], alerts=[straggler(3)]), (), -1, S)
    assert d.outcome == "hold" and "too small" in d.reason
    d = rb.decide(inputs([80, 80, 80, math.nan], alerts=[straggler(3)]), (), -1, S)
    assert d.outcome == "hold" and "compute time" in d.reason
    assert rb.decide(inputs([80, 120], alerts=[straggler(1)], dp=1), (), -1, S) is None  # no other replica


def test_in_force_undone_when_the_replica_recovers_else_held():
    in_force = (18, 17, 17, 12)
    # still slow: 12 samples at 7.5 ms against 5 ms on the others
    still = rb.decide(inputs([90, 85, 85, 90]), in_force, 3, S)
    assert still.outcome == "hold" and "still computes" in still.reason
    back = rb.decide(inputs([90, 85, 85, 60]), in_force, 3, S)  # 5 ms a sample again
    assert (back.outcome, back.value, back.values, back.rule) == ("act", -1, (16, 16, 16, 16), "rebalance_undo")


def test_a_pipeline_moves_whole_micro_batch_multiples_and_names_the_pipe_replica():
    # tp 1, pp 2, dp 2: ranks 0, 1 are stage 0 (replicas 0, 1), ranks 2, 3 stage 1; rank 3 slow
    d = rb.decide(inputs([50, 50, 50, 100], alerts=[straggler(3)], dp=2, pp=2, mb=2, mbs=4), (), -1, S)
    assert d.value == 1 and all(n % 4 == 0 for n in d.values) and sum(d.values) == 16 and d.values[1] < 8


def test_verify_keeps_a_faster_step_and_rolls_back_a_slower_one_or_a_rising_loss():
    assert rb.verify(250, 200, 1.0, 0.98, undo=False, s=S).keep
    v = rb.verify(250, 245, 1.0, 0.98, undo=False, s=S)
    assert not v.keep and "did not fall by 5%" in v.text
    assert rb.verify(250, 200, 1.0, 1.3, undo=False, s=S).keep  # a window's median moves with the batches
    v = rb.verify(250, 200, 1.0, 1.6, undo=False, s=S)
    assert not v.keep and "loss rose" in v.text
    v = rb.verify(250, 200, 1.0, math.inf, undo=False, s=S)
    assert not v.keep and "loss rose" in v.text
    assert rb.verify(200, 210, 1.0, 1.0, undo=True, s=S).keep  # back to balanced: kept


SHAPE = RunShape("r", 4, 4, 4, 1, 1, 8, 2, False)


@pytest.mark.parametrize(("shape", "value", "values", "words"), [
    (RunShape("r", 2, 2, 1, 2, 1, 8, 2, False), 0, [16], "no other replica"),
    (SHAPE, 3, [18, 17, 29], "give one count per replica"),
    (SHAPE, 3, [18, 17, 17, 10], "sum to 62; the global batch of run r is 64"),
    (SHAPE, 3, [20, 21, 22, 1], "fewer than the 2 micro-batches"),
    (RunShape("r", 4, 4, 2, 2, 1, 2, 4, False), 1, [10, 6], "multiple of its 4 micro-batches"),
    (SHAPE, 7, [18, 17, 17, 12], "give 0..3, or -1"),
    (SHAPE, -1, [16, 16, 16, 16], "already in force"),
    (RunShape("r", 4, 4, 4, 1, 1, -1, -1, False), 3, [18, 17, 17, 12], "declared no micro-batch shape"),
])
def test_refusals_say_what_is_wrong_and_what_would_work(shape, value, values, words):
    why = refusal(shape, "rebalance", value, values)
    assert why is not None and words in why, why


def test_a_micro_batch_change_waits_for_the_rebalance_to_be_undone():
    shape = RunShape("r", 4, 4, 4, 1, 1, 8, 2, False, (18, 17, 17, 12), 3)
    assert "undo the rebalance first" in refusal(shape, "micro_batch", 4)
    assert refusal(shape, "rebalance", -1, [16] * 4) is None


def test_weighted_replica_losses_average_to_the_global_mean():
    """Trainer side: sum over replicas of dp x n_i / G x mean_i, over dp (DDP's average), is the
    mean over the global batch; per micro-batch with gradient accumulation the same."""
    r = Rebalance((18, 17, 17, 12), 3)
    losses = [float(i % 7) for i in range(64)]
    replica_means, micro = [], []
    for q in range(4):
        lo = r.offset(q)
        mine = losses[lo: lo + r.share(q)]
        replica_means.append(r.weight(q) * sum(mine) / len(mine))
        acc, at = 0.0, 0
        for n in r.micro_batch_sizes(q, 2):
            acc += r.micro_weight(q, n, 2) * sum(mine[at: at + n]) / n / 2
            at += n
        micro.append(acc)
    assert sum(replica_means) / 4 == pytest.approx(sum(losses) / 64)
    assert sum(micro) / 4 == pytest.approx(sum(losses) / 64)
    assert r.micro_batch_sizes(3, 2) == [6, 6] and r.micro_batch_sizes(1, 2) == [9, 8]
    assert r.balanced() == Rebalance((16,) * 4, -1) and r.balanced().weight(0) == 1.0


class Clock:
    ns = 1_000 * 10**9

    def __call__(self) -> int:
        return self.ns


@pytest.fixture
def svc():
    con = open_store(":memory:")
    for rank in range(4):
        con.execute("INSERT INTO run_start (run_id, rank, world_size, dp, pp, zero_stage, micro_batch, micro_batches) "
                    "VALUES ('r', ?, 4, 4, 1, 2, 8, 2)", [rank])
    clock = Clock()
    s = ControlService(con, ttl_s=10, clock_ns=clock)
    for rank in range(4):
        s.note_source(f"src-{rank}@1", "r", rank, clock.ns - 10**9)
    s.clock = clock
    yield s
    s.close()
    con.close()


def _apply(svc, a, step):
    for rank in range(4):
        svc.clock.ns += 1000
        svc.on_status(pb.CommandStatus(command_id=a.action_id, run_id="r", rank=rank, applied=True, step=step,
                                       micro_batch=8, micro_batches=2, source_key=f"src-{rank}@1"))


def test_the_service_keeps_the_shares_in_force_and_rolls_back_to_the_ones_before(svc):
    with pytest.raises(ControlError, match="sum to 60"):
        svc.propose("r", "rebalance", 3, by="person:t", values=[18, 17, 17, 8])
    a = svc.propose("r", "rebalance", 3, by="person:t", approve=True, values=[18, 17, 17, 12])
    assert (a.previous_value, a.value_list, a.shown()) == (-1, [18, 17, 17, 12], "rebalance=3 [18,17,17,12]")
    _apply(svc, a, 30)
    assert svc.shape("r").rebalance == (18, 17, 17, 12) and svc.shape("r").relieved == 3
    b = svc.rollback(a.action_id, "person:t")
    assert (b.value, b.value_list, b.rollback_of) == (-1, [16, 16, 16, 16], a.action_id)
    _apply(svc, b, 40)
    assert a.state == "rolled_back" and svc.shape("r").rebalance == () and svc.shape("r").relieved == -1
