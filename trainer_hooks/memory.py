"""The step's memory peak: what memory pressure looks like to a controller.

The process-lifetime peak (``ru_maxrss``, ``max_memory_allocated`` without a reset) only ever
grows, so it cannot show a smaller micro-batch helping. This is the peak *within one step*,
reset at every step's end (on the training thread; on CPU ~27 us a step, measured below):

- GPU: ``torch.cuda.max_memory_allocated()`` then ``torch.cuda.reset_peak_memory_stats()``;
  both read and reset the caching allocator's host-side counters (no device synchronization).
- CPU: the kernel's resident-set high-water mark. ``VmHWM`` in ``/proc/self/status`` is the
  largest resident set since the last reset, and writing ``5`` to ``/proc/self/clear_refs``
  resets it to the current resident set (Linux >= 4.0). The kernel raises the mark before it
  unmaps memory, so a step's activations that are allocated and freed inside the step still
  count. It is the whole process's resident memory (Python, the model, the optimizer state and
  the step's transient tensors), which is what an OOM kill looks at. Sampling RSS at the step's
  end instead would miss exactly the transient peak; tracking allocations would miss what torch
  does not allocate.

  Reading it cheaply. ``/proc/self/status`` is a large file to generate: in the reference
  trainer, between steps of tensor work (cold caches), its read cost ~35 us of the training
  thread's CPU a step (~3 us in a tight loop). ``getrusage(RUSAGE_THREAD).ru_maxrss`` reads the
  same mark for ~10 us, but as ``max(S, mark)``, where S is the mark the process's image had
  before its ``execve`` (the kernel folds the old image's, i.e. the launching parent's, mark
  into the new one: ``exec_mmap``). S never changes while the process lives (a thread's exit
  does not touch it, only the whole group's), and every ``ru_maxrss`` reading is >= S. So the
  smallest reading seen so far, ``floor``, bounds S from above, and a reading above ``floor`` is
  the mark itself, exact. Only a reading at or below ``floor`` (this step's peak may be below
  the parent's) falls back to ``VmHWM`` and lowers ``floor``. A trainer whose resident set
  outgrows its launcher's (the common case: torch and the model are loaded after the exec) reads
  ``ru_maxrss`` only; ``status_reads`` counts the fallbacks. With the reset (~6 us), ``take()``
  timed in place in the reference trainer cost 26-28 us a step instead of 50-52 us
  (``reference_trainer/bench/probe_hook_costs.py``, docs/benchmarks.md, "The hooks' cost").

A side effect, on purpose and to know: the kernel keeps one high-water mark per process, so
after the hooks reset it the process's own ``getrusage(RUSAGE_SELF).ru_maxrss`` (and what a
parent's ``wait4`` reports at exit) is the peak since the last step began, not since the process
started. Job accounting that samples ``/proc`` (Slurm's jobacct_gather) is not affected. The
alternatives were worse: RSS sampled by the emitter misses a peak that lasts milliseconds, and
RSS sampled at every phase and pipeline instruction costs ~2 us per event on the hot path against
~27 us per step here.

Where neither is available (no /proc, clear_refs not writable) ``take()`` returns -1 and the
MEMORY rows fall back to the emitter's sample.

How often, on CPU: at the end of a step that ends at least ``CPU_EVERY_S`` (0.1 s) after the last
read, i.e. every step of 0.1 s or longer, every few steps of shorter ones. Such a read is the peak
since the last one: of the steps since then, the largest (the mark is reset only at a read). The
steps in between return ``SKIPPED`` (-2): their MEMORY rows say -1, not measured (the controller
reads only peaks >= 0), never a value of another moment. Why: the two system calls are the
largest single cost the hooks put on a short step's training thread where system calls are slow
(a VM with shadow page tables, a sandbox: 0.5-0.6 us each in a tight loop on the shared test
machine): ``take()`` timed in place in the reference trainer read 20-22 us a step (median, load
1-2), ~0.07% of the tiny model's 30 ms step; a step not read costs a clock read.
A GPU's counters cost no system call: every step there.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

#: getrusage(RUSAGE_THREAD) (Linux): this thread's rusage, the process's memory mark (no walk over threads)
_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
_getrusage = resource.getrusage  # [2] is ru_maxrss (a struct sequence: the index is the cheap read)
#: on CPU, the least time between two reads (see the module docstring)
CPU_EVERY_S = 0.1
#: what ``take()`` returns for a step it did not read (the peak is counted in the next read)
SKIPPED = -2


class StepPeak:
    """``take()``: the peak bytes since the previous ``take()`` (or since construction), and reset."""

    def __init__(self, cuda: Any = None, *, status_path: str = "/proc/self/status",
                 clear_refs_path: str = "/proc/self/clear_refs", every_s: float | None = None,
                 clock_ns: Any = time.monotonic_ns) -> None:
        self._cuda = cuda  # torch.cuda, when the device is a GPU
        #: CPU: the least ns between two reads (0: every take); None = CPU_EVERY_S
        self.every_ns = int((CPU_EVERY_S if every_s is None else every_s) * 1e9)
        #: CPU: ``clock_ns()`` before which ``take()`` reads nothing and says SKIPPED (0 on a GPU, or
        #: where nothing can be read: every call goes through). Public: the step's end tests it
        #: itself, so a step not read costs a clock read and no call (trainer_hooks/tracer.py)
        self.next_ns = 0
        self.clock_ns = clock_ns
        self._status = self._clear = -1
        self.status_reads = 0  # steps whose peak came from VmHWM (ru_maxrss was at or below floor)
        self._floor_kib = -1  # the smallest ru_maxrss seen: >= S, the mark the image started with
        if cuda is None:
            try:
                self._status = os.open(status_path, os.O_RDONLY)
                self._clear = os.open(clear_refs_path, os.O_WRONLY)
                os.write(self._clear, b"5")
                self._hwm()
                self._floor_kib = resource.getrusage(_RUSAGE).ru_maxrss
            except (OSError, ValueError):
                self.close()
        else:
            cuda.reset_peak_memory_stats()

    @property
    def available(self) -> bool:
        return self._cuda is not None or self._clear >= 0

    def _hwm(self) -> int:
        b = os.pread(self._status, 4096, 0)
        i = b.index(b"VmHWM:")
        return int(b[i + 6 : b.index(b"kB", i)]) * 1024

    def take(self) -> int:
        cuda = self._cuda
        if cuda is not None:
            peak = int(cuda.max_memory_allocated())
            cuda.reset_peak_memory_stats()
            return peak
        if self._clear < 0:
            return -1
        now = self.clock_ns()
        if now < self.next_ns:
            return SKIPPED  # counted in the next read (the mark is not reset)
        self.next_ns = now + self.every_ns
        try:
            kib = _getrusage(_RUSAGE)[2]  # ru_maxrss = max(S, the mark): the mark when above floor
            if kib > self._floor_kib:
                peak = kib * 1024
            else:  # S may be what it shows: read the mark itself; this reading bounds S more tightly
                self._floor_kib = kib
                self.status_reads += 1
                peak = self._hwm()
            os.write(self._clear, b"5")
        except (OSError, ValueError):  # the step's row still goes out, its peak unknown
            return -1
        return peak

    def close(self) -> None:
        for fd in (self._status, self._clear):
            if fd >= 0:
                os.close(fd)
        self._status = self._clear = -1
