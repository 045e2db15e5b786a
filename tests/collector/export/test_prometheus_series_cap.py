"""/metrics carries at most MAX_ALERT_SERIES_PER_RUN alert series a run (a rule firing on each of
16,384 ranks made 49,152 series of one run): firing and most severe first, the rest counted."""

from __future__ import annotations

from collector.export.prometheus import alert_families
from collector.live.model import Alert


def _alert(run: str, rank: int, state: str = "firing", severity: str = "warning") -> Alert:
    return Alert("silent", "silent_rank", severity, state, run, "rank", {"rank": str(rank)}, -1, -1, 0, 0, 30.0, 20.0,
                 f"rank {rank} silent")


def test_alert_series_per_run_are_capped_and_the_rest_counted():
    many = [_alert("big", r, "pending") for r in range(1000)] + [_alert("big", 5000, severity="critical")]
    small = [_alert("small", r) for r in range(3)]
    active, value, threshold, dropped = alert_families(many + small, max_per_run=100)
    runs = [s.labels["run_id"] for s in active.samples]
    assert runs.count("big") == 100 and runs.count("small") == 3
    assert len(value.samples) == len(threshold.samples) == 103
    # the firing critical one is kept whatever its place in the list
    assert any(s.labels["rank"] == "5000" for s in active.samples)
    assert [(s.labels["run_id"], s.value) for s in dropped.samples] == [("big", 901.0)]
