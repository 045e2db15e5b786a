"""The hot path's shortcuts give the rows the general path gives: a collective called with
keywords (DeepSpeed's comm backend) against the same call positional, the cache renamed with the
groups, and the flat row buffers drained into the same columns."""

from __future__ import annotations

import pytest

from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport
from trainer_hooks import Tracer
from trainer_hooks.integrations import collectives as colls

torch = pytest.importorskip("torch")


def _all_reduce(tensor, op=None, group=None, async_op=False):
    return None


def test_keyword_and_positional_collective_calls_give_the_same_rows() -> None:
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="forms", transport=mem, wrap_collectives=False, heartbeat_s=60)
    tracer.set_topology({"dp": [(0,)]})
    timed = colls.wrap_function("all_reduce", _all_reduce)
    colls.route_to(tracer.recorder)
    try:
        with tracer.step(0):
            timed(torch.ones(8))
            timed(tensor=torch.ones(8), op=None, group=None, async_op=False)
            timed(torch.ones(4, dtype=torch.float16), group=None)
            timed(tensor=torch.ones(4, dtype=torch.float16))
        tracer.set_topology({"tp": [(0,)]})  # renamed: the keyword cache is forgotten with the rest
        with tracer.step(1):
            timed(tensor=torch.ones(2, dtype=torch.int64), async_op=False)
            timed(torch.ones(2, dtype=torch.int64))
    finally:
        colls.route_to(None)
        tracer.close()
    rows = mem.rows(Kind.COLLECTIVE)
    got = [(int(s), int(b), d, r) for s, b, d, r in zip(rows["step"], rows["bytes"], rows["dtype"], rows["role"])]
    assert got == [(0, 32, "float32", "dp"), (0, 32, "float32", "dp"), (0, 8, "float16", "dp"), (0, 8, "float16", "dp"),
                   (1, 16, "int64", "tp"), (1, 16, "int64", "tp")]
    assert list(rows["is_async"]) == [0] * 6 and list(rows["op"]) == ["all_reduce"] * 6
    assert all(rows["duration_ns"] >= 0) and tracer.errors == 0


def test_flat_instruction_rows_drain_row_by_row() -> None:
    from trainer_hooks.integrations import pipeline

    class Engine:
        pass

    def forward(self, buffer_id):
        return None

    def step(self):
        return None

    Engine._INSTRUCTION_MAP = {type("ForwardPass", (), {}): forward, type("OptimizerStep", (), {}): step}
    engine = Engine()
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="flat", transport=mem, wrap_collectives=False, heartbeat_s=60)
    assert pipeline.wrap(engine, tracer)
    fwd, opt = engine._INSTRUCTION_MAP.values()
    for n in range(3):
        with tracer.step(n):
            for b in range(n + 1):
                fwd(engine, buffer_id=b)
            opt(engine)
    tracer.close()
    rows = mem.rows(Kind.PIPE_INSTR)
    assert list(rows["step"]) == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert list(rows["instr"]) == ["ForwardPass", "OptimizerStep"] + ["ForwardPass"] * 2 + ["OptimizerStep"] + \
        ["ForwardPass"] * 3 + ["OptimizerStep"]
    assert list(rows["micro_batch"]) == [0, -1, 0, 1, -1, 0, 1, 2, -1]
    starts = list(rows["start_ns"])
    assert starts == sorted(starts) and all(rows["duration_ns"] >= 0)


def test_the_row_count_is_every_row_recorded_across_drains() -> None:
    """``Tracer.events`` (the benchmarks' denominator) is read off the buffers and the emitter's
    takes, not counted per event: it must equal the rows that reach the sink, a drain or not."""
    from trainer_hooks.integrations import pipeline

    class Engine:
        pass

    def forward(self, buffer_id):
        return None

    Engine._INSTRUCTION_MAP = {type("ForwardPass", (), {}): forward}
    engine = Engine()
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="count", transport=mem, wrap_collectives=False, heartbeat_s=60,
                    drain_interval_s=3600)
    assert pipeline.wrap(engine, tracer)
    (fwd,) = engine._INSTRUCTION_MAP.values()
    timed = colls.wrap_function("all_reduce", _all_reduce)
    colls.route_to(tracer.recorder)
    seen = []
    try:
        for n in range(4):
            with tracer.step(n):
                for b in range(n + 1):  # 1 + 2 + 3 + 4 instructions
                    fwd(engine, buffer_id=b)
                timed(torch.ones(8))  # 4 collectives
            tracer.record_offload("d2h", "grads", 64, 0, 10)  # 4 rows straight to the sink
            if n == 1:
                before = tracer.events
                tracer.emitter.drain()  # type: ignore[union-attr]
                seen.append((before, tracer.events))
        seen.append((tracer.events, tracer.events))
    finally:
        colls.route_to(None)
        tracer.close()
    per_step = [1 + 1 + 3 + 1, 2 + 1 + 3 + 1]  # instructions, the collective, STEP/THROUGHPUT/MEMORY, the offload
    assert seen[0] == (sum(per_step), sum(per_step))  # a drain moves rows, it does not change the count
    total = sum(len(mem.rows(k)["step"]) for k in (Kind.PIPE_INSTR, Kind.COLLECTIVE, Kind.STEP, Kind.THROUGHPUT,
                                                     Kind.MEMORY, Kind.OFFLOAD))
    assert total == 10 + 4 + 12 + 4 == seen[1][0], (total, seen)
