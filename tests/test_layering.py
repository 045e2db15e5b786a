"""STYLE.md habit 6: what each package may pull in, checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

FORBIDDEN = {
    # package imported -> modules that must not appear in sys.modules afterwards
    "tracetop.wire.shipper": ("duckdb", "textual", "torch", "collector", "agent", "tui", "trainer_hooks", "reference_trainer"),
    "tracetop.procs": ("duckdb", "textual", "torch", "grpc", "collector", "agent", "tui", "trainer_hooks", "reference_trainer"),
    "tracetop.wire.auth": ("duckdb", "textual", "torch", "collector", "agent", "tui", "trainer_hooks", "reference_trainer"),
    "tracetop.cli": ("duckdb", "textual", "torch", "grpc", "collector", "agent", "tui", "trainer_hooks"),
    "trainer_hooks": ("duckdb", "textual", "collector", "agent", "tui"),
    "agent": ("duckdb", "textual", "collector", "tui", "trainer_hooks", "torch"),
    "collector": ("textual", "agent", "tui", "trainer_hooks", "torch"),
    # tracetop bench gpu: the driver starts the agent's and the collector's parts as processes
    "reference_trainer.bench_gpu": ("duckdb", "textual", "torch", "collector", "agent", "tui"),
    "reference_trainer.bench_gpu_child": ("duckdb", "textual", "collector", "agent", "tui"),
    "agent.bench_gpu": ("duckdb", "textual", "torch", "collector", "tui", "trainer_hooks", "reference_trainer"),
    # the outputs: OTLP's SDK only when --otlp asks for it; no file access
    "collector.export": ("duckdb", "opentelemetry", "textual", "agent", "tui", "trainer_hooks", "torch"),
    # the planner is arithmetic in the shared core: nothing of ours, no database, no plotting
    "tracetop.plan": ("duckdb", "textual", "torch", "grpc", "matplotlib", "collector", "agent", "tui",
                      "trainer_hooks", "reference_trainer"),
    "tracetop.plan_cli": ("duckdb", "textual", "torch", "grpc", "matplotlib", "collector", "agent", "tui",
                          "trainer_hooks", "reference_trainer"),
    # the report's plotting library loads only when a report is drawn
    "collector.report_html": ("matplotlib", "textual", "agent", "tui", "trainer_hooks", "torch"),
    # the live engine, what the collector's server loads with rules
    "collector.live.engine": ("textual", "agent", "tui", "trainer_hooks", "torch", "grpc"),
    "collector.live.rules_cli": ("duckdb", "textual", "agent", "tui", "trainer_hooks", "torch", "grpc"),
    # the TUI reads only through the wire and read-only SQL (DESIGN §2, §10): no collector internals
    "tui.app": ("collector", "agent", "trainer_hooks", "reference_trainer", "torch"),
    "tui.cli": ("collector", "agent", "trainer_hooks", "reference_trainer", "torch", "textual", "duckdb"),
    # the snapshot definition is shared core: nothing of ours, no UI, no DuckDB until a build runs
    "tracetop.snapshot": ("collector", "agent", "tui", "trainer_hooks", "textual", "duckdb", "grpc"),
}


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_import_pulls_in_nothing_forbidden(module: str) -> None:
    code = f"import sys, {module}; print(','.join(sorted(m for m in {FORBIDDEN[module]!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} pulled in {out.stdout.strip()}"
