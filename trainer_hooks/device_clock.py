"""The device clock: timing on the GPU with events the training thread records and only the emitter
resolves, and the deferred queue between them.

On GPU (``device="cuda"``) a phase, an instruction, a collective or a step is a pair of CUDA events
recorded on the current stream (:class:`CudaClock`); the training thread appends the pair to the
recorder's ``deferred`` queue with a :class:`DeferredOp` saying what it was, and never calls
``synchronize()``, ``.item()`` or ``elapsed_time()``. The emitter (:func:`resolve_deferred`) takes
entries in recording order once their events are done (``query()``: never a wait) and does the CPU
path's accounting in the same order.

:class:`HostClock` is the test double shipped beside the real clock (STYLE.md habit 5): the same
pool and event code as :class:`CudaClock`, over :class:`HostEvent` (``torch.cuda.Event``'s API on the
host clock), with a :class:`HostDevice` that says when an event is done and notes which thread
asked it anything.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trainer_hooks.recorder import Recorder, StepAccumulator


class DeviceClock(Protocol):
    """What the Tracer needs of a device timer. ``mark()`` runs on the training thread (and on a
    process group's thread, in a completion callback) and must not wait; every other method runs
    on the emitter only."""

    def mark(self) -> Any:
        """Record an event on the current stream and return it."""

    def ready(self, ev: Any) -> bool:
        """The event is done on the device (never a wait)."""

    def elapsed_ns(self, a: Any, b: Any) -> int:
        """Device time between two done events, in ns."""

    def release(self, a: Any, b: Any) -> None:
        """The pair is resolved: its events may be reused."""

    def memory(self) -> tuple[int, int, int]:
        """(allocated, reserved, peak allocated) device bytes."""


class DeferredOp(IntEnum):
    """What one entry ``(op, payload, a, b)`` of the deferred queue is; ``a``/``b`` its events."""

    ENTER = 0  #: a phase or instruction begins: snapshot the step's communication time
    PHASE = 1  #: a phase ends; payload: its accumulator slot
    INSTR = 2  #: a pipeline instruction ends; payload: (slot, step, wall ns, micro-batch, instruction)
    STEP_BEGIN = 3  #: a step begins: reset the accumulator; payload: the step
    STEP_END = 4  #: a step ends; payload: (step, wall ns, tokens, samples, shape)
    COLLECTIVE = 5  #: a collective returned; payload: (step, wall ns, bytes, signature)
    #: a DDP backward pass or an async collective's completion; payload: per bucket (step, wall ns,
    #: bytes, signature, ready event, done event); ``a``: the last bucket's ready event, ``b`` None
    PASS = 6


class CudaClock:
    """CUDA events from a pool, recorded on the current stream; resolved by the emitter only.

    ``event``: the event type (``torch.cuda.Event``, or a test's double with its API); ``memory``:
    the (allocated, reserved, peak) reader (``torch.cuda``'s by default)."""

    def __init__(self, event: Callable[..., Any] | None = None,
                 memory: Callable[[], tuple[int, int, int]] | None = None) -> None:
        if event is None or memory is None:
            import torch

            cuda = torch.cuda
            event = event if event is not None else cuda.Event
            memory = memory if memory is not None else (
                lambda: (cuda.memory_allocated(), cuda.memory_reserved(), cuda.max_memory_allocated()))
        self._event = event
        self._memory = memory
        self._pool: list[Any] = []

    def mark(self) -> Any:
        try:  # marks come from several threads (training, autograd, a process group's): pop, not test-then-pop
            ev = self._pool.pop()
        except IndexError:
            ev = self._event(enable_timing=True)
        ev.record()
        return ev

    def ready(self, ev: Any) -> bool:
        return bool(ev.query())

    def elapsed_ns(self, a: Any, b: Any) -> int:
        return int(a.elapsed_time(b) * 1e6)

    def release(self, a: Any, b: Any) -> None:
        if len(self._pool) < 4096:
            self._pool.append(a)
            self._pool.append(b)

    def memory(self) -> tuple[int, int, int]:
        return self._memory()


# ----------------------------------------------------------------------------- the emitter's side


def pass_ready(clock: DeviceClock, buckets: list[tuple], ev_last: Any) -> bool:
    """Every event of one pass is done on the device (``query()``: never a wait)."""
    if not clock.ready(ev_last):
        return False
    return all(clock.ready(b[4]) and clock.ready(b[5]) for b in buckets)


def resolve_pass(rec: Recorder, acc: StepAccumulator, clock: DeviceClock, buckets: list[tuple], ev_last: Any) -> None:
    """In recording order: one row per bucket (ready -> done on the device) and the exposed wait
    (the last completion after the last bucket was ready) into the step's communication time
    (``acc``: the accumulator of the step being resolved)."""
    exposed = 0
    rows = rec.collective_rows
    for step, wall0, nbytes, sig, ev0, ev1 in buckets:
        rows.extend((step, wall0, clock.elapsed_ns(ev0, ev1), nbytes, sig))
        exposed = max(exposed, clock.elapsed_ns(ev_last, ev1))
    acc.comm_ns += exposed
    for b in buckets:
        clock.release(b[4], b[5])


def resolve_deferred(rec: Recorder, clock: DeviceClock, acc: StepAccumulator) -> None:
    """Turn done event pairs into durations, in recording order, with the CPU path's accounting
    (``acc``: the emitter's own accumulator). Stops at the first entry not done yet."""
    q = rec.deferred
    while q:
        op, payload, a, b = q[0]
        if b is not None and not clock.ready(b):
            return
        if op == DeferredOp.PASS and not pass_ready(clock, payload, a):
            return
        q.popleft()
        if op == DeferredOp.PASS:  # one DDP backward pass: its bucket rows and exposed wait
            resolve_pass(rec, acc, clock, payload, a)
            continue
        if op == DeferredOp.ENTER:
            acc.stack.append(acc.comm_ns)
            continue
        if op == DeferredOp.STEP_BEGIN:
            acc.reset()
            continue
        dur = clock.elapsed_ns(a, b)
        if op == DeferredOp.PHASE:
            acc.sums[payload] += dur - (acc.comm_ns - acc.stack.pop())
        elif op == DeferredOp.INSTR:
            slot, step, wall, mb, instr = payload
            acc.sums[slot] += dur - (acc.comm_ns - acc.stack.pop())
            rec.instr_rows.extend((step, wall, dur, mb, rec.instr_code(instr)))
        elif op == DeferredOp.COLLECTIVE:
            step, wall, nbytes, sig = payload
            acc.comm_ns += dur
            rec.collective_rows.extend((step, wall, dur, nbytes, sig))
        elif op == DeferredOp.STEP_END:
            n, wall0, tokens, samples, shape = payload
            rec.finish_step(n, wall0, dur, tokens, samples, acc, shape)
        clock.release(a, b)


# ----------------------------------------------------------------------------- the test double


class HostDevice:
    """The "device" behind :class:`HostEvent`: an event is done ``lag_ns`` after it was recorded
    (a GPU running behind the host), never while ``held`` is set, and (where
    ``complete_before_ns`` is set) only if recorded before that ``perf_counter_ns`` time. Every
    event call is noted in ``calls`` with the name of the thread that made it; ``synchronize()`` and
    ``wait()`` (device syncs) in ``syncs``."""

    def __init__(self, lag_ns: int = 0, complete_before_ns: int | None = None) -> None:
        self.lag_ns = lag_ns
        self.held = False
        self.complete_before_ns = complete_before_ns
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()  # (method, thread) -> count
        self.syncs: list[str] = []

    def event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> HostEvent:
        """``torch.cuda.Event``'s constructor."""
        if not enable_timing:
            raise RuntimeError("HostEvent: elapsed_time needs enable_timing=True")
        return HostEvent(self)

    def done(self, t_ns: int) -> bool:
        if self.held or time.perf_counter_ns() < t_ns + self.lag_ns:
            return False
        return self.complete_before_ns is None or t_ns < self.complete_before_ns

    def note(self, method: str) -> None:
        self.calls[(method, threading.current_thread().name)] += 1

    def threads_that(self, method: str) -> set[str]:
        """The names of the threads that called ``method`` on an event."""
        return {thread for (m, thread), n in self.calls.items() if m == method and n}


class HostEvent:
    """``torch.cuda.Event``'s API on the host clock: ``record()`` notes ``perf_counter_ns`` (on CPU
    the work "on the stream" at that moment is what the host has done so far); ``query()`` asks
    the :class:`HostDevice`; ``elapsed_time`` raises on an event not done, as CUDA does
    (cudaErrorNotReady)."""

    __slots__ = ("device", "t_ns")

    def __init__(self, device: HostDevice) -> None:
        self.device = device
        self.t_ns: int | None = None

    def record(self, stream: Any = None) -> None:
        self.device.note("record")
        self.t_ns = time.perf_counter_ns()

    def query(self) -> bool:
        self.device.note("query")
        if self.t_ns is None:  # CUDA: an event never recorded counts as done
            return True
        return self.device.done(self.t_ns)

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end``."""
        self.device.note("elapsed_time")
        if self.t_ns is None or end.t_ns is None:
            raise RuntimeError("HostEvent: elapsed_time on an event never recorded")
        if not (self.query() and end.query()):
            raise RuntimeError("HostEvent: elapsed_time before both events completed (cudaErrorNotReady)")
        return (end.t_ns - self.t_ns) / 1e6

    def synchronize(self) -> None:
        self.device.syncs.append(threading.current_thread().name)

    def wait(self, stream: Any = None) -> None:
        self.device.syncs.append(threading.current_thread().name)


class HostClock(CudaClock):
    """:class:`CudaClock`'s own code (pool, record, query, elapsed_time) over :class:`HostEvent`:
    puts the Tracer on its GPU accounting path on a machine without a GPU. By default every event is
    done as soon as recorded; pass a ``device`` (or ``lag_ns`` / ``complete_before_ns``) to make the
    "device" run behind. ``memory``: what :meth:`memory` reports."""

    def __init__(self, device: HostDevice | None = None, *, lag_ns: int = 0, complete_before_ns: int | None = None,
                 memory: tuple[int, int, int] = (-1, -1, -1)) -> None:
        self.device = device if device is not None else HostDevice(lag_ns, complete_before_ns)
        super().__init__(event=self.device.event, memory=lambda: memory)

    @property
    def complete_before_ns(self) -> int | None:
        return self.device.complete_before_ns

    @complete_before_ns.setter
    def complete_before_ns(self, t_ns: int | None) -> None:
        self.device.complete_before_ns = t_ns

    @property
    def asked_from(self) -> set[str]:
        """The threads that asked an event whether or when it was done."""
        return self.device.threads_that("query") | self.device.threads_that("elapsed_time")
