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
    big, small = memory_budget(CollectorConfig("x", memory_cap_mb=1536)), memory_budget(CollectorConfig("x", memory_cap_mb=256))
    assert (big.checkpoint_mb, small.checkpoint_mb) == (64, 32)
    handle = serve(CollectorConfig(str(tmp_path / "c.duckdb"), memory_cap_mb=256))
    try:
        got = handle.collector.con.execute("SELECT current_setting('checkpoint_threshold')").fetchone()[0]  # type: ignore[attr-defined]
    finally:
        handle.stop()
    assert got == "30.5 MiB"  # 32 MB, as DuckDB prints it
    assert duckdb_settings(small)["checkpoint_threshold"] == "32MB"


def test_duckdb_threads_follow_the_flag(tmp_path) -> None:
    """DuckDB's threads: half the cores the collector may run on (at least 1; DuckDB's own default is
    one per core) unless the collector is told (`--duckdb-threads`, docs/benchmarks.md); a bad count
    is refused by name before anything opens."""
    import os
    import subprocess

    half = max(1, len(os.sched_getaffinity(0)) // 2)
    for threads, want in ((None, half), (1, 1), (3, 3)):
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


def _refused_by_name(tmp_path, name: str, value: str) -> None:
    """`tracetop collector` with a bad `name` in its environment exits 2 naming it, opening nothing."""
    import os
    import subprocess

    db = tmp_path / "refused.duckdb"
    out = subprocess.run([sys.executable, "-m", "collector", "--db", str(db)], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, **{name: value}))
    assert out.returncode == 2 and f"{name}={value!r}" in out.stderr, out.stderr
    assert not db.exists()


def test_switch_interval_is_short_and_a_bad_one_is_refused_by_name(tmp_path, monkeypatch) -> None:
    """The collector process runs with a 0.5 ms GIL switch interval (DuckDB's client takes the GIL
    back between a query's tasks; docs/benchmarks.md), TRACETOP_SWITCH_INTERVAL_S sets another, and a
    value that is not a time in (0, 1] s stops the collector before it opens anything, naming it."""

    from collector.app import SWITCH_INTERVAL_S, switch_interval_s

    monkeypatch.delenv("TRACETOP_SWITCH_INTERVAL_S", raising=False)
    assert switch_interval_s() == SWITCH_INTERVAL_S == 0.0005
    monkeypatch.setenv("TRACETOP_SWITCH_INTERVAL_S", "0.002")
    assert switch_interval_s() == 0.002
    for bad in ("abc", "0", "-1", "5"):
        monkeypatch.setenv("TRACETOP_SWITCH_INTERVAL_S", bad)
        with pytest.raises(ValueError, match="TRACETOP_SWITCH_INTERVAL_S"):
            switch_interval_s()
    _refused_by_name(tmp_path, "TRACETOP_SWITCH_INTERVAL_S", "soon")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux only")
def test_the_roll_thread_runs_lowered_and_a_bad_niceness_is_refused_by_name(tmp_path, monkeypatch) -> None:
    """The views' roll thread adds ROLL_NICE to its niceness (commits first where the cores are short);
    the writer thread keeps the process's; `roll_nice=0` leaves it; TRACETOP_ROLL_NICE
    sets another, and a bad one stops the collector before it opens anything, naming it."""
    import os
    import time

    from collector.app import roll_nice
    from collector.ingest.writer import ROLL_NICE

    base = os.getpriority(os.PRIO_PROCESS, 0)
    for asked, want in ((ROLL_NICE, min(19, base + ROLL_NICE)), (0, base)):
        handle = serve(CollectorConfig(str(tmp_path / f"n{asked}.duckdb"), roll_nice=asked))
        try:
            w = handle.collector.writer
            deadline = time.monotonic() + 10
            while os.getpriority(os.PRIO_PROCESS, w._roller.native_id) != want and time.monotonic() < deadline:
                time.sleep(0.01)
            assert os.getpriority(os.PRIO_PROCESS, w._roller.native_id) == want
            assert os.getpriority(os.PRIO_PROCESS, w._thread.native_id) == base
        finally:
            handle.stop()
    monkeypatch.delenv("TRACETOP_ROLL_NICE", raising=False)
    assert roll_nice() == ROLL_NICE == 10
    monkeypatch.setenv("TRACETOP_ROLL_NICE", "0")
    assert roll_nice() == 0
    for bad in ("low", "-1", "20", "2.5"):
        monkeypatch.setenv("TRACETOP_ROLL_NICE", bad)
        with pytest.raises(ValueError, match="TRACETOP_ROLL_NICE"):
            roll_nice()
    _refused_by_name(tmp_path, "TRACETOP_ROLL_NICE", "low")
