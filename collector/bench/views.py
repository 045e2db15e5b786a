"""`tracetop bench views [--rows 100000000] [--ranks 1024] [--json] [--dir DIR] [--keep]`: every view
over a generated file of that many event rows.

The file is made by DuckDB itself (`INSERT ... SELECT FROM range(n)`, no Python row loop) through
`collector.ingest.schema.open_store`, so it has this version's tables and views. Rows are split as a
pipeline run's file splits them: 50% collective, 30% pipe_instr, 10% step, 5% memory, 4.9%
offload, the rest gap; one run, `--ranks` ranks (PP 4 stages), steps filling the step share; the
rollups the writer keeps (collector/ingest/rollup.py) and the materialized per-step views
(collector/ingest/matviews.py) are filled from those rows in the same transaction (as a closed collector
leaves them: no tail past the watermarks).
`--file` times an existing file as it is (an older schema keeps its older views: migrate a copy
with `open_store` first to time this version's).
Each view is then computed whole (every column of every row hashed as one struct, so nothing is
pruned away, while only one row comes back to Python) three times on a read-only connection: the first (cold) and the median of the three are
reported beside the file's size, the generation time and the machine's load average. Goal: each
view <= 1 s at 10^8 rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SHARES = {"collective": 0.50, "pipe_instr": 0.30, "step": 0.10, "memory": 0.05, "offload": 0.049}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=100_000_000, help="event rows in the file (default 1e8)")
    parser.add_argument("--ranks", type=int, default=1024, help="ranks in the generated run (default 1024)")
    parser.add_argument("--dir", type=Path, default=None, help="where the file goes (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the generated file")
    parser.add_argument("--file", type=Path, default=None,
                        help="time the views of this existing file instead of generating one (kept as it is)")
    parser.add_argument("--view", action="append", default=None, metavar="NAME",
                        help="time only this view (repeatable; default: every view)")
    parser.add_argument("--repeat", type=int, default=3, help="reads per view (default 3)")
    parser.add_argument("--memory-limit-gb", type=float, default=4.0,
                        help="DuckDB memory limit while generating and reading (default 4; the machine is shared)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def generate(path: str, rows: int, ranks: int, memory_limit_gb: float = 4.0) -> dict[str, int]:
    """Write a collector file of about `rows` event rows; return rows per table."""
    from collector.ingest import matviews, rollup
    from collector.ingest.schema import connect, migrate

    con = connect(path)
    migrate(con, path)
    con.execute(f"SET memory_limit = '{memory_limit_gb}GB'")
    pp = 4
    n = {t: max(1, int(rows * s)) for t, s in SHARES.items()}
    n["gap"] = max(1, rows - sum(n.values()))
    steps = max(1, n["step"] // ranks)
    n["step"] = steps * ranks
    t0 = 1_700_000_000_000_000_000
    try:
        con.execute("BEGIN TRANSACTION")
        con.execute(
            f"""INSERT INTO run_start (run_id, rank, step, start_ns, duration_ns, world_size, tp, pp, dp, zero_stage,
                    stage, model_name, n_params, micro_batch, micro_batches, seq_len, hostname, pid)
                SELECT 'bench', i, -1, {t0}, 0, {ranks}, 1, {pp}, {max(1, ranks // pp)}, 1, i % {pp}, 'bench',
                       1000000000, 1, 8, 2048, 'node' || (i // 8), i
                FROM range({ranks}) r(i)""")
        con.execute(
            f"""INSERT INTO step (run_id, rank, step, start_ns, duration_ns, data_wait_ns, forward_ns, backward_ns,
                    optimizer_ns, comm_exposed_ns, compute_ns, tokens, samples, loss, micro_batch, micro_batches)
                SELECT 'bench', i % {ranks}, i // {ranks}, {t0} + (i // {ranks}) * 1000000000,
                       900000000 + (hash(i) % 100000000), 1000000, 300000000 + (hash(i + 1) % 1000000),
                       500000000, 50000000, 40000000 + (hash(i + 2) % 10000000), 850000000, 16384, 8,
                       2.0, 1, 8
                FROM range({n['step']}) r(i)""")
        con.execute(
            f"""INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, bytes, peer,
                    dtype, is_async)
                SELECT 'bench', i % {ranks}, (i // {ranks}) % {steps}, {t0} + i, 100000 + (hash(i) % 10000000),
                       ['all_reduce', 'all_gather_into_tensor', 'reduce_scatter_tensor', 'send', 'recv'][1 + i % 5],
                       ['dp', 'tp', 'dp', 'p2p:pp', 'p2p:pp'][1 + i % 5], 8, 1024 << (i % 20), -1, 'bfloat16', 0
                FROM range({n['collective']}) r(i)""")
        con.execute(
            f"""INSERT INTO pipe_instr (run_id, rank, step, start_ns, duration_ns, stage, micro_batch, instr)
                SELECT 'bench', i % {ranks}, (i // {ranks}) % {steps}, {t0} + i, 1000000 + (hash(i) % 1000000),
                       (i % {ranks}) % {pp}, (i // {ranks}) % 8,
                       ['ForwardPass', 'BackwardPass', 'SendActivation', 'RecvGrad'][1 + i % 4]
                FROM range({n['pipe_instr']}) r(i)""")
        con.execute(
            f"""INSERT INTO memory (run_id, rank, step, start_ns, duration_ns, allocated_bytes, reserved_bytes,
                    peak_bytes, rss_bytes, budget_bytes)
                SELECT 'bench', i % {ranks}, (i // {ranks}) % {steps}, {t0} + i, 0, 60000000000 + (hash(i) % 1000000000),
                       70000000000, 65000000000, 8000000000, 80000000000
                FROM range({n['memory']}) r(i)""")
        con.execute(
            f"""INSERT INTO offload (run_id, rank, step, start_ns, duration_ns, direction, what, bytes)
                SELECT 'bench', i % {ranks}, (i // {ranks}) % {steps}, {t0} + i, 1000000 + (hash(i) % 1000000),
                       ['d2h', 'h2d'][1 + i % 2], ['grads', 'optim_state', 'params'][1 + i % 3], 16777216
                FROM range({n['offload']}) r(i)""")
        con.execute(
            f"""INSERT INTO gap (run_id, rank, step, start_ns, duration_ns, kind, dropped, reason, origin_source)
                SELECT 'bench', i % {ranks}, -1, {t0} + i, 0, 'collective', 10, 'queue_full', 'rank-' || (i % {ranks})
                FROM range({n['gap']}) r(i)""")
        rollup.rebuild(con)  # what the collector's writer rolls up as the rows come
        matviews.rebuild(con)  # and materializes, step by step
        con.execute("COMMIT")
        con.execute("CHECKPOINT")
    finally:
        con.close()
    return n


def time_views(path: str, repeat: int, memory_limit_gb: float = 4.0, only: list[str] | None = None) -> list[dict]:
    import duckdb

    from collector.ingest.schema import connect

    con = connect(path, read_only=True)
    try:
        con.execute(f"SET memory_limit = '{memory_limit_gb}GB'")
        con.execute("SET lock_configuration = true")
        views = [v for (v,) in con.execute(
            "SELECT view_name FROM duckdb_views() WHERE NOT internal AND schema_name = 'main' ORDER BY 1").fetchall()]
        if only:
            missing = sorted(set(only) - set(views))
            if missing:
                raise ValueError(f"--view {', '.join(missing)}: no such view in {path}; it has {', '.join(views)}")
            views = [v for v in views if v in only]
        out = []
        for v in views:
            times, rows, error = [], 0, None
            # every column of every row is computed (hashed as one struct), none shipped to Python:
            # what the view costs, not what moving 10^7 rows into Arrow costs
            sql = f'SELECT count(*), max(hash(t)) FROM (SELECT * FROM "{v}") t'
            for _ in range(max(1, repeat)):
                t = time.perf_counter()
                try:
                    rows = con.execute(sql).fetchone()[0]
                except duckdb.Error as e:
                    error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    break
                times.append(time.perf_counter() - t)
            if error:
                out.append({"view": v, "error": error, "within_1s": False})
                continue
            out.append({"view": v, "first_s": round(times[0], 4), "median_s": round(statistics.median(times), 4),
                        "rows": rows, "within_1s": statistics.median(times) <= 1.0})
        return out
    finally:
        con.close()


def run(args: argparse.Namespace) -> int:
    if args.rows < 100 or args.ranks < 1 or args.ranks * 10 > args.rows:
        print(f"tracetop bench views: --rows {args.rows} --ranks {args.ranks}: need rows >= 100 and at least "
              "10 rows per rank", file=sys.stderr)
        return 2
    if args.file is not None:
        if not args.file.exists():
            print(f"tracetop bench views: --file {args.file}: no such file", file=sys.stderr)
            return 2
        try:
            views = time_views(str(args.file), args.repeat, args.memory_limit_gb, args.view)
        except ValueError as e:
            print(f"tracetop bench views: {e}", file=sys.stderr)
            return 2
        result = {"file": str(args.file), "file_bytes": args.file.stat().st_size, "views": views,
                  "all_within_1s": all(v["within_1s"] for v in views),
                  "loadavg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
                  "memory_limit_gb": args.memory_limit_gb}
        _print(result, args.json)
        return 0
    tmp = None
    if args.dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="tracetop-bench-views-")
        folder = Path(tmp.name)
    else:
        folder = args.dir
        folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"views-{args.rows}.duckdb"
    for stale in (path, Path(str(path) + ".wal")):
        stale.unlink(missing_ok=True)
    try:
        t = time.perf_counter()
        counts = generate(str(path), args.rows, args.ranks, args.memory_limit_gb)
        gen_s = time.perf_counter() - t
        size = path.stat().st_size
        views = time_views(str(path), args.repeat, args.memory_limit_gb, args.view)
    finally:
        if not args.keep:
            for p in (path, Path(str(path) + ".wal")):
                p.unlink(missing_ok=True)
        if tmp is not None and not args.keep:
            tmp.cleanup()
    result = {"rows": sum(counts.values()), "rows_by_table": counts, "ranks": args.ranks,
              "file_bytes": size, "generate_s": round(gen_s, 2), "views": views,
              "all_within_1s": all(v["within_1s"] for v in views),
              "loadavg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
              "memory_limit_gb": args.memory_limit_gb,
              "file": str(path) if args.keep else None}
    _print(result, args.json)
    return 0


def _print(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    if "generate_s" in result:
        print(f"generated {result['rows']:,} rows ({result['ranks']} ranks) in {result['generate_s']:.1f} s; "
              f"file {result['file_bytes'] / 1e9:.2f} GB")
    else:
        print(f"{result['file']}: {result['file_bytes'] / 1e9:.2f} GB")
    for v in result["views"]:
        if "error" in v:
            print(f"  {v['view']:<20} {v['error']}")
            continue
        print(f"  {v['view']:<20} first {v['first_s']:8.3f} s  median {v['median_s']:8.3f} s  "
              f"{v['rows']:>10,} rows  {'ok' if v['within_1s'] else 'OVER 1 s'}")
    print(f"load average {result['loadavg_1m']} on {result['cpus']} CPUs")
