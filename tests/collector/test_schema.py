"""Schema and listen-address rules, on real DuckDB files: migrations at open, newer files refused."""

from __future__ import annotations

import duckdb
import pytest

from collector.ingest import schema
from collector.ingest.server import ListenError, check_listen
from tracetop.events import SCHEMAS, Kind, table_name


def test_fresh_file_gets_every_table_and_view(tmp_path):
    con = schema.open_store(str(tmp_path / "f.duckdb"))
    names = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    for kind in Kind:
        assert table_name(kind) in names
        cols = [r[0] for r in con.execute(f"DESCRIBE {table_name(kind)}").fetchall()]
        assert cols == ["run_id"] + [c.name for c in SCHEMAS[kind]]
    assert {"sources", "ingest_log", "schema_meta", "runs", "gaps", "step_summary", "collective_stats", "offload_bandwidth"} <= names
    assert schema.stored_version(con) == schema.STORE_VERSION
    con.close()


def test_old_file_is_migrated_in_place(tmp_path):
    path = str(tmp_path / "old.duckdb")
    con = duckdb.connect(path)
    con.execute("CREATE TABLE schema_meta (version INTEGER NOT NULL, applied_ns BIGINT NOT NULL)")
    for stmt in schema.MIGRATIONS[0]():
        con.execute(stmt)
    con.execute("INSERT INTO schema_meta VALUES (1, 0)")
    con.execute("INSERT INTO sources VALUES ('s', 7, 0, 0, 1, 10)")
    con.close()
    con = schema.open_store(path)
    assert schema.stored_version(con) == schema.STORE_VERSION > 1
    assert con.execute("SELECT hwm FROM sources").fetchall() == [(7,)]  # data kept
    assert con.execute("SELECT count(*) FROM step_summary").fetchone()[0] == 0  # a later migration's view
    con.close()


def test_newer_file_and_foreign_file_refused(tmp_path):
    path = str(tmp_path / "new.duckdb")
    con = duckdb.connect(path)
    con.execute("CREATE TABLE schema_meta (version INTEGER, applied_ns BIGINT)")
    con.execute("INSERT INTO schema_meta VALUES (?, 0)", [schema.STORE_VERSION + 1])
    con.close()
    with pytest.raises(schema.SchemaError, match="upgrade tracetop"):
        schema.open_store(path)
    foreign = str(tmp_path / "foreign.duckdb")
    con = duckdb.connect(foreign)
    con.execute("CREATE TABLE t (x INT)")
    con.close()
    with pytest.raises(schema.SchemaError, match="not a tracetop collector file"):
        schema.open_store(foreign)


@pytest.mark.parametrize("addr", ["127.0.0.1:7000", "localhost:0", "[::1]:7000", "127.1.2.3:9", "unix:///tmp/x.sock"])
def test_loopback_and_unix_accepted(addr):
    assert check_listen(addr) == addr


@pytest.mark.parametrize("addr", ["0.0.0.0:7000", "10.0.0.1:7000", "[::]:7000"])
def test_other_binds_need_tls_or_a_token(addr):
    with pytest.raises(ListenError, match="--tls-cert.*--token-file"):
        check_listen(addr)
    assert check_listen(addr, closed=True) == addr


@pytest.mark.parametrize("addr", ["127.example.com:7000", "127.0.0.1.nip.io:7000", "localhost.evil:7000"])
def test_names_that_look_like_loopback_are_not(addr):
    with pytest.raises(ListenError, match="not loopback"):
        check_listen(addr)


def test_a_token_in_clear_text_off_loopback_is_refused():
    with pytest.raises(ListenError, match="clear text"):
        check_listen("0.0.0.0:7000", closed=True, token_in_clear=True)
    assert check_listen("127.0.0.1:7000", token_in_clear=True) == "127.0.0.1:7000"


@pytest.mark.parametrize("addr", ["7000", "host", "unix:", "127.0.0.1:port"])
def test_malformed_listen_refused(addr):
    with pytest.raises(ListenError):
        check_listen(addr)


def test_v13_gpu_sample_gains_the_risk_columns(tmp_path, monkeypatch):
    """A schema-13 file (GPU_SAMPLE as wire schema 2 had it): hardware_risk reads it read-only with the
    new columns NULL; open_store's _v14 appends them in tracetop/events.py's order, the old row kept."""
    from collector.query import dashboard

    new = [c.name for c in SCHEMAS[Kind.GPU_SAMPLE][-7:]]
    assert new[0] == "ecc_corrected" and new[-1] == "power_limit_mw"
    path = str(tmp_path / "v13.duckdb")
    con = duckdb.connect(path)
    con.execute("CREATE TABLE schema_meta (version INTEGER NOT NULL, applied_ns BIGINT NOT NULL)")
    monkeypatch.setitem(SCHEMAS, Kind.GPU_SAMPLE, SCHEMAS[Kind.GPU_SAMPLE][:-7])
    for version in range(13):
        for stmt in schema.MIGRATIONS[version]():
            con.execute(stmt)
        post = getattr(schema.MIGRATIONS[version], "post", None)
        if post is not None:
            post(con)
        con.execute("INSERT INTO schema_meta VALUES (?, 0)", [version + 1])
    monkeypatch.undo()
    old_cols = [r[0] for r in con.execute("DESCRIBE gpu_sample").fetchall()]
    assert "ecc_corrected" not in old_cols
    for k in range(4):  # uncorrected ECC doubling every hour
        con.execute(f"INSERT INTO gpu_sample VALUES ('r', -1, -1, {k * 3600 * 10**9}, 0, 'n', 0, 'u', 90, 1, 1, 1, 1, "
                    f"1, 60, 1980, 0, 1, 1, 1, 1, {2**k}, 0)")
    con.close()
    ro = duckdb.connect(path, read_only=True)
    (row,) = dashboard.rows(ro, dashboard.hardware_risk_sql(), [])
    ro.close()
    assert row["cecc_now"] is None and row["remap_pending"] is None and row["points"] == 3, row
    con = schema.open_store(path)
    cols = [r[0] for r in con.execute("DESCRIBE gpu_sample").fetchall()]
    assert cols == ["run_id"] + [c.name for c in SCHEMAS[Kind.GPU_SAMPLE]]
    assert con.execute("SELECT count(*), count(ecc_corrected) FROM gpu_sample").fetchone() == (4, 0)
    con.close()
