"""`tracetop bench gpu`: the pure figures on hand-made inputs, and the whole command in --cpu mode
(real processes: a collector, DeepSpeed runs on gloo, the agent on the fake NVML)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from reference_trainer.bench import gpu as bench_gpu
from reference_trainer.bench.gpu_child import sync_figures, sync_site, timing_figures
from reference_trainer.config import PRESETS, n_params
from tests.support import ROOT

# ----------------------------------------------------------------------------- pure figures


def test_counter_interpolates_between_samples_and_refuses_outside() -> None:
    s = [(1_000, 100.0), (2_000, 300.0), (4_000, 500.0)]
    assert bench_gpu.counter_at(s, 1_500) == pytest.approx(200.0)
    assert bench_gpu.counter_at(s, 3_000) == pytest.approx(400.0)
    assert bench_gpu.counter_at(s, 4_000) == pytest.approx(500.0)
    assert bench_gpu.counter_at(s, 999) is None
    assert bench_gpu.counter_at(s, 4_001) is None


def test_throughput_integrates_rates_over_the_window_only() -> None:
    # 1000 KB/s for 1 s, then 3000 KB/s for 1 s; window = the last half of the first second + all of the second
    s = [(0, 1000.0), (1_000_000_000, 3000.0), (2_000_000_000, 0.0)]
    got = bench_gpu.throughput_bytes(s, 500_000_000, 2_000_000_000)
    assert got == pytest.approx(1024 * (1000 * 0.5 + 3000 * 1.0))
    assert bench_gpu.throughput_bytes(s, -1, 2_000_000_000) is None  # readings do not cover the window


def test_offload_figures_compare_each_direction_with_its_counter() -> None:
    t0, t1 = 10_000_000_000, 12_000_000_000  # a 2 s window
    trainer = {"window_start_ns": t0, "window_end_ns": t1, "steps": 4, "whats": ["grads", "params"],
               "by_direction": {"d2h": {"bytes": 4_000_000_000}, "h2d": {"bytes": 2_200_000_000}}}
    # TX counter moves 4.4 GB across the window, RX 2.0 GB; samples every second, straddling it
    pcie = {"backend": "nvml", "samples": [
        (t0 - 1_000_000_000, 0, 0, None, None), (t0, 1e9, 5e8, None, None),
        (t1, 1e9 + 4.4e9, 5e8 + 2.0e9, None, None), (t1 + 1_000_000_000, 9e9, 9e9, None, None)]}
    f = bench_gpu.offload_figures(trainer, pcie)
    assert f["window_s"] == pytest.approx(2.0)
    assert f["nvml_tx_bytes"] == pytest.approx(4.4e9) and f["nvml_rx_bytes"] == pytest.approx(2.0e9)
    assert f["d2h_vs_tx_pct"] == pytest.approx((4.0 - 4.4) / 4.4 * 100)
    assert f["h2d_vs_rx_pct"] == pytest.approx(10.0)
    assert f["within_goal"] is True  # -9.1% and +10.0%: both within 10%
    assert f["hooks_d2h_gbps"] == pytest.approx(2.0)
    assert f["nvml_source"].startswith("counters")
    # no counters: the throughput readings (KB/s) are integrated instead
    pcie_thr = {"backend": "nvml", "samples": [(t0 - 1, None, None, 1e6, 5e5), (t1 + 1, None, None, 0.0, 0.0)]}
    g = bench_gpu.offload_figures(trainer, pcie_thr)
    assert g["nvml_source"].startswith("throughput")
    assert g["nvml_tx_bytes"] == pytest.approx(1e6 * 1024 * (t1 - t0 + 1) / 1e9)
    with pytest.raises(ValueError, match="no measured window"):
        bench_gpu.offload_figures({"window_start_ns": None}, pcie)


def test_goal_verdict_is_undecided_when_the_interval_straddles_the_goal() -> None:
    assert bench_gpu.goal_verdict(-0.1, 0.15, 0.2) is True
    assert bench_gpu.goal_verdict(0.25, 0.4, 0.2) is False
    assert bench_gpu.goal_verdict(0.1, 0.3, 0.2) is None


def test_wall_overhead_reads_a_known_difference() -> None:
    off = [0.100] * 40
    on = [0.1002] * 40  # +0.2%
    f = bench_gpu.wall_overhead(on, off)
    assert f["overhead_wall_pct"] == pytest.approx(0.2)
    assert f["overhead_wall_ci95_low_pct"] == pytest.approx(0.2)
    assert f["off_step_ms"] == pytest.approx(100.0)


def _frame(path: str, line: int, name: str) -> traceback.FrameSummary:
    return traceback.FrameSummary(path, line, name, lookup_line=False)


def test_sync_site_is_the_innermost_frame_outside_torch() -> None:
    torch_f = _frame("/site/torch/cuda/__init__.py", 10, "synchronize")
    hooks = _frame("/repo/trainer_hooks/tracer.py", 500, "_step_end")
    ds = _frame("/site/deepspeed/runtime/engine.py", 2000, "step")
    trainer = _frame("/repo/reference_trainer/train.py", 300, "_train")
    # a DeepSpeed sync called from inside a hook wrapper is DeepSpeed's, not the hooks'
    assert sync_site([trainer, hooks, ds, torch_f], "MainThread") == ("deepspeed", "runtime/engine.py:2000 step")
    assert sync_site([trainer, ds, hooks, torch_f], "MainThread")[0] == "hooks"
    assert sync_site([trainer, torch_f], "MainThread")[0] == "trainer"
    assert sync_site([torch_f], "tracetop-emitter")[0] == "hooks"  # a hook thread's sync is the hooks' anyway


def test_sync_figures_count_per_on_and_off_step() -> None:
    on = [True, True, False, False, True, True, False, False]
    records = [(n, "trainer", "train.py:1 _train") for n in range(8)]  # one trainer sync a step
    records += [(4, "hooks", "tracer.py:9 x")]
    f = sync_figures(records, on, warmup=2)
    assert f["syncs_in_hooks"] == 1
    assert f["syncs_per_off_step"] == pytest.approx(1.0)
    assert f["syncs_per_on_step"] == pytest.approx(1.5)  # steps 4, 5: 2 and 1


def test_timing_figures_sum_the_phases_against_the_step_and_the_wall() -> None:
    steps = [{"step": n, "start_ns": 0, "duration_ns": 100, "data_wait_ns": 5, "forward_ns": 30, "backward_ns": 40,
              "optimizer_ns": 10, "comm_exposed_ns": 10} for n in range(4)]
    wall = [100e-9 / 0.98] * 4  # the host saw each step 2% longer than the hooks' timer
    f = timing_figures(steps, wall, [True] * 4, warmup=1, collectives=[(1, 5, 8), (2, 5, 8)], tolerance_pct=5)
    assert f["steps_compared"] == 3
    assert f["phase_sum_over_step_median"] == pytest.approx(0.95)
    assert f["step_over_wall_median"] == pytest.approx(0.98)
    assert f["within_tolerance"] is True
    g = timing_figures(steps, wall, [True] * 4, warmup=1, collectives=[], tolerance_pct=4)
    assert g["within_tolerance"] is False  # 0.95 is 5% off


def _loop_rows(step: int = 20, *, fall: bool = True, offload_rows_early: bool = False):
    actions = [{"action_id": "1", "kind": "offload", "value": 1, "state": "verified", "step": step, "rule": "memory",
                "reason": "at the smallest micro-batch 1: offload on"},
               {"action_id": "2", "kind": "memory", "value": 0, "state": "cannot_fix", "step": None, "rule": "memory",
                "reason": "nothing left to change"}]
    ranks = [{"action_id": "1", "rank": 0, "stage": "received", "step": -1}] + [
        {"action_id": "1", "rank": r, "stage": "applied", "step": step} for r in range(2)]
    # the boundary of `step` follows step - 1: its offload_states lands in step - 1's rows
    offload = [{"rank": r, "step": s, "direction": d, "what": "optim_state", "bytes": 100}
               for r in range(2) for s in range(step - 1, step + 5) for d in ("d2h", "h2d")]
    if offload_rows_early:
        offload.append({"rank": 0, "step": step - 5, "direction": "d2h", "what": "grads", "bytes": 1})
    mib = 2**20
    memory = [{"rank": r, "step": s, "peak_bytes": (900 if s < step or not fall else 600) * mib}
              for r in range(2) for s in range(0, step + 12)]
    logs = {r: [{"step": s, "offloaded_states": ["optim_states"] if s >= step else []} for s in range(step + 12)]
            for r in range(2)}
    return actions, ranks, offload, memory, logs


def test_loop_figures_offload_at_one_step_rows_after_it_and_the_peak_falling() -> None:
    f = bench_gpu.loop_figures(*_loop_rows(), world=2, budget_bytes=500 * 2**20, on_gpu=True, window=10)
    assert f["checks_failed"] == [] and f["verdict"].startswith("passed")
    assert f["offload_step"] == 20 and f["offload_on_every_rank_at_one_step"] is True
    assert f["trainer_offloaded_from_step"] == {"0": 20, "1": 20}
    assert f["offload_rows_before"] == 0 and f["offload_rows_after"] == 2 * 6 * 2
    assert f["offload_bytes_after"] == {"d2h:optim_state": 1200, "h2d:optim_state": 1200}
    assert (f["peak_mb_before"], f["peak_mb_after"], f["memory_fell"]) == (900, 600, True)
    assert f["over_budget_after"] is True and f["cannot_fix"] == "nothing left to change"
    # the same rows on CPU: the fall is not judged, and said why
    c = bench_gpu.loop_figures(*_loop_rows(fall=False), world=2, budget_bytes=500 * 2**20, on_gpu=False, window=10)
    assert c["checks_failed"] == [] and c["memory_fell"] is None and "cannot fall" in c["memory_note"]


def test_loop_figures_fail_what_did_not_happen() -> None:
    g = bench_gpu.loop_figures(*_loop_rows(fall=False), world=2, budget_bytes=1, on_gpu=True)
    assert g["checks_failed"] == ["device memory fell"]
    acts, ranks, offload, memory, logs = _loop_rows(offload_rows_early=True)
    h = bench_gpu.loop_figures(acts, ranks[:-1], offload, memory, logs, world=2, budget_bytes=1, on_gpu=True)
    assert h["checks_failed"] == ["offload on at one step on every rank", "OFFLOAD rows only from that step"]
    logs[1] = [{"step": s, "offloaded_states": ["x"] if s >= 21 else []} for s in range(30)]  # rank 1 a step later
    k = bench_gpu.loop_figures(acts, ranks, offload[:-1], memory, logs, world=2, budget_bytes=1, on_gpu=True)
    assert k["checks_failed"] == ["the trainer's logs agree"]
    none = bench_gpu.loop_figures([], [], [], memory, logs, world=2, budget_bytes=1, on_gpu=True)
    assert none["offload_step"] is None and none["verdict"].startswith("FAILED")


# ----------------------------------------------------------------------------- the command


def _cli(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", "gpu", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_arguments_are_refused_with_the_fix(tmp_path: Path) -> None:
    r = _cli("--out", str(tmp_path / "o"), "--cpu", "--parts", "sync,bogus")
    assert r.returncode == 2 and "unknown part(s) bogus" in r.stderr
    f = tmp_path / "file"
    f.write_text("x")
    r = _cli("--out", str(f), "--cpu")
    assert r.returncode == 2 and "is a file" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_without_a_gpu_the_gpu_mode_says_to_rehearse_with_cpu(tmp_path: Path) -> None:
    r = _cli("--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "no CUDA device here; run with --cpu" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_cpu_rehearsal_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # the overhead run at 64 steps (--cpu's default is 96): quads of 4 x 2 steps from step 16 (the
    # warmup), 6 whole ones, one more than the check below asks for; 24 steps compared (10 asked)
    r = _cli("--out", str(out), "--cpu", "--json", "--steps", "64")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu.json", "gpu.log"]
    res = json.loads((out / "gpu.json").read_text())
    assert res == json.loads(r.stdout)
    assert res["mode"] == "cpu" and res["ok"] is True and res["collector"]["error"] is None
    for part, keys in bench_gpu.FIGURES.items():
        got = res["parts"][part]
        assert got["ok"] is True, (part, got["error"])
        assert set(keys) <= set(got), (part, set(keys) - set(got))

    sync = res["parts"]["sync"]  # CPU: said to be not applicable, not a fake pass
    assert sync["applicable"] is False and sync["hooks_passed"] is None and sync["syncs_added_by_hooks"] is None
    assert "not applicable on CPU" in sync["verdict"]
    assert "not applicable on CPU" in sync["deepspeed_warn_mode"]["note"]
    assert sync["step_rows"] == sync["step_rows_under_check"] == sync["steps"] and sync["hook_errors"] == 0
    assert sync["collective_rows"] == sync["steps"] * sync["collectives_per_step"]

    ddp = res["parts"]["ddp"]  # the DDP comm hook's CUDA-event path over host events; no sync check on CPU
    assert ddp["applicable"] is False and ddp["hooks_passed"] is None and "not applicable on CPU" in ddp["verdict"]
    assert ddp["timed_by_comm_hook"] is True and ddp["hook_errors"] == 0 and ddp["control_passed"] is True
    assert ddp["step_rows"] == ddp["step_rows_under_check"] == ddp["steps"]
    # 4 Linear(256, 256) in fp32 with 0.25 MB buckets: one bucket a layer, their bytes the gradients'
    assert ddp["grad_bytes"] == 4 * 4 * (256 * 256 + 256) == ddp["bucket_bytes_per_step"] and ddp["bytes_match"] is True
    assert ddp["buckets_per_step"] == 4 and ddp["bucket_rows"] == 4 * ddp["steps"]
    assert 0 < ddp["bucket_over_step_max"] <= 1.0 and ddp["bucket_ms_median"] > 0
    assert 0.5 < ddp["steps_over_wall"] <= 1.0  # the steps' clock inside the loop's wall clock
    assert ddp["emitter_resolves"] is True and set(ddp["resolved_by_threads"]) == {"tracetop-emitter"}

    over = res["parts"]["overhead"]
    assert over["quads"] >= 5 and over["off_step_ms"] > 0
    assert over["overhead_wall_ci95_low_pct"] <= over["overhead_wall_pct"] <= over["overhead_wall_ci95_high_pct"]
    assert over["ns_per_event_cpu_path"] > 0 and over["ns_per_event_cuda_path"] is None

    timing = res["parts"]["timing"]  # computed from the hooks' rows and the trainer's own step timer
    assert timing["steps_compared"] >= 10
    # the phases are inside the step and the step inside the trainer's own interval: neither exceeds 1
    assert 0.5 < timing["phase_sum_over_step_median"] <= timing["phase_sum_over_step_max"] <= 1.0
    assert 0.9 < timing["step_over_wall_median"] <= 1.0
    # the CPU rehearsal puts the hooks on their GPU accounting path (a host clock behind the device-clock
    # interface): the emitter, never the training thread, resolves the events
    assert "deferred" in timing["timer"]
    assert timing["emitter_resolves"] is True and timing["resolved_on_training_thread"] == 0
    assert timing["resolved_by_threads"]["tracetop-emitter"] >= 2 * timing["steps_compared"]

    nvml = res["parts"]["nvml"]
    assert nvml["backend"] == "fake" and nvml["passes"] >= 2 and nvml["xid_watcher_up"] is True
    assert "power_mw" in nvml["fields_read"] and nvml["sample_ms_per_pass"] > 0

    off = res["parts"]["offload"]
    # ZeRO-2 + optimizer offload, fp32, dp 1, 2 micro-batches (shared/notes/deepspeed-instrumentation.md §3):
    # per step d2h = 2 x N x 4 (accumulation) + N x 4 (boundary), h2d = N x 4 (accumulation) + N x 4 (params)
    n = n_params(PRESETS["tiny"])
    assert off["hooks_d2h_bytes"] == off["steps"] * 12 * n
    assert off["hooks_h2d_bytes"] == off["steps"] * 8 * n
    assert off["window_s"] > 0 and off["nvml_backend"] == "fake"
    assert off["nvml_tx_bytes"] == 0 and off["d2h_vs_tx_pct"] is None  # fake counters stand still: no ratio

    loop = res["parts"]["loop"]  # the auto loop's offload on two gloo ranks (the GPU part's code path)
    assert loop["offload_on_every_rank_at_one_step"] is True and loop["offload_state"] in ("applied", "verified")
    assert set(loop["trainer_offloaded_from_step"].values()) == {loop["offload_step"]}
    assert loop["offload_rows_before"] == 0 and loop["offload_rows_after"] > 0
    # offload_states moves the optimizer state (Adam's two fp32 moments) and the fp32 params of each rank's partition
    assert loop["offload_bytes_after"]["d2h:optim_state"] == 2 * loop["offload_bytes_after"]["d2h:params"]
    assert loop["memory_fell"] is None and "cannot fall" in loop["memory_note"]
    assert loop["offload_action"]["proposed_by"] == "controller" and "smallest micro-batch" in loop["offload_action"]["reason"]
    assert (out / "gpu.log").stat().st_size < 1 << 20


def test_sync_watch_catches_the_sync_warning_in_any_thread_and_lets_others_through() -> None:
    import threading
    import warnings

    from reference_trainer.bench.gpu_child import SyncWatch

    modes: list[object] = []
    window = {"current_step": 7}
    watch = SyncWatch(window, set_mode=modes.append)  # the CUDA switch itself needs a GPU: recorded here
    with warnings.catch_warnings(record=True) as other:
        warnings.simplefilter("always")
        watch.start()
        try:
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
            t = threading.Thread(target=warnings.warn, args=("called a synchronizing CUDA operation",),
                                 name="tracetop-emitter")
            t.start()
            t.join()
            warnings.warn("something else", UserWarning, stacklevel=1)
        finally:
            watch.stop()
    assert modes == ["warn", 0]
    assert [(step, owner) for step, owner, _ in watch.records] == [(7, "other"), (7, "hooks")]
    assert "test_bench_gpu.py" in watch.records[0][2]
    assert [str(w.message) for w in other] == ["something else"]


def test_the_overhead_run_is_sized_to_its_limit_by_the_plain_loop(tmp_path: Path) -> None:
    import argparse

    def bench(steps: int | None = None) -> bench_gpu.Bench:
        p = argparse.ArgumentParser()
        bench_gpu.add_arguments(p)
        argv = ["--out", str(tmp_path / "o"), "--keep", str(tmp_path / "k")] + (["--steps", str(steps)] if steps else [])
        return bench_gpu.Bench(p.parse_args(argv))

    b = bench()
    assert b.steps == 400 and b.overhead_limit_s == 300
    b.size_overhead_run(100.0)  # a DeepSpeed step ~0.45 s: 400 steps fit in 300 - 90 s
    assert b.steps == 400
    b.size_overhead_run(300.0)  # ~1.35 s: (300 - 90) / 1.35 = 155 steps, cut to whole quads
    assert b.steps == 152
    b.size_overhead_run(5000.0)
    assert b.steps == 96  # never below 12 quads
    given = bench(steps=400)
    given.size_overhead_run(5000.0)
    assert given.steps == 400  # --steps wins


def test_a_failing_part_is_recorded_and_the_next_one_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _cli("--out", str(out), "--cpu", "--parts", "offload,nvml", "--offload-model", "nosuch", "--nvml-s", "2")
    assert r.returncode == 1, r.stderr[-3000:]
    res = json.loads((out / "gpu.json").read_text())
    off, nvml = res["parts"]["offload"], res["parts"]["nvml"]
    assert off["ok"] is False and "offload: exited 2" in off["error"] and "nosuch" in off["error"]
    assert all(off[k] is None for k in bench_gpu.FIGURES["offload"])  # its figures stay null, not half-filled
    assert nvml["ok"] is True and nvml["passes"] >= 1  # ran after the failure
    assert res["parts"]["sync"]["ok"] is None and res["ok"] is False
    assert "nosuch" in (out / "gpu.log").read_text()


def test_parts_the_budget_cannot_hold_are_skipped_and_said_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _cli("--out", str(out), "--cpu", "--budget-s", "1")
    assert r.returncode == 1
    res = json.loads((out / "gpu.json").read_text())
    for part in bench_gpu.PARTS:
        assert res["parts"][part]["ok"] is False and res["parts"][part]["error"].startswith("skipped:"), part
