"""What one Watch snapshot costs the collector at scale: a file with --ranks ranks × --steps steps
(step rows, 4 collectives a rank a step), then collector/watch.snapshot on a cursor, as the
Watch handler calls it (the first builds the per-step cache; later ones reuse it), and a new step.

    .venv/bin/python scripts/bench_watch_snapshot.py [--ranks 16384] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    from collector import watch
    from collector.schema import open_store
    from tracetop import snapshot as snap

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
        cur = con.cursor()
        c = snap.Cursor("big")
        for i in range(4):
            if i == 2:
                add(steps, steps + 1)
            t = time.perf_counter()
            b = watch.snapshot(cur, "big", cursor=c)
            dt = (time.perf_counter() - t) * 1e3
            print(f"snapshot {i}: {dt:.0f} ms, {len(b) / 1e6:.2f} MB, step {snap.decode(b).step}")
        # the lost-time section alone (tracetop/lost_sql.py over the same window), interleaved with
        # the snapshot's other sections' cost above: what the TUI's lost line adds
        from tracetop.lost_sql import lost_window_sql

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


if __name__ == "__main__":
    sys.exit(main())
