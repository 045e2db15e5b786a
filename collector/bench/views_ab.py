"""The same file's step_summary and collective_stats before and after the rollups, in one process:
OLD (a file of schema 7, read-only, its exact quantile_cont views as stored) against NEW (a copy
migrated by this version, its rollup views); per view 3 NEW reads, 1 OLD, 3 NEW, so both see the
same load. Prints each read with the load average, then the medians.

    cp OLD.duckdb NEW.duckdb && .venv/bin/python -c "from collector.ingest.schema import open_store; open_store('NEW.duckdb').close()"
    .venv/bin/python -m collector.bench.views_ab OLD.duckdb NEW.duckdb [--memory-limit-gb 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import duckdb

from collector.ingest.schema import connect


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--memory-limit-gb", type=float, default=8.0)
    a = p.parse_args()
    cons = {"old": connect(a.old, read_only=True), "new": connect(a.new, read_only=True)}
    for c in cons.values():
        c.execute(f"SET memory_limit = '{a.memory_limit_gb}GB'")
        c.execute("SET enable_progress_bar = false")
    times: dict[tuple[str, str], list[float]] = {}

    def read(which: str, view: str) -> None:
        t = time.perf_counter()
        try:
            cons[which].execute(f'SELECT count(*), max(hash(t)) FROM (SELECT * FROM "{view}") t').fetchone()
        except duckdb.Error as e:
            print(which, view, "error:", str(e).splitlines()[0], flush=True)
            return
        dt = time.perf_counter() - t
        times.setdefault((which, view), []).append(dt)
        print(f"{which} {view} {dt:.3f} s  load {os.getloadavg()[0]:.1f}", flush=True)

    for view in ("step_summary", "collective_stats"):
        for which in ["new"] * 3 + ["old"] + ["new"] * 3:
            read(which, view)
    for (which, view), xs in times.items():
        print(f"{which} {view}: median {statistics.median(xs):.3f} s over {len(xs)}")


if __name__ == "__main__":
    main()
