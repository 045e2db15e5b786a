"""tracetop plan: hand-computed memory on small cases, the rules, bad inputs, the CLI's JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from reference_trainer import plan as P
from reference_trainer.config import PRESETS, make_layout

GB = 1e9


def test_state_bytes_by_zero_stage_by_hand() -> None:
    # 2 weights + 2 grads + 12 optimizer bytes per parameter, sharded over dp = 4 by stage
    assert P.state_bytes_per_param(0, 4, "none") == (2, 2, 12)
    assert P.state_bytes_per_param(1, 4, "none") == (2, 2, 3)
    assert P.state_bytes_per_param(2, 4, "none") == (2, 0.5, 3)
    assert P.state_bytes_per_param(3, 4, "none") == (0.5, 0.5, 3)
    assert P.state_bytes_per_param(2, 4, "cpu") == (2, 0.5, 0)


def test_memory_small_model_by_hand() -> None:
    # 1e9 params, 8 layers, hidden 1024, 8 heads, seq 512; tp 2, pp 2, dp 2, ZeRO 1, micro-batch 2, m 4
    m = P.Model(params=1e9, layers=8, hidden=1024, heads=8, seq=512)
    mem = P.memory_per_gpu(m, tp=2, pp=2, dp=2, zero_stage=1, offload="none", micro_batch=2, micro_batches=4,
                           recompute=False)
    held = 1e9 / 4  # params per GPU
    assert mem.weights_gb == pytest.approx(held * 2 / GB)  # 0.5 GB
    assert mem.grads_gb == pytest.approx(0.5)
    assert mem.optimizer_gb == pytest.approx(held * 12 / 2 / GB)  # 1.5 GB
    # per layer: s*b*h*(10 + 24/t + 5*a*s/(h*t)) = 512*2*1024*(10 + 12 + 5*8*512/2048) = 1048576*32
    per_layer = 512 * 2 * 1024 * 32
    # first stage: 8/2 = 4 layers, min(pp=2, m=4) = 2 micro-batches in flight
    assert mem.activations_gb == pytest.approx(4 * 2 * per_layer / GB)
    assert mem.total_gb == pytest.approx(0.5 + 0.5 + 1.5 + 4 * 2 * per_layer / GB)
    rec = P.memory_per_gpu(m, tp=2, pp=2, dp=2, zero_stage=1, offload="none", micro_batch=2, micro_batches=4,
                           recompute=True)
    assert rec.activations_gb == pytest.approx(4 * 2 * (2 * 512 * 2 * 1024) / GB)


def test_zero3_offload_keeps_one_layer_of_weights() -> None:
    m = P.Model(params=8e9, layers=32, hidden=4096, heads=32, seq=1024)
    mem = P.memory_per_gpu(m, tp=1, pp=1, dp=8, zero_stage=3, offload="cpu", micro_batch=1, micro_batches=1,
                           recompute=True)
    assert mem.weights_gb == pytest.approx(2 * 8e9 / 32 / GB)
    assert mem.optimizer_gb == 0
    assert mem.grads_gb == pytest.approx(2 * 8e9 / 8 / GB)


def test_bubble_and_grad_sync_by_hand() -> None:
    assert P.bubble(4, 64) == pytest.approx(3 / 67)
    assert P.bubble(1, 8) == 0
    m = P.Model(params=1e9, layers=8, hidden=1024, heads=8, seq=512)
    # all-reduce of 2e9/2 bf16 bytes per GPU (tp 2) over dp 4 at 100 GB/s: 2*3/4 * 1e9 B / 100e9 B/s = 15 ms
    assert P.grad_sync_ms(m, tp=2, pp=1, dp=4, zero_stage=1, busbw_gbps=100) == pytest.approx(15.0)
    assert P.grad_sync_ms(m, tp=2, pp=1, dp=4, zero_stage=3, busbw_gbps=100) == pytest.approx(22.5)
    assert P.grad_sync_ms(m, tp=2, pp=1, dp=1, zero_stage=1, busbw_gbps=100) == 0


def test_every_plan_is_a_layout_the_reference_trainer_accepts() -> None:
    model = P.derive_model(13e9)
    cluster = P.Cluster(gpus=64)
    tiny = PRESETS["tiny"]
    for p in P.candidates(model, cluster, 512):
        assert p.tp * p.pp * p.dp == 64
        assert model.heads % p.tp == 0 and model.layers % p.pp == 0 and 8 % p.tp == 0
        assert p.micro_batch * p.micro_batches * p.dp == 512
        # the trainer's own rules (the tiny preset only for its head/layer checks: tp <= 4, pp <= 4)
        if p.tp <= 4 and p.pp <= 4:
            make_layout(64, p.tp, p.pp, p.zero_stage, p.offload, tiny)


def test_ranked_plans_fit_and_come_best_first() -> None:
    model = P.derive_model(130e9)
    cluster = P.Cluster(gpus=512)
    plans = P.plan(model, cluster, 1024, top=5)
    assert plans and all(p.fits and p.memory.total_gb <= cluster.budget_gb for p in plans)
    assert [p.step_ms for p in plans] == sorted(p.step_ms for p in plans)
    # the seed's example answer for 130B on 512 GPUs of 80 GB: tp=8 (a node), pp=4, dp=16
    best = plans[0]
    assert (best.tp, best.pp, best.dp) == (8, 4, 16)
    # its memory by hand: 130e9/32 params per GPU * (2 + 2 + 12/16) bytes + activations
    held = 130e9 / 32
    act = 22 * 4 * 2048 * 1 * 11264 * (10 + 24 / 8 + 5 * 88 * 2048 / (11264 * 8))
    assert best.memory.total_gb == pytest.approx((held * 4.75 + act) / GB)


def test_nothing_fits_says_what_would() -> None:
    with pytest.raises(P.PlanError, match=r"it would fit on \d+ GPUs"):
        P.plan(P.derive_model(1e12), P.Cluster(gpus=16), 1024)


def test_gpus_not_whole_nodes_refused() -> None:
    with pytest.raises(P.PlanError, match="multiple of 8"):
        P.check_cluster(P.Cluster(gpus=12))
    P.check_cluster(P.Cluster(gpus=4))  # half a node is fine


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetop.cli", "plan", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_json_shape_and_exit_codes() -> None:
    out = _plan_cli("--params", "13e9", "--gpus", "64", "--json", "--top", "3")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert 1 <= len(plans) <= 3
    for p in plans:
        for k in ("tp", "pp", "dp", "zero_stage", "offload", "micro_batch", "micro_batches", "memory_per_gpu_gb",
                  "bubble", "command"):
            assert k in p
        assert p["tp"] * p["pp"] * p["dp"] == 64
        assert f"--tp {p['tp']} --pp {p['pp']}" in p["command"]
        assert "#SBATCH --nodes=8" in p["commands"]["sbatch"]
    bad = _plan_cli("--params", "130e9", "--gpus", "7")
    assert bad.returncode == 2 and "multiple of 8" in bad.stderr and bad.stdout == ""
    huge = _plan_cli("--params", "1e13", "--gpus", "8")
    assert huge.returncode == 2 and "fits no layout" in huge.stderr


def test_offload_time_by_hand() -> None:
    # 1e9 params, dp 4, ZeRO-2 + cpu: a 2.5e8-parameter shard; PCIe 4 bytes each at 20 GB/s = 50 ms,
    # the host Adam step at 2e9 parameters/s = 125 ms
    m = P.Model(params=1e9, layers=8, hidden=1024, heads=8, seq=512)
    c = P.Cluster(gpus=4, host_gbps=20.0, cpu_adam_params_per_s=2e9)
    got = [p for p in P.candidates(m, c, 16) if (p.tp, p.pp, p.zero_stage, p.offload) == (1, 1, 2, "cpu")]
    assert got and all(p.offload_ms == pytest.approx(175.0) for p in got)
    assert all(p.offload_ms == 0 for p in P.candidates(m, c, 16) if p.offload == "none")
