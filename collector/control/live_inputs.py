"""The controller's inputs from the live engine's state (collector/live/state.py, fed by the
writer's on_commit): the same ``ControlInputs`` as ``inputs.RowInputs``, without scanning the
`step`, `memory` and `bubble_by_stage` rows each tick. ``loop.start_tasks`` uses it where the
engine runs and RowInputs where it is off; tests/collector/control/test_live_inputs.py holds the two equal
on a real run.

Per run the engine holds (not ended, a row within ``active_s``): the latest step every rank has
finished, at or before the engine's last judged step (settled: the step's MEMORY rows are in); the
shape in force from rank 0's STEP row; the step peak and budget per rank that sent MEMORY; the bubble
per stage (1 - (forward + backward) / duration summed over the stage's ranks, as the
`bubble_by_stage` view); samples/s and the optimizer time over the last ``window_steps``; the
firing alerts from the engine's book. What the engine does not keep (ZeRO stage, the offload
configured or applied) comes from `run_start` and `actions` (small tables), once per run for
`run_start`. A window of steps no longer in the engine's window is answered by RowInputs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from collector.control.inputs import RowInputs
from collector.control.policy import ControlInputs, RankMemory
from collector.live.state import F


class EngineInputs:
    def __init__(self, live: Any, con: Any, *, window_steps: int = 5, active_s: float = 120.0,
                 bubble_threshold: float = math.nan, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.live = live
        self.rows = RowInputs(con, window_steps=window_steps, active_s=active_s, bubble_threshold=bubble_threshold,
                              clock_ns=clock_ns)
        self.window_steps = window_steps
        self.active_s = active_s
        self.bubble_threshold = bubble_threshold
        self._clock_ns = clock_ns
        self._static: dict[str, tuple[int, int, int, int, str | None, int]] = {}

    # ------------------------------------------------------------------ what the engine holds
    def _views(self, state: Any) -> list[dict]:
        """The active runs' arrays, as views: used only inside ``live.read_state`` (its lock), so
        nothing is copied (16,384 ranks x 64 steps would be 218 MB a tick)."""
        since = self._clock_ns() - int(self.active_s * 1e9)
        return [{"run_id": run.run_id, "world": run.expected_ranks(), "pp": run.pp, "last_evaluated": run.last_evaluated,
                 "slot_step": run.slot_step, "present": run.present, "data": run.data, "stage": run.stage}
                for run in state.runs.values() if not run.ended and run.last_row_ns >= since and run.ranks > 0]

    def _complete(self, snap: dict) -> dict[int, int]:
        """step -> slot, for steps every rank has finished."""
        n = snap["present"].sum(axis=1)
        return {int(s): i for i, s in enumerate(snap["slot_step"]) if s >= 0 and n[i] >= snap["world"]}

    def read(self) -> list[ControlInputs]:
        ids = self.live.read_state(lambda st: [r.run_id for r in st.runs.values()])
        static = {run: self._static_of(run) for run in ids}  # SQL outside the engine's lock
        static = {run: v for run, v in static.items() if v is not None}
        firing = self.live.alerts(firing_only=True)
        found = self.live.read_state(lambda st: [x for v in self._views(st) if v["run_id"] in static
                                                 if (x := self._run(v, static[v["run_id"]])) is not None])
        return [dataclasses.replace(inp, offload=self.rows._offload(inp.run_id, static[inp.run_id][4]),
                                                  alerts=tuple(a for a in firing if a.run_id == inp.run_id))
                for inp in found]

    def _static_of(self, run: str) -> tuple[int, int, int, int, str | None, int] | None:
        if run not in self._static:
            row = self.rows._q("SELECT max(world_size), max(dp), max(pp), max(zero_stage), any_value(ds_config_json), "
                               "max(tp) FROM run_start WHERE run_id = ?", [run])
            if not row or row[0][0] is None:
                return None
            world, dp, pp, zero, cfg, tp = row[0]
            self._static[run] = (int(world), int(dp or 1), int(pp or 1), int(zero if zero is not None else -1), cfg,
                                 int(tp or 1))
        return self._static[run]

    def _run(self, snap: dict, static: tuple) -> ControlInputs | None:
        run = snap["run_id"]
        world, dp, pp, zero, _cfg, tp = static
        done = {s: i for s, i in self._complete(snap).items() if s <= snap["last_evaluated"]}
        if not done:
            return None
        step = max(done)
        d, present, slot = snap["data"], snap["present"], done[step]
        mb, mbs = (int(d[slot, F["micro_batch"], 0]), int(d[slot, F["micro_batches"], 0])) if present[slot, 0] else (-1, -1)
        mem = []
        for r in range(min(world, d.shape[2])):
            rss, peak, budget = (d[slot, F[k], r] for k in ("rss_bytes", "peak_bytes", "budget_bytes"))
            if rss or peak or budget:  # a MEMORY row came from this rank for this step
                mem.append(RankMemory(r, int(peak), int(budget)))
        bubble: tuple[float, ...] = ()
        if pp > 1:
            ok = present[slot] & (d[slot, F["duration_ns"]] > 0)
            stages = snap["stage"]
            rates = []
            for st in sorted({int(x) for x in stages[ok]}):
                m = ok & (stages == st)
                busy = (d[slot, F["forward_ns"]] + d[slot, F["backward_ns"]])[m].sum()
                rates.append(float(1 - busy / d[slot, F["duration_ns"]][m].sum()))
            bubble = tuple(rates)
        first = step - self.window_steps + 1
        opt = np.concatenate([d[done[s], F["optimizer_ns"]][present[done[s]]] for s in range(first, step + 1)
                              if s in done] or [np.zeros(0)])
        # per rank: the median compute over the window's steps (vectorised: 16,384 ranks a tick)
        slots = [done[s] for s in range(first, step + 1) if s in done]
        block = d[slots, F["compute_ns"], :world]
        vals = np.where(present[slots, :world] & (block > 0), block, np.nan)
        with warnings.catch_warnings():  # a rank with no compute time in the window: NaN, said below
            warnings.simplefilter("ignore", RuntimeWarning)
            med = np.nanmedian(vals, axis=0) / 1e6
        compute = [float(x) for x in med] + [math.nan] * (world - len(med))
        return ControlInputs(
            run_id=run, step=step, world_size=world, dp=dp, pp=pp, zero_stage=zero, micro_batch=mb, micro_batches=mbs,
            offload=False, memory=tuple(mem), bubble_by_stage=bubble,  # offload, alerts: filled in by read()
            bubble_threshold=self.bubble_threshold, samples_per_s=self._sps(snap, dp, first, step),
            optimizer_ms=float(np.median(opt)) / 1e6 if len(opt) else math.nan, tp=tp, compute_ms=tuple(compute))

    def _sps(self, snap: dict, dp: int, first: int, last: int) -> float:
        d, present = snap["data"], snap["present"]
        by_step = {int(s): i for i, s in enumerate(snap["slot_step"]) if s >= 0}
        vals = []
        for s in range(first, last + 1):
            i = by_step.get(s)
            if i is None or not present[i].any():
                continue
            dur = float(d[i, F["duration_ns"]][present[i]].max())
            n = d[i, F["samples"]][present[i]]
            samples = float(n[n > 0].mean()) if (n > 0).any() else 0.0  # the ranks' mean (a rebalance differs them)
            if dur > 0 and samples > 0:
                vals.append(dp * samples / (dur / 1e9))
        return float(statistics.median(vals)) if vals else math.nan

    def _in_window(self, run_id: str, first: int, last: int, fn: Callable[[dict], float]) -> float | None:
        """``fn(view)`` under the engine's lock when it still holds every step of [first, last]; else None."""
        def look(state: Any) -> float | None:
            v = next((x for x in self._views(state) if x["run_id"] == run_id), None)
            if v is None:
                return None
            held = {int(s) for s in v["slot_step"] if s >= 0}
            return fn(v) if all(s in held for s in range(max(first, 0), last + 1)) else None

        return self.live.read_state(look)

    def samples_per_s(self, run_id: str, first_step: int, last_step: int) -> float:
        static = self._static_of(run_id)
        got = None if static is None else self._in_window(
            run_id, first_step, last_step, lambda v: self._sps(v, static[1], first_step, last_step))
        return self.rows.samples_per_s(run_id, first_step, last_step) if got is None else got

    def step_ms(self, run_id: str, first_step: int, last_step: int) -> float:
        """A verification window's step time: from the rows (a window after an action may be out of the engine's)."""
        return self.rows.step_ms(run_id, first_step, last_step)

    def loss(self, run_id: str, first_step: int, last_step: int) -> float:
        return self.rows.loss(run_id, first_step, last_step)

    def memory_share(self, run_id: str, first_step: int, last_step: int) -> float:
        def share(v: dict) -> float:
            d, best = v["data"], math.nan
            for i, s in enumerate(v["slot_step"]):
                if first_step <= s <= last_step:
                    peak, budget = d[i, F["peak_bytes"]], d[i, F["budget_bytes"]]
                    ok = (budget > 0) & (peak >= 0)
                    if ok.any():
                        x = float((peak[ok] / budget[ok]).max())
                        best = x if math.isnan(best) else max(best, x)
            return best

        got = self._in_window(run_id, first_step, last_step, share)
        return self.rows.memory_share(run_id, first_step, last_step) if got is None else got
