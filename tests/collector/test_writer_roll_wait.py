"""The views' roll waits out a burst of commits (`Writer(roll_quiet_s=)`, writer.ROLL_QUIET_S).

Under a burst the writer's queue is short of a commit's worth after each commit, so a roll that
waited only for that started between two of the burst's commits and took the cores they wanted.
Here a burst commits every ~0.1 s for 3 s (shorter than ROLL_DEFER_S, 5 s) far past the roll's
bound: with roll_quiet_s = 2 s nothing rolls until 2 s after its last commit; with 0 (the old wait)
the roll runs during the burst. The real Writer over a real file."""

from __future__ import annotations

import time

from collector.ingest import rollup
from collector.ingest.schema import open_store
from collector.ingest.writer import ROLL_DEFER_S, Writer
from tests.collector.test_writer_checkpoint import _Acks, _step_batch

BURST_S = 3.0
QUIET_S = 2.0


def _rolled(con) -> int:
    cur = con.cursor()
    try:
        return int(dict(cur.execute("SELECT table_name, rows_upto FROM rollup_state").fetchall()).get("step", 0))
    finally:
        cur.close()


def _burst(tmp_path, monkeypatch, quiet_s: float) -> tuple[int, float, float | None]:
    """(rows rolled by the burst's end, its last commit, when the roll was first seen; monotonic)."""
    monkeypatch.setattr(rollup, "ROLL_EVERY_ROWS", 3000)
    con = open_store(str(tmp_path / f"q{quiet_s}.duckdb"))
    writer = Writer(con, flush_rows=1000, flush_interval_s=0.05, roll_quiet_s=quiet_s)
    writer.start()
    try:
        replies, i, t0 = _Acks(), 0, time.monotonic()
        while time.monotonic() - t0 < BURST_S:  # 4,000 step rows a commit: past the bound at the first
            writer.submit(_step_batch(replies, i))
            replies.wait(i + 1)
            last = time.monotonic()  # the commit ended before its ack came
            i += 1
            time.sleep(0.1)
        during = _rolled(con)
        seen = None
        while time.monotonic() - last < QUIET_S + 30:
            if _rolled(con) > 0:
                seen = time.monotonic()
                break
            time.sleep(0.02)
        return during, last, seen
    finally:
        writer.close()
        con.close()


def test_the_roll_waits_for_a_burst_to_end_then_rolls(tmp_path, monkeypatch) -> None:
    assert BURST_S + 1.0 < ROLL_DEFER_S  # the burst ends before the wait's bound
    during, last, seen = _burst(tmp_path, monkeypatch, QUIET_S)
    assert during == 0  # nothing rolled while the burst committed
    assert seen is not None, "the roll never ran after the burst"
    assert seen - last >= QUIET_S - 0.5  # not before the writer had been quiet about that long (at once: ~0)


def test_without_the_quiet_wait_the_roll_runs_inside_the_burst(tmp_path, monkeypatch) -> None:
    during, _, _ = _burst(tmp_path, monkeypatch, 0.0)
    assert during > 0
