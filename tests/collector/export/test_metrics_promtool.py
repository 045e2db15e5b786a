"""/metrics: the live figures as metric families, and `promtool check metrics` (Debian's prometheus
2.42) on what real collectors serve."""

from __future__ import annotations

import math
import urllib.request

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collector import app
from collector.export import Exports, build
from collector.export.alertmanager import AlertmanagerSink
from collector.export.webhook import WebhookSink
from collector.ingest.metrics import CollectorMetrics
from tests.collector.util import Feeder, batch
from tests.support.services import scrape_metrics, start_collector

from .records import gauges, pending_bubble, resolved, straggler
from .tools import promtool_check, refused_port, wait_until


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def live_registry(g, a) -> CollectorRegistry:
    reg = CollectorRegistry()
    Exports().attach_metrics(reg, lambda: g, lambda: a)
    return reg


def test_live_families_values_units_and_nan_left_out():
    g1 = gauges("run-7")
    g2 = gauges("run-8", step_ms_p50=float("nan"), bubble_by_stage={0: float("nan"), 1: 0.2}, steps_skipped=0)
    fa, pe = straggler(), pending_bubble()
    gone = resolved(straggler(rank=1))
    s = samples(generate_latest(live_registry([g1, g2], [fa, pe, gone])).decode())
    run = (("run_id", "run-7"),)
    assert s[("tracetop_run_step", run)] == 42
    assert s[("tracetop_run_ranks", run)] == 4
    assert math.isclose(s[("tracetop_run_step_duration_p50_seconds", run)], g1.step_ms_p50 / 1000)
    assert math.isclose(s[("tracetop_run_grad_sync_p99_seconds", run)], g1.grad_sync_ms_p99 / 1000)
    assert s[("tracetop_run_communication_share_ratio", run)] == g1.comm_share
    assert s[("tracetop_run_scaling_efficiency_ratio", run)] == g1.scaling_efficiency
    assert s[("tracetop_run_tokens_per_second", run)] == g1.tokens_per_s
    assert s[("tracetop_run_gpu_samples_per_second", run)] == g1.samples_per_s_per_gpu
    assert s[("tracetop_run_memory_budget_used_max_ratio", run)] == g1.memory_used_of_budget_max
    assert s[("tracetop_run_alerts_firing", run)] == 2
    assert s[("tracetop_run_live_steps_skipped_total", run)] == 3
    assert s[("tracetop_run_pipeline_bubble_ratio", (("run_id", "run-7"), ("stage", "1")))] == 0.41
    # NaN = not known: left out, never 0
    names = {k[0] for k in s}
    assert "tracetop_run_model_flops_utilization_ratio" not in names
    assert ("tracetop_run_step_duration_p50_seconds", (("run_id", "run-8"),)) not in s
    assert ("tracetop_run_pipeline_bubble_ratio", (("run_id", "run-8"), ("stage", "0"))) not in s
    assert s[("tracetop_run_pipeline_bubble_ratio", (("run_id", "run-8"), ("stage", "1")))] == 0.2
    # alerts: pending and firing, resolved gone
    active = {dict(k[1])["alertname"] + "/" + dict(k[1])["alertstate"]: v
              for k, v in s.items() if k[0] == "tracetop_alert_active"}
    assert active == {"straggler/firing": 1.0, "bubble/pending": 1.0}
    key = tuple(sorted({"alertname": "straggler", "alertstate": "firing", "severity": "critical",
                        "run_id": "run-7", "scope": "rank", "kind": "fault", "rank": "3", "stage": "1"}.items()))
    assert s[("tracetop_alert_value", key)] == fa.value and s[("tracetop_alert_threshold", key)] == fa.threshold


def test_promtool_catches_a_bad_name_so_the_checks_below_can_fail():
    reg = CollectorRegistry()
    Gauge("demo_bytes_sent_total", "a gauge with a counter's suffix", registry=reg)
    Gauge("demo_latency_ms", "abbreviated unit", registry=reg)
    out = promtool_check(generate_latest(reg).decode())
    assert out.returncode != 0 and "_total" in out.stderr and "abbreviated units" in out.stderr, out


def test_promtool_passes_collector_metrics_live_families_and_sink_counts():
    reg = CollectorRegistry()
    m = CollectorMetrics(reg)
    m.received.labels("step").inc(5)
    m.rejected.labels("crc32c").inc()
    m.latency.observe(0.2)
    sinks = [AlertmanagerSink(f"http://127.0.0.1:{refused_port()}"), WebhookSink("http://127.0.0.1:1/x")]
    ex = Exports(sinks)
    try:
        ex.attach_metrics(reg, lambda: [gauges("run-7"), gauges("run-8")],
                          lambda: [straggler(), straggler(rank=2), pending_bubble()])
        text = generate_latest(reg).decode()
        assert "tracetop_export_requests_total" in text and "tracetop_alert_active" in text
        out = promtool_check(text)
        assert out.returncode == 0 and out.stdout + out.stderr == "", out
    finally:
        ex.close()


def test_real_collector_process_metrics_pass_promtool(tmp_path):
    """`python -m collector --metrics-port 0` with the outputs configured, after real batches."""
    c = start_collector(tmp_path, metrics=True, extra_args=[
        "--alertmanager", f"http://127.0.0.1:{refused_port()}", "--webhook", f"http://127.0.0.1:{refused_port()}/h"])
    try:
        f = Feeder(c.addr)
        for seq in (1, 2, 3):
            f.send(batch("src-a", seq))
        f.wait_ack("src-a", 3)
        f.close()
        f.wait_end()
        wait_until(lambda: scrape_metrics(c.metrics_port).get('tracetop_collector_events_stored_total{kind="step"}')
                   == 300, 30, "300 stored rows on /metrics")
        text = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_port}/metrics", timeout=10).read().decode()
        assert 'tracetop_export_requests_total{sink="alertmanager"}' in text
        # the live engine (built-in rules) counts what it could not judge or store
        assert {"tracetop_live_alert_rows_lost_total 0.0", "tracetop_live_batches_dropped_total 0.0"} <= set(
            text.splitlines())
        out = promtool_check(text)
        assert out.returncode == 0 and out.stdout + out.stderr == "", out
    finally:
        assert c.stop() == 0


def test_real_collector_serving_live_records_passes_promtool(tmp_path):
    """A real collector (gRPC + DuckDB + /metrics over HTTP), in process so it can be handed the
    engine's functions, fed RunGauges and Alert records."""
    g = [gauges("run-7"), gauges("run-8", mfu=0.41)]
    a = [straggler(), pending_bubble()]
    h = app.serve(app.CollectorConfig(str(tmp_path / "c.duckdb"), metrics_port=0), exports=build(_Args()),
                  gauges_fn=lambda: g, alerts_fn=lambda: a)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{h.metrics_port}/metrics", timeout=10).read().decode()
        s = samples(text)
        assert s[("tracetop_run_model_flops_utilization_ratio", (("run_id", "run-8"),))] == 0.41
        assert sum(v for k, v in s.items() if k[0] == "tracetop_alert_active") == 2
        out = promtool_check(text)
        assert out.returncode == 0 and out.stdout + out.stderr == "", out
    finally:
        h.stop()


class _Args:
    alertmanager = webhook = otlp = None
