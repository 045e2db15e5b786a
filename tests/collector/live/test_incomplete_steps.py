"""A step judged without every rank says so: in each alert raised or updated on it ("judged on 7 of 8
ranks (missing: 5)"; an alert that went firing on it keeps saying so while it fires), and in its
run's gauges (steps judged so, the latest of them). A complete run's alert says nothing of the kind.

The rows are built here, so the ranks missing from each step are known; they are fed to the engine's
Evaluator on a clock the test sets (the collector's receive times, as test_step_deadline.py does), then
through a real Writer into a real DuckDB file with the LiveEngine's thread on the test's clock (the
alerts table, /metrics, and the recompute over the same file)."""

from __future__ import annotations

import threading
import time

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collector.export import Exports
from collector.ingest.schema import connect, open_store
from collector.ingest.writer import QueuedBatch, StreamReplies, Writer, batch_to_arrow
from collector.live.engine import Evaluator, LiveEngine
from collector.live.model import FIRING
from collector.live.replay import recompute
from collector.live.rules import parse
from collector.query import snapshot as snap
from collector.query import watch
from tests.collector.live.test_engine import _coll_cols, _run_start, _step_cols
from tracetop.events import Kind
from tracetop.wire.codec import decode_batch, encode_batch
from tui.widgets import head_text

# every rank waits 300 ms in its gradient all-reduce: the p99 breaches whichever ranks are judged
RULES = parse('[rule.gs]\nsignal = "grad_sync"\ngrad_sync_ms_above = 200\nfor_steps = 2\n')
S = 10**9
DEADLINE_S = 15.0  # the engine's default step deadline


def _rows(kind: Kind, step: int, world: int, ranks: list[int]) -> dict:
    """`kind`'s rows of `step` for `ranks` of a run of `world` ranks (a grad-sync of 300 ms each)."""
    cols = _coll_cols(step, np.full(world, 300.0)) if kind == Kind.COLLECTIVE else \
        _step_cols(step, world, np.full(world, 50.0))
    keep = np.array(ranks, np.int64)
    return {k: (v[0][keep], v[1]) if isinstance(v, tuple) else v[keep] for k, v in cols.items()}


def _step(ev: Evaluator, run: str, t_s: float, step: int, world: int, ranks: list[int]) -> None:
    """`ranks`' rows of `step` received at `t_s`: every rank's collectives, the STEP rows of `ranks` only."""
    ev.ingest(Kind.COLLECTIVE, run, _rows(Kind.COLLECTIVE, step, world, list(range(world))), int(t_s * S))
    ev.ingest(Kind.STEP, run, _rows(Kind.STEP, step, world, ranks), int(t_s * S))


def test_an_alert_judged_without_a_rank_names_it_and_the_run_counts_the_step():
    ev = Evaluator(RULES)
    everyone = list(range(8))
    # (receive time s, step, the ranks whose STEP row comes): run "part" loses rank 5's row of step 1
    # and ranks 3 and 5's of step 3 (they never come); run "full" gets every row; run "wide" (20
    # ranks) loses 11 of its step 0 (more than a message lists). Each step after an incomplete one
    # comes once that one was judged, so that the words of each step can be read between the two.
    part = [(1.0, 0, everyone), (2.0, 1, [r for r in everyone if r != 5]), (18.0, 2, everyone),
            (19.0, 3, [r for r in everyone if r not in (3, 5)]), (35.0, 4, everyone)]
    for name, world in (("part", 8), ("full", 8), ("wide", 20)):
        ev.ingest(Kind.RUN_START, name, _run_start(world), 0)
    feed = [("part", t, s, 8, ranks) for t, s, ranks in part] + [("full", t, s, 8, everyone) for t, s, _ in part]
    feed.append(("wide", 1.0, 0, 20, [0, 1, *range(13, 20)]))
    feed.sort(key=lambda x: x[1])
    # the engine's thread: each delivery at its time, the ready steps judged after it and every 0.5 s;
    # after each judgment, the alert's words as they stood at the step it was last updated on
    said: dict[tuple[str, int], str] = {}
    judged_at: dict[tuple[str, int], float] = {}
    i = 0
    for tick in range(0, 2 * 40 + 1):
        t = tick / 2
        while i < len(feed) and feed[i][1] <= t:
            _step(ev, feed[i][0], *feed[i][1:])
            i += 1
        ev.evaluate_ready(int(t * S), t)
        for name, run in ev.state.runs.items():
            for s in range(run.last_judged + 1):
                judged_at.setdefault((name, s), t)
        for a in ev.book.all():
            said[(a.run_id, a.last_step)] = a.message
    # step 1 of "part" waited for rank 5 until the deadline (15 s after its first STEP row), not longer
    assert 2.0 + DEADLINE_S < judged_at[("part", 1)] <= 2.0 + DEADLINE_S + 0.5
    assert judged_at[("full", 1)] < 4.0
    assert 19.0 + DEADLINE_S < judged_at[("part", 3)] <= 19.0 + DEADLINE_S + 0.5
    # the alert went firing on that step (its hold: steps 0 and 1), judged on 7 ranks, and says so
    fired = [a for a in ev.book.all() if a.run_id == "part"]
    assert [(a.state, a.first_step, a.fired_step) for a in fired] == [(FIRING, 0, 1)]
    assert said[("part", 0)].count("judged on") == 0, said[("part", 0)]
    assert said[("part", 1)].count("; judged on 7 of 8 ranks (missing: 5)") == 1, said[("part", 1)]
    assert "went firing" not in said[("part", 1)]  # it is that step's own judgment
    # complete again: that step stood on every rank; what it went firing on stays said while it fires
    fired_on = "; it went firing on step 1, judged on 7 of 8 ranks (missing: 5)"
    assert "; judged on" not in said[("part", 2)] and said[("part", 2)].count(fired_on) == 1, said[("part", 2)]
    assert said[("part", 3)].count("; judged on 6 of 8 ranks (missing: 3, 5)") == 1, said[("part", 3)]
    assert said[("part", 3)].count(fired_on) == 1, said[("part", 3)]
    assert "; judged on" not in said[("part", 4)] and said[("part", 4)].count(fired_on) == 1, said[("part", 4)]
    # the complete run: the same alert, never a word of the kind
    full = [a for a in ev.book.all() if a.run_id == "full"]
    assert [(a.state, a.fired_step) for a in full] == [(FIRING, 1)]
    assert not any("judged on" in m for (run, _), m in said.items() if run == "full")
    # more missing than a message lists: the first 8, then how many more
    assert said[("wide", 0)].count("; judged on 9 of 20 ranks (missing: 2, 3, 4, 5, 6, 7, 8, 9, +3 more)") == 1, \
        said[("wide", 0)]
    # the runs' gauges count their own incomplete steps, exactly
    g = ev.gauges_by_run
    assert (g["part"].steps_incomplete, g["part"].last_incomplete_step) == (2, 3)
    assert (g["full"].steps_incomplete, g["full"].last_incomplete_step) == (0, -1)
    assert (g["wide"].steps_incomplete, g["wide"].last_incomplete_step) == (1, 0)
    assert ev.stats.steps_incomplete == 3  # the engine-wide count is their sum


