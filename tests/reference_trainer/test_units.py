"""The reference trainer's pure parts: layouts, flags, fault and adjustment specs, data, FLOPs,
tensor-parallel slicing, and the per-rank clock with an injected clock. No processes started."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from reference_trainer.adjust import AdjustError, offload_method, parse_adjustment, plan_micro_batch
from reference_trainer.config import (
    PRESETS,
    LayoutError,
    add_trainer_arguments,
    ds_config,
    flops_per_token,
    make_layout,
    n_params,
    to_argv,
)
from reference_trainer.data import global_batch, micro_batches_for
from reference_trainer.faults import (
    Fault,
    FaultSpecError,
    SlowMicroBatch,
    StageClock,
    parse_fault,
    parse_faults,
    parse_slow_micro_batch,
)
from reference_trainer.model import GPT
from reference_trainer.tp_layers import TPGroup, qkv_rows
from tests.support import ROOT

TINY = PRESETS["tiny"]


def test_layout_derives_dp_and_picks_the_shape():
    lay = make_layout(8, 2, 2, 1, "none", TINY)
    assert (lay.dp, lay.shape) == (2, "3d")
    assert make_layout(4, 2, 1, 3, "cpu", TINY).shape == "zero"


@pytest.mark.parametrize(
    "world,tp,pp,zero,offload,words",
    [
        (6, 2, 2, 1, "none", ["does not divide the world size 6", "multiple of 4"]),
        (4, 1, 2, 2, "none", ["incompatible with pipeline", "--zero 1 with a pipeline", "--pp 1"]),
        (4, 1, 2, 3, "none", ["ZeRO-2 and ZeRO-3"]),
        (2, 1, 1, 0, "cpu", ["needs ZeRO", "--zero 2"]),
        (3, 3, 1, 1, "none", ["--tp 3 does not divide", "attention heads"]),
        (8, 1, 8, 1, "none", ["more stages than", "4 blocks"]),
    ],
)
def test_impossible_layouts_say_why_and_what_instead(world, tp, pp, zero, offload, words):
    with pytest.raises(LayoutError) as e:
        make_layout(world, tp, pp, zero, offload, TINY)
    for w in words:
        assert w in str(e.value)


def test_ds_config_uses_torch_adam_and_allows_it_with_offload():
    cfg = ds_config(make_layout(2, 1, 1, 2, "cpu", TINY), micro_batch=4, micro_batches=2, lr=1e-3, bf16=False)
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert cfg["zero_force_ds_cpu_optimizer"] is False
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["train_batch_size"] == 4 * 2 * 2


def test_to_argv_round_trips_through_the_parser():
    p = argparse.ArgumentParser()
    add_trainer_arguments(p)
    argv = ["--tp", "2", "--pp", "2", "--steps", "7", "--no-trace", "--inject-straggler", "1:50@3",
            "--inject-straggler", "2:10", "--adjust", "3:micro_batch=2"]
    a = p.parse_args(argv)
    assert p.parse_args(to_argv(a)) == a
    assert to_argv(p.parse_args([])) == []


def test_fault_specs_parse_and_bad_ones_are_named():
    assert parse_fault("straggler", "1:200@5") == Fault("straggler", 1, 200.0, 5)
    assert parse_fault("comm_delay", "0:150") == Fault("comm_delay", 0, 150.0, 0)
    assert parse_fault("hang", "3@10") == Fault("hang", 3, 0.0, 10)
    with pytest.raises(FaultSpecError, match="--inject-straggler '1-200'.*RANK:MS"):
        parse_fault("straggler", "1-200")
    with pytest.raises(FaultSpecError, match="FACTOR must be at least 1"):
        parse_fault("stage_imbalance", "1:0.5")
    assert parse_fault("slow_rank", "3:2@30") == Fault("slow_rank", 3, 2.0, 30)
    with pytest.raises(FaultSpecError, match="--inject-slow-rank '3:0.5'.*FACTOR must be at least 1"):
        parse_fault("slow_rank", "3:0.5")
    ns = argparse.Namespace(inject_straggler=["9:10"], inject_stage_imbalance=[])
    with pytest.raises(FaultSpecError, match="rank 9 does not exist in a world of 4"):
        parse_faults(ns, world_size=4, pp=2)
    ns = argparse.Namespace(inject_stage_imbalance=["2:3"])
    with pytest.raises(FaultSpecError, match="stage 2 does not exist with --pp 2"):
        parse_faults(ns, world_size=4, pp=2)


def test_adjustment_specs_and_micro_batch_plan():
    assert parse_adjustment("20:micro_batch=2").value == 2
    assert parse_adjustment("3:offload=on").value is True
    with pytest.raises(AdjustError, match="unknown key"):
        parse_adjustment("3:speed=11")
    assert plan_micro_batch(4, 4, 2) == 8
    assert plan_micro_batch(4, 4, 16) == 1
    with pytest.raises(AdjustError, match=r"does not divide the 16 samples.*\[1, 2, 4, 8, 16\]"):
        plan_micro_batch(4, 4, 3)


def test_offload_toggle_method_per_layout():
    assert offload_method(make_layout(4, 1, 2, 1, "none", TINY))[0] == "offload_states"
    assert offload_method(make_layout(2, 1, 1, 2, "none", TINY))[0] == "offload_states"
    assert offload_method(make_layout(2, 1, 1, 3, "none", TINY))[0] == "relaunch"
    assert offload_method(make_layout(2, 1, 1, 2, "cpu", TINY))[0] == "relaunch"
    method, why = offload_method(make_layout(4, 1, 2, 0, "none", TINY))
    assert method is None and "--zero 1" in why


def test_data_is_a_function_of_seed_and_step_and_learnable():
    x1, y1 = global_batch(3, 7, 8, 64, 32)
    x2, y2 = global_batch(3, 7, 8, 64, 32)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(global_batch(4, 7, 8, 64, 32)[0], x1)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # labels are the next tokens
    stride = (x1[:, 1] - x1[:, 0]) % 64
    assert torch.equal((x1[:, 2] - x1[:, 1]) % 64, stride)  # determined by the last two tokens


def test_micro_batch_split_keeps_each_ranks_samples():
    kw = dict(dp=2, vocab=64, seq_len=32)
    a = micro_batches_for(5, 1, dp_rank=1, micro_batch=4, micro_batches=4, **kw)
    b = micro_batches_for(5, 1, dp_rank=1, micro_batch=2, micro_batches=8, **kw)
    assert torch.equal(torch.cat([x for x, _ in a]), torch.cat([x for x, _ in b]))
    other = micro_batches_for(5, 1, dp_rank=0, micro_batch=4, micro_batches=4, **kw)
    assert not torch.equal(torch.cat([x for x, _ in a]), torch.cat([x for x, _ in other]))


def test_declared_parameter_count_matches_the_model():
    model = GPT(TINY, TPGroup(0, 1), seed=1)
    assert sum(p.numel() for p in model.parameters()) == n_params(TINY)
    assert 0.9e9 < n_params(PRESETS["1b"]) < 1.3e9


def test_flops_per_token_formula():
    p = TINY
    matmul = p.n_layers * (4 * p.hidden**2 + 2 * p.hidden * p.ffn) + p.vocab * p.hidden
    assert flops_per_token(p) == 6 * matmul + 12 * p.n_layers * p.hidden * p.seq_len


def test_qkv_slices_take_q_k_and_v_of_the_same_heads():
    rows = [qkv_rows(8, 4, TPGroup(r, 2)).tolist() for r in range(2)]
    assert rows[0] == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert rows[1] == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


class FakeClock:
    def __init__(self):
        self.t = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_stage_clock_straggler_and_imbalance_sleep_the_right_amounts():
    c = FakeClock()
    faults = [Fault("straggler", 0, 200.0, 2), Fault("stage_imbalance", 0, 3.0, 0), Fault("mem_growth", 1, 8, 0)]
    clock = StageClock(faults, rank=0, stage=0, micro_batches=lambda: 4, clock=c, sleep=c.sleep)
    clock.begin_step(2)
    clock._pre_forward(None, ())
    assert c.slept == [0.05]  # 200 ms over 4 micro-batches
    c.t += 0.010  # 10 ms of compute
    clock._post_forward(None, (), None)
    assert c.slept[-1] == pytest.approx(0.020)  # (3 - 1) x 10 ms
    assert clock.forward_s == pytest.approx(0.05 + 0.010 + 0.020)
    clock.backward_started()
    c.t += 0.004
    clock.backward_ended()
    assert clock.backward_s == pytest.approx(0.012)
    assert clock.held == []  # memory growth is rank 1's


def test_stage_clock_imbalance_from_a_step_sleeps_its_median_before_the_onset():
    """From its onset the stage sleeps (FACTOR - 1) x its median forward (backward) before it, not
    a median that follows its speed after: on a busy host the sleeping stage computes faster."""
    c = FakeClock()
    clock = StageClock([Fault("stage_imbalance", 1, 3.0, 3)], rank=1, stage=1, micro_batches=lambda: 1,
                       clock=c, sleep=c.sleep)
    for step, (fwd, bwd) in enumerate(((0.010, 0.004), (0.030, 0.008), (0.020, 0.006), (0.005, 0.001),
                                       (0.050, 0.020))):
        c.slept.clear()
        clock.begin_step(step)
        clock._pre_forward(None, ())
        c.t += fwd
        clock._post_forward(None, (), None)
        clock.backward_started()
        c.t += bwd
        clock.backward_ended()
        # before step 3 nothing; from it 2 x 20 ms and 2 x 6 ms, whatever the stage measures now
        assert c.slept == ([] if step < 3 else [pytest.approx(0.040), pytest.approx(0.012)]), step
        assert clock.forward_s == pytest.approx(fwd + (0.040 if step >= 3 else 0.0))


def test_stage_clock_slow_rank_sleeps_factor_minus_one_times_its_median_step_before_onset():
    faults = [Fault("slow_rank", 1, 2.5, 3)]
    for rank in (1, 0):
        c = FakeClock()
        clock = StageClock(faults, rank=rank, stage=0, micro_batches=lambda: 2, clock=c, sleep=c.sleep)
        for step, wall in enumerate((0.100, 0.300, 0.200, 0.200, 0.200)):
            c.slept.clear()
            clock.begin_step(step)
            clock._pre_forward(None, ())
            clock._pre_forward(None, ())  # two micro-batches
            # rank 1 from step 3: (2.5 - 1) x 200 ms (the median of its steps 0-2), split in 2
            assert c.slept == ([pytest.approx(0.150)] * 2 if rank == 1 and step >= 3 else []), (rank, step)
            c.t += wall
        if rank == 1:
            assert clock.step_walls == [pytest.approx(w) for w in (0.100, 0.300, 0.200)]  # fixed at onset


def test_slow_micro_batch_by_a_factor_follows_the_step_at_the_other_sizes_and_bad_specs_are_named():
    """MB:xF: at that size (F - 1) x the median wall of this rank's last steps at its other sizes,
    split across the forwards; the slowed steps never feed the median (a fixed MS: the same every step)."""
    assert parse_slow_micro_batch(["2:x4", "1:1500"]) == {2: SlowMicroBatch(factor=4.0), 1: SlowMicroBatch(ms=1500.0)}
    for bad, words in (("2", "expected MB:MS or MB:xFACTOR"), ("0:x3", "MB >= 1"), ("2:x0.5", "at least 1"),
                       ("2:fast", "e.g. 2:1500 or 2:x4")):
        with pytest.raises(FaultSpecError, match="--inject-slow-micro-batch") as e:
            parse_slow_micro_batch([bad])
        assert words in str(e.value), (bad, e.value)
    c = FakeClock()
    mb = {"size": 4}
    clock = StageClock([], rank=0, stage=0, micro_batches=lambda: 8 // mb["size"], micro_batch=lambda: mb["size"],
                       clock=c, sleep=c.sleep, slow_micro_batch=parse_slow_micro_batch(["2:x4"]))
    # size 4 (walls 100, 300, 200 ms), then size 2 (whatever it computes), then 4 again at 400 ms, then 2
    plan = [(4, 0.100), (4, 0.300), (4, 0.200), (2, 0.050), (2, 0.500), (4, 0.400), (2, 0.050)]
    for step, (size, wall) in enumerate(plan):
        mb["size"] = size
        c.slept.clear()
        clock.begin_step(step)
        for _ in range(8 // size):
            clock._pre_forward(None, ())
        expected = {3: 3 * 0.200, 4: 3 * 0.200, 6: 3 * 0.250}.get(step, 0.0)  # median of 100, 300, 200 (, 400)
        assert sum(c.slept) == pytest.approx(expected), step
        assert len(c.slept) == (8 // size if expected else 0)
        c.t += wall
    assert clock.shape_walls == [pytest.approx(w) for w in (0.100, 0.300, 0.200, 0.400)]


def test_tracetop_train_dry_run_and_refusal():
    tt = [sys.executable, "-m", "tracetop.cli", "train"]
    out = subprocess.run([*tt, "--nproc", "4", "--pp", "2", "--inject-straggler", "1:100", "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--nproc_per_node 4 --standalone -m reference_trainer --pp 2 --inject-straggler 1:100" in out.stdout
    bad = subprocess.run([*tt, "--nproc", "4", "--pp", "2", "--zero", "3"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "incompatible with pipeline" in bad.stderr


def test_trainer_refuses_an_impossible_layout_before_starting_anything():
    out = subprocess.run([sys.executable, "-m", "reference_trainer", "--pp", "2", "--zero", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert "does not divide the world size 1" in out.stderr  # a world of one process
    out = subprocess.run([sys.executable, "-m", "reference_trainer", "--inject-straggler", "0-5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "--inject-straggler '0-5': expected RANK:MS[@STEP]" in out.stderr


def test_control_seam_asks_tracing_for_adjustments_and_reports_outcomes():
    from reference_trainer.train import Run, _apply_commands

    class Seam:  # what the hooks' tracing object offers the loop
        def __init__(self):
            self.results = []

        def adjustments(self, step):
            return [("micro_batch", 3), ("speed", 2)] if step == 7 else []

        def adjustment_result(self, step, key, value, applied, message):
            self.results.append((step, key, value, applied, message))

    run = Run(engine=None, layout=make_layout(2, 1, 2, 1, "none", TINY), preset=TINY, micro_batch=4,
              micro_batches=4, rank=0, stage=0, dp_rank=0, tracing=Seam())
    _apply_commands(run, 6)
    assert run.tracing.results == []
    _apply_commands(run, 7)  # both refused before touching the engine; the run is unchanged
    (s1, k1, v1, ok1, m1), (s2, k2, v2, ok2, m2) = run.tracing.results
    assert (s1, k1, v1, ok1) == (7, "micro_batch", 3, False) and "does not divide the 16 samples" in m1
    assert (k2, ok2) == ("speed", False) and "unknown adjustment" in m2
    assert (run.micro_batch, run.micro_batches) == (4, 4)


def test_stop_file_is_read_whole_and_the_step_it_names_is_kept(tmp_path):
    """--stop-file in a world of one (a real gloo group): ignored while absent or not an integer,
    then the run stops at the step written, or at once when that step is already behind it."""
    import torch.distributed as dist

    from reference_trainer.stop import StopFile, read_stop_step

    path = tmp_path / "stop"
    assert read_stop_step(str(path)) is None
    path.write_text("")  # an empty (or half-written) file is no stop step
    assert read_stop_step(str(path)) is None
    path.write_text("12\n")
    assert read_stop_step(str(path)) == 12
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        path.unlink()
        late = StopFile(str(path), rank=0)
        assert not late.should_stop(0) and not late.should_stop(1)
        path.write_text("x")
        assert not late.should_stop(2)
        path.write_text("3")
        assert not late.should_stop(2) and late.should_stop(3)
        path.write_text("9")  # agreed once: a later write changes nothing
        assert late.should_stop(4) and late.stop_step == 3
        behind = StopFile(str(path), rank=0)
        path.write_text("0")
        assert behind.should_stop(7) and behind.stop_step == 0
    finally:
        dist.destroy_process_group()
