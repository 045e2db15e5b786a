"""`tracetop bench ingest --mix realistic`: the simulated ranks' mix arrives whole, kind by kind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT


@pytest.mark.slow
def test_realistic_mix_is_stored_whole_with_the_stated_proportions(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", "ingest", "--mix", "realistic", "--ranks", "64",
                        "--step-s", "0.5", "--duration-s", "4", "--sources", "2", "--dir", str(tmp_path), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stored"] == out["sent"] > 0
    # 39 rows a rank-step: (1 + 20 + 16 + 1 + 1) x 64 ranks x 8 steps, plus GPU samples and heartbeats
    steps = 4 / 0.5
    assert out["sent"] >= 39 * 64 * steps
    assert out["offered_events_per_s"] == pytest.approx(64 * (39 / 0.5 + 1 / 8 + 1 / 5))
    for key in ("events_per_s", "p99_ms", "collector_cpu_pct", "collector_peak_rss_mb", "file_gb_per_hour"):
        assert out[key] > 0, key


def test_bad_mix_arguments_exit_2(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", "ingest", "--mix", "realistic", "--ranks", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--ranks must be positive" in r.stderr
