"""``tracetop bench hooks``: what the hooks cost a training run.

Two measurements:

1. **Step-time overhead** (``overhead_pct``): reference-trainer runs (single process, tiny model
   by default) in which the hooks are switched off and on every ``--block`` steps, in ABBA order
   (``trainer_hooks/_bench_child.py``): "on" is the hooks as the trainer starts them, shipping
   over gRPC to a real collector started as a subprocess (so the emitter and shipper threads
   compete for the GIL as in production); "off" removes every hook, as ``--no-trace`` would. Each
   step's **process CPU time** (every thread: training, emitter, shipper, gloo) is noted at the
   trainer's own step timer; when an "on" block ends, what it recorded is shipped at once and that
   CPU time is charged to the block. Adjacent on/off blocks are paired; the figure is the median
   over pairs of (on CPU per step) / (off CPU per step) - 1, in percent. ``overhead_wall_pct`` is
   the same from wall-clock step times, the block's shipping CPU added as if the training thread
   had waited for all of it.
   Why blocks inside runs rather than whole runs with ``--no-trace``: separate processes of the
   same run differ by several percent in step time from one process to the next (memory layout,
   core, neighbours; measured here: medians of 28-36 ms for identical runs), which buries a 1%
   effect; blocks inside one process share all of that. The collector runs at nice 10 (in
   production it is on another host).
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
    p.add_argument("--runs", type=int, default=6, help="reference-trainer runs (default 6)")
    p.add_argument("--steps", type=int, default=620, help="steps per run (default 620)")
    p.add_argument("--block", type=int, default=60,
                   help="steps per on or off block (default 60: ~2 s of the tiny model, the shipper's batching interval)")
    p.add_argument("--warmup", type=int, default=20, help="first steps of each run left out (default 20)")
    p.add_argument("--model", default="tiny", help="reference trainer model preset (default tiny)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--micro-blocks", type=int, default=40, help="microbenchmark blocks (default 40)")
    p.add_argument("--keep", default=None, help="keep the collector's file and the run logs in this folder")


class _Collector:
    def __init__(self, folder: Path) -> None:
        self.db = folder / "bench.duckdb"
        self.proc = subprocess.Popen(
            # --flush-interval-s 0.02: the collector acks within ~20 ms, so the end-of-block flush (whose
            # CPU is charged to the "on" block) does not sit 0.5 s waiting while idle threads tick.
            [sys.executable, "-m", "collector", "--db", str(self.db), "--listen", "127.0.0.1:0", "--flush-interval-s", "0.02"],
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


def _run_trainer(args: argparse.Namespace, folder: Path, name: str, endpoint: str) -> dict[str, Any]:
    """One run with the hooks switched every --block steps; the child's per-step log."""
    out = folder / f"{name}.json"
    argv = [sys.executable, "-m", "trainer_hooks._bench_child", str(out), str(args.block), "--quiet",
            "--steps", str(args.steps), "--model", args.model, "--micro-batches", str(args.micro_batches)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TRACETOP_ENDPOINT=endpoint,
               TRACETOP_RUN_ID=f"bench-{name}")
    env.pop("TRACETOP_DISABLE", None)
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench hooks: run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def block_ratios(log: dict[str, Any], warmup: int) -> tuple[list[float], list[float]]:
    """(CPU ratios, wall ratios) of adjacent on/off blocks of one run (pure).

    Per block: the mean per step over its steps (the switching step, the one after it and the
    first ``warmup`` steps left out); "on" blocks also carry the CPU time of shipping their rows at
    the block's end, spread over their steps (in the wall figure too: as if the training thread
    had waited for it). Blocks 2p and 2p+1 form a pair (one on, one off)."""
    block = int(log["block"])
    ship = {int(b): cpu for b, cpu in log["ship_cpu_s"]}
    switches = set(log["switch_steps"])
    per_block: dict[int, tuple[bool, list[float], list[float]]] = {}
    for n, (wall, cpu, on) in enumerate(zip(log["wall_s"], log["cpu_s"], log["on"])):
        if n < warmup or n in switches or n - 1 in switches:
            continue
        entry = per_block.setdefault(n // block, (bool(on), [], []))
        entry[1].append(cpu)
        entry[2].append(wall)
    cpu_ratios, wall_ratios = [], []
    for b in sorted(per_block):
        if b % 2 or b + 1 not in per_block:
            continue
        (on_a, cpu_a, wall_a), (on_b, cpu_b, wall_b) = per_block[b], per_block[b + 1]
        if on_a == on_b or not cpu_a or not cpu_b:
            continue
        (b_on, cpu_on, wall_on), (cpu_off, wall_off) = ((b, cpu_a, wall_a), (cpu_b, wall_b)) if on_a else ((b + 1, cpu_b, wall_b), (cpu_a, wall_a))
        ship_per_step = ship.get(b_on, 0.0) / max(1, block - 2)
        cpu_ratios.append((sum(cpu_on) / len(cpu_on) + ship_per_step) / (sum(cpu_off) / len(cpu_off)))
        wall_ratios.append((sum(wall_on) / len(wall_on) + ship_per_step) / (sum(wall_off) / len(wall_off)))
    return cpu_ratios, wall_ratios


def _microbench(args: argparse.Namespace, endpoint: str) -> dict[str, float]:
    """Training-thread CPU time per recorded event of the exact hot paths (see the module doc)."""
    import torch

    from trainer_hooks import collectives as colls
    from trainer_hooks import pipeline as pipeline_mod
    from trainer_hooks.tracer import Tracer

    tensor = torch.ones(256)
    tracer = Tracer(endpoint=endpoint, run_id="bench-micro", rank=0, world_size=1, wrap_collectives=False,
                    heartbeat_s=5.0, device="cpu")
    tracer.set_topology({"dp": [(0,)]})

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None  # the collective itself costs the same with and without hooks: left out

    # the wrapper install() puts in place of torch.distributed.all_reduce, around the stand-in
    wrapped_all_reduce = colls._make_wrapper(colls._Spec("all_reduce", all_reduce), all_reduce)
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
        colls._installed.sink = tracer if on else None
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
        colls._installed.sink = None
        tracer.close()
    return {"ns_per_event": statistics.median(per_event), "ns_per_event_p90": sorted(per_event)[int(0.9 * (len(per_event) - 1))],
            "ns_per_event_wall": statistics.median(per_event_wall)}


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.steps < args.warmup + 4 * args.block or args.block < 3:
        print(f"bench hooks: --steps {args.steps} must leave at least 4 blocks of --block {args.block} (>= 3) "
              f"after --warmup {args.warmup}", file=sys.stderr)
        return 2
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tracetop-bench-hooks-"))
    folder.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    collector = _Collector(folder)
    try:
        cpu_ratios: list[float] = []
        wall_ratios: list[float] = []
        for i in range(args.runs):
            log = _run_trainer(args, folder, f"ab{i}", collector.addr)
            c, w = block_ratios(log, args.warmup)
            cpu_ratios += c
            wall_ratios += w
            if not args.json:
                print(f"  run {i}: {len(c)} block pairs, median on/off CPU per step {statistics.median(c):.4f}, "
                      f"wall {statistics.median(w):.4f}", flush=True)
        if not cpu_ratios:
            raise RuntimeError("bench hooks: no on/off block pairs; raise --steps or lower --block/--warmup")
        micro = _microbench(args, collector.addr)
    finally:
        collector.stop()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    result = {
        "overhead_pct": round((statistics.median(cpu_ratios) - 1) * 100, 3),
        "overhead_wall_pct": round((statistics.median(wall_ratios) - 1) * 100, 3),
        "ns_per_event": round(micro["ns_per_event"], 1),
        "ns_per_event_p90": round(micro["ns_per_event_p90"], 1),
        "ns_per_event_wall": round(micro["ns_per_event_wall"], 1),
        "block_pairs": len(cpu_ratios),
        "runs": args.runs,
        "steps_per_run": args.steps,
        "block_steps": args.block,
        "model": args.model,
        "device": "cpu",
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"hooks overhead {result['overhead_pct']:+.2f}% of step CPU time ({result['overhead_wall_pct']:+.2f}% of "
              f"wall step time; median of {result['block_pairs']} on/off block pairs; goal <= 1%); "
              f"{result['ns_per_event']:.0f} ns per recorded event on the training thread (goal <= 2000 ns); "
              f"{result['wall_s']:.0f} s")
    return 0
