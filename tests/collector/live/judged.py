"""Waiting on the live engine's judgment of a run's last step, not on a fixed sleep.

    wait_judged(c, "clean", "balanced")   # c: a collector started with metrics=True

A run's rows are committed once its ranks closed (their hooks wait for the collector's acks, which
come after the commit), so its last step stored is its last step; the engine judges it once it is
settled (`settle_s` after its last row) or at the step deadline, and /metrics then shows it as the
run's step (`tracetop_run_step`). Its alert rows are stored in the same pass, under the same lock
as the gauges /metrics reads: once the step shows, what was judged on it is in `alerts`."""

from __future__ import annotations

from tests.collector.util import sql
from tests.support.services import scrape_metrics
from tests.support.wait import wait_for


def last_steps(addr: str, run_ids: tuple[str, ...]) -> dict[str, int]:
    names = ", ".join(f"'{r}'" for r in run_ids)
    rows = sql(addr, f"SELECT run_id, max(step) AS s FROM step WHERE run_id IN ({names}) GROUP BY run_id").to_pylist()
    got = {r["run_id"]: r["s"] for r in rows}
    assert set(got) == set(run_ids), (got, run_ids)
    return got


def wait_judged(c, *run_ids: str, timeout_s: float = 60.0) -> dict[str, float]:
    """/metrics once every run's last stored step has been judged (each run's step gauge reached it)."""
    want = last_steps(c.addr, run_ids)

    def judged():
        m = scrape_metrics(c.metrics_port)
        return m if all(m.get(f'tracetop_run_step{{run_id="{r}"}}', -1) >= s for r, s in want.items()) else None

    return wait_for(judged, timeout_s, f"the last steps {want} judged",
                    lambda: {k: v for k, v in scrape_metrics(c.metrics_port).items() if k.startswith("tracetop_run_step")},
                    every_s=0.2)
