"""The on-demand profiling window (CommandKind PROFILE; ``tracetop profile``): the ranks a command
names run torch's profiler for the next N steps, then ship the trace to the collector.

The flow, on a named rank:

1. At a command boundary (trainer_hooks/commands.py; every K steps, K = TRACETOP_COMMAND_EVERY_STEPS,
   and where the trainer registered no ``on_command`` handler, only with ``TRACETOP_PROFILE=1``:
   then every 50 steps unless K is set, never at step 0; ``TRACETOP_PROFILE=0`` refuses windows)
   every rank receives the PROFILE command
   (``value`` = N steps, ``values`` = the ranks). A named rank starts the profiler right there,
   before the next step begins (CPU activities; CUDA too where torch sees a device). The others do
   nothing. Every rank agrees as for any command: if a named rank refuses, the windows started
   elsewhere are stopped and their traces dropped, and the action says who refused and why.
2. The window counts step ends (the Tracer's step context) and stops the profiler after the N-th step
   ends, before the next begins (or when the tracer closes, with the steps it had).
3. A thread of its own writes the trace (Chrome/Perfetto JSON, gzip'd) to a temporary file and
   sends it to the collector in pieces of at most 1 MiB (``Control.Profile``); the collector keeps
   it in the run's file (tables ``profile_traces``, ``profile_chunks``).

Cost, bounded: nothing before or after a window (no profiler is ever left on). Starting costs ~1 ms
on the training thread (``torch.autograd.profiler.profile`` directly, the Kineto profiler
``torch.profiler.profile`` wraps: the wrapper's first ``start()`` imports ``torch._inductor``, 2-4 s
on the training thread here); stopping costs the profiler's own teardown (and, on CUDA, the one
device synchronize torch's profiler does when it stops). The JSON export, gzip and upload run off
the training thread.

Size cap: a gzip'd trace over ``MAX_TRACE_BYTES`` (64 MiB) is not sent; the collector is told so
(``note``), and the file stays on the rank's disk, its path in the note. Refused, with the reason,
where the profiler is unavailable (``import`` fails, or ``TRACETOP_TEST_NO_PROFILER`` names the
rank) and while a window (or its upload) is still running on the rank. Nothing here raises into
the training loop: a failure is counted (``hook_error``) and said in the window's note.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any

from tracetop import env as tenv

log = logging.getLogger("trainer_hooks")

#: steps between command boundaries when no handler is registered and TRACETOP_COMMAND_EVERY_STEPS is
#: unset: the boundary then serves profiling windows alone, and a window may wait this long to start
EVERY_STEPS = 50
#: the most steps one window profiles (the collector refuses more before anything is sent)
MAX_STEPS = 100
#: the most ranks one window names (the collector refuses more): a window is to look closer at a few
MAX_RANKS = 16
#: the largest gzip'd trace sent to the collector; above it the trace stays on the rank's disk
MAX_TRACE_BYTES = 64 << 20
#: one Control.Profile message's data (gRPC's default message cap is 4 MiB)
CHUNK_BYTES = 1 << 20
#: seconds the tracer's close waits for a window's upload to finish
CLOSE_WAIT_S = 10.0


def enabled() -> bool:
    """TRACETOP_PROFILE (default on): whether this rank takes profiling windows at all."""
    return (tenv.get(tenv.TRACETOP_PROFILE, "1") or "1") not in ("0", "off", "false", "False")


def boundary_alone() -> bool:
    """TRACETOP_PROFILE=1 (said, not the default): a trainer with no ``on_command`` handler runs
    the command boundary for profiling windows alone. Not by default: the boundary is a collective
    over every rank (its first one creates a process group), so a job where some rank does not
    trace the same steps (a Tracer on rank 0 only, a rank that skips steps) would wait there until
    the group's timeout: a hang the job did not have without tracetop."""
    return (tenv.get(tenv.TRACETOP_PROFILE, "") or "") in ("1", "on", "true", "True")


