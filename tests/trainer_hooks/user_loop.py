"""A plain user DDP loop, written the way users write one: a Tracer, ``step``/``phase`` around each
step, ``tracer.close()`` after the last step, and no signal handling of its own (torchrun's SIGTERM
ends it with the default action). Launched by torchrun in tests/trainer_hooks/test_shutdown.py.

    torchrun --standalone --nproc_per_node 4 tests/trainer_hooks/user_loop.py --steps 60 --kill 3@40 --log-dir D

``--kill R@S``: rank R SIGKILLs itself in its forward of step S. ``--log-dir``: each rank appends
every step it completed to ``rank{R}.log`` (flushed at once): the ground truth. ``--sleep-ms``:
added to each forward (steps long enough that the kill lands mid-run).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill", default="", help="RANK@STEP")
    ap.add_argument("--log-dir", type=Path, required=True)
    ap.add_argument("--sleep-ms", type=float, default=20.0)
    a = ap.parse_args()
    import torch.distributed as dist

    import trainer_hooks

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kill_rank, kill_step = (int(x) for x in a.kill.split("@")) if a.kill else (-1, -1)
    tracer = trainer_hooks.Tracer()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                                                          torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a.log_dir.mkdir(parents=True, exist_ok=True)
    log = open(a.log_dir / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115
    for step in range(a.steps):
        with tracer.step(step):
            with tracer.phase("forward"):
                if rank == kill_rank and step == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(a.sleep_ms / 1000)
                loss = model(torch.randn(4, 32)).square().mean()
            with tracer.phase("backward"):
                loss.backward()
            with tracer.phase("optimizer"):
                opt.step()
                opt.zero_grad()
        log.write(f"{step}\n")
    tracer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
