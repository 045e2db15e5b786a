"""What each package may pull in, checked in a fresh interpreter (STYLE.md habit 6; harlequin's
``test_import_hygiene.py``): one table, a reason per row.

A forbidden name matches the module and everything under it (``collector`` forbids
``collector.query.snapshot`` too); ``allow`` lists what is let through all the same (the TUI may use
the collector's read model, ``collector.query``, and nothing else of the collector).
"""

from __future__ import annotations

import subprocess
import sys
from typing import NamedTuple

import pytest

OURS = ("collector", "agent", "tui", "trainer_hooks", "reference_trainer")
HEAVY = ("duckdb", "textual", "torch", "grpc", "matplotlib")
#: what the hooks and their integrations never load
HOOKS_FORBIDDEN = ("duckdb", "textual", "collector", "agent", "tui", "reference_trainer")


class Rule(NamedTuple):
    forbidden: tuple[str, ...]
    reason: str
    allow: tuple[str, ...] = ()


LAYERS: dict[str, Rule] = {
    "tracetop.wire.shipper": Rule(
        ("duckdb", "textual", "torch", *OURS),
        "the shipper runs in every rank and every agent: the wire and nothing else"),
    "tracetop.procs": Rule(
        ("duckdb", "textual", "torch", "grpc", *OURS),
        "starting a service process needs only the standard library"),
    "tracetop.wire.auth": Rule(
        ("duckdb", "textual", "torch", *OURS),
        "TLS and token setup is shared by every sender and server"),
    "tracetop.errors": Rule(
        (*HEAVY, *OURS), "the exception root is imported by everything, so it imports nothing"),
    "tracetop.cli": Rule(
        ("duckdb", "textual", "torch", "grpc", "collector", "agent", "tui", "trainer_hooks"),
        "`tracetop --help` and `tracetop query` start fast: each command imports its own module"),
    "trainer_hooks": Rule(HOOKS_FORBIDDEN, "the hooks run inside user trainers: no database, no UI, no server code"),
    **{f"trainer_hooks.integrations.{m}": Rule(HOOKS_FORBIDDEN, f"the {m} integration is part of the hooks")
       for m in ("deepspeed", "pipeline", "offload", "collectives")},
    "reference_trainer.tracing": Rule(
        ("duckdb", "textual", "collector", "agent", "tui"),
        "the reference trainer traces itself as a user trainer would"),
    "agent": Rule(
        ("duckdb", "textual", "torch", "collector", "tui", "trainer_hooks", "reference_trainer"),
        "the node agent is small and lives beside training: NVML, /proc and the wire"),
    "collector": Rule(
        ("textual", "torch", "agent", "tui", "trainer_hooks", "reference_trainer"),
        "the collector stores and judges; it runs nothing of the trainer's side"),
    "collector.export": Rule(
        ("duckdb", "opentelemetry", "textual", "torch", "agent", "tui", "trainer_hooks"),
        "the outputs read no file, and OTLP's SDK loads only when --otlp asks for it"),
    "collector.report": Rule(
        ("matplotlib", "textual", "torch", "agent", "tui", "trainer_hooks"),
        "the report's plotting library loads only when a report is drawn"),
    "collector.live.engine": Rule(
        ("textual", "torch", "grpc", "agent", "tui", "trainer_hooks"),
        "the live engine is what the collector's server loads with rules: no wire of its own"),
    "collector.live.rules_cli": Rule(
        ("duckdb", "textual", "torch", "grpc", "agent", "tui", "trainer_hooks"),
        "`tracetop rules` checks a file without a database"),
    "collector.query.snapshot": Rule(
        ("collector", "agent", "tui", "trainer_hooks", "textual", "duckdb", "grpc"),
        "the read model is shared by the collector's Watch and the TUI: no DuckDB until a build runs",
        allow=("collector.query",)),
    "tui.app": Rule(
        ("collector", "agent", "trainer_hooks", "reference_trainer", "torch"),
        "the TUI reads only through the wire and read-only SQL (DESIGN §2, §10): the read model, "
        "no collector internals", allow=("collector.query",)),
    "tui.cli": Rule(
        ("collector", "agent", "trainer_hooks", "reference_trainer", "torch", "textual", "duckdb"),
        "`tracetop ui --help` starts fast"),
    "reference_trainer.plan": Rule(
        (*HEAVY, "collector", "agent", "tui", "trainer_hooks"),
        "the planner is arithmetic: no torch, no database, no plotting"),
    "reference_trainer.plan_cli": Rule(
        (*HEAVY, "collector", "agent", "tui", "trainer_hooks"),
        "`tracetop plan` is the planner's thin edge"),
    # tracetop bench gpu: the driver starts the agent's and the collector's parts as processes
    "reference_trainer.bench.gpu": Rule(
        ("duckdb", "textual", "torch", "collector", "agent", "tui"),
        "the GPU bench's driver starts each part as a process; it imports none of them"),
    "reference_trainer.bench.gpu_child": Rule(
        ("duckdb", "textual", "collector", "agent", "tui"),
        "the GPU bench's trainer child is a user trainer"),
    "agent.bench.gpu": Rule(
        ("duckdb", "textual", "torch", "collector", "tui", "trainer_hooks", "reference_trainer"),
        "the GPU bench's agent part is the agent"),
}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_import_pulls_in_nothing_forbidden(module: str) -> None:
    rule = LAYERS[module]
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    allowed = tuple(rule.allow) + tuple(a.split(".")[0] for a in rule.allow)  # a package's __init__
    bad = [m for m in out.stdout.split()
           if _under(m, rule.forbidden) and not (_under(m, rule.allow) or m in allowed)]
    assert not bad, f"importing {module} pulled in {', '.join(bad[:8])}: {rule.reason}"


def test_a_traced_step_pulls_in_nothing_forbidden() -> None:
    """The hooks' hot path, run: a step with a phase and a close, over the in-memory transport."""
    forbidden = ("duckdb", "textual", "collector", "agent", "tui")
    code = (
        "import sys\n"
        "from tracetop.wire.shipper import MemoryTransport\n"
        "import trainer_hooks\n"
        "t = trainer_hooks.Tracer(rank=0, world_size=1, run_id='l', transport=MemoryTransport())\n"
        "with t.step(0):\n"
        "    with t.phase('forward'): pass\n"
        "t.close()\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    bad = [m for m in out.stdout.split() if _under(m, forbidden)]
    assert not bad, f"a traced step pulled in {', '.join(bad[:8])}"
