"""A tracer's close when its endpoint refuses every connection, A/B between two trees.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m tracetop.cli bench close-gone --runs 4 \\
        --ab "PYTHONPATH=/work/main"

Two cases, each run in a fresh process (the sender's first try then takes as long as it does in a
job's first seconds), interleaved with the ``--ab`` tree's run of the same case:

* ``early``: three 10 ms steps, then ``close()``: the close begins before the sender's first try has
  failed (the never-reached rule used to be judged then, and the close waited all of
  ``close_timeout_s``);
* ``report``: rank 0 has a command outcome to report, and the close is the exit path's
  (``close_within`` 0.5 s): the reporter's retries used to ignore that deadline.

Prints the close's seconds per case and tree: medians and range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, logging, socket, sys, time
logging.disable(logging.WARNING)
import trainer_hooks
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    ep = f"127.0.0.1:{s.getsockname()[1]}"
t = trainer_hooks.Tracer(endpoint=ep, run_id="close-gone", rank=0, world_size=1, device="cpu", wrap_collectives=False)
for i in range(3):
    with t.step(i):
        time.sleep(0.01)
case = sys.argv[1]
if case == "report":
    t.commands.link.report("7", False, -1, "the benchmark's")
t0 = time.monotonic()
t.close() if case == "early" else t.close_within(t0 + 0.5)
print(json.dumps({"close_s": time.monotonic() - t0, "file": trainer_hooks.__file__}))
"""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cases", default="early,report")
    ap.add_argument("--ab", default="", help="VAR=VALUE for the other side, e.g. PYTHONPATH=/path/to/other/tree")
    ap.add_argument("--json", action="store_true")


def _one(case: str, env: dict[str, str]) -> tuple[float, str]:
    # run from a neutral folder: ``-c`` puts the working directory first on the path
    out = subprocess.run([sys.executable, "-c", _CHILD, case], env=env, cwd=tempfile.gettempdir(),
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["close_s"]), str(Path(got["file"]).parents[1])


def run(a: argparse.Namespace) -> int:
    sides = {"this": dict(os.environ, PYTHONPATH=str(ROOT))}
    if a.ab:
        key, _, value = a.ab.partition("=")
        sides["ab"] = dict(os.environ, **{key: value})
    got: dict[str, list[float]] = {}
    for _ in range(a.runs):
        for case in a.cases.split(","):
            for side, env in sides.items():
                secs, tree = _one(case, env)
                got.setdefault(f"{case} {side} ({tree})", []).append(secs)
    report = {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}
              for k, v in got.items()}
    report["load"] = os.getloadavg()  # type: ignore[assignment]
    print(json.dumps(report) if a.json else "\n".join(f"{k:40s} {v}" for k, v in report.items()))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tracetop bench close-gone", description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