def unavailable(rank: int) -> str | None:
    """Why this rank cannot profile (None: it can)."""
    spec = (tenv.get(tenv.TRACETOP_TEST_NO_PROFILER, "") or "").replace(" ", "")
    if spec and (spec == "all" or str(rank) in spec.split(",")):
        return (f"torch.profiler is unavailable on rank {rank} ({tenv.TRACETOP_TEST_NO_PROFILER}={spec}); "
                "no window was started")
    try:
        from torch.autograd import profiler as ap

        if not callable(getattr(ap, "profile", None)):
            return f"torch.profiler is unavailable on rank {rank} (torch.autograd.profiler.profile is missing)"
    except Exception as e:
        return f"torch.profiler is unavailable on rank {rank} ({type(e).__name__}: {e})"
    return None


class Windows:
    """This rank's profiling windows, one at a time: the PROFILE command's flow at a boundary, the
    running window's step count, its end when the tracer closes. Held by the command bus (whose
    ``settle``/``undone`` make every rank agree, as for any command)."""

    def __init__(self, bus: Any) -> None:
        self.bus = bus
        self.enabled = enabled()
        self.current: Window | None = None  # the window running (or shipping) on this rank

    def take(self, p: Any) -> None:
        """A PROFILE command (a ``commands.Pending``) at ``p.step``'s boundary, on every rank (the
        on_command flow and the reference trainer's seam both land here): the named ranks start a
        window, all agree."""
        bus, rank = self.bus, self.bus.t.rank
        window, why = None, ""
        named = rank in p.values
        if named:
            w = self.current
            why = (unavailable(rank) or
                   ("profiling is off on this rank (TRACETOP_PROFILE=0)" if not self.enabled else "") or
                   (f"a profiling window (action {w.action_id}) is still running on rank {rank}"
                    if w is not None and w.running else ""))
            if not why:
                try:
                    window = Window(bus, p.action_id, int(p.value), p.step)
                    window.start()
                    self.current = window
                except Exception as e:
                    window, why = None, f"torch's profiler could not start on rank {rank}: {type(e).__name__}: {e}"
        message = why or (f"profiling steps {p.step}..{p.step + int(p.value) - 1}" if named
                          else "not named: nothing to profile here")
        if bus.settle(p, not why, message) or why:
            return
        if window is not None:  # another rank refused: no window anywhere
            window.stop(ship=False)
            self.current = None
        bus.undone(p, True, "this rank's window stopped, its trace dropped" if window is not None
                   else "not named: nothing to undo")

    def step_done(self) -> None:
        """A step ended (the Tracer's step end): count it in the running window (stops it after its
        N steps)."""
        w = self.current
        if w is not None and w._prof is not None:
            try:
                w.step_done()
            except Exception as e:
                self.bus.t.recorder.hook_error("profile", e)

    def end(self, timeout_s: float) -> None:
        """The tracer closes: stop a running window with the steps it had, let its upload finish."""
        w = self.current
        if w is None:
            return
        try:
            if w._prof is not None:
                w.stop(note=f"the run ended after {w.done_steps} of {w.steps} steps")
            w.join(timeout_s)
        except Exception as e:
            self.bus.t.recorder.hook_error("profile close", e)


