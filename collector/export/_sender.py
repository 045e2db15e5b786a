"""The shell every pushing sink shares: a bounded queue, one daemon thread, HTTP with short timeouts.

The engine's thread calls `publish`; it only puts the call on a bounded queue (never waits). When
the queue is full the call is dropped and counted (`dropped`), logged once; the sinks are built so
that a dropped call heals itself (the next call carries every alert firing now, see AlertTracker).
The sink's own thread does the I/O. `close` waits a bounded time and leaves a thread stuck in a
dead receiver's TCP timeout behind (a daemon): shutdown never waits for a receiver.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from collector.live.model import FIRING, RESOLVED, Alert
from tracetop.errors import TracetopError

log = logging.getLogger("tracetop.export")

#: A publish call waits on no lock but this queue's; beyond this many calls the newest are dropped.
#: Each call holds its firing tuple (references): 256 calls x 10k firing alerts ~ 20 MB at worst.
QUEUE_CALLS = 256
#: Seconds an HTTP request may take (connect + answer). Short: a receiver that slow is as good as dead.
HTTP_TIMEOUT_S = 2.0
#: Seconds `close` waits for a sink's thread (then leaves it behind; it is a daemon).
CLOSE_TIMEOUT_S = 1.0


class SendError(TracetopError):
    """A receiver refused, failed or did not answer in time; the message says which and where."""


def post_json(url: str, payload: object, timeout_s: float = HTTP_TIMEOUT_S) -> int:
    """POST `payload` as JSON; returns the HTTP status (2xx). Raises SendError for anything else."""
    body = json.dumps(payload, allow_nan=False).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace").strip()
        raise SendError(f"POST {url}: HTTP {e.code} {detail}") from e
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise SendError(f"POST {url}: {reason}") from e


def finite_or_none(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def alert_dict(a: Alert) -> dict:
    """An Alert as plain JSON (NaN becomes null)."""
    return {
        "rule": a.rule,
        "signal": a.signal,
        "severity": a.severity,
        "state": a.state,
        "run_id": a.run_id,
        "scope": a.scope,
        "labels": dict(a.labels),
        "first_step": a.first_step,
        "last_step": a.last_step,
        "first_ns": a.first_ns,
        "last_ns": a.last_ns,
        "value": finite_or_none(a.value),
        "threshold": finite_or_none(a.threshold),
        "message": a.message,
        "kind": a.kind,                  # fault | sla | hardware
        "incident_id": a.incident_id,    # the cause alert's id ("" for a standalone SLA breach)
        "role": a.role,                  # cause | consequence | ""
    }


@dataclass
class Transitions:
    fired: list[Alert] = field(default_factory=list)     # firing now, not firing at the previous call
    resolved: list[Alert] = field(default_factory=list)  # firing at the previous call, not now
    # firing at both calls, but attached to an incident since (an SLA breach that fired before its
    # cause): (the record as last seen, the record now)
    attached: list[tuple[Alert, Alert]] = field(default_factory=list)


class AlertTracker:
    """Pure: which alerts started or stopped firing between two publish calls.

    Membership comes from `firing` (every alert firing now), so a call that was dropped on a full
    queue costs nothing lasting: the next call's set says it all. The record for a resolved alert
    is its RESOLVED record from `changed` when there is one, else the last firing record seen,
    marked resolved at `now_ns`. Pending alerts are nobody's business outside the collector."""

    def __init__(self) -> None:
        self.firing: dict[tuple, Alert] = {}

    def update(self, changed: Sequence[Alert], firing: Sequence[Alert], now_ns: int) -> Transitions:
        now = {a.key: a for a in firing if a.state == FIRING}
        resolved_records = {a.key: a for a in changed if a.state == RESOLVED}
        t = Transitions()
        for key, a in now.items():
            old = self.firing.get(key)
            if old is None:
                t.fired.append(a)
            elif old.incident_id != a.incident_id:
                t.attached.append((old, a))
        for key, old in self.firing.items():
            if key not in now:
                rec = resolved_records.get(key)
                if rec is None:
                    rec = _resolved_copy(old, now_ns)
                t.resolved.append(rec)
        self.firing = now
        return t


def _resolved_copy(a: Alert, now_ns: int) -> Alert:
    from dataclasses import replace

    return replace(a, state=RESOLVED, last_ns=max(a.last_ns, now_ns))


_STOP = object()


