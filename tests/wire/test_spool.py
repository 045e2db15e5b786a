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


def test_a_disk_that_refuses_spool_writes_loses_nothing_and_leaves_nothing(tmp_path: Path) -> None:
    """EFBIG (RLIMIT_FSIZE; a full disk's ENOSPC takes the same path): the shipper's own batches stay
    in memory and arrive, the relay refuses the hook's (which keeps and resends them), no tmp file
    is left and the failed sizes are not counted, so once the disk takes writes again everything
    flows (the relay does not answer "spool full" forever). Real collector, relay and shippers."""
    import json
    import subprocess
    import sys

    import duckdb

    from tests.support import ROOT
    from tests.support.services import start_collector

    c = start_collector(tmp_path)
    try:
        r = subprocess.run([sys.executable, "-m", "tests.wire.disk_full_proc", c.addr, str(tmp_path / "spool"),
                            str(tmp_path / "relay.sock")], cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        assert c.stop() == 0
    assert out["spool_write_errors"] >= 1, out
    assert out["tmp_files"] == [], out
    assert out["spool_bytes_while_full"] == 0, out
    assert out["own_flushed_while_full"], out  # kept in memory, delivered
    assert not out["hook_flushed_while_full"] and out["relay_refusals"] >= 1, out  # refused, kept by the hook
    assert out["hook_flushed_after"] and out["hook_flushed_more"] and out["own_flushed_after"], out
    assert out["hook_stats"]["rows_dropped"] == 0 and out["agent_stats"]["rows_dropped"] == 0, out
    assert out["agent_stats"]["spool_bytes"] == 0 and out["batch_files_left"] == 0, out
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        got = con.execute("SELECT rank, count(DISTINCT step) FROM step WHERE run_id = 'disk' GROUP BY rank ORDER BY rank").fetchall()
    finally:
        con.close()
    assert got == [(0, 100), (1, 100)], got


def test_the_spool_folder_is_fsynced_after_a_rename(tmp_path: Path, monkeypatch) -> None:
    import os

    from tracetop.wire.spool import Spool

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    spool = Spool(tmp_path / "spool", 1 << 20, fsync=True)
    path = spool.write(_batch("hook-z", 1), 100)
    assert path is not None and path.exists()
    assert str(path.parent) in synced, synced  # the folder, after the rename: the name is durable


def test_ids_that_name_no_folder_or_hide_a_newline_are_refused(tmp_path: Path) -> None:
    import pytest

    from tracetop.wire.codec import BatchError, decode_batch

    for bad in (".", "..", "run1\n", "a/b", ""):
        with pytest.raises(BatchError):
            decode_batch(encode_batch(Kind.STEP, {c.name: (["x"] if c.dtype == "str" else np.zeros(1)) for c in SCHEMAS[Kind.STEP]},
                                      source_id="ok", seq=1, run_id=bad))
        with pytest.raises(BatchError):
            decode_batch(_batch(bad, 1))
    decode_batch(_batch("...", 1))  # dots with more than two are a name
    decode_batch(_batch("a.b", 1))
