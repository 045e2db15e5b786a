"""The step's memory peak (trainer_hooks/memory.py): it falls when the step's transient memory
falls, unlike the process-lifetime peak. Ground truth: tensors of known size, touched and freed
inside the step."""

from __future__ import annotations

import torch

from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport
from trainer_hooks import Tracer
from trainer_hooks.memory import StepPeak

MIB = 2**20


def test_step_peak_counts_what_the_step_freed_and_resets():
    p = StepPeak()
    assert p.available
    p.take()
    x = torch.ones(200 * MIB // 4)  # 200 MiB touched...
    del x  # ...and freed inside the "step"
    big = p.take()
    small = p.take()  # a step that allocated nothing
    assert big - small > 180 * MIB, (big, small)


def test_memory_rows_carry_each_steps_peak_and_the_budget():
    mem = MemoryTransport()
    t = Tracer(transport=mem, run_id="mem-1", rank=0, world_size=1, wrap_collectives=False, memory_budget_bytes=3 * 2**30)
    sizes_mib = [160, 40, 160, 40, 0]
    for i, mib in enumerate(sizes_mib):
        with t.step(i):
            x = torch.ones(max(1, mib * MIB // 4))
            del x
    t.close()
    rows = mem.rows(Kind.MEMORY)
    peaks = dict(zip(rows["step"].tolist(), rows["peak_bytes"].tolist()))
    assert set(rows["budget_bytes"].tolist()) == {3 * 2**30}
    assert peaks[0] - peaks[1] > 100 * MIB and peaks[2] - peaks[3] > 100 * MIB, peaks
    assert peaks[1] - peaks[4] < 60 * MIB + 10 * MIB
