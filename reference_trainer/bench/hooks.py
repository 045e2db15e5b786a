"""``tracetop bench hooks``: what the hooks cost a training run.

Two measurements:

1. **Step-time overhead** (``overhead_pct``): reference-trainer runs (single process, tiny model
   by default) shipping to a real collector started as a subprocess (at nice 10: in production it
   is on another host), in which the hooks are taken off the training thread and put back every
   ``--block`` steps, in quads of four blocks ordered ABBA or BAAB at random
   (``reference_trainer/bench/hooks_child.py``). The hooks' own threads
   (emitter, flusher, sender, gRPC's) run throughout, on their own timers, as in production.
   The figure has two parts, added:

   * ``training_thread_pct``: per step, the training thread's CPU time (read at the trainer's own
     step timer; switching happens outside it). Each quad of blocks (on, off, off, on or the
     reverse) gives (on - off) per step, in which a linear drift of the machine cancels; the
     median over quads, as a share of an off step's process CPU time. This is the hot path plus
     whatever the hooks do to the training thread indirectly.
   * ``hook_threads_pct``: the CPU time of every thread the hooks started, measured exactly over the
     whole window (process CPU minus the training thread's minus that of the threads that existed
     before the hooks started), as an always-on run pays it: their idle ticking per second (from
     an A/A control run, below) per step, plus the rest, which only recorded rows cause, over the
     "on" steps. ``hook_threads_upper_pct`` charges all of it to the "on" steps (errs high).

   ``ci95_low_pct``/``ci95_high_pct`` bootstrap the quads. ``overhead_wall_pct`` is the median
   from wall-clock step times (hook threads not added: here they run on the other core).
   Why short blocks inside runs rather than whole runs with ``--no-trace``: step times on this
   shared machine wander by several percent within seconds (neighbours, caches, frequency), and
   separate processes differ by more; a block of 2 steps (~60 ms) and its neighbours share nearly
   all of that, so a thousand quads pin the difference to about a tenth of a percent. The
   orientation of each quad is random because step times also have periodic parts (the garbage
   collector, for one, runs every so many allocations): a fixed ABBA pattern of 1- or 2-step
   blocks aliased them into a bias of ±0.15% in A/A runs here. Every bench ends with one A/A
   control run (the hooks off in every block, only the labels alternating): its training-thread
   figure (``aa_training_thread_pct``) should read zero within about ±0.4 (one run's noise), and
   it measures the hook threads' idle cost. ``--aa`` makes every run one.
2. **Host time per recorded event** (``ns_per_event``): a microbenchmark of the exact hot paths on
   this process's training thread, with a real Shipper to the same collector: per step,
   ``tracer.step`` around the instruction sequence of the reference trainer's stage 0 (PP2, 4
   micro-batches: 22 instructions through the pipeline wrapper, 10 collectives through the
   collective wrapper; the instructions and the collective are stand-ins that do nothing, since
   their own cost is the same with and without hooks). Blocks of steps
   with hooks on and off alternate; (on - off) CPU time of the training thread
   (``time.thread_time_ns``: immune to other processes taking the CPU) / rows recorded, median
   over blocks. ``ns_per_event_wall`` is the same with wall time (includes GIL waits).

``--json`` prints one object (keys with units). Runs on CPU (DS_ACCELERATOR=cpu); the GPU path
(CUDA events) is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--runs", type=int, default=6, help="reference-trainer runs (default 6)")
    p.add_argument("--steps", type=int, default=1500, help="steps per run (default 1500)")
    p.add_argument("--block", type=int, default=2,
                   help="steps per on or off block (default 2: short blocks cancel the machine's drift)")
    p.add_argument("--warmup", type=int, default=20, help="first steps of each run left out (default 20)")
    p.add_argument("--model", default="tiny", help="reference trainer model preset (default tiny)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--micro-blocks", type=int, default=40, help="microbenchmark blocks (default 40)")
    p.add_argument("--aa", action="store_true",
                   help="every run an A/A control (hooks off in every block, only the labels alternate): the "
                        "training-thread figure should come out within its interval of 0 (checks the estimator)")
    p.add_argument("--keep", default=None, help="keep the collector's file and the run logs in this folder")
    p.add_argument("--ddp", action="store_true",
                   help="instead: the DDP comm hook's own cost, 2 gloo ranks, timed vs plain DDP (trainer_hooks/bench/ddp.py)")
    p.add_argument("--form", choices=("explicit", "auto"), default="explicit",
                   help="auto: the automatic form's cost per step against the explicit API's, one process "
                        "(trainer_hooks/bench/auto_form.py)")
    p.add_argument("--auto-steps", type=int, default=3000, help="steps of the --form auto bench (default 3000)")
    p.add_argument("--ddp-steps", type=int, default=1200, help="steps of the --ddp bench (default 1200)")
    p.add_argument("--ddp-device-clock", action="store_true",
                   help="--ddp with the Tracer on its GPU path (its CUDA clock over host events): the device path's host cost")


class BenchCollector:
    """A collector for the bench runs (a process on a free port, its database in ``folder``)."""

    def __init__(self, folder: Path) -> None:
        from tracetop import procs

        self.db = folder / "bench.duckdb"
        # --flush-interval-s 0.02: acks come within ~20 ms, so each burst's stream (and gRPC's
        # threads serving it) closes soon after it, as with a collector or agent that is not idle.
        self.service = procs.collector(self.db, "127.0.0.1:0", extra_args=["--flush-interval-s", "0.02"], nice=10)
        try:
            self.service.start(120)
        except procs.ServiceError as e:
            raise RuntimeError(f"bench hooks: the collector did not start:\n{e}") from None
        self.addr = self.service.address

    def stop(self) -> None:
        try:
            self.service.stop(timeout_s=60)
        except Exception:
            self.service.kill()


def _run_trainer(args: argparse.Namespace, folder: Path, name: str, endpoint: str, seed: int, aa: bool) -> dict[str, Any]:
    """One run with the hooks switched every --block steps; the child's per-step log."""
    out = folder / f"{name}.json"
    argv = [sys.executable, "-m", "reference_trainer.bench.hooks_child", str(out), str(args.block), str(args.warmup), str(seed),
            *(["--aa"] if aa else []), "--quiet",
            "--steps", str(args.steps), "--model", args.model, "--micro-batches", str(args.micro_batches)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TRACETOP_ENDPOINT=endpoint,
               TRACETOP_RUN_ID=f"bench-{name}")
    env.pop("TRACETOP_DISABLE", None)
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench hooks: run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


