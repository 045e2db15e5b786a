"""Real multi-process DeepSpeed runs on gloo: the 3D and ZeRO shapes, TP equivalence, checkpoint
and resume, and the step-boundary adjustments. Each run is a module-scoped fixture shared by
several tests. Ground truths: the loss of an uninterrupted run, a TP1 run, the global batch."""

from __future__ import annotations

import pytest

from tests.support.torchrun import RunResult, torchrun

pytestmark = pytest.mark.slow


def _ok(r: RunResult) -> RunResult:
    assert r.rc == 0, r.output[-4000:]
    assert not r.leftover_pids
    return r


@pytest.fixture(scope="module")
def pp2dp2(tmp_path_factory) -> RunResult:
    """PP2 x DP2, 50 steps; the micro-batch goes 4 -> 2 before step 25 (global batch kept)."""
    tmp = tmp_path_factory.mktemp("pp2dp2")
    return _ok(torchrun(tmp, nproc=4, args=["--pp", "2", "--steps", "50", "--seed", "3",
                                            "--adjust", "25:micro_batch=2"]))


@pytest.fixture(scope="module")
def tp2pp2dp2(tmp_path_factory) -> RunResult:
    """TP2 x PP2 x DP2, 5 steps; the micro-batch goes 4 -> 8 before step 3 (the pipeline's cached
    partitioned-activation shapes must be reset)."""
    tmp = tmp_path_factory.mktemp("tp2pp2dp2")
    return _ok(torchrun(tmp, nproc=8, args=["--tp", "2", "--pp", "2", "--steps", "5", "--seed", "3",
                                            "--adjust", "3:micro_batch=8"]))


