"""`tracetop bench hooks`: the pure pairing, and one short real run of the whole benchmark."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer_hooks.bench import block_ratios


def _log(block: int, blocks: int, on_cost: float, off_cost: float, ship: float) -> dict:
    on, wall, cpu, switches, shipped = [], [], [], [], []
    for b in range(blocks):
        first_on = (b // 2) % 2 == 0
        state = first_on if b % 2 == 0 else not first_on
        switches.append(b * block)
        if state:
            shipped.append((b, ship))
        for _ in range(block):
            on.append(state)
            cost = on_cost if state else off_cost
            wall.append(cost)
            cpu.append(cost)
    return {"block": block, "on": on, "wall_s": wall, "cpu_s": cpu, "switch_steps": switches, "ship_cpu_s": shipped}


def test_block_pairs_follow_abba_and_charge_shipping_to_on_blocks() -> None:
    cpu, wall = block_ratios(_log(block=10, blocks=8, on_cost=0.011, off_cost=0.010, ship=0.008), warmup=0)
    assert len(cpu) == 4
    # 10% slower steps plus 8 ms of shipping spread over the 8 counted steps of the block
    assert cpu == pytest.approx([(0.011 + 0.001) / 0.010] * 4)
    assert wall == pytest.approx(cpu)
    none, _ = block_ratios(_log(block=10, blocks=8, on_cost=0.01, off_cost=0.01, ship=0.0), warmup=0)
    assert none == pytest.approx([1.0] * 4)


@pytest.mark.slow
def test_bench_hooks_prints_one_json_object() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tracetop.cli", "bench", "hooks", "--json", "--runs", "1", "--steps", "150",
         "--block", "30", "--warmup", "10", "--micro-blocks", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"overhead_pct", "ns_per_event", "overhead_wall_pct", "block_pairs"} <= set(result)
    assert result["block_pairs"] >= 2 and result["ns_per_event"] > 0
