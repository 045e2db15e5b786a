"""The rank_step view (migration _v7) on a migrated copy of the fixture, checked against the raw
step and run_start rows and the known injection (rank 3 +150 ms compute from step 20)."""

from __future__ import annotations

import shutil
import statistics
from collections import defaultdict

import pytest

from collector.ingest.schema import open_store
from tests.support import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "straggler_run.duckdb"


def test_rank_step_against_raw_rows(tmp_path) -> None:
    db = tmp_path / "f.duckdb"
    shutil.copy(FIXTURE, db)
    con = open_store(str(db))  # migrates the copy to this version's schema
    raw = con.execute("SELECT s.run_id, s.rank, s.step, s.compute_ns, s.duration_ns, r.stage FROM step s "
                      "JOIN run_start r USING (run_id, rank)").fetchall()
    got = {(r, k, s): (c, d, st, v) for r, k, s, c, d, st, v in con.execute(
        "SELECT run_id, rank, step, compute_ms, step_ms, stage, compute_vs_median_ms FROM rank_step").fetchall()}
    assert len(got) == len(raw)
    by_step = defaultdict(list)
    for run, _, step, c, _, _ in raw:
        by_step[(run, step)].append(c / 1e6)
    for run, rank, step, c, d, stage in raw:
        gc, gd, gst, gv = got[(run, rank, step)]
        assert gc == pytest.approx(c / 1e6) and gd == pytest.approx(d / 1e6) and gst == stage
        assert gv == pytest.approx(c / 1e6 - statistics.median(by_step[(run, step)]))
    late = con.execute("SELECT rank, median(compute_vs_median_ms) FROM rank_step WHERE step >= 21 GROUP BY rank "
                       "ORDER BY 2 DESC").fetchall()
    assert late[0][0] == 3 and late[0][1] > 150 * 0.3
    con.close()
