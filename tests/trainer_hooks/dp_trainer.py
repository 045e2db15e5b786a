"""A plain data-parallel PyTorch trainer for the DDP / FSDP tests, instrumented exactly as
trainer_hooks/README.md shows (``Tracer``, ``step``, ``phase``); launched by torchrun.

    torchrun --standalone --nproc_per_node 4 tests/trainer_hooks/dp_trainer.py --mode ddp --steps 16 --slow 2:80@10

--mode ddp (DistributedDataParallel), fsdp2 (``fully_shard`` on each Linear, then the root) or
fsdp1 (``FullyShardedDataParallel`` with ``device_id=cpu``). ``--slow R:MS@S``: rank R sleeps MS
ms inside its forward phase from step S on. The Tracer ships to TRACETOP_ENDPOINT.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

#: (in, out) of each Linear: every dim divisible by 4 (FSDP pads dim 0 to the world size; none here).
#: "large": 2.1 MB of fp32 parameters, so DDP makes two buckets from step 1 (1 MiB first bucket,
#: then the rest); "small" (132 kB): FSDP's nine blocking collectives a step stay short on a loaded
#: 2-core machine, so an 80 ms straggler stands out of their noise.
LAYERS = {"large": ((256, 512), (512, 512), (512, 256)), "small": ((64, 128), (128, 128), (128, 64))}
BATCH = 8


def build_model(size: str = "large") -> torch.nn.Sequential:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(LAYERS[size]):
        mods.append(torch.nn.Linear(a, b))
        if i < len(LAYERS[size]) - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def unit_bytes(size: str = "large") -> list[int]:
    """fp32 bytes of each Linear's parameters (one FSDP unit each)."""
    return [4 * (a * b + b) for a, b in LAYERS[size]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("ddp", "fsdp2", "fsdp1"), default="ddp")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--slow", default="", help="RANK:MS@STEP")
    ap.add_argument("--size", choices=tuple(LAYERS), default="large")
    a = ap.parse_args()
    import torch.distributed as dist

    import trainer_hooks

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    slow_rank, slow_ms, slow_from = -1, 0.0, 0
    if a.slow:
        r, rest = a.slow.split(":")
        ms, s = rest.split("@")
        slow_rank, slow_ms, slow_from = int(r), float(ms), int(s)
    tracer = trainer_hooks.Tracer(heartbeat_s=1)
    model = build_model(a.size)
    if a.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif a.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        with tracer.step(step):
            with tracer.phase("data"):
                x = torch.randn(BATCH, LAYERS[a.size][0][0], generator=gen)
            with tracer.phase("forward"):
                if rank == slow_rank and step >= slow_from:
                    time.sleep(slow_ms / 1000)
                loss = model(x).square().mean()
            with tracer.phase("backward"):
                loss.backward()
            with tracer.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    tracer.close()
    # a barrier before tearing down: 4-rank gloo runs exiting right after the last collective
    # sometimes abort in C++ (shared/notes/ddp-fsdp-instrumentation.md, "Pitfalls")
    dist.barrier()
    del model, opt
    dist.destroy_process_group()
    if os.environ.get("DP_TRAINER_VERBOSE"):
        print(f"rank {rank}: {tracer.stats()}", flush=True)


if __name__ == "__main__":
    main()
