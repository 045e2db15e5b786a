"""``tracetop bench hooks``: what the hooks cost a training run.

Two measurements:

1. **Step-time overhead** (``overhead_pct``): interleaved reference-trainer runs (single process,
   tiny model by default; ABBA order), hooks on (shipping over gRPC to a real collector started
   as a subprocess, so the emitter/shipper threads compete for the GIL as in production) and
   ``--no-trace``. Steps are paired by position (step k of an "on" run with step k of the "off"
   run next to it), the first ``--warmup`` steps skipped; the figure is the median of on/off - 1
   over all pairs, in percent, of each step's **process CPU time** (all threads: the training
   thread, the hooks' emitter and shipper threads, gloo), noted at the trainer's own step timer
   (``trainer_hooks/_bench_child.py``). CPU time, because on a shared machine other processes
   move wall-clock step times by several percent from one run to the next, far more than the
   effect measured; it counts every CPU cycle the hooks add, also on other cores.
   ``overhead_wall_pct`` is the same figure from wall-clock step times, for reference. The
   collector runs at nice 10 (in production it is on another host).
2. **Host time per recorded event** (``ns_per_event``): a microbenchmark of the exact hot paths on
   this process's training thread, with a real Shipper to the same collector: a gloo world of 1
   and, per step, ``tracer.step`` around the instruction sequence of the reference trainer's
   stage 0 (PP2, 4 micro-batches: 22 instructions through the instruction wrapper, 10 collectives
   through the collective wrapper, gloo all_reduce standing in for send/recv). Blocks of steps
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
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_LISTEN = re.compile(r"tracetop collector: listening on (\S+?),")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--pairs", type=int, default=6, help="on/off run pairs, ABBA order (default 6)")
    p.add_argument("--steps", type=int, default=140, help="steps per run (default 140)")
    p.add_argument("--warmup", type=int, default=10, help="first steps of each run left out (default 10)")
    p.add_argument("--model", default="tiny", help="reference trainer model preset (default tiny)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--micro-blocks", type=int, default=30, help="microbenchmark blocks (default 30)")
    p.add_argument("--keep", default=None, help="keep the collector's file and the run logs in this folder")


class _Collector:
    def __init__(self, folder: Path) -> None:
        self.db = folder / "bench.duckdb"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "collector", "--db", str(self.db), "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
            preexec_fn=lambda: os.nice(10),
        )
        self.addr = ""
        self.lines: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                m = _LISTEN.search(line)
                if m and not ready.is_set():
                    self.addr = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(120) or not self.addr:
            self.stop()
            raise RuntimeError("bench hooks: the collector did not start:\n" + "\n".join(self.lines[-20:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _run_trainer(args: argparse.Namespace, folder: Path, name: str, endpoint: str, traced: bool) -> tuple[list[float], list[float]]:
    """One run; (wall seconds, process CPU seconds) per step."""
    log, cpu = folder / f"{name}.jsonl", folder / f"{name}.cpu.json"
    argv = [sys.executable, "-m", "trainer_hooks._bench_child", str(cpu), "--quiet", "--steps", str(args.steps),
            "--model", args.model, "--micro-batches", str(args.micro_batches), "--log-jsonl", str(log)]
    if not traced:
        argv.append("--no-trace")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TRACETOP_ENDPOINT=endpoint,
               TRACETOP_RUN_ID=f"bench-{name}")
    env.pop("TRACETOP_DISABLE", None)
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench hooks: run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    wall = [json.loads(line)["step_time_s"] for line in log.read_text().splitlines() if line.strip()]
    return wall, json.loads(cpu.read_text())


def paired_overhead_pct(on_runs: list[list[float]], off_runs: list[list[float]], warmup: int) -> float:
    """Median over step positions and run pairs of on/off - 1, in percent (pure)."""
    ratios = []
    for on, off in zip(on_runs, off_runs):
        for a, b in zip(on[warmup:], off[warmup:]):
            if b > 0:
                ratios.append(a / b)
    if not ratios:
        raise ValueError("no paired steps; raise --steps above --warmup")
    return (statistics.median(ratios) - 1.0) * 100.0


def _microbench(args: argparse.Namespace, endpoint: str) -> dict[str, float]:
    import socket

    import torch
    import torch.distributed as dist

    from trainer_hooks import pipeline as pipeline_mod
    from trainer_hooks.tracer import Tracer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    tensor = torch.ones(256)
    tracer = Tracer(endpoint=endpoint, run_id="bench-micro", rank=0, world_size=1, wrap_collectives=True,
                    heartbeat_s=5.0, device="cpu")
    tracer.set_topology({"dp": [(0,)]})

    class _Engine:  # a PipelineEngine-shaped object: the reference trainer's schedule, shape for shape
        pass

    from trainer_hooks import collectives as colls

    def compute(self: Any, buffer_id: int = 0) -> None:
        return None

    def p2p(self: Any, buffer_id: int = 0) -> None:  # a pipeline send/recv: a meta and a data tensor
        dist.all_reduce(tensor)
        dist.all_reduce(tensor)

    def reduce(self: Any, buffer_id: int = 0) -> None:  # gradient all-reduce + grad-norm all-reduce
        dist.all_reduce(tensor)
        dist.all_reduce(tensor)

    kinds = {"LoadMicroBatch": compute, "ForwardPass": compute, "BackwardPass": compute, "SendActivation": p2p,
             "RecvGrad": p2p, "ReduceGrads": reduce, "OptimizerStep": compute}
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
    steps_per_block = 100

    def block(on: bool) -> tuple[int, int, int]:
        t = tracer if on else null
        handlers = on_steps if on else off_steps
        if on:
            colls.install(tracer)
        else:
            colls.uninstall()  # the originals: no hook on the training thread at all
        ev0 = tracer.events
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        for n in range(steps_per_block):
            with t.step(n):
                for h in handlers:
                    h(engine)
        return time.thread_time_ns() - c0, time.perf_counter_ns() - t0, tracer.events - ev0

    block(True)
    block(False)
    per_event, per_event_wall = [], []
    for _ in range(args.micro_blocks):
        on_cpu, on_wall, events = block(True)
        off_cpu, off_wall, _ = block(False)
        per_event.append((on_cpu - off_cpu) / max(1, events))
        per_event_wall.append((on_wall - off_wall) / max(1, events))
    tracer.close()
    colls.uninstall()
    dist.destroy_process_group()
    return {"ns_per_event": statistics.median(per_event), "ns_per_event_p90": sorted(per_event)[int(0.9 * (len(per_event) - 1))],
            "ns_per_event_wall": statistics.median(per_event_wall)}


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.steps <= args.warmup:
        print(f"bench hooks: --steps {args.steps} must exceed --warmup {args.warmup}", file=sys.stderr)
        return 2
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tracetop-bench-hooks-"))
    folder.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    collector = _Collector(folder)
    try:
        on_runs: list[list[float]] = []
        off_runs: list[list[float]] = []
        on_cpu: list[list[float]] = []
        off_cpu: list[list[float]] = []
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)  # ABBA
            for traced in order:
                wall, cpu = _run_trainer(args, folder, f"{'on' if traced else 'off'}{i}", collector.addr, traced)
                (on_runs if traced else off_runs).append(wall)
                (on_cpu if traced else off_cpu).append(cpu)
            if not args.json:
                print(f"  pair {i}: median step {statistics.median(on_runs[-1][args.warmup:]) * 1e3:.2f} ms on, "
                      f"{statistics.median(off_runs[-1][args.warmup:]) * 1e3:.2f} ms off (wall); "
                      f"{statistics.median(on_cpu[-1][args.warmup:]) * 1e3:.2f} / "
                      f"{statistics.median(off_cpu[-1][args.warmup:]) * 1e3:.2f} ms CPU", flush=True)
        overhead_wall = paired_overhead_pct(on_runs, off_runs, args.warmup)
        overhead = paired_overhead_pct(on_cpu, off_cpu, args.warmup)
        micro = _microbench(args, collector.addr)
    finally:
        collector.stop()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    med_on = statistics.median(s for r in on_runs for s in r[args.warmup:])
    med_off = statistics.median(s for r in off_runs for s in r[args.warmup:])
    med_on_cpu = statistics.median(s for r in on_cpu for s in r[args.warmup:])
    med_off_cpu = statistics.median(s for r in off_cpu for s in r[args.warmup:])
    result = {
        "overhead_pct": round(overhead, 3),
        "overhead_wall_pct": round(overhead_wall, 3),
        "ns_per_event": round(micro["ns_per_event"], 1),
        "ns_per_event_p90": round(micro["ns_per_event_p90"], 1),
        "ns_per_event_wall": round(micro["ns_per_event_wall"], 1),
        "median_step_on_ms": round(med_on * 1e3, 3),
        "median_step_off_ms": round(med_off * 1e3, 3),
        "median_step_cpu_on_ms": round(med_on_cpu * 1e3, 3),
        "median_step_cpu_off_ms": round(med_off_cpu * 1e3, 3),
        "pairs": args.pairs,
        "steps_per_run": args.steps,
        "warmup_steps": args.warmup,
        "model": args.model,
        "device": "cpu",
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"hooks overhead {result['overhead_pct']:+.2f}% of median step CPU time "
              f"({result['overhead_wall_pct']:+.2f}% wall; paired by step, {args.pairs} run pairs; goal <= 1%); {result['ns_per_event']:.0f} ns per recorded event on the "
              f"training thread (goal <= 2000 ns); median step {result['median_step_on_ms']:.2f} ms on, "
              f"{result['median_step_off_ms']:.2f} ms off; {result['wall_s']:.0f} s")
    return 0
