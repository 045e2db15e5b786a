"""How a Tracer ends: its close (the trainer's ``close()``, or the interpreter's exit) and the exit
flush (a signal: the process may die right after).

Close, in order: the collectives are restored (the training's own calls run untimed from here),
a running profiling window stops and its upload gets up to ``profiling.CLOSE_WAIT_S``, the command
path's threads stop after their last reports, the emitter drains its last rows and a heartbeat
says ``closed`` (collector/ingest/source_ends.py watches for it), then the shipper waits for the
acks (``close_timeout_s``; :data:`NEVER_REACHED_S` when the endpoint was never reached) and the progress record is
removed once everything was handed over. With a deadline (the exit path, shutdown.py) every wait
is bounded by it. A failure on the way is counted as a hook error; the rest still runs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from trainer_hooks import profiling, progress, shutdown
from trainer_hooks.integrations import collectives as colls
from trainer_hooks.integrations import ddp

if TYPE_CHECKING:
    from trainer_hooks.tracer import Tracer

log = logging.getLogger("trainer_hooks")

#: Seconds a close waits for an endpoint that was never reached (its first try failed, nothing acked).
NEVER_REACHED_S = 1.0


def close(tracer: Tracer, deadline: float | None) -> None:
    """``tracer.close()``; with ``deadline`` (monotonic), all of it bounded by it (the exit path).
    Idempotent."""
    if tracer.closed:
        return
    tracer.closed = True
    if not tracer.enabled:
        return
    shutdown.unregister(tracer)
    shutdown.closing(True)  # a SIGTERM meanwhile waits for this close (up to its deadline)
    try:
        _close_body(tracer, deadline)
    finally:
        shutdown.closing(False)  # hands on a signal that came meanwhile


def _close_body(t: Tracer, deadline: float | None) -> None:
    rec, emitter, commands, step_peak, shipper = t.recorder, t.emitter, t.commands, t.step_peak, t.shipper
    assert emitter is not None and commands is not None and step_peak is not None

    def left(cap: float) -> float:
        return cap if deadline is None else max(0.0, min(cap, deadline - time.monotonic()))

    try:
        colls.uninstall(rec)
        ddp.uninstall(rec)
        commands.windows.end(left(profiling.CLOSE_WAIT_S))
        commands.close(left(t.close_timeout_s))  # its last reports, within the deadline too
        emitter.stop(timeout_s=left(max(2.0, t.close_timeout_s)))
        # the last rows sealed before the closed heartbeat is recorded (a flush of no wait seals, then
        # returns): one pass seals its heartbeat rows before its step columns, so the closed marker
        # went out with a lower seq than the last step's rows, and a collector that committed it and
        # died before them stored a clean end without them. Sealed first, it is the rank's last batch
        shipper.flush(0.0)
        emitter.heartbeat(closed=True)  # the clean close: collector/ingest/source_ends.py watches for it
    except Exception as e:
        rec.hook_error("close", e)
    finally:
        if t.progress is not None:  # a rank of this run killed on this node: count its loss
            progress.claim_dead(shipper, t.run_id)
        try:
            _hand_over(t, left(t.close_timeout_s))
        except Exception as e:
            rec.hook_error("close", e)
        if t.progress is not None and not shipper.stats().get("unacked_batches"):
            t.progress.remove()  # all handed over; else a neighbour counts what was not
        emitter.close()
        step_peak.close()
        if rec.errors:
            log.warning("trainer_hooks: %d hook errors were counted and skipped on rank %d", rec.errors, t.rank)


def _hand_over(t: Tracer, timeout_s: float) -> None:
    """The shipper's last flush and stop, within ``timeout_s``; an endpoint never reached gets
    :data:`NEVER_REACHED_S` of it. Judged after that first stretch, not before it: a close that came
    before the sender's first try had failed (a short job, a tracer closed soon after its start)
    used to wait the whole ``close_timeout_s`` for an endpoint that refuses every connection."""
    shipper = t.shipper
    end = time.monotonic() + timeout_s
    try:
        if not shipper.flush(min(timeout_s, NEVER_REACHED_S)):  # all acked: the close stops at once
            st = shipper.stats()
            if st and st.get("last_error") and not st.get("connected") and not st.get("batches_acked"):
                # never reached the endpoint: do not hold the trainer's exit for long
                log.warning("trainer_hooks: rank %d never reached %s; %d telemetry batches are dropped at exit",
                            t.rank, t.endpoint, st.get("unacked_batches", 0))
                end = time.monotonic()
    except Exception as e:  # a sink that cannot flush is still closed
        t.recorder.hook_error("close", e)
    shipper.close(max(0.0, end - time.monotonic()))


def exit_flush(t: Tracer, deadline: float, final: bool) -> None:
    """The process is ending (a signal; trainer_hooks/shutdown.py): the rows the training thread
    recorded go to the shipper and out, acked by ``deadline`` (monotonic) or left. ``final``:
    the process dies after this, so once all is acked a last heartbeat says ``closed``. Called
    from the main thread's handler or the watcher thread; never raises."""
    emitter, shipper = t.emitter, t.shipper
    if t.closed or not t.enabled or emitter is None:
        return
    try:
        # (device-clock pairs are resolved by the emitter thread alone, every 50 ms: not here)
        emitter.drain()
        ok = shipper.flush(max(0.0, deadline - time.monotonic()))
        # a rank of this run killed on this node (torchrun ends the rest right after): count its loss
        if progress.claim_dead(shipper, t.run_id):
            ok = shipper.flush(max(0.0, deadline - time.monotonic())) and ok
        if ok and final and not t.final_beat:
            t.final_beat = True
            emitter.heartbeat(closed=True)
            if shipper.flush(max(0.0, deadline - time.monotonic())) and t.progress is not None:
                t.progress.remove()  # all handed over
    except Exception as e:
        t.recorder.hook_error("exit-flush", e)
