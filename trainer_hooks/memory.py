"""The step's memory peak: what memory pressure looks like to a controller.

The process-lifetime peak (``ru_maxrss``, ``max_memory_allocated`` without a reset) only ever
grows, so it cannot show a smaller micro-batch helping. This is the peak *within one step*,
reset at every step's end (on the training thread, ~3 us a step on CPU, measured):

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

A side effect, on purpose and to know: the kernel keeps one high-water mark per process, so
after the hooks reset it the process's own ``getrusage(RUSAGE_SELF).ru_maxrss`` (and what a
parent's ``wait4`` reports at exit) is the peak since the last step began, not since the process
started. Job accounting that samples ``/proc`` (Slurm's jobacct_gather) is not affected. The
alternatives were worse: RSS sampled by the emitter misses a peak that lasts milliseconds, and
RSS sampled at every phase and pipeline instruction costs ~2 us per event on the hot path against
~3 us per step here.

Where neither is available (no /proc, clear_refs not writable) ``take()`` returns -1 and the
MEMORY rows fall back to the emitter's sample.
"""

from __future__ import annotations

import os
from typing import Any


class StepPeak:
    """``take()``: the peak bytes since the previous ``take()`` (or since construction), and reset."""

    def __init__(self, cuda: Any = None, *, status_path: str = "/proc/self/status",
                 clear_refs_path: str = "/proc/self/clear_refs") -> None:
        self._cuda = cuda  # torch.cuda, when the device is a GPU
        self._status = self._clear = -1
        if cuda is None:
            try:
                self._status = os.open(status_path, os.O_RDONLY)
                self._clear = os.open(clear_refs_path, os.O_WRONLY)
                os.write(self._clear, b"5")
                self._hwm()
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
        peak = self._hwm()
        os.write(self._clear, b"5")
        return peak

    def close(self) -> None:
        for fd in (self._status, self._clear):
            if fd >= 0:
                os.close(fd)
        self._status = self._clear = -1
