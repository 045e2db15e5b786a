"""Post-mortem judgments: the live engine's code run over a file's stored rows.

`recompute(con, rules)` feeds every run's rows through the same LiveState, judge and AlertBook
the live engine uses, a window of steps at a time, in step order; then it replays the heartbeats
in time order with the clock at each one, for the time-based rules; then it judges the dashboard
rules (cross_node_share, hardware_risk, fragmentation) once, as the live engine's last tick at
close does (`LiveEngine._dashboard_tick(final=True)`): each rule's SQL over its last window_s of
rows, up to each run's newest step end and the agents' newest GPU sample. What it returns is what
the live engine would have found had it seen everything (live == post-mortem is tested).

What differs by cadence: live, a dashboard rule is also judged every every_s during the run; an
alert one of those ticks fired and a later one resolved (a group that crossed nodes for a while)
is in the live file and not in the recompute, which sees only the last window; and a run the live
engine saw end (every rank silent run_end_s before the collector stopped) had its alerts resolved
there, where the recompute may leave them firing. The rules the recompute does not judge at all
are named by `not_recomputed` (`tracetop alerts --recompute` prints them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from collector.live.engine import Evaluator, dashboard_obs, lookup_baseline
from collector.live.model import Alert
from collector.live.rules import Rule
from tracetop.events import SCHEMAS, Kind, table_name

_STEP_KINDS = (Kind.COLLECTIVE, Kind.PIPE_INSTR, Kind.OFFLOAD, Kind.MEMORY, Kind.THROUGHPUT, Kind.STEP)
_NP = {"i4": np.int32, "i8": np.int64, "f8": np.float64}
#: signals the recompute does not judge, and why: what the file lacks, or a replay not written yet
_NOT_IN_FILE = {
    "collector_behind": "the collector's own backlog while it ran is not stored",
    "xid": "the agents' samples and XIDs are not replayed on a clock (hardware_risk, their SQL judgment, is)",
    "thermal_throttle": "the agents' samples are not replayed on a clock (hardware_risk, their SQL judgment, is)",
    "ecc": "the agents' samples are not replayed on a clock (hardware_risk, their SQL judgment, is)",
}


def not_recomputed(rules: Sequence[Rule]) -> list[tuple[str, str]]:
    """(rule name, why) for each enabled rule the recompute does not judge: its absence from the
    recompute says nothing about the run."""
    return [(r.name, _NOT_IN_FILE[r.signal]) for r in rules if r.enabled and r.signal in _NOT_IN_FILE]


def _columns(con, kind: Kind, where: str, params: list) -> dict | None:
    names = [c.name for c in SCHEMAS[kind]]
    sel = ", ".join(f'"{n}"' for n in names)
    table = con.sql(f"SELECT {sel} FROM {table_name(kind)} WHERE {where}", params=params).to_arrow_table()
    if table.num_rows == 0:
        return None
    out: dict = {}
    for col in SCHEMAS[kind]:
        arr = table.column(col.name)
        if col.dtype == "str":
            values = np.asarray([v if v is not None else "" for v in arr.to_pylist()], dtype=object)
            dictionary, codes = np.unique(values, return_inverse=True) if len(values) else (np.array([], object), [])
            out[col.name] = (np.asarray(codes, np.int32), tuple(str(d) for d in dictionary))
        elif col.dtype == "f8":
            out[col.name] = np.asarray(arr.to_numpy(zero_copy_only=False), np.float64)
        else:
            out[col.name] = np.asarray(arr.fill_null(-1).to_numpy(zero_copy_only=False), _NP[col.dtype])
    return out


def recompute(con, rules: Sequence[Rule], *, window: int = 64, baseline: str | None = None,
              runs: Sequence[str] | None = None, tick_s: float = 1.0) -> list[Alert]:
    ev = Evaluator(rules, window=window, baseline=baseline,
                   baseline_lookup=(lambda run_id: lookup_baseline(con, run_id)))
    run_ids = list(runs) if runs else [r[0] for r in con.execute(
        "SELECT run_id FROM (SELECT run_id, min(start_ns) AS t FROM step GROUP BY run_id) ORDER BY t").fetchall()]
    for run_id in run_ids:
        cols = _columns(con, Kind.RUN_START, "run_id = ?", [run_id])
        if cols is not None:
            ev.ingest(Kind.RUN_START, run_id, cols, 0)
        lo, hi = con.execute("SELECT min(step), max(step) FROM step WHERE run_id = ? AND step >= 0", [run_id]).fetchall()[0]
        if lo is None:
            continue
        chunk = max(1, window // 2)
        for a in range(int(lo), int(hi) + 1, chunk):
            b = a + chunk - 1
            last_ns = 0
            for kind in _STEP_KINDS:
                c = _columns(con, kind, "run_id = ? AND step BETWEEN ? AND ?", [run_id, a, b])
                if c is not None:
                    last_ns = max(last_ns, int(np.max(c["start_ns"] + c["duration_ns"])))
                    ev.ingest(kind, run_id, c, last_ns)
            ev.evaluate_ready(last_ns, 1e9, final=True)
        # heartbeats in time order, the clock at each tick of heartbeat time
        hb = _columns(con, Kind.HEARTBEAT, "run_id = ? ORDER BY start_ns", [run_id])
        if hb is not None and ev.timer_rules:
            t = hb["start_ns"]
            i = 0
            now = int(t[0])
            end = int(t[-1])
            while now <= end:
                j = int(np.searchsorted(t, now, side="right"))
                if j > i:
                    part = {k: (v[0][i:j], v[1]) if isinstance(v, tuple) else v[i:j] for k, v in hb.items()}
                    ev.ingest(Kind.HEARTBEAT, run_id, part, now)
                    i = j
                ev.evaluate_timer(now)
                now += int(tick_s * 1e9)
    _dashboard_final(con, ev)
    return ev.book.all()


def _dashboard_final(con, ev: Evaluator) -> None:
    """The dashboard rules once, as `LiveEngine._dashboard_tick(final=True)`: the runs not ended
    (their newest step end, the ranks' clock) and the agents' newest GPU sample."""
    if not ev.dashboard_rules:
        return
    runs = ev.dashboard_runs()  # the runs replayed: the state holds no other
    gpu_ns = int(con.execute(f"SELECT coalesce(max(start_ns), 0) FROM {table_name(Kind.GPU_SAMPLE)}").fetchone()[0])
    now = max([gpu_ns, *runs.values()])
    for rule in ev.dashboard_rules:
        for run_id, obs in dashboard_obs(con, rule, runs, gpu_ns).items():
            ev.book.update(rule, run_id, obs, -1, now, True)
