"""Where the collector's judgments go: /metrics, Alertmanager, a JSON webhook, OTLP (DESIGN §9).

    exports = build(args)        # from `tracetop collector --alertmanager/--webhook/--otlp`; raises
                                 # ExportConfigError (nothing started) on a bad URL or endpoint
    engine = LiveEngine(..., sinks=exports.sinks)          # AlertSink.publish(changed, firing)
    exports.attach_metrics(registry, engine.gauges, engine.alerts)
    exports.start_otlp(engine.gauges, engine.alerts)
    ...
    exports.close()              # bounded: a dead receiver never holds up shutdown

Every sink queues and sends on its own thread, so a dead or slow receiver never slows the engine
or ingest: calls beyond its bounded queue are dropped, counted on /metrics
(`tracetop_export_publishes_dropped_total{sink}`) and logged once.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Sequence

from collector.export._sender import QueuedSink
from collector.export.alertmanager import AlertmanagerSink
from collector.export.prometheus import AlertsFn, GaugesFn, LiveCollector, SinkStatsCollector
from collector.export.webhook import WebhookSink
from collector.live.model import Alert, RunGauges
from tracetop.errors import TracetopError


class ExportConfigError(TracetopError, ValueError):
    """A bad --alertmanager / --webhook / --otlp value; the message names the flag and the fix."""


def no_gauges() -> list[RunGauges]:
    return []


def no_alerts() -> list[Alert]:
    return []


def check_http_url(flag: str, url: str, example: str) -> str:
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ExportConfigError(f"{flag} {url!r} is not an http:// or https:// URL with a host; e.g. {flag} {example}")
    try:
        u.port  # noqa: B018  (raises on a bad port)
    except ValueError as e:
        raise ExportConfigError(f"{flag} {url!r}: {e}; e.g. {flag} {example}") from e
    return url


def check_otlp_endpoint(endpoint: str) -> tuple[str, bool]:
    """`HOST:PORT` (plaintext gRPC, as an OpenTelemetry Collector on 4317 usually is),
    `http://HOST:PORT` (plaintext) or `https://HOST:PORT` (TLS). Returns (endpoint, insecure)."""
    example = "127.0.0.1:4317 (or https://otel.example:4317 for TLS)"
    if "://" in endpoint:
        u = urllib.parse.urlsplit(endpoint)
        if u.scheme not in ("http", "https"):
            raise ExportConfigError(f"--otlp {endpoint!r}: the scheme must be http or https; e.g. --otlp {example}")
        hostport, insecure = u.netloc, u.scheme == "http"
        if u.path not in ("", "/"):
            raise ExportConfigError(f"--otlp {endpoint!r}: OTLP/gRPC takes no path; give HOST:PORT, e.g. --otlp {example}")
    else:
        hostport, insecure = endpoint, True
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ExportConfigError(f"--otlp {endpoint!r} is not HOST:PORT; e.g. --otlp {example}")
    from collector.export import otlp

    try:
        otlp.import_sdk()
    except otlp.OtlpUnavailable as e:
        raise ExportConfigError(str(e)) from e
    return hostport, insecure


class Exports:
    """The configured outputs. Sinks start their (idle) threads when made; OTLP when started."""

    def __init__(
        self,
        sinks: Sequence[QueuedSink] = (),
        *,
        otlp_endpoint: str | None = None,
        otlp_insecure: bool = True,
        otlp_interval_s: float = 10.0,
        otlp_timeout_s: float = 2.0,
    ) -> None:
        self.sinks: list[QueuedSink] = list(sinks)
        self.otlp_endpoint = otlp_endpoint
        self.otlp_insecure = otlp_insecure
        self.otlp_interval_s = otlp_interval_s
        self.otlp_timeout_s = otlp_timeout_s
        self.otlp = None
        self._attached = False

    def publish(self, changed: Sequence[Alert], firing: Sequence[Alert]) -> None:
        """Fan out to every sink (an AlertSink itself, for an engine that takes one)."""
        for s in self.sinks:
            s.publish(changed, firing)

    def stats(self) -> dict[str, dict[str, int]]:
        out = {s.kind: s.stats() for s in self.sinks}
        if self.otlp is not None:
            out["otlp"] = self.otlp.stats()
        return out

    def attach_metrics(self, registry, gauges_fn: GaugesFn = no_gauges, alerts_fn: AlertsFn = no_alerts) -> None:
        """Put the live figures and the exporters' own counts on `registry` (once)."""
        if self._attached:
            return
        self._attached = True
        registry.register(LiveCollector(gauges_fn, alerts_fn))
        registry.register(SinkStatsCollector(self.stats))

    def start_otlp(self, gauges_fn: GaugesFn = no_gauges, alerts_fn: AlertsFn = no_alerts) -> None:
        if self.otlp_endpoint is None or self.otlp is not None:
            return
        from collector.export.otlp import OtlpExporter

        self.otlp = OtlpExporter(self.otlp_endpoint, gauges_fn, alerts_fn, insecure=self.otlp_insecure,
                                 interval_s=self.otlp_interval_s, timeout_s=self.otlp_timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop every output at once, waiting at most ~timeout_s in all (a dead receiver's request is
        left to time out in its daemon thread)."""
        closers = [*self.sinks, *([self.otlp] if self.otlp is not None else [])]
        threads = [threading.Thread(target=c.close, args=(timeout_s * 0.75,), daemon=True) for c in closers]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


def build(args, *, environ=None) -> Exports:
    """Exports from parsed `tracetop collector` arguments (`alertmanager`, `webhook`, `otlp`,
    `otlp_interval_s`; missing attributes count as unset), each flag falling back to its
    TRACETOP_* variable. Validates everything before starting anything."""
    from tracetop import env

    from_env: dict[str, str] = {}

    def pick(attr: str, var: str) -> str | None:
        v = getattr(args, attr, None)
        if v is None:
            v = (environ.get(var) or None) if environ is not None else env.get(var)
            if v is not None:
                from_env[attr] = var
        return v

    am = pick("alertmanager", env.TRACETOP_ALERTMANAGER)
    hook = pick("webhook", env.TRACETOP_WEBHOOK)
    otlp_ep = pick("otlp", env.TRACETOP_OTLP)
    try:
        return _build(am, hook, otlp_ep, args)
    except ExportConfigError as e:
        flag = str(e).split(" ", 1)[0].lstrip("-").replace("-", "_")
        if flag in from_env:
            raise ExportConfigError(f"{e} (the value comes from ${from_env[flag]})") from None
        raise


def _build(am: str | None, hook: str | None, otlp_ep: str | None, args) -> Exports:
    interval_s = getattr(args, "otlp_interval_s", None)
    interval_s = 10.0 if interval_s is None else interval_s
    if am is not None:
        check_http_url("--alertmanager", am, "http://127.0.0.1:9093")
    if hook is not None:
        check_http_url("--webhook", hook, "https://hooks.example/tracetop")
    otlp_hostport, insecure = (None, True)
    if otlp_ep is not None:
        otlp_hostport, insecure = check_otlp_endpoint(otlp_ep)
    if not interval_s > 0:
        raise ExportConfigError(f"--otlp-interval-s {interval_s}: give a positive number of seconds, e.g. 10")
    sinks: list[QueuedSink] = []
    if am is not None:
        sinks.append(AlertmanagerSink(am))
    if hook is not None:
        sinks.append(WebhookSink(hook))
    return Exports(sinks, otlp_endpoint=otlp_hostport, otlp_insecure=insecure, otlp_interval_s=interval_s)


__all__ = ["AlertmanagerSink", "ExportConfigError", "Exports", "WebhookSink", "build"]
