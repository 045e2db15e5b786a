"""`tracetop demo`: a collector, a 4-rank reference run (PP2 x DP2, one injected straggler) with the
hooks on, then a per-rank summary read back from the DuckDB file.

Everything is real: torchrun launches four DeepSpeed processes on gloo, their hooks ship over gRPC
to a collector process, which stores into DuckDB; the summary is SQL over that file.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=Path("demo-out"), help="where the DuckDB file goes (default demo-out/)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--straggler", default="1:60", help="RANK:MS injected on one rank (default 1:60)")
    parser.add_argument("--nproc", type=int, default=4, help="processes (default 4: PP2 x DP2)")


def run(args: argparse.Namespace) -> int:
    import duckdb

    from collector.loadgen import CollectorProcess
    from collector.report import render, summarize

    workdir: Path = args.dir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    db = workdir / "demo.duckdb"
    for stale in (db, db.with_suffix(".duckdb.wal")):
        stale.unlink(missing_ok=True)
    listen = f"unix://{workdir / 'collector.sock'}"
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")

    print(f"tracetop demo: collector on {listen}, file {db}", flush=True)
    collector = CollectorProcess(db, listen)
    collector.start()
    env = dict(os.environ, TRACETOP_ENDPOINT=listen, TRACETOP_RUN_ID=run_id, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        "-m", "reference_trainer", "--tp", "1", "--pp", "2", "--steps", str(args.steps),
        "--inject-straggler", args.straggler,
    ]
    print("tracetop demo: " + " ".join(cmd[2:]), flush=True)
    try:
        rc = subprocess.call(cmd, env=env)
    finally:
        collector.stop()
    if rc != 0:
        print(f"tracetop demo: the training run failed (exit {rc}); the collector log is {collector.log_path}", file=sys.stderr)
        return rc
    con = duckdb.connect(str(db), read_only=True)
    try:
        summary = summarize(con, run_id)
    finally:
        con.close()
    print()
    print(render(summary))
    print()
    print(f"injected: rank {args.straggler.split(':')[0]} computes {args.straggler.split(':')[1]} ms longer every step")
    print(f'explore: tracetop query {db} "SELECT * FROM step_summary"')
    return 0
