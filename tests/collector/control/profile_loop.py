"""A plain DDP loop as a user writes one (gloo, CPU), traced by ``trainer_hooks.auto`` and nothing
else: no ``on_command`` handler, no step blocks. ``tracetop profile`` must reach it all the same.
Each step: a small MLP's forward/backward/step and a fixed 20 ms of "data loading" (a sleep), so
that step times are steady and a profiling window's cost shows against them. Runs argv[1] steps."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks


def main() -> int:
    dist.init_process_group("gloo")
    steps = int(sys.argv[1])
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracer = trainer_hooks.auto(model, opt)
    launcher = os.getppid()
    for step in range(steps):
        if os.getppid() != launcher:
            break  # torchrun is gone (a test killed it): its workers live in sessions of their own
        g = torch.Generator().manual_seed(step * 100 + dist.get_rank())
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g)
        time.sleep(0.02)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    tracer.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
