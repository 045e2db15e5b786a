"""Alert and RunGauges records as the live engine publishes them (collector/live/model.py)."""

from __future__ import annotations

import time
from dataclasses import replace

from collector.live.model import FIRING, PENDING, RESOLVED, Alert, RunGauges


def straggler(run_id: str = "run-7", rank: int = 3, *, state: str = FIRING, value: float = 9.1,
              first_ns: int | None = None) -> Alert:
    now = time.time_ns()
    return Alert(
        rule="straggler", signal="straggler", severity="critical", state=state, run_id=run_id, scope="rank",
        labels={"rank": str(rank), "stage": "1"}, first_step=20, last_step=22,
        first_ns=first_ns if first_ns is not None else now - 2_000_000_000, last_ns=now,
        value=value, threshold=3.5,
        message=f"rank {rank} computes 152 ms longer than its stage's median (z = {value}) for 3 steps "
                "and waits 2 ms where the others wait 150 ms: it is the straggler",
    )


def grad_sync(run_id: str = "run-7", **over) -> Alert:
    """An SLA breach (kind sla), standalone unless `incident_id` is given."""
    now = time.time_ns()
    a = Alert(rule="grad_sync", signal="grad_sync", severity="warning", state=FIRING, run_id=run_id, scope="run",
              labels={}, first_step=19, last_step=22, first_ns=now - 3_000_000_000, last_ns=now, value=420.0,
              threshold=200.0, message="grad-sync p99 across ranks 420 ms; an SLA breach, not a fault", kind="sla")
    return replace(a, **over)


def pending_bubble(run_id: str = "run-7") -> Alert:
    now = time.time_ns()
    return Alert(rule="bubble", signal="bubble", severity="warning", state=PENDING, run_id=run_id, scope="stage",
                 labels={"stage": "0"}, first_step=21, last_step=22, first_ns=now, last_ns=now, value=0.2,
                 threshold=0.15, message="stage 0 bubbles at 20% of its step (budget 15%)")


def resolved(a: Alert, last_step: int = 25) -> Alert:
    return replace(a, state=RESOLVED, last_step=last_step, last_ns=time.time_ns())


def gauges(run_id: str = "run-7", **over) -> RunGauges:
    base = dict(run_id=run_id, step=42, ranks=4, step_ms_p50=152.5, grad_sync_ms_p99=212.25, comm_share=0.31,
                scaling_efficiency=0.62, tokens_per_s=18250.0, samples_per_s_per_gpu=7.5, mfu=float("nan"),
                bubble_by_stage={0: 0.12, 1: 0.41}, memory_used_of_budget_max=0.87, firing_alerts=2,
                steps_skipped=3)
    base.update(over)
    return RunGauges(**base)
