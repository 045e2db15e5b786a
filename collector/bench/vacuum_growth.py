"""What a file keeps without DuckDB's vacuum, under the collector's kinds of delete.

    python -m collector.bench.vacuum_growth [--rounds 400] [--json]

Two files, one with DuckDB's default vacuum (max_vacuum_tasks 100) and one without (0, the
collector's default: collector/app.py `duckdb_settings`), get the same rounds: a commit of 8,000
rows into an event table (append only), every 4th round the last six steps of a view table deleted
and inserted again (a step the views roll again) and a queue table emptied, every 40th a rollup
table re-summed whole (deleted and refilled, as `collector/ingest/rollup.py` compacts), a
CHECKPOINT every 8th. Printed: each file's size every 100 rounds, row groups and blocks a table,
the CPU seconds. On this machine (400 rounds): 40.4 MB with vacuum, 49.3 MB without; the event table
50 row groups against 27 (each checkpoint leaves its last one partial), the view table 50 against
7 (deleted rows kept), the rollup table 1 either way (docs/benchmarks.md, "DuckDB's vacuum").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import duckdb

TABLES = ("ev", "view_m", "roll", "pend")


def grow(path: str, vacuum_tasks: int, rounds: int) -> dict:
    """The rounds on a new file at ``path`` with ``max_vacuum_tasks = vacuum_tasks``."""
    con = duckdb.connect(path, config={"max_vacuum_tasks": vacuum_tasks})
    con.execute("CREATE TABLE ev(step BIGINT, rank INTEGER, v DOUBLE, op VARCHAR)")
    con.execute("CREATE TABLE view_m(step BIGINT, rank INTEGER, v DOUBLE)")
    con.execute("CREATE TABLE roll(k BIGINT, n BIGINT, total DOUBLE)")
    con.execute("CREATE TABLE pend(step BIGINT)")
    sizes = []
    cpu0 = time.process_time()
    for i in range(rounds):
        con.execute(f"INSERT INTO ev SELECT {i}, range, random(), 'op' || (range % 7) FROM range(8000)")
        con.execute("INSERT INTO roll SELECT range % 5000, 1, random() FROM range(8000)")
        con.execute(f"INSERT INTO pend SELECT {i} FROM range(50)")
        if i % 4 == 3:
            con.execute(f"DELETE FROM view_m WHERE step >= {i - 5}")
            con.execute(f"INSERT INTO view_m SELECT step, rank, v FROM ev WHERE step >= {i - 5} AND rank < 2000")
            con.execute("DELETE FROM pend")
        if i % 40 == 39:
            con.execute("BEGIN TRANSACTION")
            con.execute("CREATE TEMP TABLE _c AS SELECT k, sum(n) AS n, sum(total) AS total FROM roll GROUP BY k")
            con.execute("DELETE FROM roll")
            con.execute("INSERT INTO roll SELECT * FROM _c")
            con.execute("DROP TABLE _c")
            con.execute("COMMIT")
        if i % 8 == 7:
            con.execute("CHECKPOINT")
        if i % 100 == 99:
            sizes.append(round(os.path.getsize(path) / 1e6, 1))
    con.execute("CHECKPOINT")
    tables = {t: dict(zip(("row_groups", "blocks"), con.execute(
        f"SELECT count(DISTINCT row_group_id), count(DISTINCT block_id) FROM pragma_storage_info('{t}')").fetchone()))
        for t in TABLES}
    cpu = time.process_time() - cpu0
    con.close()
    return {"max_vacuum_tasks": vacuum_tasks, "mb_every_100_rounds": sizes,
            "file_mb": round(os.path.getsize(path) / 1e6, 1), "tables": tables, "cpu_s": round(cpu, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m collector.bench.vacuum_growth", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=400, help="commits of 8,000 rows (default 400)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    a = ap.parse_args(argv)
    if a.rounds < 8:
        ap.error("--rounds must be at least 8 (a checkpoint every 8th)")
    with tempfile.TemporaryDirectory(prefix="tt-vacuum-") as d:
        out = [grow(os.path.join(d, f"v{n}.duckdb"), n, a.rounds) for n in (100, 0)]
    if a.json:
        print(json.dumps({"rounds": a.rounds, "files": out}))
        return 0
    for r in out:
        groups = ", ".join(f"{t} {v['row_groups']} row groups / {v['blocks']} blocks" for t, v in r["tables"].items())
        print(f"max_vacuum_tasks {r['max_vacuum_tasks']:>3}: {r['file_mb']} MB (every 100 rounds "
              f"{r['mb_every_100_rounds']}), {r['cpu_s']} CPU-s; {groups}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
