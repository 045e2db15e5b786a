"""Scaling, bubble, memory and loss rules on real runs into one real collector (--baseline base).

Runs: `base` (DP1), `dp2delay` (DP2, rank 0 enters its gradient reduction 1.5 s late from step
3), `dp2` (DP2, clean), `imbal` (PP2, stage 1 three times slower from step 4), `mem` (DP1, rank 0
grows 4 MB a step, memory sampled every 0.5 s), and `loss` (a plain loop with a Tracer that gives
its loss, one spike at step 20). The thresholds are the built-in ones, except where this 2-core
machine needs looser ones; each is said below."""

from __future__ import annotations

import json
import time

import pytest

from collector.live.rules import DEFAULTS_TOML
from tests.collector.live.judged import wait_judged
from tests.collector.live.test_live_runs import _env
from tests.collector.util import sql
from tests.support.services import start_collector
from tests.support.torchrun import torchrun

pytestmark = pytest.mark.slow

# DP2 shares two loaded cores with everyone else: its per-rank throughput sits well under DP1's
# without any fault (measured below 0.4 of it), so the efficiency bar is 0.2 here; the injected
# 1.5 s delay takes it under 0.1. A DP1 baseline has no gradient reduction: its grad-sync counts
# as at least 150 ms (so the rule's bar is sqrt(2) x 150 = 212 ms; the delay makes it ~750 ms).
DELAY_MS = 1500
RULES = (DEFAULTS_TOML
         .replace("efficiency_below = 0.75", "efficiency_below = 0.2")
         .replace("sqrt_k_ratio_above = 1.0", "sqrt_k_ratio_above = 1.0\nbaseline_floor_ms = 150")
         .replace("used_of_budget_above = 0.90", "used_of_budget_above = 0.80\nbudget_mb = 900"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live_signals")
    rules = tmp / "rules.toml"
    rules.write_text(RULES)
    c = start_collector(tmp, listen="unix", extra_args=["--rules", str(rules), "--baseline", "base"], metrics=True)
    plans = [
        ("base", 1, ["--steps", "14"]),
        ("dp2delay", 2, ["--steps", "12", "--inject-comm-delay", f"0:{DELAY_MS}@3"]),
        ("dp2", 2, ["--steps", "14"]),
        ("imbal", 2, ["--pp", "2", "--steps", "16", "--micro-batch", "64", "--micro-batches", "2",
                      "--inject-stage-imbalance", "1:3@4"]),
        ("mem", 1, ["--steps", "100", "--inject-mem-growth", "0:4@2"]),
    ]
    try:
        for run_id, nproc, args in plans:
            extra = {"TRACETOP_HEARTBEAT_S": "0.5"} if run_id == "mem" else {}
            with _env(TRACETOP_ENDPOINT=c.addr, TRACETOP_RUN_ID=run_id, **extra):
                r = torchrun(tmp / run_id, nproc=nproc, trace=True, args=args)
            assert r.rc == 0, r.output[-3000:]
        _loss_loop(c.addr)
        wait_judged(c, *(p[0] for p in plans), "loss")  # the last steps settle and are judged
        yield {"collector": c, "alerts": sql(c.addr, "SELECT * FROM alerts ORDER BY first_ns").to_pylist(),
               "steps": sql(c.addr, "SELECT run_id, step, rank, loss FROM step").to_pylist(),
               "stage_compute": sql(c.addr, "SELECT step, stage, compute_ms FROM bubble_budget WHERE run_id = 'imbal'"
                                    ).to_pylist(),
               "memory": sql(c.addr, "SELECT run_id, step, rss_bytes FROM memory WHERE run_id = 'mem'").to_pylist()}
    finally:
        c.stop()


SPIKE_STEP = 20


def _loss_loop(addr: str) -> None:
    """A plain training loop (no DeepSpeed) that hands its loss to the tracer."""
    from trainer_hooks import Tracer

    t = Tracer(endpoint=addr, run_id="loss", rank=0, world_size=1, wrap_collectives=False)
    for n in range(SPIKE_STEP + 4):
        with t.step(n):
            with t.phase("forward"):
                time.sleep(0.002)
            t.set_loss(2.0 - 0.01 * n + (0.6 if n == SPIKE_STEP else 0.0))
    t.close()


def _of(runs, run_id: str, signal: str) -> list[dict]:
    return [a for a in runs["alerts"] if a["run_id"] == run_id and a["signal"] == signal]


def test_scaling_efficiency_and_sqrt_k_name_the_baseline_only_with_the_delay(runs):
    eff, sqk = _of(runs, "dp2delay", "scaling_efficiency"), _of(runs, "dp2delay", "grad_sync_scaling")
    assert eff and sqk, json.dumps([a for a in runs["alerts"] if a["run_id"] == "dp2delay"], default=str)[:3000]
    for a in eff + sqk:
        assert json.loads(a["labels"])["baseline"] == "base" and "base" in a["message"]
        assert a["first_step"] >= 3
    assert eff[0]["value"] < 0.2
    assert not _of(runs, "dp2", "scaling_efficiency") and not _of(runs, "dp2", "grad_sync_scaling"), \
        [a for a in runs["alerts"] if a["run_id"] == "dp2"]


def test_stage_imbalance_bubble_alert_names_the_slow_stage(runs):
    # went firing after the injection began (a noisy step 3 may open the same breach a step early)
    bub = [a for a in _of(runs, "imbal", "bubble") if a["fired_step"] >= 4]
    assert bub, [a for a in runs["alerts"] if a["run_id"] == "imbal"]
    assert {json.loads(a["labels"]).get("slow_stage") for a in bub} == {"1"}
    assert any("stage 1 is the slow stage" in a["message"] for a in bub)
    imb = [a for a in _of(runs, "imbal", "stage_imbalance") if a["fired_step"] >= 4]
    assert imb and imb[0]["value"] > 1.2 and json.loads(imb[0]["labels"])["slow_stage"] == "1"
    # the live figures see the injection: stage 1 computes ~3x what it did before step 4 (its
    # forwards and backwards each sleep 2x their own recent median), read against stage 0's compute
    # in the same step. Alone, stage 1's figure compared a median of 3 early steps with the rest,
    # under whatever load each had: at load 7-12 it rose 1.97x for the 3x injection (428.9 vs 2 x
    # 218 ms) and failed the 2x bar; both stages of one step share the same load
    c: dict[int, dict[int, float]] = {}
    for r in runs["stage_compute"]:
        c.setdefault(r["step"], {})[r["stage"]] = r["compute_ms"]
    ratio = {s: v[1] / v[0] for s, v in c.items() if v.get(0) and v.get(1) is not None}
    before = sorted(v for s, v in ratio.items() if 1 <= s < 4)
    after = sorted(v for s, v in ratio.items() if s >= 5)
    assert len(before) == 3 and len(after) >= 10, c
    assert after[len(after) // 2] > 2.0 * before[len(before) // 2], (ratio, c)


def test_memory_alert_before_the_budget_is_reached(runs):
    mem = _of(runs, "mem", "memory")
    assert mem, [a for a in runs["alerts"] if a["run_id"] == "mem"]
    a = mem[0]
    assert a["rank"] == 0, a
    # at the step it fired, rank 0 used between 80% and 100% of the 900 MB budget: before reaching it
    # (memory is sampled every 0.5 s, every ~6-19 steps here: 4 MB a step keeps a sample in that band)
    rss = {r["step"]: r["rss_bytes"] for r in runs["memory"]}
    assert 0.8 * 900 * 2**20 < rss[a["fired_step"]] < 900 * 2**20, (a["fired_step"], rss)
    # the growth was real (host pages counted as touched: at least half the injected 4 MB a step)
    assert rss[max(rss)] - rss[min(rss)] > 0.5 * 4 * 2**20 * (max(rss) - 2)


def test_loss_recorded_and_spike_alert(runs):
    losses = {r["step"]: r["loss"] for r in runs["steps"] if r["run_id"] == "loss"}
    assert losses[SPIKE_STEP] == pytest.approx(2.0 - 0.2 + 0.6)
    spikes = _of(runs, "loss", "loss_spike")
    assert [a["first_step"] for a in spikes] == [SPIKE_STEP], spikes
    assert "over its rolling median" in spikes[0]["message"]
    # the reference trainer's loss arrives too (DeepSpeed's train_batch return, through the hooks)
    ref = [r["loss"] for r in runs["steps"] if r["run_id"] == "base"]
    assert ref and all(x is not None and 0 < x < 10 for x in ref)
