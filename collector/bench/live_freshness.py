"""Onset -> firing of a straggler alert (rank 3 computes 150 ms longer from step 20, PP2 x DP2) at
given TRACETOP_FLUSH_S values: one 30-step reference run per value into one collector, then the
alerts' onset -> firing seconds per run (the figure in collector/live/README.md).

    .venv/bin/python -m collector.bench.live_freshness 1 5

(was scripts/live_freshness.sh; the same commands, run from Python)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

QUERY = ("SELECT a.run_id, a.first_step, a.fired_step, round((a.fired_ns - s.start_ns) / 1e9, 2) AS onset_to_firing_s "
         "FROM alerts a JOIN step s ON s.run_id = a.run_id AND s.rank = 3 AND s.step = 20 "
         "WHERE a.signal = 'straggler' ORDER BY a.run_id")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("flush_s", nargs="+", help="TRACETOP_FLUSH_S values, one run each")
    a = p.parse_args(argv)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    d = Path(tempfile.mkdtemp())
    db, sock = d / "f.duckdb", f"unix://{d / 'c.sock'}"
    with open(d / "col.log", "w") as col_log:
        collector = subprocess.Popen([sys.executable, "-m", "tracetop.cli", "collector", "--db", str(db), "--listen", sock],
                                     cwd=ROOT, env=env, stdout=col_log, stderr=subprocess.STDOUT)
    for _ in range(100):
        if "listening" in (d / "col.log").read_text():
            break
        time.sleep(0.2)
    for f in a.flush_s:
        run_env = dict(env, TRACETOP_FLUSH_S=f, TRACETOP_ENDPOINT=sock, TRACETOP_RUN_ID=f"flush{f}")
        with open(d / f"run{f}.log", "w") as log:
            try:
                subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                                "-m", "reference_trainer", "--pp", "2", "--steps", "30", "--quiet",
                                "--inject-straggler", "3:150@20"], cwd=ROOT, env=run_env, stdout=log,
                               stderr=subprocess.STDOUT, timeout=400)
            except subprocess.TimeoutExpired:
                pass
    time.sleep(3)
    collector.send_signal(signal.SIGTERM)
    collector.wait()
    return subprocess.call([sys.executable, "-m", "tracetop.cli", "query", str(db), QUERY], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
