"""FileSource and CollectorSource against real files and a real collector process; the errors a
person must act on (held file, newer schema, unknown run, nothing answering)."""

from __future__ import annotations

import shutil
import socket
import threading

import duckdb
import pytest

from collector.ingest.schema import STORE_VERSION
from collector.query import snapshot as snapmod
from tests.support.services import start_collector
from tests.tui.fixture import (
    FIXTURE,
    RUN_ID,
    STRAGGLER_FROM_STEP,
    STRAGGLER_RANK,
    compute_ms,
    last_step,
    replay_into,
    same_table,
)
from tui import core
from tui.sources import CollectorSource, FileSource, SourceError


def test_the_tui_sql_knows_the_newest_file_schema() -> None:
    assert snapmod.MAX_STORE_VERSION == STORE_VERSION, (
        "collector/ingest/schema.py has a new migration: check collector/query/snapshot.py's SQL against it, then bump MAX_STORE_VERSION")


def test_file_source_scrubs_to_a_step() -> None:
    src = FileSource(FIXTURE)
    src.open()
    try:
        assert src.run_id == RUN_ID
        latest = src.snapshot_at(None)
        assert latest.step == last_step()
        for step in (STRAGGLER_FROM_STEP - 5, STRAGGLER_FROM_STEP + 1):
            s = src.snapshot_at(step)
            assert s.step == step
            got = dict(zip(s.table("ranks").column("rank").to_pylist(), s.table("ranks").column("compute_ms").to_pylist()))
            assert got == pytest.approx(compute_ms(step))
        d = src.rank_detail(STRAGGLER_RANK, last_step())
        assert d["steps"].column("step").to_pylist()[-1] == last_step()
    finally:
        src.close()


def _expect_error(src, title: str) -> SourceError:
    with pytest.raises(SourceError) as ei:
        src.open()
    assert ei.value.title == title, ei.value
    assert ei.value.hint  # always says what to do
    return ei.value


def test_file_errors(tmp_path) -> None:
    _expect_error(FileSource(tmp_path / "missing.duckdb"), "no such file")
    e = _expect_error(FileSource(FIXTURE, "no-such-run"), "unknown run")
    assert RUN_ID in e.hint
    newer = tmp_path / "newer.duckdb"
    shutil.copyfile(FIXTURE, newer)
    con = duckdb.connect(str(newer))
    con.execute("INSERT INTO schema_meta VALUES (?, 0)", [snapmod.MAX_STORE_VERSION + 1])
    con.close()
    e = _expect_error(FileSource(newer), "file of a newer schema")
    assert str(snapmod.MAX_STORE_VERSION + 1) in e.message and "upgrade" in e.hint
    plain = tmp_path / "plain.duckdb"
    duckdb.connect(str(plain)).execute("CREATE TABLE t (x INT)").close()
    _expect_error(FileSource(plain), "not a tracetop file")


def test_file_held_by_a_running_collector_is_refused(tmp_path) -> None:
    held = tmp_path / "held.duckdb"
    shutil.copyfile(FIXTURE, held)
    c = start_collector(tmp_path, db=held)
    try:
        e = _expect_error(FileSource(held), "file held by a running collector")
        assert str(c.proc.pid) in e.message and "--collector" in e.hint
    finally:
        assert c.stop() == 0


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_nothing_answers() -> None:
    e = _expect_error(CollectorSource(f"127.0.0.1:{_free_port()}", connect_timeout_s=0.5), "nothing answers")
    assert "tracetop collector" in e.hint and "TRACETOP_COLLECTOR" in e.hint


def test_collector_source_follows_a_live_run(tmp_path) -> None:
    """Watch through a real collector: empty → 'waiting'; rows up to step K → a snapshot at K whose
    values are the fixture's; more rows → later snapshots move on; an unknown run → its error."""
    c = start_collector(tmp_path)
    try:
        src = CollectorSource(c.addr)
        src.open()
        stop = threading.Event()
        first = next(iter(src.watch(0.2, stop)))
        assert first.header.get("waiting") is True
        k = STRAGGLER_FROM_STEP + 2
        replay_into(c.addr, steps=(-1, k))
        snaps = src.watch(0.2, stop)
        s = next(x for x in snaps if x.step >= k)
        assert s.step == k and s.header["run_id"] == RUN_ID
        got = dict(zip(s.table("ranks").column("rank").to_pylist(), s.table("ranks").column("compute_ms").to_pylist()))
        assert got == pytest.approx(compute_ms(k))
        assert core.stragglers(core.rank_table(s, "compute")) == [STRAGGLER_RANK]
        replay_into(c.addr, steps=(k + 1, last_step()))
        s = next(x for x in snaps if x.step >= last_step())
        assert s.step == last_step()
        # live, per-step rows are aggregated once and kept (the Watch cursor's cache): they must
        # equal the whole window computed at once from the file
        ref = FileSource(FIXTURE)
        ref.open()
        try:
            same_table(s.table("steps"), ref.snapshot_at(last_step()).table("steps"), "steps")
        finally:
            ref.close()
        stop.set()
        d = src.rank_detail(STRAGGLER_RANK, s.step)
        assert d["steps"].num_rows > 0 and d["collectives"].num_rows > 0
        src.close()
        bad = CollectorSource(c.addr, "no-such-run")
        bad.open()
        with pytest.raises(SourceError) as ei:
            next(iter(bad.watch(0.2, threading.Event())))
        assert ei.value.title == "unknown run" and RUN_ID in ei.value.message
        bad.close()
    finally:
        assert c.stop() == 0


def test_latest_complete_step_reads_forward_only() -> None:
    con = duckdb.connect()
    con.execute("CREATE TABLE step (run_id VARCHAR, rank INT, step BIGINT)")
    con.execute("INSERT INTO step SELECT 'r', r, s FROM range(4) t(r), range(5) u(s)")
    con.execute("INSERT INTO step VALUES ('r', 0, 5), ('r', 1, 5)")  # step 5: half the ranks so far
    cur = snapmod.Cursor("r", world=4)
    seen: list[list] = []

    def run_sql(q, p):
        seen.append(p)
        return con.execute(q, p).fetchall()

    assert snapmod.latest_complete_step(run_sql, cur) == 4
    con.execute("INSERT INTO step VALUES ('r', 2, 5), ('r', 3, 5)")
    assert snapmod.latest_complete_step(run_sql, cur) == 5
    assert seen[-1][1] >= 3  # the second look started near the last step, not at 0


def test_collector_stops_cleanly_under_a_watching_tui(tmp_path) -> None:
    """SIGTERM while a Watch stream is open: the collector exits 0 (its file closed), and the
    watcher is told the collector went away."""
    c = start_collector(tmp_path)
    replay_into(c.addr, steps=(-1, STRAGGLER_FROM_STEP))
    src = CollectorSource(c.addr)
    src.open()
    got: list = []
    errors: list[SourceError] = []

    def watch() -> None:
        try:
            for s in src.watch(0.1, threading.Event()):
                got.append(s.step)
        except SourceError as e:
            errors.append(e)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    while not got:
        t.join(0.05)
    assert c.stop() == 0, c.text()
    t.join(30)
    assert not t.is_alive()
    assert [e.title for e in errors] in (["collector went away"], []), errors
    src.close()
    duckdb.connect(str(c.db), read_only=True).close()  # the file is free again
