"""Query.Watch from the live engine's state: a real collector (gRPC on loopback, its live engine
fed by the writer's on_commit) takes a real reference run's recorded rows (the committed fixture,
shipped through a real Shipper); at several steps the sections the engine's state builds (ranks,
steps, bubble, offload_rate) equal those its SQL builds over the same file, column by column, with
the same Arrow types. A state that does not hold the steps (an engine started after them: a
collector restarted on the file) falls back to the SQL; and a TUI watching gets live-built
snapshots."""

from __future__ import annotations

import math
import threading
import time

import pytest

from collector import app
from collector.live.engine import LiveEngine
from collector.live.rules import defaults
from collector.query import snapshot as snap
from collector.query.watch import LiveSnapshots, build
from tests.tui.fixture import (
    RUN_ID,
    STRAGGLER_FROM_STEP,
    STRAGGLER_RANK,
    last_step,
    raw,
    replay_into,
    same_table,
)
from tui.sources import CollectorSource


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    path = tmp_path_factory.mktemp("watch_live") / "c.duckdb"
    handle = app.serve(app.CollectorConfig(str(path), "127.0.0.1:0", rules=defaults()))
    try:
        replay_into(handle.address)
        engine = handle.collector.live
        deadline = time.monotonic() + 60
        # the engine ingests after the commit, on its own thread: wait until it holds the last step
        while LiveSnapshots(engine).latest_step(RUN_ID, 4) != last_step():
            assert time.monotonic() < deadline, "the live engine never held the run's last step"
            time.sleep(0.05)
        yield handle
    finally:
        handle.stop()


def test_live_and_sql_snapshots_agree_on_a_real_run(collector) -> None:
    live = LiveSnapshots(collector.collector.live)
    cur = collector.collector.con.cursor()
    try:
        steps = (0, STRAGGLER_FROM_STEP - 1, STRAGGLER_FROM_STEP + 2, last_step())
        for k in steps:
            a = build(cur, RUN_ID, step=k, live=live)
            b = build(cur, RUN_ID, step=k)
            assert (a.header["built_from"], b.header["built_from"]) == ("live", "sql"), k
            assert list(a.tables) == list(b.tables)
            for name in LiveSnapshots.provides:
                same_table(a.table(name), b.table(name), f"step {k} {name}")
            assert a.table("ranks").num_rows == 4 and sum(a.table("ranks").column("reported").to_pylist()) == 4
        # the straggler is the straggler in the live-built ranks too (ground truth: the injection)
        ranks = build(cur, RUN_ID, step=last_step(), live=live).table("ranks").to_pylist()
        compute = {r["rank"]: r["compute_ms"] for r in ranks}
        assert max(compute, key=compute.get) == STRAGGLER_RANK
        # and the figures are the file's raw rows
        (raw_ms,) = raw("SELECT compute_ns / 1e6 FROM step WHERE run_id = ? AND step = ? AND rank = ?",
                        [RUN_ID, last_step(), STRAGGLER_RANK])[0]
        assert math.isclose(compute[STRAGGLER_RANK], raw_ms)
        # with no step asked, the live path picks the latest complete step, as the SQL's does; a
        # watcher's cursor keeps the step-bound sections while no row of their steps comes in
        c = snap.Cursor(RUN_ID)
        first = build(cur, RUN_ID, cursor=c, live=live)
        again = build(cur, RUN_ID, cursor=c, live=live)
        sql = build(cur, RUN_ID, step=last_step())
        assert first.step == again.step == last_step()
        assert set(c.stamped) == set(snap.STEP_BOUND)
        for name in snap.SECTIONS:
            if name != "steps" and name not in snap.REPLAY_ONLY:  # REPLAY_ONLY: empty for a watcher
                same_table(again.table(name), sql.table(name), f"cursor {name}")
        for name in snap.STEP_BOUND:
            assert again.table(name) is first.table(name)  # kept, not queried again
        assert all(first.table(name).num_rows == 0 for name in snap.REPLAY_ONLY)
    finally:
        cur.close()


def test_an_engine_that_missed_the_steps_falls_back_to_sql(collector) -> None:
    fresh = LiveEngine(defaults())  # started after the run's rows: a collector restarted on the file
    cur = collector.collector.con.cursor()
    try:
        a = build(cur, RUN_ID, step=last_step(), live=LiveSnapshots(fresh))
        b = build(cur, RUN_ID, step=last_step())
        assert a.header["built_from"] == "sql"
        for name in LiveSnapshots.provides:
            same_table(a.table(name), b.table(name), name)
    finally:
        cur.close()


def test_a_watching_tui_gets_live_built_snapshots(collector) -> None:
    src = CollectorSource(collector.address)
    src.open()
    try:
        stop = threading.Event()
        for s in src.watch(0.2, stop):
            assert s.header["built_from"] == "live" and s.step == last_step()
            assert s.table("ranks").num_rows == 4
            break
    finally:
        src.close()


def test_the_lost_line_comes_from_the_engines_gauges(collector) -> None:
    """Live, the lost section is the engine's lost-time gauges (collector/live/lost.py over the
    steps it judged), not SQL per new step; it names the injected straggler, as the SQL does."""
    live = LiveSnapshots(collector.collector.live)
    got = live.lost(RUN_ID)
    assert got is not None
    table, window_s = got
    g = next(g for g in collector.collector.live.gauges() if g.run_id == RUN_ID)
    assert window_s == g.lost_window_s
    rows = table.to_pylist()
    total = rows[0]
    assert total["rank"] is None and math.isclose(total["lost_gpu_ms"], 1e3 * sum(g.lost_window_gpu_s.values()))
    assert rows[1]["rank"] == STRAGGLER_RANK and rows[1]["lost_gpu_ms"] > 0.5 * total["lost_gpu_ms"]
    cur = collector.collector.con.cursor()
    try:
        a = build(cur, RUN_ID, step=last_step(), live=live)
        b = build(cur, RUN_ID, step=last_step())
        assert a.table("lost").schema == b.table("lost").schema
        assert a.header["lost_window_s"] == window_s
        sql_top = next(r for r in b.table("lost").to_pylist() if r["rank"] is not None)
        assert sql_top["rank"] == STRAGGLER_RANK
    finally:
        cur.close()
    # and the TUI's line reads it
    from tui.core import lost_figure

    fig = lost_figure(a)
    assert fig is not None and f"rank {STRAGGLER_RANK}" in fig.note
