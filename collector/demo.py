"""`tracetop demo [--headless] [--steps 60]`: the whole loop on one machine, every part real.

A collector (live judgments on, the controller in auto), a node agent with fake GPUs (the
hardware edge; agent/fake_nvml.py), and a 4-rank reference run (PP2 x DP2 on gloo) whose
activations need more memory than its declared budget and one of whose ranks turns into a
straggler halfway. What happens, in order:
- the live engine flags the memory above 0.90 of the budget, the controller shrinks the
  micro-batch (the global batch kept) and every rank applies it at one and the same step;
- later rank --straggler-rank computes --straggler-factor times as long each step (proportional, so
  it is a straggler at any load): a straggler alert names it;
- the CPU pipeline's bubble and exposed communication are what they are, and their rules say so.
With a terminal the TUI watches the run live; without one (or with --headless) the demo prints the
per-rank summary, the alerts and the actions. The file stays at DIR/demo.duckdb for
`tracetop ui`, `tracetop report` and `tracetop query`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

#: the controller's settings for a short demo: it looks every half second and verifies over few steps
DEMO_CONTROLLER = """[controller]
mode = "auto"
tick_s = 0.5
cooldown_s = 1
cooldown_steps = 5
verify_steps = 6
max_throughput_drop = 0.6   # CPU: a smaller micro-batch is slower per sample; the demo keeps it anyway
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=Path("demo-out"), help="where the DuckDB file goes (default demo-out/)")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--headless", action="store_true", help="no TUI: print the summary, alerts and actions")
    parser.add_argument("--straggler-rank", type=int, default=3, help="the rank that turns slow (default 3)")
    parser.add_argument("--straggler-factor", type=float, default=2.0,
                        help="how much slower: its forward and backward take this many times as long (default 2)")
    parser.add_argument("--straggler-from", type=int, default=None,
                        help="from which step (default: half the steps, after the controller has acted)")


def _print_incidents(alerts: list[tuple]) -> None:
    """The alerts as incidents: each cause (a fault) with the alerts it explains under it, then the
    SLA breaches nothing explains."""
    causes = [a for a in alerts if a[6] and a[6] == a[7]]
    print(f"alerts ({len(alerts)}), as incidents ({len(causes)}):")
    for sev, rule, state, step, msg, _, iid, _, _ in causes:
        print(f"  [{state} {sev}] {rule} (fired at step {step}): {msg}")
        for c in alerts:
            if c[6] == iid and c[7] != iid:
                on = f" on rank {c[8]}" if c[8] is not None else ""
                print(f"      └ consequence [{c[2]}] {c[1]}{on} (fired at step {c[3]})")
    alone = [a for a in alerts if not a[6]]
    print(f"SLA breaches nothing explains ({len(alone)}):")
    for sev, rule, state, step, msg, *_ in alone:
        print(f"  [{state} {sev}] {rule} (fired at step {step}): {msg}")


