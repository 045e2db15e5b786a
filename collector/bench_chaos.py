"""`tracetop bench chaos`: kill -9 the collector repeatedly while sources ship; count what survived.

Sources ship identifiable rows (rank = source, step = row number) into a real collector process;
meanwhile the collector is killed with SIGKILL several times and restarted on the same file. At
the end every source has flushed (all its batches acked), the collector stops cleanly, and the
file is counted: ``lost`` = sent − distinct rows stored, ``duplicates`` = rows stored − distinct.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sources", type=int, default=8, help="shipper processes (default 8)")
    parser.add_argument("--events", type=int, default=1_000_000, help="events in all, split over the sources")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs of the collector (default 3)")
    parser.add_argument("--kill-every-s", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--rate-eps", type=float, default=0.0,
                        help="per-source pacing in events/s so the run outlasts the kills (default: chosen)")
    parser.add_argument("--dir", type=Path, default=None, help="keep the DuckDB file here (default: a temp dir)")
    parser.add_argument("--listen", default=None, help="collector address (default: a unix socket in the dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def chaos(sources: int, events: int, kills: int, kill_every_s: float, workdir: Path, listen: str | None = None,
          rate_eps: float = 0.0) -> dict:
    from collector.loadgen import CollectorProcess, collect_sources, count_stored, start_sources

    db = workdir / "chaos.duckdb"
    listen = listen or f"unix://{workdir / 'collector.sock'}"
    per_source = events // sources
    if rate_eps <= 0:
        # spread the sending over the kill schedule and a bit more, so kills land mid-stream
        rate_eps = per_source / max(1.0, kills * kill_every_s * 1.5)
    collector = CollectorProcess(db, listen)
    collector.start()
    run_id = "chaos"
    t0 = time.monotonic()
    procs = start_sources(listen, run_id, sources, per_source, rate_eps)
    killed = 0
    restarts_s: list[float] = []

    def killer() -> None:
        nonlocal killed
        for _ in range(kills):
            time.sleep(kill_every_s)
            if all(p.poll() is not None for p in procs):
                break
            collector.kill()
            killed += 1
            r0 = time.monotonic()
            collector.start()
            restarts_s.append(time.monotonic() - r0)

    k = threading.Thread(target=killer, daemon=True)
    k.start()
    results = collect_sources(procs)
    k.join()
    elapsed = time.monotonic() - t0
    rc = collector.stop()
    counts = count_stored(db, run_id)
    sent = sum(r["sent"] for r in results)
    stored = sum(s for s, _ in counts["per_source"].values())
    distinct = sum(d for _, d in counts["per_source"].values())
    return {
        "sources": sources,
        "sent": sent,
        "stored": stored,
        "duplicates": stored - distinct,
        "lost": sent - distinct,
        "gaps_recorded": counts["gaps_dropped"],
        "kills": killed,
        "collector_restart_s_max": round(max(restarts_s), 2) if restarts_s else None,
        "all_flushed": all(r["flushed"] for r in results),
        "reconnects": sum(r["reconnects"] for r in results),
        "elapsed_s": round(elapsed, 2),
        "collector_exit_code": rc,
        "db": str(db),
    }


def run(args: argparse.Namespace) -> int:
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        result = chaos(args.sources, args.events, args.kills, args.kill_every_s, args.dir, args.listen, args.rate_eps)
    else:
        with tempfile.TemporaryDirectory(prefix="tracetop-chaos-") as d:
            result = chaos(args.sources, args.events, args.kills, args.kill_every_s, Path(d), args.listen, args.rate_eps)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0 if result["lost"] == 0 and result["duplicates"] == 0 else 1
