"""Hook processes for the relay tests (the agent itself: tests/support/services.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

HOOK = Path(__file__).with_name("hook_proc.py")


def start_hook(
    endpoint: str, rank: int, n: int, duration_s: float, run_id: str = "relay-test"
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HOOK), endpoint, str(rank), str(n), str(duration_s), run_id],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_hooks(hooks: list[subprocess.Popen], timeout_s: float = 300.0) -> list[str]:
    outs = []
    for h in hooks:
        out, _ = h.communicate(timeout=timeout_s)
        assert h.returncode == 0, out
        outs.append(out)
    return outs


def exactly_once(db: Path) -> dict[int, tuple[int, int]]:
    """rank -> (rows, distinct steps) of the hooks' STEP rows; every row must be one a hook made."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        got = {
            int(r): (int(c), int(d))
            for r, c, d in con.execute(
                "SELECT rank, count(*), count(DISTINCT step) FROM step WHERE run_id = 'relay-test' GROUP BY rank"
            ).fetchall()
        }
        bad_steps = con.execute(
            "SELECT count(*) FROM step WHERE run_id = 'relay-test' AND (step < 0 OR data_wait_ns <> 1)"
        ).fetchone()[0]
    finally:
        con.close()
    assert bad_steps == 0
    return got
