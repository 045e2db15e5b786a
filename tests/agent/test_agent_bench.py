"""`tracetop bench agent --json` runs end to end (short windows) and prints the keys the issue asks
for. No assertion on the CPU figures themselves: they are benchmarks, reported in the notes."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def test_bench_agent_json_short_run():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracetop.cli",
            "bench",
            "agent",
            "--json",
            "--window-s",
            "1.5",
            "--rounds",
            "1",
            "--events-per-s",
            "2000",
            "--gpus",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"sampling_cpu_pct", "relay_cpu_pct", "relay_events_per_s", "sample_ms_per_interval"} <= set(out)
    assert out["gpus"] == 2 and out["sampling_cpu_pct"] >= 0 and out["relay_cpu_pct"] >= 0
    assert out["relay_events_per_s"] > 0.3 * 2000  # the load really went through the relay
