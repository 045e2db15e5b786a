"""`tracetop bench chaos --scenario launcher-teardown`: a real torchrun job, one rank SIGKILLed
mid-step; torchrun then ends the others (SIGTERM), as it ends every job in which a rank fails.

The reference trainer (4 ranks, PP2 x DP2 by default) under ``torch.distributed.run``, its hooks
shipping to a real collector (directly, on a unix socket, or through a node agent with ``--via
agent``). Rank ``kill_rank`` sends itself SIGKILL in its first forward of ``kill_step``
(``--inject-kill``); torchrun sees it die and SIGTERMs the others.

What is promised, and checked, per rank (ground truth: the trainer's own per-rank step log, the
steps each rank completed):

- **the survivors** flush at torchrun's SIGTERM (trainer_hooks/shutdown.py: chained to the default
  action, within TRACETOP_EXIT_FLUSH_S), or at their exit when gloo fails them first: every step
  they completed is stored, or counted in a gap row of theirs;
- **the killed rank** handed each finished step over at its end (a unix-socket endpoint, at most
  every TRACETOP_HANDOVER_S), so it loses at most about a step, or that long of steps when steps are
  shorter (``killed_loss_steps``, ``killed_loss_within_a_step``: informative); what it lost is
  **counted**: a surviving rank of the node reads its progress record at its own exit flush
  (trainer_hooks/progress.py) and ships a GAP row (kind ``step``, ``dropped`` = steps completed −
  STEP rows acked) for it; its source also gets the collector's ``unclosed:last_seq=N`` gap row
  (collector/ingest/source_ends.py), and an alert names it.

Printed per rank: steps run, stored, missing (run, not stored), gap rows and the rows they count.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: the killed rank loses at most this many completed steps (the one whose handover was on its way,
#: and one more for a handover interval longer than a step)
LOSS_BOUND_STEPS = 2


def launcher_teardown(workdir: Path, *, nproc: int = 4, pp: int = 2, steps: int = 80, kill_rank: int = 3,
                      kill_step: int = 40, via: str = "direct", silent_s: float = 3.0, unclosed_after_s: float = 3.0,
                      timeout_s: float = 600.0, env: dict[str, str] | None = None) -> dict:
    """Run the scenario and count (see the module doc). ``env``: more variables for the ranks (e.g.
    ``TRACETOP_HANDOVER_S=0``, to see the survivors' exit flush alone)."""
    from collector.bench.loadgen import CollectorProcess
    from collector.bench.rank_kill import read_jsonl, sql
    from collector.live.rules import DEFAULTS_TOML
    from tracetop import procs

    if not (0 <= kill_rank < nproc and 0 < kill_step < steps):
        raise ValueError(f"launcher-teardown: kill rank {kill_rank} at step {kill_step} needs 0 <= rank < {nproc} "
                         f"and 0 < step < {steps}")
    if via not in ("direct", "agent"):
        raise ValueError(f"launcher-teardown: via must be direct or agent, not {via!r}")
    workdir.mkdir(parents=True, exist_ok=True)
    rules = workdir / "rules.toml"
    rules.write_text(DEFAULTS_TOML.replace("silent_s_above = 15", f"silent_s_above = {silent_s:g}"))
    db = workdir / "launcher-teardown.duckdb"
    listen = f"unix://{workdir / 'collector.sock'}"
    collector = CollectorProcess(db, listen, extra_args=("--rules", str(rules), "--unclosed-after-s",
                                                        f"{unclosed_after_s:g}"))
    collector.start()
    agent = None
    run_id = "launcher-teardown"
    rank_dir = workdir / "ranks"
    unclosed: list[dict] = []
    alerts: list[dict] = []
    rc = None
    output = ""
    elapsed = 0.0
    try:
        endpoint = listen
        if via == "agent":
            agent = procs.agent(listen, f"unix://{workdir / 'agent.sock'}", spool_dir=workdir / "spool",
                                extra_args=["--fake-gpus", "1", "--run-id", "teardown-agent", "--clock-interval-s", "0"],
                                log_path=workdir / "agent.log")
            agent.start()
            endpoint = agent.address
        job_env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   TRACETOP_ENDPOINT=endpoint, TRACETOP_RUN_ID=run_id, **(env or {}))
        job_env.pop("TRACETOP_DISABLE", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "reference_trainer", "--pp", str(pp), "--steps", str(steps), "--quiet", "--dist-timeout-s", "60",
               "--rank-log-dir", str(rank_dir), "--inject-kill", f"{kill_rank}@{kill_step}"]
        t0 = time.monotonic()
        job = subprocess.Popen(cmd, cwd=ROOT, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
        try:
            output, _ = job.communicate(timeout=timeout_s)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
            try:
                os.killpg(job.pid, signal.SIGKILL)  # anything of the job's session still alive
            except ProcessLookupError:
                pass
        rc = job.returncode
        elapsed = time.monotonic() - t0
        if agent is not None:
            agent.stop(timeout_s=120)
            agent = None
        deadline = time.monotonic() + max(silent_s, unclosed_after_s) + 60
        while time.monotonic() < deadline:
            unclosed = sql(listen, f"SELECT rank, reason, dropped FROM gap WHERE run_id = '{run_id}' AND reason "
                                    "LIKE 'unclosed:%' ORDER BY rank")
            alerts = sql(listen, f"SELECT rank, signal FROM alerts WHERE run_id = '{run_id}' ORDER BY first_ns")
            if kill_rank in {u["rank"] for u in unclosed} and kill_rank in {a["rank"] for a in alerts}:
                break
            time.sleep(0.5)
    finally:
        if agent is not None:
            agent.stop(timeout_s=120)
        time.sleep(1.0)
        collector_rc = collector.stop()
    return _count(db, run_id, rank_dir, nproc, kill_rank, kill_step, unclosed, alerts, rc=rc, output=output,
                  via=via, elapsed=elapsed, collector_rc=collector_rc, read_jsonl=read_jsonl)


def _count(db: Path, run_id: str, rank_dir: Path, nproc: int, kill_rank: int, kill_step: int, unclosed: list[dict],
           alerts: list[dict], *, rc: int | None, output: str, via: str, elapsed: float, collector_rc: int,
           read_jsonl) -> dict:
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        stored = {r: {s for (s,) in con.execute("SELECT step FROM step WHERE run_id = ? AND rank = ?",
                                                [run_id, r]).fetchall()} for r in range(nproc)}
        dup = {r: con.execute("SELECT count(*) - count(DISTINCT step) FROM step WHERE run_id = ? AND rank = ?",
                              [run_id, r]).fetchone()[0] for r in range(nproc)}
        gaps = {r: con.execute("SELECT count(*), coalesce(sum(dropped), 0), coalesce(sum(dropped) FILTER "
                               "(WHERE kind = 'step'), 0) FROM gap WHERE run_id = ? AND rank = ?",
                               [run_id, r]).fetchone() for r in range(nproc)}
    finally:
        con.close()
    ranks = {}
    for r in range(nproc):
        ran = sorted({row["step"] for row in read_jsonl(rank_dir / f"rank{r}.jsonl")})
        missing = sorted(set(ran) - stored[r])
        n_gaps, dropped, dropped_steps = gaps[r]
        ranks[r] = {"killed": r == kill_rank, "steps_run": len(ran), "last_run": ran[-1] if ran else -1,
                    "stored": len(stored[r] & set(ran)), "stored_beyond_run": len(stored[r] - set(ran)),
                    "missing": len(missing), "missing_steps": missing[:10], "duplicates": int(dup[r]),
                    "gap_rows": int(n_gaps), "gap_dropped": int(dropped), "gap_dropped_steps": int(dropped_steps),
                    "unclosed": any(u["rank"] == r for u in unclosed)}
    killed = ranks[kill_rank]
    survivors = [r for r in range(nproc) if r != kill_rank]
    held = {
        "killed_ran_up_to_its_death": killed["steps_run"] == kill_step,
        "survivors_stored_or_counted": all(ranks[r]["missing"] <= ranks[r]["gap_dropped_steps"] for r in survivors),
        "killed_loss_counted": killed["missing"] <= killed["gap_dropped_steps"],
        "killed_loss_marked": killed["missing"] == 0 or killed["unclosed"],
        "killed_named_in_an_alert": any(a["rank"] == kill_rank for a in alerts),
        "no_duplicates": all(v["duplicates"] == 0 for v in ranks.values()),
    }
    return {
        "scenario": "launcher-teardown", "via": via, "ranks": nproc, "kill_rank": kill_rank, "kill_step": kill_step,
        "killed_loss_steps": killed["missing"], "killed_loss_within_a_step": killed["missing"] <= LOSS_BOUND_STEPS,
        "per_rank": ranks, "held": held, "ok": all(held.values()),
        "alerts": sorted({(a["rank"] if a["rank"] is not None else -1, a["signal"]) for a in alerts}), "torchrun_rc": rc, "elapsed_s": round(elapsed, 2),
        "collector_exit_code": collector_rc, "db": str(db),
        "torchrun_tail": output[-1500:] if not all(held.values()) else "",
    }


def table(r: dict) -> str:
    """The per-rank lines the bench prints."""
    lines = [f"launcher-teardown ({r['via']}): {r['ranks']} ranks under torchrun, rank {r['kill_rank']} SIGKILLed in "
             f"step {r['kill_step']}, torchrun SIGTERMs the rest",
             f"{'rank':>4} {'':>8} {'run':>5} {'stored':>6} {'missing':>7} {'gaps':>5} {'dropped':>7}  unclosed"]
    for k, v in r["per_rank"].items():
        lines.append(f"{k:>4} {'killed' if v['killed'] else 'survivor':>8} {v['steps_run']:>5} {v['stored']:>6} "
                     f"{v['missing']:>7} {v['gap_rows']:>5} {v['gap_dropped']:>7}  {'yes' if v['unclosed'] else 'no'}")
    lines.append("held: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in r["held"].items()))
    lines.append("ok" if r["ok"] else "SHORT")
    return "\n".join(lines)
