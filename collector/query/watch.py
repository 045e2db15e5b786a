"""Query.Watch's snapshots: one function the gRPC handler calls, on the collector's own cursor.

A snapshot (collector/query/snapshot.py) is built in a worker thread (never on the event loop) on a
cursor of the writer's own connection. Where the collector runs the live engine (the default;
not with --no-rules), the per-rank sections (ranks, steps, bubble, offload_rate: the heavy ones
at scale) come from the engine's in-memory state (collector/live/state.py, fed by the writer's
on_commit), read under the engine's lock: `LiveSnapshots`. The rest (the run's header, the
collectives' quantiles, the Gantt, the last transfers, GPUs, XIDs, alerts, actions) stays the
bounded SQL (`WHERE step BETWEEN latest-N AND latest`; a time window on gpu_sample). Where the live
state does not hold the steps (a collector restarted on the file, a run older than its window, a
collector without the engine) the SQL builds everything, as it always could. The Cursor remembers
the newest complete step, so finding the next one reads only rows at or after it.

Cost at 16,384 ranks: collector/bench/watch_snapshot.py measures both, interleaved.
"""

from __future__ import annotations

import numpy as np

from collector.query import snapshot as snap
from tracetop.errors import TracetopError

#: Rates a client may ask for, in seconds between snapshots.
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 60.0
DEFAULT_INTERVAL_S = 1.0


class UnknownRun(TracetopError, LookupError):
    """The asked-for run is not in this collector; str() lists the runs it has."""


def clamp_interval(interval_s: float) -> float:
    if not interval_s or interval_s != interval_s:  # 0 or NaN: the default
        return DEFAULT_INTERVAL_S
    return min(max(float(interval_s), MIN_INTERVAL_S), MAX_INTERVAL_S)


def newest_run(con) -> str | None:
    rows = con.execute(snap.RUNS_SQL).fetchall()
    return rows[-1][0] if rows else None


def snapshot(con, run_id: str, *, cursor: snap.Cursor | None = None,
             window_steps: int = snap.DEFAULT_WINDOW_STEPS, live: LiveSnapshots | None = None,
             step: int | None = None) -> bytes:
    """Arrow IPC bytes of run `run_id`'s snapshot at its latest complete step (or `step`);
    collector/query/snapshot.py says what it holds. `con` is a cursor owned by the calling thread; `live`
    the engine's state where the collector has one. Raises UnknownRun."""
    return snap.encode(build(con, run_id, cursor=cursor, window_steps=window_steps, live=live, step=step))


def build(con, run_id: str, *, cursor: snap.Cursor | None = None, window_steps: int = snap.DEFAULT_WINDOW_STEPS,
          live: LiveSnapshots | None = None, step: int | None = None) -> snap.Snapshot:
    try:
        return snap.build(con, run_id, cursor=cursor, window_steps=window_steps, source="collector", live=live,
                          step=step)
    except snap.SnapshotError as e:
        raise UnknownRun(str(e)) from e


# ---- the live engine's state as snapshot sections ------------------------------------------------

def _col(x: np.ndarray, pa_type, null: np.ndarray | None = None):
    import pyarrow as pa

    mask = np.isnan(x) if null is None and x.dtype.kind == "f" else null
    return pa.array(x, type=pa_type, mask=mask)


