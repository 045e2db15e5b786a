"""`tracetop bench chaos --scenario rank-kill`: one rank of a real training run is killed -9 mid-step.

A real multi-process run: the reference trainer on torch.distributed (gloo), each rank its own
process (as ranks on different nodes are: no launcher tears the survivors down), its hooks
shipping to a real collector, directly or through a node agent (its disk spool). At step
``kill_step`` rank ``kill_rank`` sends itself SIGKILL in its first forward (``--inject-kill``,
reference_trainer/faults.py). Its peers fail in their next collective with it and end as their
code does (the training loop's ``finally`` closes their hooks cleanly).

What is promised, and checked:
- every row a rank handed on (acked by the collector, or taken onto an agent's spool, which acks
  only once the batch is on disk) is stored exactly once; for the killed rank that is a prefix of
  its steps (its batches go out in order), with no duplicate;
- what the killed rank held only in memory is lost, and counted: a surviving rank of the run on
  the node reads its progress record at its close (trainer_hooks/progress.py) and ships a GAP row
  ``kind = step, reason = died_unacked:steps=A-B`` (``gaps_recorded``); and never silently: the
  collector writes a GAP row ``reason = unclosed:last_seq=N`` for its source (collector/ingest/source_ends.py:
  silent for ``--unclosed-after-s`` without the clean close, N = the last seq stored), and the live
  engine's silent_rank alert names the rank (its peers closed cleanly, so it is the one singled out);
- the survivors lose nothing (every step they completed is stored once) and get no unclosed row;
- telemetry never holds the survivors: they end within their own failure path (reported as
  ``survivor_exit_after_kill_s``), and their step times before the kill are reported beside a run
  of the same layout without the kill (``baseline``).

Not promised: a rank killed before anything of it was stored (not one heartbeat) is unknown to the
collector, so it gets no unclosed row (its peers' RUN_START rows still give the world size); the
hooks' first heartbeat comes ``TRACETOP_HEARTBEAT_S`` (default 5 s; here 0.5) after they start.
The unclosed row waits ``--unclosed-after-s`` (default 30 s; here 3) of silence, so a rank cut off
longer than that but alive gets one too, followed by a ``resumed:seq=N`` row when it is heard again.

Ground truth is the trainer's own per-rank step log (``--rank-log-dir``): the steps each rank
completed, which are the STEP rows its hooks recorded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line torn by the kill
            pass
    return out


def sql(addr: str, query: str) -> list[dict]:
    from collector.query.readonly import from_ipc
    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc
    from tracetop.wire.auth import ClientAuth

    with ClientAuth().channel(addr) as ch:
        return from_ipc(pb_grpc.QueryStub(ch).Sql(pb.QueryRequest(sql=query), timeout=60).arrow_ipc).to_pylist()


def launch_ranks(workdir: Path, endpoints: list[str], run_id: str, *, steps: int, extra: list[str],
                 timeout_s: float, heartbeat_s: float = 1.0) -> dict:
    """Each rank as its own process (RANK/WORLD_SIZE env, one MASTER_PORT), rank r shipping to
    ``endpoints[r]``; waits for all of them. Returns each rank's exit code and exit time (wall
    clock), its step log and its output."""
    nproc = len(endpoints)
    workdir.mkdir(parents=True, exist_ok=True)
    rank_dir = workdir / "ranks"
    port = _free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRACETOP_ENDPOINT=endpoints[r],
                   TRACETOP_RUN_ID=run_id, TRACETOP_HEARTBEAT_S=f"{heartbeat_s:g}")
        log = open(workdir / f"rank{r}.out", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, "-m", "reference_trainer", "--quiet", "--steps", str(steps),
                                        "--rank-log-dir", str(rank_dir), *extra], cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True), log))
    exit_unix_s: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(exit_unix_s) < nproc:
            for r, (p, _) in enumerate(procs):
                if r not in exit_unix_s and p.poll() is not None:
                    exit_unix_s[r] = time.time()
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks did not end in {timeout_s} s")
            time.sleep(0.02)
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    return {
        "rc": {r: p.returncode for r, (p, _) in enumerate(procs)},
        "exit_unix_s": exit_unix_s,
        "steps": {r: read_jsonl(rank_dir / f"rank{r}.jsonl") for r in range(nproc)},
        "output": {r: (workdir / f"rank{r}.out").read_text(errors="replace") for r in range(nproc)},
    }


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[len(s) // 2] + s[(len(s) - 1) // 2]) / 2 if s else float("nan")


VIAS = ("direct", "agent", "mixed")


def rank_kill(workdir: Path, *, via: str = "agent", nproc: int = 2, steps: int = 40,
              kill_ranks: tuple[int, ...] = (1,), kill_step: int = 25, silent_s: float = 3.0,
              unclosed_after_s: float = 3.0, baseline: bool = True, heartbeat_s: float = 0.5,
              timeout_s: float = 300.0) -> dict:
    """Run the scenario and count. ``via``: "direct" (hooks ship to the collector), "agent" (through
    a node agent), "mixed" (odd ranks through the agent, even ranks directly: one run covers both
    paths when ``kill_ranks`` holds one of each). See the module doc for what each figure means."""
    from collector.bench.loadgen import CollectorProcess
    from collector.live.rules import DEFAULTS_TOML
    from tracetop import procs

    if via not in VIAS:
        raise ValueError(f"rank-kill: via must be one of {', '.join(VIAS)}, not {via!r}")
    kill_ranks = tuple(sorted(set(kill_ranks)))
    if not kill_ranks or not all(0 <= k < nproc for k in kill_ranks) or len(kill_ranks) >= nproc \
            or not 0 < kill_step < steps:
        raise ValueError(f"rank-kill: kill ranks {list(kill_ranks)} at step {kill_step} need 0 <= rank < {nproc}, "
                         f"at least one survivor, and 0 < step < {steps}")
    workdir.mkdir(parents=True, exist_ok=True)
    rules = workdir / "rules.toml"
    # silent_rank names every killed rank (its peers closed); first_failure, which would name only the
    # first of ranks killed together, is off here
    rules.write_text(DEFAULTS_TOML.replace("silent_s_above = 15", f"silent_s_above = {silent_s:g}")
                     .replace('signal = "first_failure"', 'signal = "first_failure"\nenabled = false'))
    db = workdir / "rank-kill.duckdb"
    listen = f"unix://{workdir / 'collector.sock'}"
    collector = CollectorProcess(db, listen, extra_args=("--rules", str(rules), "--unclosed-after-s",
                                                        f"{unclosed_after_s:g}"))
    collector.start()
    agent = None
    if via != "direct":
        agent = procs.agent(listen, f"unix://{workdir / 'agent.sock'}", spool_dir=workdir / "spool",
                            extra_args=["--fake-gpus", "1", "--run-id", "rank-kill-agent", "--clock-interval-s", "0"],
                            log_path=workdir / "agent.log")
        agent.start()
    ways = ["agent" if via == "agent" or (via == "mixed" and r % 2) else "direct" for r in range(nproc)]
    endpoints = [agent.address if w == "agent" else listen for w in ways]  # type: ignore[union-attr]
    run_id = "rank-kill"
    common = ["--dist-timeout-s", "60"]
    kills = [a for k in kill_ranks for a in ("--inject-kill", f"{k}@{kill_step}")]
    elapsed = 0.0
    run: dict = {}
    base = None
    unclosed: list[dict] = []
    alerts: list[dict] = []
    try:
        if baseline:
            base = launch_ranks(workdir / "baseline", endpoints, "rank-kill-baseline", steps=kill_step,
                                extra=common, timeout_s=timeout_s, heartbeat_s=heartbeat_s)
        t0 = time.monotonic()
        run = launch_ranks(workdir / "run", endpoints, run_id, steps=steps, extra=[*common, *kills],
                           timeout_s=timeout_s, heartbeat_s=heartbeat_s)
        elapsed = time.monotonic() - t0
        # the collector's own judgments: the unclosed rows (after unclosed_after_s) and the silent-rank alerts
        deadline = time.monotonic() + max(silent_s, unclosed_after_s) + 60
        while time.monotonic() < deadline:
            unclosed = sql(listen, f"SELECT rank, step, reason, origin_source, dropped, kind FROM gap WHERE "
                                    f"run_id = '{run_id}' AND reason LIKE 'unclosed:%' ORDER BY rank")
            alerts = sql(listen, f"SELECT rank, state, message FROM alerts WHERE run_id = '{run_id}' AND "
                                  "signal = 'silent_rank' ORDER BY first_ns")
            if {u["rank"] for u in unclosed} >= set(kill_ranks) and {a["rank"] for a in alerts} >= set(kill_ranks):
                break
            time.sleep(0.5)
    finally:
        agent_rc = agent.stop(timeout_s=120) if agent is not None else None
        time.sleep(1.0)  # the agent's last flush may have delivered late rows: let the collector commit them
        rc = collector.stop()
    return _count(db, run_id, run, base, unclosed, alerts, via=via, ways=ways, kill_ranks=kill_ranks,
                  kill_step=kill_step, elapsed=elapsed, collector_rc=rc, agent_rc=agent_rc)


def _count(db: Path, run_id: str, run: dict, base: dict | None, unclosed: list[dict], alerts: list[dict], *,
           via: str, ways: list[str], kill_ranks: tuple[int, ...], kill_step: int, elapsed: float,
           collector_rc: int, agent_rc: int | None) -> dict:
    import duckdb

    nproc = len(ways)
    con = duckdb.connect(str(db), read_only=True)
    try:
        stored = {r: [s for (s,) in con.execute("SELECT step FROM step WHERE run_id = ? AND rank = ? ORDER BY step",
                                                [run_id, r]).fetchall()] for r in range(nproc)}
        dropped = con.execute("SELECT coalesce(sum(dropped), 0) FROM gap WHERE run_id = ? AND kind = 'step'",
                              [run_id]).fetchone()[0]
        last_seq = {u["origin_source"]: con.execute("SELECT max(seq) FROM ingest_log WHERE source_id = ?",
                                                    [u["origin_source"]]).fetchone()[0] for u in unclosed}
    finally:
        con.close()
    done = {r: [row["step"] for row in run["steps"][r]] for r in range(nproc)}  # steps each rank completed
    distinct = {r: sorted(set(v)) for r, v in stored.items()}
    lost = {r: len(set(done[r]) - set(stored[r])) for r in range(nproc)}
    marked = {u["rank"] for u in unclosed}
    kill_t = min(run["exit_unix_s"][k] for k in kill_ranks)
    survivors = [r for r in range(nproc) if r not in kill_ranks]

    def step_ms(res: dict | None, r: int) -> float:
        if res is None:
            return float("nan")
        rows = [row["step_time_s"] * 1e3 for row in res["steps"][r] if 0 < row["step"] < kill_step]
        return round(_median(rows), 2)

    def seen_at(r: int) -> int | None:
        m = re.search(r"injected kill at step (\d+)", run["output"].get(r, ""))
        return int(m.group(1)) if m else None

    out = {
        "scenario": "rank-kill",
        "via": via,
        "ranks": nproc,
        "ships_via": {r: ways[r] for r in range(nproc)},
        "killed_ranks": list(kill_ranks),
        "kill_step": kill_step,
        "killed": {k: {"ships_via": ways[k], "by_sigkill": run["rc"][k] == -signal.SIGKILL, "kill_seen_at_step": seen_at(k),
                       "steps_done": len(done[k]), "stored": len(distinct[k]), "lost": lost[k],
                       "stored_is_prefix": distinct[k] == list(range(len(distinct[k])))} for k in kill_ranks},
        "sent": sum(len(v) for v in done.values()),
        "stored": sum(len(set(stored[r]) & set(done[r])) for r in range(nproc)),
        # a survivor's hooks also record the step its collective failed in (not in its step log)
        "stored_beyond_completed": sum(len(set(stored[r]) - set(done[r])) for r in range(nproc)),
        "duplicates": sum(len(stored[r]) - len(distinct[r]) for r in range(nproc)),
        "lost": sum(lost.values()),
        "lost_survivors": sum(lost[r] for r in survivors),
        "gaps_recorded": int(dropped),
        "unclosed_rows": [{"rank": u["rank"], "step": u["step"], "reason": u["reason"], "dropped": u["dropped"]}
                          for u in unclosed],
        "unclosed_ranks": sorted(marked),
        "unclosed_last_seq_exact": bool(unclosed) and all(
            u["reason"] == f"unclosed:last_seq={last_seq[u['origin_source']]}" for u in unclosed),
        "silent_rank_alerts": [{"rank": a["rank"], "message": a["message"]} for a in alerts],
        "lost_unmarked": sum(lost[r] for r in range(nproc) if r not in marked),
        "survivor_rc": {r: run["rc"][r] for r in survivors},
        "survivor_exit_after_kill_s": round(max(run["exit_unix_s"][r] - kill_t for r in survivors), 2),
        "survivor_step_ms_p50": {r: step_ms(run, r) for r in survivors},
        "baseline_step_ms_p50": {r: step_ms(base, r) for r in survivors} if base else None,
        "elapsed_s": round(elapsed, 2),
        "collector_exit_code": collector_rc,
        "agent_exit_code": agent_rc,
        "db": str(db),
    }
    return out
