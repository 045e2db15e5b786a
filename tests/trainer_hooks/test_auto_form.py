"""The automatic form (trainer_hooks/auto.py) in one process, rows into an in-memory transport:
gradient accumulation (one step row per optimizer step), phases timed where the sleeps are, an eval
loop and another thread left out, the class-level patches restored on close.
The 4-rank run against the explicit API: tests/trainer_hooks/test_auto.py."""

from __future__ import annotations

import threading
import time

import torch

import trainer_hooks
from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport
from trainer_hooks.tracer import Tracer

FWD_MS, DATA_MS, ACCUM = 20.0, 10.0, 3
#: the eval pass's fetch and forward each sleep this long: were either counted in a step, that step
#: would be this much longer than its own fetches (forwards) as the test clocked them
EVAL_MS = 100.0


class Pause(torch.nn.Module):
    """Sleeps FWD_MS in training (EVAL_MS in eval); ``walls``: each training forward's sleep as clocked."""

    def __init__(self) -> None:
        super().__init__()
        self.walls: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        time.sleep((FWD_MS if self.training else EVAL_MS) / 1e3)
        if self.training:
            self.walls.append((time.perf_counter() - t0) * 1e3)
        return x


class Slow(torch.utils.data.Dataset):
    """Each fetch sleeps ``ms``; ``walls``: each fetch's sleep as clocked (ms)."""

    def __init__(self, ms: float = DATA_MS) -> None:
        self.ms = ms
        self.walls: list[float] = []

    def __len__(self) -> int:
        return 4 * ACCUM

    def __getitem__(self, i: int) -> torch.Tensor:
        t0 = time.perf_counter()
        time.sleep(self.ms / 1e3)
        self.walls.append((time.perf_counter() - t0) * 1e3)
        return torch.full((8,), float(i))


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Pause(), torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mem = MemoryTransport()
    tracer = Tracer(run_id="auto-unit", rank=0, world_size=1, transport=mem, heartbeat_s=60, wrap_collectives=False)
    return model, opt, mem, tracer


def test_one_step_per_optimizer_step_phases_where_the_time_went_and_eval_left_out():
    model, opt, mem, tracer = _setup()
    orig_next = torch.utils.data.dataloader._BaseDataLoaderIter.__next__
    orig_backward = torch.Tensor.backward
    data = Slow()
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    losses = []
    auto = trainer_hooks.auto(model, opt, tracer=tracer)
    for i, x in enumerate(loader):
        loss = model(x).pow(2).mean() / ACCUM
        losses.append(loss.item())
        loss.backward()
        if (i + 1) % ACCUM == 0:
            opt.step()
            opt.zero_grad()
            model.eval()  # an eval pass between steps: its fetches and forwards are no step's
            with torch.no_grad():
                for x_eval in torch.utils.data.DataLoader(Slow(EVAL_MS), batch_size=None):
                    model(x_eval)
                    break
            model.train()
    auto.close()
    assert torch.utils.data.dataloader._BaseDataLoaderIter.__next__ is orig_next
    assert torch.Tensor.backward is orig_backward
    rows = mem.rows(Kind.STEP)
    n = len(Slow()) // ACCUM
    assert list(rows["step"]) == list(range(n)) and auto.errors == 0
    ms = {k: rows[k] / 1e6 for k in ("data_wait_ns", "forward_ns", "backward_ns", "optimizer_ns", "duration_ns")}
    pause = model[0]
    assert len(data.walls) == len(pause.walls) == n * ACCUM
    for s in range(n):
        # ACCUM fetches and ACCUM forwards a step, as the test clocked them (a loaded host stretches each
        # sleep: 61 ms for three 10-ms fetches beside a CPU burner); the eval pass's fetch and forward
        # (EVAL_MS each) in none of them
        fetched, forwarded = (sum(w[s * ACCUM:(s + 1) * ACCUM]) for w in (data.walls, pause.walls))
        assert fetched - 0.5 <= ms["data_wait_ns"][s] < fetched + EVAL_MS / 2, (s, fetched, ms)
        assert forwarded - 0.5 <= ms["forward_ns"][s] < forwarded + EVAL_MS / 2, (s, forwarded, ms)
        assert ms["backward_ns"][s] > 0 and ms["optimizer_ns"][s] > 0
        assert ms["duration_ns"][s] >= ms["data_wait_ns"][s] + ms["forward_ns"][s]
    # the loss: the last micro-batch's, as backward() saw it (divided by ACCUM by the loop)
    assert list(rows["loss"]) == [losses[(s + 1) * ACCUM - 1] for s in range(n)]


def test_another_threads_fetches_are_not_the_loops_data_wait():
    model, opt, mem, tracer = _setup()
    auto = trainer_hooks.auto(model, opt, tracer=tracer)
    loader = torch.utils.data.DataLoader(Slow(), batch_size=None)
    # a prefetching thread's fetches are not the training thread's data wait
    fetched = []
    t = threading.Thread(target=lambda: fetched.extend(x for _, x in zip(range(2), loader)))
    t.start()
    t.join()
    for x in fetched:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    auto.close()
    assert auto.errors == 0 and len(fetched) == 2
    rows = mem.rows(Kind.STEP)
    assert len(rows["step"]) == 2 and max(rows["data_wait_ns"]) == 0  # no fetch on this thread
