"""What one Watch snapshot costs the collector at scale: a file with --ranks ranks × --steps steps
(step rows, 4 collectives a rank a step), then collector/watch.snapshot on a cursor, as the
Watch handler calls it (the first builds the per-step cache; later ones reuse it), and a new step.

Two ways, interleaved (A/B in one run): `sql`, every section by the bounded SQL (a collector
without the live engine), and `live`, the per-rank sections from a live engine's state fed the
same rows (collector/watch.LiveSnapshots, what a collector with the engine does).

    .venv/bin/python -m collector.bench.watch_snapshot [--ranks 16384] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    from collector.ingest.schema import open_store
    from collector.live.engine import LiveEngine
    from collector.query import snapshot as snap
    from collector.query import watch

    n, steps = a.ranks, a.steps
    with tempfile.TemporaryDirectory() as d:
        con = open_store(os.path.join(d, "big.duckdb"))
        con.execute(f"""INSERT INTO run_start (run_id, rank, step, start_ns, duration_ns, world_size, tp, pp, dp,
            zero_stage, stage, model_name, hostname, micro_batches)
            SELECT 'big', r, -1, 0, 0, {n}, 8, 16, {max(n // 128, 1)}, 1, r // {max(n // 16, 1)}, 'm',
                   'node' || (r // 8), 8 FROM range({n}) t(r)""")

        def add(lo: int, hi: int) -> None:
            con.execute(f"""INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns, forward_ns,
                backward_ns, optimizer_ns, comm_exposed_ns, data_wait_ns, tokens, samples)
                SELECT 'big', r, s, s * 1000000000, 200000000 + (r % 7) * 1000000, 120000000, 40000000, 70000000,
                       10000000, 30000000, 100000, 4096, 4 FROM range({lo}, {hi}) u(s), range({n}) t(r)""")
            con.execute(f"""INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size,
                bytes, peer) SELECT 'big', r, s, s * 1000000000, 5000000, 'all_reduce', 'dp', 128, 1048576, -1
                FROM range({lo}, {hi}) u(s), range({n}) t(r), range(4) k(i)""")

        add(0, steps)
        engine = LiveEngine([], window=64)  # its state only: fed below as the writer's on_commit would
        feed(engine, n, 0, steps, start=True)
        live = watch.LiveSnapshots(engine)
        cur = con.cursor()
        cursors = {"sql": snap.Cursor("big"), "live": snap.Cursor("big")}
        took: dict[str, list[float]] = {"sql": [], "live": []}
        for i in range(6):
            if i == 2:
                add(steps, steps + 1)
                feed(engine, n, steps, steps + 1)
            for how in ("sql", "live") if i % 2 == 0 else ("live", "sql"):
                t = time.perf_counter()
                b = watch.snapshot(cur, "big", cursor=cursors[how], live=live if how == "live" else None)
                dt = (time.perf_counter() - t) * 1e3
                s = snap.decode(b)
                took[how].append(dt)
                print(f"snapshot {i} {how:>4}: {dt:.0f} ms, {len(b) / 1e6:.2f} MB, step {s.step}, "
                      f"built from {s.header['built_from']}")
        for how, ts in took.items():
            later = sorted(ts[1:])  # the first SQL one builds the per-step cache
            print(f"{how}: median {later[len(later) // 2]:.0f} ms a snapshot after the first")
        # the lost-time section alone (collector/query/lost_sql.py over the same window), interleaved with
        # the snapshot's other sections' cost above: what the TUI's lost line adds
        from collector.query.lost_sql import lost_window_sql

        top = snap.decode(b).step
        for lo_steps in (1, snap.DEFAULT_WINDOW_STEPS):
            t = time.perf_counter()
            cur.sql(lost_window_sql(), params={"run": "big", "lo": max(top - lo_steps + 1, 0), "hi": top,
                                               "since_ns": 0}).fetchall()
            print(f"lost section over {min(lo_steps, top + 1)} steps: {(time.perf_counter() - t) * 1e3:.0f} ms")
        print(f"load {os.getloadavg()[0]:.2f}")
        cur.close()
        con.close()
    return 0


def feed(engine, n: int, lo: int, hi: int, *, start: bool = False) -> None:
    """The rows `add` writes, as decoded columns into the engine's state (what on_commit hands it)."""
    import numpy as np

    from tracetop.events import Kind

    state = engine.ev.state
    now = time.time_ns()
    r = np.arange(n)
    if start:
        state.ingest(Kind.RUN_START, "big", {
            "rank": r, "step": np.full(n, -1), "start_ns": np.full(n, now), "world_size": np.full(n, n), "tp": np.full(n, 8),
            "pp": np.full(n, 16), "dp": np.full(n, max(n // 128, 1)), "micro_batches": np.full(n, 8),
            "flops_per_token": np.full(n, np.nan), "stage": r // max(n // 16, 1),
            "hostname": (r // 8, [f"node{k}" for k in range(n // 8 + 1)])}, now)
    for s in range(lo, hi):
        st = np.full(n, s)
        state.ingest(Kind.STEP, "big", {
            "rank": r, "step": st, "start_ns": np.full(n, now), "duration_ns": 200000000 + (r % 7) * 1000000, "compute_ns": np.full(n, 120000000),
            "forward_ns": np.full(n, 40000000), "backward_ns": np.full(n, 70000000),
            "optimizer_ns": np.full(n, 10000000), "comm_exposed_ns": np.full(n, 30000000),
            "data_wait_ns": np.full(n, 100000), "tokens": np.full(n, 4096), "samples": np.full(n, 4),
            "loss": np.full(n, np.nan)}, now)
        rr = np.repeat(r, 4)
        state.ingest(Kind.COLLECTIVE, "big", {
            "rank": rr, "step": np.full(4 * n, s), "start_ns": np.full(4 * n, now), "duration_ns": np.full(4 * n, 5000000),
            "op": (np.zeros(4 * n, np.int32), ["all_reduce"]), "role": (np.zeros(4 * n, np.int32), ["dp"]),
            "bytes": np.full(4 * n, 1048576)}, now)


if __name__ == "__main__":
    sys.exit(main())