@dataclass
class RunQuads:
    """One run's quads of blocks (per-step means, seconds, of the quad's two on and two off blocks) and
    the CPU time of its hook threads."""

    thread_on: list[float] = field(default_factory=list)
    thread_off: list[float] = field(default_factory=list)
    wall_on: list[float] = field(default_factory=list)
    wall_off: list[float] = field(default_factory=list)
    off_cpu: list[float] = field(default_factory=list)  # process CPU per step of the off blocks
    hook_threads_cpu_s: float = 0.0
    on_steps: int = 0
    window_wall_s: float = 0.0  # wall time from the first measured step to the last one's end
    window_steps: int = 0


def block_quads(log: dict[str, Any]) -> RunQuads:
    """Group one run's blocks (pure) into quads 4q..4q+3, which _bench_child switches in ABBA or
    BAAB order (on, off, off, on or the reverse, at random), so a linear drift of the machine
    cancels inside each quad. Quads the warmup cuts into are left out."""
    block, warmup = int(log["block"]), int(log["warmup"])
    steps = min(len(log["on"]), len(log["cpu_s"]))
    out = RunQuads()

    def mean(key: str, idx: list[int]) -> float:
        return sum(log[key][i] for i in idx) / len(idx)

    quad = 4 * block
    for q0 in range(0, steps - quad + 1, quad):
        if q0 < warmup:
            continue
        on_idx = [n for n in range(q0, q0 + quad) if log["on"][n]]
        off_idx = [n for n in range(q0, q0 + quad) if not log["on"][n]]
        if len(on_idx) != 2 * block or len(off_idx) != 2 * block:
            continue
        out.thread_on.append(mean("thread_cpu_s", on_idx))
        out.thread_off.append(mean("thread_cpu_s", off_idx))
        out.wall_on.append(mean("wall_s", on_idx))
        out.wall_off.append(mean("wall_s", off_idx))
        out.off_cpu.append(mean("cpu_s", off_idx))
    window = log.get("window") or {}
    out.hook_threads_cpu_s = float(window.get("hook_threads_cpu_s", 0.0))
    out.on_steps = int(window.get("on_steps", 0))
    out.window_wall_s = float(window.get("wall_s", 0.0))
    out.window_steps = int(window.get("steps", 0))
    return out


