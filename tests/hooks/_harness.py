"""Runs of the reference trainer under torchrun for the hooks' integration tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def trainer_env(endpoint: str, run_id: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TRACETOP_ENDPOINT=endpoint, TRACETOP_RUN_ID=run_id, TRACETOP_HEARTBEAT_S="1")
    env.pop("TRACETOP_DISABLE", None)
    env.update(extra)
    return env


def torchrun_argv(nproc: int, trainer_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "reference_trainer", "--quiet", *trainer_args]


def torchrun(nproc: int, trainer_args: list[str], *, endpoint: str, run_id: str, timeout_s: float = 300,
             **extra_env: str) -> subprocess.CompletedProcess:
    """Run the reference trainer to the end; raise with its output if it fails."""
    proc = subprocess.run(torchrun_argv(nproc, trainer_args), cwd=ROOT, env=trainer_env(endpoint, run_id, **extra_env),
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"reference trainer run {run_id} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def query(db: Path, sql: str, *params) -> list[tuple]:
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()