@pytest.fixture(scope="module")
def pp2_ckpt(tmp_path_factory):
    """PP2 (2 processes, ZeRO 1), 6 steps, checkpoints after 3 and 6; optimizer offload via
    offload_states on before step 1 and off before step 4. Then a resume from the step-3
    checkpoint to step 6, launched by `tracetop train`, ended there by --stop-file (not --steps)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    ck = tmp / "ck"
    (tmp / "stop").write_text("6")
    full = _ok(torchrun(tmp / "full", nproc=2, args=["--pp", "2", "--steps", "6", "--save-dir", str(ck),
                                                     "--save-every", "3", "--adjust", "1:offload=on",
                                                     "--adjust", "4:offload=off"]))
    # The resume goes through `tracetop train`, which execs torchrun with the same flags.
    resumed = _ok(torchrun(tmp / "resumed", nproc=2, via_tracetop=True,
                           args=["--pp", "2", "--steps", "50", "--load-dir", str(ck), "--load-tag", "step3",
                                 "--stop-file", str(tmp / "stop"), "--save-dir", str(tmp / "ck2")]))
    return full, resumed, tmp / "ck2"


def test_pp2dp2_loss_falls_over_50_steps(pp2dp2):
    loss = pp2dp2.losses()
    assert len(loss) == 50
    first, last = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
    assert last < 0.9 * first, (first, last)


def test_micro_batch_change_keeps_every_rank_training_with_the_global_batch(pp2dp2):
    assert sorted(pp2dp2.ranks) == [0, 1, 2, 3]
    for k, rows in pp2dp2.ranks.items():
        assert [r["step"] for r in rows] == list(range(50)), f"rank {k}"
        assert {r["micro_batch"] for r in rows[:25]} == {4} and {r["micro_batch"] for r in rows[25:]} == {2}
        assert {r["micro_batches"] for r in rows[25:]} == {8}
        assert {r["micro_batch"] * r["micro_batches"] * 2 for r in rows} == {32}  # dp = 2
    # The data of a step does not depend on the micro-batch size, so the loss goes on smoothly:
    # no jump at the change bigger than the step-to-step changes around it.
    loss = pp2dp2.losses()
    around = [abs(loss[i + 1] - loss[i]) for i in range(20, 30) if i != 24]
    assert abs(loss[25] - loss[24]) <= 3 * max(around)


def test_tp2pp2dp2_trains(tp2pp2dp2):
    assert [r["step"] for r in tp2pp2dp2.rows] == list(range(5))
    assert sorted(tp2pp2dp2.ranks) == list(range(8))
    for k, rows in tp2pp2dp2.ranks.items():
        assert [(r["micro_batch"], r["micro_batches"]) for r in rows] == [(4, 4)] * 3 + [(8, 2)] * 2, k
    assert tp2pp2dp2.rows[-1]["loss"] < tp2pp2dp2.rows[0]["loss"]


def test_tp2_gives_the_tp1_losses(tp2pp2dp2, pp2dp2):
    # Same seed and global batch; the micro-batch change of the TP2 run does not change the data.
    tp2, tp1 = tp2pp2dp2.losses(), pp2dp2.losses()[:5]
    assert max(abs(a - b) for a, b in zip(tp1, tp2)) <= 1e-4, (tp1, tp2)


def test_resume_continues_the_uninterrupted_loss_sequence(pp2_ckpt):
    full, resumed, _ = pp2_ckpt
    assert [r["step"] for r in resumed.rows] == [3, 4, 5]
    want = full.losses()[3:]
    assert max(abs(a - b) for a, b in zip(want, resumed.losses())) <= 1e-5, (want, resumed.losses())


def test_stop_file_ends_every_rank_at_the_step_written_and_saves_it(pp2_ckpt):
    """--stop-file (passed through `tracetop train`): both ranks end before step 6 of 50, rc 0,
    and the stop's checkpoint is saved like the end's (tag step6)."""
    _, resumed, ck2 = pp2_ckpt
    assert "stopping before step 6: " in resumed.output, resumed.output[-3000:]
    assert sorted(resumed.ranks) == [0, 1]
    for k, rows in resumed.ranks.items():
        assert [r["step"] for r in rows] == [3, 4, 5], k
    assert (ck2 / "step6").is_dir() and not (ck2 / "step50").exists(), sorted(p.name for p in ck2.iterdir())


def test_optimizer_offload_toggle_moves_states_and_keeps_the_losses(pp2_ckpt, zero2_offload):
    full, _, _ = pp2_ckpt
    for k, rows in full.ranks.items():
        states = [set(r["offloaded_states"]) for r in rows]
        assert states[0] == set() and states[4] == set() and states[5] == set(), f"rank {k}: {states}"
        for s in states[1:4]:
            assert {"optim_states", "hp_params"} <= s, f"rank {k}: {states}"
    # Same global batch and seed through another engine (ZeRO-2, TP2, cpu offload): same losses.
    z = zero2_offload.losses()
    assert max(abs(a - b) for a, b in zip(full.losses()[:3], z)) <= 1e-4, (full.losses(), z)


@pytest.fixture(scope="module")
def zero2_offload(tmp_path_factory) -> RunResult:
    """The ZeRO shape: TP2 x DP1, ZeRO 2, optimizer offloaded to cpu (torch AdamW, no build)."""
    tmp = tmp_path_factory.mktemp("zero2")
    return _ok(torchrun(tmp, nproc=2, args=["--tp", "2", "--zero", "2", "--offload", "cpu", "--steps", "3"]))


def test_zero_shape_with_cpu_offload_runs(zero2_offload):
    assert [r["step"] for r in zero2_offload.rows] == [0, 1, 2]
    for k in (0, 1):  # DeepSpeed's ZeRO optimizer itself says it keeps its state on the host
        assert all(r["optimizer_cpu_offload"] for r in zero2_offload.ranks[k])
    assert zero2_offload.rows[-1]["loss"] < zero2_offload.rows[0]["loss"]


@pytest.fixture(scope="module")
def zero3_relaunch(tmp_path_factory) -> RunResult:
    """ZeRO 3 x DP2: optimizer offload on before step 2 and off before step 4, which this engine
    can only do by checkpoint-and-relaunch (in process)."""
    tmp = tmp_path_factory.mktemp("zero3")
    return _ok(torchrun(tmp, nproc=2, args=["--zero", "3", "--steps", "6", "--seed", "3",
                                            "--adjust", "2:offload=on", "--adjust", "4:offload=off"]))


def test_zero3_offload_toggle_relaunches_the_engine_and_keeps_the_losses(zero3_relaunch, pp2dp2):
    for k in (0, 1):
        assert zero3_relaunch.rank(k, "optimizer_cpu_offload") == [False, False, True, True, False, False]
    # DP2 with the same seed and global batch as the uninterrupted PP2 x DP2 run.
    want, got = pp2dp2.losses()[:6], zero3_relaunch.losses()
    assert max(abs(a - b) for a, b in zip(want, got)) <= 1e-4, (want, got)
