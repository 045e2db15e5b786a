"""The bubble_by_stage view against hand-computed figures, on a real collector file."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.ingest.schema import open_store


def test_bubble_by_stage_follows_the_definition(tmp_path: Path) -> None:
    con = open_store(str(tmp_path / "b.duckdb"))
    # PP2 x DP1, m = 6 micro-batches; stage 0 (rank 0) and stage 1 (rank 1), two steps.
    for rank, stage in ((0, 0), (1, 1)):
        con.execute(
            "INSERT INTO run_start (run_id, rank, step, start_ns, duration_ns, world_size, tp, pp, dp, zero_stage, stage, "
            "micro_batches) VALUES ('b', ?, -1, 0, 0, 2, 1, 2, 1, 1, ?, 6)",
            [rank, stage],
        )
    # (rank, step, forward_ns, backward_ns, duration_ns)
    rows = [(0, 1, 30, 50, 100), (1, 1, 20, 40, 100), (0, 2, 40, 40, 200), (1, 2, 10, 10, 200)]
    for rank, step, f, b, d in rows:
        con.execute(
            "INSERT INTO step (run_id, rank, step, start_ns, duration_ns, forward_ns, backward_ns) VALUES ('b', ?, ?, 0, ?, ?, ?)",
            [rank, step, d, f, b],
        )
    got = {(st, step): (bubble, ideal) for st, step, bubble, ideal in con.execute(
        "SELECT stage, step, bubble_rate, ideal_bubble_rate FROM bubble_by_stage WHERE run_id = 'b'"
    ).fetchall()}
    con.close()
    ideal = (2 - 1) / (6 + 2 - 1)
    assert got == {
        (0, 1): (pytest.approx(1 - 80 / 100), pytest.approx(ideal)),
        (1, 1): (pytest.approx(1 - 60 / 100), pytest.approx(ideal)),
        (0, 2): (pytest.approx(1 - 80 / 200), pytest.approx(ideal)),
        (1, 2): (pytest.approx(1 - 20 / 200), pytest.approx(ideal)),
    }
