"""`tracetop bench views`: a small generated file, every view of this version timed and read whole."""

from __future__ import annotations

import json
import subprocess
import sys

import duckdb

from collector.bench.views import generate
from tests.support import ROOT


def test_bench_views_small_json() -> None:
    out = subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", "views", "--rows", "20000", "--ranks", "16",
                          "--repeat", "1", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["file_bytes"] > 0 and r["generate_s"] >= 0 and r["file"] is None
    assert abs(r["rows"] - 20000) <= 16  # the step share is rounded to whole steps of all ranks
    views = {v["view"] for v in r["views"]}
    assert {"runs", "gaps", "step_summary", "collective_stats", "offload_bandwidth", "bubble_by_stage"} <= views
    by = {v["view"]: v for v in r["views"]}
    assert by["step_summary"]["rows"] == 16 and by["runs"]["rows"] == 1


def test_generated_file_has_the_row_counts_it_reports(tmp_path) -> None:
    path = tmp_path / "g.duckdb"
    counts = generate(str(path), 5000, 8)
    con = duckdb.connect(str(path), read_only=True)
    for table, n in counts.items():
        assert con.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == n
    # the generated pipeline shape: 4 stages, so bubble_by_stage has rows for each stage
    assert con.execute("SELECT count(DISTINCT stage) FROM bubble_by_stage").fetchone()[0] == 4


def test_roll_statements_rolls_every_step_of_a_copy_and_names_the_views(tmp_path) -> None:
    path = tmp_path / "g.duckdb"
    generate(str(path), 5000, 8)
    before = path.read_bytes()
    con = duckdb.connect(str(path), read_only=True)
    steps = con.execute("SELECT count(DISTINCT step) FROM step").fetchone()[0]
    con.close()
    out = subprocess.run([sys.executable, "-m", "collector.bench.roll_statements", str(path), "--top", "30"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{steps} steps rolled")
    for view in ("step_ranks", "stragglers", "lost_time", "grad_sync"):
        assert f"INSERT INTO {view}_m" in out.stdout, view
    assert path.read_bytes() == before  # a copy was rolled, not the file