def idle_rate(control: RunQuads) -> float:
    """CPU seconds per second the hooks' threads spend with nothing recorded (pure): from an A/A
    control run, in which they run beside training but every hook is off."""
    return control.hook_threads_cpu_s / control.window_wall_s if control.window_wall_s > 0 else 0.0


def estimate(runs: list[RunQuads], resamples: int = 2000, seed: int = 0, idle_cpu_per_s: float | None = None) -> dict[str, float]:
    """Overhead in percent of an off step's process CPU time (pure but for the seeded bootstrap).

    ``training_thread_pct``: the median over quads of (on - off) training-thread CPU per
    step: the hot path, plus whatever the hooks do to the training thread indirectly (caches).
    ``hook_threads_pct``: the CPU time of the threads the hooks started (emitter, flusher, sender,
    gRPC's), measured exactly over the whole window, as an always-on run would pay it per step:
    their idle ticking (``idle_cpu_per_s``, from an A/A control run) per step of wall time, plus
    the rest, which only rows cause, over the "on" steps. Without a control run everything is
    charged to the "on" steps (``hook_threads_upper_pct``: errs high, the ticking during "off"
    blocks counted too). ``overhead_pct`` is the sum; its 95% interval bootstraps the quads.
    ``overhead_wall_pct``: the same median from wall-clock step times, hook threads not added (on
    this machine they run on the other core)."""
    import numpy as np

    d = np.array([a - b for r in runs for a, b in zip(r.thread_on, r.thread_off)])
    dw = np.array([a - b for r in runs for a, b in zip(r.wall_on, r.wall_off)])
    base = float(np.mean([c for r in runs for c in r.off_cpu]))
    base_wall = float(np.mean([w for r in runs for w in r.wall_off]))
    on_steps = sum(r.on_steps for r in runs)
    hook_cpu = sum(r.hook_threads_cpu_s for r in runs)
    upper = hook_cpu / on_steps / base * 100 if on_steps else 0.0
    hook = upper
    if idle_cpu_per_s is not None and on_steps:
        wall = sum(r.window_wall_s for r in runs)
        steps = sum(r.window_steps for r in runs)
        rows_cpu = max(0.0, hook_cpu - idle_cpu_per_s * wall)
        hook = min(upper, (rows_cpu / on_steps + idle_cpu_per_s * wall / max(1, steps)) / base * 100)
    thread = float(np.median(d)) / base * 100
    rng = np.random.default_rng(seed)
    boot = np.median(d[rng.integers(0, len(d), (resamples, len(d)))], axis=1) / base * 100 + hook
    return {
        "overhead_pct": thread + hook,
        "ci95_low_pct": float(np.percentile(boot, 2.5)),
        "ci95_high_pct": float(np.percentile(boot, 97.5)),
        "training_thread_pct": thread,
        "hook_threads_pct": hook,
        "hook_threads_upper_pct": upper,
        "overhead_wall_pct": float(np.median(dw)) / base_wall * 100,
        "off_step_cpu_ms": base * 1e3,
        "quads": len(d),
    }


