"""An AlertSink that POSTs plain JSON to any URL (chat bridges, paging tools, scripts).

One request per publish call in which an alert started firing or resolved (value-only updates of a
firing alert are not news):

    {"source": "tracetop", "version": 1, "sent_ns": 1764582000123456789,
     "alerts": [{"state": "firing" | "resolved", "rule", "signal", "severity", "run_id", "scope",
                 "labels": {...}, "first_step", "last_step", "first_ns", "last_ns",
                 "value", "threshold", "message"}, ...],
     "firing": 3}                       # how many alerts fired right after these changes

NaN values are sent as null. A payload that cannot be delivered is retried every `retry_s`, oldest
first, from a bounded backlog (`MAX_BACKLOG` payloads; beyond it the oldest is dropped and counted).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from collector.export._sender import AlertTracker, QueuedSink, alert_dict
from collector.live.model import Alert

VERSION = 1
MAX_BACKLOG = 256


def payload(alerts: Sequence[Alert], firing_now: int, sent_ns: int) -> dict:
    return {"source": "tracetop", "version": VERSION, "sent_ns": sent_ns,
            "alerts": [alert_dict(a) for a in alerts], "firing": firing_now}


class WebhookSink(QueuedSink):
    kind = "webhook"

    def __init__(self, url: str, *, retry_s: float = 5.0, **kwargs) -> None:
        self.retry_s = retry_s
        self._tracker = AlertTracker()
        self._backlog: deque[tuple[list[Alert], int]] = deque()  # (news, alerts firing after them)
        self._retry_at_s = 0.0
        self.payloads_dropped = 0
        super().__init__(url, **kwargs)

    def _on_publish(self, changed: Sequence[Alert], firing: Sequence[Alert], now_s: float) -> None:
        t = self._tracker.update(changed, firing, self._wall_ns())
        news = t.fired + t.resolved
        if news:
            self._backlog.append((news, len(self._tracker.firing)))
            while len(self._backlog) > MAX_BACKLOG:
                self._backlog.popleft()
                self.payloads_dropped += 1

    def _next_due_s(self, now_s: float) -> float:
        return (self._retry_at_s - now_s) if self._backlog else math.inf

    def _on_tick(self, now_s: float) -> None:
        if now_s < self._retry_at_s:
            return
        while self._backlog and not self._stop.is_set():
            alerts, firing_now = self._backlog[0]
            if not self._post(self.url, payload(alerts, firing_now, self._wall_ns())):
                self._retry_at_s = self._clock_s() + self.retry_s
                return
            self._backlog.popleft()

    def _on_close(self, now_s: float) -> None:
        self._retry_at_s = now_s
        self._on_tick(now_s)

    def stats(self) -> dict[str, int]:
        s = super().stats()
        s["backlog"] = len(self._backlog)
        s["payloads_dropped"] = self.payloads_dropped
        return s
