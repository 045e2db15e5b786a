"""`tracetop bench ingest`: N shipper processes into a real collector; events/s stored end to end.

Figures, all from one run:
  events_per_s           rows committed / (last commit − first record), from the collector's ingest_log
  p50_ms, p99_ms         record → commit delay per row (a batch's oldest record to its commit; an
                         upper bound for the batch's other rows), weighted by rows
  collector_cpu_pct      collector CPU time / wall time over the run (100 = one core)
  collector_peak_rss_mb  the collector's VmHWM
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sources", type=int, default=8, help="shipper processes (default 8)")
    parser.add_argument("--events", type=int, default=4_000_000, help="events in all, split over the sources")
    parser.add_argument("--listen", default=None, help="collector address (default: 127.0.0.1 on a free port)")
    parser.add_argument("--dir", type=Path, default=None, help="keep the DuckDB file here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def ingest(sources: int, events: int, workdir: Path, listen: str | None = None,
           collector_args: tuple[str, ...] = ()) -> dict:
    import duckdb
    import numpy as np
    import psutil

    from collector.loadgen import CollectorProcess, collect_sources, count_stored, release, start_sources

    db = workdir / "ingest.duckdb"
    db.unlink(missing_ok=True)
    listen = listen or f"127.0.0.1:{_free_port()}"
    collector = CollectorProcess(db, listen, args=collector_args)
    collector.start()
    assert collector.proc is not None
    ps = psutil.Process(collector.proc.pid)
    go = workdir / "go"
    procs = start_sources(listen, "bench", sources, events // sources, start_file=go)
    release(go, procs)  # every source set up: interpreter start-up stays out of the figures
    cpu0, wall0 = ps.cpu_times(), time.monotonic()
    results = collect_sources(procs)
    cpu1, wall1 = ps.cpu_times(), time.monotonic()
    peak_rss = _peak_rss_mb(collector.proc.pid)
    collector.stop()

    con = duckdb.connect(str(db), read_only=True)
    try:
        n, first_ns, committed_ns, t_first, t_last = con.execute(
            "SELECT list(n), list(first_record_ns), list(committed_ns), min(first_record_ns), max(committed_ns) "
            "FROM ingest_log WHERE kind = 'step'"
        ).fetchone()
    finally:
        con.close()
    n = np.asarray(n, dtype=np.int64)
    delay_ms = (np.asarray(committed_ns, dtype=np.int64) - np.asarray(first_ns, dtype=np.int64)) / 1e6
    order = np.argsort(delay_ms)
    cum = np.cumsum(n[order]) / n.sum()
    p50 = float(delay_ms[order][np.searchsorted(cum, 0.50)])
    p99 = float(delay_ms[order][np.searchsorted(cum, 0.99)])
    counts = count_stored(db, "bench")
    stored = sum(s for s, _ in counts["per_source"].values())
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "sources": sources,
        "events": int(sum(r["sent"] for r in results)),
        "stored": stored,
        "events_per_s": round(stored / ((t_last - t_first) / 1e9), 1),
        "p50_ms": round(p50, 1),
        "p99_ms": round(p99, 1),
        "collector_cpu_pct": round(100 * cpu_s / (wall1 - wall0), 1),
        "collector_peak_rss_mb": round(peak_rss, 1),
        "sources_cpu_pct": round(100 * sum(r["cpu_s"] for r in results) / (wall1 - wall0), 1),
        "batches": int(len(n)),
        "wall_s": round(wall1 - wall0, 2),
    }


def run(args: argparse.Namespace) -> int:
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        result = ingest(args.sources, args.events, args.dir, args.listen)
    else:
        with tempfile.TemporaryDirectory(prefix="tracetop-ingest-") as d:
            result = ingest(args.sources, args.events, Path(d), args.listen)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    return 0 if result["stored"] == result["events"] else 1
