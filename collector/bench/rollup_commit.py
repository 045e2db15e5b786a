"""What the views' rollups add to the writer: the same 10,000-row batches (decoded and turned into
Arrow as the collector does) committed into two fresh files, one transaction each, alternating
A (rows only) and B (rows, then `rollup.advance` whenever ROLL_EVERY_ROWS of a kind are past the
watermark), so both see the same machine load. Prints the total seconds of each (B's including
its roll-ups), B/A, and B's longest pause. Here B's roll-ups run inline, so B/A is their CPU
cost; the collector runs them on a thread of its own (`tracetop-rollup`), so commits do not wait.

    .venv/bin/python -m collector.bench.rollup_commit [--commits 40] [--rows 10000] [--ranks 1024]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from collector.ingest import rollup
from collector.ingest.schema import open_store
from collector.ingest.writer import batch_to_arrow
from tracetop.events import Kind, table_name
from tracetop.wire.codec import decode_batch, encode_batch


def batches(rng, i: int, n: int, ranks: int):
    rank = np.arange(n) % ranks
    step = np.full(n, i)
    steps = {"rank": rank, "step": step, "start_ns": np.arange(n), "duration_ns": rng.integers(9e8, 1e9, n),
             "data_wait_ns": rng.integers(0, 2e6, n), "forward_ns": rng.integers(2e8, 3e8, n),
             "backward_ns": rng.integers(4e8, 5e8, n), "optimizer_ns": rng.integers(4e7, 5e7, n),
             "comm_exposed_ns": rng.integers(4e7, 5e7, n), "compute_ns": rng.integers(8e8, 9e8, n),
             "tokens": np.full(n, 16384), "samples": np.full(n, 8), "loss": rng.random(n),
             "micro_batch": np.ones(n), "micro_batches": np.full(n, 8)}
    k = np.arange(n) % 5
    colls = {"rank": rank, "step": step, "start_ns": np.arange(n), "duration_ns": rng.integers(1e5, 1e7, n),
             "op": list(np.array(["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "send", "recv"])[k]),
             "role": list(np.array(["dp", "tp", "dp", "p2p:pp", "p2p:pp"])[k]), "group_size": np.full(n, 8),
             "bytes": 1024 << (np.arange(n) % 20), "peer": np.full(n, -1), "dtype": ["bfloat16"] * n,
             "is_async": np.zeros(n)}
    return [(kind, batch_to_arrow(decode_batch(encode_batch(kind, cols, source_id="b", seq=i + 1, run_id="bench"))))
            for kind, cols in ((Kind.STEP, steps), (Kind.COLLECTIVE, colls))]


def commit(con, tables, unrolled: dict | None) -> float:
    t = time.perf_counter()
    con.execute("BEGIN TRANSACTION")
    for kind, table in tables:
        con.register("_tt_batch", table)
        con.execute(f"INSERT INTO {table_name(kind)} SELECT * FROM _tt_batch")
        con.unregister("_tt_batch")
    con.execute("COMMIT")
    if unrolled is not None:
        for kind, table in tables:
            unrolled[kind] = unrolled.get(kind, 0) + table.num_rows
            if unrolled[kind] > rollup.ROLL_EVERY_ROWS:
                rollup.advance(con, rollup.for_kind(kind))
                unrolled[kind] = 0
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--commits", type=int, default=40)
    p.add_argument("--rows", type=int, default=10_000, help="rows of each kind per commit")
    p.add_argument("--ranks", type=int, default=1024)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        ca, cb = open_store(str(Path(d) / "a.duckdb")), open_store(str(Path(d) / "b.duckdb"))
        ta, tb, unrolled = [], [], {}
        for i in range(a.commits):
            tables = batches(rng, i, a.rows, a.ranks)
            if i % 2:
                tb.append(commit(cb, tables, unrolled))
                ta.append(commit(ca, tables, None))
            else:
                ta.append(commit(ca, tables, None))
                tb.append(commit(cb, tables, unrolled))
        sa, sb = sum(ta), sum(tb)
        n_roll = sum(cb.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in rollup.TABLES)
        print(f"{a.commits} commits of {a.rows} step + {a.rows} collective rows: rows only {sa:.2f} s, "
              f"rows + rollups {sb:.2f} s (x{sb / sa:.2f}); median commit {statistics.median(ta) * 1e3:.0f} / "
              f"{statistics.median(tb) * 1e3:.0f} ms, longest {max(ta) * 1e3:.0f} / {max(tb) * 1e3:.0f} ms; "
              f"rollup rows {n_roll:,}")


if __name__ == "__main__":
    main()
