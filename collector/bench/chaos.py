"""`tracetop bench chaos [--scenario S]`: break the path while sources ship; count what survived.

Sources ship identifiable rows (rank = source, step = row number) into a real collector process;
meanwhile the collector is killed with SIGKILL several times and restarted on the same file. At
the end every source has flushed (all its batches acked), the collector stops cleanly, and the
file is counted: ``lost`` = sent − distinct rows stored, ``duplicates`` = rows stored − distinct,
``gaps_recorded`` = rows the gap table says were dropped; ``lost_unrecorded`` (lost − gaps) must be 0.
Other scenarios (SCENARIOS) freeze the collector, partition the network through a loopback proxy,
kill the node agent, or fill the agent's spool.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import threading
import time
from pathlib import Path

SCENARIOS = {
    "kill": "kill -9 the collector --kills times, restart it on the same file",
    "freeze": "SIGSTOP the collector for --fault-s, then SIGCONT",
    "partition": "a loopback proxy between sources and collector stalls, then resets, for --fault-s each",
    "agent-kill": "sources ship through a node agent (disk spool); kill -9 the agent --kills times",
    "full-spool": "through an agent whose spool is tiny, with the collector down for --fault-s",
    "rank-kill": "a real 2-rank training run (gloo); one rank SIGKILLs itself mid-step; hooks ship directly and "
                 "through an agent (--via); see collector/bench/rank_kill.py",
    "launcher-teardown": "a real 4-rank torchrun job (reference trainer, PP2 x DP2); rank 3 SIGKILLs itself in "
                         "--kill-step, torchrun SIGTERMs the rest; per rank: steps run, stored, counted in gaps "
                         "(--via direct or agent); see collector/bench/launcher_teardown.py",
    "none": "no fault: the baseline for the sources' per-step telemetry cost",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="kill",
                        help="; ".join(f"{k}: {v}" for k, v in SCENARIOS.items()))
    parser.add_argument("--sources", type=int, default=8, help="shipper processes (default 8)")
    parser.add_argument("--events", type=int, default=1_000_000, help="events in all, split over the sources")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs of the collector or agent (default 3)")
    parser.add_argument("--kill-every-s", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--fault-s", type=float, default=60.0, help="how long a freeze / partition / outage lasts (default 60)")
    parser.add_argument("--rate-eps", type=float, default=0.0,
                        help="per-source pacing in events/s so the run outlasts the faults (default: chosen)")
    parser.add_argument("--dir", type=Path, default=None, help="keep the DuckDB file here (default: a temp dir)")
    parser.add_argument("--listen", default=None, help="collector address (default: a unix socket in the dir)")
    parser.add_argument("--via", choices=("direct", "agent", "mixed", "both"), default="both",
                        help="rank-kill: the hooks ship to the collector, through an agent, odd ranks through the "
                             "agent (mixed), or one direct and one agent run (both, the default)")
    parser.add_argument("--steps", type=int, default=None,
                        help="rank-kill / launcher-teardown: training steps (default 40 / 80)")
    parser.add_argument("--kill-step", type=int, default=None,
                        help="rank-kill / launcher-teardown: the step rank 1 / rank 3 is killed in (default 25 / 40)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(workdir: Path, collector: str, spool_max_mb: float):
    """`tracetop agent` relaying the sources' batches through its disk spool (chaos runs only)."""
    from tracetop import procs

    return procs.agent(collector, f"unix://{workdir / 'agent.sock'}", spool_dir=workdir / "spool",
                       extra_args=["--spool-max-mb", str(spool_max_mb), "--fake-gpus", "1", "--run-id", "chaos-agent",
                                   "--clock-interval-s", "0"], log_path=workdir / "agent.log")


