"""The verdict (collector/query/verdict.py) and `tracetop compare` (collector/query/compare.py) on
the committed fixture (a real PP2 x DP2 run, rank 3 STRAGGLER_MS slower from STRAGGLER_FROM_STEP),
and the pure judgment on facts a test writes. Real runs with a data stall and a straggler:
tests/trainer_hooks/test_auto.py."""

from __future__ import annotations

import json
import subprocess
import sys

import duckdb
import pytest

from collector.query import compare, verdict
from collector.report import build_report
from tests.support import ROOT
from tests.tui.fixture import RUN_ID, STRAGGLER_FROM_STEP, STRAGGLER_MS, STRAGGLER_RANK


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetop.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_fixture_is_judged_straggler_bound_with_the_injected_rank_and_size(recorded_file):
    con = duckdb.connect(str(recorded_file), read_only=True)
    try:
        facts = verdict.gather(con, RUN_ID)
        v = verdict.judge(facts)
        steps = con.execute("SELECT max(step) FROM step WHERE run_id = ?", [RUN_ID]).fetchone()[0]
    finally:
        con.close()
    assert v.bound == "straggler" and f"rank {STRAGGLER_RANK}" in v.why and "drain" in v.next
    rank, _node, _gpu_ms, paced, excess_ms, _ = facts.top_rank["straggler"]
    assert rank == STRAGGLER_RANK
    assert paced >= steps - STRAGGLER_FROM_STEP + 1  # it paced every step from the injection on
    assert 0.7 * STRAGGLER_MS <= excess_ms <= 1.5 * STRAGGLER_MS
    text = verdict.render(v)
    assert text.startswith("verdict: straggler") and "next: " in text


def test_summary_and_the_report_open_with_the_verdict(recorded_file, tmp_path):
    r = _cli("summary", str(recorded_file))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("verdict: straggler") and "per rank" in r.stdout
    j = json.loads(_cli("summary", str(recorded_file), "--json").stdout)
    assert j["verdict"]["bound"] == "straggler" and len(j["summary"]["ranks"]) == 4
    con = duckdb.connect(str(recorded_file), read_only=True)
    try:
        page = build_report(con, RUN_ID)
    finally:
        con.close()
    assert page.index('<section id="verdict"') < page.index('<section id="summary"')
    assert f"rank {STRAGGLER_RANK}" in page[page.index('<section id="verdict"'):page.index('<section id="summary"')]


def _facts(**kw) -> verdict.RunFacts:
    base = dict(run_id="r", ranks=4, steps=50, step_ms=100.0, data_ms=1.0, forward_ms=40.0, backward_ms=50.0,
                optimizer_ms=5.0, comm_ms=4.0, held_gpu_ms=20_000.0, lost_gpu_ms=dict.fromkeys(verdict.CAUSES, 0.0),
                top_rank={}, rank_data_ms={0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0},
                rank_compute_ms={0: 95.0, 1: 95.0, 2: 95.0, 3: 95.0})
    base.update(kw)
    return verdict.RunFacts(**base)


def test_judge_names_each_bound_and_its_next_step():
    lost = dict.fromkeys(verdict.CAUSES, 0.0)
    assert verdict.judge(_facts()).bound == "compute"
    spread = verdict.judge(_facts(data_ms=40.0, lost_gpu_ms={**lost, "data": 8000.0},
                                  top_rank={"data": (0, "n0", 2000.0, 50, 0.0, 40.0)}))
    assert spread.bound == "input-bound" and "DataLoader workers" in spread.next
    one = verdict.judge(_facts(lost_gpu_ms={**lost, "data": 8000.0}, rank_data_ms={0: 1.0, 1: 1.0, 2: 80.0, 3: 1.0},
                               top_rank={"data": (2, "n2", 7900.0, 48, 0.0, 80.0)}))
    assert one.bound == "input straggler" and "rank 2 (node n2)" in one.why and "80.0 ms" in one.why
    pipe = verdict.judge(_facts(lost_gpu_ms={**lost, "pipeline": 6000.0}, bubble=[(0, 0.45, 0.2), (1, 0.3, 0.2)]))
    assert pipe.bound == "pipeline bubble" and "micro-batches" in pipe.next and "stage 0" in pipe.why
    comm = verdict.judge(_facts(comm_ms=40.0, lost_gpu_ms={**lost, "comm": 5000.0, "data": 3100.0}))
    assert comm.bound == "exposed communication" and "bucket" in comm.next and comm.also == ["input-bound (16%)"]
    mem = verdict.judge(_facts(memory_growth=(1, 1 << 30, 2 << 30)))
    assert mem.bound == "memory" and "rank 1" in mem.why
    small = verdict.judge(_facts(memory_growth=(1, 1 << 30, (1 << 30) + (1 << 20))))
    assert small.bound == "compute"  # 1 MiB of growth is not a creep
    assert verdict.judge(_facts(steps=0)).bound == "no steps"


def test_compare_a_run_with_itself_passes_every_condition_and_bad_conditions_say_the_fix(recorded_file):
    ref = f"{recorded_file}:{RUN_ID}"
    r = _cli("compare", ref, str(recorded_file), "--fail-if", "step_time_pct>0", "--fail-if", "fault_alerts>0",
             "--fail-if", "tokens_per_s_pct<0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "passed: step_time_pct>0" in r.stdout and "all_reduce" in r.stdout
    bad = _cli("compare", ref, ref, "--fail-if", "step_tim_pct>5")
    assert bad.returncode == 2 and "did you mean step_time?" in bad.stderr
    with pytest.raises(compare.CompareError, match="expected NAME>X"):
        compare.parse_condition("step_time_pct=5")
    missing = _cli("compare", f"{recorded_file}:nope", ref)
    assert missing.returncode == 2 and "nope" in missing.stderr


def test_failed_names_what_regressed():
    a = compare.Profile("A", {**dict.fromkeys(compare.HEADLINE, float("nan")), "step_time": 100.0, "fault_alerts": 0.0},
                        {}, {})
    b = compare.Profile("B", {**a.headline, "step_time": 104.0, "fault_alerts": 1.0}, {}, {})
    d = compare.diff(a, b)
    conds = [compare.parse_condition(t) for t in ("step_time_pct>5", "step_time_pct>3", "fault_alerts>0", "mfu_pct<-5")]
    got = compare.failed(d, conds)
    assert [g.split(":")[0] for g in got] == ["step_time", "fault_alerts"], got
    assert "fail-if step_time_pct>3" in got[0]


def test_the_report_compares_against_a_baseline(recorded_file, tmp_path):
    out = tmp_path / "r.html"
    r = _cli("report", str(recorded_file), "-o", str(out), "--compare", f"{recorded_file}:{RUN_ID}")
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    section = page[page.index('<section id="compare"'):page.index('<section id="summary"')]
    assert "step_time" in section and "+0.0%" in section  # the run against itself
    bad = _cli("report", str(recorded_file), "-o", str(out), "--compare", f"{recorded_file}:nope")
    assert bad.returncode == 2 and "nope" in bad.stderr
