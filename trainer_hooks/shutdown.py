"""The end of the process is part of the path: the hooks flush on SIGTERM, SIGINT and at
interpreter exit, within a deadline, then let the process end as it would have.

Why: a launcher ends a job by signal (torchrun SIGTERMs every rank when one fails, Slurm and
Kubernetes SIGTERM before they SIGKILL), and a plain training loop neither catches it nor calls
``tracer.close()``. The default action of SIGTERM ends the process at once, and with it whatever
the hooks held since their last shipment (seconds of steps on every rank).

What happens:

* **Interpreter exit** (the loop returned or raised, ``sys.exit``): an ``atexit`` hook closes every
  live Tracer, its whole close bounded by :data:`EXIT_FLUSH_S` (``TRACETOP_EXIT_FLUSH_S``).
* **SIGTERM / SIGINT**: a handler is installed (once, from the main thread, by the first Tracer)
  over the one already there. On the signal it drains the hooks' rows, ships them and waits for the
  acks up to the deadline, then hands the signal to the previous handler: a Python handler (the
  framework's, ``KeyboardInterrupt`` for SIGINT) is called as it would have been; the default
  action is taken again (the handler restores ``SIG_DFL`` and re-sends the signal, so the process
  dies by it, with the same exit status as without the hooks). Where the process will die of it
  (default action) and everything was acked, a last heartbeat says ``closed``: nothing of this
  rank is missing. Where the previous handler was ``SIG_IGN`` or not set from Python, nothing is
  installed for that signal. Where the signal lands inside a ``__del__`` (the garbage collector's,
  where Python drops an exception) and the previous handler is Python's, it is flushed there and
  handed on a moment later, outside it (:func:`_in_del`).
* **A main thread stuck in C** (a collective waiting on a dead peer) runs no Python handler until
  the call returns. So a watcher thread also learns of the signal (``signal.set_wakeup_fd``, where
  nobody else has set one), flushes from its own thread, and, when the previous action was the
  default and the main thread has not taken the signal by the deadline, takes the default action
  itself (``SIG_DFL`` at the C level, the signal re-sent): the process ends as soon as it would
  have without the hooks, plus at most the deadline.

Never raises out of a handler (its own failures are counted on each Tracer, as every hook error),
never waits past the deadline, and does nothing in a forked child (a DataLoader worker).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from tracetop import env as tenv

if TYPE_CHECKING:
    from trainer_hooks.tracer import Tracer

log = logging.getLogger("trainer_hooks")

#: Seconds the hooks may hold the end of a process (signal or exit) to ship what they hold.
DEFAULT_EXIT_FLUSH_S = 2.0
#: The signals the hooks flush on.
SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: After its flush, how long the watcher lets the main thread take the signal before it takes the
#: default action itself.
MAIN_THREAD_GRACE_S = 0.25
#: A signal whose previous Python handler would raise inside a ``__del__`` is sent again this much
#: later (flushed once), until it lands outside one: see :func:`_in_del`.
REDELIVER_S = 0.005

_lock = threading.RLock()
_tracers: weakref.WeakSet[Tracer] = weakref.WeakSet()
_flush_lock = threading.Lock()  # one exit flush at a time
_flush_owner = 0  # thread ident holding _flush_lock
_previous: dict[int, Any] = {}  # signum -> the handler ours replaced
_pending: list[int] = []  # signals that arrived on the main thread while it was flushing
_chained = threading.Event()  # the main thread handed a signal on
_redeliver: set[int] = set()  # signals flushed and sent again, to be handed on outside a __del__
_closing = 0  # thread ident of a Tracer.close() in progress (0: none)
_close_done = threading.Event()  # set when no close() is in progress
_close_done.set()
_pid = -1  # the process that installed (a forked child does nothing)
_signals_pid = -1  # the process whose main thread installed the signal handlers
_atexit_done = False
_watcher: threading.Thread | None = None


def exit_flush_s() -> float:
    raw = tenv.get(tenv.TRACETOP_EXIT_FLUSH_S)
    try:
        value = float(raw) if raw else DEFAULT_EXIT_FLUSH_S
    except ValueError:
        value = DEFAULT_EXIT_FLUSH_S
    return max(0.0, value)


def register(tracer: Tracer) -> None:
    """Flush ``tracer`` at the end of the process (installs the handlers once). Never raises."""
    global _pid, _signals_pid
    try:
        with _lock:
            _tracers.add(tracer)
            if _pid != os.getpid():
                _pid = os.getpid()
                atexit.register(_at_exit)
            # from the main thread only (Python's rule); a first Tracer elsewhere leaves it to a later one
            if _signals_pid != os.getpid() and threading.current_thread() is threading.main_thread():
                _signals_pid = os.getpid()
                _install_signals()
    except Exception as e:  # the hooks never stop the training
        log.warning("trainer_hooks: cannot flush at process end (%r); telemetry of the last seconds may be lost", e)


def unregister(tracer: Tracer) -> None:
    with _lock:
        _tracers.discard(tracer)


def _install_signals() -> None:
    global _watcher
    for sig in SIGNALS:
        prev = signal.getsignal(sig)
        if prev is None or prev == signal.SIG_IGN or prev is _on_signal:
            continue  # set from C, or ignored: leave it as it is
        _previous[sig] = prev
        signal.signal(sig, _on_signal)
    if not _previous:
        return
    # the watcher: learns of the signal even while the main thread is stuck in C
    r, w = socket.socketpair()
    r.setblocking(True)
    w.setblocking(False)
    try:
        old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):
        r.close()
        w.close()
        return
    if old != -1:  # someone (asyncio) reads the wakeup fd: leave it to them
        signal.set_wakeup_fd(old)
        r.close()
        w.close()
        return
    _watcher = threading.Thread(target=_watch, args=(r, w), name="tracetop-exit-watch", daemon=True)
    _watcher.start()


def closing(begin: bool) -> None:
    """A Tracer.close() begins or ends. A signal that comes meanwhile lets it finish (its flush is
    the one that matters: torchrun's SIGTERM often lands while a rank closes after a peer's death),
    then is handed on at its end; the watcher still ends the process at the deadline."""
    global _closing
    if begin:
        _close_done.clear()
        _closing = threading.get_ident()
        return
    _closing = 0
    _close_done.set()
    if _pending and threading.current_thread() is threading.main_thread():
        pending = list(_pending)
        _pending.clear()
        for signum in pending:
            _chain(signum, None)


def _live() -> list[Tracer]:
    with _lock:
        return [t for t in list(_tracers) if not t.closed]


def flush_all(deadline: float, final: bool) -> None:
    """Ship every live tracer's rows, waiting for acks until ``deadline`` (monotonic). ``final``:
    the process ends after this (a last ``closed`` heartbeat where everything was acked)."""
    global _flush_owner
    if not _flush_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        return
    _flush_owner = threading.get_ident()
    try:
        for t in _live():
            t.exit_flush(deadline, final)
    finally:
        _flush_owner = 0
        _flush_lock.release()


def _dies_of(sig: int) -> bool:
    """Whether the previous action for ``sig`` was the default one (the process ends of it)."""
    return _previous.get(sig) == signal.SIG_DFL


def _on_signal(signum: int, frame: Any) -> None:
    """The handler over the previous one: flush within the deadline, then hand the signal on."""
    if os.getpid() == _pid:
        if threading.get_ident() in (_flush_owner, _closing):
            _pending.append(signum)  # arrived inside our own flush or a close: handed on after it
            return
        if signum not in _redeliver:
            try:
                flush_all(time.monotonic() + exit_flush_s(), final=_dies_of(signum))
            except Exception:  # never out of a handler
                pass
        if callable(_previous.get(signum)) and _in_del(frame):
            try:
                _redeliver.add(signum)
                timer = threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum))
                timer.daemon = True
                timer.start()
                return
            except Exception:  # no thread to be had: hand it on here, as before
                pass
        _redeliver.discard(signum)
    _chain(signum, frame)


def _in_del(frame: Any) -> bool:
    """Whether the main thread was interrupted inside a ``__del__``. An exception a handler raises
    there (``KeyboardInterrupt``) is printed as "Exception ignored in" and dropped, and the loop it
    was meant to end runs on. The garbage collector runs finalizers in whichever thread allocates:
    with the hooks the main thread also collects the shipper's cycles (gRPC's objects have
    ``__del__``), so a SIGINT landed there once in a few hundred tries; the signal is sent again
    a moment later instead (tests/trainer_hooks/test_shutdown.py, ``sigint-in-del``)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _chain(signum: int, frame: Any) -> None:
    """Hand the signal to the handler ours replaced, as if ours had never been there."""
    _chained.set()
    prev = _previous.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)  # e.g. KeyboardInterrupt, a framework's graceful stop
        return
    if prev == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # dies of it, as it would have


