"""`tracetop query`: options anywhere on the line; several files at once (attached read-only, the
views recreated over the unions of their tables); the read-only gate still holds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from collector.ingest import rollup
from collector.ingest.schema import open_store
from tests.support import ROOT

TT = [sys.executable, "-m", "tracetop.cli", "query"]
FIXTURE = ROOT / "tests" / "fixtures" / "straggler_run.duckdb"


def _q(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TT, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _small_file(path: Path, run_id: str, ranks: list[int], steps: int) -> None:
    """A collector file with only `step` rows: `steps` steps per rank, duration = (rank+1) ms."""
    con = open_store(str(path))
    for r in ranks:
        for s in range(steps):
            con.execute(
                "INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns, comm_exposed_ns, "
                "data_wait_ns) VALUES (?, ?, ?, ?, ?, ?, 0, 0)",
                [run_id, r, s, s * 10**9, (r + 1) * 10**6, (r + 1) * 10**6],
            )
    rollup.rebuild(con)  # rows written here, not by the collector's writer
    con.close()


def test_options_anywhere_on_the_line() -> None:
    want = duckdb.connect(str(FIXTURE), read_only=True).execute("SELECT count(*) FROM step").fetchone()[0]
    for line in ([FIXTURE, "--json", "SELECT count(*) AS n FROM step"],
                 ["--json", FIXTURE, "SELECT count(*) AS n FROM step"],
                 [FIXTURE, "SELECT count(*) AS n FROM step", "--json"]):
        out = _q(*line)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == [{"n": want}]


def test_two_files_views_read_the_union(tmp_path: Path) -> None:
    a, b = tmp_path / "a.duckdb", tmp_path / "b.duckdb"
    _small_file(a, "run-a", [0, 1], steps=3)
    _small_file(b, "run-b", [2], steps=5)
    out = _q(a, b, "--json", "SELECT run_id, rank, steps, step_ms_p50 FROM step_summary ORDER BY rank")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["run_id"], r["rank"], r["steps"]) for r in rows] == [("run-a", 0, 3), ("run-a", 1, 3), ("run-b", 2, 5)]
    assert [r["step_ms_p50"] for r in rows] == pytest.approx([1.0, 2.0, 3.0])
    # the files are untouched (attached read-only)
    assert duckdb.connect(str(b), read_only=True).execute("SELECT count(*) FROM step").fetchone()[0] == 5


def test_fixture_and_its_copy_count_twice(tmp_path: Path) -> None:
    copy = tmp_path / "copy.duckdb"
    shutil.copy(FIXTURE, copy)
    con = duckdb.connect(str(FIXTURE), read_only=True)
    n_step = con.execute("SELECT count(*) FROM step").fetchone()[0]
    n_bubble = con.execute("SELECT count(*) FROM bubble_by_stage").fetchone()[0]
    out = _q(FIXTURE, copy, "--json", "SELECT (SELECT count(*) FROM step) AS s, (SELECT sum(ranks) FROM bubble_by_stage) "
             "AS r, (SELECT count(*) FROM bubble_by_stage) AS b")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)[0]
    assert row["s"] == 2 * n_step
    assert row["b"] == n_bubble  # same (run, stage, step) groups, each with twice the rows
    # the view joins step to run_start; both hold every row twice, so the join holds each 4 times
    # (what the union of a file with its copy means; disjoint collectors' files have disjoint ranks)
    assert row["r"] == 4 * con.execute("SELECT sum(ranks) FROM bubble_by_stage").fetchone()[0]


@pytest.mark.parametrize("probe", [
    "SELECT * FROM read_text('/etc/hostname')",
    "ATTACH '{tmp}/o.duckdb' AS o",
    "SET enable_external_access = true",
    "CREATE TEMP TABLE t (x INT)",
    "COPY step TO '{tmp}/leak.csv'",
    "DETACH f0",
])
def test_multi_file_stays_read_only(tmp_path: Path, probe: str) -> None:
    copy = tmp_path / "copy.duckdb"
    shutil.copy(FIXTURE, copy)
    out = _q(FIXTURE, copy, probe.format(tmp=tmp_path))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "read-only" in out.stderr
    assert not (tmp_path / "leak.csv").exists() and not (tmp_path / "o.duckdb").exists()


def test_bad_second_file_is_named(tmp_path: Path) -> None:
    junk = tmp_path / "junk.duckdb"
    duckdb.connect(str(junk)).execute("CREATE TABLE x (a INT)").close()
    out = _q(FIXTURE, junk, "SELECT 1")
    assert out.returncode == 1 and "not a tracetop collector file" in out.stderr
    out = _q(FIXTURE, tmp_path / "missing.duckdb", "SELECT 1")
    assert out.returncode == 2 and "no such file" in out.stderr
