"""The step's memory peak (trainer_hooks/memory.py): it falls when the step's transient memory
falls, unlike the process-lifetime peak. Ground truth: tensors of known size, touched and freed
inside the step."""

from __future__ import annotations

import time

import torch

from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport
from trainer_hooks import Tracer, memory
from trainer_hooks.memory import StepPeak

MIB = 2**20


def test_step_peak_counts_what_the_step_freed_and_resets():
    p = StepPeak(every_s=0)
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
    t.step_peak.every_ns = 0  # type: ignore[union-attr]  # every step read (the cadence: the test below)
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


def test_a_step_not_read_is_counted_in_the_next_read_and_its_row_says_not_measured():
    now = [0]
    p = StepPeak(every_s=0.3, clock_ns=lambda: now[0])
    p.take()  # read: the mark reset
    x = torch.ones(200 * MIB // 4)  # a step of 200 MiB touched and freed, ending within 0.3 s: not read
    del x
    now[0] = int(0.2e9)
    assert p.take() == memory.SKIPPED
    now[0] = int(0.31e9)
    window = p.take()  # the next read: the peak since the last read, the skipped step's included
    now[0] = int(0.62e9)
    quiet = p.take()
    assert window - quiet > 180 * MIB, (window, quiet)
    # through the Tracer: steps of ~10 ms, read every 0.3 s; the others' MEMORY rows say -1 (not measured)
    mem = MemoryTransport()
    t = Tracer(transport=mem, run_id="mem-2", rank=0, world_size=1, wrap_collectives=False)
    t.step_peak.every_ns = int(0.3e9)  # type: ignore[union-attr]
    t0 = time.monotonic()
    for i in range(40):
        with t.step(i):
            time.sleep(0.01)
    elapsed_s = time.monotonic() - t0
    t.close()
    peaks = mem.rows(Kind.MEMORY)["peak_bytes"].tolist()
    read = [v for v in peaks if v >= 0]
    assert len(peaks) == 40 and 1 <= len(read) <= elapsed_s / 0.3 + 1 < 40, (elapsed_s, peaks)
    assert set(peaks) - set(read) == {-1}, peaks


# The cheap read (trainer_hooks/memory.py): ru_maxrss is max(S, the mark), S the largest mark of
# the images this process's line ran before its execve (the launcher's, folded in at exec). Both
# paths must give each step's own peak (STEP_MIB touched and freed, or nothing): a forked child
# (no exec: S is 0) reads ru_maxrss; a child whose image touched LAUNCHER_MIB and then exec'd
# itself has S above every step it takes and must fall back to VmHWM.
LAUNCHER_MIB, STEP_MIB = 300, 64
STEPS_MIB = [STEP_MIB, 0, STEP_MIB, 0]
# run in the test's forked child and as the exec'd child's program (which must not import torch:
# its own resident set has to stay below the launcher's mark)
_STEPS = """
import resource
from trainer_hooks.memory import StepPeak
MIB = 2**20


def vmhwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def steps(steps_mib):
    p = StepPeak(every_s=0)
    start = {"ru": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "hwm": vmhwm()}
    peaks, marks = [], []
    for mib in steps_mib:
        x = b"\\x01" * (mib * MIB) if mib else b""
        del x
        marks.append(vmhwm())  # the mark as /proc/self/status shows it, just before take()
        peaks.append(p.take())
    return {"start": start, "peaks": peaks, "marks": marks, "status_reads": p.status_reads}
"""


def test_step_peak_read_cheaply_is_the_kernels_mark():
    import json
    import os

    ns: dict = {}
    exec(_STEPS, ns)
    r, w = os.pipe()
    pid = os.fork()  # no exec: the child's S is 0, so every step above the first reading is read from ru_maxrss
    if pid == 0:
        try:
            os.write(w, json.dumps(ns["steps"](STEPS_MIB)).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = json.loads(f.read())
    os.waitpid(pid, 0)
    peaks, marks = got["peaks"], got["marks"]
    assert got["status_reads"] <= STEPS_MIB.count(0), got  # the STEP_MIB steps took the cheap path
    for p, m in zip(peaks, marks):
        assert abs(p - m) <= MIB, (peaks, marks)  # the same mark VmHWM shows (per-CPU counters: a few pages)
    assert peaks[0] - peaks[1] > (STEP_MIB - 8) * MIB and peaks[2] - peaks[3] > (STEP_MIB - 8) * MIB, peaks


def test_step_peak_below_the_launchers_mark_reads_vmhwm():
    import json
    import os
    import subprocess
    import sys

    stage1 = (f"import os, sys\nx = b'\\x01' * ({LAUNCHER_MIB} * 2**20)\n"
              "os.execv(sys.executable, [sys.executable, '-c', *sys.argv[1:]])")
    stage2 = _STEPS + "\nimport json, sys\nprint(json.dumps(steps([int(a) for a in sys.argv[1:]])))\n"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", stage1, stage2, *map(str, STEPS_MIB)], capture_output=True, text=True,
                         timeout=120, check=True, env=dict(os.environ, PYTHONPATH=root))
    got = json.loads(out.stdout)
    # premise: the image before exec left its mark (ru_maxrss) far above this process's own
    assert got["start"]["ru"] - got["start"]["hwm"] > (LAUNCHER_MIB - STEP_MIB) * MIB, got
    assert got["status_reads"] == len(STEPS_MIB), got
    peaks, marks = got["peaks"], got["marks"]
    assert peaks == marks, got
    assert peaks[0] - peaks[1] > (STEP_MIB - 8) * MIB and peaks[2] - peaks[3] > (STEP_MIB - 8) * MIB, peaks
