"""A fake CUDA event at the hardware edge, following ``torch.cuda.Event``'s API, for the hooks'
GPU path on a machine without a GPU.

``record()`` notes the host clock: on CPU the work "on the stream" at that moment is what the
host has done so far (a DDP bucket's gradients when the hook is called; the all-reduce's end in a
gloo future's callback). The event is done on the "device" ``lag_ns`` after it was recorded (a
GPU running behind the host), or never while ``held`` is set: ``query()`` is False until then,
and ``elapsed_time`` raises on an event not done, as CUDA does (cudaErrorNotReady).
``synchronize()`` and ``wait()`` are device syncs: they are counted, and the tests require none.
Every call is noted with the name of the thread that made it.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from trainer_hooks.tracer import _CudaClock


class FakeCudaEvent:
    lag_ns = 20_000_000
    held = False  # True: nothing recorded completes (the device is busy) until it is lifted
    calls: collections.Counter = collections.Counter()  # (method, thread name) -> count
    syncs: list[str] = []

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        if not enable_timing:
            raise RuntimeError("FakeCudaEvent: elapsed_time needs enable_timing=True")
        self.t_ns: int | None = None

    def _note(self, method: str) -> None:
        FakeCudaEvent.calls[(method, threading.current_thread().name)] += 1

    def record(self, stream: Any = None) -> None:
        self._note("record")
        self.t_ns = time.perf_counter_ns()

    def query(self) -> bool:
        self._note("query")
        if self.t_ns is None:  # CUDA: an event never recorded counts as done
            return True
        return not FakeCudaEvent.held and time.perf_counter_ns() >= self.t_ns + FakeCudaEvent.lag_ns

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        self._note("elapsed_time")
        if self.t_ns is None or end.t_ns is None:
            raise RuntimeError("FakeCudaEvent: elapsed_time on an event never recorded")
        if not (self.query() and end.query()):
            raise RuntimeError("FakeCudaEvent: elapsed_time before both events completed (cudaErrorNotReady)")
        return (end.t_ns - self.t_ns) / 1e6

    def synchronize(self) -> None:
        FakeCudaEvent.syncs.append(threading.current_thread().name)

    def wait(self, stream: Any = None) -> None:
        FakeCudaEvent.syncs.append(threading.current_thread().name)


class FakeCudaClock(_CudaClock):
    """The Tracer's own CUDA clock (pool, record, query, elapsed_time) over FakeCudaEvent; memory
    is not the subject here."""

    def __init__(self) -> None:
        super().__init__(event=FakeCudaEvent)

    def memory(self) -> tuple[int, int, int]:
        return -1, -1, -1


def threads_that(method: str) -> set[str]:
    return {thread for (m, thread), n in FakeCudaEvent.calls.items() if m == method and n}
