"""The step's loss: floats and CPU tensors as given; a device tensor copied asynchronously and read
by the emitter only once the step's end event is done (on CPU with the fake device clock)."""

from __future__ import annotations

import math
import threading
import time

import torch

from tests.trainer_hooks.test_device_path import FakeDeviceClock
from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport
from trainer_hooks import Tracer


class FakeDeviceLoss:
    """Stands for a CUDA tensor: reading it (float/item) would sync the device, so it refuses."""

    is_cuda = True

    def __init__(self, value: float) -> None:
        self.value = value
        self.copies: list[str] = []

    def __float__(self) -> float:
        raise AssertionError("a device loss was read on the training thread")

    item = __float__

    def detach(self) -> FakeDeviceLoss:
        return self

    def reshape(self, *shape) -> FakeDeviceLoss:
        return self

    def __getitem__(self, index) -> FakeDeviceLoss:
        return self

    def to(self, device: str, non_blocking: bool = False) -> torch.Tensor:
        assert device == "cpu" and non_blocking, "the copy must be asynchronous"
        self.copies.append(threading.current_thread().name)
        return torch.tensor([self.value])  # the pending host copy


def _losses(device_clock, values) -> list[float]:
    mem = MemoryTransport()
    t = Tracer(rank=0, world_size=1, run_id="loss", transport=mem, wrap_collectives=False, device_clock=device_clock,
               drain_interval_s=0.05)
    try:
        for n, v in enumerate(values):
            with t.step(n):
                for each in v if isinstance(v, tuple) else (v,):  # a tuple: set_loss called once per item
                    t.set_loss(each)
        if device_clock is not None:
            time.sleep(0.3)
            t.emitter.drain()
            assert len(mem.rows(Kind.STEP)["step"]) == 0  # the device has not reached the step ends
            device_clock.complete_before_ns = time.perf_counter_ns()
            time.sleep(0.3)
    finally:
        t.close()
    assert t.errors == 0
    return list(mem.rows(Kind.STEP)["loss"])


def test_floats_and_cpu_tensors():
    got = _losses(None, [2.5, torch.tensor(1.25), None])
    assert got[:2] == [2.5, 1.25] and math.isnan(got[2])


def test_cpu_tensors_of_any_shape_and_with_a_graph():
    graph = (torch.ones(3, requires_grad=True) * 0.5).sum()  # 1.5, with a grad_fn
    got = _losses(None, [graph, torch.tensor([[0.75, 9.0]]), torch.tensor([], dtype=torch.float64),
                         torch.tensor(4, dtype=torch.int64)])
    assert got[0] == 1.5 and got[1] == 0.75 and math.isnan(got[2]) and got[3] == 4.0


def test_device_loss_read_by_the_emitter_after_the_step_event():
    loss = FakeDeviceLoss(3.75)
    assert _losses(FakeDeviceClock(), [loss, 1.5]) == [3.75, 1.5]
    assert loss.copies == ["MainThread"]  # only the asynchronous copy is queued on the training thread


def test_device_loss_without_a_device_clock_stays_nan():
    loss = FakeDeviceLoss(3.75)
    got = _losses(None, [loss])
    assert math.isnan(got[0]) and loss.copies == []


class CountedLoss:
    """A CPU tensor stand-in that counts its reads (``item()``)."""

    is_cpu = True

    def __init__(self, value: float) -> None:
        self.value = value
        self.reads = 0

    def numel(self) -> int:
        return 1

    def item(self) -> float:
        self.reads += 1
        return self.value


def test_the_last_loss_of_a_step_is_read_once_at_its_end_and_a_replaced_one_never():
    # DeepSpeed's train_batch result, then the trainer's own float: the tensor is never read
    replaced, kept = CountedLoss(9.0), CountedLoss(0.5)
    got = _losses(None, [(replaced, 1.75), (kept,), (CountedLoss(9.0), None)])
    assert got[:2] == [1.75, 0.5] and math.isnan(got[2])
    assert replaced.reads == 0 and kept.reads == 1
