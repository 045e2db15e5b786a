"""An action's life in the Control service, on a real DuckDB store (in memory) and a clock the
test moves: the ranks' reports fold into one outcome; what rank 0 never received is lost; what
some ranks never confirmed is incomplete."""

from __future__ import annotations

import pytest

from collector.control.service import ControlService
from collector.ingest.schema import open_store
from tracetop.wire import tracetop_pb2 as pb

S = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000 * S

    def __call__(self) -> int:
        return self.ns


@pytest.fixture
def svc():
    con = open_store(":memory:")
    for rank in range(3):
        con.execute("INSERT INTO run_start (run_id, rank, world_size, dp, pp, zero_stage, micro_batch, micro_batches) "
                    "VALUES ('r', ?, 3, 3, 1, 1, 4, 4)", [rank])
    clock = Clock()
    s = ControlService(con, ttl_s=10, clock_ns=clock)
    for rank in range(3):  # what the writer's commits tell it: each rank's shipper start
        s.note_source(f"src-{rank}@1", "r", rank, clock.ns - S)
    s.clock = clock
    yield s
    s.close()
    con.close()


def status(a, rank, applied, step, msg="", stage=0):
    return pb.CommandStatus(command_id=a.action_id, run_id="r", rank=rank, applied=applied, step=step, message=msg,
                            stage=stage, micro_batch=2, micro_batches=8, source_key=f"src-{rank}@1")


def test_every_rank_applied(svc):
    a = svc.propose("r", "micro_batch", 2, by="person:t", approve=True)
    assert a.state == "approved" and a.previous_value == 4
    svc.on_status(status(a, 0, False, -1, "received", stage=1))
    assert a.state == "received"
    for r in range(3):
        svc.on_status(status(a, r, True, 20))
    assert a.state == "applied" and a.step == 20 and "all 3 ranks at step 20" in a.outcome
    assert svc.shape("r").micro_batch == 2 and svc.shape("r").micro_batches == 8
    svc.flush()  # written off the event loop, in batches
    row = svc._cur.execute("SELECT state, ranks_applied FROM actions WHERE action_id = ?", [a.action_id]).fetchone()
    assert row == ("applied", 3)


def test_one_refusal_is_rejected_and_undone_elsewhere(svc):
    a = svc.propose("r", "micro_batch", 2, by="person:t", approve=True)
    svc.on_status(status(a, 2, False, 30, "out of memory here"))
    svc.on_status(status(a, 0, False, 30, "undone", stage=2))
    assert a.state == "received" and "2 of 3" in a.outcome
    svc.on_status(status(a, 1, False, 30, "undone", stage=2))
    assert a.state == "rejected" and "rank 2: out of memory here" in a.outcome and a.ranks_undone == 2
    assert svc.shape("r").micro_batch == 4  # nothing in force


def test_a_failed_undo_is_inconsistent(svc):
    a = svc.propose("r", "micro_batch", 2, by="person:t", approve=True)
    svc.on_status(status(a, 2, False, 30, "refused"))
    svc.on_status(status(a, 0, False, 30, "undone", stage=2))
    svc.on_status(status(a, 1, False, 30, "undo failed: boom", stage=3))
    assert a.state == "inconsistent" and "boom" in a.outcome


def test_not_received_before_it_expired_is_lost_and_late_reports_still_count(svc):
    a = svc.propose("r", "micro_batch", 2, by="person:t", approve=True)
    svc.clock.ns += 12 * S
    assert svc.sweep() == []  # within the grace for reports in flight
    svc.clock.ns += 2 * S
    assert [x.action_id for x in svc.sweep()] == [a.action_id]
    assert a.state == "lost" and "rank 0 never subscribed" in a.outcome and "nothing was applied" in a.outcome
    with pytest.raises(Exception, match="only a proposal"):
        svc.approve(a.action_id, "person:t")
    for r in range(3):  # the truth wins if the ranks did apply it after all
        svc.on_status(status(a, r, True, 40))
    assert a.state == "applied" and "after it was marked lost" in a.outcome


def test_rank_0_dropping_an_expired_command_makes_it_lost(svc):
    a = svc.propose("r", "micro_batch", 2, by="person:t", approve=True)
    svc.on_status(status(a, 0, False, -1, "expired at rank 0 before a step boundary came"))
    assert a.state == "lost" and "expired at rank 0" in a.outcome


def test_ranks_that_never_report_make_it_incomplete_and_free_the_run(svc):
    a = svc.propose("r", "micro_batch", 2, by="person:t", approve=True)
    svc.on_status(status(a, 0, True, 50))
    with pytest.raises(Exception, match="one change at a time"):
        svc.propose("r", "micro_batch", 1, by="person:t", approve=True)
    svc.clock.ns += 25 * S
    svc.sweep()
    assert a.state == "incomplete" and "ranks [1, 2] never did" in a.outcome
    assert svc.propose("r", "micro_batch", 1, by="person:t", approve=True).state == "approved"


