"""`tracetop bench judge`: the fault matrix as a benchmark: are tracetop's judgments right?

Clean runs and one run per fault class, on two trainers: a plain DDP loop written the way a user
writes one (collector/bench/judge_loop.py, 4 ranks, gloo, under torchrun) and the reference
trainer (PP2 x DP2) where it has the fault. Each run ships to a real collector of its own (its own
DuckDB file) running the built-in rules; what the rules fired is read back from its `alerts` table
and held against the injection (the rank, the step, the time it began: printed by the trainer).

Faults are sized by the measured step time (the rank's own median step before onset), so they mean
the same at any load. ``--noise``: a CPU burner process beside the ranks, and one rank SIGSTOPped
for about a step every few seconds (SIGCONT after), on the clean runs too.

Figures (top level of ``--json``):
- recall: fault runs where a fault alert named the culprit (rank; stage for stage imbalance; the
  run for a loss spike) / fault runs;
- culprit_accuracy: fault runs whose first fault alert named the culprit / fault runs;
- precision: fault alerts naming the culprit / all fault alerts (fault and clean runs);
- clean_fault_alerts: fault alerts over all clean runs (should be 0); clean_runs;
- incidents_per_fault: the most incidents one fault run raised (distinct coalesce(incident_id, id)
  over its fault alerts where the alerts table has incident_id, else its distinct fault alerts);
- per fault run: detected, culprit_right, steps and seconds from onset to the first alert naming
  the culprit, its fault alerts.
Fault alerts: straggler, data_stall, silent_rank, stuck_collective, first_failure, unheard_rank,
memory, loss_spike (and stage_imbalance / bubble naming the slow stage, for that fault only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAULT_SIGNALS = ("straggler", "data_stall", "silent_rank", "stuck_collective", "first_failure", "unheard_rank",
                 "memory", "loss_spike")
NPROC = 4
MEMORY_BUDGET = 1 << 30  # each rank declares 1 GiB (TRACETOP_MEMORY_BUDGET_BYTES): a torch rank uses ~0.3


@dataclass
class Case:
    name: str
    trainer: str                      # "loop" | "reference"
    args: list[str]
    culprit: str = ""                 # "rank:2" | "stage:1" | "run" | "" (clean)
    onset_step: int = -1
    deadline: str = "steps"           # "steps": named within 5 steps of onset; "seconds": within 20 s; "none"
    stop: bool = False                # the run does not end by itself: stopped once judged (or after wait_s)
    wait_s: float = 45.0              # after onset: how long to wait for a judgment
    sigstop: tuple[int, int, float] | None = None  # (rank, step, seconds) frozen from outside
    signals: tuple[str, ...] = FAULT_SIGNALS
    steps: int = 30

    @property
    def clean(self) -> bool:
        return not self.culprit


def _loop(name: str, steps: int, *args: str, **kw) -> Case:
    return Case(name, "loop", ["--steps", str(steps), *args], steps=steps, **kw)


def cases(quick: bool = False) -> list[Case]:
    """The matrix. Onsets leave 8 steps for the base step time; runs are tens of steps."""
    s = 10  # onset step of the step faults
    faults = [
        _loop("compute straggler (forward)", 30, "--fault", f"forward:2:1.5@{s}", culprit="rank:2", onset_step=s),
        _loop("compute straggler (backward, buckets in flight)", 30, "--fault", f"backward:1:1.5@{s}", culprit="rank:1",
              onset_step=s),
        # a creep has no onset step: counted from the first step its extra reaches half a base step
        # (0.4, 0.8, 1.2, ... x), with no deadline
        _loop("creeping slowdown", 30, "--fault", f"creep:3:0.4@{s}", culprit="rank:3", onset_step=s + 1,
              deadline="none"),
        _loop("data-loader stall", 30, "--fault", f"data:2:1.5@{s}", culprit="rank:2", onset_step=s),
        _loop("slow communication on one rank", 30, "--fault", f"comm:1:1.5@{s}", culprit="rank:1", onset_step=s),
        # a growth (64 MB a step) crosses 90% of the 1 GiB budget some steps after it begins: no deadline
        _loop("memory growth", 30, "--fault", f"mem:0:64@{s}", culprit="rank:0", onset_step=s, deadline="none"),
        _loop("loss spike", 40, "--fault", "loss:0:4@25", culprit="run", onset_step=25),
        _loop("hang inside a collective", 200, "--fault", f"hang:3:0@{s}", "--timeout-s", "120", culprit="rank:3",
              onset_step=s, deadline="seconds", stop=True),
        _loop("rank stalled in its forward, peers in all-reduce", 200, "--fault", f"stall:2:60@{s}", culprit="rank:2",
              onset_step=s, deadline="seconds", stop=True),
        _loop("frozen process (SIGSTOP)", 200, culprit="rank:1", onset_step=s, deadline="seconds", stop=True,
              sigstop=(1, s, 60.0)),
        _loop("killed rank under torchrun", 60, "--kill", f"3@{s}", "--timeout-s", "20", culprit="rank:3",
              onset_step=s, deadline="seconds"),
        _loop("crash before the first heartbeat", 30, "--die-early", "1", culprit="rank:1", deadline="seconds",
              wait_s=40.0),
        _loop("hang before the first heartbeat", 30, "--late", "1:60", culprit="rank:1", deadline="seconds",
              stop=True, wait_s=40.0),
        Case("stage imbalance (reference, PP2)", "reference", ["--pp", "2", "--steps", "30",
                                                                "--inject-stage-imbalance", f"1:4@{s}"],
             culprit="stage:1", onset_step=s, signals=FAULT_SIGNALS + ("stage_imbalance", "bubble"), steps=30),
        Case("compute straggler (reference)", "reference", ["--pp", "2", "--steps", "30",
                                                            "--inject-slow-rank", f"2:2.5@{s}"],
             culprit="rank:2", onset_step=s, steps=30),
        Case("hang inside a collective (reference)", "reference", ["--pp", "2", "--steps", "200",
                                                                   "--inject-hang", f"3@{s}"],
             culprit="rank:3", onset_step=s, deadline="seconds", stop=True, steps=200),
    ]
    clean = [_loop(f"clean {i + 1}", 30) for i in range(8)] + \
        [Case(f"clean reference {i + 1}", "reference", ["--pp", "2", "--steps", "30"], steps=30) for i in range(2)]
    if quick:
        return [clean[0], faults[0]]
    return clean + faults


# ------------------------------------------------------------------------------------ running
class Noise:
    """A CPU burner process, and one rank SIGSTOPped for about a step every 2-4 s."""

    def __init__(self, pid_dir: Path, rank: int, seed: int) -> None:
        self.pid_dir, self.rank = pid_dir, rank
        self.rng = random.Random(seed)
        self.burner: subprocess.Popen | None = None
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._desched, daemon=True)
        self.bursts = 0

    def start(self) -> None:
        self.burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        self.thread.start()

    def _step(self) -> int:
        try:
            return int((self.pid_dir / f"rank{self.rank}.step").read_text())
        except (OSError, ValueError):
            return -1

    def _desched(self) -> None:
        pid = None
        last = (time.monotonic(), -1)
        step_s = 0.1
        while not self.stop_ev.wait(self.rng.uniform(2.0, 4.0)):
            try:
                pid = pid or int((self.pid_dir / f"rank{self.rank}.pid").read_text())
            except (OSError, ValueError):
                continue
            now, st = time.monotonic(), self._step()
            if st > last[1] >= 0:
                step_s = (now - last[0]) / (st - last[1])
            last = (now, st)
            if st < 0:
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(min(max(step_s, 0.05), 2.0))  # about one step
                os.kill(pid, signal.SIGCONT)
                self.bursts += 1
            except ProcessLookupError:
                return

    def stop(self) -> None:
        self.stop_ev.set()
        self.thread.join(5)
        if self.burner is not None:
            self.burner.kill()
            self.burner.wait()


def _sql(addr: str, query: str) -> list[dict]:
    from collector.bench.rank_kill import sql

    return sql(addr, query)


def _fault_alerts(addr: str, run_id: str, signals: tuple[str, ...], has_incident: bool) -> list[dict]:
    inc = "coalesce(incident_id, id)" if has_incident else "id"
    names = ", ".join(f"'{s}'" for s in signals)
    return _sql(addr, f"SELECT id, {inc} AS incident, signal, rank, stage, labels, first_step, fired_step, fired_ns, "
                      f"message FROM alerts WHERE run_id = '{run_id}' AND fired_ns IS NOT NULL AND signal IN ({names}) "
                      f"ORDER BY fired_ns")


def _names(case: Case, a: dict) -> bool:
    """The alert names the case's culprit."""
    kind, _, val = case.culprit.partition(":")
    labels = json.loads(a["labels"] or "{}")
    if kind == "rank":
        return a["signal"] not in ("stage_imbalance", "bubble", "loss_spike") and str(a["rank"]) == val
    if kind == "stage":
        return labels.get("slow_stage") == val
    if kind == "run":
        return a["signal"] == "loss_spike"
    return False


