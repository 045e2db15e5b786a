"""`tracetop profile` on a live 2-rank run (torchrun, gloo) of a plain DDP loop traced by
``trainer_hooks.auto`` alone (no handler registered), through a real collector:

- a window of N steps on rank 0: the trace stored in the file, and `tracetop export --perfetto`
  puts the profiler's events inside those N step slices of rank 0 (same clock base); the window's
  step times are reported, and the steps after it cost what the steps before it did;
- rank 1 acts as if torch's profiler were missing (TRACETOP_TEST_NO_PROFILER=1): its window is
  refused, the action says why, nothing is stored;
- bad requests (a rank the run has not, N = 0, N too big, no rank named and no incident) are
  answered at once with the fault and the fix, nothing sent.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.collector.control.harness import Client, Trainer, wait_for
from tests.support import ROOT
from tests.support.services import start_collector

pytestmark = pytest.mark.slow
RUN = "profile-loop-1"
N = 5


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetop.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def window(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profile")
    c = start_collector(tmp, extra_args=["--controller", "off"])
    client = Client(c.addr)
    t = Trainer(tmp, nproc=2, args=["100000"], script=str(ROOT / "tests" / "collector" / "control" / "profile_loop.py"),
                env={"TRACETOP_ENDPOINT": c.addr, "TRACETOP_RUN_ID": RUN, "TRACETOP_FLUSH_S": "0.5",
                     "TRACETOP_COMMAND_EVERY_STEPS": "4", "TRACETOP_TEST_NO_PROFILER": "1",
                     "TRACETOP_PROFILE": "1"})
    out: dict = {}
    base = ["profile", "--collector", c.addr, "--run", RUN]
    try:
        wait_for(lambda: client.sql(f"SELECT count(DISTINCT rank) AS n FROM step WHERE run_id = '{RUN}'")[0]["n"] == 2,
                 300, "steps from both ranks", t.output)
        out["bad"] = {name: _cli(*base, *extra) for name, extra in (
            ("rank", ["--ranks", "5", "--steps", "3"]), ("zero", ["--ranks", "0", "--steps", "0"]),
            ("big", ["--ranks", "0", "--steps", "1000"]), ("none", ["--steps", "3"]))}
        out["ok"] = _cli(*base, "--ranks", "0", "--steps", str(N), "--compare-steps", "20", "--json")
        out["refused"] = _cli(*base, "--ranks", "1", "--steps", "3", "--json")
        out["log"] = t.output()
    finally:
        t.kill()
        client.close()
        c.stop()
    out["db"] = c.db
    out["export"] = tmp / "timeline.json"
    out["export_run"] = _cli("export", str(c.db), "--perfetto", str(out["export"]), "--run", RUN)
    out["report"] = tmp / "report.html"
    out["report_run"] = _cli("report", str(c.db), "-o", str(out["report"]), "--run", RUN)
    return out


def test_bad_requests_are_answered_with_the_fault(window):
    bad = window["bad"]
    for name, p in bad.items():
        assert p.returncode == 2, (name, p.stdout, p.stderr)
    assert "no rank 5" in bad["rank"].stderr and "world size 2" in bad["rank"].stderr
    assert "give 1 to 100 steps" in bad["zero"].stderr and "give 1 to 100 steps" in bad["big"].stderr
    assert "names a rank" in bad["none"].stderr and "--ranks" in bad["none"].stderr


def test_a_window_of_n_steps_is_stored_and_costs_nothing_after(window):
    p = window["ok"]
    assert p.returncode == 0, (p.stdout, p.stderr, window["log"][-3000:])
    r = json.loads(p.stdout)
    assert r["state"] == "applied", r
    (tr,) = r["traces"]
    assert tr["rank"] == 0 and tr["state"] == "stored" and tr["steps"] == N and tr["bytes"] > 0, tr
    assert tr["first_step"] == r["boundary_step"], r
    assert len(tr["window_step_ms"]) == N
    before, during, after = tr["before_ms"], tr["during_ms"], tr["after_ms"]
    assert before and during and after, tr
    # the cost afterwards is 0: the steps after the window are the steps before it, within noise
    # (medians of 20 steps each side, a margin for load 4); that the profiler is off after the
    # window is shown directly by the export test (no profiler event after its last step)
    assert after <= before * 2 + 2.0, tr


def test_refused_where_the_profiler_is_unavailable(window):
    p = window["refused"]
    assert p.returncode == 2, (p.stdout, p.stderr)
    r = json.loads(p.stdout)
    assert r["state"] == "rejected", r
    assert "torch.profiler is unavailable on rank 1" in r["outcome"], r
    assert not r.get("traces"), r


def test_the_perfetto_export_opens_the_trace_beside_the_steps(window):
    assert window["export_run"].returncode == 0, window["export_run"].stderr
    r = json.loads(window["ok"].stdout)
    (tr,) = r["traces"]
    first = tr["first_step"]
    ev = json.loads(window["export"].read_text())["traceEvents"]
    steps = {e["args"]["step"]: e for e in ev if e.get("cat") == "step" and e["tid"] == 0 * 10 + 1}
    prof = [e for e in ev if e.get("ph") == "X" and str(e.get("cat", "")).startswith("profiler:")]
    assert prof and all(e["args"]["rank"] == 0 and 4 <= e["tid"] <= 9 for e in prof)
    ops = [e for e in prof if e["name"] in ("aten::addmm", "aten::linear", "aten::mm")]
    for s in range(first, first + N):  # each profiled step holds the profiler's matmuls of that step
        st = steps[s]
        inside = [e for e in ops if st["ts"] - 0.5 <= e["ts"] and e["ts"] + e["dur"] <= st["ts"] + st["dur"] + 0.5]
        assert inside, (s, st, ops[:3])
    # and none outside the window: the profiler was off before and after
    lo = steps[first]["ts"] - 1e3
    hi = steps[first + N - 1]["ts"] + steps[first + N - 1]["dur"] + 1e5
    assert all(lo <= e["ts"] <= hi for e in ops), "profiler events outside the window"
    html = window["report"].read_text()
    assert window["report_run"].returncode == 0, window["report_run"].stderr
    assert 'id="profiles"' in html and "data:application/gzip;base64," in html and f"--steps {first}:" in html
