"""Where a rank's end goes: the close path of a plain torchrun DDP loop (gloo, CPU), per phase.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m tracetop.cli bench close --runs 5

Each run: a real collector, ``torchrun --nproc_per_node N`` of trainer_hooks/bench/close_loop.py,
every rank stamping its end on the system-wide monotonic clock (last step end, close start and
end, barrier, process-group teardown, last atexit hook) and this driver stamping each rank's
process exit through a pidfd. Scenarios, interleaved run by run: ``up`` (the collector reachable),
``down`` (an endpoint nobody listens on), ``sigterm`` (torchrun SIGTERMed mid-run: from the signal
to each rank's exit), ``off`` (the hooks disabled: the baseline the rest is judged against), ``freeze`` (``up`` with
``gc.freeze()`` as the rank's last atexit hook: what the interpreter's final collection costs). Prints medians and spread (min-max) per phase, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tracetop import procs

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exits(out: Path, nproc: int, job: subprocess.Popen, sigterm_after: float | None) -> tuple[dict[int, float], float]:
    """Each rank's exit (monotonic), seen through a pidfd; the monotonic time torchrun was SIGTERMed
    (NaN if not)."""
    fds: dict[int, int] = {}
    exits: dict[int, float] = {}
    sent = float("nan")
    deadline = time.monotonic() + 300
    while len(exits) < nproc and time.monotonic() < deadline:
        for r in range(nproc):
            p = out / f"rank{r}.pid"
            if r not in fds and r not in exits and p.exists() and p.read_text():
                try:
                    fds[r] = os.pidfd_open(int(p.read_text()))
                except ProcessLookupError:
                    exits[r] = time.monotonic()
        if sigterm_after is not None and sent != sent and len(fds) == nproc:
            paths = [out / f"rank{r}.json" for r in range(nproc)]
            started = [json.loads(p.read_text()) for p in paths if p.exists()]
            if len(started) == nproc and all("last_step_end" in s for s in started):
                time.sleep(sigterm_after)
                sent = time.monotonic()
                job.send_signal(signal.SIGTERM)
        ready, _, _ = select.select(list(fds.values()), [], [], 0.01)
        now = time.monotonic()
        for r, fd in list(fds.items()):
            if fd in ready:
                exits[r] = now
                os.close(fds.pop(r))
        if job.poll() is not None and not fds and len(exits) < nproc and all(
                (out / f"rank{r}.pid").exists() for r in range(nproc)):
            break
    return exits, sent


def one_run(tmp: Path, scenario: str, nproc: int, steps: int, collector: Any) -> list[dict[str, float]]:
    out = tmp / f"{scenario}-{time.monotonic_ns()}"
    out.mkdir()
    endpoint = collector.address if scenario != "down" else f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, TRACETOP_ENDPOINT=endpoint, TRACETOP_RUN_ID=out.name, PYTHONPATH=str(ROOT),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TRACETOP_HEARTBEAT_S="1")
    env.pop("TRACETOP_DISABLE", None)
    if scenario == "off":  # the baseline: the same loop with the hooks disabled
        env["TRACETOP_DISABLE"] = "1"
    n = steps if scenario != "sigterm" else 100000
    extra = ["--gc-freeze"] if scenario == "freeze" else []
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                            str(nproc), "-m", "trainer_hooks.bench.close_loop", "--steps", str(n), "--out", str(out), *extra],
                           env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    exits, sent = _exits(out, nproc, job, 1.0 if scenario == "sigterm" else None)
    job.wait(120)
    rows = []
    for r in range(nproc):
        s = json.loads((out / f"rank{r}.json").read_text())
        row: dict[str, float] = {}
        end = s["last_step_end"] if scenario != "sigterm" else sent
        for key in ("close_start", "close_end", "barrier_end", "teardown_end", "atexit_last"):
            if key in s:
                row[key] = s[key] - end
        row["exit"] = exits.get(r, float("nan")) - end
        ex = out / f"rank{r}.exit.json"
        if ex.exists() and "atexit_cpu_s" in s:  # CPU seconds after the last atexit hook: finalization
            row["finalize_cpu_s"] = json.loads(ex.read_text())["cpu_s"] - s["atexit_cpu_s"]
        for name, secs in s["waits"]:
            row[name] = row.get(name, 0.0) + secs
        if "close_start" in s:
            row["close"] = s["close_end"] - s["close_start"]
        rows.append(row)
    return rows


def _summary(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    keys = sorted({k for r in rows for k in r})
    out = {}
    for k in keys:
        vals = [r[k] for r in rows if k in r and r[k] == r[k]]
        if vals:
            out[k] = {"median": round(statistics.median(vals), 3), "min": round(min(vals), 3),
                      "max": round(max(vals), 3), "n": len(vals)}
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario, interleaved")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--scenarios", default="off,up,down,sigterm")
    ap.add_argument("--budget-s", type=float, default=240.0, help="no new round of runs after this many seconds")
    ap.add_argument("--json", action="store_true")


def run(a: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="close-bench-"))
    c = procs.collector(tmp / "collector.duckdb", cwd=ROOT).start()
    results: dict[str, list[dict[str, float]]] = {}
    try:
        started = time.monotonic()
        for i in range(a.runs):
            if i and time.monotonic() - started > a.budget_s:
                print(f"budget spent: {i} rounds of {a.runs}", file=sys.stderr)
                break
            for sc in a.scenarios.split(","):
                results.setdefault(sc, []).extend(one_run(tmp, sc, a.nproc, a.steps, c))
    finally:
        c.stop()
    report = {sc: _summary(rows) for sc, rows in results.items()}
    report["load"] = os.getloadavg()  # type: ignore[assignment]
    if a.json:
        print(json.dumps(report))
    else:
        for sc, summ in report.items():
            print(sc)
            if isinstance(summ, dict):
                for k, v in summ.items():
                    print(f"  {k:32s} median {v['median']:7.3f}  [{v['min']:.3f} .. {v['max']:.3f}]  n={v['n']}")
            else:
                print(" ", summ)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tracetop bench close", description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
