"""`tracetop bench live [--ranks 16384] [--json]`: what live judgments cost.

Figures, from one run:
  eval_ms_p50, eval_ms_p99   one completed step judged by the built-in rules at --ranks ranks
                             (PP4, a STEP row and 8 collective rows a rank-step, as a real step has)
  ingest_ms_per_step         feeding that step's rows into the live state (vectorised)
  lost_ms_p50, lost_ms_p99   of eval_ms: the lost-time split (collector/live/lost.py) of that step and
                             adding it to the run's sums, timed alone on the same steps
  live_state_mb              the live state holding --window steps of --ranks ranks
  ingest_on_vs_off           `tracetop bench ingest` events/s with the built-in rules over without
                             (--no-rules), interleaved A B B A so that load drifts cancel
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=16384, help="ranks in the judged run (default 16384)")
    parser.add_argument("--window", type=int, default=64, help="steps the live state holds (default 64)")
    parser.add_argument("--steps", type=int, default=40, help="steps judged for the timing (default 40)")
    parser.add_argument("--ingest-events", type=int, default=1_000_000, help="events per ingest block (0: skip)")
    parser.add_argument("--sources", type=int, default=4, help="shipper processes per ingest block")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _batches(ranks: int, step: int, rng) -> list[tuple]:
    import numpy as np

    from tracetop.events import Kind

    r = np.arange(ranks, dtype=np.int32)
    n = ranks
    ns = lambda ms: (rng.normal(ms, ms * 0.05, n) * 1e6).astype(np.int64)  # noqa: E731
    z = np.zeros(n, np.int64)
    fwd, bwd, opt = ns(30), ns(60), ns(5)
    step_cols = {"rank": r, "step": np.full(n, step, np.int64), "start_ns": np.full(n, step * 10**9, np.int64),
                 "duration_ns": ns(200), "data_wait_ns": z, "forward_ns": fwd, "backward_ns": bwd, "optimizer_ns": opt,
                 "comm_exposed_ns": ns(60), "compute_ns": fwd + bwd + opt, "tokens": np.full(n, 8192, np.int64),
                 "samples": np.full(n, 8, np.int64), "loss": np.full(n, 2.0), "micro_batch": np.full(n, 2, np.int32),
                 "micro_batches": np.full(n, 4, np.int32)}
    k = 8  # per rank: 2 gradient all-reduces, a 4-byte loss all-reduce, a broadcast, 4 p2p
    rr = np.repeat(r, k)
    ops = (np.tile(np.array([0, 0, 0, 1, 2, 3, 2, 3], np.int32), n), ("all_reduce", "broadcast", "send", "recv"))
    roles = (np.tile(np.array([0, 0, 0, 1, 2, 2, 2, 2], np.int32), n), ("dp", "pp|mp", "p2p:pp"))
    nbytes = np.tile(np.array([1 << 22, 1 << 22, 4, 8, 1 << 16, 1 << 16, 1 << 16, 1 << 16], np.int64), n)
    coll = {"rank": rr, "step": np.full(n * k, step, np.int64), "start_ns": np.full(n * k, step * 10**9, np.int64),
            "duration_ns": (rng.exponential(5, n * k) * 1e6).astype(np.int64), "op": ops, "role": roles,
            "group_size": np.full(n * k, 2, np.int32), "bytes": nbytes, "peer": np.full(n * k, -1, np.int32),
            "dtype": (np.zeros(n * k, np.int32), ("float32",)), "is_async": np.zeros(n * k, np.int32)}
    return [(Kind.COLLECTIVE, coll), (Kind.STEP, step_cols)]


def _run_start(ranks: int, pp: int) -> dict:
    import numpy as np

    n = ranks
    i4 = np.full(n, 1, np.int32)
    s = (np.zeros(n, np.int32), ("",))
    return {"rank": np.arange(n, dtype=np.int32), "step": np.full(n, -1, np.int64), "start_ns": np.zeros(n, np.int64),
            "duration_ns": np.zeros(n, np.int64), "world_size": np.full(n, n, np.int32), "tp": i4,
            "pp": np.full(n, pp, np.int32), "dp": np.full(n, n // pp, np.int32), "zero_stage": i4,
            "stage": (np.arange(n) // (n // pp)).astype(np.int32), "model_name": s, "n_params": np.zeros(n, np.int64),
            "flops_per_token": np.full(n, np.nan), "peak_flops": np.full(n, np.nan), "micro_batch": i4,
            "micro_batches": i4, "seq_len": i4, "hostname": s, "pid": i4, "ds_config_json": s, "meta_json": s}


def judge_cost(ranks: int, window: int, steps: int) -> dict:
    import numpy as np

    from collector.live.engine import Evaluator
    from collector.live.rules import defaults
    from tracetop.events import Kind

    rng = np.random.default_rng(0)
    ev = Evaluator(defaults(), window=window, settle_s=0.0)
    ev.ingest(Kind.RUN_START, "bench", _run_start(ranks, 4), 0)
    pre = [_batches(ranks, s, rng) for s in range(3)]
    ingest_s, eval_s, lost_s = [], [], []
    from collector.live.lost import RunLost

    book = RunLost()  # the bench's own sums (the engine keeps its own)
    for s in range(window + steps):
        batches = pre[s % 3]
        t0 = time.perf_counter()
        for kind, cols in batches:
            cols = {**cols, "step": np.full(len(cols["rank"]), s, np.int64)}
            ev.ingest(kind, "bench", cols, 10**9 * s)
        t1 = time.perf_counter()
        ev.evaluate_ready(10**9 * s + 1, 0.0)
        t2 = time.perf_counter()
        if s >= window:  # the window is full: steady state
            ingest_s.append(t1 - t0)
            eval_s.append(t2 - t1)
            lost_s.append(_lost_cost(ev, s, book))
    ms = np.array(eval_s) * 1e3
    return {"ranks": ranks, "window": window, "eval_ms_p50": round(float(np.quantile(ms, 0.5)), 2),
            "eval_ms_p99": round(float(np.quantile(ms, 0.99)), 2),
            "ingest_ms_per_step": round(float(np.median(ingest_s)) * 1e3, 2),
            "lost_ms_p50": round(float(np.quantile(lost_s, 0.5)) * 1e3, 2),
            "lost_ms_p99": round(float(np.quantile(lost_s, 0.99)) * 1e3, 2),
            "live_state_mb": round(ev.state.nbytes / 2**20, 1), "steps_evaluated": ev.stats.steps_evaluated}


def _lost_cost(ev, step: int, book) -> float:
    """Seconds the lost-time part of judging `step` takes: the split, the run's sums and reading
    the window (the calls judge.step_figures and the Evaluator make, on the step's own figures)."""
    from collector.live import judge
    from collector.live import lost as L

    v = judge.step_view(ev.state.runs["bench"], step)
    if v is None:
        return float("nan")
    c = v.cols
    others = judge.sg.straggler_scores(v.stage, c["compute_ns"] / 1e6, c["coll_wait_ns"] / 1e6).others_compute_ms
    t0 = time.perf_counter()
    s = L.step_lost(v.rank, c["duration_ns"] / 1e6, c["compute_ns"] / 1e6, others, c["data_wait_ns"] / 1e6,
                    (c["forward_ns"] + c["backward_ns"]) / 1e6, c["p2p_ns"] / 1e6, c["p2p_bytes"],
                    v.best_p2p_bytes_per_ns * 1e6, c["comm_exposed_ns"] / 1e6, pp=v.pp, micro_batches=v.micro_batches,
                    gpus=v.world, step=step, end_ns=v.end_ns)
    book.add(s)
    book.window()
    book.top_rank()
    return time.perf_counter() - t0


def ingest_ratio(events: int, sources: int) -> dict:
    from collector.bench.ingest import ingest

    on, off = [], []
    with tempfile.TemporaryDirectory(prefix="tracetop-live-") as d:
        for label in ("on", "off", "off", "on"):
            args = () if label == "on" else ("--no-rules",)
            r = ingest(sources, events, Path(d), collector_args=args)
            (on if label == "on" else off).append(r["events_per_s"])
    return {"ingest_on_events_per_s": on, "ingest_off_events_per_s": off,
            "ingest_on_vs_off": round(sum(on) / sum(off), 3)}


def run(args: argparse.Namespace) -> int:
    result = judge_cost(args.ranks, args.window, args.steps)
    if args.ingest_events > 0:
        result.update(ingest_ratio(args.ingest_events, args.sources))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0
