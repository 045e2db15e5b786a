"""The emitter thread: the Recorder's rows -> columns -> the sink, the heartbeat, memory samples, and
(on the device clock) the resolution of deferred event pairs.

It decides *when* rows go (every drain interval, at every heartbeat, sooner when the collector asks
for fresh rows); the sink (``tracetop.wire.shipper.Sink``, the Shipper) decides *where*. Each
wake-up takes the GIL from training: few, large pieces of work. The emitter never dies: an error
is counted by the Recorder and the loop goes on.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from typing import TYPE_CHECKING

from tracetop.events import Kind
from trainer_hooks import columns as cols
from trainer_hooks.device_clock import resolve_deferred
from trainer_hooks.recorder import Recorder, StepAccumulator

if TYPE_CHECKING:
    from tracetop.wire.shipper import Sink

#: where the resident set size is read (pages; field 2)
STATM_PATH = "/proc/self/statm"


def _take(buf: list) -> list:
    """Everything appended so far (appends and a row's ``extend`` only ever add at the end, each one
    step under the GIL, as are slicing and deleting a prefix: nothing is lost or taken twice, and a
    flat buffer is taken in whole rows)."""
    n = len(buf)
    chunk = buf[:n]
    del buf[:n]
    return chunk


class Emitter:
    """Drains ``rec`` into ``sink`` from its own thread (:meth:`start`).

    ``drain_interval_s`` None: follow the sink's shipment interval (``sink.ship_interval_s``,
    shorter while someone watches the run; ``on_interval_change`` wakes the thread), else
    ``fallback_drain_s`` until the sink says. ``statm_path``: the resident-set source (a missing or
    unreadable file leaves ``rss_bytes`` at -1). ``memory_budget_bytes``: reported beside each
    memory row.
    """

    def __init__(self, rec: Recorder, sink: Sink, *, heartbeat_s: float, drain_interval_s: float | None,
                 fallback_drain_s: float, memory_budget_bytes: int = -1, statm_path: str = STATM_PATH) -> None:
        self.rec = rec
        self.sink = sink
        self.heartbeat_s = heartbeat_s
        self.follows_sink = drain_interval_s is None
        self.drain_interval_s = fallback_drain_s if drain_interval_s is None else drain_interval_s
        self.memory_budget_bytes = memory_budget_bytes
        self.hostname = os.environ.get("TRACETOP_NODE") or socket.gethostname()  # the rank's node name
        self.pid = os.getpid()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._statm_fd = os.open(statm_path, os.O_RDONLY)
        except OSError:
            self._statm_fd = -1
        self.device_acc = StepAccumulator()  # the accounting of the step being resolved (device clock)
        self._drain_lock = rec.drain_lock  # also taken by ``rec.events``, which counts rows taken here
        self._stop = threading.Event()
        self.rewake = threading.Event()  # the sleep, cut short by stop() or a new interval
        if self.follows_sink and hasattr(sink, "on_interval_change"):
            sink.on_interval_change(self.rewake.set)
        self._ship_soon = getattr(sink, "ship_soon", lambda: None)
        self._handover = False  # the training thread asked for a drain now (handover())
        self._thread = threading.Thread(target=self.run, name="tracetop-emitter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop the thread after its last resolution and drain (waits up to ``timeout_s``)."""
        self._stop.set()
        self.rewake.set()
        self._thread.join(timeout=timeout_s)

    def close(self) -> None:
        if self._statm_fd >= 0:
            os.close(self._statm_fd)
            self._statm_fd = -1

    def handover(self) -> None:
        """A step ended and the endpoint is local (a node agent): drain and ship now, so a rank
        killed later loses at most the rows since (the Tracer calls it at most every
        TRACETOP_HANDOVER_S)."""
        self._handover = True
        self.rewake.set()

    def drain_every(self) -> float:
        """The drain interval: the sink's interval now (shorter while the collector asks for fresh
        rows because someone watches the run), unless one was given."""
        if self.follows_sink:
            return float(getattr(self.sink, "ship_interval_s", self.drain_interval_s))
        return self.drain_interval_s

    def run(self) -> None:
        # device clock: resolve events every 50 ms (they are few and must be released); CPU: wake
        # only to drain or beat
        rec = self.rec
        next_hb = time.monotonic()  # the first heartbeat at once: the collector knows this rank exists
        next_drain = time.monotonic() + self.drain_interval_s

        def wait() -> float:
            due = max(0.0, min(next_hb, next_drain) - time.monotonic())
            return min(0.05, due) if rec.device_clock is not None else due

        last_drain = time.monotonic()
        while True:
            if self.rewake.wait(wait()):
                self.rewake.clear()
                # a new interval (the collector asks for fresh rows while the run is watched)
                next_drain = min(next_drain, last_drain + self.drain_every())
                if self._handover:
                    self._handover = False
                    next_drain = time.monotonic()
            if self._stop.is_set():
                break
            try:
                self.resolve()
                now = time.monotonic()
                if now >= next_drain or now >= next_hb:
                    last_drain, next_drain = now, now + self.drain_every()
                    drained = self.drain()
                    beat = now >= next_hb
                    if beat:
                        next_hb = now + self.heartbeat_s
                        self.heartbeat()
                    if drained or beat:
                        # out now, one shipment with everything drained (and the heartbeat): a
                        # row waits at most one drain interval, not a drain and then a flush
                        self._ship_soon()
            except Exception as e:  # the emitter never dies
                rec.hook_error("emitter", e)
        if rec.device_clock is not None:
            deadline = time.monotonic() + 2.0
            while rec.deferred and time.monotonic() < deadline:
                self.resolve()
                time.sleep(0.01)
        try:
            self.drain()
        except Exception as e:
            rec.hook_error("emitter", e)

    def resolve(self) -> None:
        """Device clock: the deferred event pairs that are done, in recording order."""
        clock = self.rec.device_clock
        if clock is not None:
            resolve_deferred(self.rec, clock, self.device_acc)

    def drain(self) -> bool:
        """Hot-path rows -> columns -> the sink, a few vectorised operations per kind. True when
        there were rows."""
        rec, sink = self.rec, self.sink
        drained = False
        with self._drain_lock:
            # each take counted at once, under the lock ``rec.events`` takes (a count never misses them)
            rows = _take(rec.collective_rows)
            rec.rows_taken += len(rows) // cols.ROW_WIDTH
            if rows:
                drained = True
                sink.record_many(Kind.COLLECTIVE, cols.collective_columns(rec.rank, rows, list(rec.signature_table)))
            rows = _take(rec.instr_rows)
            rec.rows_taken += len(rows) // cols.ROW_WIDTH
            if rows:
                drained = True
                sink.record_many(Kind.PIPE_INSTR, cols.instr_columns(rec.rank, rec.stage, rows, list(rec.instr_names)))
            rows = _take(rec.step_rows)
            rec.rows_taken += 3 * len(rows)
            if rows:
                a, res, peak, rss = self.memory()  # a row's own peak replaces this sample's, where measured
                step, throughput, memory = cols.step_columns(rec.rank, rows, (a, res, peak, rss, self.memory_budget_bytes),
                                                             list(rec.mfu_table))
                sink.record_many(Kind.STEP, step)
                sink.record_many(Kind.THROUGHPUT, throughput)
                sink.record_many(Kind.MEMORY, memory)
                drained = True
        return drained

    def heartbeat(self, closed: bool = False) -> None:
        rec = self.rec
        op, role, since = rec.pending
        phase = "closed" if closed else "comm" if op else (rec.current_phase if rec.in_step else "idle")
        rec.record(Kind.HEARTBEAT, rec.rank, rec.step_n, rec.clock_ns(), 0, phase, op, role, since,
                   self.hostname, self.pid)

    def memory(self) -> tuple[int, int, int, int]:
        """(device allocated, reserved, peak, host RSS) bytes; -1 where not known (host peak:
        ``ru_maxrss`` without a device clock)."""
        rss = -1
        if self._statm_fd >= 0:
            rss = int(os.pread(self._statm_fd, 64, 0).split()[1]) * self._page
        clock = self.rec.device_clock
        if clock is not None:
            alloc, reserved, peak = clock.memory()
        else:
            alloc = reserved = -1
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return alloc, reserved, peak, rss
