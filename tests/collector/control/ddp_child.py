"""A plain PyTorch DDP trainer (gloo, CPU) that takes commands through ``tracer.on_command``.

Each rank appends to $OUT/rankN.jsonl one line per step (step, micro_batch, micro_batches) and one
per handler call (``call``: the value, at which step). Rank 2 refuses micro_batch=1 (raises).

The run ends after argv[1] steps, or before the step written in $OUT/stop_at once the test has seen
what it waits for: every rank reads it before each step, and the test names a step far enough
ahead of every rank's logged progress (the ranks run in lockstep) that all of them stop there."""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_hooks import Tracer


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    steps = int(sys.argv[1])
    out = open(os.path.join(os.environ["OUT"], f"rank{rank}.jsonl"), "w")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    shape = {"micro_batch": 4, "micro_batches": 2}
    per_rank = 8
    state = {"step": -1}
    tracer = Tracer()
    tracer.describe(micro_batch=4, micro_batches=2, model_name="ddp-mlp")

    def set_micro_batch(n: int) -> None:
        out.write(json.dumps({"call": n, "step": state["step"]}) + "\n")
        if rank == 2 and n == 1:
            raise ValueError("rank 2 will not run micro-batch 1")
        if per_rank % n:
            raise ValueError(f"{n} does not divide {per_rank}")
        shape["micro_batch"], shape["micro_batches"] = n, per_rank // n

    tracer.on_command("micro_batch", set_micro_batch, current=lambda: shape["micro_batch"])
    stop_file = os.path.join(os.environ["OUT"], "stop_at")
    for step in range(steps):
        if os.path.exists(stop_file):
            with open(stop_file) as f:
                if step >= int(f.read()):
                    break
        state["step"] = step
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(per_rank, 16, generator=g), torch.randn(per_rank, 1, generator=g)
        with tracer.step(step):
            mb, n = shape["micro_batch"], shape["micro_batches"]  # read after the boundary: in force this step
            opt.zero_grad()
            for i in range(n):
                xs, ys = x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]
                if i < n - 1:
                    with model.no_sync():
                        torch.nn.functional.mse_loss(model(xs), ys).div(n).backward()
                else:
                    torch.nn.functional.mse_loss(model(xs), ys).div(n).backward()
            opt.step()
            import time

            time.sleep(0.03)
        out.write(json.dumps({"step": step, "micro_batch": mb, "micro_batches": n}) + "\n")
        out.flush()
    tracer.close()
    out.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rc = main()
    gc.freeze()  # skip the interpreter's last collection over torch's objects (~1 CPU-s a rank)
    sys.exit(rc)
