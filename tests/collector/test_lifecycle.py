"""A real collector process on a unix socket: SIGTERM flushes and acks, kill -9 loses only unacked
batches, a restart on the same file keeps every source's high-water mark (exactly once)."""

from __future__ import annotations

import signal
import subprocess
import sys

import duckdb
import grpc

from tests.collector.util import Feeder, batch, scalar
from tests.support import ROOT
from tests.support.services import start_collector

N = 500
TOTAL = 60


def _stored(db) -> tuple[list[int], int, int]:
    """(seqs in ingest_log, rows in step, hwm) for source 'life', straight from the file."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        seqs = [r[0] for r in con.execute("SELECT seq FROM ingest_log WHERE source_id = 'life' ORDER BY seq").fetchall()]
        rows = con.execute("SELECT count(*) FROM step").fetchone()[0]
        hwm = con.execute("SELECT coalesce(max(hwm), 0) FROM sources WHERE source_id = 'life'").fetchone()[0]
    finally:
        con.close()
    return seqs, rows, hwm


def _send_until_stopped(c, first_seq: int, last_seq: int, sig: int) -> int:
    """Stream batches first_seq..last_seq; after the first ack send `sig` to the collector.
    Returns the last seq acked on this stream."""
    f = Feeder(c.addr)
    for seq in range(first_seq, last_seq + 1):
        f.send(batch("life", seq, N))
    f.wait_ack("life", first_seq)
    assert c.stop(sig) == (0 if sig == signal.SIGTERM else -signal.SIGKILL), c.text()
    err = f.wait_end()
    if sig == signal.SIGTERM:
        # Shutdown ends the stream with UNAVAILABLE after the acks of everything it committed.
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "shutting down" in err.details()
    return f.acks["life"]


def test_sigterm_kill9_restart_exactly_once(tmp_path):
    db = tmp_path / "life.duckdb"
    # 1. SIGTERM while batches are in flight: every acked batch is in the file.
    c = start_collector(tmp_path, "unix", db=db, extra_args=["--flush-interval-s", "0.1"])
    assert c.addr.startswith("unix:")
    acked1 = _send_until_stopped(c, 1, TOTAL, signal.SIGTERM)
    seqs, rows, hwm = _stored(db)
    assert acked1 >= 1 and hwm == acked1 == seqs[-1], (acked1, hwm, seqs[-1:])
    assert seqs == list(range(1, acked1 + 1)) and rows == acked1 * N

    # 2. Restart on the same file (same socket path). The hwm survived: resent 1..acked1 are
    #    duplicates, acked and not stored. Then new batches, and kill -9 mid-stream.
    c = start_collector(tmp_path, "unix", db=db, extra_args=["--flush-interval-s", "0.1"])
    f = Feeder(c.addr)
    for seq in range(1, acked1 + 1):
        f.send(batch("life", seq, N))
    assert f.wait_ack("life", acked1) == acked1
    f.close()
    assert f.wait_end() is None
    # Nothing stored twice (asked through the Query service over the unix socket: the file is locked).
    assert scalar(c.addr, "SELECT count(*) FROM ingest_log WHERE source_id = 'life'") == acked1
    assert scalar(c.addr, "SELECT count(*) FROM step") == acked1 * N
    acked2 = _send_until_stopped(c, acked1 + 1, 2 * TOTAL, signal.SIGKILL)
    assert acked2 > acked1
    seqs, rows, hwm = _stored(db)
    assert seqs[:acked2] == list(range(1, acked2 + 1)), "an acked batch was lost by kill -9"
    assert len(seqs) == len(set(seqs)) and rows == len(seqs) * N

    # 3. Restart again and resend everything: exactly once, nothing missing.
    c = start_collector(tmp_path, "unix", db=db, extra_args=["--flush-interval-s", "0.1"])
    f = Feeder(c.addr)
    for seq in range(1, 2 * TOTAL + 1):
        f.send(batch("life", seq, N))
    f.wait_ack("life", 2 * TOTAL)
    f.close()
    assert f.wait_end() is None
    assert c.stop() == 0
    seqs, rows, hwm = _stored(db)
    assert seqs == list(range(1, 2 * TOTAL + 1)) and rows == 2 * TOTAL * N and hwm == 2 * TOTAL


def test_refuses_non_loopback_and_newer_file(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "collector", "--db", str(tmp_path / "x.duckdb"), "--listen", "0.0.0.0:0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2 and "not loopback" in r.stderr and "--token-file" in r.stderr and "listening" not in r.stdout
    newer = tmp_path / "newer.duckdb"
    con = duckdb.connect(str(newer))
    con.execute("CREATE TABLE schema_meta (version INTEGER, applied_ns BIGINT)")
    con.execute("INSERT INTO schema_meta VALUES (999, 0)")
    con.close()
    r = subprocess.run(
        [sys.executable, "-m", "collector", "--db", str(newer), "--listen", "127.0.0.1:0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2 and "schema version 999" in r.stderr and "upgrade tracetop" in r.stderr
