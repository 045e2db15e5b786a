"""Where a views roll's time goes, statement by statement, on a copy of a collector's file.

    python -m collector.bench.roll_statements FILE [--top 12]

Copies FILE, empties its materialized views and rolls every stored step again (`matviews.rebuild`'s
work, in a transaction rolled back at the end), timing each statement: wall seconds, and the calling
thread's CPU (DuckDB's workers are in the process's CPU, printed as the total). Statements are keyed by
their first line, numbers masked, so a view's chunks add up under one key.
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import duckdb

from collector.ingest import matviews


class _Timed:
    """A connection whose `execute` adds each statement's wall and thread CPU under its key."""

    def __init__(self, con) -> None:
        self.con = con
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    def execute(self, sql: str, *args):
        key = re.sub(r"\d+", "N", sql.strip().split("\n")[0][:72])
        w, c = time.perf_counter(), time.thread_time()
        out = self.con.execute(sql, *args)
        self.wall[key] += time.perf_counter() - w
        self.cpu[key] += time.thread_time() - c
        self.calls[key] += 1
        return out


def run(path: Path, top: int) -> None:
    with tempfile.TemporaryDirectory(prefix="tracetop-roll-") as d:
        copy = Path(d) / "copy.duckdb"
        shutil.copy(path, copy)
        con = duckdb.connect(str(copy))
        con.execute("BEGIN TRANSACTION")
        for v in matviews.VIEWS:
            con.execute(f"DELETE FROM {v}_m")
        con.execute("DELETE FROM views_pending")
        con.execute("DELETE FROM views_state")
        timed = _Timed(con)
        w, p = time.perf_counter(), time.process_time()
        steps = matviews.advance_in(timed, final=True)
        print(f"{steps} steps rolled: {time.perf_counter() - w:.2f} s wall, {time.process_time() - p:.2f} s process CPU")
        print(f"{'wall s':>8} {'thread CPU s':>12} {'calls':>6}  statement")
        for key in sorted(timed.wall, key=lambda k: -timed.wall[k])[:top]:
            print(f"{timed.wall[key]:8.2f} {timed.cpu[key]:12.2f} {timed.calls[key]:6d}  {key}")
        con.execute("ROLLBACK")
        con.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file", type=Path)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    run(a.file, a.top)


if __name__ == "__main__":
    main()
