"""`tracetop bench close` and `tracetop bench close-gone` run and print their figures (their values
are benchmarks: docs/benchmarks.md; the close's bounds are tested in test_close_path.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", *args, "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_bench_close_times_each_rank_end_phase() -> None:
    out = _bench("close", "--runs", "1", "--scenarios", "up", "--steps", "10")
    up = out["up"]
    for phase in ("close", "Shipper.flush", "atexit_last"):
        fig = up[phase]
        assert fig["n"] == 2 and 0 <= fig["min"] <= fig["median"] <= fig["max"], (phase, fig)


def test_bench_close_gone_times_both_cases() -> None:
    out = _bench("close-gone", "--runs", "1")
    for case in ("early", "report"):
        fig = next(v for k, v in out.items() if k.startswith(case))
        assert 0 < fig["min"] <= fig["median"] <= fig["max"], (case, fig)
