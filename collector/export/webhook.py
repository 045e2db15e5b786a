"""An AlertSink that POSTs plain JSON to any URL (chat bridges, paging tools, scripts).

One request per publish call in which an alert started firing or resolved (value-only updates of a
firing alert are not news):

    {"source": "tracetop", "version": 1, "sent_ns": 1764582000123456789,
     "alerts": [{"state": "firing" | "resolved", "rule", "signal", "severity", "run_id", "scope",
                 "labels": {...}, "first_step", "last_step", "first_ns", "last_ns",
                 "value", "threshold", "message",
                 "kind": "fault" | "sla" | "hardware",
                 "incident_id": "straggler|run|rank=3|20" | "",   # the cause alert's id
                 "role": "cause" | "consequence" | ""}, ...],
     "incidents": [{"incident_id", "rule", "cause", "culprit", "run_id", "state",
                    "consequences": ["grad_sync", ...]}, ...],  # the incidents these alerts belong to
     "page": true,                      # false when every alert here is a consequence of an incident
     "firing": 3}                       # how many alerts fired right after these changes

Incidents: a consequence (an SLA breach or a waiter that a fault explains) is sent with its
incident, but a payload whose alerts are all consequences has "page": false: a paging bridge pages
on "page" and so pages once per incident (its cause), not once per alert. An SLA breach attached
to its cause after it fired is sent again, firing, with its incident (news: the attachment).

NaN values are sent as null. A payload that cannot be delivered is retried every `retry_s`, oldest
first, from a bounded backlog (`MAX_BACKLOG` payloads; beyond it the oldest is dropped and counted).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from collector.export._sender import AlertTracker, QueuedSink, alert_dict
from collector.live.model import Alert, cause_text, culprit_text

VERSION = 1
MAX_BACKLOG = 256


def payload(alerts: Sequence[Alert], firing_now: int, sent_ns: int,
            known: Sequence[Alert] = ()) -> dict:
    """The POST body; `known` are the alerts the sink knows besides these (to describe incidents)."""
    pool = {a.id: a for a in known}
    pool.update({a.id: a for a in alerts})
    incidents = []
    for iid in dict.fromkeys(a.incident_id for a in alerts if a.incident_id):
        cause = pool.get(iid)
        cons = sorted({a.rule for a in pool.values() if a.incident_id == iid and a.id != iid})
        incidents.append({"incident_id": iid, "rule": cause.rule if cause else iid.split("|")[0],
                          "cause": cause_text(cause) if cause else "", "culprit": culprit_text(cause) if cause else "",
                          "run_id": cause.run_id if cause else "", "state": cause.state if cause else "",
                          "consequences": cons})
    return {"source": "tracetop", "version": VERSION, "sent_ns": sent_ns,
            "alerts": [alert_dict(a) for a in alerts], "incidents": incidents,
            "page": any(not a.is_consequence for a in alerts), "firing": firing_now}


class WebhookSink(QueuedSink):
    kind = "webhook"

    def __init__(self, url: str, *, retry_s: float = 5.0, **kwargs) -> None:
        self.retry_s = retry_s
        self._tracker = AlertTracker()
        # (news, how many alerts fired after them, those alerts)
        self._backlog: deque[tuple[list[Alert], int, list[Alert]]] = deque()
        self._retry_at_s = 0.0
        self.payloads_dropped = 0
        super().__init__(url, **kwargs)

    def _on_publish(self, changed: Sequence[Alert], firing: Sequence[Alert], now_s: float) -> None:
        t = self._tracker.update(changed, firing, self._wall_ns())
        news = t.fired + t.resolved + [a for _, a in t.attached]
        if news:
            self._backlog.append((news, len(self._tracker.firing), list(self._tracker.firing.values())))
            while len(self._backlog) > MAX_BACKLOG:
                self._backlog.popleft()
                self.payloads_dropped += 1

    def _next_due_s(self, now_s: float) -> float:
        return (self._retry_at_s - now_s) if self._backlog else math.inf

    def _on_tick(self, now_s: float) -> None:
        if now_s < self._retry_at_s:
            return
        while self._backlog and not self._stop.is_set():
            alerts, firing_now, known = self._backlog[0]
            if not self._post(self.url, payload(alerts, firing_now, self._wall_ns(), known)):
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
