"""The `tracetop` command: picks the subcommand, imports only the module that does that work.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and keeps its
heavy imports (torch, duckdb, textual, grpc) inside ``run``, so ``tracetop query`` never loads
torch and ``tracetop --help`` loads nothing.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: name -> (module, one-line help). Module paths are imported only when that command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "ui": ("tui.cli", "the terminal UI: live through a collector, or a finished run's FILE.duckdb"),
    "collector": ("collector.cli", "run a collector: gRPC ingest into one DuckDB file"),
    "query": ("collector.query.cli", "read-only SQL on a collector's file, or through a running collector"),
    "agent": ("agent.cli", "run the node agent: NVML/host sampling, local relay with disk spool"),
    "train": ("reference_trainer.cli", "run the reference 3D-parallel trainer through torchrun"),
    "rules": ("collector.live.rules_cli", "check a rules file, or print the built-in rules (live judgments)"),
    "alerts": ("collector.live.alerts_cli", "the alerts a collector raised (or --recompute them from a file)"),
    "demo": ("collector.demo", "collector + a 4-rank reference run, then a per-rank summary"),
    "summary": ("collector.query.verdict", "a run's verdict (what bounds it, why, what to try next) and per-rank summary"),
    "compare": ("collector.query.compare", "two runs side by side (FILE or FILE:RUN); --fail-if step_time_pct>5 gates CI"),
    "report": ("collector.report", "one self-contained HTML report with plots of a run in a collector's file"),
    "export": ("collector.export.timeline", "the file as a Perfetto/chrome://tracing timeline (--perfetto) or Parquet (--parquet)"),
    "plan": ("reference_trainer.plan_cli", "parallelism planner: ranked TP x PP x DP plans, memory per GPU, launch commands"),
    "control": ("collector.control.control_cli", "send a command to a running job: set-micro-batch, offload, approve, reject, rollback"),
    "token": ("tracetop.wire.token_cli", "the ranks' ingest-only token, derived from the operator's --token-file"),
    "profile": ("collector.control.profile_cli", "torch's profiler on named ranks of a running job for N steps; the trace in the file"),
    "actions": ("collector.control.actions_cli", "every action of the closed loop and its life (from a file or a collector)"),
}

#: `tracetop bench <what>` -> module. Each prints one JSON object with --json.
BENCHES: dict[str, tuple[str, str]] = {
    "ingest": ("collector.bench.ingest", "N shipper processes into a real collector: events/s, p50/p99"),
    "chaos": ("collector.bench.chaos", "kill -9 the collector repeatedly while shipping: lost/duplicates"),
    "hooks": ("reference_trainer.bench.hooks", "interleaved reference runs with hooks on/off: overhead"),
    "agent": ("agent.bench.cost", "agent CPU cost: sampling 8 fake GPUs, relaying 10k events/s"),
    "gpu": ("reference_trainer.bench.gpu", "the GPU path in one call: syncs, overhead, CUDA timing, NVML, offload"),
    "views": ("collector.bench.views", "every view over a generated file of --rows rows: seconds each"),
    "live": ("collector.bench.live", "live judgments: eval ms per step at 16,384 ranks, state MB, ingest on/off"),
    "raw": ("collector.bench.raw", "the collector alone: pre-encoded batches from raw gRPC stubs, events/s and p50/p99"),
    "tui": ("tui.bench.render", "the TUI's CPU share at 2 Hz and the Ranks screen's refresh time at 16,384 ranks"),
    "e2e": ("tui.bench.e2e", "a rank's step end -> visible in a Watch snapshot: p50/p99"),
    "judge": ("collector.bench.judge", "the fault matrix: clean and fault runs judged live: recall, precision, culprit"),
    "compact": ("collector.bench.compact", "a short run's file with compaction at close off and on: MB and close seconds"),
    "profile": ("trainer_hooks.bench.profile_boundary", "the command boundary a plain loop now runs by default (profiling windows): us per step, A/B"),
    "commands": ("trainer_hooks.bench.commands", "the command path's gloo broadcast on its own: us per K steps"),
    "close": ("trainer_hooks.bench.close_path", "a torchrun rank's end, phase by phase: close, barrier, teardown, exit"),
    "close-gone": ("trainer_hooks.bench.close_gone", "a tracer's close when its endpoint refuses: early close, a pending report; A/B"),
}


def _usage(table: dict[str, tuple[str, str]], prefix: str) -> str:
    width = max(len(k) for k in table)
    lines = [f"usage: {prefix} <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in table.items()]
    if table is COMMANDS:
        lines += [f"  {'bench':<{width}}  benchmarks: {', '.join(BENCHES)} (`{prefix} bench --help`)"]
    lines += ["", f"`{prefix} <command> --help` for a command's options."]
    return "\n".join(lines)


def _dispatch(table: dict[str, tuple[str, str]], prefix: str, argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(table, prefix))
        return 0
    name, rest = argv[0], argv[1:]
    if name == "--version":
        from tracetop import __version__

        print(f"tracetop {__version__}")
        return 0
    if name not in table:
        import difflib

        close = difflib.get_close_matches(name, table, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"{prefix}: unknown command '{name}'{hint}\n\n{_usage(table, prefix)}", file=sys.stderr)
        return 2
    module = importlib.import_module(table[name][0])
    parser = argparse.ArgumentParser(prog=f"{prefix} {name}", description=table[name][1])
    module.add_arguments(parser)
    # a module may ask for options anywhere among its positionals (`tracetop query FILE --json "SQL"`)
    parse = parser.parse_intermixed_args if getattr(module, "PARSE_INTERMIXED", False) else parser.parse_args
    args = parse(rest)
    return int(module.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _dispatch(BENCHES, "tracetop bench", argv[1:])
    if not argv:  # `tracetop` alone is the live TUI (DESIGN §11)
        argv = ["ui"]
    return _dispatch(COMMANDS, "tracetop", argv)


if __name__ == "__main__":
    sys.exit(main())