class LiveSnapshots:
    """snapshot.LiveSections over a LiveEngine: the ranks, steps, bubble and offload_rate sections
    from its state, with the SQL's definitions (collector/query/snapshot.py) and Arrow types.

    Each call takes the engine's lock once and reduces the window to a few per-step figures and
    one row per rank while holding it (vectorised numpy). A step's figures are kept until a row
    lands in its slot again (the slot's last-row time changes), so a snapshot recomputes only the
    steps that changed since the last: at 16,384 ranks the newest one or two, not all 30."""

    provides = ("ranks", "steps", "bubble", "offload_rate")
    #: per-step figures kept (runs x steps); beyond it the oldest are dropped
    MAX_CACHED = 4096

    def __init__(self, engine) -> None:
        self.engine = engine
        self._per_step: dict[tuple[str, int], tuple[tuple[int, int, int], dict]] = {}

    def _step_figures(self, run, s: int, F) -> dict | None:
        """One step's rows of the steps, bubble and offload_rate sections (cached, see above)."""
        slot = run.slot_of(s) if s >= 0 else -1
        if slot < 0:
            return None
        stamp = (int(run.slot_step[slot]), int(run.slot_last_ns[slot]), int(run.started.sum()))  # a late RUN_START too
        hit = self._per_step.get((run.run_id, s))
        if hit is not None and hit[0] == stamp:
            return hit[1]
        fig = {"steps": self._steps_row(run, s, slot, F), "bubble": self._bubble_rows(run, s, slot, F),
               "offload_rate": self._offload_rows(run, s, slot, F)}
        self._per_step[(run.run_id, s)] = (stamp, fig)
        while len(self._per_step) > self.MAX_CACHED:
            self._per_step.pop(next(iter(self._per_step)))
        return fig

    def lost(self, run_id: str):
        """The snapshot's `lost` section from the engine's lost-time gauges over its window (GPU
        time lost per cause and the rank most of it is charged to), with the SQL section's columns;
        None when the engine has judged no step of the run (the SQL is used)."""
        import math

        import pyarrow as pa

        from collector.query.snapshot import lost_schema

        g = next((g for g in self.engine.gauges() if g.run_id == run_id), None)
        if g is None or not g.lost_window_gpu_s or not (g.lost_window_span_s > 0):
            return None
        ms = {c: float(v) * 1e3 for c, v in g.lost_window_gpu_s.items()}
        total_ms = sum(ms.values())
        span_ns = int(g.lost_window_span_s * 1e9)
        keys = ("straggler", "data", "pipeline", "comm")
        rows = [{"rank": None, **{f"{c}_gpu_ms": ms.get(c, 0.0) for c in keys}, "lost_gpu_ms": total_ms,
                 "steps": 1, "first_end_ns": 0, "last_end_ns": span_ns}]
        if g.lost_window_top_rank >= 0 and not math.isnan(g.lost_window_top_rank_share):
            rows.append({"rank": g.lost_window_top_rank, **{f"{c}_gpu_ms": None for c in keys},
                         "lost_gpu_ms": g.lost_window_top_rank_share * total_ms, "steps": 1,
                         "first_end_ns": 0, "last_end_ns": span_ns})
        return pa.Table.from_pylist(rows, schema=lost_schema()), float(g.lost_window_s)

    def judged(self, run_id: str) -> dict | None:
        """The engine's counts of the run's steps judged on part of the ranks and skipped unjudged
        (the TUI's "judged on part of the run" line); None before it judged a step of the run."""
        g = next((g for g in self.engine.gauges() if g.run_id == run_id), None)
        if g is None:
            return None
        return {"steps_incomplete": int(g.steps_incomplete), "last_incomplete_step": int(g.last_incomplete_step),
                "steps_skipped": int(g.steps_skipped)}

    def latest_step(self, run_id: str, world: int) -> int | None:
        def pick(state):
            run = state.runs.get(run_id)
            if run is None or world <= 0:
                return None
            for s in range(run.newest_step, max(run.newest_step - run.window, -1), -1):
                slot = run.slot_of(s)
                if slot >= 0 and int(run.present[slot].sum()) >= world:
                    return s
            return None

        return self.engine.read(pick)

    def stamp(self, run_id: str, lo: int, step: int) -> tuple | None:
        def read(state):
            run = state.runs.get(run_id)
            if run is None or run.first_step < 0 or run.first_step > lo or lo <= run.newest_step - run.window:
                return None  # the state may not have seen every row of these steps
            out = []
            for s in range(lo, step + 1):
                slot = run.slot_of(s)
                out.append((s, int(run.slot_last_ns[slot])) if slot >= 0 else (s, -1))
            return tuple(out)

        return self.engine.read(read)

    def sections(self, run_id: str, step: int, lo: int, gpus) -> dict | None:
        return self.engine.read(lambda state: self._sections(state, run_id, step, lo, gpus))

    def _sections(self, state, run_id: str, step: int, lo: int, gpus) -> dict | None:
        from collector.live.state import F

        run = state.runs.get(run_id)
        # the state must hold every step lo..step from their first row on, and the run's RUN_START
        if (run is None or not run.started.any() or run.first_step < 0 or run.first_step > lo
                or lo <= run.newest_step - run.window or run.slot_of(step) < 0):
            return None
        return {"ranks": self._ranks(run, step, gpus, F), "steps": self._steps(run, step, lo, F),
                "bubble": self._bubble(run, step, lo, F), "offload_rate": self._offload(run, step, lo, F)}

    @staticmethod
    def _ranks(run, step: int, gpus, F):
        import pyarrow as pa

        ranks = np.flatnonzero(run.started)
        slot = run.slot_of(step)
        d = run.data[slot][:, ranks]
        here = run.present[slot, ranks]
        nan = np.full(len(ranks), np.nan)

        def ms(name: str) -> np.ndarray:
            return np.where(here, d[F[name]] / 1e6, nan)

        wait_ns = d[F["coll_wait_ns"]] + d[F["p2p_ns"]]
        wait = np.where(wait_ns > 0, wait_ns / 1e6, nan)
        # memory: the step's latest sample, else the step before's (the SQL: steps step-1..step)
        mem, budget = nan.copy(), nan.copy()
        for s in (step - 1, step):
            sl = run.slot_of(s) if s >= 0 else -1
            if sl < 0:
                continue
            m = run.data[sl][:, ranks]
            has = (m[F["rss_bytes"]] != 0) | (m[F["allocated_bytes"]] != 0) | (m[F["budget_bytes"]] != 0)
            val = np.where(m[F["allocated_bytes"]] >= 0, m[F["allocated_bytes"]], m[F["rss_bytes"]])
            mem = np.where(has, val, mem)
            budget = np.where(has, m[F["budget_bytes"]], budget)
        node = run.hostname[ranks].astype(str)
        # the rank's GPU: its place among its node's ranks (by rank), as the SQL's local_rank
        order = np.lexsort((ranks, node))
        local = np.empty(len(ranks), np.int64)
        sn = node[order]
        starts = np.r_[0, np.flatnonzero(sn[1:] != sn[:-1]) + 1] if len(sn) else np.zeros(0, np.int64)
        counts = np.diff(np.r_[starts, len(sn)])
        local[order] = np.arange(len(sn)) - np.repeat(starts, counts)
        util = nan.copy()
        if gpus is not None and gpus.num_rows:
            g = {(n, int(i)): u for n, i, u in zip(gpus.column("node").to_pylist(), gpus.column("gpu").to_pylist(),
                                                    gpus.column("util_pct").to_pylist())}
            util = np.array([g.get((n, int(k))) if g.get((n, int(k))) is not None else np.nan
                             for n, k in zip(node, local)], np.float64) if g else util
        tp, dp = max(run.tp, 1), max(run.dp, 1)
        return pa.table({
            "rank": pa.array(ranks, pa.int32()),
            "stage": pa.array(run.stage[ranks], pa.int32()),
            "replica": pa.array((ranks // tp) % dp, pa.int32()),
            "tp_rank": pa.array(ranks % tp, pa.int32()),
            "node": pa.array(node, pa.string()),
            "step_ms": _col(ms("duration_ns"), pa.float64()),
            "compute_ms": _col(ms("compute_ns"), pa.float64()),
            "wait_ms": _col(wait, pa.float64()),
            "data_wait_ms": _col(ms("data_wait_ns"), pa.float64()),
            "forward_ms": _col(ms("forward_ns"), pa.float64()),
            "backward_ms": _col(ms("backward_ns"), pa.float64()),
            "optimizer_ms": _col(ms("optimizer_ns"), pa.float64()),
            "comm_exposed_ms": _col(ms("comm_exposed_ns"), pa.float64()),
            "mem_bytes": _col(mem, pa.float64()),
            "mem_budget_bytes": _col(budget, pa.float64()),
            "gpu_util_pct": _col(util, pa.float64()),
            "reported": pa.array(here.astype(np.int32), pa.int32()),
        })

    _STEPS_COLS = ("step", "ranks", "step_ms_p50", "step_ms_max", "data_wait_ms", "forward_ms", "backward_ms",
                   "optimizer_ms", "comm_exposed_ms", "compute_ms", "tokens", "samples", "tokens_per_s", "mfu",
                   "grad_sync_ms_p99")

    def _window(self, run, step: int, lo: int, F) -> list[dict]:
        return [f for f in (self._step_figures(run, s, F) for s in range(lo, step + 1)) if f is not None]

    def _steps(self, run, step: int, lo: int, F):
        import pyarrow as pa

        rows = [f["steps"] for f in self._window(run, step, lo, F) if f["steps"] is not None]
        types = {"step": pa.int64(), "ranks": pa.int64(), "tokens": pa.int64(), "samples": pa.int64()}
        return pa.table({k: pa.array([r[k] for r in rows], types.get(k, pa.float64())) for k in self._STEPS_COLS})

    @staticmethod
    def _steps_row(run, s: int, slot: int, F) -> dict | None:
        here = run.present[slot]
        if not here.any():
            return None
        d = run.data[slot]
        dur = d[F["duration_ns"], here]
        row = {"step": s, "ranks": int(here.sum()), "step_ms_p50": float(np.quantile(dur, 0.5)) / 1e6,
               "step_ms_max": float(dur.max()) / 1e6}
        for name in ("data_wait", "forward", "backward", "optimizer", "comm_exposed", "compute"):
            row[name + "_ms"] = float(d[F[name + "_ns"], here].mean()) / 1e6
        row["tokens"] = int(d[F["tokens"], here].sum())
        row["samples"] = int(d[F["samples"], here].sum())
        tps = d[F["tokens_per_s"]]
        had = ~np.isnan(tps)  # a THROUGHPUT row came in
        row["tokens_per_s"] = float(tps[had].sum()) if had.any() else None
        mfu = d[F["mfu"], had]
        mfu = mfu[~np.isnan(mfu)]
        row["mfu"] = float(mfu.mean()) if len(mfu) else None
        gs = d[F["dp_coll_ns"]]
        gs = gs[gs > 0]
        row["grad_sync_ms_p99"] = float(np.quantile(gs, 0.99)) / 1e6 if len(gs) else None
        return row

    def _bubble(self, run, step: int, lo: int, F):
        import pyarrow as pa

        rows = [r for f in self._window(run, step, lo, F) for r in f["bubble"]]
        return pa.table({"stage": pa.array([r[0] for r in rows], pa.int32()),
                         "step": pa.array([r[1] for r in rows], pa.int64()),
                         "bubble_rate": pa.array([r[2] for r in rows], pa.float64()),
                         "ideal_bubble_rate": pa.array([r[3] for r in rows], pa.float64())})

    @staticmethod
    def _bubble_rows(run, s: int, slot: int, F) -> list[tuple]:
        if run.pp <= 1:
            return []
        ideal = (run.pp - 1) / (run.micro_batches + run.pp - 1)
        d = run.data[slot]
        ok = run.present[slot] & run.started & (d[F["duration_ns"]] > 0)
        if not ok.any():
            return []
        stage = run.stage[ok].astype(np.int64)
        base = int(stage.min())
        busy = np.bincount(stage - base, weights=d[F["forward_ns"], ok] + d[F["backward_ns"], ok])
        dur = np.bincount(stage - base, weights=d[F["duration_ns"], ok])
        n = np.bincount(stage - base)
        return [(int(k) + base, s, float(1 - busy[k] / dur[k]), ideal) for k in np.flatnonzero(n)]

    def _offload(self, run, step: int, lo: int, F):
        import pyarrow as pa

        rows = [r for f in self._window(run, step, lo, F) for r in f["offload_rate"]]
        return pa.table({"step": pa.array([r[0] for r in rows], pa.int64()),
                         "direction": pa.array([r[1] for r in rows], pa.string()),
                         "bytes": pa.array([r[2] for r in rows], pa.int64()),
                         "gbps": pa.array([r[3] for r in rows], pa.float64())})

    @staticmethod
    def _offload_rows(run, s: int, slot: int, F) -> list[tuple]:
        d = run.data[slot]
        out = []
        for direction in ("d2h", "h2d"):
            nb, ns = float(d[F[direction + "_bytes"]].sum()), float(d[F[direction + "_ns"]].sum())
            if nb or ns:
                out.append((s, direction, int(nb), nb / ns if ns else None))
        return out
