"""The collector's per-run gauges and alert counts, exported over OTLP/gRPC (`--otlp ENDPOINT`).

opentelemetry-sdk's own split (STYLE: what and when apart from where): observable instruments
whose callbacks read the live engine's records (`gauges_fn`, `alerts_fn`) at each collection; a
PeriodicExportingMetricReader (when: every `interval_s`) and an OTLPMetricExporter (where) on the
reader's own thread. Needs the `otlp` extra (`pip install 'tracetop[otlp]'`; `make setup` has it).

A dead endpoint never slows ingest or shutdown:
- recording is a callback at collection time on the reader's thread: nothing on the ingest path;
- the exporter's timeout is short (`timeout_s`, default 2 s). With the default (10 s) the SDK's
  shutdown blocked 11-14 s against a dead endpoint; with 2 s, ~1 s (measured,
  ../shared/notes/stack-measurements.md "Exporters");
- `close` runs the SDK's shutdown in a daemon thread and waits at most `close_timeout_s`.
The exporter's own log lines about a dead endpoint (one per retry) are cut to the first one until
an export succeeds again; failures are counted (`tracetop_export_request_failures_total{sink="otlp"}`).

Instruments (OTel names, units in `unit`), attribute run_id (and stage, severity):
    tracetop.run.step, tracetop.run.ranks, tracetop.run.step.duration.p50 (s),
    tracetop.run.grad_sync.duration.p99 (s), tracetop.run.communication.share (1),
    tracetop.run.scaling.efficiency (1), tracetop.run.tokens.rate ({token}/s),
    tracetop.run.gpu.samples.rate ({sample}/s), tracetop.run.mfu (1),
    tracetop.run.pipeline.bubble (1, by stage), tracetop.run.memory.budget.used.max (1),
    tracetop.run.alerts.firing, tracetop.run.live.steps_skipped (counter),
    tracetop.run.live.steps_incomplete (counter: steps judged without every rank's STEP row),
    tracetop.run.live.last_incomplete_step (the latest of them; absent while none),
    tracetop.alerts (alerts pending or firing, by run_id, severity, state)
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from collector.live.model import FIRING, PENDING, Alert, RunGauges
from tracetop.errors import TracetopError

log = logging.getLogger("tracetop.export")

DEFAULT_INTERVAL_S = 10.0
DEFAULT_TIMEOUT_S = 2.0
CLOSE_TIMEOUT_S = 1.5
_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"

# (instrument name, unit, description, RunGauges field, scale)
RUN_GAUGES: tuple[tuple[str, str, str, str, float], ...] = (
    ("tracetop.run.step", "{step}", "Latest completed step", "step", 1.0),
    ("tracetop.run.ranks", "{rank}", "Ranks in the run", "ranks", 1.0),
    ("tracetop.run.step.duration.p50", "s", "Median step time across ranks", "step_ms_p50", 1e-3),
    ("tracetop.run.grad_sync.duration.p99", "s", "Gradient-sync time per step, p99 across ranks",
     "grad_sync_ms_p99", 1e-3),
    ("tracetop.run.communication.share", "1", "Exposed communication over step time", "comm_share", 1.0),
    ("tracetop.run.scaling.efficiency", "1", "Scaling efficiency (against the baseline where set)",
     "scaling_efficiency", 1.0),
    ("tracetop.run.tokens.rate", "{token}/s", "Tokens per second, the whole run", "tokens_per_s", 1.0),
    ("tracetop.run.gpu.samples.rate", "{sample}/s", "Samples per second per GPU", "samples_per_s_per_gpu", 1.0),
    ("tracetop.run.mfu", "1", "Model FLOPs utilisation", "mfu", 1.0),
    ("tracetop.run.memory.budget.used.max", "1", "Largest memory used over budget across ranks",
     "memory_used_of_budget_max", 1.0),
    ("tracetop.run.alerts.firing", "{alert}", "Alerts firing now for the run", "firing_alerts", 1.0),
)


class OtlpUnavailable(TracetopError, RuntimeError):
    """The `otlp` extra is not installed."""


def import_sdk():
    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import MetricExportResult, PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
    except ImportError as e:
        raise OtlpUnavailable(
            f"--otlp needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-grpc ({e}); "
            "install them with: pip install 'tracetop[otlp]' (make setup does)"
        ) from e
    return OTLPMetricExporter, MeterProvider, MetricExportResult, PeriodicExportingMetricReader, Resource


def available() -> bool:
    try:
        import_sdk()
    except OtlpUnavailable:
        return False
    return True


class _QuietAfterFirst(logging.Filter):
    """Lets the exporter's first warning through, then none until an export succeeds again."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet = False
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if self.quiet:
            self.suppressed += 1
            return False
        self.quiet = True
        return True


_filter = _QuietAfterFirst()


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


class _Snapshot:
    """One read of the engine's records per collection, shared by every instrument's callback."""

    def __init__(self, gauges_fn, alerts_fn, ttl_s: float, clock_s=time.monotonic) -> None:
        self.gauges_fn, self.alerts_fn, self.ttl_s, self.clock_s = gauges_fn, alerts_fn, ttl_s, clock_s
        self._at = -math.inf
        self._gauges: list[RunGauges] = []
        self._alerts: list[Alert] = []
        self._lock = threading.Lock()
        self._logged = False

    def get(self) -> tuple[list[RunGauges], list[Alert]]:
        with self._lock:
            now = self.clock_s()
            if now - self._at >= self.ttl_s:
                self._at = now
                try:
                    self._gauges, self._alerts = list(self.gauges_fn()), list(self.alerts_fn())
                except Exception:
                    self._gauges, self._alerts = [], []
                    if not self._logged:
                        self._logged = True
                        log.exception("otlp: reading the live engine's records failed (logged once)")
            return self._gauges, self._alerts


