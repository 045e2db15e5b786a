"""`tracetop bench ingest`: N shipper processes into a real collector; events/s stored end to end.

Figures, all from one run:
  events_per_s           rows committed / (last commit − first record), from the collector's ingest_log
  p50_ms, p99_ms         record → commit delay per row (a batch's oldest record to its commit; an
                         upper bound for the batch's other rows), weighted by rows
  collector_cpu_pct      collector CPU time / wall time over the run (100 = one core)
  collector_cpu_s_per_m  collector CPU seconds per million rows stored (the work, however long the
                         machine's load stretched the run)
  collector_cpu_s_per_m_through_close  the same counting the collector's stop too: its close rolls
                         up the views and rollups still pending and checkpoints, work a running
                         collector does in its roll thread after the sources end
  collector_cpu_s_per_m_by_thread  the same by thread (their OS names: tracetop-writer, tracetop-rollup,
                         tracetop-live, main (gRPC edge), and DuckDB's workers under the process's name)
  collector_peak_rss_mb  the collector's VmHWM
  window                 the rows mix's sources: 16,384-row chunks a source may have unacked when it
                         records the next (`--window`, default 1; a real shipper never waits for acks,
                         up to its 256 MiB budget: larger windows give larger commits, docs/benchmarks.md)

`--ab 'SETTING'`: interleaved runs of the collector as it is (A) and with SETTING (B: collector flags,
and NAME=VALUE words set in the collector's environment), `--runs` of each, A B A B ...; each run's
figures with the load average, then per figure the median and spread (min..max) of each side and
B's median over A's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sources", type=int, default=8, help="shipper processes (default 8)")
    parser.add_argument("--events", type=int, default=4_000_000, help="events in all, split over the sources")
    parser.add_argument("--listen", default=None, help="collector address (default: 127.0.0.1 on a free port)")
    parser.add_argument("--dir", type=Path, default=None, help="keep the DuckDB file here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--window", type=int, default=None,
                        help="rows mix: 16,384-row chunks a source may have unacked when it records the next "
                        "(default 1, or TRACETOP_BENCH_WINDOW)")
    mix = parser.add_argument_group("simulated ranks (--mix realistic)")
    mix.add_argument("--mix", choices=["rows", "realistic"], default="rows",
                     help="rows: identifiable STEP rows as fast as acks allow (default); realistic: --ranks ranks' "
                     "per-step mix (1 STEP, 20 COLLECTIVE, 16 PIPE_INSTR, 1 MEMORY, 1 THROUGHPUT a rank-step; GPU "
                     "samples at 1 Hz per 8 ranks; heartbeats every 5 s) at --step-s")
    mix.add_argument("--ranks", type=int, default=16384, help="simulated ranks (default 16384)")
    mix.add_argument("--step-s", type=float, default=1.0, help="the simulated training step time (default 1 s)")
    mix.add_argument("--duration-s", type=float, default=300.0, help="how long the ranks ship (default 300)")
    ab = parser.add_argument_group("A/B (interleaved runs of two collector settings)")
    ab.add_argument("--ab", metavar="SETTING", default=None,
                    help="B's setting: collector flags and NAME=VALUE environment words, e.g. '--no-rules' or "
                    "'TRACETOP_ROLL=off'; A is the collector as it is")
    ab.add_argument("--runs", type=int, default=5, help="runs of each side with --ab (default 5)")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of process `pid`: (its OS name, CPU seconds so far). The main thread is named
    "main (gRPC edge)"; the collector names its own threads in the OS (app.name_os_threads), so
    what keeps the process's name was made by DuckDB (its workers) or a library."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    try:
        threads = psutil.Process(pid).threads()
        process_name = Path(f"/proc/{pid}/comm").read_text().strip()
    except (psutil.Error, OSError):
        return out
    for t in threads:
        try:
            name = Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip()
        except OSError:
            name = "?"
        if t.id == pid:
            name = "main (gRPC edge)"
        elif name == process_name:
            name = "DuckDB workers"
        out[t.id] = (name, t.user_time + t.system_time)
    return out


def _cpu_s(times) -> float:
    return times.user + times.system


def _stop_counting_cpu(collector, ps) -> float:
    """Stop the collector; its CPU seconds (user + system) at the last look before it exited (every
    20 ms: a stop's last 20 ms at most go uncounted)."""
    import threading

    import psutil

    stopper = threading.Thread(target=collector.stop, name="bench-stop")
    last = _cpu_s(ps.cpu_times())
    stopper.start()
    while stopper.is_alive():
        try:
            last = _cpu_s(ps.cpu_times())
        except psutil.Error:  # exited
            break
        stopper.join(0.02)
    stopper.join()
    return last


def _cpu_by_thread(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], rows: int) -> dict:
    """CPU seconds per million rows stored, by thread name (threads of one name summed; a thread
    that ended within the window is missing), largest first."""
    per: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        per[name] = per.get(name, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    return {k: round(v / max(rows, 1) * 1e6, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.005}


def _commit_delays(db: Path, where: str = ""):
    """From the file's ingest_log: rows per batch, the row-weighted p50 / p99 of record -> commit (ms),
    and the first record / last commit (ns)."""
    import duckdb
    import numpy as np

    con = duckdb.connect(str(db), read_only=True)
    try:
        n, first_ns, committed_ns, t_first, t_last = con.execute(
            "SELECT list(n), list(first_record_ns), list(committed_ns), min(first_record_ns), max(committed_ns) "
            f"FROM ingest_log {where}"
        ).fetchone()
    finally:
        con.close()
    n = np.asarray(n, dtype=np.int64)
    delay_ms = (np.asarray(committed_ns, dtype=np.int64) - np.asarray(first_ns, dtype=np.int64)) / 1e6
    order = np.argsort(delay_ms)
    cum = np.cumsum(n[order]) / n.sum()
    p50 = float(delay_ms[order][np.searchsorted(cum, 0.50)])
    p99 = float(delay_ms[order][np.searchsorted(cum, 0.99)])
    return n, p50, p99, t_first, t_last


def ingest(sources: int, events: int, workdir: Path, listen: str | None = None,
           collector_args: tuple[str, ...] = (), window: int | None = None) -> dict:
    import psutil

    from collector.bench.loadgen import (
        MAX_INFLIGHT_BATCHES,
        CollectorProcess,
        collect_sources,
        count_stored,
        release,
        start_sources,
    )

    db = workdir / "ingest.duckdb"
    db.unlink(missing_ok=True)
    listen = listen or f"127.0.0.1:{_free_port()}"
    collector = CollectorProcess(db, listen, extra_args=tuple(collector_args))
    collector.start()
    assert collector.proc is not None
    ps = psutil.Process(collector.proc.pid)
    go = workdir / "go"
    window = window or _env_window() or MAX_INFLIGHT_BATCHES
    procs = start_sources(listen, "bench", sources, events // sources, start_file=go, window=window)
    release(go, procs)  # every source set up: interpreter start-up stays out of the figures
    cpu0, wall0, threads0 = ps.cpu_times(), time.monotonic(), _thread_cpu(ps.pid)
    results = collect_sources(procs)
    cpu1, wall1, threads1 = ps.cpu_times(), time.monotonic(), _thread_cpu(ps.pid)
    peak_rss = _peak_rss_mb(collector.proc.pid)
    cpu_closed = _stop_counting_cpu(collector, ps)

    n, p50, p99, t_first, t_last = _commit_delays(db, "WHERE kind = 'step'")
    counts = count_stored(db, "bench")
    stored = sum(s for s, _ in counts["per_source"].values())
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "sources": sources,
        "window": window,
        "events": int(sum(r["sent"] for r in results)),
        "stored": stored,
        "events_per_s": round(stored / ((t_last - t_first) / 1e9), 1),
        "p50_ms": round(p50, 1),
        "p99_ms": round(p99, 1),
        "collector_cpu_pct": round(100 * cpu_s / (wall1 - wall0), 1),
        "collector_cpu_s_per_m": round(cpu_s / max(stored, 1) * 1e6, 2),
        "collector_cpu_s_per_m_through_close": round((cpu_closed - _cpu_s(cpu0)) / max(stored, 1) * 1e6, 2),
        "collector_cpu_s_per_m_by_thread": _cpu_by_thread(threads0, threads1, stored),
        "collector_peak_rss_mb": round(peak_rss, 1),
        "sources_cpu_pct": round(100 * sum(r["cpu_s"] for r in results) / (wall1 - wall0), 1),
        "batches": int(len(n)),
        "wall_s": round(wall1 - wall0, 2),
    }


def ingest_mix(ranks: int, step_s: float, duration_s: float, sources: int, workdir: Path,
               listen: str | None = None, collector_args: tuple[str, ...] = ()) -> dict:
    """The realistic mix of `ranks` ranks for `duration_s`: what one collector stores, at what delay,
    CPU and memory, and how fast its file grows. Offered vs stored says whether it keeps up."""
    import psutil

    from collector.bench.loadgen import (
        MIX_GPU_HZ_PER_8_RANKS,
        MIX_HEARTBEAT_S,
        MIX_PER_RANK_STEP,
        CollectorProcess,
        collect_sources,
        release,
        start_mix_sources,
    )

    db = workdir / "mix.duckdb"
    db.unlink(missing_ok=True)
    listen = listen or f"127.0.0.1:{_free_port()}"
    collector = CollectorProcess(db, listen, extra_args=tuple(collector_args))
    collector.start()
    assert collector.proc is not None
    ps = psutil.Process(collector.proc.pid)
    go = workdir / "go"
    procs = start_mix_sources(listen, "mix", sources, ranks, step_s, duration_s, go)
    release(go, procs)
    cpu0, wall0, threads0 = ps.cpu_times(), time.monotonic(), _thread_cpu(ps.pid)
    rss_max = 0.0
    while any(p.poll() is None for p in procs):
        rss_max = max(rss_max, ps.memory_info().rss / 2**20)
        time.sleep(0.5)
    results = collect_sources(procs)
    cpu1, wall1, threads1 = ps.cpu_times(), time.monotonic(), _thread_cpu(ps.pid)
    peak_rss = _peak_rss_mb(collector.proc.pid)
    cpu_closed = _stop_counting_cpu(collector, ps)
    n, p50, p99, t_first, t_last = _commit_delays(db, "WHERE kind <> 'gap'")
    sent = sum(r["sent"] for r in results)
    stored = int(n.sum())
    dropped = sum(int(r.get("rows_dropped", 0)) for r in results)
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:  # what the shippers could not hand over, as the file records it (gap rows)
        gap_dropped = int(con.execute("SELECT coalesce(sum(dropped), 0) FROM gap WHERE kind <> 'gap'").fetchone()[0])
    finally:
        con.close()
    log_text = collector.log_path.read_text(errors="replace") if collector.log_path.exists() else ""
    per_step = sum(MIX_PER_RANK_STEP.values())
    offered = ranks * (per_step / step_s + MIX_GPU_HZ_PER_8_RANKS / 8 + 1 / MIX_HEARTBEAT_S)
    file_mb = db.stat().st_size / 2**20
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "mix": "realistic",
        "ranks": ranks,
        "step_s": step_s,
        "duration_s": duration_s,
        "sources": sources,
        "offered_events_per_s": round(offered, 1),
        "sent": sent,
        "stored": stored,
        "events_per_s": round(stored / ((t_last - t_first) / 1e9), 1),
        # kept up: everything stored, at the offered rate (a collector that falls behind stretches the window)
        "kept_up": bool(stored == sent and stored / ((t_last - t_first) / 1e9) >= 0.95 * offered),
        # under overload: what the shippers dropped (counted, and recorded as gap rows), and whether
        # every row sent is stored or counted
        "shipper_rows_dropped": dropped,
        "gap_rows_dropped": gap_dropped,
        "accounted": bool(stored + dropped == sent),
        "collector_said_behind": log_text.count("collector: behind"),
        "sources_late_steps": int(sum(r["late_steps"] for r in results)),
        "sources_max_lag_s": max(r["max_lag_s"] for r in results),
        "p50_ms": round(p50, 1),
        "p99_ms": round(p99, 1),
        "collector_cpu_pct": round(100 * cpu_s / (wall1 - wall0), 1),
        # CPU seconds per million rows stored: the work, whatever the machine's load stretched the run to
        "collector_cpu_s_per_m": round(cpu_s / max(stored, 1) * 1e6, 2),
        "collector_cpu_s_per_m_through_close": round((cpu_closed - _cpu_s(cpu0)) / max(stored, 1) * 1e6, 2),
        "collector_cpu_s_per_m_by_thread": _cpu_by_thread(threads0, threads1, stored),
        "collector_peak_rss_mb": round(max(peak_rss, rss_max), 1),
        "sources_cpu_pct": round(100 * sum(r["cpu_s"] for r in results) / (wall1 - wall0), 1),
        "file_mb": round(file_mb, 1),
        "file_gb_per_hour": round(file_mb / 1024 * 3600 / duration_s, 2),
        # the closed file's bytes over the rank-steps simulated (every kind, views and rollups included)
        "bytes_per_rank_step": round(db.stat().st_size / (ranks * max(1.0, duration_s / step_s)), 1),
        "wall_s": round(wall1 - wall0, 2),
    }


def _split_setting(setting: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """'--flag 1 NAME=VALUE' -> (collector flags, environment)."""
    flags, env = [], {}
    for word in shlex.split(setting):
        name, eq, value = word.partition("=")
        if eq and not word.startswith("-") and name.isidentifier():
            env[name] = value
        else:
            flags.append(word)
    return tuple(flags), env


#: the tree this bench runs from (the folder holding `collector/`)
OWN_TREE = str(Path(__file__).resolve().parents[2])


def side_env(env: dict[str, str]) -> dict[str, str]:
    """One side's environment words, with PYTHONPATH always set: the side's own, else this bench's tree
    first. The children run `python -m ...` in the work dir (see `_one`): run in a checkout, `-m` puts
    the current directory first on sys.path, ahead of PYTHONPATH, and B ran A's tree (the A/Bs of
    other trees before this fix compared a tree with itself)."""
    if "PYTHONPATH" in env:
        return env
    rest = os.environ.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": OWN_TREE + (os.pathsep + rest if rest else "")}


def _one(args: argparse.Namespace, workdir: Path, flags: tuple[str, ...], env: dict[str, str]) -> dict:
    env, workdir = side_env(env), workdir.resolve()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the collector and source processes inherit it
    cwd = os.getcwd()
    os.chdir(workdir)  # ... and this directory, which holds no package to shadow PYTHONPATH's
    try:
        if args.mix == "realistic":
            return ingest_mix(args.ranks, args.step_s, args.duration_s, args.sources, workdir, args.listen, flags)
        return ingest(args.sources, args.events, workdir, args.listen, flags, args.window)
    finally:
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: the figures an A/B compares (those a run has)
AB_FIGURES = ("events_per_s", "p50_ms", "p99_ms", "collector_cpu_pct", "collector_cpu_s_per_m",
              "collector_cpu_s_per_m_through_close", "collector_peak_rss_mb", "file_mb")


def ab(args: argparse.Namespace) -> dict:
    """Interleaved A B A B ... runs; medians and spread per side."""
    b_flags, b_env = _split_setting(args.ab)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tracetop-ab-", dir=args.dir) as d:
        for i in range(args.runs):
            for side, flags, env in (("A", (), {}), ("B", b_flags, b_env)):
                load = os.getloadavg()[0]
                r = _one(args, Path(d), flags, env)
                r.update(side=side, run=i, load_1m=round(load, 2), load_1m_after=round(os.getloadavg()[0], 2))
                runs.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    out: dict = {"ab": args.ab, "runs_each": args.runs, "mix": args.mix}
    for fig in AB_FIGURES:
        per = {side: [r[fig] for r in runs if r["side"] == side and fig in r] for side in "AB"}
        if not per["A"] or not per["B"]:
            continue
        med = {side: statistics.median(xs) for side, xs in per.items()}
        out[fig] = {side: {"median": round(med[side], 1), "min": min(xs), "max": max(xs)} for side, xs in per.items()}
        out[fig]["b_over_a"] = round(med["B"] / med["A"], 3) if med["A"] else None
    by_thread: dict = {}
    for side in "AB":
        rs = [r.get("collector_cpu_s_per_m_by_thread", {}) for r in runs if r["side"] == side]
        names = sorted({k for r in rs for k in r})
        by_thread[side] = {k: round(statistics.median(r.get(k, 0.0) for r in rs), 3) for k in names}
    out["collector_cpu_s_per_m_by_thread_median"] = by_thread
    if args.mix == "realistic":
        out["kept_up"] = {side: sum(r["kept_up"] for r in runs if r["side"] == side) for side in "AB"}
    out["load_1m"] = [r["load_1m"] for r in runs]
    return out


def _env_window(raw: str | None = None) -> int | None:
    """TRACETOP_BENCH_WINDOW (or ``raw``) as a window, None when unset; ValueError names a bad one."""
    raw = (os.environ.get("TRACETOP_BENCH_WINDOW", "") if raw is None else raw).strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TRACETOP_BENCH_WINDOW={raw!r} is not a whole number of chunks, at least 1")
    return int(raw)


def run(args: argparse.Namespace) -> int:
    if args.window is not None and args.window < 1:
        print("tracetop bench ingest: --window must be at least 1 (chunks a source may have unacked)", file=sys.stderr)
        return 2
    try:  # checked before any run: the environment's, and B's word when --ab sets one
        _env_window()
        b_env = _split_setting(args.ab)[1] if args.ab is not None else {}
        _env_window(b_env.get("TRACETOP_BENCH_WINDOW", ""))
    except ValueError as e:
        print(f"tracetop bench ingest: {e}", file=sys.stderr)
        return 2
    if args.ab is not None:
        if args.runs < 1:
            print("tracetop bench ingest: --runs must be at least 1", file=sys.stderr)
            return 2
        result = ab(args)
        print(json.dumps(result) if args.json else "\n".join(f"{k:>22}: {v}" for k, v in result.items()))
        return 0
    if args.mix == "realistic":
        for flag, value in (("--ranks", args.ranks), ("--step-s", args.step_s), ("--duration-s", args.duration_s)):
            if value <= 0:
                print(f"tracetop bench ingest: {flag} must be positive", file=sys.stderr)
                return 2
        if args.dir is not None:  # --dir keeps the file (mix.duckdb), as for the rows bench
            args.dir.mkdir(parents=True, exist_ok=True)
            result = ingest_mix(args.ranks, args.step_s, args.duration_s, args.sources, args.dir, args.listen)
        else:
            with tempfile.TemporaryDirectory(prefix="tracetop-mix-") as d:
                result = ingest_mix(args.ranks, args.step_s, args.duration_s, args.sources, Path(d), args.listen)
        print(json.dumps(result) if args.json else "\n".join(f"{k:>24}: {v}" for k, v in result.items()))
        return 0 if result["accounted"] else 1
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        result = ingest(args.sources, args.events, args.dir, args.listen, window=args.window)
    else:
        with tempfile.TemporaryDirectory(prefix="tracetop-ingest-") as d:
            result = ingest(args.sources, args.events, Path(d), args.listen, window=args.window)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    return 0 if result["stored"] == result["events"] else 1
