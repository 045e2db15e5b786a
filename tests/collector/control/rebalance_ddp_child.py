"""A plain PyTorch DDP loop (gloo, CPU) as a user writes one, taking the controller's rebalance
through ``tracer.on_command``: each step every replica trains its share of the same global batch
(generated from the step and the seed), cut into the same number of micro-batches, each
micro-batch's loss weighted by ``Rebalance.micro_weight``.

argv: STEPS. Environment: OUT (rankN.jsonl: one line per step, one per handler call), WORK_MS
(per sample: the compute time a device would spend, slept inside the forward; the test's MLP is
too small to time on a loaded CPU, and a GPU's time scales with the samples the same way),
SLOW=RANK:FACTOR@FROM-TO (that rank's forward takes FACTOR x WORK_MS per sample in [FROM, TO)),
REPLICAS (the step's global batch is that of this many replicas, default the world size: the test's
balanced reference runs the whole global batch of 4 replicas in one process).

The run ends after STEPS steps, or before the step written in $OUT/stop_at once the test has seen
what it waits for: every rank reads it before each step, and the test names a step far enough
ahead of every rank's logged progress (the ranks run in lockstep: an all-reduce every step) that
all of them stop there.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_hooks import Tracer
from trainer_hooks.rebalance import Rebalance

MICRO_BATCH, MICRO_BATCHES = 8, 2


def main() -> int:
    dist.init_process_group("gloo")
    rank, dp = dist.get_rank(), dist.get_world_size()
    steps = int(sys.argv[1])
    work_s = float(os.environ.get("WORK_MS", "0")) / 1000
    slow_rank, factor, slow_from, slow_to = -1, 1.0, 0, 0
    if os.environ.get("SLOW"):
        who, _, rest = os.environ["SLOW"].partition(":")
        f, _, span = rest.partition("@")
        a, _, b = span.partition("-")
        slow_rank, factor, slow_from, slow_to = int(who), float(f), int(a), int(b)
    out = open(os.path.join(os.environ["OUT"], f"rank{rank}.jsonl"), "w")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    global_batch = MICRO_BATCH * MICRO_BATCHES * int(os.environ.get("REPLICAS", dp))
    per_replica = global_batch // dp
    target = torch.linspace(-1, 1, 16).unsqueeze(1)
    split = {"now": Rebalance((per_replica,) * dp)}
    state = {"step": -1}
    tracer = Tracer()
    tracer.describe(micro_batch=MICRO_BATCH, micro_batches=MICRO_BATCHES, model_name="ddp-mlp")

    def rebalance(r: Rebalance) -> None:
        out.write(json.dumps({"call": list(r.samples), "relieved": r.relieved, "step": state["step"]}) + "\n")
        if r.dp != dp or r.global_batch != per_replica * dp or min(r.samples) < MICRO_BATCHES:
            raise ValueError(f"{list(r.samples)} does not fit {dp} replicas of {per_replica} samples")
        split["now"] = r

    tracer.on_command("rebalance", rebalance)  # the undo: the split in force before (the hooks keep it)
    stop_file = os.path.join(os.environ["OUT"], "stop_at")
    for step in range(steps):
        if os.path.exists(stop_file):
            with open(stop_file) as f:
                if step >= int(f.read()):
                    break
        state["step"] = step
        g = torch.Generator().manual_seed(1000 + step)  # the step's global batch: the same for any split
        x = torch.randn(global_batch, 16, generator=g)
        y = x @ target + 0.1 * torch.randn(global_batch, 1, generator=g)  # learnable: the loss falls
        t0 = time.perf_counter()
        with tracer.step(step):
            r = split["now"]  # read after the boundary: in force this step
            lo, sizes = r.offset(rank), r.micro_batch_sizes(rank, MICRO_BATCHES)
            slow = factor if slow_rank == rank and slow_from <= step < slow_to else 1.0
            opt.zero_grad()
            total = torch.zeros(())
            for i, n in enumerate(sizes):
                xs, ys = x[lo: lo + n], y[lo: lo + n]
                lo += n
                with tracer.phase("forward"):
                    time.sleep(work_s * slow * n)
                    loss = torch.nn.functional.mse_loss(model(xs), ys) * r.micro_weight(rank, n, MICRO_BATCHES)
                    loss = loss / MICRO_BATCHES
                with tracer.phase("backward"):
                    if i < MICRO_BATCHES - 1:
                        with model.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                total += loss.detach()
            with tracer.phase("optimizer"):
                opt.step()
            dist.all_reduce(total)  # the step's loss over the global batch: DDP's average, as its gradient
            tracer.set_loss(float(total) / dp)
        out.write(json.dumps({"step": step, "samples": sum(sizes), "loss": float(total) / dp,
                              "wall_s": time.perf_counter() - t0}) + "\n")
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
