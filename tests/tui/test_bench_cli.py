"""`tracetop bench tui` / `tracetop bench e2e` print their keys; `tracetop ui` refuses bad flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT


def _tracetop(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetop.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.slow
def test_bench_tui_json() -> None:
    r = _tracetop("bench", "tui", "--ranks", "64", "--refresh-ranks", "2048", "--seconds", "2", "--refreshes", "3",
                  "--warmup-s", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ranks"] == 64 and out["refresh_ranks"] == 2048
    assert 0 < out["tui_cpu_pct"] < 100 * 16 and out["ranks_refresh_ms"] > 0
    assert out["tty_bytes_per_s"] > 0  # the TUI really drew into its pty while measured


@pytest.mark.slow
def test_bench_e2e_json() -> None:
    r = _tracetop("bench", "e2e", "--ranks", "32", "--sources", "2", "--steps", "6", "--step-s", "0.5",
                  "--flush-s", "0.5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["steps_seen"] >= 1 and 0 < out["e2e_p50_ms"] <= out["e2e_p99_ms"]


def test_ui_refuses_file_and_collector_together() -> None:
    r = _tracetop("ui", "x.duckdb", "--collector", "127.0.0.1:1", timeout_s=60)
    assert r.returncode == 2 and "not both" in r.stdout + r.stderr
    r = _tracetop("ui", "--interval-s", "0", timeout_s=60)
    assert r.returncode == 2 and "--interval-s" in r.stdout + r.stderr
