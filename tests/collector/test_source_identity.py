"""A source cannot be silenced: not by a caller claiming its id with a seq far ahead, nor by its own
restart with a fixed source_id. Real collector process, real gRPC, real DuckDB."""

from __future__ import annotations

from pathlib import Path

import duckdb
import grpc

from tests.collector.util import batch
from tests.support.services import start_collector
from tracetop.events import Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc
from tracetop.wire.shipper import Shipper


def _record_steps(s: Shipper, steps: range, rank: int = 0) -> None:
    from tracetop.events import SCHEMAS

    names = [c.name for c in SCHEMAS[Kind.STEP]]
    for st in steps:
        row = dict.fromkeys(names, 0)
        row.update(rank=rank, step=st)
        s.record(Kind.STEP, *(row[n] for n in names))


def _stored_steps(db: Path, run: str) -> list[int]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return [r[0] for r in con.execute("SELECT step FROM step WHERE run_id = ? ORDER BY step", [run]).fetchall()]
    finally:
        con.close()


def test_a_seq_far_ahead_is_refused_and_the_real_source_keeps_storing(tmp_path: Path) -> None:
    c = start_collector(tmp_path)
    try:
        s = Shipper(c.addr, run_id="victim", flush_interval_s=60)
        _record_steps(s, range(0, 10))
        assert s.flush(30)
        # another caller, knowing the source's id and even its epoch, claims seq 2^63
        forged = batch(s.source_id, 1 << 63, 10, run_id="victim")
        forged.epoch = s.epoch
        with grpc.insecure_channel(c.addr) as ch:
            reply = pb_grpc.IngestStub(ch).Push(pb.PushRequest(batches=[forged.SerializeToString()]), timeout=30)
        assert reply.end_code == "INVALID_ARGUMENT", reply
        assert reply.end_metadata["tracetop-fault"] == "seq_ahead"
        assert "ahead" in reply.end_message and "restart" in reply.end_message, reply.end_message
        assert not reply.acks or all(a.seq < (1 << 63) for a in reply.acks)
        # the real source goes on, and is stored
        _record_steps(s, range(10, 20))
        assert s.flush(30)
        stats = s.stats()
        s.close()
        assert stats["rows_dropped"] == 0, stats
    finally:
        assert c.stop() == 0
    assert _stored_steps(c.db, "victim") == list(range(20)), "batches after the forged one were dropped"


def test_a_shipper_restarted_with_a_fixed_source_id_is_stored(tmp_path: Path) -> None:
    c = start_collector(tmp_path)
    try:
        first = Shipper(c.addr, run_id="fixed", source_id="rank-0-fixed", flush_interval_s=60)
        _record_steps(first, range(0, 10))
        assert first.flush(30)
        first.close()
        # the same source id again: its seqs start from 1 again
        second = Shipper(c.addr, run_id="fixed", source_id="rank-0-fixed", flush_interval_s=60)
        assert second.epoch != first.epoch
        _record_steps(second, range(10, 20))
        assert second.flush(30)
        second.close()
    finally:
        assert c.stop() == 0
    assert _stored_steps(c.db, "fixed") == list(range(20)), "the restarted shipper's batches were taken for resends"
