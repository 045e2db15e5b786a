"""What the views' roll (collector/ingest/matviews.py `advance`) costs per step, as CPU seconds, on a
fixed file: the figure that does not stretch with the machine's load.

    .venv/bin/python -m collector.bench.roll_cost [--shape mix|pipeline] [--ranks 16384] [--steps 6]
        [--repeat 5] [--threads 2] [--file F.duckdb] [--live] [--json]

The file (made once by DuckDB's own INSERT ... SELECT, kept with --file) holds `--steps` steps of
`--ranks` ranks, inserted step by step as a collector stores them:

- `mix`: what `tracetop bench ingest --mix realistic` ships (20 COLLECTIVE and 16 PIPE_INSTR rows a
  rank-step, the loadgen template's values: "op-0".."op-3", counters 1..1000; no RUN_START rows, so one
  stage of every rank);
- `pipeline`: a 3D-parallel run (RUN_START rows, 4 pipeline stages, dp / tp / p2p collectives,
  ReduceGrads), the shape a real trainer's hooks give.

Timed, each `--repeat` times (median and min..max of the process's CPU time, which counts DuckDB's
worker threads; wall beside it): `advance`, one roll that materializes the last `--roll-steps` steps
(watermarks set back to their first rows; rolled back after), per step; and each of its statements
alone for one step (step_ranks into a temp table, then each derived view over it). Run it with
another tree first on PYTHONPATH to compare that tree's SQL on the same file.

`--live` (mix only; `--steps` steps) times instead every roll the writer makes (views, both rollups),
as a collector makes them: over a fresh file whose rows are still uncompressed in memory (at 16,384
ranks the checkpointed file's views roll cost 120 ms CPU a step, the live one 300-350: `time_live`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

_MIX_RANKS_PER_SOURCE = 2048  # 16,384 ranks over 8 sources, as the bench splits them


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _mix_step(con, step: int, ranks: int, first: int = 0) -> None:
    """One step of the realistic mix, with the loadgen template's values (collector/bench/loadgen.py
    `mix_template`: per source, row j's counters are j % 1000 + 1, its strings '<col>-' || j % 4);
    ranks first..ranks-1 (one source's: first, first + 2048)."""
    per = _MIX_RANKS_PER_SOURCE
    t0 = 1_700_000_000_000_000_000 + step * 2_000_000_000
    con.execute(f"""INSERT INTO step (run_id, rank, step, start_ns, duration_ns, data_wait_ns, forward_ns, backward_ns,
            optimizer_ns, comm_exposed_ns, compute_ns, tokens, samples, loss, micro_batch, micro_batches)
        SELECT 'mix', r, {step}, {t0}, j, j, j, j, j, j, j, j, j, (r % {per}) / {per - 1}, j, j
        FROM (SELECT i AS r, (i % {per}) % 1000 + 1 AS j FROM range({first}, {ranks}) t(i))""")
    con.execute(f"""INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, bytes,
            peer, dtype, is_async)
        SELECT 'mix', i // 20, {step}, {t0}, j % 1000 + 1, 'op-' || j % 4, 'role-' || j % 4, j % 1000 + 1,
               j % 1000 + 1, j % 1000 + 1, 'dtype-' || j % 4, j % 1000 + 1
        FROM (SELECT i, i % ({per} * 20) AS j FROM range({first} * 20, {ranks} * 20) t(i))""")
    con.execute(f"""INSERT INTO pipe_instr (run_id, rank, step, start_ns, duration_ns, stage, micro_batch, instr)
        SELECT 'mix', i // 16, {step}, {t0}, j % 1000 + 1, j % 1000 + 1, j % 1000 + 1, 'instr-' || j % 4
        FROM (SELECT i, i % ({per} * 16) AS j FROM range({first} * 16, {ranks} * 16) t(i))""")


def _pipeline_start(con, ranks: int) -> None:
    con.execute(f"""INSERT INTO run_start (run_id, rank, step, start_ns, duration_ns, world_size, tp, pp, dp, zero_stage,
            stage, model_name, n_params, micro_batch, micro_batches, seq_len, hostname, pid)
        SELECT 'pipe', i, -1, 0, 0, {ranks}, 8, 4, {max(1, ranks // 32)}, 1, (i // 8) % 4, 'm', 1000000000, 1, 8,
               2048, 'node' || (i // 8), i
        FROM range({ranks}) t(i)""")


def _pipeline_step(con, step: int, ranks: int) -> None:
    """One step of a TP 8 x PP 4 x DP run: per rank 8 dp/tp collectives, 4 p2p, 16 pipeline instructions
    (2 ReduceGrads); compute ~850 ms with one slow rank in 997."""
    t0 = 1_700_000_000_000_000_000 + step * 1_000_000_000
    con.execute(f"""INSERT INTO step (run_id, rank, step, start_ns, duration_ns, data_wait_ns, forward_ns, backward_ns,
            optimizer_ns, comm_exposed_ns, compute_ns, tokens, samples, loss, micro_batch, micro_batches)
        SELECT 'pipe', i, {step}, {t0} + hash(i, {step}) % 1000000, 900000000 + hash(i, {step}, 1) % 100000000,
               hash(i, {step}, 2) % 1000000, 300000000 + hash(i, {step}, 3) % 1000000, 500000000, 50000000,
               40000000 + hash(i, {step}, 4) % 10000000,
               850000000 + hash(i, {step}, 5) % 1000000 + CASE WHEN (i + {step}) % 997 = 0 THEN 300000000 ELSE 0 END,
               16384, 8, 2.0, 1, 8
        FROM range({ranks}) t(i)""")
    con.execute(f"""INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, bytes,
            peer, dtype, is_async)
        SELECT 'pipe', i // 12, {step}, {t0} + i, 100000 + hash(i, {step}) % 10000000,
               ['all_reduce', 'reduce_scatter_tensor', 'all_gather_into_tensor', 'all_reduce', 'send', 'recv'][1 + (i % 12) % 6],
               ['dp', 'dp', 'dp', 'tp', 'p2p:pp', 'p2p:pp'][1 + (i % 12) % 6], 8, 1024 << (i % 20), -1, 'bfloat16', 0
        FROM range({ranks} * 12) t(i)""")
    con.execute(f"""INSERT INTO pipe_instr (run_id, rank, step, start_ns, duration_ns, stage, micro_batch, instr)
        SELECT 'pipe', i // 16, {step}, {t0} + i, 1000000 + hash(i, {step}) % 1000000, (i // 128) % 4, (i % 16) // 2,
               ['ForwardPass', 'BackwardPass', 'SendActivation', 'RecvGrad', 'ReduceGrads', 'ForwardPass',
                'BackwardPass', 'ReduceTiedGrads'][1 + i % 8]
        FROM range({ranks} * 16) t(i)""")


def generate(path: str, shape: str, ranks: int, steps: int) -> None:
    """A collector file of `steps` steps of `ranks` ranks, every step materialized (a closed file)."""
    from collector.ingest import matviews
    from collector.ingest.schema import connect, migrate

    con = connect(path)
    try:
        migrate(con, path)
        con.execute("BEGIN TRANSACTION")
        if shape == "pipeline":
            _pipeline_start(con, ranks)
        for s in range(steps):
            (_pipeline_step if shape == "pipeline" else _mix_step)(con, s, ranks)
        matviews.rebuild(con)
        con.execute("COMMIT")
        con.execute("CHECKPOINT")
    finally:
        con.close()


def _timed(fn, repeat: int) -> dict:
    cpu, wall = [], []
    for _ in range(repeat):
        c, w = _cpu_s(), time.perf_counter()
        fn()
        cpu.append(_cpu_s() - c)
        wall.append(time.perf_counter() - w)
    return {"cpu_ms": round(1e3 * statistics.median(cpu), 1), "cpu_ms_min": round(1e3 * min(cpu), 1),
            "cpu_ms_max": round(1e3 * max(cpu), 1), "wall_ms": round(1e3 * statistics.median(wall), 1)}


def _first_rows(con, first_step: int) -> dict[str, int]:
    """Per input table, the rowid of its first row of step >= first_step (rows go in step by step)."""
    from collector.ingest import matviews

    out = {}
    for t in matviews.INPUTS:
        lo = con.execute(f"SELECT min(rowid) FROM {t} WHERE step >= {first_step}").fetchone()[0]
        out[t] = int(lo) if lo is not None else con.execute(f"SELECT coalesce(max(rowid) + 1, 0) FROM {t}").fetchone()[0]
    return out


def time_roll(con, roll_steps: int, repeat: int) -> dict:
    """One `advance_in(final=True)` over the last `roll_steps` steps, rolled back after each try."""
    from collector.ingest import matviews

    last = con.execute("SELECT max(step) FROM step").fetchone()[0]
    marks = _first_rows(con, last - roll_steps + 1)

    def roll() -> None:
        con.execute("BEGIN TRANSACTION")
        for t, m in marks.items():
            con.execute("INSERT OR REPLACE INTO views_state VALUES (?, ?)", [t, m])
        n = matviews.advance_in(con, final=True)
        assert n == roll_steps, n
        con.execute("ROLLBACK")

    r = _timed(roll, repeat)
    return {k: round(v / roll_steps, 1) for k, v in r.items()}


def time_statements(con, repeat: int) -> dict:
    """Each of the roll's statements alone over the file's last step."""
    from collector.ingest import matviews

    step = con.execute("SELECT max(step) FROM step").fetchone()[0]
    con.execute(f"CREATE OR REPLACE TEMP TABLE _rc_keys AS SELECT DISTINCT run_id, step FROM step WHERE step = {step}")
    keys = "(SELECT * FROM _rc_keys)"
    out = {"step_ranks": _timed(lambda: con.execute(
        f"CREATE OR REPLACE TEMP TABLE _tt_sr AS {matviews.step_ranks_sql(keys, step, step)}"), repeat)}
    for v in matviews.VIEWS[1:]:
        sql = matviews.derived_sql(v, "_tt_sr", keys, step, step)
        out[v] = _timed(lambda sql=sql: con.execute(f"CREATE OR REPLACE TEMP TABLE _rc_out AS {sql}"), repeat)
    return out


def time_live(ranks: int, steps: int, checkpoint_mb: int = 64) -> dict:
    """The writer's rolls as a collector makes them: a fresh file (rows uncompressed in memory until
    the checkpoint threshold, as the collector's), each step's mix rows committed source by source
    (8 sources of `ranks` / 8), the writer's roll rule (collector/ingest/writer.py `_roll_up` whenever
    a kind has more than ROLL_EVERY_ROWS rows past its watermark) and its closing roll. Process CPU
    of the rolls (the inserts are not counted), per step, by rolled table."""
    from collector.ingest import rollup
    from collector.ingest.schema import migrate, open_store
    from collector.ingest.writer import Writer

    per_source = -(-ranks // 8)
    cost: dict[str, float] = {}
    rows = 0
    with tempfile.TemporaryDirectory(prefix="tracetop-roll-live-") as d:
        path = str(Path(d) / "live.duckdb")
        con = open_store(path, settings={"checkpoint_threshold": f"{checkpoint_mb}MB"})
        migrate(con, path)
        w = Writer(con)
        w._roll_cursor.close()
        try:
            def roll(at_least: int) -> None:
                before = {t: n for t, n in w._unrolled.items() if n > at_least or at_least == 0}
                for t in before:  # one table at a time, as _roll_up goes, to charge each its CPU
                    keep = {u: n for u, n in w._unrolled.items() if u != t}
                    for u in keep:
                        w._unrolled[u] = 0
                    c = _cpu_s()
                    w._roll_up(con, at_least)
                    cost[t] = cost.get(t, 0.0) + _cpu_s() - c
                    w._unrolled.update(keep)

            for s in range(steps):
                for first in range(0, ranks, per_source):
                    _mix_step(con, s, min(ranks, first + per_source), first)
                    w._newest_step["mix"] = s  # what the writer notes of committed step rows
                    n = min(ranks, first + per_source) - first
                    rows += n * 37
                    w._unrolled["step_rollup"] += n
                    w._unrolled["collective_rollup"] += 20 * n
                    w._unrolled["views"] += 37 * n
                    if max(w._unrolled.values()) > rollup.ROLL_EVERY_ROWS:
                        roll(rollup.ROLL_EVERY_ROWS)
            roll(0)
        finally:
            con.close()
    out = {t: round(1e3 * c / steps, 1) for t, c in cost.items()}
    return {"roll_cpu_ms_per_step": out, "total_ms_per_step": round(sum(out.values()), 1),
            "cpu_s_per_m_rows": round(sum(cost.values()) / rows * 1e6, 3), "rows": rows}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=["mix", "pipeline"], default="mix")
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=6, help="steps in a generated file (default 6)")
    parser.add_argument("--roll-steps", type=int, default=3, help="steps one timed roll materializes (default 3)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="DuckDB threads (default: DuckDB's own)")
    parser.add_argument("--file", type=Path, default=None, help="use (or make and keep) this file")
    parser.add_argument("--live", action="store_true", help="the writer's rolls over a fresh file (`time_live`) only")
    parser.add_argument("--json", action="store_true")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collector.bench.roll_cost", description=__doc__.split("\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    from collector.ingest.schema import open_store

    if a.live:
        load0 = os.getloadavg()[0]
        live = time_live(a.ranks, a.steps) | {"load": [round(load0, 2), round(os.getloadavg()[0], 2)]}
        print(json.dumps(live) if a.json else live)
        return 0
    tmp = None
    path = a.file
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="tracetop-roll-")
        path = Path(tmp.name) / "roll.duckdb"
    if not path.exists():
        generate(str(path), a.shape, a.ranks, a.steps)
    con = open_store(str(path))
    try:
        if a.threads:
            con.execute(f"SET threads = {int(a.threads)}")
        load0 = os.getloadavg()[0]
        result = {"file": str(path), "threads": con.execute("SELECT current_setting('threads')").fetchone()[0],
                  "statements_per_step": time_statements(con, a.repeat),
                  "advance_per_step": time_roll(con, a.roll_steps, a.repeat),
                  "load": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    finally:
        con.close()
        if tmp is not None:
            tmp.cleanup()
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
