"""`tracetop bench hooks`: the pure pairing and estimate, and one short real run of the whole benchmark."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from reference_trainer.bench.hooks import block_quads, estimate, idle_rate


def _log(*, block: int, steps: int, warmup: int, on_s: float, off_s: float, base_s: float, drift_s: float,
         hook_threads_s: float) -> dict:
    """A run as _bench_child writes it: ABBA blocks, per-step training-thread CPU on_s / off_s plus
    a linear drift, base_s of other threads' CPU per step, hook_threads_s over the window."""
    on, thread, cpu, wall = [], [], [], []
    for n in range(steps):
        b = n // block
        first_on = (b // 2) % 2 == 0
        state = first_on if b % 2 == 0 else not first_on
        t = (on_s if state else off_s) + drift_s * n
        on.append(state)
        thread.append(t)
        cpu.append(t + base_s)
        wall.append(t + base_s)
    window = {"on_steps": sum(on[warmup:]), "steps": steps - warmup, "hook_threads_cpu_s": hook_threads_s,
              "wall_s": sum(wall[warmup:])}
    return {"block": block, "warmup": warmup, "on": on, "thread_cpu_s": thread, "cpu_s": cpu, "wall_s": wall,
            "window": window}


def test_blocks_group_in_abba_quads_and_a_linear_drift_cancels() -> None:
    kw = dict(block=4, steps=200, warmup=8, on_s=0.0101, off_s=0.0100, base_s=0.0002, hook_threads_s=0.0)
    quads = block_quads(_log(**kw, drift_s=0.0))
    assert len(quads.thread_on) == len(quads.thread_off) == (200 - 16) // 16  # the warmup cuts into quad 0
    assert quads.thread_on == pytest.approx([0.0101] * len(quads.thread_on))
    assert quads.thread_off == pytest.approx([0.0100] * len(quads.thread_off))
    steady = estimate([quads])
    assert steady["training_thread_pct"] == pytest.approx(0.0001 / 0.0102 * 100)
    # 10 us a step: a 4-step block moves 40 us, 40% of the effect; inside an ABBA quad it cancels
    drifting = estimate([block_quads(_log(**kw, drift_s=1e-5))])
    assert drifting["training_thread_pct"] * drifting["off_step_cpu_ms"] == pytest.approx(0.0001e3 * 100)


def test_hook_threads_are_charged_to_the_on_steps_and_added() -> None:
    log = _log(block=4, steps=208, warmup=8, on_s=0.0100, off_s=0.0100, base_s=0.0, drift_s=0.0, hook_threads_s=0.005)
    est = estimate([block_quads(log)])
    assert log["window"]["on_steps"] == 100
    # 5 ms over 100 on-steps of 10 ms: 0.5%, and nothing on the training thread
    assert est["hook_threads_pct"] == pytest.approx(0.5)
    assert est["training_thread_pct"] == pytest.approx(0.0, abs=1e-9)
    assert est["overhead_pct"] == pytest.approx(0.5)
    assert est["ci95_low_pct"] == pytest.approx(0.5) and est["ci95_high_pct"] == pytest.approx(0.5)


def test_an_aa_control_splits_the_hook_threads_into_idle_ticking_and_work_for_rows() -> None:
    # hook threads tick at 2 ms per s of wall time whatever happens, and rows cost them 3 ms in all
    kw = dict(block=4, steps=208, warmup=8, on_s=0.0100, off_s=0.0100, base_s=0.0, drift_s=0.0)
    control = block_quads(_log(**kw, hook_threads_s=0.002 * 2.0))  # 200 steps of 10 ms: 2 s
    assert idle_rate(control) == pytest.approx(0.002)
    run = block_quads(_log(**kw, hook_threads_s=0.002 * 2.0 + 0.003))
    est = estimate([run], idle_cpu_per_s=idle_rate(control))
    # always on: 2 ms/s of 10 ms steps = 20 us a step, plus 3 ms over 100 on-steps = 30 us: 0.5%
    assert est["hook_threads_pct"] == pytest.approx(0.5)
    # everything on the 100 on-steps: 7 ms / 100 / 10 ms
    assert est["hook_threads_upper_pct"] == pytest.approx(0.7)
    assert estimate([run])["hook_threads_pct"] == pytest.approx(0.7)


@pytest.mark.slow
def test_bench_hooks_prints_one_json_object() -> None:
    # 112 steps: quads of 4 x 4 steps start at steps 16, 32, ... 96 (the warmup cuts the first): 6 whole
    # quads, one more than the check below asks for; the test checks the output's shape, not the figure
    out = subprocess.run(
        [sys.executable, "-m", "tracetop.cli", "bench", "hooks", "--json", "--runs", "1", "--steps", "112",
         "--block", "4", "--warmup", "10", "--micro-blocks", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"overhead_pct", "ns_per_event", "overhead_wall_pct", "quads", "hook_threads_pct"} <= set(result)
    assert result["quads"] >= 5 and result["ns_per_event"] > 0
    assert result["hook_threads_pct"] > 0, "the hooks' threads (emitter, shipper) cost something; zero means they went unmeasured"
    assert result["ci95_low_pct"] <= result["overhead_pct"] <= result["ci95_high_pct"]
    assert 0 < result["hook_threads_idle_ms_per_s"] and result["aa_training_thread_pct"] is not None
    assert result["hook_threads_pct"] <= result["hook_threads_upper_pct"]
