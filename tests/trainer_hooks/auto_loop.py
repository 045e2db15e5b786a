"""A plain DDP loop (gloo, under torchrun) run in segments, one tracetop run each, in one job:

    torchrun --standalone --nproc_per_node 4 tests/trainer_hooks/auto_loop.py --prefix p \
        --segments explicit,auto,auto-data,auto-forward,auto-fsdp --steps 30

``explicit``: ``train_explicit`` (``Tracer``, ``step``, four ``phase`` blocks, ``set_loss``);
``auto``: ``train_auto``, which is ``train_plain`` plus three lines (``import trainer_hooks`` is one
of them: tests/trainer_hooks/test_auto.py counts them); ``auto-data``: rank DATA_RANK's batches
take DATA_MS longer from step FAULT_STEP; ``auto-forward``: rank FWD_RANK's forward FWD_MS longer from
FAULT_STEP; ``auto-fsdp``: the model wrapped in FSDP (``FullyShardedDataParallel``, CPU) instead.
Each segment builds its model (seed 0), optimizer and DataLoader afresh (rank-seeded data), so
every segment computes the same losses. Run ids: ``PREFIX-SEGMENT``.

The step's compute is a sleep of --step-ms inside the model's forward (``Pause``); the data wait
a sleep of --data-ms inside the dataset's ``__getitem__`` (one batch per index, num_workers=0).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import trainer_hooks

DATA_RANK, FWD_RANK, FAULT_STEP = 2, 1, 8
DATA_MS, FWD_MS = 150.0, 300.0


class Pause(torch.nn.Module):
    """Sleeps ``ms`` (+ the straggler's extra from ``from_step``) in each training forward."""

    def __init__(self, ms: float, extra_ms: float = 0.0, from_step: int = 0) -> None:
        super().__init__()
        self.ms, self.extra_ms, self.from_step, self.calls = ms, extra_ms, from_step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            extra = self.extra_ms if self.calls >= self.from_step else 0.0
            self.calls += 1
            time.sleep((self.ms + extra) / 1e3)
        return x


class Batches(torch.utils.data.Dataset):
    """Batch ``i`` (64 x 64, seeded by rank and i) after ``ms`` (+ ``extra_ms`` from ``from_step``)."""

    def __init__(self, n: int, rank: int, ms: float, extra_ms: float = 0.0, from_step: int = 0) -> None:
        self.n, self.rank, self.ms, self.extra_ms, self.from_step = n, rank, ms, extra_ms, from_step

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep((self.ms + (self.extra_ms if i >= self.from_step else 0.0)) / 1e3)
        return torch.randn(64, 64, generator=torch.Generator().manual_seed(1000 * self.rank + i))


def train_plain(model, opt, loader):
    for x in loader:
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def train_auto(model, opt, loader, run_id):
    tracer = trainer_hooks.auto(model, opt, run_id=run_id)
    for x in loader:
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    tracer.close()


def train_explicit(model, opt, loader, run_id):
    tracer = trainer_hooks.Tracer(run_id=run_id)
    it = iter(loader)
    for step in range(len(loader)):
        with tracer.step(step):
            with tracer.phase("data"):
                x = next(it)
            with tracer.phase("forward"):
                out = model(x)
                loss = out.pow(2).mean()
                tracer.set_loss(loss.item())
            with tracer.phase("backward"):
                loss.backward()
            with tracer.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    tracer.close()


def build(segment: str, rank: int, a: argparse.Namespace):
    torch.manual_seed(0)
    extra_fwd = FWD_MS if segment == "auto-forward" and rank == FWD_RANK else 0.0
    extra_data = DATA_MS if segment == "auto-data" and rank == DATA_RANK else 0.0
    net = torch.nn.Sequential(Pause(a.step_ms, extra_fwd, FAULT_STEP), torch.nn.Linear(64, 128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 64))
    if segment == "auto-fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(net, device_id=torch.device("cpu"))
    else:
        model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Batches(a.steps, rank, a.data_ms, extra_data, FAULT_STEP)
    return model, opt, torch.utils.data.DataLoader(data, batch_size=None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--segments", default="explicit,auto")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--step-ms", type=float, default=30.0)
    ap.add_argument("--data-ms", type=float, default=10.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for segment in a.segments.split(","):
        model, opt, loader = build(segment, rank, a)
        dist.barrier()
        run_id = f"{a.prefix}-{segment}"
        if segment == "explicit":
            train_explicit(model, opt, loader, run_id)
        elif segment == "plain":
            train_plain(model, opt, loader)
        else:
            train_auto(model, opt, loader, run_id)
        print(f"[auto_loop] rank {rank} segment {segment} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
