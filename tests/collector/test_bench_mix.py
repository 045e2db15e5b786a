"""`tracetop bench ingest --mix realistic`: the simulated ranks' mix arrives whole, kind by kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT


@pytest.mark.slow
def test_realistic_mix_is_stored_whole_with_the_stated_proportions(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", "ingest", "--mix", "realistic", "--ranks", "64",
                        "--step-s", "0.5", "--duration-s", "4", "--sources", "2", "--dir", str(tmp_path), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stored"] == out["sent"] > 0
    # 39 rows a rank-step: (1 + 20 + 16 + 1 + 1) x 64 ranks x 8 steps, plus GPU samples and heartbeats
    steps = 4 / 0.5
    assert out["sent"] >= 39 * 64 * steps
    assert out["offered_events_per_s"] == pytest.approx(64 * (39 / 0.5 + 1 / 8 + 1 / 5))
    for key in ("events_per_s", "p99_ms", "collector_cpu_pct", "collector_peak_rss_mb", "file_gb_per_hour"):
        assert out[key] > 0, key
    # the stop's work (the closing roll, the last checkpoint) counted in the second figure only
    assert out["collector_cpu_s_per_m_through_close"] > out["collector_cpu_s_per_m"] > 0
    # --dir keeps the file (it was made in a temporary directory inside it, and deleted)
    import duckdb

    con = duckdb.connect(str(tmp_path / "mix.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM step").fetchone()[0] >= 64 * steps
    finally:
        con.close()
    # the checkpoint-cost bench on that file: a round on a fresh file and on a copy, rows in the WAL each
    r = subprocess.run([sys.executable, "-m", "collector.bench.checkpoint_cost", str(tmp_path / "mix.duckdb"),
                        "--rounds", "1", "--vacuum-tasks", "0", "--json"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ck = json.loads(r.stdout)
    assert ck["vacuum_tasks"] == 0 and ck["file_mb"] > 0
    for side in ("fresh", "this_file"):
        assert ck[side][0]["wal_mb"] > 0 and ck[side][0]["cpu_s"] >= 0, ck


def test_vacuum_growth_bench_keeps_deleted_rows_only_without_vacuum() -> None:
    """The bench behind the collector's vacuum default: without vacuum the view table keeps the row
    groups its deletes left and the append-only table its partial ones; a table emptied whole is
    dropped either way."""
    r = subprocess.run([sys.executable, "-m", "collector.bench.vacuum_growth", "--rounds", "40", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    with_vacuum, without = json.loads(r.stdout)["files"]
    assert (with_vacuum["max_vacuum_tasks"], without["max_vacuum_tasks"]) == (100, 0)
    assert without["tables"]["view_m"]["row_groups"] > with_vacuum["tables"]["view_m"]["row_groups"]
    assert without["tables"]["ev"]["row_groups"] >= with_vacuum["tables"]["ev"]["row_groups"]
    # the 40th round re-sums the rollup table whole: its deleted row groups are gone either way
    assert with_vacuum["tables"]["roll"]["row_groups"] == without["tables"]["roll"]["row_groups"] == 1


def test_bad_mix_arguments_exit_2(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", "ingest", "--mix", "realistic", "--ranks", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--ranks must be positive" in r.stderr
    r = subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", "ingest", "--window", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--window must be at least 1" in r.stderr
    for env, ab in (({"TRACETOP_BENCH_WINDOW": "two"}, []), ({}, ["--ab", "TRACETOP_BENCH_WINDOW=0"])):
        r = subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", "ingest", *ab], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env={**os.environ, **env})
        assert r.returncode == 2 and "TRACETOP_BENCH_WINDOW=" in r.stderr, r.stderr[-500:]


def test_ab_runs_both_settings_interleaved_and_reports_medians(tmp_path) -> None:
    """`bench ingest --ab`: A (as it is) and B (--no-rules, and an environment word) alternate; the
    summary has each side's median and spread of every figure, and each run's line says its side."""
    r = subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", "ingest", "--events", "20000", "--sources", "2",
                        "--ab", "--no-rules TRACETOP_AB_PROBE=1", "--runs", "2", "--dir", str(tmp_path), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    runs = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert [x["side"] for x in runs] == ["A", "B", "A", "B"]
    assert all(x["stored"] == x["events"] == 20000 for x in runs)
    for fig in ("events_per_s", "p99_ms", "collector_cpu_pct", "collector_peak_rss_mb"):
        for side in "AB":
            xs = [x[fig] for x in runs if x["side"] == side]
            assert out[fig][side]["median"] == pytest.approx(sum(xs) / 2, rel=1e-3, abs=0.06)  # to 0.1
            assert (out[fig][side]["min"], out[fig][side]["max"]) == (min(xs), max(xs))
    assert out["ab"] == "--no-rules TRACETOP_AB_PROBE=1" and len(out["load_1m"]) == 4


def test_ab_setting_splits_flags_from_environment_words() -> None:
    from collector.bench.ingest import _split_setting

    assert _split_setting("--no-rules --memory-cap-mb 512 TRACETOP_X=a=b") == (
        ("--no-rules", "--memory-cap-mb", "512"), {"TRACETOP_X": "a=b"})


def test_each_side_runs_the_tree_it_names(monkeypatch) -> None:
    """A (no PYTHONPATH of its own) runs this bench's tree first; B runs the PYTHONPATH it gives, and
    both run in the work dir, where `python -m` cannot put a checkout ahead of it (it did: run from a
    checkout, B ran A's tree)."""
    from collector.bench.ingest import OWN_TREE, side_env

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert side_env({"X": "1"}) == {"X": "1", "PYTHONPATH": OWN_TREE + ":/elsewhere"}
    assert side_env({"PYTHONPATH": "/other/tree"}) == {"PYTHONPATH": "/other/tree"}
    assert (ROOT / "collector" / "bench" / "ingest.py").samefile(OWN_TREE + "/collector/bench/ingest.py")


def test_rows_sources_keep_at_most_their_window_unacked(tmp_path) -> None:
    """A rows source records its next chunk only once at most `window` chunks of what it sent are
    unacked (it waits on the shipper's acks, not by polling), and everything is stored once."""
    from collector.bench.ingest import _free_port
    from collector.bench.loadgen import CollectorProcess, count_stored, run_source

    listen = f"127.0.0.1:{_free_port()}"
    collector = CollectorProcess(tmp_path / "w.duckdb", listen)
    collector.start()
    try:
        stats = {w: run_source(listen, f"w{w}", w, 60_000, chunk_rows=4_000, window=w) for w in (1, 3)}
    finally:
        collector.stop()
    for w, st in stats.items():
        assert st["flushed"] and st["sent"] == 60_000
        assert 0 <= st["most_unacked_rows"] <= w * 4_000, (w, st["most_unacked_rows"])
        assert count_stored(tmp_path / "w.duckdb", f"w{w}")["per_source"] == {w: (60_000, 60_000)}
