"""A step longer than the step deadline is judged on all its ranks, as its recompute judges it.

The failure kept from two live runs into one collector (/tmp/suite/lrA-failed-keep): the `hang` run's
step 12 lasted 35 s (rank 1 hung in an all_reduce until the gloo timeout). Its ranks shipped the
step's finished collectives every flush while it ran, so the slot's first row came ~35 s before its
STEP rows; the deadline (15 s from that first row) had long passed when rank 1's STEP row came in,
and the engine judged step 12 at once on rank 1 alone (grad-sync p99 0 ms, comm share 0.99857: the
file's stored comm_share value, only rank 1's row gives it). The other ranks' STEP rows came 0.2 s
later. The recompute over the file judged all four (p99 33,963 ms) and raised grad_sync from step 10.

Here the same shape with rows the test controls, fed to the engine's Evaluator on a clock the test
sets (the collector's receive times) and written to a real DuckDB file for the recompute."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from collector.ingest.schema import connect, open_store
from collector.ingest.writer import insert_rows
from collector.live.engine import Evaluator
from collector.live.replay import recompute
from collector.live.rules import parse
from tests.collector.live.test_engine import _run_start
from tracetop.events import SCHEMAS, Kind, table_name

RULES = parse('[rule.gs]\nsignal = "grad_sync"\ngrad_sync_ms_above = 200\nfor_steps = 3\n')
RANKS, HANG_STEP, HANG_S = 4, 3, 35.0
S = 10**9


def _step(step: int, ranks: list[int], start_ns: int, dur_ns: int) -> dict:
    n = len(ranks)
    z = np.zeros(n, np.int64)
    return {"rank": np.array(ranks, np.int32), "step": np.full(n, step, np.int64),
            "start_ns": np.full(n, start_ns, np.int64), "duration_ns": np.full(n, dur_ns, np.int64),
            "data_wait_ns": z, "forward_ns": np.full(n, 20_000_000, np.int64), "backward_ns": z, "optimizer_ns": z,
            "comm_exposed_ns": z, "compute_ns": np.full(n, 20_000_000, np.int64), "tokens": np.full(n, 1024, np.int64),
            "samples": np.full(n, 32, np.int64), "loss": np.full(n, np.nan), "micro_batch": np.ones(n, np.int32),
            "micro_batches": np.ones(n, np.int32)}


def _coll(step: int, ranks: list[int], start_ns: int, ms: list[float]) -> dict:
    n = len(ranks)
    return {"rank": np.array(ranks, np.int32), "step": np.full(n, step, np.int64),
            "start_ns": np.full(n, start_ns, np.int64), "duration_ns": (np.array(ms) * 1e6).astype(np.int64),
            "op": (np.zeros(n, np.int32), ("all_reduce",)), "role": (np.zeros(n, np.int32), ("dp",)),
            "group_size": np.full(n, RANKS, np.int32), "bytes": np.full(n, 1 << 20, np.int64),
            "peer": np.full(n, -1, np.int32), "dtype": (np.zeros(n, np.int32), ("float32",)),
            "is_async": np.zeros(n, np.int32)}


def _deliveries() -> list[tuple[float, Kind, dict]]:
    """(collector receive time s, kind, rows): steps 0..2 of 1 s; steps 1 and 2 with grad-sync 300 ms on
    rank 3 (p99 above the 200 ms threshold: two of the rule's three steps); step 3 starts at 3 s and hangs 35 s. Its collectives finished
    before the hang (rank 0's 250 ms grad-sync among them) ship with the 5 s flush; rank 1's STEP row
    comes when its timeout ends it, the others' 0.2 s later."""
    out: list[tuple[float, Kind, dict]] = [(0.0, Kind.RUN_START, _run_start(RANKS))]
    for s in range(HANG_STEP):
        out.append((s + 1.1, Kind.COLLECTIVE, _coll(s, list(range(RANKS)), s * S + 500_000_000,
                                                 [5, 5, 5, 300 if s else 5])))
        out.append((s + 1.1, Kind.STEP, _step(s, list(range(RANKS)), s * S, 900_000_000)))
    t0 = HANG_STEP * S
    out.append((5.0, Kind.COLLECTIVE, _coll(HANG_STEP, [0, 2, 3], t0 + 100_000_000, [250, 5, 5])))
    end = HANG_STEP + HANG_S
    out.append((end, Kind.STEP, _step(HANG_STEP, [1], t0, int(HANG_S * S))))
    out.append((end + 0.2, Kind.STEP, _step(HANG_STEP, [0, 2, 3], t0, int(HANG_S * S))))
    return out


def _live(deliveries) -> tuple[Evaluator, list]:
    """The engine's judge fed as its thread feeds it: each delivery ingested at its receive time, the
    ready steps judged after it and every 0.5 s between (the timer)."""
    ev = Evaluator(RULES)
    found = []
    t_end = deliveries[-1][0] + 20
    ticks = sorted({round(x * 0.5, 1) for x in range(int(t_end * 2) + 1)} | {d[0] for d in deliveries})
    i = 0
    for t in ticks:
        while i < len(deliveries) and deliveries[i][0] <= t:
            ev.ingest(deliveries[i][1], "r", deliveries[i][2], int(deliveries[i][0] * S))
            i += 1
        found += ev.evaluate_ready(int(t * S), t)
    return ev, found


def _arrow(kind: Kind, cols: dict) -> pa.Table:
    n = len(cols["rank"])
    arrays, names = [pa.array(["r"] * n)], ["run_id"]
    for c in SCHEMAS[kind]:
        v = cols[c.name]
        arrays.append(pa.array([v[1][k] for k in v[0]], pa.string()) if c.dtype == "str"
                      else pa.array(v, from_pandas=c.dtype == "f8"))
        names.append(c.name)
    return pa.Table.from_arrays(arrays, names=names)


def test_a_step_longer_than_the_deadline_is_judged_on_every_rank_as_its_recompute(tmp_path):
    deliveries = _deliveries()
    ev, found = _live(deliveries)
    run = ev.state.runs["r"]
    assert run.last_judged == HANG_STEP
    assert ev.stats.steps_evaluated == HANG_STEP + 1
    # judged once all four STEP rows were in, not on rank 1's alone the moment it came
    assert ev.stats.steps_incomplete == 0
    assert ev.gauges_by_run["r"].grad_sync_ms_p99 > 200
    # steps 1, 2, 3 breach: the rule fires from step 1 (judged on rank 1 alone, step 3 broke the hold)
    live = {(a.rule, a.first_step) for a in ev.book.all() if a.state != "pending"}
    assert live == {("gs", 1)}, found
    # the same rows in a real collector file: the recompute agrees
    db = str(tmp_path / "c.duckdb")
    con = open_store(db)
    for _, kind, cols in deliveries:
        insert_rows(con, table_name(kind), [_arrow(kind, cols)])
    con.close()
    con = connect(db, read_only=True)
    try:
        again = {(a.rule, a.first_step) for a in recompute(con, RULES) if a.state != "pending"}
    finally:
        con.close()
    assert again == live


def test_a_rank_whose_step_row_never_comes_is_still_judged_at_the_deadline():
    """The deadline still does its work: a step three ranks finished is judged 15 s after their STEP
    rows without the fourth's (named missing, counted incomplete)."""
    ev = Evaluator(RULES)
    ev.ingest(Kind.RUN_START, "r", _run_start(RANKS), 0)
    ev.ingest(Kind.COLLECTIVE, "r", _coll(0, [0, 1, 2, 3], 100_000_000, [5, 5, 5, 5]), 1 * S)
    ev.ingest(Kind.STEP, "r", _step(0, [0, 1, 2], 0, 900_000_000), 20 * S)
    ev.evaluate_ready(34 * S, 34.0)
    assert ev.stats.steps_evaluated == 0  # 14 s after the first STEP row (33 s after the first row)
    ev.evaluate_ready(36 * S, 36.0)
    assert ev.stats.steps_evaluated == 1 and ev.stats.steps_incomplete == 1