def run_case(case: Case, workdir: Path, *, noise: bool, seed: int, run_id: str) -> dict:
    from collector.bench.loadgen import CollectorProcess

    workdir.mkdir(parents=True, exist_ok=True)
    pid_dir = workdir / "pids"
    pid_dir.mkdir(exist_ok=True)
    db = workdir / "judge.duckdb"
    listen = f"unix://{workdir / 'c.sock'}"
    collector = CollectorProcess(db, listen)
    collector.start()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRACETOP_ENDPOINT=listen,
               TRACETOP_RUN_ID=run_id, TRACETOP_HEARTBEAT_S="1", TRACETOP_FLUSH_S="1",
               TRACETOP_MEMORY_BUDGET_BYTES=str(MEMORY_BUDGET), PYTHONPATH=str(ROOT))
    env.pop("TRACETOP_DISABLE", None)
    if case.trainer == "loop":
        cmd = ["-m", "collector.bench.judge_loop", *case.args, "--pid-dir", str(pid_dir)]
    else:
        cmd = ["-m", "reference_trainer", *case.args, "--quiet", "--dist-timeout-s", "120"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC), *cmd]
    culprit_rank = int(case.culprit.split(":")[1]) if case.culprit.startswith("rank:") else -1
    nz = Noise(pid_dir, (culprit_rank + 1) % NPROC if culprit_rank >= 0 else seed % NPROC, seed) if noise else None
    log_path = workdir / "job.log"
    t0 = time.monotonic()
    onset_ns = None
    has_incident = False
    try:
        with open(log_path, "w") as log:
            job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        if nz:
            nz.start()
        frozen_pid = None
        start_ns = time.time_ns()
        judged_at = None
        try:
            while True:
                rc = job.poll()
                out = log_path.read_text(errors="replace")
                if onset_ns is None:
                    m = re.findall(r"onset rank \d+ step -?\d+ unix_ns (\d+)", out)
                    if m:
                        onset_ns = min(int(x) for x in m)
                    elif case.trainer == "reference" and "injected hang" in out:
                        onset_ns = time.time_ns()
                if case.sigstop and frozen_pid is None:
                    r, st, _ = case.sigstop
                    try:
                        if int((pid_dir / f"rank{r}.step").read_text()) >= st:
                            frozen_pid = int((pid_dir / f"rank{r}.pid").read_text())
                            if nz:  # the noise leaves the frozen rank alone
                                nz.rank = (r + 2) % NPROC
                            os.kill(frozen_pid, signal.SIGSTOP)
                            onset_ns = time.time_ns()
                    except (OSError, ValueError):
                        pass
                if rc is not None:
                    break
                since = onset_ns or (start_ns if case.onset_step < 0 and case.culprit else None)
                if case.stop and since is not None:
                    if judged_at is None and _judged(listen, run_id, case):
                        judged_at = time.monotonic()
                    if (judged_at is not None and time.monotonic() - judged_at > 3) or \
                            (time.time_ns() - since) / 1e9 > case.wait_s:
                        break
                if time.monotonic() - t0 > 600:
                    break
                time.sleep(0.5)
        finally:
            # a frozen rank stays frozen to its SIGKILL (a SIGCONT first would let it beat once more)
            if nz:
                nz.stop()
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wall = time.monotonic() - t0
        # what a stopped run leaves is judged on the timer (first failure after 15 s of silence)
        end = time.monotonic() + (case.wait_s if case.culprit and case.deadline == "seconds" else 3.0)
        while time.monotonic() < end:
            if case.culprit and case.deadline == "seconds" and _judged(listen, run_id, case):
                time.sleep(1.0)
                break
            time.sleep(1.0)
        has_incident = bool(_sql(listen, "SELECT 1 FROM information_schema.columns WHERE table_name = 'alerts' AND "
                                         "column_name = 'incident_id'"))
        alerts = _fault_alerts(listen, run_id, case.signals, has_incident)
        steps = _sql(listen, f"SELECT count(*) AS n, median(duration_ns) / 1e6 AS ms, min(start_ns) FILTER (WHERE "
                             f"step = {case.onset_step}) AS onset_ns FROM step WHERE run_id = '{run_id}'")
        if onset_ns is None and steps[0]["onset_ns"]:
            onset_ns = int(steps[0]["onset_ns"])  # the onset step's start (the reference trainer's faults)
    finally:
        collector.stop()
    return _score(case, alerts, onset_ns, steps[0], wall, nz.bursts if nz else 0, job.returncode,
                  log_path.read_text(errors="replace"))