def _refused_batches(log_path: Path) -> int:
    """Batches the agent's relay refused for a full spool (it logs each once; a refusal is not a
    loss, so it is in no GAP row: the source keeps the batch, and records its own drops)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return 0
    return text.count("agent relay: spool full, refused batch")


def chaos(sources: int, events: int, kills: int, kill_every_s: float, workdir: Path, listen: str | None = None,
          rate_eps: float = 0.0, scenario: str = "kill", fault_s: float = 60.0) -> dict:
    """Run one scenario; count sent / stored / duplicates / lost / gaps exactly, and what the faults
    cost the sources' hand-overs (`record_ms_max`: a source that never waits for acks, as a training
    loop does not, must stay as fast during the fault as without it)."""
    from collector.bench.loadgen import CollectorProcess, collect_sources, count_stored, start_sources

    if scenario not in SCENARIOS:
        raise ValueError(f"unknown chaos scenario {scenario!r}; choose one of {', '.join(sorted(SCENARIOS))}")
    if scenario == "rank-kill":
        raise ValueError("rank-kill runs a real training: collector.bench.rank_kill.rank_kill")
    if scenario == "launcher-teardown":
        raise ValueError("launcher-teardown runs a real torchrun job: collector.bench.launcher_teardown.launcher_teardown")
    db = workdir / "chaos.duckdb"
    if scenario == "partition":
        listen = f"127.0.0.1:{_free_port()}"
    listen = listen or f"unix://{workdir / 'collector.sock'}"
    per_source = events // sources
    fault_total_s = kills * kill_every_s if scenario in ("kill", "agent-kill") else 2 * fault_s if scenario == "partition" else fault_s
    if rate_eps <= 0:
        # spread the sending over the fault schedule and a bit more, so faults land mid-stream
        rate_eps = per_source / max(1.0, fault_total_s * 1.5 if scenario != "none" else 3.0)
    collector = CollectorProcess(db, listen)
    collector.start()
    run_id = "chaos"
    proxy = agent = None
    endpoint = listen
    if scenario == "partition":
        from collector.bench.chaos_proxy import ChaosProxy

        host, _, port = listen.rpartition(":")
        proxy = ChaosProxy((host, int(port))).start()
        endpoint = proxy.address
    if scenario in ("agent-kill", "full-spool"):
        # full-spool: a spool of 1 MiB holds a few batches; the rest waits in the sources' memory
        agent = _agent(workdir, listen, spool_max_mb=1.0 if scenario == "full-spool" else 1024.0)
        agent.start()
        endpoint = agent.address
    trainer_like = scenario != "kill"  # the kill scenario keeps its historical ack-paced sources
    t0 = time.monotonic()
    # full-spool: the sources' own buffers are small too, so they must drop (oldest first) and say so
    procs = start_sources(endpoint, run_id, sources, per_source, rate_eps, trainer_like=trainer_like,
                          chunk_rows=2048 if trainer_like else 16384,
                          buffer_bytes=1 << 20 if scenario == "full-spool" else None)
    faults = 0
    restarts_s: list[float] = []

    def done() -> bool:
        return all(p.poll() is not None for p in procs)

    def injector() -> None:
        nonlocal faults
        time.sleep(min(kill_every_s, 2.0))
        if scenario in ("kill", "agent-kill"):
            target = collector if scenario == "kill" else agent
            for i in range(kills):
                if i:
                    time.sleep(kill_every_s)
                if done():
                    break
                target.kill()  # type: ignore[union-attr]
                faults += 1
                r0 = time.monotonic()
                target.start()  # type: ignore[union-attr]
                restarts_s.append(time.monotonic() - r0)
        elif scenario == "freeze":
            collector.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
            faults += 1
            time.sleep(fault_s)
            collector.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        elif scenario == "partition":
            proxy.stall()  # type: ignore[union-attr]
            faults += 1
            time.sleep(fault_s)
            proxy.drop()  # type: ignore[union-attr]
            faults += 1
            time.sleep(fault_s)
            proxy.heal()  # type: ignore[union-attr]
        elif scenario == "full-spool":
            collector.kill()
            faults += 1
            time.sleep(fault_s)
            r0 = time.monotonic()
            collector.start()
            restarts_s.append(time.monotonic() - r0)

    k = threading.Thread(target=injector, daemon=True)
    k.start()
    results = collect_sources(procs)
    k.join()
    elapsed = time.monotonic() - t0
    agent_rc = agent.stop(timeout_s=120) if agent is not None else None
    if proxy is not None:
        proxy.stop()
    rc = collector.stop()
    counts = count_stored(db, run_id, ("chaos-agent",) if agent is not None else ())
    sent = sum(r["sent"] for r in results)
    stored = sum(s for s, _ in counts["per_source"].values())
    distinct = sum(d for _, d in counts["per_source"].values())
    lost = sent - distinct
    out = {
        "scenario": scenario,
        "sources": sources,
        "sent": sent,
        "stored": stored,
        "duplicates": stored - distinct,
        "lost": lost,
        "gaps_recorded": counts["gaps_dropped"],
        "lost_unrecorded": lost - counts["gaps_dropped"],
        "spool_refusals": _refused_batches(workdir / "agent.log") if agent is not None else 0,
        "faults": faults,
        "kills": faults if scenario in ("kill", "agent-kill") else 0,
        "restart_s_max": round(max(restarts_s), 2) if restarts_s else None,
        "all_flushed": all(r["flushed"] for r in results),
        "reconnects": sum(r["reconnects"] for r in results),
        "elapsed_s": round(elapsed, 2),
        "collector_exit_code": rc,
        "agent_exit_code": agent_rc,
        "db": str(db),
    }
    out["collector_restart_s_max"] = out["restart_s_max"] if scenario == "kill" else None
    if trainer_like:
        out["record_ms_p50"] = round(max(r["record_ms_p50"] for r in results), 3)
        out["record_ms_p99"] = round(max(r["record_ms_p99"] for r in results), 3)
        out["record_ms_max"] = round(max(r["record_ms_max"] for r in results), 3)
    return out


def rank_kill_held(r: dict) -> bool:
    """What rank-kill promises (collector/bench/rank_kill.py): nothing stored twice; the survivors lose
    nothing; each killed rank's stored rows are a prefix of its steps, its source has one unclosed
    GAP row with the exact last seq, and a silent-rank alert names it; no loss without that mark."""
    killed = r["killed_ranks"]
    return (r["duplicates"] == 0 and r["lost_survivors"] == 0 and r["lost_unmarked"] == 0
            and all(k["by_sigkill"] and k["stored_is_prefix"] for k in r["killed"].values())
            and r["unclosed_last_seq_exact"] and r["unclosed_ranks"] == killed
            and {a["rank"] for a in r["silent_rank_alerts"]} == set(killed))


def _run_rank_kill(args: argparse.Namespace, workdir: Path) -> int:
    import sys

    from collector.bench.rank_kill import rank_kill

    if not 0 < args.kill_step < args.steps:
        print(f"tracetop bench chaos: --kill-step {args.kill_step} must lie in 1..{args.steps - 1} (--steps "
              f"{args.steps}): rank 1 is killed in that step, after at least one whole step", file=sys.stderr)
        return 2
    vias = ("direct", "agent") if args.via == "both" else (args.via,)
    results = [rank_kill(workdir / via, via=via, steps=args.steps, kill_step=args.kill_step) for via in vias]
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0]))
    else:
        for r in results:
            for key, value in r.items():
                print(f"{key:>28}: {value}")
            print()
    return 0 if all(rank_kill_held(r) for r in results) else 1


def _run_launcher_teardown(args: argparse.Namespace, workdir: Path) -> int:
    from collector.bench.launcher_teardown import launcher_teardown, table

    via = "direct" if args.via in ("both", "mixed") else args.via
    r = launcher_teardown(workdir, steps=args.steps or 80, kill_step=args.kill_step or 40, via=via)
    print(json.dumps(r) if args.json else table(r))
    return 0 if r["ok"] else 1


def run(args: argparse.Namespace) -> int:
    if args.scenario == "launcher-teardown":
        if args.dir is not None:
            args.dir.mkdir(parents=True, exist_ok=True)
            return _run_launcher_teardown(args, args.dir)
        with tempfile.TemporaryDirectory(prefix="tracetop-chaos-") as d:
            return _run_launcher_teardown(args, Path(d))
    if args.scenario == "rank-kill":
        args.steps = args.steps or 40
        args.kill_step = args.kill_step or 25
        if args.dir is not None:
            args.dir.mkdir(parents=True, exist_ok=True)
            return _run_rank_kill(args, args.dir)
        with tempfile.TemporaryDirectory(prefix="tracetop-chaos-") as d:
            return _run_rank_kill(args, Path(d))
    kw = dict(scenario=args.scenario, fault_s=args.fault_s)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        result = chaos(args.sources, args.events, args.kills, args.kill_every_s, args.dir, args.listen, args.rate_eps, **kw)
    else:
        with tempfile.TemporaryDirectory(prefix="tracetop-chaos-") as d:
            result = chaos(args.sources, args.events, args.kills, args.kill_every_s, Path(d), args.listen,
                           args.rate_eps, **kw)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0 if result["lost_unrecorded"] == 0 and result["duplicates"] == 0 else 1
