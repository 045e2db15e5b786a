"""Async collectives (``async_op=True``: FSDP2's explicit prefetch, DeepSpeed ZeRO-3's
all-gathers, ``isend``/``irecv``) timed to their completion, not only until they return.

The returned ``Work``'s future (``work.get_future()``) completes when the collective does: on CPU
(gloo) on the process group's thread, where a done-callback reads the clock; on GPU (NCCL) at
once, when it is queued, with its callbacks run on a stream made to wait for it, so the callback
records a CUDA event there, done on the device when the collective is. Either way the row is
written from the callback (CPU) or by the emitter once the events are done (GPU, through
:func:`trainer_hooks.device_clock.resolve_pass`, the DDP bucket's resolution with no exposed wait), never by
a wait on the training thread.

What is measured: the row's ``duration_ns`` is issue to completion (``is_async=1``); the step's
``comm_exposed_ns`` keeps only the time the call took to return (the training thread's later
``work.wait()`` stays in the phase it happens in: counting it would need a wrapper on
``Work.wait``, not built). A work without a future (``get_future`` refused: some backends' p2p
works) keeps the old row, the time until return; that (op, group) is not asked again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from trainer_hooks.device_clock import DeferredOp

if TYPE_CHECKING:
    from trainer_hooks.recorder import Recorder

perf_counter_ns = time.perf_counter_ns


def _future(sink: Recorder, work: Any, sig: int) -> Any:
    no_future = sink.no_future
    if sig in no_future:
        return None
    get = getattr(work, "get_future", None)  # a list (batch_isend_irecv) has none: the old row
    if get is None:
        return None
    try:
        return get()
    except Exception:  # this backend's work has no future: not asked again for this signature
        no_future.add(sig)
        return None


def track(sink: Recorder, work: Any, step: int, wall0: int, t0: int, nbytes: int, sig: int) -> bool:
    """CPU: the row is appended when ``work`` completes. False: no future, the caller writes the
    row (the time until return)."""
    fut = _future(sink, work, sig)
    if fut is None:
        return False
    rows = sink.collective_rows

    def done(_f: Any) -> None:  # the process group's thread (or here, if already complete)
        try:
            rows.extend((step, wall0, perf_counter_ns() - t0, nbytes, sig))
        except Exception as e:
            sink.hook_error("collective", e)

    fut.add_done_callback(done)
    return True


def track_device(sink: Recorder, work: Any, token: tuple) -> bool:
    """GPU: ``token`` is the Recorder's ``collective_enter`` (sig, bytes, t0, start event). The
    completion event is recorded in the future's callback; the pair goes to the emitter as a
    one-bucket pass whose last-ready event is its own end (no exposed wait)."""
    sig, nbytes, t0, ev0 = token
    fut = _future(sink, work, sig)
    if fut is None:
        return False
    clock, deferred = sink.device_clock, sink.deferred
    assert clock is not None
    step, wall0 = sink.step_n, sink.wall(t0)

    def done(_f: Any) -> None:
        try:
            ev1 = clock.mark()  # on the callback's stream: it waits for the collective
            deferred.append((DeferredOp.PASS, [(step, wall0, nbytes, sig, ev0, ev1)], ev1, None))
        except Exception as e:
            sink.hook_error("collective", e)

    fut.add_done_callback(done)
    return True
