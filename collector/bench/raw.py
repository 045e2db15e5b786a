"""The collector alone: pre-encoded batches from raw gRPC stubs, as fast as acks allow.

`tracetop bench raw [--clients K] [--batches B] [--rows N] [--window W] [--json]`

Each client process encodes B STEP batches of N rows up front, then streams them keeping at most
W unacked, so the figure is the collector's (decode, validate, group commit, ack), not the
producers'. Prints events/s committed (rows / (last commit − first send)), p50/p99 send→commit
from ingest_log, and the collector's CPU. Compare with `tracetop bench ingest`, which includes
real shippers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from pathlib import Path


def _client(addr: str, idx: int, batches: int, rows: int, window: int, out: mp.Queue) -> None:
    import grpc
    import numpy as np

    from tracetop.events import SCHEMAS, Kind
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc
    from tracetop.wire.codec import encode_batch

    source = f"raw-{idx}"
    cols = {c.name: np.arange(rows) for c in SCHEMAS[Kind.STEP]}
    cols["rank"] = np.full(rows, idx)
    pre = [encode_batch(Kind.STEP, cols, source_id=source, seq=s, run_id="bench-raw") for s in range(1, batches + 1)]
    room = threading.Semaphore(window)

    def requests():
        for b in pre:
            room.acquire()
            b.sealed_ns = b.first_record_ns = time.time_ns()  # not covered by the CRC
            yield b

    last = 0
    with grpc.insecure_channel(addr) as ch:
        for ack in pb_grpc.IngestStub(ch).Stream(requests()):
            for _ in range(ack.seq - last):
                room.release()
            last = ack.seq
            if last == batches:
                break
    out.put(idx)


def bench(clients: int, batches: int, rows: int, window: int, workdir: Path) -> dict:
    import duckdb
    import psutil

    db = workdir / "raw.duckdb"
    from tracetop import procs as services

    service = services.collector(db, "127.0.0.1:0").start()
    proc = service.proc
    assert proc is not None
    addr = service.address
    ps = psutil.Process(proc.pid)
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_client, args=(addr, i, batches, rows, window, out)) for i in range(clients)]
    cpu0, t0 = ps.cpu_times(), time.monotonic()
    for p in procs:
        p.start()
    for _ in procs:
        out.get(timeout=600)
    for p in procs:
        p.join()
    cpu1, wall = ps.cpu_times(), time.monotonic() - t0
    proc.terminate()
    proc.wait(60)
    con = duckdb.connect(str(db), read_only=True)
    try:
        n, t_first, t_last, p50, p99, commits = con.execute(
            "SELECT sum(n), min(sealed_ns), max(committed_ns), "
            "quantile_cont((committed_ns - sealed_ns) / 1e6, 0.5), quantile_cont((committed_ns - sealed_ns) / 1e6, 0.99), "
            "count(DISTINCT committed_ns) FROM ingest_log"
        ).fetchone()
    finally:
        con.close()
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "clients": clients,
        "events": int(n),
        "events_per_s": round(n / ((t_last - t_first) / 1e9)),
        "p50_ms": round(p50, 1),
        "p99_ms": round(p99, 1),
        "commits": int(commits),
        "collector_cpu_pct": round(100 * cpu_s / wall, 1),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--batches", type=int, default=100, help="batches per client")
    p.add_argument("--rows", type=int, default=20_000, help="rows per batch")
    p.add_argument("--window", type=int, default=4, help="unacked batches per client")
    p.add_argument("--json", action="store_true")


def run(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="tracetop-raw-") as d:
        result = bench(a.clients, a.batches, a.rows, a.window, Path(d))
    print(json.dumps(result) if a.json else "\n".join(f"{k:>18}: {v}" for k, v in result.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