def _judged(addr: str, run_id: str, case: Case) -> bool:
    try:
        return any(_names(case, a) for a in _fault_alerts(addr, run_id, case.signals, False))
    except Exception:
        return False


def _score(case: Case, alerts: list[dict], onset_ns: int | None, steps: dict, wall: float, bursts: int, rc,
           output: str) -> dict:
    named = [a for a in alerts if _names(case, a)]
    for a in alerts:
        # the stage alerts naming the slow stage (stage_imbalance, the bubbles it causes) are one
        # incident where the alerts table does not group them (no incident_id)
        slow = json.loads(a["labels"] or "{}").get("slow_stage")
        if a["signal"] in ("stage_imbalance", "bubble") and slow is not None and a["incident"] == a["id"]:
            a["incident"] = f"stage:{slow}"
    row = {"case": case.name, "trainer": case.trainer, "culprit": case.culprit or "-", "onset_step": case.onset_step,
           "rc": rc, "wall_s": round(wall, 1), "rank_steps": steps.get("n"),
           "step_ms_p50": round(steps["ms"], 1) if steps.get("ms") is not None else None, "noise_bursts": bursts,
           "alerts": len(alerts), "incidents": len({a["incident"] for a in alerts}),
           "alerts_list": [f"{a['signal']} rank={a['rank']} step={a['fired_step']}" for a in alerts][:8],
           "right_alerts": len(named)}
    if case.clean:
        return row
    first = named[0] if named else None
    row["detected"] = first is not None
    row["culprit_right"] = bool(alerts) and _names(case, alerts[0])
    row["steps_to_detect"] = (first["fired_step"] - case.onset_step if first and case.onset_step >= 0
                              and first["fired_step"] is not None and first["fired_step"] >= 0 else None)
    row["seconds_to_detect"] = round((first["fired_ns"] - onset_ns) / 1e9, 1) if first and onset_ns else None
    if case.deadline == "none":
        row["in_time"] = row["detected"]
    elif case.deadline == "steps":
        row["in_time"] = row["steps_to_detect"] is not None and row["steps_to_detect"] <= 5
    else:
        row["in_time"] = row["seconds_to_detect"] is not None and row["seconds_to_detect"] <= 20
    if not row["detected"]:
        row["job_tail"] = output[-800:]
    return row


