"""Runs of the reference trainer under torchrun for the hooks' integration tests."""

from __future__ import annotations

import os
from pathlib import Path


def trainer_env(endpoint: str, run_id: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TRACETOP_ENDPOINT=endpoint, TRACETOP_RUN_ID=run_id, TRACETOP_HEARTBEAT_S="1")
    env.pop("TRACETOP_DISABLE", None)
    env.update(extra)
    return env


def torchrun(tmp: Path, nproc: int, trainer_args: list[str], *, endpoint: str, run_id: str,
             timeout_s: float = 400, **extra_env: str) -> None:
    """Run the reference trainer to the end with the hooks on, shipping to ``endpoint`` (through
    the reference trainer tests' launcher, which also cleans up its process group)."""
    import pytest

    from tests.support.torchrun import torchrun as launch

    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"TRACETOP_ENDPOINT": endpoint, "TRACETOP_RUN_ID": run_id, "TRACETOP_HEARTBEAT_S": "1",
                           **extra_env}.items():
            mp.setenv(key, value)
        mp.delenv("TRACETOP_DISABLE", raising=False)
        result = launch(tmp / run_id, nproc=nproc, args=trainer_args, timeout_s=timeout_s, trace=True)
    if result.rc != 0:
        raise AssertionError(f"reference trainer run {run_id} failed ({result.rc}):\n{result.output[-5000:]}")


def query(db: Path, sql: str, *params) -> list[tuple]:
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()
