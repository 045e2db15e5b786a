"""The live engine's figures on the collector's `/metrics`: a prometheus_client custom Collector.

`LiveCollector(gauges_fn, alerts_fn).collect()` reads the engine's latest `RunGauges` and `Alert`
records at scrape time (nothing is copied between scrapes) and turns them into metric families.
`families(gauges, alerts)` is the pure part. NaN (not known yet) gauges are left out, never
exported as 0. Base units (seconds, ratios) as Prometheus wants, so names pass `promtool check
metrics`: no `_ms`, `_total` only on counters, snake_case, a HELP on each.

Per alert (pending and firing; resolved ones are gone; at most MAX_ALERT_SERIES_PER_RUN a run,
firing and most severe first, the rest counted in tracetop_alert_series_dropped{run_id}), like
Prometheus's own ALERTS series:
    tracetop_alert_active{alertname, alertstate, severity, run_id, scope, kind, <scope labels>} 1
    tracetop_alert_value{...} / tracetop_alert_threshold{...}    in the rule's unit
Per run (label run_id; bubble also by stage):
    tracetop_run_step, tracetop_run_ranks, tracetop_run_step_duration_p50_seconds,
    tracetop_run_grad_sync_p99_seconds, tracetop_run_communication_share_ratio,
    tracetop_run_scaling_efficiency_ratio, tracetop_run_tokens_per_second,
    tracetop_run_gpu_samples_per_second, tracetop_run_model_flops_utilization_ratio,
    tracetop_run_pipeline_bubble_ratio{stage}, tracetop_run_memory_budget_used_max_ratio,
    tracetop_run_alerts_firing, tracetop_run_live_steps_skipped_total,
    tracetop_run_live_steps_incomplete_total (steps judged without every rank's STEP row),
    tracetop_run_live_last_incomplete_step (the latest of them; absent while none)
What the run lost (collector/live/lost.py; GPU-seconds, one GPU per rank):
    tracetop_run_lost_gpu_seconds_total{run_id, cause}        over the steps the engine judged
    tracetop_run_lost_recent_gpu_seconds{run_id, cause}       over the last window (lost_window_s)
    tracetop_run_lost_recent_window_seconds{run_id}           the step time that window holds
    tracetop_run_lost_recent_gpus{run_id}                     GPUs' worth lost in it (= GPU-h per hour)
    tracetop_run_held_gpu_seconds_total{run_id}               GPUs x step time judged (lost / held = share)
    tracetop_run_lost_top_rank_share_ratio{run_id, rank, window="run"|"recent"}
    tracetop_run_lost_cost_total{run_id, currency}, tracetop_run_lost_recent_cost{run_id, currency}
                                                              where a price per GPU-hour is declared
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from collector.export.alertmanager import label_name
from collector.live.model import FIRING, PENDING, Alert, RunGauges

log = logging.getLogger("tracetop.export")

GaugesFn = Callable[[], Sequence[RunGauges]]
AlertsFn = Callable[[], Sequence[Alert]]

_ALERT_RESERVED = ("alertname", "alertstate", "severity", "run_id", "scope", "kind")

# (metric name, help, RunGauges field, scale to the metric's unit)
RUN_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("tracetop_run_step", "Latest completed step of the run", "step", 1.0),
    ("tracetop_run_ranks", "Ranks in the run", "ranks", 1.0),
    ("tracetop_run_step_duration_p50_seconds", "Median step time across ranks at the latest step",
     "step_ms_p50", 1e-3),
    ("tracetop_run_grad_sync_p99_seconds",
     "Gradient-synchronisation time per step, 99th percentile across ranks", "grad_sync_ms_p99", 1e-3),
    ("tracetop_run_communication_share_ratio", "Exposed communication time over step time",
     "comm_share", 1.0),
    ("tracetop_run_scaling_efficiency_ratio",
     "Scaling efficiency: per-rank throughput against the baseline run where one is set, "
     "else compute over compute plus exposed communication", "scaling_efficiency", 1.0),
    ("tracetop_run_tokens_per_second", "Tokens per second, the whole run", "tokens_per_s", 1.0),
    ("tracetop_run_gpu_samples_per_second", "Samples per second per GPU", "samples_per_s_per_gpu", 1.0),
    ("tracetop_run_model_flops_utilization_ratio", "Model FLOPs utilisation (where FLOPs are declared)",
     "mfu", 1.0),
    ("tracetop_run_memory_budget_used_max_ratio", "Largest memory used over budget across the run's ranks",
     "memory_used_of_budget_max", 1.0),
    ("tracetop_run_alerts_firing", "Alerts firing now for the run", "firing_alerts", 1.0),
)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def alert_labels(a: Alert) -> dict[str, str]:
    out = {"alertname": a.rule, "alertstate": a.state, "severity": a.severity, "run_id": a.run_id,
           "scope": a.scope, "kind": a.kind}
    for k, v in a.labels.items():
        name = label_name(str(k))
        if name in _ALERT_RESERVED or name.startswith("__"):
            name = "exported_" + name.lstrip("_")
        out[name] = str(v)
    return out


def run_families(gauges: Iterable[RunGauges]) -> list[Metric]:
    fams: list[Metric] = []
    rows = list(gauges)
    for name, help_, attr, scale in RUN_GAUGES:
        fam = GaugeMetricFamily(name, help_, labels=["run_id"])
        for g in rows:
            v = getattr(g, attr)
            if _finite(v):
                fam.add_metric([g.run_id], float(v) * scale)
        fams.append(fam)
    bubble = GaugeMetricFamily(
        "tracetop_run_pipeline_bubble_ratio", "Pipeline bubble per stage: idle share of the step",
        labels=["run_id", "stage"],
    )
    skipped = CounterMetricFamily(
        "tracetop_run_live_steps_skipped",
        "Steps the live state skipped to keep up with ingest (it never queues them)", labels=["run_id"],
    )
    incomplete = CounterMetricFamily(
        "tracetop_run_live_steps_incomplete",
        "Steps of the run judged without every rank's STEP row (their alerts say which ranks were missing)",
        labels=["run_id"],
    )
    last_incomplete = GaugeMetricFamily(
        "tracetop_run_live_last_incomplete_step", "The latest step of the run judged without every rank",
        labels=["run_id"],
    )
    for g in rows:
        for stage, v in sorted(g.bubble_by_stage.items()):
            if _finite(v):
                bubble.add_metric([g.run_id, str(stage)], float(v))
        skipped.add_metric([g.run_id], float(g.steps_skipped))
        incomplete.add_metric([g.run_id], float(g.steps_incomplete))
        if g.last_incomplete_step >= 0:
            last_incomplete.add_metric([g.run_id], float(g.last_incomplete_step))
    return [*fams, bubble, skipped, incomplete, last_incomplete, *lost_families(rows)]


def lost_families(rows: list[RunGauges]) -> list[Metric]:
    total = CounterMetricFamily("tracetop_run_lost_gpu_seconds",
                                "GPU time lost by cause (straggler, data, pipeline, comm) over the steps judged",
                                labels=["run_id", "cause"])
    recent = GaugeMetricFamily("tracetop_run_lost_recent_gpu_seconds",
                               "GPU time lost by cause over the last window of step time", labels=["run_id", "cause"])
    span = GaugeMetricFamily("tracetop_run_lost_recent_window_seconds",
                             "Step time the recent window holds (up to the configured window)", labels=["run_id"])
    gpus = GaugeMetricFamily("tracetop_run_lost_recent_gpus",
                             "GPUs' worth of time lost over the recent window: GPU-hours lost per hour", labels=["run_id"])
    held = CounterMetricFamily("tracetop_run_held_gpu_seconds", "GPUs x step time over the steps judged",
                               labels=["run_id"])
    top = GaugeMetricFamily("tracetop_run_lost_top_rank_share_ratio",
                            "Share of the lost GPU time charged to the rank charged the most",
                            labels=["run_id", "rank", "window"])
    money = CounterMetricFamily("tracetop_run_lost_cost", "Lost GPU time at the declared price per GPU-hour",
                                labels=["run_id", "currency"])
    money_recent = GaugeMetricFamily("tracetop_run_lost_recent_cost",
                                     "Lost GPU time over the recent window at the declared price",
                                     labels=["run_id", "currency"])
    for g in rows:
        if not g.lost_gpu_s:
            continue
        for cause, v in sorted(g.lost_gpu_s.items()):
            total.add_metric([g.run_id, cause], float(v))
        for cause, v in sorted(g.lost_window_gpu_s.items()):
            recent.add_metric([g.run_id, cause], float(v))
        if _finite(g.lost_window_span_s):
            span.add_metric([g.run_id], float(g.lost_window_span_s))
        if _finite(g.lost_window_gpus):
            gpus.add_metric([g.run_id], float(g.lost_window_gpus))
        if _finite(g.held_gpu_s):
            held.add_metric([g.run_id], float(g.held_gpu_s))
        for rank, share, window in ((g.lost_top_rank, g.lost_top_rank_share, "run"),
                                    (g.lost_window_top_rank, g.lost_window_top_rank_share, "recent")):
            if rank >= 0 and _finite(share):
                top.add_metric([g.run_id, str(rank), window], float(share))
        if _finite(g.price_per_gpu_hour):
            money.add_metric([g.run_id, g.currency], sum(g.lost_gpu_s.values()) / 3600 * g.price_per_gpu_hour)
            money_recent.add_metric([g.run_id, g.currency],
                                    sum(g.lost_window_gpu_s.values()) / 3600 * g.price_per_gpu_hour)
    return [total, recent, span, gpus, held, top, money, money_recent]


#: the most alert series one run puts on /metrics (each of tracetop_alert_active/_value/_threshold);
#: a run with more pending or firing alerts (e.g. one per rank of 16,384) shows its most severe and
#: counts the rest in tracetop_alert_series_dropped{run_id} (the `alerts` table holds them all)
MAX_ALERT_SERIES_PER_RUN = 256
_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def alert_families(alerts: Iterable[Alert], max_per_run: int = MAX_ALERT_SERIES_PER_RUN) -> list[Metric]:
    dropped_fam = GaugeMetricFamily("tracetop_alert_series_dropped",
                                    "Pending or firing alerts of the run left off /metrics by the per-run series cap",
                                    labels=["run_id"])
    shown: dict[str, int] = {}
    dropped: dict[str, int] = {}
    live = sorted((a for a in alerts if a.state in (PENDING, FIRING)),
                  key=lambda a: (a.state != FIRING, _SEVERITY_ORDER.get(a.severity, 3)))
    kept = []
    for a in live:
        if shown.get(a.run_id, 0) >= max_per_run:
            dropped[a.run_id] = dropped.get(a.run_id, 0) + 1
            continue
        shown[a.run_id] = shown.get(a.run_id, 0) + 1
        kept.append(a)
    for run_id, n in sorted(dropped.items()):
        dropped_fam.add_metric([run_id], float(n))
    active = GaugeMetricFamily(
        "tracetop_alert_active", "1 for each pending or firing alert (alertstate says which), as ALERTS"
    )
    value = GaugeMetricFamily("tracetop_alert_value", "The alert's signal value at its last step, in the rule's unit")
    threshold = GaugeMetricFamily("tracetop_alert_threshold", "The alert rule's threshold, in the rule's unit")
    for a in kept:
        labels = alert_labels(a)
        active.add_sample("tracetop_alert_active", labels, 1.0)
        if _finite(a.value):
            value.add_sample("tracetop_alert_value", labels, float(a.value))
        if _finite(a.threshold):
            threshold.add_sample("tracetop_alert_threshold", labels, float(a.threshold))
    return [active, value, threshold, dropped_fam]


def families(gauges: Iterable[RunGauges], alerts: Iterable[Alert]) -> list[Metric]:
    """Pure: the metric families for these records; families without a sample are left out."""
    return [f for f in (*run_families(gauges), *alert_families(alerts)) if f.samples]


class LiveCollector:
    """Registered on the collector's registry; read at each scrape. A failing source leaves its
    families out (logged once) rather than failing the whole scrape."""

    def __init__(self, gauges_fn: GaugesFn, alerts_fn: AlertsFn) -> None:
        self.gauges_fn = gauges_fn
        self.alerts_fn = alerts_fn
        self._logged = False

    def _read(self, fn):
        try:
            return list(fn())
        except Exception:
            if not self._logged:
                self._logged = True
                log.exception("/metrics: reading the live engine's records failed (logged once)")
            return []

    def collect(self) -> list[Metric]:
        return families(self._read(self.gauges_fn), self._read(self.alerts_fn))


class SinkStatsCollector:
    """What the exporters did: requests, failures and dropped publish calls, per sink."""

    def __init__(self, stats_fn: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.stats_fn = stats_fn

    def collect(self) -> list[Metric]:
        stats = self.stats_fn()
        spec = (
            ("tracetop_export_requests", "Requests made to a receiver (HTTP POSTs; OTLP exports)", "requests"),
            ("tracetop_export_request_failures", "Requests that failed: refused, HTTP error or timed out",
             "failures"),
            ("tracetop_export_publishes_dropped",
             "Alert publish calls dropped because the sink's queue was full (slow or dead receiver)", "dropped"),
        )
        out: list[Metric] = []
        for name, help_, key in spec:
            fam = CounterMetricFamily(name, help_, labels=["sink"])
            for sink, s in sorted(stats.items()):
                if key in s:
                    fam.add_metric([sink], float(s[key]))
            if fam.samples:
                out.append(fam)
        return out
