"""The issue's must-show list, on real reference-trainer runs shipping to a real collector, read
back from its DuckDB file. One collector and five runs are shared by every test here (~2 min)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.support.services import start_collector
from tests.trainer_hooks._harness import query, torchrun
from trainer_hooks.bubble import expected_bubble_rate

pytest.importorskip("deepspeed")

STRAGGLER_MS = 300
STRAGGLER_RANK = 1
STRAGGLER_FROM = 3

RUNS = {
    # completeness, collective bytes and roles: TP2 x PP2 x DP2, tiny model
    "3d": (8, ["--tp", "2", "--pp", "2", "--steps", "5", "--micro-batches", "4", "--micro-batch", "4"]),
    # straggler ground truth: PP2 x DP2 (the demo's shape), rank 1 computes 300 ms longer from step 3
    "straggler": (4, ["--pp", "2", "--steps", "7", "--inject-straggler", f"{STRAGGLER_RANK}:{STRAGGLER_MS}@{STRAGGLER_FROM}"]),
    # bubble: PP2, 2 vs 8 micro-batches; stage 1 twice as slow from step 4 of the second run
    "bubble2": (2, ["--model", "small", "--micro-batch", "2", "--pp", "2", "--steps", "4", "--micro-batches", "2"]),
    "bubble8": (2, ["--model", "small", "--micro-batch", "2", "--pp", "2", "--steps", "7", "--micro-batches", "8",
                    "--inject-stage-imbalance", "1:2@4"]),
    # offload: the ZeRO shape, ZeRO-2 with the optimizer on the host, gradient accumulation 2
    "offload": (2, ["--zero", "2", "--offload", "cpu", "--steps", "3", "--micro-batches", "2", "--micro-batch", "2"]),
    # offload_states / reload_states between steps (ZeRO-2 without configured offload), from step 2
    "offload_states": (2, ["--zero", "2", "--steps", "4", "--micro-batches", "2", "--micro-batch", "2",
                           "--adjust", "2:offload=on"]),
}


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("must_show")
    collector = start_collector(tmp)
    try:
        for run_id, (nproc, args) in RUNS.items():
            torchrun(tmp, nproc, args, endpoint=collector.addr, run_id=run_id)
    finally:
        assert collector.stop() == 0, collector.text()
    return collector.db


def _by_rank_step(db: Path, sql: str, run_id: str) -> dict[tuple[int, int], tuple]:
    return {(r[0], r[1]): r[2:] for r in query(db, sql, run_id)}


@pytest.mark.slow
def test_completeness_every_rank_every_step_keyed_once(db: Path) -> None:
    world, steps = 8, 5
    want = {(r, s) for r in range(world) for s in range(steps)}
    got = query(db, "SELECT rank, step, count(*) FROM step WHERE run_id = ? GROUP BY rank, step", "3d")
    assert {(r, s) for r, s, _ in got} == want
    assert all(n == 1 for _, _, n in got), "a (run, rank, step) STEP row was stored twice"
    for table in ("collective", "pipe_instr", "memory", "throughput"):
        rows = query(db, f"SELECT DISTINCT rank, step FROM {table} WHERE run_id = ? AND step >= 0", "3d")
        assert set(rows) == want, f"{table} misses {sorted(want - set(rows))[:5]}"
    starts = query(db, "SELECT rank, world_size, tp, pp, dp, stage FROM run_start WHERE run_id = ? ORDER BY rank", "3d")
    assert [(r, w, t, p, d) for r, w, t, p, d, _ in starts] == [(r, 8, 2, 2, 2) for r in range(8)]
    assert [s for *_, s in starts] == [0, 0, 0, 0, 1, 1, 1, 1]  # pipe is the outer axis
    assert {r for (r,) in query(db, "SELECT DISTINCT rank FROM heartbeat WHERE run_id = ?", "3d")} == set(range(8))
    assert query(db, "SELECT count(*) FROM gap WHERE run_id = ?", "3d") == [(0,)]


@pytest.mark.slow
def test_collective_bytes_equal_tensor_sizes_and_roles(db: Path) -> None:
    from reference_trainer.config import PRESETS

    p, mb, tp = PRESETS["tiny"], 4, 2
    activation = mb * p.seq_len * p.hidden * 4  # fp32, one micro-batch
    local = {r: json.loads(m)["local_params"] for r, m in query(db, "SELECT rank, meta_json FROM run_start WHERE run_id = ?", "3d")}
    rows = query(db, "SELECT rank, step, op, role, group_size, bytes, peer FROM collective WHERE run_id = ? AND step >= 1", "3d")
    for rank in range(8):
        mine = [r for r in rows if r[0] == rank]
        tp_ar = [r for r in mine if r[2] == "all_reduce" and r[3] == "tp"]
        assert tp_ar and {(r[4], r[5]) for r in tp_ar} == {(2, activation)}  # row-parallel all-reduce of the activation
        # the DP gradient all-reduce carries exactly this rank's parameters (ZeRO-1 under the pipeline)
        dp_ar = [r for r in mine if r[2] == "all_reduce" and r[3] == "dp" and r[5] > 64]
        assert [(r[1], r[4], r[5]) for r in dp_ar] == [(s, 2, local[rank] * 4) for s in range(1, 5)]
        # pipeline p2p: to/from the same (data, model) coordinate on the other stage
        peer = rank + 4 if rank < 4 else rank - 4
        data_sends = [r for r in mine if r[2] in ("send", "recv") and r[5] == activation // tp]
        assert len(data_sends) == 2 * 4 * 4  # (send act + recv grad) or (recv act + send grad), 4 micro-batches, 4 steps
        assert {(r[3], r[4], r[6]) for r in data_sends} == {("p2p:pp", 2, peer)}
        assert {r[3] for r in mine if r[2] == "broadcast"} == {"pp"}


def _median(values) -> float:
    return statistics.median(values)


@pytest.mark.slow
def test_straggler_ground_truth(db: Path) -> None:
    rows = query(db, "SELECT rank, step, compute_ns, comm_exposed_ns FROM step WHERE run_id = ? AND step >= 1", "straggler")
    delta_ms = STRAGGLER_MS

    def shift(rank: int, col: int) -> float:
        before = [r[col] for r in rows if r[0] == rank and r[1] < STRAGGLER_FROM]
        after = [r[col] for r in rows if r[0] == rank and r[1] >= STRAGGLER_FROM]
        return (_median(after) - _median(before)) / 1e6

    assert shift(STRAGGLER_RANK, 2) == pytest.approx(delta_ms, rel=0.25)
    for rank in (0, 2, 3):
        assert shift(rank, 2) < 0.25 * delta_ms  # their compute did not change much
        assert shift(rank, 3) == pytest.approx(delta_ms, rel=0.35), f"rank {rank} collective wait"
    assert shift(STRAGGLER_RANK, 3) < 0.25 * delta_ms


def _bubbles(db: Path, run_id: str) -> dict[int, dict[int, float]]:
    got: dict[int, dict[int, float]] = {}
    sql = """SELECT r.stage, s.step, 1 - sum(s.forward_ns + s.backward_ns) / sum(s.duration_ns)
             FROM step s JOIN run_start r ON r.run_id = s.run_id AND r.rank = s.rank
             WHERE s.run_id = ? AND s.step >= 1 GROUP BY r.stage, s.step"""
    for stage, step, b in query(db, sql, run_id):
        got.setdefault(stage, {})[step] = b
    return got


@pytest.mark.slow
def test_bubble_rate_by_stage(db: Path) -> None:
    two, eight = _bubbles(db, "bubble2"), _bubbles(db, "bubble8")
    for stage in (0, 1):
        b2 = _median(two[stage].values())
        b8 = _median([b for s, b in eight[stage].items() if s < 4])
        assert b8 < b2, f"stage {stage}: bubble {b8:.3f} with 8 micro-batches, {b2:.3f} with 2"
        # the ideal bubble is a floor for balanced stages: a step whose compute a busy machine stretched
        # (its waits did not) reads under it (0.23 against 1/3 once, at a load spike), so the floor
        # holds for the median of the steps, and each step keeps at least half of it
        for bubbles, ideal in ((list(two[stage].values()), expected_bubble_rate(2, 2)),
                               ([b for s, b in eight[stage].items() if s < 4], expected_bubble_rate(2, 8))):
            assert _median(bubbles) >= ideal - 0.05 and min(bubbles) >= ideal / 2, (stage, ideal, two, eight)
    fast_balanced = _median([b for s, b in eight[0].items() if s < 4])
    fast_slowed = _median([b for s, b in eight[0].items() if s >= 4])
    slow_slowed = _median([b for s, b in eight[1].items() if s >= 4])
    assert fast_slowed > fast_balanced and fast_slowed > slow_slowed, eight


def _partition(rank: int, dp: int) -> tuple[int, int, int]:
    """(partition numel, numel of the params overlapping it, numel of real params in it) of this
    rank's ZeRO-1/2 partition: the flat fp32 parameters padded and split evenly over dp."""
    import torch

    from reference_trainer.config import PRESETS
    from reference_trainer.model import GPT
    from reference_trainer.tp_layers import TPGroup

    torch.manual_seed(0)
    numels = [p.numel() for p in GPT(PRESETS["tiny"], TPGroup(0, 1), 1).parameters()]
    total = sum(numels)
    align = 2 * dp  # DeepSpeed pads the flat buffer to a multiple of 2 x dp (nccl_start_alignment_factor)
    padded = -(-total // align) * align
    part = padded // dp
    lo, hi = rank * part, (rank + 1) * part
    s_ov, pos = 0, 0
    for n in numels:
        if pos < hi and pos + n > lo:
            s_ov += n
        pos += n
    in_part = min(hi, total) - lo
    return part, s_ov, in_part


def _expected_offload(rank: int, dp: int, gas: int) -> dict[tuple[str, str], int]:
    """Bytes per step DeepSpeed moves in ZeRO-2 + cpu offload (fp32), derived from the partition."""
    part, s_ov, in_part = _partition(rank, dp)
    return {
        ("d2h", "grads"): 4 * (gas * s_ov + in_part),
        ("h2d", "grads"): 4 * (gas - 1) * s_ov,
        ("h2d", "params"): 4 * part,
    }


@pytest.mark.slow
def test_offload_bytes_match_the_partitions(db: Path) -> None:
    rows = query(db, """SELECT rank, step, direction, what, sum(bytes) FROM offload WHERE run_id = ?
                        GROUP BY ALL ORDER BY ALL""", "offload")
    assert rows, "no offload rows"
    for rank in range(2):
        want = _expected_offload(rank, dp=2, gas=2)
        for step in range(3):
            got = {(d, w): b for r, s, d, w, b in rows if r == rank and s == step}
            assert set(got) == set(want), got
            for key, nbytes in want.items():
                assert got[key] == pytest.approx(nbytes, rel=0.01), (rank, step, key)


@pytest.mark.slow
def test_offload_states_bytes_match_the_partitions(db: Path) -> None:
    rows = query(db, """SELECT rank, step, direction, what, sum(bytes) FROM offload WHERE run_id = ?
                        GROUP BY ALL ORDER BY ALL""", "offload_states")
    for rank in range(2):
        part, _, _ = _partition(rank, dp=2)
        # hp_params: the fp32 partition; optim_states: AdamW's exp_avg and exp_avg_sq of it
        want = {("params", 4 * part), ("optim_state", 2 * 4 * part)}
        for direction in ("d2h", "h2d"):
            got = [(s, w, b) for r, s, d, w, b in rows if r == rank and d == direction]
            assert got, (rank, direction, rows)
            steps = {s for s, _, _ in got}
            for step in steps:
                assert {(w, b) for s, w, b in got if s == step} == want, (rank, direction, step)
