"""The shipper's disk spool: what forward() accepted survives the process and is replayed once."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np

from tracetop.events import SCHEMAS, Kind
from tracetop.wire.codec import encode_batch
from tracetop.wire.shipper import MemoryTransport, Shipper


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _batch(source: str, seq: int, n: int = 100):
    cols = {c.name: (["x"] * n if c.dtype == "str" else np.full(n, seq)) for c in SCHEMAS[Kind.STEP]}
    return encode_batch(Kind.STEP, cols, source_id=source, seq=seq, run_id="sp")


def test_forwarded_batches_are_replayed_from_the_spool_after_a_restart(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    first = Shipper(_dead_address(), run_id="sp", spool_dir=spool)
    for seq in range(1, 21):
        assert first.forward(_batch("hook-a", seq))
    for seq in range(1, 6):
        assert first.forward(_batch("hook-b", seq))
    first.close(timeout_s=0.2)  # nothing acked: everything stays on disk
    assert len(list(spool.rglob("*.batch"))) == 25

    sink = MemoryTransport()
    second = Shipper(None, run_id="sp", spool_dir=spool, transport=sink)
    assert second.flush(10)
    second.close()
    got = sorted((b.source_id, b.seq) for b in sink.batches)
    assert got == sorted([("hook-a", s) for s in range(1, 21)] + [("hook-b", s) for s in range(1, 6)])
    assert list(spool.rglob("*.batch")) == [], "acked batches must leave the spool"


def test_a_full_spool_refuses_instead_of_dropping(tmp_path: Path) -> None:
    one = _batch("hook", 1).ByteSize()
    s = Shipper(_dead_address(), run_id="sp", spool_dir=tmp_path, spool_max_bytes=3 * one + one // 2)
    accepted = [s.forward(_batch("hook", seq)) for seq in range(1, 6)]
    assert accepted == [True, True, True, False, False]
    assert s.stats()["spool_full"] == 2
    s.close(timeout_s=0.2)
    assert len(list(tmp_path.rglob("*.batch"))) == 3


def test_forwarding_the_same_batch_twice_spools_it_once(tmp_path: Path) -> None:
    s = Shipper(_dead_address(), run_id="sp", spool_dir=tmp_path)
    b = _batch("hook", 1)
    assert s.forward(b) and s.forward(b)
    assert s.stats()["spool_bytes"] == b.ByteSize(), "a resend must not count against the spool twice"
    assert s.stats()["unacked_batches"] == 1
    s.close(timeout_s=0.2)
    second = Shipper(None, run_id="sp", spool_dir=tmp_path, transport=MemoryTransport())
    assert second.replayed_high_water == {"hook": 1}
    second.close()
