"""The automatic form (trainer_hooks/auto.py) on a real run, and what reads that run afterwards.

One torchrun job (tests/trainer_hooks/auto_loop.py: a plain DDP loop, 4 ranks on gloo) into one real
collector with the built-in rules, five segments, one run id each: ``explicit`` (step/phase blocks),
``auto`` (the same loop plus three lines), ``auto-data`` (rank 2's batches 150 ms slower from step 8),
``auto-forward`` (rank 1's forward 300 ms longer from step 8), ``auto-fsdp`` (the model in FSDP).
Ground truths: the sleeps the loop injects (--step-ms in forward, --data-ms per batch), the faults'
rank and step, and the explicit segment's rows; the same seeds give every segment the same losses.
The collector's file then feeds `tracetop summary` and `tracetop compare`.
"""

from __future__ import annotations

import difflib
import inspect
import json
import subprocess
import sys

import duckdb
import pytest

from collector.live.rules import DEFAULTS_TOML
from tests.collector.live.test_live_runs import _env
from tests.collector.util import sql
from tests.support import ROOT
from tests.support.services import start_collector
from tests.support.torchrun import launch
from tests.support.wait import wait_for
from tests.trainer_hooks import auto_loop

LOOP = str(ROOT / "tests" / "trainer_hooks" / "auto_loop.py")
STEPS, STEP_MS, DATA_MS = 30, 30.0, 10.0
SEGMENTS = ("explicit", "auto", "auto-data", "auto-forward", "auto-fsdp")
P = "auto"  # run id prefix


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetop.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto")
    rules = tmp / "rules.toml"
    rules.write_text(DEFAULTS_TOML)
    c = start_collector(tmp, listen="unix", extra_args=["--rules", str(rules)])
    out: dict = {"db": c.db}
    try:
        with _env(TRACETOP_ENDPOINT=c.addr, TRACETOP_HEARTBEAT_S="1", TRACETOP_FLUSH_S="1"):
            r = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", LOOP,
                        "--prefix", P, "--segments", ",".join(SEGMENTS), "--steps", str(STEPS),
                        "--step-ms", str(STEP_MS), "--data-ms", str(DATA_MS)], timeout_s=400)
        assert r.rc == 0, r.output[-3000:]

        def named():
            got = sql(c.addr, f"SELECT run_id, signal, rank, first_step FROM alerts WHERE run_id LIKE '{P}-%' "
                              "AND signal IN ('straggler', 'data_stall') AND fired_ns > 0").to_pylist()
            return got if {a["run_id"] for a in got} >= {f"{P}-auto-data", f"{P}-auto-forward"} else None

        out["alerts"] = wait_for(named, 60, "the data stall and the straggler named", every_s=0.5)
        out["alerts"] = sql(c.addr, "SELECT run_id, signal, rank, first_step FROM alerts WHERE fired_ns > 0 "
                                    "AND signal IN ('straggler', 'data_stall')").to_pylist()
    finally:
        assert c.stop() == 0
    con = duckdb.connect(str(c.db), read_only=True)
    out["rows"] = {s: con.execute(
        "SELECT rank, step, data_wait_ns / 1e6, forward_ns / 1e6, backward_ns / 1e6, optimizer_ns / 1e6, "
        "duration_ns / 1e6, loss FROM step WHERE run_id = ? ORDER BY rank, step", [f"{P}-{s}"]).fetchall()
        for s in SEGMENTS}
    con.close()
    return out


def test_the_automatic_form_is_the_plain_loop_plus_three_lines():
    plain = inspect.getsource(auto_loop.train_plain).splitlines()[1:]  # the bodies: the signature differs by run_id
    auto = inspect.getsource(auto_loop.train_auto).splitlines()[1:]
    added = [line for line in difflib.ndiff(plain, auto) if line.startswith("+ ")]
    removed = [line for line in difflib.ndiff(plain, auto) if line.startswith("- ")]
    imports = [line for line in inspect.getsource(auto_loop).splitlines() if line == "import trainer_hooks"]
    assert not removed and len(added) + len(imports) <= 3, (added, imports)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


