"""Load generation for the collector benchmarks: a real collector process and real shipper processes.

A source process ships STEP rows in bulk (``record_many``), the way a node's agent forwarding many
ranks would, so the figures measure the collector and the wire, not Python call overhead in the
sources. Every row is identifiable — ``rank`` = source index, ``step`` = row number — so a test can
count exactly what was stored, lost, or stored twice.

Run a source by hand: ``python -m collector.loadgen --endpoint ADDR --source 3 --events 100000``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CHUNK_ROWS = 16384
#: A source waits (rather than letting its shipper drop the oldest) while this many batches are unacked.
MAX_INFLIGHT_BATCHES = 1


def run_source(
    endpoint: str,
    run_id: str,
    source: int,
    events: int,
    chunk_rows: int = CHUNK_ROWS,
    rate_eps: float = 0.0,
    start_file: str | None = None,
) -> dict:
    """Ship `events` STEP rows tagged (rank=source, step=0..events-1); return the shipper's stats.

    With start_file: once set up (imports done, shipper started), create `<start_file>.ready.<source>`
    and wait until start_file exists, so a benchmark can start every source at once and leave
    interpreter start-up out of its window."""
    import numpy as np

    from tracetop.events import SCHEMAS, Kind
    from tracetop.wire.shipper import Shipper

    # A load source sends without pause, like a busy agent relay: its stream stays open between
    # its paced batches (a 1 s linger) and ends only when it is done, so a killed collector
    # breaks a live stream rather than falling between two bursts.
    shipper = Shipper(endpoint, run_id=run_id, source_id=f"loadgen-{source}-{os.getpid()}", rank=source,
                      burst_linger_s=1.0)
    names = [c.name for c in SCHEMAS[Kind.STEP]]
    if start_file:
        Path(f"{start_file}.ready.{source}").touch()
        while not os.path.exists(start_file):
            time.sleep(0.005)
    t0, cpu0 = time.monotonic(), time.process_time()
    sent = 0
    while sent < events:
        n = min(chunk_rows, events - sent)
        while True:
            st = shipper.stats()
            if st["unacked_batches"] + st["pending_rows"] // chunk_rows <= MAX_INFLIGHT_BATCHES:
                break
            time.sleep(0.002)
        steps = np.arange(sent, sent + n, dtype="<i8")
        now = time.time_ns()
        cols = {name: steps for name in names}
        cols["rank"] = np.full(n, source, dtype="<i4")
        cols["start_ns"] = np.full(n, now, dtype="<i8")
        shipper.record_many(Kind.STEP, cols)
        sent += n
        if rate_eps > 0:
            ahead = sent / rate_eps - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    ok = shipper.flush(timeout_s=600)
    stats = shipper.stats()
    shipper.close(timeout_s=5)
    stats.update(sent=sent, flushed=ok, source=source, elapsed_s=time.monotonic() - t0, cpu_s=time.process_time() - cpu0)
    return stats


@dataclass
class CollectorProcess:
    """`tracetop collector` as a child process on a given file and address."""

    db: Path
    listen: str
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    args: tuple[str, ...] = ()  # more `tracetop collector` flags (e.g. --no-rules)

    def start(self, timeout_s: float = 60.0) -> None:
        self.log_path = self.db.with_suffix(".collector.log")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tracetop.cli", "collector", "--db", str(self.db), "--listen", self.listen, *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_ready(self.listen, timeout_s, self.proc)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_ready(address: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    import grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"collector exited with code {proc.returncode} before listening on {address}")
        channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
            return
        except grpc.FutureTimeoutError:
            pass
        finally:
            channel.close()
    raise TimeoutError(f"nothing listening on {address} after {timeout_s} s")


def start_sources(
    endpoint: str, run_id: str, sources: int, events: int, rate_eps: float = 0.0, start_file: Path | None = None
) -> list[subprocess.Popen]:
    """Launch the source processes. With start_file they get ready and wait; call release(start_file)."""
    extra = ["--start-file", str(start_file)] if start_file else []
    return [
        subprocess.Popen(
            [sys.executable, "-m", "collector.loadgen", "--endpoint", endpoint, "--run-id", run_id,
             "--source", str(i), "--events", str(events), "--rate-eps", str(rate_eps), *extra],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(sources)
    ]


def release(start_file: Path, procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    """Wait until every source is set up, then let them all go at once."""
    deadline = time.monotonic() + timeout_s
    for i, p in enumerate(procs):
        while not Path(f"{start_file}.ready.{i}").exists():
            if p.poll() is not None:
                raise RuntimeError(f"load source {i} exited {p.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"load source {i} not ready after {timeout_s} s")
            time.sleep(0.01)
    start_file.touch()


def collect_sources(procs: list[subprocess.Popen], timeout_s: float = 900) -> list[dict]:
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"load source exited {p.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def count_stored(db: Path, run_id: str) -> dict:
    """Exactly-once accounting over the STEP table: per source (rank), distinct and total rows."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute(
            "SELECT rank, count(*) AS stored, count(DISTINCT step) AS distinct_steps FROM step WHERE run_id = ? GROUP BY rank",
            [run_id],
        ).fetchall()
        gaps = con.execute("SELECT coalesce(sum(dropped), 0) FROM gap WHERE run_id = ?", [run_id]).fetchone()[0]
    finally:
        con.close()
    return {"per_source": {int(r): (int(s), int(d)) for r, s, d in rows}, "gaps_dropped": int(gaps)}


def main() -> None:
    p = argparse.ArgumentParser(description="one load source (used by tracetop bench ingest/chaos)")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--run-id", default="bench")
    p.add_argument("--source", type=int, required=True)
    p.add_argument("--events", type=int, required=True)
    p.add_argument("--rate-eps", type=float, default=0.0, help="events/s pacing; 0 = as fast as acks allow")
    p.add_argument("--start-file", default=None, help="get ready, then wait until this file exists")
    a = p.parse_args()
    stats = run_source(a.endpoint, a.run_id, a.source, a.events, rate_eps=a.rate_eps, start_file=a.start_file)
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
