"""The records the live path hands to the world outside it: alerts and per-run gauges.

These are the contract between the live engine (collector/live: state, signals, rules) and the
places people look (collector/export: Prometheus /metrics, Alertmanager, webhook, OTLP; the TUI
through Watch). Plain frozen records, no protobuf, no DuckDB (STYLE habit 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

#: Alert states, in the order an alert goes through them.
PENDING, FIRING, RESOLVED = "pending", "firing", "resolved"
SEVERITIES = ("info", "warning", "critical")
SCOPES = ("run", "stage", "rank", "role", "node", "gpu", "collector")
#: What an alert says: a fault (something broke or slowed: it opens an incident naming the culprit
#: and the cause), an SLA breach (a figure past its objective: standalone, or a consequence of an
#: incident that explains it), or a hardware event (XID, ECC, throttling: an incident of its own).
KINDS = ("fault", "sla", "hardware")


@dataclass(frozen=True)
class Alert:
    """One alert instance: a rule breached at one scope of one run.

    An alert's identity is (rule, run_id, labels); the engine publishes a new record each time its
    state, value or last step changes. Times are the collector's wall clock (ns)."""

    rule: str                       # the rule's name in the rules file, e.g. "straggler"
    signal: str                     # the signal it judges, e.g. "straggler", "grad_sync_ms"
    severity: str                   # one of SEVERITIES
    state: str                      # PENDING | FIRING | RESOLVED
    run_id: str
    scope: str                      # one of SCOPES
    labels: Mapping[str, str]       # scope labels ({"rank": "3"}, {"stage": "1"}, ...) plus the rule's own
    first_step: int                 # the step at which the breach began (-1 for time-based rules)
    last_step: int                  # the latest step at which it held
    first_ns: int
    last_ns: int
    value: float                    # the signal's value at last_step, in the rule's unit
    threshold: float
    message: str                    # what, where and why, with numbers, for a person
    fired_ns: int = 0               # (added by the live engine) collector clock when it went firing; 0 = never
    fired_step: int = -1            # (added by the live engine) the completed step at which it went firing
    kind: str = "fault"             # one of KINDS (the rule's `kind`, else its signal's)
    # The incident it belongs to: the alert_id of the cause alert (a cause's own id for a cause; a
    # consequence's cause's id); "" for a standalone SLA breach (and while pending).
    incident_id: str = ""

    @property
    def role(self) -> str:
        """'cause' (it opened its incident), 'consequence' (attached to another's), '' (standalone)."""
        if not self.incident_id:
            return ""
        return "consequence" if self.is_consequence else "cause"

    @property
    def is_consequence(self) -> bool:
        return bool(self.incident_id) and self.incident_id != self.id

    @property
    def id(self) -> str:
        """The alerts table's id: rule|run|labels|first step (first ns for timer rules)."""
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        return f"{self.rule}|{self.run_id}|{labels}|{self.first_ns if self.first_step < 0 else self.first_step}"

    @property
    def key(self) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        return (self.rule, self.run_id, tuple(sorted(self.labels.items())))


@dataclass(frozen=True)
class CollectorLag:
    """How far behind the collector itself is (collector/ingest/metrics.py `CollectorMetrics.lag`):
    the `collector_behind` rule's input. Behind: a stream held by backpressure, or the oldest batch
    not yet committed waiting over BEHIND_AFTER_S (2 s)."""

    behind_s: float         # how long it has been behind without a break (0: keeping up)
    oldest_wait_s: float    # the oldest batch not yet committed (queued, or in the commit running): its wait so far
    streams_held: int       # streams held by backpressure now
    rows_not_stored: int    # rows the shippers counted as not stored (gap rows) since it fell behind
    queue_mb: float = 0.0   # the writer's queue now (Arrow MB)


@dataclass(frozen=True)
class RunGauges:
    """Per-run figures at the latest completed step, for /metrics, OTLP and the TUI's header.
    NaN = not known (yet); exporters leave NaN gauges out rather than export them."""

    run_id: str
    step: int
    ranks: int
    step_ms_p50: float = float("nan")
    grad_sync_ms_p99: float = float("nan")
    comm_share: float = float("nan")            # exposed communication / step time
    scaling_efficiency: float = float("nan")    # against the baseline where one is set, else within the run
    tokens_per_s: float = float("nan")          # the whole run's
    samples_per_s_per_gpu: float = float("nan")
    mfu: float = float("nan")
    bubble_by_stage: Mapping[int, float] = field(default_factory=dict)
    memory_used_of_budget_max: float = float("nan")  # max over ranks of used / budget
    firing_alerts: int = 0
    steps_skipped: int = 0                      # this run's steps the live state skipped to keep up (never judged)
    # Steps of this run judged without every rank's STEP row (at the step deadline, or in a recompute
    # where the file lacks them): their judgments, and the alerts raised or updated on them,
    # stand on part of the run (the alert's message says "judged on N of M ranks (missing: ...)").
    steps_incomplete: int = 0
    last_incomplete_step: int = -1              # the latest of them; -1 = none
    # What it cost (collector/live/lost.py): GPU-seconds lost per cause (straggler, data, pipeline,
    # comm) over the steps the engine judged, and over the last `lost_window_s` of step time.
    lost_gpu_s: Mapping[str, float] = field(default_factory=dict)
    lost_window_gpu_s: Mapping[str, float] = field(default_factory=dict)
    lost_window_s: float = float("nan")         # the configured window
    lost_window_span_s: float = float("nan")    # step time the window holds now (less early in a run)
    held_gpu_s: float = float("nan")            # GPUs x step time judged: lost / held is the share lost
    lost_top_rank: int = -1                     # the rank most lost time is charged to (whole run), -1 none
    lost_top_rank_share: float = float("nan")
    lost_window_top_rank: int = -1
    lost_window_top_rank_share: float = float("nan")
    lost_window_gpus: float = float("nan")      # GPU-seconds lost per second of step time in the window (= GPU-h/h)
    price_per_gpu_hour: float = float("nan")    # declared price; NaN = none
    currency: str = ""


#: The cause an incident names, by its cause alert's signal.
CAUSES = {"straggler": "compute", "data_stall": "data", "stuck_collective": "hang", "silent_rank": "silent",
          "first_failure": "failure", "unheard_rank": "never heard", "memory": "memory", "loss_spike": "loss"}


def culprit_text(a: Alert) -> str:
    """'rank 3, stage 1', 'stage 1', 'GPU 2 on node-a', 'the run': who an incident names."""
    lb = a.labels
    if "rank" in lb:
        return f"rank {lb['rank']}" + (f", stage {lb['stage']}" if "stage" in lb else "")
    if "gpu" in lb:
        return f"GPU {lb['gpu']}" + (f" on {lb['node']}" if "node" in lb else "")
    if "node" in lb:
        return f"node {lb['node']}"
    if "stage" in lb:
        return f"stage {lb['stage']}"
    return "the run"


def cause_text(a: Alert) -> str:
    return CAUSES.get(a.signal, a.signal if a.kind == "hardware" else a.rule)


class AlertSink(Protocol):
    """Where alerts go (Alertmanager, a webhook, ...). `publish` is called by the engine's thread
    with the alerts whose state changed since the last call and all alerts firing now; it must
    return at once (a sink queues and sends on its own thread) and never raise."""

    def publish(self, changed: Sequence[Alert], firing: Sequence[Alert]) -> None: ...

    def close(self) -> None: ...
