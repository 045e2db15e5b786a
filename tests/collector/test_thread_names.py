"""The collector names its threads in the OS (app.name_os_threads), so CPU per thread can be read from
outside (`tracetop bench ingest` reports it by these names), and its DuckDB settings are applied."""

from __future__ import annotations

import sys

import pytest

from collector.app import CollectorConfig, duckdb_settings, memory_budget, serve


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names through /proc: Linux only")
def test_writer_and_live_threads_carry_their_names_in_the_os(tmp_path) -> None:
    from collector.live import rules as rules_mod

    handle = serve(CollectorConfig(str(tmp_path / "t.duckdb"), rules=rules_mod.defaults()))
    try:
        c = handle.collector
        named = {
            "tracetop-writer": c.writer._thread.native_id,
            "tracetop-rollup": c.writer._roller.native_id,
            "tracetop-live": c.live._thread.native_id,  # type: ignore[attr-defined]
        }
        for name, tid in named.items():
            with open(f"/proc/self/task/{tid}/comm") as f:
                assert f.read().strip() == name
    finally:
        handle.stop()


def test_checkpoint_threshold_follows_the_budget(tmp_path) -> None:
    """DuckDB's 16 MB checkpoints made small group commits re-compress each table's last row group
    over and over; the collector raises it to a quarter of DuckDB's memory share, at most 64 MB."""
    big, small = memory_budget(CollectorConfig("x", memory_cap_mb=1024)), memory_budget(CollectorConfig("x", memory_cap_mb=256))
    assert (big.checkpoint_mb, small.checkpoint_mb) == (64, 32)
    handle = serve(CollectorConfig(str(tmp_path / "c.duckdb"), memory_cap_mb=256))
    try:
        got = handle.collector.con.execute("SELECT current_setting('checkpoint_threshold')").fetchone()[0]  # type: ignore[attr-defined]
    finally:
        handle.stop()
    assert got == "30.5 MiB"  # 32 MB, as DuckDB prints it
    assert duckdb_settings(small)["checkpoint_threshold"] == "32MB"


def test_duckdb_threads_follow_the_flag(tmp_path) -> None:
    """DuckDB's threads: its default (one per core) unless the collector is told (`--duckdb-threads`,
    docs/benchmarks.md); a bad count is refused by name before anything opens."""
    import os
    import subprocess

    for threads, want in ((None, os.cpu_count()), (1, 1), (3, 3)):
        handle = serve(CollectorConfig(str(tmp_path / f"t{want}.duckdb"), duckdb_threads=threads))
        try:
            got = handle.collector.con.execute("SELECT current_setting('threads')").fetchone()[0]  # type: ignore[attr-defined]
        finally:
            handle.stop()
        assert got == want
    db = tmp_path / "refused.duckdb"
    out = subprocess.run([sys.executable, "-m", "collector", "--db", str(db), "--duckdb-threads", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--duckdb-threads" in out.stderr
    assert not db.exists()
