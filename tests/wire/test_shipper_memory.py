"""The shipper against the in-memory transport: rows arrive intact, drops become gap rows."""

from __future__ import annotations

import numpy as np

from tracetop.events import SCHEMAS, Kind
from tracetop.wire.shipper import MemoryTransport, NullShipper, Shipper


def _collective(i: int) -> tuple:
    return (i % 8, i, 1_000 + i, 10 * i, "all_reduce" if i % 2 else "send", "dp", 2, 4 * i, -1, "float32", 0)


def test_recorded_rows_arrive_once_and_intact() -> None:
    sink = MemoryTransport()
    s = Shipper(None, run_id="r", transport=sink, flush_rows=1000)
    n = 25_000
    for i in range(n):
        s.record(Kind.COLLECTIVE, *_collective(i))
    assert s.flush(10)
    s.close()
    rows = sink.rows(Kind.COLLECTIVE)
    order = np.argsort(rows["step"])
    np.testing.assert_array_equal(rows["step"][order], np.arange(n))
    np.testing.assert_array_equal(rows["bytes"][order], 4 * np.arange(n))
    assert rows["op"][order][:2].tolist() == ["send", "all_reduce"]
    seqs = [b.seq for b in sink.batches]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_bulk_columns_split_into_batches_that_fit() -> None:
    sink = MemoryTransport()
    s = Shipper(None, run_id="r", transport=sink)
    n = 200_000
    s.record_many(Kind.STEP, {c.name: np.arange(n) for c in SCHEMAS[Kind.STEP]})
    assert s.flush(10)
    s.close()
    assert len(sink.batches) > 1, "a 200k-row STEP bulk must be split under the 3 MiB batch cap"
    assert sum(b.n for b in sink.batches) == n
    assert max(b.nbytes for b in sink.batches) <= 3 << 20


def test_buffer_overflow_drops_oldest_and_ships_a_gap_row() -> None:
    sink = MemoryTransport()
    # a flush interval far away so the buffer overflows before any seal
    s = Shipper(None, run_id="r", transport=sink, max_pending_rows=100, flush_rows=10**9, flush_interval_s=60)
    for i in range(1000):
        s.record(Kind.COLLECTIVE, *_collective(i))
    assert s.flush(10)
    s.close()
    rows = sink.rows(Kind.COLLECTIVE)
    assert sorted(rows["step"].tolist()) == list(range(900, 1000)), "the newest rows are kept"
    gaps = sink.rows(Kind.GAP)
    assert gaps["dropped"].sum() == 900
    assert set(gaps["reason"].tolist()) == {"queue_full"}
    assert set(gaps["kind"].tolist()) == {"collective"}


def test_a_row_of_the_wrong_arity_is_dropped_and_counted_not_raised() -> None:
    sink = MemoryTransport()
    s = Shipper(None, run_id="r", transport=sink)
    s.record(Kind.STEP, 1, 2, 3)  # far too few values
    assert s.flush(10)
    s.close()
    assert len(sink.rows(Kind.STEP)["step"]) == 0
    gaps = sink.rows(Kind.GAP)
    assert gaps["reason"].tolist() == ["bad_row"] and gaps["dropped"].tolist() == [1]


def _collective_columns(steps: range, ops: list[str], roles: tuple) -> dict:
    n = len(steps)
    cols = {c.name: np.full(n, 7) for c in SCHEMAS[Kind.COLLECTIVE]}
    cols["step"] = np.array(steps)
    cols["op"] = [ops[i % len(ops)] for i in range(n)]  # plain strings
    cols["role"] = (np.arange(n, dtype="<i4") % len(roles[1]), list(roles[1])) if roles[0] else ["dp"] * n
    cols["dtype"] = ["float32"] * n
    return cols


def test_every_bulk_of_a_kind_since_the_last_seal_ships_as_one_batch() -> None:
    """The emitter hands over columns several times per shipment; each gRPC message costs the
    trainer CPU, so they go out as one batch, with one merged dictionary per string column."""
    sink = MemoryTransport()
    s = Shipper(None, run_id="r", transport=sink, flush_interval_s=60, flush_rows=10**6)
    s.record_many(Kind.COLLECTIVE, _collective_columns(range(0, 5), ["all_reduce", "send"], (True, ("tp", "dp"))))
    s.record_many(Kind.COLLECTIVE, _collective_columns(range(5, 12), ["recv", "all_reduce"], (True, ("pp", "tp", "dp"))))
    s.record_many(Kind.COLLECTIVE, _collective_columns(range(12, 15), ["broadcast"], (False, ())))
    assert s.flush(10)
    s.close()
    batches = [b for b in sink.batches if b.kind == Kind.COLLECTIVE]
    assert len(batches) == 1 and batches[0].n == 15
    rows = sink.rows(Kind.COLLECTIVE)
    assert rows["step"].tolist() == list(range(15))
    assert rows["op"].tolist() == [*["all_reduce", "send"] * 2, "all_reduce", *["recv", "all_reduce"] * 3, "recv",
                                   *["broadcast"] * 3]
    assert rows["role"].tolist() == [*"tp dp tp dp tp".split(), *"pp tp dp pp tp dp pp".split(), "dp", "dp", "dp"]


def test_a_malformed_bulk_is_dropped_and_counted_while_the_rest_ships() -> None:
    sink = MemoryTransport()
    s = Shipper(None, run_id="r", transport=sink, flush_interval_s=60, flush_rows=10**6)
    s.record_many(Kind.COLLECTIVE, _collective_columns(range(0, 4), ["send"], (False, ())))
    bad = _collective_columns(range(4, 10), ["send"], (False, ()))
    del bad["peer"]
    s.record_many(Kind.COLLECTIVE, bad)
    s.record_many(Kind.COLLECTIVE, _collective_columns(range(10, 13), ["recv"], (False, ())))
    assert s.flush(10)
    s.close()
    assert sorted(sink.rows(Kind.COLLECTIVE)["step"].tolist()) == [0, 1, 2, 3, 10, 11, 12]
    gaps = sink.rows(Kind.GAP)
    assert gaps["reason"].tolist() == ["bad_row"] and gaps["dropped"].tolist() == [6]


def test_null_shipper_accepts_everything_and_does_nothing() -> None:
    s = NullShipper()
    s.record(Kind.STEP, 1)
    assert s.flush() and s.stats() == {}
