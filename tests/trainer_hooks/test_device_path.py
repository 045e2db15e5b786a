"""The GPU accounting path (CUDA events resolved by the emitter), on CPU with a fake event clock.

The double stands at the hardware edge: the shipped HostClock (CudaClock's own code over host
events). Events become "complete" only when the test says so, like a GPU still busy,
and the fake notes which thread asked about them: never the training thread."""

from __future__ import annotations

import time

from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport
from trainer_hooks import Tracer
from trainer_hooks.device_clock import HostClock
from trainer_hooks.integrations import collectives as colls
from trainer_hooks.integrations import pipeline


def FakeDeviceClock() -> HostClock:  # noqa: N802  (named as the clock type it stands for)
    """Nothing done on the "device" until the test moves ``complete_before_ns``; memory (100, 200, 300)."""
    return HostClock(complete_before_ns=0, memory=(100, 200, 300))


def test_device_timings_are_resolved_by_the_emitter_in_order() -> None:
    import torch.distributed  # noqa: F401  (naming the first group imports it: not inside the timed step)

    clock = FakeDeviceClock()
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="gpu", transport=mem, wrap_collectives=False, device_clock=clock,
                    drain_interval_s=0.05)

    def all_reduce(tensor, op=None, group=None, async_op=False):
        time.sleep(0.01)

    wrapped = colls.wrap_function("all_reduce", all_reduce)

    class Engine:
        pass

    def forward(self, buffer_id=0):
        time.sleep(0.02)
        wrapped(FakeTensor())  # a TP all-reduce inside the forward: communication, not compute

    class FakeTensor:
        nbytes = 4096
        dtype = "float32"

    Engine._INSTRUCTION_MAP = {type("ForwardPass", (), {}): forward}
    engine = Engine()
    pipeline.wrap(engine, tracer)
    handler = next(iter(engine._INSTRUCTION_MAP.values()))
    colls.route_to(tracer.recorder)
    try:
        for n in range(2):
            with tracer.step(n):
                handler(engine)
                with tracer.phase("optimizer"):
                    time.sleep(0.005)
        time.sleep(0.3)  # the emitter runs; the "device" has not finished anything yet
        tracer.emitter.drain()
        tracer.shipper.flush(5.0)
        assert len(mem.rows(Kind.STEP)["step"]) == 0 and len(mem.rows(Kind.COLLECTIVE)["step"]) == 0
        assert tracer.recorder.deferred  # waiting on the device
        clock.complete_before_ns = time.perf_counter_ns()
        time.sleep(0.3)
    finally:
        colls.route_to(None)
        tracer.close()
    steps = mem.rows(Kind.STEP)
    assert list(steps["step"]) == [0, 1]
    coll = mem.rows(Kind.COLLECTIVE)
    assert list(coll["bytes"]) == [4096, 4096] and all(coll["duration_ns"] >= 10_000_000)
    # forward self time excludes the all-reduce inside it; the step's comm is that all-reduce
    assert all(steps["forward_ns"] >= 20_000_000) and all(steps["forward_ns"] < 20_000_000 + coll["duration_ns"])
    assert list(steps["comm_exposed_ns"]) == list(coll["duration_ns"])
    assert all(steps["optimizer_ns"] >= 5_000_000)
    assert list(mem.rows(Kind.PIPE_INSTR)["instr"]) == ["ForwardPass", "ForwardPass"]
    assert list(mem.rows(Kind.MEMORY)["allocated_bytes"]) == [100, 100]
    assert "MainThread" not in clock.asked_from and clock.asked_from