def _watch(r: socket.socket, w: socket.socket) -> None:
    """The watcher thread: a signal number on the wakeup fd; flush from here, and take the default
    action where the main thread cannot (stuck in C) and the process would have died of it."""
    while True:
        try:
            data = r.recv(64)
        except OSError:
            return
        if not data:
            return
        for signum in set(data):
            if signum not in _previous or os.getpid() != _pid or signum in _redeliver:
                continue  # (sent again by the main thread: flushed already)
            deadline = time.monotonic() + exit_flush_s()
            try:
                flush_all(deadline, final=_dies_of(signum))
            except Exception:
                pass
            _close_done.wait(max(0.0, deadline - time.monotonic()))  # a close in progress: let it finish
            if _dies_of(signum) and signal.getsignal(signum) is _on_signal:
                if not _chained.wait(MAIN_THREAD_GRACE_S):
                    _default_action(signum)


def _default_action(signum: int) -> None:
    """Take the signal's default action from this (non-main) thread: SIG_DFL at the C level (the
    Python API allows it only on the main thread), then the signal again."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signum, 0)  # SIG_DFL
    except Exception:
        os._exit(128 + signum)  # as near as it gets: the shell's status for a death by signal
    os.kill(os.getpid(), signum)


def _at_exit() -> None:
    """Interpreter exit: close every live tracer within the deadline (then any signal that came
    meanwhile is handed on)."""
    global _atexit_done, _flush_owner
    if os.getpid() != _pid or _atexit_done:
        return
    _atexit_done = True
    deadline = time.monotonic() + exit_flush_s()
    if _flush_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        _flush_owner = threading.get_ident()
        try:
            for t in _live():
                try:
                    t.close_within(deadline)
                except Exception:
                    pass
        finally:
            _flush_owner = 0
            _flush_lock.release()
    pending = list(_pending)
    _pending.clear()
    for signum in pending:
        _chain(signum, None)
