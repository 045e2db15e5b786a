"""The writer's DuckDB cost alone: CPU seconds per million rows for a commit size and a checkpoint threshold.

    python -m collector.bench.writer --rows 4000000 --commit-rows 16384 --checkpoint 16MB
    python -m collector.bench.writer --mix --rows 8000000 --commit-rows 160000 --checkpoint 64MB

One process, no gRPC, no roll, no live engine: the Arrow tables `batch_to_arrow` makes, INSERTed as the
writer does (`writer.Staging`: one INSERT per kind a commit, its Arrow staged by a name registered once) into a fresh file opened as the collector opens it. The rows:
`bench ingest`'s STEP rows (each row a step of its own), or with --mix the realistic mix's kinds in its
proportions (1 STEP, 20 COLLECTIVE, 16 PIPE_INSTR, 1 MEMORY, 1 THROUGHPUT a rank-step). CPU is the
process's (every DuckDB thread included), over the commits, then the closing checkpoint's apart.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _tables(mix: bool) -> list[tuple[str, pa.Table]]:
    """(table, Arrow table) pairs, one commit's worth of each kind at the smallest unit."""
    import numpy as np

    from collector.bench.loadgen import MIX_PER_RANK_STEP, mix_template
    from collector.ingest.writer import batch_to_arrow
    from tracetop.events import SCHEMAS, Kind, table_name
    from tracetop.wire.codec import decode_batch, encode_batch

    def arrow(kind, cols):
        return batch_to_arrow(decode_batch(encode_batch(kind, cols, source_id="s", seq=1, run_id="bench")))

    if mix:
        out = []
        for name, per in MIX_PER_RANK_STEP.items():
            kind = getattr(Kind, name)
            cols = mix_template(kind, 0, 2048, per)
            cols.update(step=np.full(2048 * per, 1, "<i8"), start_ns=np.full(2048 * per, time.time_ns(), "<i8"))
            out.append((table_name(kind), arrow(kind, cols)))
        return out
    n = 16384
    steps = np.arange(n, dtype="<i8")
    cols = {c.name: steps for c in SCHEMAS[Kind.STEP]}
    cols.update(rank=np.zeros(n, "<i4"), start_ns=np.full(n, time.time_ns(), "<i8"), loss=np.linspace(0, 1, n),
                micro_batch=np.zeros(n, "<i4"), micro_batches=np.ones(n, "<i4"))
    return [(table_name(Kind.STEP), arrow(Kind.STEP, cols))]


def run(rows: int, commit_rows: int, checkpoint: str, mix: bool, settings: dict[str, str] | None = None) -> dict:
    from collector.ingest.schema import open_store
    from collector.ingest.writer import Staging

    units = _tables(mix)
    unit_rows = sum(t.num_rows for _, t in units)
    k = max(1, commit_rows // unit_rows)
    commit = [(name, [t] * k) for name, t in units]  # k batches of each kind, as the writer's queue holds them
    with tempfile.TemporaryDirectory(prefix="tracetop-writer-") as d:
        con = open_store(str(Path(d) / "w.duckdb"), settings={"checkpoint_threshold": checkpoint, **(settings or {})})
        done, commits = 0, 0
        staging = Staging(con)
        c0, w0 = _cpu_s(), time.monotonic()
        while done < rows:
            staged = [(name, staging.stage_rows(name, tables)) for name, tables in commit]
            con.execute("BEGIN TRANSACTION")
            for (name, tables), (_, source) in zip(commit, staged):
                con.execute(f"INSERT INTO {name} SELECT * FROM {source}")
                done += sum(t.num_rows for t in tables)
            con.execute("COMMIT")
            staging.clear()
            commits += 1
        c1, w1 = _cpu_s(), time.monotonic()
        con.execute("CHECKPOINT")
        c2 = _cpu_s()
        con.close()
        file_mb = (Path(d) / "w.duckdb").stat().st_size / 2**20
    return {"rows": done, "commit_rows": k * unit_rows, "commits": commits, "checkpoint": checkpoint, "mix": mix, "settings": settings or {},
            "cpu_s_per_m": round((c1 - c0) / done * 1e6, 3), "closing_checkpoint_cpu_s_per_m": round((c2 - c1) / done * 1e6, 3),
            "wall_s": round(w1 - w0, 2), "file_mb": round(file_mb, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--commit-rows", type=int, default=16384, help="rows a commit (rounded to the unit: 16,384 STEP "
                   "rows, or 2,048 ranks' mix)")
    p.add_argument("--checkpoint", default="64MB", help="DuckDB's checkpoint_threshold (its default: 16MB)")
    p.add_argument("--mix", action="store_true", help="the realistic mix's kinds instead of STEP rows")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="another DuckDB setting (repeatable)")
    a = p.parse_args()
    settings = dict(s.split("=", 1) for s in a.set)
    print(json.dumps(run(a.rows, a.commit_rows, a.checkpoint, a.mix, settings)))


if __name__ == "__main__":
    main()
