"""``tracetop bench compact``: what compaction at close saves and costs (collector/compact.py).

Pairs of runs, off then on: a collector started on a fresh file (``TRACETOP_COMPACT_MAX_MB=0``:
off; ``64``: on), a ``--steps``-step, ``--nproc``-rank run of the automatic form
(tests/trainer_hooks/auto_loop.py: a plain DDP loop on gloo, ``--step-ms 5 --data-ms 1``) shipping
to it, then SIGTERM; the close is timed from the signal to the collector's exit. Prints each run's
file size and close time, and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--pairs", type=int, default=2, help="off/on pairs of runs (default 2)")
    p.add_argument("--steps", type=int, default=300, help="steps a run (default 300)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")


def one(folder: Path, compact_mb: str, steps: int, nproc: int) -> tuple[float, float]:
    from tracetop import procs

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    os.environ["TRACETOP_COMPACT_MAX_MB"] = compact_mb
    svc = procs.collector(str(folder / "c.duckdb"), f"unix://{folder / 'c.sock'}", cwd=ROOT)
    svc.start(60)
    env = dict(os.environ, TRACETOP_ENDPOINT=svc.address, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    try:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                            str(nproc), str(ROOT / "tests" / "trainer_hooks" / "auto_loop.py"), "--prefix",
                            folder.name, "--segments", "auto", "--steps", str(steps), "--step-ms", "5",
                            "--data-ms", "1"], env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise SystemExit(f"bench compact: the run failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    finally:
        t0 = time.monotonic()
        svc.stop(signal.SIGTERM, 120)
        close_s = time.monotonic() - t0
    return os.path.getsize(folder / "c.duckdb") / 1e6, close_s


def run(args: argparse.Namespace) -> int:
    base = Path(tempfile.mkdtemp(prefix="tracetop-bench-compact-"))
    rows: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    try:
        for i in range(args.pairs):
            for arm, mb in (("off", "0"), ("on", "64")):
                mb_, s = one(base / f"{arm}{i}", mb, args.steps, args.nproc)
                rows[arm].append((mb_, s))
                if not args.json:
                    print(f"{arm}{i}: file {mb_:.2f} MB, close {s:.2f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = {f"{arm}_{k}": statistics.median(v[j] for v in rows[arm])
           for arm in rows for j, k in ((0, "file_mb"), (1, "close_s"))}
    out.update(pairs=args.pairs, steps=args.steps, nproc=args.nproc)
    print(json.dumps(out) if args.json else "medians: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()))
    return 0
