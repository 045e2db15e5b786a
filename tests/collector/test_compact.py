"""Small files small (collector/compact.py): a closed file rewritten with 16 KiB blocks keeps every
row, view and schema version, and a collector writes on in it; the collector compacts at its close
unless TRACETOP_COMPACT_MAX_MB says not to. Real DuckDB files, a real collector process."""

from __future__ import annotations

import os

import duckdb

from collector import compact
from tests.collector.live.test_live_runs import _env
from tests.support.services import start_collector


def _contents(path) -> dict:
    con = duckdb.connect(str(path), read_only=True)
    try:
        names = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' "
                                           "UNION ALL SELECT view_name FROM duckdb_views() WHERE NOT internal "
                                           "AND schema_name = 'main' ORDER BY 1").fetchall()]
        return {n: con.execute(f'SELECT count(*) FROM "{n}"').fetchone()[0] for n in names} | {
            "_schema": con.execute("SELECT max(version) FROM schema_meta").fetchone()[0],
            "_block": con.execute("PRAGMA database_size").fetchone()[2],
            "_steps": con.execute("SELECT sum(duration_ns), sum(loss) FROM step").fetchone(),
            # the views' watermarks are rowids of the append-only event tables: each row keeps its rowid
            "_rowids": [con.execute(f"SELECT count(*), max(rowid), sum(hash(rowid, start_ns, duration_ns, rank)) "
                                    f"FROM {t}").fetchone() for t in ("step", "collective", "heartbeat")]}
    finally:
        con.close()


def test_a_compacted_file_keeps_every_row_and_view_and_takes_more_writes(recorded_file, tmp_path):
    before = _contents(recorded_file)
    size = os.path.getsize(recorded_file)
    c = compact.compact(str(recorded_file), limit_bytes=float("inf"))
    assert not c.skipped and c.before_bytes == size and c.after_bytes == os.path.getsize(recorded_file) < size / 2
    after = _contents(recorded_file)
    assert after.pop("_block") == compact.BLOCK_SIZE and before.pop("_block") > compact.BLOCK_SIZE
    assert after == before
    assert not os.path.exists(str(recorded_file) + ".compact.tmp")
    # a collector opens it, migrates and writes on; its own close compacts it again
    col = start_collector(tmp_path, listen="unix", db=recorded_file)
    assert col.stop() == 0
    assert _contents(recorded_file)["_steps"] == before["_steps"]


def test_the_collector_compacts_at_close_unless_told_not_to(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    on.mkdir()
    off.mkdir()
    col = start_collector(on, listen="unix")
    assert col.stop() == 0
    with _env(TRACETOP_COMPACT_MAX_MB="0"):
        col_off = start_collector(off, listen="unix")
    assert col_off.stop() == 0
    assert _contents(col.db)["_block"] == compact.BLOCK_SIZE
    assert _contents(col_off.db)["_block"] > compact.BLOCK_SIZE
    assert os.path.getsize(col.db) < os.path.getsize(col_off.db)


def test_a_file_over_the_limit_or_with_a_wal_is_left_as_it_is(recorded_file):
    size = os.path.getsize(recorded_file)
    assert "over" in compact.compact(str(recorded_file), limit_bytes=size - 1).skipped
    open(str(recorded_file) + ".wal", "wb").close()
    assert "write-ahead log" in compact.compact(str(recorded_file), limit_bytes=float("inf")).skipped
    assert os.path.getsize(recorded_file) == size
