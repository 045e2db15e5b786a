"""`tracetop bench e2e [--ranks 1024] [--json]`: a rank's step end → visible in a Watch snapshot.

A real collector process; --ranks simulated ranks in --sources shipper processes (each the
shipper the hooks use, configured as the hooks configure it: one shipment every --flush-s,
default TRACETOP_FLUSH_S or the hooks' default, 65,536 rows a shipment); every --step-s each
process makes one STEP row per rank with the step's real end time (start_ns + duration_ns), and
hands its rows to the shipper as the hooks' emitter does: on its own timer, every
`Shipper.ship_interval_s` (the flush interval, or the shorter one the collector asks for while the
run is watched: TRACETOP_FRESH_SHIP_S), then ships at once.
A Watch client (the TUI's CollectorSource, at the TUI's default 0.5 s) notes when each step
first shows as the snapshot's complete step. Latency = that arrival time − the step's last rank's
end, p50/p99 over the steps (wall clocks of one machine, so no offset).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tracetop import env

    parser.add_argument("--ranks", type=int, default=1024, help="simulated ranks (default 1024)")
    parser.add_argument("--sources", type=int, default=4, help="shipper processes the ranks are spread over (default 4)")
    parser.add_argument("--steps", type=int, default=30, help="steps (default 30)")
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds a step (default 1)")
    parser.add_argument("--flush-s", type=float, default=None,
                        help=f"seconds between shipments (default ${env.TRACETOP_FLUSH_S} or {env.DEFAULT_FLUSH_S}, "
                        "the hooks' own)")
    parser.add_argument("--interval-s", type=float, default=0.5, help="Watch interval (default 0.5, the TUI's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--source", type=str, default=None, help=argparse.SUPPRESS)


def _source(endpoint: str, run_id: str, lo: int, hi: int, world: int, steps: int, step_s: float,
            flush_s: float, start_at: float) -> None:
    """One shipper process: ranks lo..hi-1, one STEP row each per step, at the step's end."""
    import numpy as np

    from tracetop.events import SCHEMAS, Kind
    from tracetop.wire.shipper import Shipper

    sh = Shipper(endpoint, run_id=run_id, source_id=f"e2e-{lo}-{os.getpid()}", rank=lo,
                 flush_interval_s=flush_s, flush_rows=1 << 16)
    n = hi - lo
    ranks = np.arange(lo, hi, dtype="<i4")
    zeros8, zeros4 = np.zeros(n, "<i8"), np.zeros(n, "<i4")
    now = time.time_ns()
    rs = {c.name: (zeros8 if c.dtype == "i8" else zeros4 if c.dtype == "i4" else np.full(n, np.nan)
                   if c.dtype == "f8" else [""] * n) for c in SCHEMAS[Kind.RUN_START]}
    rs.update(rank=ranks, step=np.full(n, -1, "<i8"), start_ns=np.full(n, now, "<i8"),
              world_size=np.full(n, world, "<i4"), tp=np.ones(n, "<i4"), pp=np.ones(n, "<i4"),
              dp=np.full(n, world, "<i4"), stage=zeros4, model_name=["sim"] * n,
              hostname=[f"node{r // 8:05d}" for r in range(lo, hi)])
    sh.record_many(Kind.RUN_START, rs)
    sh.ship_soon()
    held: list = []  # the emitter's buffer: step rows wait here for the next drain
    lock = threading.Lock()
    done, rewake = threading.Event(), threading.Event()
    sh.on_interval_change(rewake.set)

    def emitter() -> None:  # trainer_hooks.emitter.Emitter's timing, on this process's rows
        last = time.monotonic()
        while not done.is_set():
            if rewake.wait(max(0.0, last + sh.ship_interval_s - time.monotonic())):
                rewake.clear()  # a new interval: drain on its schedule (maybe now)
                continue
            last = time.monotonic()
            with lock:
                parts, held[:] = list(held), []
            for cols in parts:
                sh.record_many(Kind.STEP, cols)
            if parts:
                sh.ship_soon()

    drain = threading.Thread(target=emitter, daemon=True)
    drain.start()
    while time.time() < start_at:
        time.sleep(0.005)
    for step in range(steps):
        t_start = start_at + step * step_s
        t_end = t_start + step_s
        while time.time() < t_end:
            time.sleep(min(0.01, max(t_end - time.time(), 0)))
        end_ns = time.time_ns()
        cols = {c.name: (zeros8 if c.dtype == "i8" else zeros4 if c.dtype == "i4" else np.full(n, np.nan))
                for c in SCHEMAS[Kind.STEP]}
        dur = np.full(n, int(step_s * 1e9), "<i8")
        cols.update(rank=ranks, step=np.full(n, step, "<i8"), start_ns=np.full(n, end_ns, "<i8") - dur,
                    duration_ns=dur, compute_ns=dur // 2, forward_ns=dur // 6, backward_ns=dur // 3)
        with lock:
            held.append(cols)
    done.set()
    rewake.set()
    drain.join()
    with lock:
        for cols in held:
            sh.record_many(Kind.STEP, cols)
    sh.flush(timeout_s=60)
    sh.close()


def _start_collector(tmp: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tracetop.cli", "collector", "--db", str(tmp / "e2e.duckdb"),
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"listening on (\S+),", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, m.group(1)
    raise RuntimeError(f"tracetop bench e2e: the collector exited ({proc.wait()}) before listening")


def run(args: argparse.Namespace) -> int:
    import multiprocessing as mp

    import numpy as np

    from tracetop import env
    from tui.sources import CollectorSource

    if args.ranks < 1 or args.sources < 1 or args.steps < 2 or args.step_s <= 0:
        print("tracetop bench e2e: --ranks, --sources >= 1, --steps >= 2, --step-s > 0", file=sys.stderr)
        return 2
    flush_s = args.flush_s if args.flush_s is not None else float(env.get(env.TRACETOP_FLUSH_S) or env.DEFAULT_FLUSH_S)
    load = os.getloadavg()
    run_id = f"e2e-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="tracetop-e2e-") as tmp:
        coll, addr = _start_collector(Path(tmp))
        try:
            ctx = mp.get_context("spawn")
            start_at = time.time() + 8.0  # every process imported and connected before step 0
            bounds = np.linspace(0, args.ranks, args.sources + 1).astype(int)
            procs = [ctx.Process(target=_source, args=(addr, run_id, int(a), int(b), args.ranks, args.steps,
                                                       args.step_s, flush_s, start_at))
                     for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
            for p in procs:
                p.start()
            seen: dict[int, int] = {}
            src = CollectorSource(addr, run_id)
            src.open()
            stop = threading.Event()
            deadline = start_at + args.steps * args.step_s + flush_s + 30
            while time.time() < start_at - 6:
                time.sleep(0.1)
            first_step: int | None = None  # steps already visible in the first snapshot are not timed
            for snap in _watch_until_known(src, args.interval_s, stop, deadline):
                now = time.time_ns()
                step = snap.step
                if step >= 0 and first_step is None:
                    first_step = step
                    continue
                if first_step is not None:
                    for s in range(max(seen, default=first_step) + 1, step + 1):
                        seen[s] = now
                if step >= args.steps - 1 or time.time() > deadline:
                    break
            stop.set()
            src.close()
            for p in procs:
                p.join(60)
        finally:
            coll.terminate()
            coll.wait(60)
        # the steps' real end times, from the file the collector wrote
        import duckdb

        con = duckdb.connect(str(Path(tmp) / "e2e.duckdb"), read_only=True)
        ends = dict(con.execute("SELECT step, max(start_ns + duration_ns) FROM step WHERE run_id = ? GROUP BY step",
                                [run_id]).fetchall())
        con.close()
    lat = [(seen[s] - ends[s]) / 1e6 for s in sorted(seen) if s in ends]
    if not lat:
        print("tracetop bench e2e: no step became visible through Watch", file=sys.stderr)
        return 1
    out = {
        "ranks": args.ranks, "sources": len(procs), "steps_seen": len(lat), "step_s": args.step_s,
        "flush_s": flush_s, "watch_interval_s": args.interval_s,
        "e2e_p50_ms": round(float(np.percentile(lat, 50)), 1), "e2e_p99_ms": round(float(np.percentile(lat, 99)), 1),
        "e2e_max_ms": round(max(lat), 1), "e2e_mean_ms": round(statistics.mean(lat), 1),
        "loadavg_1m": round(load[0], 2),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"tracetop bench e2e: {out['ranks']} simulated ranks in {out['sources']} shippers, a step every "
              f"{args.step_s} s, shipments every {flush_s} s, Watch every {args.interval_s} s (load {load[0]:.2f}):")
        print(f"  step end → visible in a Watch snapshot: p50 {out['e2e_p50_ms']} ms, p99 {out['e2e_p99_ms']} ms, "
              f"max {out['e2e_max_ms']} ms over {out['steps_seen']} steps")
    return 0


def _watch_until_known(src, interval_s: float, stop: threading.Event, deadline: float):
    """Watch snapshots; while the run is not known yet (NOT_FOUND), retry."""
    from tui.sources import SourceError

    while time.time() < deadline:
        try:
            yield from src.watch(interval_s, stop)
            return
        except SourceError as e:
            if e.title != "unknown run":
                raise
            time.sleep(interval_s)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