class Window:
    """One profiling window on this rank: started at a boundary, stopped after ``steps`` step ends."""

    def __init__(self, bus: Any, action_id: int, steps: int, first_step: int) -> None:
        self.bus = bus
        self.action_id = action_id
        self.steps = steps
        self.first_step = first_step
        self.done_steps = 0
        self.start_ns = 0
        self.end_ns = 0
        self.note = ""
        self._prof: Any = None
        self.thread: threading.Thread | None = None
        self.sent_bytes = 0

    # ------------------------------------------------------------------ the training thread
    def start(self) -> None:
        """Raises when the profiler cannot start (the boundary turns it into a refusal)."""
        import torch
        from torch.autograd import profiler as ap

        device = "cuda" if torch.cuda.is_available() else None
        prof = ap.profile(use_cpu=True, use_device=device, use_kineto=True, record_shapes=False)
        prof.__enter__()
        self._prof = prof
        self.start_ns = time.time_ns()

    def step_done(self) -> bool:
        """A step ended; True when the window has its N steps and stopped."""
        self.done_steps += 1
        if self.done_steps < self.steps:
            return False
        self.stop()
        return True

    def stop(self, note: str = "", ship: bool = True) -> None:
        """Stop the profiler (the training thread) and hand the export and upload to a thread."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        self.end_ns = time.time_ns()
        self.note = note
        try:
            prof.__exit__(None, None, None)
        except Exception as e:
            self.note = f"the profiler failed to stop: {type(e).__name__}: {e}"
            self.bus.t.recorder.hook_error("profile stop", e)
            prof = None
        if not ship:
            return
        self.thread = threading.Thread(target=self._export_and_send, args=(prof,), name="tracetop-profile",
                                       daemon=True)
        self.thread.start()

    @property
    def running(self) -> bool:
        return self._prof is not None or (self.thread is not None and self.thread.is_alive())

    # ------------------------------------------------------------------ the window's thread
    def _export_and_send(self, prof: Any) -> None:
        path, note = "", self.note
        tmp = tempfile.mkdtemp(prefix="tracetop-profile-")
        try:
            if prof is not None:
                raw = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(raw)
                path = os.path.join(tmp, f"{self.bus.t.run_id}-rank{self.bus.t.rank}-action{self.action_id}.json.gz")
                with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                os.remove(raw)
                size = os.path.getsize(path)
                if size > MAX_TRACE_BYTES:
                    note = (f"trace of {size / 2**20:.1f} MiB gzip'd is over the {MAX_TRACE_BYTES >> 20} MiB cap: "
                            f"not sent; it is on rank {self.bus.t.rank}'s disk at {path} (profile fewer steps)")
                    self._send_last(0, note)
                    return
                self._send_file(path, size, note)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                self._send_last(0, note or "no trace")
                shutil.rmtree(tmp, ignore_errors=True)
        except Exception as e:
            self.bus.t.recorder.hook_error("profile upload", e)
            log.warning("trainer_hooks: rank %d: the profiling window's trace could not be sent (%r)%s",
                        self.bus.t.rank, e, f"; it is at {path}" if path else "")
            try:
                self._send_last(0, f"the trace could not be sent ({type(e).__name__}: {e})"
                                + (f"; it is on rank {self.bus.t.rank}'s disk at {path}" if path else ""))
            except Exception:
                pass

    def _message(self, offset: int, data: bytes, last: bool, total: int = 0, note: str = "") -> Any:
        from tracetop.wire import tracetop_pb2 as pb

        t = self.bus.t
        m = pb.ProfileChunk(run_id=t.run_id, rank=t.rank, source_key=self.bus.link.source_key(),
                            command_id=str(self.action_id), offset=offset, data=data, last=last)
        if last:
            m.total_bytes, m.first_step, m.steps = total, self.first_step, self.done_steps
            m.start_ns, m.end_ns, m.note = self.start_ns, self.end_ns, note
        return m

    def _send(self, msg: Any) -> None:
        from tracetop.wire import tracetop_pb2_grpc as pb_grpc

        for attempt in range(5):
            try:
                link = self.bus.link
                pb_grpc.ControlStub(link.channel()).Profile(msg, timeout=30, metadata=link.metadata())
                return
            except Exception as e:
                code = e.code() if hasattr(e, "code") else None
                if attempt == 4 or getattr(code, "name", "") in ("FAILED_PRECONDITION", "INVALID_ARGUMENT",
                                                                 "PERMISSION_DENIED", "UNAUTHENTICATED"):
                    raise
                time.sleep(0.5 * (attempt + 1))

    def _send_file(self, path: str, size: int, note: str) -> None:
        with open(path, "rb") as f:
            offset = 0
            while True:
                data = f.read(CHUNK_BYTES)
                last = offset + len(data) >= size
                self._send(self._message(offset, data, last, size if last else 0, note))
                offset += len(data)
                self.sent_bytes = offset
                if last:
                    return

    def _send_last(self, total: int, note: str) -> None:
        self._send(self._message(0, b"", True, total, note))

    def join(self, timeout_s: float) -> None:
        th = self.thread
        if th is not None:
            th.join(timeout=timeout_s)