def bench(workdir: Path, *, noise: bool, quick: bool, only: str = "", log=None) -> dict:
    rows = []
    t0 = time.monotonic()
    for i, case in enumerate(cases(quick)):
        if only and only not in case.name:
            continue
        t = time.monotonic()
        row = run_case(case, workdir / f"run{i:02d}", noise=noise, seed=i, run_id=f"judge-{i:02d}")
        rows.append(row)
        if log:
            log(f"[bench judge] {case.name}: {_line(row)} ({time.monotonic() - t:.0f} s)")
    return summary(rows, noise=noise, quick=quick, wall_s=time.monotonic() - t0)


def summary(rows: list[dict], *, noise: bool, quick: bool, wall_s: float) -> dict:
    faults = [r for r in rows if r["culprit"] != "-"]
    clean = [r for r in rows if r["culprit"] == "-"]
    all_alerts = sum(r["alerts"] for r in rows)
    right = sum(r["right_alerts"] for r in faults)
    n = max(1, len(faults))
    step_det = [r["steps_to_detect"] for r in faults if r.get("steps_to_detect") is not None]
    sec_det = [r["seconds_to_detect"] for r in faults if r.get("seconds_to_detect") is not None]
    return {
        "recall": round(sum(r["detected"] for r in faults) / n, 3) if faults else None,
        "precision": round(right / all_alerts, 3) if all_alerts else 1.0,
        "culprit_accuracy": round(sum(r["culprit_right"] for r in faults) / n, 3) if faults else None,
        "clean_fault_alerts": sum(r["alerts"] for r in clean),
        "clean_runs": len(clean),
        "fault_runs": len(faults),
        "incidents_per_fault": max((r["incidents"] for r in faults), default=0),
        "in_time": sum(bool(r.get("in_time")) for r in faults),
        "max_steps_to_detect": max(step_det, default=None),
        "max_seconds_to_detect": max(sec_det, default=None),
        "noise": noise, "quick": quick, "ranks": NPROC, "wall_s": round(wall_s, 1),
        "load_1m": round(os.getloadavg()[0], 2),
        "runs": rows,
    }