class OtlpExporter:
    """Starts exporting at construction; `close()` stops, bounded. Fails fast (OtlpUnavailable) only
    at construction; at run time nothing it does raises into the collector."""

    kind = "otlp"

    def __init__(
        self,
        endpoint: str,
        gauges_fn: Callable[[], Sequence[RunGauges]],
        alerts_fn: Callable[[], Sequence[Alert]],
        *,
        insecure: bool = True,
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        service_name: str = "tracetop-collector",
    ) -> None:
        OTLPMetricExporter, MeterProvider, MetricExportResult, Reader, Resource = import_sdk()
        self.endpoint = endpoint
        self.requests = 0
        self.failures = 0
        logging.getLogger(_EXPORTER_LOGGER).addFilter(_filter)  # once: a Filter is added once per logger
        _filter.quiet = False  # this exporter's first complaint is shown
        outer = self

        class _CountingExporter(OTLPMetricExporter):
            def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
                outer.requests += 1
                result = super().export(metrics_data, timeout_millis=timeout_millis, **kwargs)
                if result == MetricExportResult.SUCCESS:
                    if _filter.quiet:
                        log.warning("otlp %s: exporting again", endpoint)
                    _filter.quiet = False
                else:
                    outer.failures += 1
                return result

        exporter = _CountingExporter(endpoint=endpoint, insecure=insecure, timeout=timeout_s)
        reader = Reader(exporter, export_interval_millis=interval_s * 1000, export_timeout_millis=timeout_s * 1000)
        self._provider = MeterProvider(
            metric_readers=[reader], resource=Resource.create({"service.name": service_name})
        )
        self._snap = _Snapshot(gauges_fn, alerts_fn, ttl_s=min(1.0, interval_s / 2))
        self._instruments(self._provider.get_meter("tracetop.collector"))

    def _instruments(self, meter) -> None:
        from opentelemetry.metrics import Observation

        snap = self._snap

        def run_gauge(attr: str, scale: float):
            def cb(_options):
                return [Observation(float(getattr(g, attr)) * scale, {"run_id": g.run_id})
                        for g in snap.get()[0] if _finite(getattr(g, attr))]
            return cb

        for name, unit, desc, attr, scale in RUN_GAUGES:
            meter.create_observable_gauge(name, callbacks=[run_gauge(attr, scale)], unit=unit, description=desc)

        def bubble(_options):
            return [Observation(float(v), {"run_id": g.run_id, "stage": str(stage)})
                    for g in snap.get()[0] for stage, v in sorted(g.bubble_by_stage.items()) if _finite(v)]

        def skipped(_options):
            return [Observation(int(g.steps_skipped), {"run_id": g.run_id}) for g in snap.get()[0]]

        def incomplete(_options):
            return [Observation(int(g.steps_incomplete), {"run_id": g.run_id}) for g in snap.get()[0]]

        def last_incomplete(_options):
            return [Observation(int(g.last_incomplete_step), {"run_id": g.run_id}) for g in snap.get()[0]
                    if g.last_incomplete_step >= 0]

        def alerts(_options):
            counts = Counter((a.run_id, a.severity, a.state) for a in snap.get()[1] if a.state in (PENDING, FIRING))
            return [Observation(n, {"run_id": r, "severity": s, "state": st}) for (r, s, st), n in sorted(counts.items())]

        def lost(attr: str):
            def cb(_options):
                return [Observation(float(v), {"run_id": g.run_id, "cause": c})
                        for g in snap.get()[0] for c, v in sorted(getattr(g, attr).items()) if _finite(v)]
            return cb

        meter.create_observable_counter("tracetop.run.lost.gpu_time", callbacks=[lost("lost_gpu_s")], unit="s",
                                        description="GPU time lost by cause over the steps judged (lost_time's definition)")
        meter.create_observable_gauge("tracetop.run.lost.recent.gpu_time", callbacks=[lost("lost_window_gpu_s")],
                                      unit="s", description="GPU time lost by cause over the last window of step time")
        meter.create_observable_gauge("tracetop.run.pipeline.bubble", callbacks=[bubble], unit="1",
                                      description="Pipeline bubble per stage")
        meter.create_observable_counter("tracetop.run.live.steps_skipped", callbacks=[skipped], unit="{step}",
                                        description="Steps the live state skipped to keep up")
        meter.create_observable_counter("tracetop.run.live.steps_incomplete", callbacks=[incomplete], unit="{step}",
                                        description="Steps judged without every rank's STEP row")
        meter.create_observable_gauge("tracetop.run.live.last_incomplete_step", callbacks=[last_incomplete],
                                      unit="{step}", description="The latest step judged without every rank")
        meter.create_observable_gauge("tracetop.alerts", callbacks=[alerts], unit="{alert}",
                                      description="Alerts pending or firing, by run, severity and state")

    def stats(self) -> dict[str, int]:
        return {"requests": self.requests, "failures": self.failures}

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Flush once more and stop, in a daemon thread; wait at most timeout_s for it."""
        def shutdown() -> None:
            try:
                self._provider.shutdown(timeout_millis=timeout_s * 1000)
            except Exception:
                log.debug("otlp: shutdown failed", exc_info=True)

        t = threading.Thread(target=shutdown, name="tracetop-otlp-shutdown", daemon=True)
        t.start()
        t.join(timeout_s)
