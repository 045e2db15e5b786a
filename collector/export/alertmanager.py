"""An AlertSink that pushes to an Alertmanager's v2 API (`POST /api/v2/alerts`), as Prometheus does.

- A firing alert is posted when it starts firing, then re-sent every `resend_s` (default 60 s) while
  it fires, each time with `endsAt` = now + `expire_s` (default 4 × resend_s, as Prometheus does). So
  Alertmanager keeps it active while we keep sending, and lets it lapse by itself if this collector
  dies; the re-send period stays well inside Alertmanager's `resolve_timeout` (5 m by default).
- On resolve it is posted once more with `endsAt` = the time it resolved (Alertmanager then drops it
  from `GET /api/v2/alerts` at once and tells receivers with `send_resolved` "resolved").
- Labels: alertname (= the rule), run_id, severity, scope, kind (fault | sla | hardware), and where
  the alert belongs to an incident `incident` (the cause alert's id, on the cause and on each of its
  consequences) and `incident_role` (cause | consequence); then the alert's own labels (scope labels
  such as rank or stage, plus the rule's). Annotations: summary and description (= the message),
  value, threshold, signal, first_step, last_step. Route with `group_by: [run_id, incident]` so a
  cause and its consequences make one notification, and inhibit the consequences while the cause
  fires (docs/alerts.md has the inhibit_rules):

      inhibit_rules:
        - source_matchers: [incident_role="cause"]
          target_matchers: [incident_role="consequence"]
          equal: [incident]
- An SLA breach that fired before its cause and was attached to it later gets its new labels: the
  old label set is posted resolved (Alertmanager's identity is the label set) and the new one firing.
- Deliveries that fail (receiver down, HTTP error, timeout) are retried every `retry_s` until they
  go through; resolutions wait for it, bounded (`MAX_UNSENT_RESOLVED`, oldest dropped and counted).

Pending alerts are not sent (Prometheus does not send them either).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence

from collector.export._sender import AlertTracker, QueuedSink
from collector.live.model import Alert

API_PATH = "/api/v2/alerts"
DEFAULT_RESEND_S = 60.0
#: Resolutions that could not be delivered yet, kept for retry; beyond it the oldest are dropped.
MAX_UNSENT_RESOLVED = 10_000
#: Alerts per POST (Alertmanager takes a JSON array; keep each request small).
MAX_ALERTS_PER_POST = 500

_LABEL_OK = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED = ("alertname", "run_id", "severity", "scope", "kind", "incident", "incident_role")


def api_url(base: str) -> str:
    """The alerts endpoint for a base URL (`http://am:9093` or `http://am:9093/prefix`)."""
    base = base.rstrip("/")
    return base if base.endswith(API_PATH) else base + API_PATH


def label_name(name: str) -> str:
    """Alertmanager 0.25 takes label names matching [A-Za-z_][A-Za-z0-9_]*; make any name fit."""
    if _LABEL_OK.match(name):
        return name
    fixed = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return fixed if _LABEL_OK.match(fixed) else "_" + fixed


def rfc3339(ns: int) -> str:
    s, frac = divmod(int(ns), 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s)) + f".{frac:09d}Z"


def _num(x: float) -> str:
    return f"{x:.6g}" if math.isfinite(x) else "NaN"


def am_labels(a: Alert) -> dict[str, str]:
    out = {"alertname": a.rule, "run_id": a.run_id, "severity": a.severity, "scope": a.scope, "kind": a.kind}
    if a.incident_id:
        out["incident"] = a.incident_id
        out["incident_role"] = a.role
    for k, v in a.labels.items():
        name = label_name(str(k))
        if name in RESERVED:
            name = "exported_" + name
        if str(v) != "":
            out[name] = str(v)
    return out


def am_alert(a: Alert, ends_ns: int) -> dict:
    """One element of the POST body."""
    return {
        "labels": am_labels(a),
        "annotations": {
            "summary": a.message,
            "description": a.message,
            "value": _num(a.value),
            "threshold": _num(a.threshold),
            "signal": a.signal,
            "first_step": str(a.first_step),
            "last_step": str(a.last_step),
        },
        "startsAt": rfc3339(a.first_ns),
        "endsAt": rfc3339(ends_ns),
    }


def _resolved_now(a: Alert, now_ns: int) -> Alert:
    from dataclasses import replace

    from collector.live.model import RESOLVED

    return replace(a, state=RESOLVED, last_ns=now_ns)


class AlertmanagerSink(QueuedSink):
    kind = "alertmanager"

    def __init__(
        self,
        url: str,
        *,
        resend_s: float = DEFAULT_RESEND_S,
        expire_s: float | None = None,
        retry_s: float | None = None,
        **kwargs,
    ) -> None:
        self.resend_s = resend_s
        self.expire_s = expire_s if expire_s is not None else 4 * resend_s
        self.retry_s = retry_s if retry_s is not None else min(5.0, resend_s)
        self._tracker = AlertTracker()
        self._unsent_fired: set[tuple] = set()
        self._unsent_resolved: dict[tuple, Alert] = {}
        self._next_resend_s = 0.0
        self._retry_at_s = 0.0
        self.resolutions_dropped = 0
        super().__init__(api_url(url), **kwargs)

    def _on_publish(self, changed: Sequence[Alert], firing: Sequence[Alert], now_s: float) -> None:
        t = self._tracker.update(changed, firing, self._wall_ns())
        for a in t.fired:
            self._unsent_fired.add(a.key)
            self._unsent_resolved.pop(a.key, None)  # fired again before its resolution went out
        for a in t.resolved:
            self._unsent_fired.discard(a.key)
            self._unsent_resolved[a.key] = a
        for old, a in t.attached:  # new labels: the old set resolves, the new one fires
            self._unsent_resolved[(a.key, old.incident_id)] = _resolved_now(old, self._wall_ns())
            self._unsent_fired.add(a.key)
        while len(self._unsent_resolved) > MAX_UNSENT_RESOLVED:
            self._unsent_resolved.pop(next(iter(self._unsent_resolved)))
            self.resolutions_dropped += 1

    def _next_due_s(self, now_s: float) -> float:
        due = self._next_resend_s if self._tracker.firing else math.inf
        if self._unsent_fired or self._unsent_resolved:
            due = min(due, self._retry_at_s)
        return due - now_s

    def _on_tick(self, now_s: float) -> None:
        resend = bool(self._tracker.firing) and now_s >= self._next_resend_s
        urgent = (self._unsent_fired or self._unsent_resolved) and now_s >= self._retry_at_s
        if not (resend or urgent):
            return
        now_ns = self._wall_ns()
        ends_firing = now_ns + int(self.expire_s * 1e9)
        if resend:
            firing = list(self._tracker.firing.values())
        else:
            firing = [self._tracker.firing[k] for k in self._unsent_fired if k in self._tracker.firing]
        body = [am_alert(a, ends_firing) for a in firing]
        # endsAt of a resolution: when it resolved, never later than now (else it would stay active)
        body += [am_alert(a, min(a.last_ns, now_ns) or now_ns) for a in self._unsent_resolved.values()]
        ok = all(self._post(self.url, body[i : i + MAX_ALERTS_PER_POST])
                 for i in range(0, len(body), MAX_ALERTS_PER_POST))
        if ok:
            self._unsent_fired.clear()
            self._unsent_resolved.clear()
            if resend:
                self._next_resend_s = now_s + self.resend_s
        else:
            self._retry_at_s = self._clock_s() + self.retry_s
            if resend:
                self._next_resend_s = now_s + self.retry_s

    def _on_close(self, now_s: float) -> None:
        if self._unsent_fired or self._unsent_resolved:
            self._retry_at_s = now_s
            self._next_resend_s = math.inf  # only what is unsent; the rest lapses at its endsAt
            self._on_tick(now_s)

    def stats(self) -> dict[str, int]:
        s = super().stats()
        s["firing"] = len(self._tracker.firing)
        s["resolutions_dropped"] = self.resolutions_dropped
        return s
