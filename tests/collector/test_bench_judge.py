"""`tracetop bench judge --quick --json` (collector/bench/judge.py): the fault matrix's smoke subset,
through the CLI: one clean run and one compute straggler (rank 2 of a plain DDP loop under
torchrun sleeps 1.5x its own median step inside its forward from step 10), each into a real
collector and DuckDB file of its own, judged live by the built-in rules. Ground truth: the
injection (rank, step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT

# alone: its clean run asserts no fault alert, which needs its ranks to share the cores evenly
# (see tests/collector/live/test_live_false_alarms.py)
pytestmark = [pytest.mark.slow, pytest.mark.alone]

KEYS = ("recall", "precision", "culprit_accuracy", "clean_fault_alerts", "clean_runs", "incidents_per_fault", "runs")


def test_bench_judge_quick_names_the_straggler_and_raises_no_alarm_on_the_clean_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "tracetop.cli", "bench", "judge", "--quick", "--json", "--dir",
                        str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert p.stdout.strip(), p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert all(k in s for k in KEYS), sorted(s)
    assert s["clean_runs"] == 1 and s["fault_runs"] == 1
    clean, fault = s["runs"]
    assert clean["culprit"] == "-" and clean["rank_steps"] == 4 * 30, clean   # the clean run was judged, whole
    assert s["clean_fault_alerts"] == 0, clean
    assert fault["culprit"] == "rank:2" and fault["detected"] and fault["culprit_right"], fault
    assert 0 <= fault["steps_to_detect"] <= 5, fault                           # named within 5 steps of onset
    assert s["recall"] == 1.0 and s["incidents_per_fault"] == 1, s
    assert p.returncode == 0, p.stderr[-2000:]
