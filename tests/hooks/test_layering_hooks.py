"""Every trainer_hooks module imports without duckdb, textual, the collector, the agent or the TUI."""

from __future__ import annotations

import subprocess
import sys

import pytest

FORBIDDEN = ("duckdb", "textual", "collector", "agent", "tui")
MODULES = ["trainer_hooks", "trainer_hooks.deepspeed", "trainer_hooks.pipeline", "trainer_hooks.offload",
           "trainer_hooks.collectives", "trainer_hooks.bench", "reference_trainer.tracing"]


@pytest.mark.parametrize("module", MODULES)
def test_hooks_modules_pull_in_nothing_forbidden(module: str) -> None:
    code = f"import sys, {module}; print(','.join(m for m in {FORBIDDEN!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} pulled in {out.stdout.strip()}"


def test_a_traced_step_pulls_in_nothing_forbidden() -> None:
    code = (
        "import sys\n"
        "from tracetop.wire.shipper import MemoryTransport\n"
        "import trainer_hooks\n"
        "t = trainer_hooks.Tracer(rank=0, world_size=1, run_id='l', transport=MemoryTransport())\n"
        "with t.step(0):\n"
        "    with t.phase('forward'): pass\n"
        "t.close()\n"
        f"print(','.join(m for m in {FORBIDDEN!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
