"""``tracetop bench hooks --ddp``: what timing DDP's gradient buckets costs, on its own.

Two ranks on gloo (spawned here), each holding three DDP copies of one model (8 Linear(256, 256),
2.1 MB of fp32 gradients, ``bucket_cap_mb=0.25``: ~8 buckets a step):

* ``plain``: DDP's built-in C++ all-reduce (the Tracer is told it has seen it already);
* ``python``: DDP's own Python ``default_hooks.allreduce_hook``, registered directly, untimed;
* ``timed``: the Tracer's comm hook (``trainer_hooks.integrations.ddp``).

``--ddp-device-clock``: the Tracer runs its GPU path (its own ``CudaClock`` over host events, ``device_clock.HostClock``,
``torch.cuda.Event``'s API on the host clock, every event done at once), so ``timed`` takes the
comm hook's CUDA-event path: two event records and one hand-over per pass on the training side,
the resolution on the emitter's (in the process CPU).

All three run inside ``tracer.step`` / ``tracer.phase`` with the same Tracer, so only the hook
differs. Steps go in groups of three blocks, one per arm, in a random order (the same on both
ranks, which must run the same model in the same step). Per group, the difference per step of:
wall time, the training thread's CPU (``time.thread_time_ns``) and the process's CPU
(``time.process_time_ns``: includes the completion callbacks on gloo's threads); medians over
groups, from rank 0. ``timed - python`` is what the timing adds; ``python - plain`` is what any
Python comm hook costs against DDP's C++ path (a Python hook must divide the bucket in a pass of
its own: the C++ path divides while it copies the gradients in).
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
from pathlib import Path
from typing import Any


def _worker(rank: int, port: int, steps: int, block: int, out: str, device_clock: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tracetop.events import Kind
    from tracetop.wire.shipper import MemoryTransport
    from trainer_hooks import Tracer
    from trainer_hooks.integrations import ddp as tddp

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    arms = {"plain": DDP(model(), bucket_cap_mb=0.25), "python": DDP(model(), bucket_cap_mb=0.25),
            "timed": DDP(model(), bucket_cap_mb=0.25)}
    mem = MemoryTransport()
    clock = None
    if device_clock:
        from trainer_hooks.device_clock import HostClock

        clock = HostClock()
    tracer = Tracer(rank=rank, world_size=2, run_id="bench-ddp", transport=mem, heartbeat_s=60, device_clock=clock)
    # the bench's reach inside: keep "plain" on DDP's built-in path and "python" on its own hook
    tddp.leave_untimed(arms["plain"])
    tddp.leave_untimed(arms["python"])
    tddp.register_untimed_hook(arms["python"], None, default_hooks.allreduce_hook)
    tddp.watch(arms["timed"], tracer)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(rank))
    rng = random.Random(1234)  # the same order on both ranks
    order: list[str] = []
    while len(order) < steps:
        names = list(ARMS)
        rng.shuffle(names)
        for name in names:
            order += [name] * block
    samples: list[tuple[str, int, int, int]] = []
    for n, name in enumerate(order[:steps]):
        m = arms[name]
        w0, c0, p0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
        with tracer.step(n):
            with tracer.phase("forward"):
                loss = m(x).square().mean()
            with tracer.phase("backward"):
                loss.backward()
        samples.append((name, time.perf_counter_ns() - w0, time.thread_time_ns() - c0, time.process_time_ns() - p0))
        m.zero_grad(set_to_none=False)
    tracer.close()
    rows = mem.rows(Kind.COLLECTIVE)
    ops = list(rows.get("op", []))
    buckets = sum(1 for o in ops if o == "all_reduce_ddp")
    timed_steps = sum(1 for name in order[:steps] if name == "timed")
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"samples": samples, "block": block, "buckets": buckets,
                                         "timed_steps": timed_steps, "errors": tracer.errors}))
    del arms
    dist.destroy_process_group()


ARMS = ("plain", "python", "timed")
PAIRS = (("timed", "python"), ("python", "plain"), ("timed", "plain"))


def summarize(samples: list[tuple[str, int, int, int]], block: int, warmup: int) -> dict[str, float]:
    """Medians over groups (one block per arm) of the per-step differences, in µs, of wall time,
    training-thread CPU and process CPU, for each pair of arms; and the plain arm's own."""
    g = len(ARMS) * block
    usable = samples[warmup + (-warmup) % g:]  # whole groups only
    groups = [usable[i:i + g] for i in range(0, len(usable) - g + 1, g)]
    out: dict[str, float] = {"groups": float(len(groups))}
    for k, metric in ((1, "wall"), (2, "thread_cpu"), (3, "process_cpu")):
        per = [{a: statistics.mean(s[k] for s in grp if s[0] == a) for a in ARMS} for grp in groups]
        out[f"plain_{metric}_us"] = statistics.median(p["plain"] for p in per) / 1e3
        for a, b in PAIRS:
            out[f"{a}_minus_{b}_{metric}_us"] = statistics.median(p[a] - p[b] for p in per) / 1e3
    return out


