"""What one DuckDB checkpoint costs on a collector's file of some size, against a fresh file.

    python -m collector.bench.checkpoint_cost FILE [--rounds 3] [--vacuum-tasks N] [--json]

Each round appends rows copied from FILE's own event tables to a copy of FILE (one commit of
20,000 rows a table, then eight of 8,000: the writer's commits are of that order at 16,384 ranks),
so they wait in the WAL, then runs CHECKPOINT and times it (process CPU and wall). The same rounds
run on a fresh file of the collector's schema: the difference is what the file's size adds.
``--vacuum-tasks`` sets DuckDB's max_vacuum_tasks on both (its default 100; 0: no vacuum, the
checkpoint neither merges row groups nor reclaims deleted rows).

On a 300 s 16k-rank file (1.1 GB): 0.52-0.98 CPU-s a checkpoint of ~45 MB of WAL against 0.15-0.22
on a fresh file; with --vacuum-tasks 0, 0.17-0.26 (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import duckdb

from collector.ingest.schema import open_store

TABLES = ("step", "collective", "pipe_instr", "heartbeat", "gpu_sample")


def _rounds(con, rounds: int) -> list[dict]:
    path = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchone()[0]
    out = []
    offset = 0
    for _ in range(rounds):
        for rows in (20_000, *(8_000,) * 8):
            con.execute("BEGIN TRANSACTION")
            for t in TABLES:
                con.execute(f"INSERT INTO {t} SELECT * FROM src.main.{t} LIMIT {rows} OFFSET {offset}")
            con.execute("COMMIT")
            offset += rows
        wal = os.path.getsize(f"{path}.wal") if os.path.exists(f"{path}.wal") else 0
        c, w = time.process_time(), time.perf_counter()
        con.execute("CHECKPOINT")
        out.append({"wal_mb": round(wal / 2**20, 1), "cpu_s": round(time.process_time() - c, 3),
                    "wall_s": round(time.perf_counter() - w, 3)})
    return out


def run(src: Path, rounds: int, vacuum_tasks: int | None) -> dict:
    config: dict = {"checkpoint_threshold": "10GB"}  # no checkpoint but ours
    if vacuum_tasks is not None:
        config["max_vacuum_tasks"] = vacuum_tasks
    result: dict = {"file": str(src), "file_mb": round(src.stat().st_size / 2**20, 1), "vacuum_tasks": vacuum_tasks}
    with tempfile.TemporaryDirectory(prefix="tracetop-ckpt-") as d:
        for side in ("fresh", "this_file"):
            work = Path(d) / f"{side}.duckdb"
            if side == "this_file":
                shutil.copy(src, work)
            else:
                open_store(str(work)).close()
            con = duckdb.connect(str(work), config=config)
            try:
                con.execute(f"ATTACH '{src}' AS src (READ_ONLY)")
                result[side] = _rounds(con, rounds)
            finally:
                con.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vacuum-tasks", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object (default: a line a round)")
    a = p.parse_args()
    r = run(a.file, a.rounds, a.vacuum_tasks)
    if a.json:
        print(json.dumps(r))
        return
    print(f"{r['file']} ({r['file_mb']} MB), max_vacuum_tasks {a.vacuum_tasks if a.vacuum_tasks is not None else 'default'}")
    for side in ("fresh", "this_file"):
        for i, x in enumerate(r[side]):
            print(f"  {side:9s} round {i}: WAL {x['wal_mb']:6.1f} MB, checkpoint {x['cpu_s']:.3f} CPU-s, {x['wall_s']:.3f} s")


if __name__ == "__main__":
    main()