class _Replies(StreamReplies):
    def deliver(self, item) -> None:  # the acks: nobody waits on them here
        pass


def _wait(what: str, ok, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = ok()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_stored_alert_the_gauges_on_metrics_and_the_recompute_say_it_too(tmp_path):
    """A real Writer commits the rows into a real file and hands them to the LiveEngine's thread,
    whose clock the test sets: rank 2's STEP row of step 1 never comes; at the deadline the alert
    fires, its row in `alerts` says so, /metrics counts the step for the run, and the recompute over
    the file (where the row is missing as well) words it the same."""
    path = str(tmp_path / "c.duckdb")
    con = open_store(path)
    now = [0]
    lock = threading.Lock()

    def clock() -> int:
        with lock:
            return now[0]

    eng = LiveEngine(RULES, con=con.cursor(), clock_ns=clock, tick_s=0.05)
    writer = Writer(con, flush_rows=10**6, flush_interval_s=0.02, on_commit=eng.on_commit)
    eng.start()
    writer.start()
    seq = 0

    def deliver(t_s: float, kind: Kind, cols: dict) -> None:
        """Rows received at t_s: committed by the writer, ingested by the engine on its clock at t_s."""
        nonlocal seq
        with lock:
            now[0] = int(t_s * S)
        seq += 1
        b = decode_batch(encode_batch(kind, cols, source_id="src", seq=seq, run_id="r"))
        taken = eng.stats.batches
        writer.submit(QueuedBatch(_Replies(), b, batch_to_arrow(b)))
        _wait(f"batch {seq} ingested", lambda: eng.stats.batches > taken)

    try:
        deliver(0.0, Kind.RUN_START, _run_start(4))
        for t, step, ranks in ((1.0, 0, [0, 1, 2, 3]), (2.0, 1, [0, 1, 3])):
            deliver(t, Kind.COLLECTIVE, _rows(Kind.COLLECTIVE, step, 4, [0, 1, 2, 3]))
            deliver(t, Kind.STEP, _rows(Kind.STEP, step, 4, ranks))
        with lock:
            now[0] = int((2.0 + DEADLINE_S + 1) * S)
        rows = _wait("the firing alert's row", lambda: con.cursor().execute(
            "SELECT state, first_step, fired_step, last_step, message FROM alerts").fetchall())
        assert [r[:4] for r in rows] == [("firing", 0, 1, 1)], rows
        assert rows[0][4].count("; judged on 3 of 4 ranks (missing: 2)") == 1, rows[0][4]
        g = eng.gauges()
        assert [(x.run_id, x.steps_incomplete, x.last_incomplete_step) for x in g] == [("r", 1, 1)]
        reg = CollectorRegistry()
        Exports().attach_metrics(reg, eng.gauges, eng.alerts)
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}
        assert got[("tracetop_run_live_steps_incomplete_total", (("run_id", "r"),))] == 1
        assert got[("tracetop_run_live_last_incomplete_step", (("run_id", "r"),))] == 1
        # the TUI's header: a live snapshot of the run says its judgments stand on part of it
        built = watch.build(con.cursor(), "r", cursor=snap.Cursor("r"), live=watch.LiveSnapshots(eng))
        assert built.header["live_judged"] == {"steps_incomplete": 1, "last_incomplete_step": 1,
                                               "steps_skipped": 0}
        line = head_text(built, description="collector", live=True, paused=False, note="").plain
        assert "1 step judged on part of the ranks (latest 1)" in line, line
        assert "skipped" not in line, line
    finally:
        writer.close()
        eng.close()
    assert eng.errors == 0
    con.close()
    ro = connect(path, read_only=True)
    try:
        again = [a for a in recompute(ro, RULES) if a.state != "pending"]
    finally:
        ro.close()
    assert [(a.state, a.first_step, a.fired_step) for a in again] == [(FIRING, 0, 1)]
    assert "; judged on 3 of 4 ranks (missing: 2)" in again[0].message