def run(args: argparse.Namespace) -> int:
    import duckdb

    from collector.query.summary import render, summarize
    from collector.query.verdict import render as render_verdict
    from collector.query.verdict import verdict_of
    from tracetop import procs

    if args.steps < 20:
        print("tracetop demo: --steps must be at least 20 (the controller needs steps to act and verify)", file=sys.stderr)
        return 2
    headless = args.headless or not (sys.stdout.isatty() and sys.stdin.isatty())
    workdir: Path = args.dir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # the sockets live in a folder only this user can write, whatever the umask: the hooks trust a unix
    # endpoint only there (a loose folder would send the ranks to the collector, past the agent)
    socks = workdir / "sockets"
    socks.mkdir(mode=0o700, exist_ok=True)
    socks.chmod(0o700)
    db = workdir / "demo.duckdb"
    for stale in (db, db.with_suffix(".duckdb.wal")):
        stale.unlink(missing_ok=True)
    (workdir / "controller.toml").write_text(DEMO_CONTROLLER)
    listen = f"unix://{socks / 'collector.sock'}"
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    strag_from = args.straggler_from if args.straggler_from is not None else args.steps // 2

    print(f"tracetop demo: collector on {listen} (rules on, controller auto), file {db}", flush=True)
    collector = procs.collector(db, listen, extra_args=["--controller", "auto", "--controller-config",
                                                        str(workdir / "controller.toml")],
                                log_path=workdir / "collector.log")
    collector.start()
    agent = procs.agent(listen, f"unix://{socks / 'agent.sock'}", spool_dir=workdir / "spool",
                        extra_args=["--fake-gpus", "4", "--run-id", f"{run_id}-agent", "--clock-interval-s", "5"],
                        log_path=workdir / "agent.log")
    agent.start()
    env = dict(os.environ, TRACETOP_ENDPOINT=listen, TRACETOP_RUN_ID=run_id, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TRACETOP_FLUSH_S="0.5", TRACETOP_COMMAND_EVERY_STEPS="5")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
        "-m", "reference_trainer", "--tp", "1", "--pp", "2", "--steps", str(args.steps),
        "--micro-batch", "4", "--micro-batches", "2", "--activation-mb-per-sample", "40", "--memory-budget-mb", "750",
        "--inject-slow-rank", f"{args.straggler_rank}:{args.straggler_factor:g}@{strag_from}", "--quiet",
    ]
    print("tracetop demo: " + " ".join(cmd[2:]), flush=True)
    rc = 1
    try:
        with open(workdir / "train.log", "w") as log:
            train = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            if not headless:
                # the TUI in the foreground while the run goes on; q leaves it, the run finishes
                subprocess.call([sys.executable, "-m", "tracetop.cli", "ui", "--collector", listen, "--run", run_id])
            rc = train.wait()
    finally:
        if "train" in locals() and train.poll() is None:
            train.kill()
        time.sleep(1.5)  # the last shipments and the controller's verification land
        agent.stop(timeout_s=60)
        collector.stop(timeout_s=120)
    if rc != 0:
        print(f"tracetop demo: the training run failed (exit {rc}); see {workdir / 'train.log'} and "
              f"{workdir / 'collector.log'}", file=sys.stderr)
        return rc
    con = duckdb.connect(str(db), read_only=True)
    try:
        summary = summarize(con, run_id)
        verdict_text = render_verdict(verdict_of(con, run_id))
        alerts = con.execute("SELECT severity, rule, state, fired_step, message, kind, incident_id, id, rank FROM alerts "
                             "WHERE run_id = ? ORDER BY fired_step, rule", [run_id]).fetchall()
        actions = con.execute("SELECT action_id, kind, value, state, step, reason, outcome FROM actions WHERE run_id = ? "
                              "ORDER BY proposed_ns", [run_id]).fetchall()
        shape = con.execute("SELECT step, min(micro_batch), max(micro_batch), min(micro_batches), max(micro_batches), "
                            "count(*) FROM step WHERE run_id = ? GROUP BY step ORDER BY step", [run_id]).fetchall()
    finally:
        con.close()
    print()
    print(render(summary))
    print()
    _print_incidents(alerts)
    print(f"actions ({len(actions)}):")
    for aid, kind, value, state, step, reason, outcome in actions:
        at = f" at step {step}" if step is not None and step >= 0 else ""
        print(f"  #{aid} {kind}={value}: {state}{at} — {reason}" + (f"; {outcome}" if outcome else ""))
    for (_, mb0, _, mbs0, _, _), (step, mb, mb_max, mbs, mbs_max, _) in zip(shape, shape[1:]):
        if (mb, mbs) != (mb0, mbs0):
            agree = "every rank runs" if (mb, mbs) == (mb_max, mbs_max) else "ranks DISAGREE:"
            print(f"  {agree} micro-batch {mb} x {mbs} from step {step}")
    print()
    print(f"injected: activations of 40 MiB a sample against a 750 MiB budget; rank {args.straggler_rank} computes "
          f"{args.straggler_factor:g}x as long from step {strag_from}")
    print(f"explore: tracetop ui {db}   |   tracetop report {db} -o {workdir / 'report.html'}   |   "
          f'tracetop query {db} "SELECT * FROM stragglers WHERE is_straggler"')
    print()
    print(verdict_text)  # the last thing on the screen: what bounds the run and what to try next
    return 0
