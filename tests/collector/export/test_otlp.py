"""OTLP: an in-test OTLP/gRPC receiver (opentelemetry-proto's MetricsService) gets the gauges."""

from __future__ import annotations

import logging
import math
import time

from collector import app
from collector.export import build
from collector.export.otlp import OtlpExporter

from .records import gauges, pending_bubble, straggler
from .tools import Blackhole, OtlpReceiver, refused_port, wait_until


class _Args:
    alertmanager = webhook = None

    def __init__(self, otlp: str, interval_s: float) -> None:
        self.otlp = otlp
        self.otlp_interval_s = interval_s


def test_a_real_collector_exports_the_fed_gauges_and_alert_counts(tmp_path):
    rx = OtlpReceiver()
    g1 = gauges("run-7")
    g2 = gauges("run-8", step_ms_p50=float("nan"), mfu=0.41, bubble_by_stage={0: 0.05})
    alerts = [straggler(), straggler(rank=2), pending_bubble(), straggler(run_id="run-8")]
    r7, r8 = (("run_id", "run-7"),), (("run_id", "run-8"),)
    want = {
        ("tracetop.run.step", r7): (42, "{step}"),
        ("tracetop.run.ranks", r7): (4, "{rank}"),
        ("tracetop.run.step.duration.p50", r7): (g1.step_ms_p50 / 1000, "s"),
        ("tracetop.run.grad_sync.duration.p99", r7): (g1.grad_sync_ms_p99 / 1000, "s"),
        ("tracetop.run.communication.share", r7): (g1.comm_share, "1"),
        ("tracetop.run.scaling.efficiency", r7): (g1.scaling_efficiency, "1"),
        ("tracetop.run.tokens.rate", r7): (g1.tokens_per_s, "{token}/s"),
        ("tracetop.run.gpu.samples.rate", r7): (g1.samples_per_s_per_gpu, "{sample}/s"),
        ("tracetop.run.memory.budget.used.max", r7): (g1.memory_used_of_budget_max, "1"),
        ("tracetop.run.alerts.firing", r7): (g1.firing_alerts, "{alert}"),
        ("tracetop.run.live.steps_skipped", r7): (g1.steps_skipped, "{step}"),
        ("tracetop.run.pipeline.bubble", (("run_id", "run-7"), ("stage", "0"))): (0.12, "1"),
        ("tracetop.run.pipeline.bubble", (("run_id", "run-7"), ("stage", "1"))): (0.41, "1"),
        ("tracetop.run.pipeline.bubble", (("run_id", "run-8"), ("stage", "0"))): (0.05, "1"),
        ("tracetop.run.mfu", r8): (0.41, "1"),
        ("tracetop.alerts", (("run_id", "run-7"), ("severity", "critical"), ("state", "firing"))): (2, "{alert}"),
        ("tracetop.alerts", (("run_id", "run-7"), ("severity", "warning"), ("state", "pending"))): (1, "{alert}"),
        ("tracetop.alerts", (("run_id", "run-8"), ("severity", "critical"), ("state", "firing"))): (1, "{alert}"),
    }
    h = app.serve(app.CollectorConfig(str(tmp_path / "c.duckdb")), exports=build(_Args(rx.addr, 0.2)),
                  gauges_fn=lambda: [g1, g2], alerts_fn=lambda: alerts)
    try:
        wait_until(lambda: want.keys() <= rx.points().keys(), 30, "an export with every fed gauge")
        pts = rx.points()
    finally:
        h.stop()
        rx.close()
    for key, (value, unit) in want.items():
        assert key in pts, f"{key} not exported; got {sorted(pts)}"
        got, got_unit = pts[key]
        assert math.isclose(got, value, rel_tol=1e-12), (key, got, value)
        assert got_unit == unit, (key, got_unit)
    # NaN = unknown: not exported
    assert ("tracetop.run.step.duration.p50", r8) not in pts
    assert ("tracetop.run.mfu", r7) not in pts
    assert {"service.name": "tracetop-collector"}.items() <= rx.resources()[0].items()


def test_close_is_bounded_against_an_endpoint_that_never_answers():
    """The receiver accepts the TCP connection and never speaks: each export would wait for its
    whole timeout (here 30 s). close() still returns well before that."""
    hole = Blackhole()
    ex = OtlpExporter(hole.addr, lambda: [gauges()], lambda: [straggler()], interval_s=0.1, timeout_s=30)
    try:
        wait_until(lambda: ex.stats()["requests"] >= 1, 20, "an export attempt")
        t0 = time.monotonic()
        ex.close()
        took = time.monotonic() - t0
        assert took < 30 / 2, f"close took {took:.1f} s against a 30 s export timeout"
    finally:
        hole.close()


def test_a_refused_endpoint_is_counted_and_logged_once(caplog):
    addr = f"127.0.0.1:{refused_port()}"
    ex = OtlpExporter(addr, lambda: [gauges()], lambda: [], interval_s=0.05, timeout_s=0.5)
    try:
        wait_until(lambda: ex.stats()["failures"] >= 3, 30, "three failed exports")
    finally:
        ex.close()
    # this exporter's lines only: an earlier test's exporter thread may still log its own endpoint
    lines = [r for r in caplog.records if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING
             and addr in r.getMessage()]
    assert len(lines) <= 1, [r.getMessage() for r in lines]
