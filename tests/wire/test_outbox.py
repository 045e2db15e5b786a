"""The unacked book and the drop ledger as plain state: no threads, no transport, step by step."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tracetop.events import SCHEMAS, Kind
from tracetop.wire.codec import encode_batch
from tracetop.wire.ledger import DropLedger
from tracetop.wire.outbox import Outbox


def _batch(seq: int, n: int = 100, source: str = "hook"):
    cols = {c.name: (["x"] * n if c.dtype == "str" else np.full(n, seq)) for c in SCHEMAS[Kind.STEP]}
    return encode_batch(Kind.STEP, cols, source_id=source, seq=seq, run_id="ob")


def _gap_batch(seq: int, rows: list[tuple[str, str, str, int]], source: str = "me"):
    n = len(rows)
    cols = {
        "rank": np.zeros(n, "<i4"), "step": np.full(n, -1), "start_ns": np.zeros(n), "duration_ns": np.zeros(n),
        "kind": [r[0] for r in rows], "reason": [r[1] for r in rows], "origin_source": [r[2] for r in rows],
        "dropped": np.array([r[3] for r in rows]),
    }
    return encode_batch(Kind.GAP, cols, source_id=source, seq=seq, run_id="ob")


def _book(size_batches: float) -> tuple[Outbox, DropLedger, int]:
    one = _batch(1).ByteSize()
    ledger = DropLedger()
    return Outbox(ledger, int(size_batches * one)), ledger, one


def _add(ob: Outbox, seq: int, n: int = 100, spool: Path | None = None, own: bool = False):
    b = _batch(seq, n)
    return ob.add(b, b.ByteSize(), spool, own)


def _drain(ob: Outbox, epoch: int) -> list[int]:
    sent = []
    while (e := ob.next_due(epoch)) is not None:
        sent.append(e.seq)
    return sent


def test_cumulative_acks_and_a_resend_of_everything_unacked_oldest_first() -> None:
    ob, ledger, _ = _book(100)
    for seq in (1, 2, 3, 4):
        _add(ob, seq)
    assert _add(ob, 2) is None, "a batch already booked is a resend, not new data"
    epoch = ob.new_epoch()
    assert _drain(ob, epoch) == [1, 2, 3, 4]
    assert [e.seq for e in ob.ack("hook", 2)] == [1, 2]
    assert ob.unacked_through(4) and not ob.unacked_through(2) and len(ob) == 2
    ob.end_stream(epoch)
    assert ob.next_due(epoch) is None, "nothing more goes out on a stream that ended"
    assert _drain(ob, ob.new_epoch()) == [3, 4]
    ob.ack("hook", 4)
    assert len(ob) == 0 and not ob.unacked_through(ob.enqueued) and ob.unacked_bytes == 0 and ob.mem_bytes == 0
    assert ledger.counters()["rows_dropped"] == 0 and not ledger


def test_the_budget_drops_the_oldest_unsent_memory_batch_and_the_ledger_counts_it() -> None:
    ob, ledger, one = _book(3.5)
    _add(ob, 1, spool=Path("/spool/1"))  # spooled: never dropped for the budget
    _add(ob, 2, n=100)
    _add(ob, 3)
    _add(ob, 4)  # 4 batches in memory > 3.5: the oldest memory-only one (2) goes
    assert [k[1] for k in ob.unacked] == [1, 3, 4]
    assert ledger.take() == {("step", "unacked_full", "hook"): 100}
    c = ledger.counters()
    assert c["rows_dropped"] == 100 and c["batches_dropped"] == 1 and c["dropped_by_reason"] == {"unacked_full": 100}
    assert ob.mem_bytes == 3 * one


def test_past_the_budget_a_spooled_batch_keeps_only_its_metadata_in_memory() -> None:
    ob, ledger, one = _book(1.5)
    a = _add(ob, 1, spool=Path("/spool/1"))
    b = _add(ob, 2, spool=Path("/spool/2"))
    assert a is not None and a.batch is not None
    assert b is not None and b.batch is None, "the spool holds it; it is read back when sent"
    assert ob.mem_bytes == one and ob.unacked_bytes == 2 * one and not ledger


def test_a_batch_dropped_in_flight_waits_in_limbo_and_an_ack_clears_it() -> None:
    ob, ledger, _ = _book(1.5)
    _add(ob, 1, n=100)
    epoch = ob.new_epoch()
    assert _drain(ob, epoch) == [1]  # on the wire
    _add(ob, 2)  # over budget: 1 is dropped, but the receiver may have it
    assert 1 in ob.limbo["hook"] and not ledger, "not counted while its stream may still ack it"
    ob.ack("hook", 1)
    ob.end_stream(epoch)
    assert not ledger and ledger.counters()["dropped_by_reason"] == {}, "stored after all: no gap"


def test_a_stream_that_ends_with_batches_in_limbo_counts_them_lost_exactly() -> None:
    ob, ledger, _ = _book(1.5)
    _add(ob, 1, n=100)
    epoch = ob.new_epoch()
    _drain(ob, epoch)
    _add(ob, 2, n=100)
    ob.end_stream(epoch)
    assert ledger.take() == {("step", "unacked_full", "hook"): 100}
    assert _drain(ob, ob.new_epoch()) == [2], "the limbo batch is never resent"


def test_a_named_rejection_drops_that_batch_for_good() -> None:
    ob, ledger, _ = _book(100)
    for seq in (1, 2, 3):
        _add(ob, seq, n=10 * seq)
    epoch = ob.new_epoch()
    _drain(ob, epoch)
    e = ob.reject("crc32c", "hook", 2)
    assert e is not None and e.seq == 2
    ob.end_stream(epoch)
    assert ledger.take() == {("step", "rejected:crc32c", "hook"): 20}
    assert ledger.counters()["batches_rejected"] == 1
    assert _drain(ob, ob.new_epoch()) == [1, 3]


def test_an_unnamed_rejection_blames_the_first_batch_sent_and_not_acked() -> None:
    """Receivers ack every batch before the one they refuse, so that one is the first unacked."""
    ob, ledger, _ = _book(100)
    for seq in (1, 2, 3, 4):
        _add(ob, seq, n=10 * seq)
    epoch = ob.new_epoch()
    _drain(ob, epoch)
    ob.ack("hook", 2)
    e = ob.reject("not_a_batch")
    assert e is not None and e.seq == 3
    ob.end_stream(epoch)
    assert ledger.take() == {("step", "rejected:not_a_batch", "hook"): 30}
    assert _drain(ob, ob.new_epoch()) == [4]


def test_a_rejected_limbo_batch_is_counted_once_as_rejected() -> None:
    ob, ledger, _ = _book(1.5)
    _add(ob, 1, n=100)
    epoch = ob.new_epoch()
    _drain(ob, epoch)
    _add(ob, 2)  # 1 into limbo
    assert ob.reject("crc32c") is not None  # the unnamed culprit is the limbo batch
    ob.end_stream(epoch)
    assert ledger.take() == {("step", "rejected:crc32c", "hook"): 100}


def test_an_own_gap_batch_dropped_for_the_budget_folds_back_into_the_next_gap_row() -> None:
    gap = _gap_batch(1, [("step", "queue_full", "me", 7), ("collective", "bad_row", "me", 2)])
    one = _batch(1).ByteSize()
    ledger = DropLedger()
    ledger.note("step", "queue_full", "me", 7)
    ledger.note("collective", "bad_row", "me", 2)
    ledger.take()  # sealed into `gap`
    ob = Outbox(ledger, one)
    ob.add(gap, gap.ByteSize(), None, own=True)
    _add(ob, 5)  # over budget: the gap batch goes
    assert ledger.take() == {("step", "queue_full", "me"): 7, ("collective", "bad_row", "me"): 2}
    assert ledger.counters()["rows_dropped"] == 9, "refolded counts are not counted twice"


def test_the_ledger_gives_gap_rows_and_counters_from_one_place() -> None:
    ledger = DropLedger()
    ledger.note("step", "queue_full", "a", 5)
    ledger.note("step", "queue_full", "a", 3)
    ledger.note_batch(int(Kind.COLLECTIVE), "rejected:crc32c", "b", 40)
    ledger.note("batch", "spool_unreadable", "c", 1, batches=1)
    cols = ledger.columns(now_ns=123, rank=4)
    assert cols is not None and ledger.columns(0, 0) is None
    rows = sorted(zip(cols["kind"], cols["reason"], cols["origin_source"], cols["dropped"].tolist()))
    assert rows == [("batch", "spool_unreadable", "c", 1), ("collective", "rejected:crc32c", "b", 40),
                    ("step", "queue_full", "a", 8)]
    assert set(cols["rank"].tolist()) == {4} and set(cols["start_ns"].tolist()) == {123}
    c = ledger.counters()
    assert c["dropped_by_reason"] == {"queue_full": 8, "rejected:crc32c": 40, "spool_unreadable": 1}
    assert c["rows_dropped"] == 48, "an unknown-size batch counts as a batch, not as rows"
    assert c["batches_rejected"] == 1 and c["batches_dropped"] == 1