@pytest.mark.slow
def test_auto_rows_equal_the_explicit_apis_within_noise(job):
    ex, au = job["rows"]["explicit"], job["rows"]["auto"]
    # the same steps on every rank, the same losses (same seeds, same data: the loss backward() saw)
    assert [r[:2] for r in au] == [r[:2] for r in ex] == [(k, s) for k in range(4) for s in range(STEPS)]
    assert [r[7] for r in au] == [r[7] for r in ex]
    # phase by phase, the medians over every rank's steps after the first agree within noise
    for i, name in ((2, "data"), (3, "forward"), (4, "backward"), (5, "optimizer"), (6, "step")):
        e, a = _median([r[i] for r in ex if r[1] > 0]), _median([r[i] for r in au if r[1] > 0])
        assert abs(a - e) <= 0.3 * e + 3.0, (name, e, a)
    # and they are the injected sleeps: DATA_MS in each batch, STEP_MS in each forward
    assert _median([r[2] for r in au]) >= DATA_MS and _median([r[3] for r in au]) >= STEP_MS


@pytest.mark.slow
def test_auto_form_under_fsdp_times_every_phase(job):
    fs, ex = job["rows"]["auto-fsdp"], job["rows"]["explicit"]
    assert [r[:2] for r in fs] == [r[:2] for r in ex]
    assert _median([r[2] for r in fs]) >= DATA_MS and _median([r[3] for r in fs]) >= STEP_MS
    assert _median([r[4] for r in fs]) > 0 and _median([r[5] for r in fs]) > 0
    assert [r[7] for r in fs] == pytest.approx([r[7] for r in ex], rel=1e-5)


@pytest.mark.slow
def test_auto_form_data_stall_and_forward_straggler_are_named_live(job):
    by_run = {}
    for a in job["alerts"]:
        by_run.setdefault(a["run_id"], []).append(a)
    stall = [a for a in by_run.get(f"{P}-auto-data", []) if a["signal"] == "data_stall"]
    strag = [a for a in by_run.get(f"{P}-auto-forward", []) if a["signal"] == "straggler"]
    assert [a["rank"] for a in stall] == [auto_loop.DATA_RANK], job["alerts"]
    assert [a["rank"] for a in strag] == [auto_loop.FWD_RANK], job["alerts"]
    assert auto_loop.FAULT_STEP <= stall[0]["first_step"] <= auto_loop.FAULT_STEP + 2
    assert auto_loop.FAULT_STEP <= strag[0]["first_step"] <= auto_loop.FAULT_STEP + 2
    # nothing of the kind on the clean runs
    assert not by_run.get(f"{P}-auto") and not by_run.get(f"{P}-explicit"), job["alerts"]


@pytest.mark.slow
def test_summary_names_the_input_straggler_and_the_next_step(job):
    r = _cli("summary", str(job["db"]), "--run", f"{P}-auto-data")
    assert r.returncode == 0, r.stderr
    head = r.stdout.split("\n\n")[0]
    assert head.startswith("verdict: input straggler"), r.stdout
    assert f"rank {auto_loop.DATA_RANK}" in head and "DataLoader workers" in head
    j = json.loads(_cli("summary", str(job["db"]), "--run", f"{P}-auto-forward", "--json").stdout)
    assert j["verdict"]["bound"] == "straggler" and f"rank {auto_loop.FWD_RANK}" in j["verdict"]["why"]
    assert "drain" in j["verdict"]["next"]


@pytest.mark.slow
def test_compare_fails_on_the_straggler_and_passes_against_itself(job):
    a, b = f"{job['db']}:{P}-auto", f"{job['db']}:{P}-auto-forward"
    bad = _cli("compare", a, b, "--fail-if", "step_time_pct>5")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "regressed: step_time" in bad.stdout
    same = _cli("compare", a, a, "--fail-if", "step_time_pct>5", "--fail-if", "fault_alerts>0")
    assert same.returncode == 0, same.stdout + same.stderr
    j = json.loads(_cli("compare", a, b, "--json").stdout)
    assert j["headline"]["fault_alerts"]["b"] == 1 and j["headline"]["step_time"]["pct"] > 100
