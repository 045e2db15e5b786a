"""`tracetop bench tui [--ranks 1024] [--json]`: what the TUI costs, and how fast Ranks redraws.

- tui_cpu_pct: the TUI's CPU share of one core (user + system of its process, over --seconds)
  while it shows the Ranks screen and applies a snapshot of --ranks simulated ranks at 2 Hz,
  running in a real pty (os.openpty, 140 x 45) that the bench drains like a terminal would.
  Also on the Overview (tui_cpu_pct_overview), measured in the same run, interleaved.
- ranks_refresh_ms: the Ranks screen's refresh at --refresh-ranks (16,384) simulated ranks, in
  process, headless: from handing the app a new snapshot to the end of its repaint (median of
  --refreshes; the max too), at the auto aggregation level (replica cells) and at rank level.
Simulated snapshots come from tui/bench/sim.py (prebuilt, so the generator is not measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=1024, help="simulated ranks for the CPU figure (default 1024)")
    parser.add_argument("--refresh-ranks", type=int, default=16384,
                        help="simulated ranks for the refresh figure (default 16384)")
    parser.add_argument("--seconds", type=float, default=10.0, help="CPU measurement window per screen (default 10)")
    parser.add_argument("--refreshes", type=int, default=10, help="refreshes timed (default 10)")
    parser.add_argument("--warmup-s", type=float, default=6.0, help="start-up left out of each window (default 6)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", choices=("ranks", "overview"), help=argparse.SUPPRESS)


def _child(screen: str, ranks: int) -> int:
    """The TUI on simulated snapshots at 2 Hz, in the pty the parent gave us."""
    from tui.app import TracetopApp
    from tui.bench.sim import SimSource

    app = TracetopApp(SimSource(ranks), interval_s=0.5, initial=screen)
    return int(app.run() or 0)


def _cpu_in_pty(screen: str, ranks: int, seconds: float, warmup_s: float = 6.0) -> tuple[float, float]:
    """(CPU % of one core, bytes/s written to the terminal) of the TUI over `seconds`."""
    import fcntl
    import pty  # noqa: F401  (Linux pty semantics)
    import select
    import struct
    import termios

    import psutil

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 45, 140, 0, 0))
    env = dict(os.environ, TERM="xterm-256color")
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    proc = subprocess.Popen([sys.executable, "-m", "tui.bench.render", "--child", screen, "--ranks", str(ranks)],
                            stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    try:
        p = psutil.Process(proc.pid)

        def drain(until: float) -> bytes:
            got = bytearray()
            while time.monotonic() < until:
                r, _, _ = select.select([master], [], [], 0.05)
                if r:
                    try:
                        got += os.read(master, 1 << 16)
                    except OSError:
                        break
            return bytes(got)

        drain(time.monotonic() + warmup_s)  # start-up and the first snapshots are not measured
        c0, t0 = p.cpu_times(), time.monotonic()
        seen = drain(t0 + seconds)
        c1, t1 = p.cpu_times(), time.monotonic()
        if proc.poll() is not None or len(seen) < 1000:
            raise RuntimeError(f"tracetop bench tui: the TUI drew {len(seen)} bytes in {seconds} s "
                               f"(exit {proc.poll()}); it is not running as measured")
        return 100.0 * ((c1.user - c0.user) + (c1.system - c0.system)) / (t1 - t0), len(seen) / (t1 - t0)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(master)


async def _refresh_ms(ranks: int, refreshes: int, level: str) -> list[float]:
    from tui.app import TracetopApp
    from tui.bench import sim

    snaps = [sim.snapshot(ranks, step=100 + i) for i in range(3)]
    app = TracetopApp(None, initial="ranks", show_no_source=False)
    out = []
    async with app.run_test(size=(140, 45)) as pilot:
        app.on_snapshot(snaps[0])
        app.ranks.level = level
        await pilot.pause()
        for i in range(refreshes):
            t0 = time.perf_counter()
            app.on_snapshot(snaps[(i + 1) % len(snaps)])
            await pilot.pause()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def run(args: argparse.Namespace) -> int:
    if args.child:
        return _child(args.child, args.ranks)
    import asyncio

    if args.ranks < 1 or args.refresh_ranks < 1:
        print("tracetop bench tui: --ranks and --refresh-ranks must be at least 1", file=sys.stderr)
        return 2
    load = os.getloadavg()
    cpu_ranks, cpu_overview, tty_bps = [], [], []
    for _ in range(2):  # interleaved A/B: ranks, overview, ranks, overview
        cpu, bps = _cpu_in_pty("ranks", args.ranks, args.seconds, args.warmup_s)
        cpu_ranks.append(cpu)
        tty_bps.append(bps)
        cpu_overview.append(_cpu_in_pty("overview", args.ranks, args.seconds, args.warmup_s)[0])
    auto = asyncio.run(_refresh_ms(args.refresh_ranks, args.refreshes, "auto"))
    rank_level = asyncio.run(_refresh_ms(args.refresh_ranks, args.refreshes, "rank"))
    out = {
        "ranks": args.ranks,
        "tui_cpu_pct": round(statistics.median(cpu_ranks), 1),
        "tui_cpu_pct_runs": [round(x, 1) for x in cpu_ranks],
        "tui_cpu_pct_overview": round(statistics.median(cpu_overview), 1),
        "tty_bytes_per_s": round(statistics.median(tty_bps)),
        "refresh_ranks": args.refresh_ranks,
        "ranks_refresh_ms": round(statistics.median(auto), 1),
        "ranks_refresh_ms_max": round(max(auto), 1),
        "ranks_refresh_ms_rank_level": round(statistics.median(rank_level), 1),
        "rate_hz": 2.0,
        "loadavg_1m": round(load[0], 2),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"tracetop bench tui ({out['ranks']} simulated ranks at 2 Hz in a 140x45 pty; load {load[0]:.2f}):")
        print(f"  TUI CPU, Ranks screen:    {out['tui_cpu_pct']:.1f}% of a core (runs {out['tui_cpu_pct_runs']})")
        print(f"  TUI CPU, Overview screen: {out['tui_cpu_pct_overview']:.1f}% of a core")
        print(f"  Ranks refresh at {out['refresh_ranks']} ranks: {out['ranks_refresh_ms']:.1f} ms median "
              f"(max {out['ranks_refresh_ms_max']:.1f}); every rank a cell: {out['ranks_refresh_ms_rank_level']:.1f} ms")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
