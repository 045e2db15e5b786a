"""One test per way the shipper can lose rows: each loss arrives as GAP rows with its reason and
exactly the rows lost, the counters in stats() say the same (one ledger), and nothing is resent
forever. The receiver is the in-memory transport, scripted to refuse, break and ack late."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np

from tracetop.events import SCHEMAS, Kind
from tracetop.wire.codec import decode_batch, encode_batch
from tracetop.wire.shipper import MemoryTransport, Shipper


def _batch(seq: int, n: int = 1000, source: str = "hook"):
    cols = {c.name: (["x"] * n if c.dtype == "str" else np.full(n, seq)) for c in SCHEMAS[Kind.STEP]}
    return encode_batch(Kind.STEP, cols, source_id=source, seq=seq, run_id="loss")


def _heartbeat(i: int) -> tuple:
    return (0, i, 1_000 + i, 0, "fwd", "", "", -1, "host", 7)


def _gaps(mem: MemoryTransport) -> dict[tuple[str, str, str], int]:
    g = mem.rows(Kind.GAP)
    out: Counter = Counter()
    for kind, reason, origin, dropped in zip(g["kind"], g["reason"], g["origin_source"], g["dropped"].tolist()):
        out[(kind, reason, origin)] += dropped
    return dict(out)


def _stored(mem: MemoryTransport, source: str = "hook") -> list[int]:
    return [b.seq for b in mem.batches if b.source_id == source]


def _close_and_check(s: Shipper, mem: MemoryTransport, expected: dict[tuple[str, str, str], int]) -> None:
    """Flush, then: the GAP rows are exactly `expected`, and stats() counts the same per reason."""
    assert s.flush(20), s.stats()
    s.close()  # flushes again: a loss found while the last batches went out ships its gap row now
    st = s.stats()
    assert _gaps(mem) == expected
    by_reason: Counter = Counter()
    for (_, reason, _), n in expected.items():
        by_reason[reason] += n
    assert st["dropped_by_reason"] == dict(by_reason), "the counters and the GAP rows come from one ledger"
    assert st["gap_rows"] == len(mem.rows(Kind.GAP)["kind"])


def _shipper(mem: MemoryTransport, **kw) -> Shipper:
    kw.setdefault("flush_interval_s", 0.02)
    return Shipper(None, run_id="loss", source_id="me", transport=mem, **kw)


def test_full_buffer_queue_full() -> None:
    mem = MemoryTransport()
    s = _shipper(mem, max_pending_rows=50, flush_rows=10**9, flush_interval_s=60)
    for i in range(80):
        s.record(Kind.HEARTBEAT, *_heartbeat(i))
    _close_and_check(s, mem, {("heartbeat", "queue_full", "me"): 30})
    assert sorted(mem.rows(Kind.HEARTBEAT)["step"].tolist()) == list(range(30, 80))


def test_unacked_budget_unacked_full() -> None:
    """The receiver is unreachable: past the budget the oldest unsent batch is dropped."""
    one = _batch(1).ByteSize()
    mem = MemoryTransport()
    mem.reachable = False
    s = _shipper(mem, max_unacked_bytes=int(1.5 * one))
    assert s.forward(_batch(1, n=1000))
    assert s.forward(_batch(2, n=1000))  # over budget: 1 goes (it was never on a wire)
    mem.reachable = True
    _close_and_check(s, mem, {("step", "unacked_full", "hook"): 1000})
    assert _stored(mem) == [2]
    assert ("hook", 1) not in mem.received, "a dropped batch is never sent"


def test_stream_ended_in_limbo_counts_what_was_in_flight() -> None:
    """A batch dropped for the budget while in flight waits for its ack; the stream breaks before
    the receiver stored it: counted lost then (unacked_full), never resent."""
    one = _batch(1).ByteSize()
    mem = MemoryTransport()
    mem.hold_acks()
    s = _shipper(mem, max_unacked_bytes=int(1.5 * one), burst_linger_s=None)
    assert s.forward(_batch(1, n=1000))
    assert mem.wait_received(1)  # 1 is on the wire, not yet stored
    assert s.forward(_batch(2, n=1000))  # over budget: 1 goes to limbo
    assert s.stats()["dropped_by_reason"] == {}, "not counted while an ack may still come"
    assert mem.wait_received(2)
    mem.disconnect()  # the receiver dies: what it held uncommitted is gone
    _close_and_check(s, mem, {("step", "unacked_full", "hook"): 1000})
    assert _stored(mem) == [2], "2 was unacked: resent on the next stream and stored"
    assert mem.received.count(("hook", 1)) == 1


def test_limbo_acked_late_is_no_loss() -> None:
    one = _batch(1).ByteSize()
    mem = MemoryTransport()
    mem.hold_acks()
    s = _shipper(mem, max_unacked_bytes=int(1.5 * one), burst_linger_s=None)
    assert s.forward(_batch(1, n=1000))
    assert mem.wait_received(1)
    assert s.forward(_batch(2, n=1000))  # 1 to limbo
    assert mem.wait_received(2)
    mem.release_acks()  # stored after all
    _close_and_check(s, mem, {})
    assert _stored(mem) == [1, 2]


def test_a_batch_the_receiver_rejects_naming_it() -> None:
    mem = MemoryTransport()
    s = _shipper(mem)
    bad = _batch(1, n=300)
    bad.crc32c ^= 1  # corrupt in transit: the receiver refuses it, naming it (tracetop-rejected-*)
    assert s.forward(bad)
    assert s.forward(_batch(2, n=1000))
    _close_and_check(s, mem, {("step", "rejected:crc32c", "hook"): 300})
    assert _stored(mem) == [2]
    assert mem.received.count(("hook", 1)) == 1, "a rejected batch is not resent"


def test_a_rejection_without_metadata_drops_the_first_unacked_batch_not_all_forever() -> None:
    mem = MemoryTransport()
    s = _shipper(mem)
    assert s.forward(_batch(1, n=100))
    assert s.flush(10)
    mem.refuse(1, fault="not_a_batch", name_batch=False)  # the receiver cannot say which batch
    for seq in (2, 3, 4):
        assert s.forward(_batch(seq, n=10 * seq))
    _close_and_check(s, mem, {("step", "rejected:not_a_batch", "hook"): 20})
    assert _stored(mem) == [1, 3, 4]
    assert mem.received.count(("hook", 2)) == 1


def test_a_refusing_transport() -> None:
    """A send()-style transport that raises refuses that batch: dropped with a gap, not resent."""
    sink = MemoryTransport()  # where Refusing keeps what it takes (rows() reads it back)
    calls: Counter = Counter()

    class Refusing:  # only send(): the shipper adapts it to the stream protocol
        def send(self, batch) -> None:
            calls[batch.seq] += 1
            if batch.source_id == "hook" and batch.seq == 2:
                raise RuntimeError("the sink is closed for seq 2")
            sink.batches.append(decode_batch(batch))

    s = _shipper(Refusing())  # type: ignore[arg-type]
    for seq in (1, 2, 3):
        assert s.forward(_batch(seq, n=100 * seq))
    _close_and_check(s, sink, {("step", "rejected:transport", "hook"): 200})
    assert calls[2] == 1, "refused once, never resent"
    assert _stored(sink) == [1, 3]


def _spool_three(spool: Path) -> list[int]:
    """A shipper that never reached anyone left hook 1..3 on its spool; their sizes in rows."""
    dead = MemoryTransport()
    dead.reachable = False
    first = Shipper(None, run_id="loss", transport=dead, spool_dir=spool)
    rows = [100, 200, 300]
    for seq, n in zip((1, 2, 3), rows):
        assert first.forward(_batch(seq, n=n))
    first.close(timeout_s=0.1)
    return rows


def test_a_corrupt_spool_file_found_at_start(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    _spool_three(spool)
    f = spool / "hook" / f"{2:020d}.batch"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # torn in the columns
    mem = MemoryTransport()
    s = _shipper(mem, spool_dir=spool)
    assert s.replayed_high_water == {"hook": 3}, "its seq was accepted once: a resend is a duplicate"
    _close_and_check(s, mem, {("step", "spool_unreadable", "hook"): 200})
    assert _stored(mem) == [1, 3]
    assert list(spool.rglob("*.batch")) == [] and (spool / "hook" / f"{2:020d}.batch.unreadable").exists()
    again = MemoryTransport()
    _close_and_check(_shipper(again, spool_dir=spool), again, {})  # set aside: counted once only


def test_a_spool_file_without_even_a_header_counts_one_batch(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    _spool_three(spool)
    (spool / "hook" / f"{3:020d}.batch").write_bytes(b"\xff" * 16)
    mem = MemoryTransport()
    s = _shipper(mem, spool_dir=spool)
    _close_and_check(s, mem, {("batch", "spool_unreadable", "hook"): 1})
    assert _stored(mem) == [1, 2]
    assert s.stats()["rows_dropped"] == 0, "a batch of unknown size is not counted as rows"


def test_a_spool_file_that_cannot_be_read_back_when_due(tmp_path: Path) -> None:
    """Past the memory budget only the spool holds a batch; if that copy is gone when it is due,
    the batch is lost (its kind and rows are known from its booking) and the rest goes on."""
    one = _batch(1).ByteSize()
    mem = MemoryTransport()
    mem.reachable = False
    s = _shipper(mem, spool_dir=tmp_path, max_unacked_bytes=int(1.5 * one))
    assert s.forward(_batch(1, n=1000))
    assert s.forward(_batch(2, n=1000))  # spool-only
    (tmp_path / "hook" / f"{2:020d}.batch").write_bytes(b"torn")
    mem.reachable = True
    _close_and_check(s, mem, {("step", "spool_unreadable", "hook"): 1000})
    assert _stored(mem) == [1]


def test_resend_after_a_broken_stream_stores_each_batch_once() -> None:
    mem = MemoryTransport()
    mem.disconnect_after(2)  # 1 and 2 stored and acked, 3 lost on the wire, the stream breaks
    s = _shipper(mem, burst_linger_s=None)
    for seq in range(1, 6):
        assert s.forward(_batch(seq, n=10))
    _close_and_check(s, mem, {})
    assert _stored(mem) == [1, 2, 3, 4, 5]
    assert mem.streams >= 2 and mem.duplicates == 0
    assert s.stats()["reconnects"] >= 1


def _hb_batch_bytes(n: int) -> int:
    cols = {c.name: (["x"] * n if c.dtype == "str" else np.arange(n)) for c in SCHEMAS[Kind.HEARTBEAT]}
    return encode_batch(Kind.HEARTBEAT, cols, source_id="hook-1", seq=1, run_id="loss").ByteSize()


def test_full_spool_refusal_is_not_a_loss_and_the_hooks_drops_count_exactly(tmp_path: Path) -> None:
    """A hook ships through the agent relay while the collector is down and the agent's spool fills:
    the relay refuses (the hook keeps the batch and resends it), the hook's small unacked budget
    makes it drop its oldest batches. When the collector is back, every row the hook recorded is
    either stored once or in exactly one GAP row (the hook's own unacked_full); a refusal adds none.
    (The relay once recorded each refused batch as a spool_full GAP row: refused-then-stored rows
    were counted lost, and refused-then-dropped rows twice.)"""
    from agent.relay import Relay

    rows_per_batch, batches = 100, 30
    size = _hb_batch_bytes(rows_per_batch)
    mem = MemoryTransport()
    mem.reachable = False  # the collector is down: the agent's spool fills
    agent = _shipper(mem, spool_dir=tmp_path / "spool", spool_max_bytes=int(2.5 * size), reconnect_max_s=0.05)
    sock = f"unix://{tmp_path / 'relay.sock'}"
    relay = Relay(agent, [sock]).start()
    # the hook seals batches of about budget/8 bytes: ~100 rows, ~8 of them in memory at most
    hook = Shipper(sock, run_id="loss", source_id="hook-1", flush_rows=rows_per_batch, flush_interval_s=0.05,
                   reconnect_max_s=0.05, max_unacked_bytes=8 * size)
    try:
        for i in range(rows_per_batch * batches):
            hook.record(Kind.HEARTBEAT, *_heartbeat(i))
        deadline = time.monotonic() + 30
        while relay.stats()["spool_full"] < 2 or hook.stats()["rows_dropped"] == 0:
            assert time.monotonic() < deadline, (relay.stats(), hook.stats())
            time.sleep(0.02)
        mem.reachable = True  # the collector is back: the spool drains, the refused batches go in
        assert hook.flush(30), hook.stats()
        assert agent.flush(30), agent.stats()
        hs = hook.stats()
    finally:
        hook.close(5.0)
        relay.stop(0.1)
    agent.close(5.0)
    stored = mem.rows(Kind.HEARTBEAT)["step"].tolist()
    assert len(stored) == len(set(stored)) and mem.duplicates == 0
    gaps = _gaps(mem)
    assert not [k for k in gaps if k[1] == "spool_full"], gaps
    # the only recorded loss is the hook's own, exactly what it dropped, and it accounts for every missing row
    assert gaps == {("heartbeat", "unacked_full", "hook-1"): hs["rows_dropped"]}
    assert len(stored) + hs["rows_dropped"] == rows_per_batch * batches
    assert 0 < hs["rows_dropped"] < rows_per_batch * batches