def _line(r: dict) -> str:
    if r["culprit"] == "-":
        return f"clean: {r['alerts']} fault alerts {r['alerts_list']}"
    return (f"detected={r['detected']} culprit_right={r['culprit_right']} steps={r['steps_to_detect']} "
            f"s={r['seconds_to_detect']} alerts={r['alerts']} incidents={r['incidents']} {r['alerts_list']}")


def table(s: dict) -> str:
    lines = [f"{'run':<52} {'trainer':<9} {'culprit':<8} {'named':>5} {'first':>5} {'steps':>5} {'s':>6} "
             f"{'alerts':>6} {'step ms':>7}"]
    def yn(r: dict, k: str) -> str:
        return "-" if k not in r else ("yes" if r[k] else "NO")

    for r in s["runs"]:
        lines.append(f"{r['case'][:52]:<52} {r['trainer']:<9} {r['culprit']:<8} {yn(r, 'detected'):>5} "
                     f"{yn(r, 'culprit_right'):>5} {str(r.get('steps_to_detect', '-')):>5} "
                     f"{str(r.get('seconds_to_detect', '-')):>6} {r['alerts']:>6} {str(r['step_ms_p50']):>7}")
    lines.append(f"recall {s['recall']}, precision {s['precision']}, culprit accuracy {s['culprit_accuracy']}, "
                 f"fault alerts on {s['clean_runs']} clean runs: {s['clean_fault_alerts']}, incidents per fault <= "
                 f"{s['incidents_per_fault']}, in time {s['in_time']}/{s['fault_runs']} (noise "
                 f"{'on' if s['noise'] else 'off'}, {s['wall_s']:.0f} s, load {s['load_1m']})")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--noise", action="store_true",
                        help="a CPU burner beside the ranks and one rank SIGSTOPped for ~1 step every 2-4 s")
    parser.add_argument("--quick", action="store_true", help="a smoke subset: one clean run, one straggler")
    parser.add_argument("--only", default="", help="only the runs whose name holds this text")
    parser.add_argument("--dir", type=Path, default=None, help="keep each run's DuckDB file and log here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.dir is not None:
        s = bench(args.dir, noise=args.noise, quick=args.quick, only=args.only, log=log)
    else:
        with tempfile.TemporaryDirectory(prefix="tracetop-judge-") as d:
            s = bench(Path(d), noise=args.noise, quick=args.quick, only=args.only, log=log)
    print(json.dumps(s) if args.json else table(s))
    ok = (s["recall"] is None or s["recall"] >= 0.95) and s["clean_fault_alerts"] == 0
    return 0 if ok else 1