class QueuedSink:
    """Base of the pushing sinks: `publish` enqueues, the thread calls `_on_publish` and `_on_tick`.

    Subclasses implement `_on_publish(changed, firing, now_s)`, `_on_tick(now_s)` and
    `_on_close(now_s)` and return from `_next_due_s(now_s)` how long the thread may sleep. Their I/O goes through `_post`, which
    counts requests and failures and logs the first failure (and the first success after one)."""

    kind = "sink"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = HTTP_TIMEOUT_S,
        queue_calls: int = QUEUE_CALLS,
        post: Callable[[str, object, float], int] = post_json,
        clock_s: Callable[[], float] = time.monotonic,
        wall_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._post_fn = post
        self._clock_s = clock_s
        self._wall_ns = wall_ns
        self._q: queue.Queue = queue.Queue(maxsize=queue_calls)
        self._stop = threading.Event()
        self._closed = False
        self.requests = 0
        self.failures = 0
        self.dropped = 0
        self.errors = 0
        self._failing = False
        self._drop_logged = False
        self._error_logged = False
        self._thread = threading.Thread(target=self._run, name=f"tracetop-export-{self.kind}", daemon=True)
        self._thread.start()

    # ---- the engine's side -----------------------------------------------------------------
    def publish(self, changed: Sequence[Alert], firing: Sequence[Alert]) -> None:
        """Never blocks, never raises."""
        try:
            if self._closed:
                return
            self._q.put_nowait((tuple(changed), tuple(firing)))
        except queue.Full:
            self.dropped += 1
            if not self._drop_logged:
                self._drop_logged = True
                log.warning(
                    "%s %s: its queue of %d publish calls is full (the receiver is slow or dead); dropping "
                    "calls, counted in tracetop_export_publishes_dropped_total{sink=%r}; firing alerts are "
                    "re-sent from the next call that fits",
                    self.kind, self.url, self._q.maxsize, self.kind,
                )
        except Exception:  # never into the engine
            self.errors += 1

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Take what was published so far, try once more to deliver what is unsent, and stop; wait
        at most timeout_s (a thread stuck in a dead receiver's timeout is left behind)."""
        self._closed = True
        try:
            self._q.put_nowait(_STOP)
        except queue.Full:
            self._stop.set()  # no room for the marker: stop after the current item
        self._thread.join(timeout_s)
        self._stop.set()

    def stats(self) -> dict[str, int]:
        return {"requests": self.requests, "failures": self.failures, "dropped": self.dropped,
                "errors": self.errors}

    # ---- the sink's thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            wait_s = max(0.0, min(self._next_due_s(self._clock_s()), 1.0))
            try:
                items = [self._q.get(timeout=wait_s) if wait_s > 0 else self._q.get_nowait()]
            except queue.Empty:
                items = []
            # take everything queued meanwhile: a slow receiver gets one request for many calls
            while items and items[-1] is not _STOP and len(items) < self._q.maxsize:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stopping = bool(items) and items[-1] is _STOP
            try:
                for item in items:
                    if item is not _STOP:
                        self._on_publish(item[0], item[1], self._clock_s())
                    if self._stop.is_set():
                        return
                if stopping:
                    self._on_close(self._clock_s())
                    return
                self._on_tick(self._clock_s())
            except Exception:
                self.errors += 1
                if not self._error_logged:
                    self._error_logged = True
                    log.exception("%s %s: failed to handle alerts (logged once)", self.kind, self.url)
                if stopping:
                    return

    def _post(self, url: str, payload: object) -> bool:
        self.requests += 1
        try:
            self._post_fn(url, payload, self.timeout_s)
        except SendError as e:
            self.failures += 1
            if not self._failing:
                self._failing = True
                log.warning("%s: %s; retrying quietly, counted in tracetop_export_request_failures_total", self.kind, e)
            return False
        if self._failing:
            self._failing = False
            log.warning("%s %s: delivering again", self.kind, url)
        return True

    def _on_publish(self, changed: Sequence[Alert], firing: Sequence[Alert], now_s: float) -> None:
        raise NotImplementedError

    def _on_tick(self, now_s: float) -> None:
        raise NotImplementedError

    def _next_due_s(self, now_s: float) -> float:
        raise NotImplementedError

    def _on_close(self, now_s: float) -> None:
        """One last attempt at what is still unsent (bounded by close's wait)."""


def labels_of(labels: Mapping[str, str]) -> dict[str, str]:
    return {str(k): str(v) for k, v in labels.items()}
