"""The reference trainer's 3D shape (PipelineEngine, pp 2 x dp 2) takes a rebalance and its undo
through ``--adjust`` (the same ``set_rebalance`` the command path calls): every pipe runs its share
in micro-batches of one size (share / M), its loss weighted, and every step's loss equals a balanced
run's (the same global batch and seeds). The ZeRO shape under the controller:
test_rebalance_loop.py."""

from __future__ import annotations

import pytest

from tests.collector.control.harness import Trainer

pytestmark = pytest.mark.slow
ARGS = ["--pp", "2", "--steps", "6", "--micro-batch", "2", "--micro-batches", "4", "--no-trace"]


def _losses(tmp, name: str, extra: list[str]) -> tuple[dict[int, float], dict[int, list[dict]]]:
    (tmp / name).mkdir()
    t = Trainer(tmp / name, nproc=4, args=[*ARGS, *extra], env={})
    assert t.wait() == 0, t.output()[-3000:]
    rows = t.rank_rows()
    return {r["step"]: r["loss"] for r in rows[0]}, rows


def test_the_pipeline_shape_rebalances_in_whole_micro_batches_and_keeps_the_loss(tmp_path):
    balanced, _ = _losses(tmp_path, "bal", [])
    moved, rows = _losses(tmp_path, "reb", ["--adjust", "2:rebalance=12,4", "--adjust", "4:rebalance=8,8"])
    assert set(moved) == set(balanced) == set(range(6))
    for s in balanced:
        assert moved[s] == pytest.approx(balanced[s], rel=1e-5), (s, moved, balanced)
    for rank, mine in rows.items():  # pp 2 x dp 2: ranks 0, 1 are stage 0 of pipes 0, 1; 2, 3 stage 1
        share = (12, 4)[mine[0]["dp_rank"]]
        assert [r["samples"] for r in mine] == [8, 8, share, share, 8, 8], (rank, mine)
