"""``tracetop bench profile``: what turning the command boundary on by default costs a plain loop
that registered no handler (the profiling window's way in: trainer_hooks/profiling.py).

N processes (default 2) on gloo over loopback, each a plain DDP loop (Linear(256, 256) x 2, SGD,
batch 32) traced by ``trainer_hooks.auto`` and shipping to an in-memory transport. Blocks of
``--block`` steps alternate the boundary on (``TRACETOP_PROFILE=1``: one 64-byte gloo
broadcast every 50 steps with no handler registered, trainer_hooks/profiling.py EVERY_STEPS;
``--every-steps K`` for another K) and off (``commands.profile_alone = False``: no boundary), in quads ordered ABBA
or BAAB by a seeded coin every rank draws alike (so every rank switches at the same step). Per
quad: (on - off) wall time per step, timed around the whole step on the training thread; the
median over quads and over ranks (``us_per_step``: what the step sees, indirect effects
included, noisy at a high load); and the training thread's time inside the boundary itself, timed in
place (``us_per_boundary_inside``, ``us_per_step_inside`` = that / K). Rank 0's poll thread (one unary ``Control.Poll`` every 5 s) is
not in it: nothing to poll here (docs/benchmarks.md gives its figure).

Then what starting a window costs the training thread, each in a fresh interpreter (as a job's
first window is): ``torch.profiler.profile(...).start()`` (the wrapper; its first start imports
``torch._inductor``) against ``torch.autograd.profiler.profile(...).__enter__()`` (the Kineto
profiler it wraps, what trainer_hooks/profiling.py starts), and the latter's stop.

``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--quads", type=int, default=60, help="quads of blocks (default 60)")
    parser.add_argument("--block", type=int, default=50, help="steps per block (default 50: one boundary a block)")
    parser.add_argument("--every-steps", type=int, default=None, metavar="K",
                        help="the boundary every K steps (default: the hooks' own, 50 with no handler)")
    parser.add_argument("--json", action="store_true")


def _child(rank: int, world: int, port: int, quads: int, block: int, every: int | None, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_hooks
    from tracetop.wire.shipper import MemoryTransport

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tracer = trainer_hooks.Tracer(run_id="bench-profile", rank=rank, world_size=world, transport=MemoryTransport(),
                                  heartbeat_s=60)
    bus = tracer.commands
    assert bus is not None and bus.profile_alone, "TRACETOP_PROFILE is not 1 in the ranks' environment"
    bus.subscribe = False  # no collector to poll here
    if every is not None:
        bus.every_steps = bus.profile_every_steps = every
    auto = trainer_hooks.auto(model, opt, tracer=tracer)
    coin = random.Random(7)
    x = torch.randn(32, 256)
    times: dict[str, list[float]] = {"on": [], "off": []}
    diffs: list[float] = []
    step = 0
    warm = (0, 0)
    for q in range(quads + 2):
        order = ("on", "off", "off", "on") if coin.random() < 0.5 else ("off", "on", "on", "off")
        per: dict[str, list[float]] = {"on": [], "off": []}
        for arm in order:
            bus.profile_alone = arm == "on"
            for _ in range(block):
                t0 = time.perf_counter_ns()
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                per[arm].append(time.perf_counter_ns() - t0)
                step += 1
        if q == 1:  # the first boundary made the gloo group: its setup is not a boundary's cost
            warm = (bus.stats["boundaries"], bus.stats["boundary_ns"])
        if q >= 2:  # warm-up quads dropped
            for arm in per:
                times[arm] += per[arm]
            diffs.append(statistics.mean(per["on"]) - statistics.mean(per["off"]))
    stats = dict(bus.stats)
    stats["boundaries"] -= warm[0]
    stats["boundary_ns"] -= warm[1]
    auto.close()
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"diffs": diffs, "on": statistics.median(times["on"]), "off": statistics.median(times["off"]),
                   "boundaries": stats["boundaries"], "boundary_ns": stats["boundary_ns"],
                   "every_steps": bus.profile_every_steps, "errors": tracer.errors}, f)
    dist.barrier()
    dist.destroy_process_group()


_START = {
    "torch_profiler_start_s": "import time, torch\nfrom torch.profiler import profile, ProfilerActivity\n"
                              "p = profile(activities=[ProfilerActivity.CPU])\nt = time.perf_counter(); p.start()\n"
                              "print(time.perf_counter() - t); p.stop()",
    "autograd_profiler_start_s": "import time, torch\nfrom torch.autograd import profiler as ap\n"
                                 "p = ap.profile(use_cpu=True, use_device=None, use_kineto=True)\n"
                                 "t = time.perf_counter(); p.__enter__(); print(time.perf_counter() - t)\n"
                                 "x = torch.randn(64, 64); [x @ x for _ in range(10)]\n"
                                 "t = time.perf_counter(); p.__exit__(None, None, None); print(time.perf_counter() - t)",
}


def start_costs() -> dict[str, float]:
    import subprocess

    out: dict[str, float] = {}
    for key, code in _START.items():
        lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                               check=True).stdout.split()
        out[key] = round(float(lines[0]), 4)
        if len(lines) > 1:
            out["autograd_profiler_stop_s"] = round(float(lines[1]), 4)
    return out


def run(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    os.environ.pop("TRACETOP_COMMAND_EVERY_STEPS", None)  # the default K is what is measured
    os.environ["TRACETOP_PROFILE"] = "1"  # the boundary for profiling alone (off unless said)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_child, args=(args.nproc, port, args.quads, args.block, args.every_steps, out), nprocs=args.nproc, join=True,
                           start_method="spawn")
        per = [json.load(open(os.path.join(out, f"r{r}.json"))) for r in range(args.nproc)]
    diffs = [statistics.median(p["diffs"]) / 1e3 for p in per]
    off = statistics.median(p["off"] for p in per) / 1e3
    spread = [sorted(p["diffs"]) for p in per]
    result = {"nproc": args.nproc, "quads": args.quads, "block_steps": args.block, "every_steps": args.every_steps,
              "step_us_off": round(off, 1), "step_us_on": round(statistics.median(p["on"] for p in per) / 1e3, 1),
              "us_per_step": round(statistics.median(diffs), 2),
              "pct_per_step": round(100 * statistics.median(diffs) / off, 3),
              "quad_diff_iqr_us": [round(statistics.median(s[len(s) // 4] for s in spread) / 1e3, 1),
                                   round(statistics.median(s[3 * len(s) // 4] for s in spread) / 1e3, 1)],
              "boundaries": [p["boundaries"] for p in per], "errors": sum(p["errors"] for p in per),
              # timed in place: the training thread's time inside the boundary, per boundary and per step
              "us_per_boundary_inside": round(statistics.median(p["boundary_ns"] / max(1, p["boundaries"])
                                                                for p in per) / 1e3, 1),
              "us_per_step_inside": round(statistics.median(p["boundary_ns"] / max(1, p["boundaries"])
                                                            / p["every_steps"] for p in per) / 1e3, 2),
              "load_avg_1m": os.getloadavg()[0]}
    result.update(start_costs())
    if args.json:
        print(json.dumps(result))
    else:
        print(f"the default boundary costs {result['us_per_step']} us a step ({result['pct_per_step']}% of a "
              f"{off:.0f} us step; quads' IQR {result['quad_diff_iqr_us']} us), {args.nproc} ranks, "
              f"load {result['load_avg_1m']:.1f}")
        print(f"starting a window (fresh process): torch.profiler.profile.start() {result['torch_profiler_start_s']} s, "
              f"torch.autograd.profiler.profile {result['autograd_profiler_start_s']} s (stop "
              f"{result['autograd_profiler_stop_s']} s)")
    return 0
