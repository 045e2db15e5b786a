"""The controller's loop around a rollback, without processes: a real ControlService on a real
(in-memory) DuckDB store, the ranks' reports fed to it as the hooks send them, a clock the test
moves, and inputs the test writes (the run's memory stays above the budget throughout).

What a demanding user wants after a change costs throughput: the rollback first and nothing else
in that tick; no second rollback while the first is on its way; the problem judged again only on
steps run with the rolled-back shape (the cooldown counts from the step the rollback took effect,
not from when it was proposed); a rollback itself never rolled back."""

from __future__ import annotations

import math

import pytest

from collector.control.controller import Controller, ControllerSettings
from collector.control.policy import ControlInputs, RankMemory, Settings
from collector.control.service import ControlService
from collector.ingest.schema import open_store
from tracetop.wire import tracetop_pb2 as pb

GIB = 2**30
S = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000 * S

    def __call__(self) -> int:
        return self.ns

    def s(self) -> float:
        return self.ns / 1e9


class Inputs:
    """The run as the test says it is: memory 95 % of the budget at every shape; samples/s per
    window from ``tput(first_step)``."""

    def __init__(self, svc: ControlService) -> None:
        self.svc = svc
        self.step = 0
        self.tput = lambda first_step: 100.0

    def read(self) -> list[ControlInputs]:
        sh = self.svc.shape("r")
        mem = tuple(RankMemory(r, int(0.95 * 8 * GIB), 8 * GIB) for r in range(2))
        return [ControlInputs("r", self.step, 2, 2, 1, 1, sh.micro_batch, sh.micro_batches, sh.offload, mem, (),
                              math.nan, 100.0, 10.0)]

    def samples_per_s(self, run_id: str, first_step: int, last_step: int) -> float:
        return self.tput(first_step)

    def memory_share(self, run_id: str, first_step: int, last_step: int) -> float:
        return 0.95


@pytest.fixture
def loop():
    con = open_store(":memory:")
    for rank in range(2):
        con.execute("INSERT INTO run_start (run_id, rank, world_size, dp, pp, zero_stage, micro_batch, micro_batches) "
                    "VALUES ('r', ?, 2, 2, 1, 1, 4, 2)", [rank])
    clock = Clock()
    svc = ControlService(con, ttl_s=60, clock_ns=clock)
    for rank in range(2):
        svc.note_source(f"src-{rank}@1", "r", rank, 0)
    src = Inputs(svc)
    pol = Settings(cooldown_s=1, cooldown_steps=5, verify_steps=8)
    c = Controller(svc, src, ControllerSettings(mode="auto", policy=pol), clock_s=clock.s)
    yield c, svc, src, clock
    svc.close()
    con.close()


def tick(c: Controller, clock: Clock, step: int, src: Inputs, advance_s: float = 2.0) -> None:
    clock.ns += int(advance_s * S)
    src.step = step
    c.gather()
    c.decide_and_act()


def apply(svc: ControlService, action_id: str, step: int) -> None:
    """What the hooks report: rank 0 received it, then every rank applied it at one boundary."""
    a = svc.actions[action_id]
    svc.on_status(pb.CommandStatus(command_id=action_id, run_id="r", rank=0, applied=False, step=-1, stage=1,
                                   source_key="src-0@1"))
    for rank in range(2):
        svc.on_status(pb.CommandStatus(command_id=action_id, run_id="r", rank=rank, applied=True, step=step,
                                       micro_batch=a.value, micro_batches=8 // a.value, source_key=f"src-{rank}@1"))


def test_a_rollback_first_then_the_problem_judged_again_after_it_took_effect(loop):
    c, svc, src, clock = loop
    tick(c, clock, 10, src)
    assert [(a.kind, a.value, a.rule) for a in svc.actions.values()] == [("micro_batch", 2, "memory")]
    apply(svc, "1", 15)
    # micro-batch 2 costs half the throughput: the steps after step 15 run at 40 samples/s
    src.tput = lambda first: 40.0 if 15 < first < 35 else 100.0
    tick(c, clock, 20, src)  # not yet verify_steps old
    assert len(svc.actions) == 1
    tick(c, clock, 23, src)  # 8 steps old: rolled back; memory is still high, but nothing else is proposed
    assert [(a.action_id, a.rollback_of, a.value, a.rule) for a in svc.actions.values()][1:] == [("2", "1", 4, "verify")]
    assert [d.outcome for d in c.decisions][-1] == "rolled_back"
    for step in (24, 26, 30):  # the rollback on its way: no second rollback, no new proposal
        tick(c, clock, step, src)
        assert len(svc.actions) == 2, list(svc.actions.values())
    apply(svc, "2", 30)
    assert svc.actions["1"].state == "rolled_back" and svc.actions["2"].state == "applied"
    # far past cooldown_s since the rollback was proposed, but its shape has run for fewer than
    # cooldown_steps steps: memory is not judged yet
    tick(c, clock, 32, src, advance_s=30)
    assert len(svc.actions) == 2
    assert "cooling down" in c.decisions[-1].reason and "2 of 5 steps" in c.decisions[-1].reason
    tick(c, clock, 35, src)  # judged again on steps with micro-batch 4: 2 did not pay, so 1
    third = svc.actions["3"]
    assert (third.kind, third.value, third.rule, third.rollback_of) == ("micro_batch", 1, "memory", None)
    assert third.proposed_ns > svc.actions["2"].done_ns


def test_a_rollback_is_verified_but_never_rolled_back(loop):
    c, svc, src, clock = loop
    tick(c, clock, 10, src)
    apply(svc, "1", 15)
    src.tput = lambda first: 40.0 if first > 15 else 100.0
    tick(c, clock, 23, src)
    apply(svc, "2", 25)
    src.tput = lambda first: 100.0 if first < 25 else 40.0  # the rollback "lost" throughput too
    tick(c, clock, 33, src)
    back = svc.actions["2"]
    assert back.state == "verified", back
    assert "not verified" in back.verification and "a rollback restores the shape before it" in back.verification
    assert not [a for a in svc.actions.values() if a.rollback_of == "2"]
