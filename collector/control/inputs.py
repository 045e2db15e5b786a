"""The controller's inputs from the committed rows: the fallback where the live engine is off
(``--no-rules``), and for verification windows the engine no longer holds (live_inputs.py is the
default; the same ``ControlInputs``; ``InputsSource`` in controller.py is the seam).

Per active run (STEP rows within ``active_s``): the latest step every rank has finished, the
shape in force from rank 0's STEP rows, the step peak and budget per rank (MEMORY), the bubble
per stage (the `bubble_by_stage` view), the run's samples/s and optimizer time (median over the
last ``window_steps`` steps) and, where the live engine's `alerts` table exists, the firing alerts.
Its own cursor: it runs off the event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from collector.control.policy import ControlInputs, RankMemory
from collector.live.model import Alert


class RowInputs:
    def __init__(self, con, *, window_steps: int = 5, active_s: float = 120.0, bubble_threshold: float = math.nan,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._cur = con.cursor()
        self.window_steps = window_steps
        self.active_s = active_s
        self.bubble_threshold = bubble_threshold
        self._clock_ns = clock_ns

    def _q(self, sql: str, params: list) -> list[tuple]:
        return self._cur.execute(sql, params).fetchall()

    def read(self) -> list[ControlInputs]:
        since = self._clock_ns() - int(self.active_s * 1e9)
        runs = self._q("SELECT r.run_id, max(r.world_size), max(r.dp), max(r.pp), max(r.zero_stage), any_value(r.ds_config_json), "
                       "max(r.tp) FROM run_start r WHERE r.run_id IN (SELECT DISTINCT run_id FROM step WHERE start_ns > ?) "
                       "GROUP BY r.run_id", [since])
        out = []
        for run, world, dp, pp, zero, cfg, tp in runs:
            inp = self._run(run, int(world), int(dp or 1), int(pp or 1), int(zero if zero is not None else -1), cfg,
                            int(tp or 1))
            if inp is not None:
                out.append(inp)
        return out

    def _run(self, run: str, world: int, dp: int, pp: int, zero: int, cfg: str | None, tp: int = 1) -> ControlInputs | None:
        since = self._clock_ns() - int(self.active_s * 1e9)  # recent rows only: the table grows all run long
        row = self._q("SELECT step FROM step WHERE run_id = ? AND start_ns > ? GROUP BY step "
                      "HAVING count(DISTINCT rank) >= ? ORDER BY step DESC LIMIT 1", [run, since, world])
        if not row:
            return None
        step = int(row[0][0])
        shape = self._q("SELECT micro_batch, micro_batches FROM step WHERE run_id = ? AND step = ? AND rank = 0", [run, step])
        mb, mbs = (int(shape[0][0]), int(shape[0][1])) if shape else (-1, -1)
        mem = tuple(RankMemory(int(r), int(p), int(b)) for r, p, b in self._q(
            "SELECT rank, peak_bytes, budget_bytes FROM memory WHERE run_id = ? AND step = ? ORDER BY rank", [run, step]))
        bubble = tuple(float(b) for (b,) in self._q(
            "SELECT bubble_rate FROM bubble_by_stage WHERE run_id = ? AND step = ? ORDER BY stage", [run, step]))
        first = step - self.window_steps + 1
        opt = self._q("SELECT median(optimizer_ns) / 1e6 FROM step WHERE run_id = ? AND step BETWEEN ? AND ?",
                      [run, first, step])
        return ControlInputs(
            run_id=run, step=step, world_size=world, dp=dp, pp=pp, zero_stage=zero, micro_batch=mb, micro_batches=mbs,
            offload=self._offload(run, cfg), memory=mem, bubble_by_stage=bubble, bubble_threshold=self.bubble_threshold,
            samples_per_s=self.samples_per_s(run, first, step),
            optimizer_ms=float(opt[0][0]) if opt and opt[0][0] is not None else math.nan, alerts=self._alerts(run),
            tp=tp, compute_ms=self._compute_ms(run, first, step, world))

    def _compute_ms(self, run: str, first: int, last: int, world: int) -> tuple[float, ...]:
        """Per rank: the median compute (forward + backward + optimizer) over the steps; NaN for a
        rank without (no rows, or no phases timed)."""
        got = dict(self._q("SELECT rank, median(compute_ns) / 1e6 FROM step WHERE run_id = ? AND step BETWEEN ? AND ? "
                           "AND compute_ns > 0 GROUP BY rank", [run, first, last]))
        return tuple(float(got[r]) if got.get(r) is not None else math.nan for r in range(world))

    def step_ms(self, run_id: str, first_step: int, last_step: int) -> float:
        """The run's step time over the steps: the slowest rank's duration, median over the steps."""
        row = self._q("SELECT median(d) FROM (SELECT max(duration_ns) / 1e6 AS d FROM step WHERE run_id = ? AND step "
                      "BETWEEN ? AND ? GROUP BY step)", [run_id, first_step, last_step])
        return float(row[0][0]) if row and row[0][0] is not None else math.nan

    def loss(self, run_id: str, first_step: int, last_step: int) -> float:
        """The run's loss over the steps (rank 0's, where it reports one; else any rank's), median."""
        row = self._q("SELECT median(l) FROM (SELECT arg_min(loss, rank) AS l FROM step WHERE run_id = ? AND step "
                      "BETWEEN ? AND ? AND NOT isnan(loss) GROUP BY step)", [run_id, first_step, last_step])
        return float(row[0][0]) if row and row[0][0] is not None else math.nan

    def samples_per_s(self, run_id: str, first_step: int, last_step: int) -> float:
        """The run's samples/s over the steps: samples of every data-parallel replica per step
        (the ranks' mean x dp: a rebalance gives the replicas different shares) over the slowest
        rank's step time, median over the steps."""
        row = self._q(
            "WITH s AS (SELECT step, max(duration_ns) AS d, avg(samples) FILTER (WHERE samples > 0) AS n FROM step "
            "WHERE run_id = ? AND step BETWEEN ? AND ? GROUP BY step) "
            "SELECT median((SELECT max(dp) FROM run_start WHERE run_id = ?) * s.n / (s.d / 1e9)) "
            "FROM s WHERE s.d > 0 AND s.n > 0",
            [run_id, first_step, last_step, run_id])
        return float(row[0][0]) if row and row[0][0] is not None else math.nan

    def memory_share(self, run_id: str, first_step: int, last_step: int) -> float:
        row = self._q("SELECT max(peak_bytes / budget_bytes) FROM memory WHERE run_id = ? AND step BETWEEN ? AND ? "
                      "AND budget_bytes > 0 AND peak_bytes >= 0", [run_id, first_step, last_step])
        return float(row[0][0]) if row and row[0][0] is not None else math.nan

    def _offload(self, run: str, cfg: str | None) -> bool:
        applied = self._q("SELECT value FROM actions WHERE run_id = ? AND kind = 'offload' AND state IN "
                          "('applied', 'verified', 'rolled_back') ORDER BY done_ns DESC LIMIT 1", [run])
        if applied:
            return bool(applied[0][0])
        import json

        try:
            zo = json.loads(cfg or "{}").get("zero_optimization", {}) or {}
            return (zo.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
        except (ValueError, AttributeError):
            return False

    def _alerts(self, run: str) -> tuple[Alert, ...]:
        """Firing alerts from the live engine's `alerts` table, where it exists (its columns may
        differ after the merge: then none, and the lead wires the live state instead)."""
        try:
            rows = self._q("SELECT rule, signal, state, message FROM alerts WHERE run_id = ? AND state = 'firing'", [run])
        except Exception:
            return ()
        return tuple(Alert(rule=r, signal=s, severity="warning", state=st, run_id=run, scope="run", labels={},
                           first_step=-1, last_step=-1, first_ns=0, last_ns=0, value=math.nan, threshold=math.nan,
                           message=m) for r, s, st, m in rows)