def test_rollback_is_a_new_action_and_marks_the_original(svc):
    a = svc.propose("r", "micro_batch", 2, by="person:t", approve=True)
    for r in range(3):
        svc.on_status(status(a, r, True, 20))
    b = svc.rollback(a.action_id, "person:t")
    assert (b.kind, b.value, b.rollback_of, b.state) == ("micro_batch", 4, a.action_id, "approved")
    for r in range(3):
        svc.on_status(status(b, r, True, 30))
    assert a.state == "rolled_back" and f"action {b.action_id} at step 30" in a.verification
    with pytest.raises(Exception, match="only an applied action"):
        svc.rollback(a.action_id, "person:t")


def test_forged_reports_never_count_toward_applied_on_all_ranks(svc):
    a = svc.propose("r", "micro_batch", 2, by="person:t", approve=True)
    svc.note_source("other-run-rank@9", "other", 2, svc.clock.ns)
    forged = [
        pb.CommandStatus(command_id=a.action_id, run_id="r", rank=7, applied=True, step=20, source_key="src-0@1"),
        pb.CommandStatus(command_id=a.action_id, run_id="r", rank=65535, applied=True, step=20, source_key="x@1"),
        pb.CommandStatus(command_id=a.action_id, run_id="r", rank=2, applied=True, step=20, source_key="never-heard@5"),
        pb.CommandStatus(command_id=a.action_id, run_id="r", rank=2, applied=True, step=20, source_key="src-1@1"),
        pb.CommandStatus(command_id=a.action_id, run_id="r", rank=2, applied=True, step=20, source_key=""),
        pb.CommandStatus(command_id=a.action_id, run_id="r", rank=2, applied=True, step=20,
                         source_key="other-run-rank@9"),
    ]
    svc.on_status(status(a, 0, True, 20))
    svc.on_status(status(a, 1, True, 20))
    for f in forged:
        svc.on_status(f)
    assert a.state == "received" and a.ranks_applied == 2 and "2 of 3" in a.outcome
    assert svc.counts["reports_refused"] == len(forged) and svc.counts["reports"] == 2
    svc.on_status(status(a, 2, True, 20))  # the real rank 2
    assert a.state == "applied"
    svc.flush()
    ranks = svc._cur.execute("SELECT rank FROM action_ranks WHERE action_id = ? ORDER BY rank",
                             [a.action_id]).fetchall()
    assert ranks == [(0,), (1,), (2,)], "a forged report reached the file"


def test_a_restarted_job_under_the_same_run_id_is_not_handed_its_predecessors_command(svc):
    import asyncio

    a = svc.propose("r", "micro_batch", 2, by="person:t", approve=True)
    svc.clock.ns += S
    svc.note_source("src-0@2", "r", 0, svc.clock.ns)  # rank 0 again: a new start, heard after the approval
    got = asyncio.run(svc.Poll(pb.SubscribeRequest(run_id="r", rank=0, source_key="src-0@2"), None))
    assert list(got.commands) == []
    assert a.state == "lost" and "restarted" in a.outcome and svc.counts["commands_withheld"] == 1
    # a start not heard yet is handed nothing (it may be the next job): the command waits
    b = svc.propose("r", "micro_batch", 1, by="person:t", approve=True)
    got = asyncio.run(svc.Poll(pb.SubscribeRequest(run_id="r", rank=0, source_key="src-0@3"), None))
    assert list(got.commands) == [] and b.state == "approved"
    # the start it was meant for has it
    got = asyncio.run(svc.Poll(pb.SubscribeRequest(run_id="r", rank=0, source_key="src-0@2"), None))
    assert [c.command_id for c in got.commands] == [b.action_id]


def test_reports_are_written_off_the_calling_thread_in_batches():
    """A command to 16,384 ranks: the reports fold into the action at once on the caller's thread
    (the event loop), and reach the file in a few transactions of the writing thread."""
    import time

    con = open_store(":memory:")
    n = 16_384
    con.execute("INSERT INTO run_start (run_id, rank, world_size, dp, pp, zero_stage, micro_batch, micro_batches) "
                "SELECT 'big', range, ?, ?, 1, 1, 4, 4 FROM range(?)", [n, n, n])
    clock = Clock()
    svc = ControlService(con, ttl_s=10, clock_ns=clock)
    try:
        for rank in range(n):
            svc.note_source(f"s{rank}@1", "big", rank, clock.ns - S)
        a = svc.propose("big", "micro_batch", 2, by="person:t", approve=True)
        t0 = time.perf_counter()
        for rank in range(n):
            svc.on_status(pb.CommandStatus(command_id=a.action_id, run_id="big", rank=rank, applied=True, step=5,
                                           source_key=f"s{rank}@1"))
        on_loop_s = time.perf_counter() - t0
        assert a.state == "applied" and a.ranks_applied == n
        svc.flush()
        stored = con.execute("SELECT count(*) FROM action_ranks WHERE run_id = 'big'").fetchone()[0]
        assert stored == n
        assert svc.counts["writes"] < n / 100, f"{svc.counts['writes']} transactions for {n} reports"
        # one statement a report took ~1 ms each on the loop; folding in memory takes microseconds
        assert on_loop_s < 10.0, f"{n} reports held the caller {on_loop_s:.1f} s"
    finally:
        svc.close()
        con.close()