def hook_thread_rates(windows: list[dict[str, Any]]) -> dict[str, float]:
    """CPU ms per second of window, by hook thread name (pure); threads that ended inside a window
    (gRPC's per-stream ones) appear as "ended threads"."""
    wall = sum(float(w.get("wall_s", 0.0)) for w in windows)
    if wall <= 0:
        return {}
    by_name: dict[str, float] = {}
    for w in windows:
        listed = 0.0
        for name, cpu in (w.get("hook_threads") or {}).items():
            key = name.rsplit(" [", 1)[0]
            by_name[key] = by_name.get(key, 0.0) + cpu
            listed += cpu
        by_name["ended threads"] = by_name.get("ended threads", 0.0) + max(0.0, float(w.get("hook_threads_cpu_s", 0.0)) - listed)
    return {k: round(v * 1e3 / wall, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}


def microbench(args: argparse.Namespace, endpoint: str) -> dict[str, float]:
    """Training-thread CPU time per recorded event of the exact hot paths (see the module doc)."""
    import torch

    from trainer_hooks.integrations import collectives as colls
    from trainer_hooks.integrations import pipeline as pipeline_mod
    from trainer_hooks.tracer import Tracer

    tensor = torch.ones(256)
    tracer = Tracer(endpoint=endpoint, run_id="bench-micro", rank=0, world_size=1, wrap_collectives=False,
                    heartbeat_s=5.0, device="cpu")
    tracer.set_topology({"dp": [(0,)]})

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None  # the collective itself costs the same with and without hooks: left out

    # the wrapper install() puts in place of torch.distributed.all_reduce, around the stand-in
    wrapped_all_reduce = colls.wrap_function("all_reduce", all_reduce)
    current = {"all_reduce": all_reduce}

    class _Engine:  # a PipelineEngine-shaped object: the reference trainer's schedule, shape for shape
        pass

    def compute(self: Any, buffer_id: int = 0) -> None:
        return None

    def two_collectives(self: Any, buffer_id: int = 0) -> None:  # send/recv: meta + data; reduce: grads + norm
        ar = current["all_reduce"]
        ar(tensor)
        ar(tensor)

    kinds = {"LoadMicroBatch": compute, "ForwardPass": compute, "BackwardPass": compute,
             "SendActivation": two_collectives, "RecvGrad": two_collectives, "ReduceGrads": two_collectives,
             "OptimizerStep": compute}
    table = {type(n, (), {}): fn for n, fn in kinds.items()}
    _Engine._INSTRUCTION_MAP = table  # type: ignore[attr-defined]
    engine = _Engine()
    pipeline_mod.wrap(engine, tracer)
    wrapped = engine._INSTRUCTION_MAP  # type: ignore[attr-defined]
    by_name = {cls.__name__: cls for cls in table}
    # one step of stage 0 in a PP2 1F1B schedule with 4 micro-batches (what the reference trainer runs)
    schedule = [*(["LoadMicroBatch", "ForwardPass", "SendActivation"] * 2),
                *(["LoadMicroBatch", "ForwardPass", "SendActivation", "RecvGrad", "BackwardPass"] * 2),
                *(["RecvGrad", "BackwardPass"] * 2), "ReduceGrads", "OptimizerStep"]
    on_steps = [wrapped[by_name[n]] for n in schedule]
    off_steps = [table[by_name[n]] for n in schedule]
    null = tracer.__class__(enabled=False)
    steps_per_block = 300

    def block(on: bool) -> tuple[int, int, int]:
        t = tracer if on else null
        handlers = on_steps if on else off_steps
        current["all_reduce"] = wrapped_all_reduce if on else all_reduce
        colls.route_to(tracer.recorder if on else None)
        ev0 = tracer.events
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        for n in range(steps_per_block):
            with t.step(n):
                for h in handlers:
                    h(engine)
        return time.thread_time_ns() - c0, time.perf_counter_ns() - t0, tracer.events - ev0

    try:
        block(True)
        block(False)
        per_event, per_event_wall = [], []
        for _ in range(args.micro_blocks):
            on_cpu, on_wall, events = block(True)
            off_cpu, off_wall, _ = block(False)
            per_event.append((on_cpu - off_cpu) / max(1, events))
            per_event_wall.append((on_wall - off_wall) / max(1, events))
    finally:
        colls.route_to(None)
        tracer.close()
    return {"ns_per_event": statistics.median(per_event), "ns_per_event_p90": sorted(per_event)[int(0.9 * (len(per_event) - 1))],
            "ns_per_event_wall": statistics.median(per_event_wall)}


def run(args: argparse.Namespace) -> int:
    if getattr(args, "form", "explicit") == "auto":
        from trainer_hooks.bench import auto_form

        return auto_form.run(args)
    if getattr(args, "ddp", False):
        from trainer_hooks.bench import ddp as bench_ddp

        return bench_ddp.run(args)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.steps < args.warmup + 8 * args.block or args.block < 1:
        print(f"bench hooks: --steps {args.steps} must leave at least two quads of 4 blocks of --block {args.block} (>= 1) "
              f"after --warmup {args.warmup}", file=sys.stderr)
        return 2
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tracetop-bench-hooks-"))
    folder.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    collector = BenchCollector(folder)
    try:
        runs: list[RunQuads] = []
        windows: list[dict[str, Any]] = []
        for i in range(args.runs):
            log = _run_trainer(args, folder, f"ab{i}", collector.addr, seed=i, aa=args.aa)
            runs.append(block_quads(log))
            windows.append(log.get("window") or {})
            if not args.json and runs[-1].thread_on:
                one = estimate([runs[-1]], resamples=200)
                print(f"  run {i}: {one['quads']} quads, training thread {one['training_thread_pct']:+.2f}%, "
                      f"hook threads {one['hook_threads_upper_pct']:.2f}% at most", flush=True)
        if not any(r.thread_on for r in runs):
            raise RuntimeError("bench hooks: no complete quad of blocks; raise --steps or lower --block/--warmup")
        # The A/A control: what the hooks' threads cost with nothing recorded, and what the
        # estimator reads when nothing differs between "on" and "off" blocks.
        control = block_quads(_run_trainer(args, folder, "aa", collector.addr, seed=args.runs, aa=True))
        idle = idle_rate(control)
        null = estimate([control], resamples=500) if control.thread_on else {}
        if not args.json:
            print(f"  A/A control run: training thread {null.get('training_thread_pct', float('nan')):+.2f}% "
                  f"(nothing differs: should be 0 within ~0.4), hook threads idle {idle * 1e3:.2f} ms per s", flush=True)
        est = estimate(runs, idle_cpu_per_s=idle)
        micro = microbench(args, collector.addr)
    finally:
        collector.stop()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    result = {
        **{k: round(v, 3) if isinstance(v, float) else v for k, v in est.items()},
        "ns_per_event": round(micro["ns_per_event"], 1),
        "ns_per_event_p90": round(micro["ns_per_event_p90"], 1),
        "ns_per_event_wall": round(micro["ns_per_event_wall"], 1),
        "hook_threads_ms_per_s": hook_thread_rates(windows),
        "hook_threads_idle_ms_per_s": round(idle * 1e3, 3),
        "aa_training_thread_pct": round(null.get("training_thread_pct", float("nan")), 3),
        "runs": args.runs,
        "steps_per_run": args.steps,
        "block_steps": args.block,
        "model": args.model,
        "aa_only": args.aa,
        "device": "cpu",
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    if args.json:
        print(json.dumps(result))
    else:
        r = result
        print(f"hooks overhead {r['overhead_pct']:+.2f}% of step CPU time (95% interval {r['ci95_low_pct']:+.2f} to "
              f"{r['ci95_high_pct']:+.2f}; training thread {r['training_thread_pct']:+.2f}% as the median of "
              f"{r['quads']} quads of on/off blocks, hook threads {r['hook_threads_pct']:.2f}% measured "
              f"(at most {r['hook_threads_upper_pct']:.2f}%); goal <= 1%); "
              f"wall step time {r['overhead_wall_pct']:+.2f}%; {r['ns_per_event']:.0f} ns per recorded event on the "
              f"training thread (goal <= 2000 ns); {r['wall_s']:.0f} s")
        print("hook threads, CPU ms per second: " + ", ".join(f"{k} {v:.2f}" for k, v in r["hook_threads_ms_per_s"].items()))
    return 0
