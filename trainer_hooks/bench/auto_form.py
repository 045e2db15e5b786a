"""``tracetop bench hooks --form auto``: what the automatic form costs a step, against the explicit API.

One process, one plain loop (a DataLoader over in-memory tensors, two Linear(256, 256), SGD), three
arms in blocks of ``--block`` steps, each group of three blocks in a random order:

* ``plain``: no tracing (the automatic form's hooks present and switched off: ``Auto.enabled = False``,
  so the class-level DataLoader/backward patches pass through: that pass-through is in every arm);
* ``explicit``: ``tracer.step`` and four ``tracer.phase`` blocks, ``set_loss(loss.item())``;
* ``auto``: ``trainer_hooks.auto(model, optimizer)``'s hooks switched on.

Both tracers ship to an in-memory transport (no collector: only the training thread's side is
measured). Per group: the training thread's CPU time per step (``time.thread_time_ns``) and wall
time per step, each arm minus ``plain``; medians over groups.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any


def measure(steps: int, block: int, seed: int = 0) -> dict[str, float]:
    import torch

    from tracetop.wire.shipper import MemoryTransport
    from trainer_hooks import Tracer
    from trainer_hooks.auto import Auto

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 256))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=False)
    kw: dict[str, Any] = {"rank": 0, "world_size": 1, "heartbeat_s": 60, "wrap_collectives": False}
    explicit = Tracer(run_id="bench-explicit", transport=MemoryTransport(), **kw)
    auto = Auto(model, opt, tracer=Tracer(run_id="bench-auto", transport=MemoryTransport(), **kw))
    auto.enabled = False
    it = iter(loader)

    def batch() -> Any:
        nonlocal it
        try:
            return next(it)[0]
        except StopIteration:
            it = iter(loader)
            return next(it)[0]

    def plain_step(_n: int) -> None:
        x = batch()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    def explicit_step(n: int) -> None:
        with explicit.step(n):
            with explicit.phase("data"):
                x = batch()
            with explicit.phase("forward"):
                loss = model(x).pow(2).mean()
                explicit.set_loss(loss.item())
            with explicit.phase("backward"):
                loss.backward()
            with explicit.phase("optimizer"):
                opt.step()
                opt.zero_grad()

    arms = {"plain": plain_step, "explicit": explicit_step, "auto": plain_step}
    rng = random.Random(seed)
    per: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
    n = 0
    for _ in range(max(1, steps // (3 * block))):
        order = list(arms)
        rng.shuffle(order)
        for arm in order:
            auto.enabled = arm == "auto"
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(block):
                arms[arm](n)
                n += 1
            per[arm].append(((time.thread_time_ns() - c0) / block, (time.perf_counter_ns() - w0) / block))
    auto.enabled = True
    auto.close()
    explicit.close()
    plain_cpu = [c for c, _ in per["plain"]]
    out: dict[str, float] = {"groups": float(len(plain_cpu)), "block_steps": float(block),
                             "plain_cpu_us_per_step": statistics.median(plain_cpu) / 1e3}
    for arm in ("explicit", "auto"):
        d_cpu = [a[0] - p[0] for a, p in zip(per[arm], per["plain"])]
        d_wall = [a[1] - p[1] for a, p in zip(per[arm], per["plain"])]
        out[f"{arm}_cpu_us_per_step"] = statistics.median(d_cpu) / 1e3
        out[f"{arm}_wall_us_per_step"] = statistics.median(d_wall) / 1e3
        out[f"{arm}_cpu_pct"] = 100.0 * statistics.median(d_cpu) / statistics.median(plain_cpu)
    d = [a[0] - e[0] for a, e in zip(per["auto"], per["explicit"])]
    out["auto_minus_explicit_cpu_us_per_step"] = statistics.median(d) / 1e3
    return out


def run(args: argparse.Namespace) -> int:
    res = measure(getattr(args, "auto_steps", 3000), max(1, getattr(args, "block", 2)))
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>40}: {v:.2f}")
    return 0