def run(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    steps, block = args.ddp_steps, 2
    if steps < 60 + 6 * len(ARMS) * block:
        print(f"bench hooks --ddp: --ddp-steps {steps} leaves too few groups; use at least {60 + 6 * len(ARMS) * block}",
              file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tracetop-bench-ddp-") as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        out = str(Path(tmp) / "rank0.json")
        device_clock = bool(getattr(args, "ddp_device_clock", False))
        mp.start_processes(_worker, args=(port, steps, block, out, device_clock), nprocs=2, start_method="spawn", join=True)
        got: dict[str, Any] = json.loads(Path(out).read_text())
    res = summarize([tuple(x) for x in got["samples"]], block, warmup=42)  # type: ignore[misc]
    buckets = got["buckets"] / max(1, got["timed_steps"])
    result: dict[str, Any] = {k: round(v, 2) for k, v in res.items()}
    result.update({
        "buckets_per_step": round(buckets, 2),
        "timing_process_cpu_us_per_bucket": round(res["timed_minus_python_process_cpu_us"] / buckets, 2) if buckets else None,
        "timing_wall_pct": round(100 * res["timed_minus_python_wall_us"] / res["plain_wall_us"], 2),
        "timing_process_cpu_pct": round(100 * res["timed_minus_python_process_cpu_us"] / res["plain_process_cpu_us"], 2),
        "python_hook_process_cpu_pct": round(100 * res["python_minus_plain_process_cpu_us"] / res["plain_process_cpu_us"], 2),
        "hook_errors": got["errors"], "steps": steps, "wall_s": round(time.monotonic() - t0, 1),
        "clock": "device path (CUDA-event code over host events)" if device_clock else "cpu",
    })
    if args.json:
        print(json.dumps(result))
    else:
        r = result
        print(f"timed hook vs DDP's C++ path (timed - plain), per step of {r['buckets_per_step']:.0f} buckets: "
              f"{r['timed_minus_plain_wall_us']:+.1f} us wall, {r['timed_minus_plain_thread_cpu_us']:+.1f} us training-thread "
              f"CPU, {r['timed_minus_plain_process_cpu_us']:+.1f} us process CPU")
        print(f"DDP bucket timing (timed - python hook), per step of {r['buckets_per_step']:.0f} buckets: "
              f"{r['timed_minus_python_wall_us']:+.1f} us wall ({r['timing_wall_pct']:+.2f}% of a plain step), "
              f"{r['timed_minus_python_thread_cpu_us']:+.1f} us training-thread CPU, "
              f"{r['timed_minus_python_process_cpu_us']:+.1f} us process CPU ({r['timing_process_cpu_pct']:+.2f}%)")
        print(f"any Python comm hook vs DDP's C++ path (python - plain): {r['python_minus_plain_wall_us']:+.1f} us wall, "
              f"{r['python_minus_plain_process_cpu_us']:+.1f} us process CPU ({r['python_hook_process_cpu_pct']:+.2f}%); "
              f"plain step {r['plain_wall_us']:.0f} us wall, {r['plain_process_cpu_us']:.0f} us process CPU; "
              f"median of {r['groups']:.0f} groups, {r['wall_s']:.0f} s")
    return 0
