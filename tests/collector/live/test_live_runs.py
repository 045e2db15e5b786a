"""Live judgments on real reference-trainer runs (PP2 x DP2 on gloo) into one real collector.

One collector with the built-in rules (stuck-in-a-collective lowered to 8 s so that a hang is
named within 20 s), three runs: a straggler on rank 3 from step 20, a hang on rank 1 at step
12, and the checks that need the stored rows afterwards (live == recompute, live == views).
Ground truths are the injections: the rank, the step, the onset time the hung rank reports."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from collector.live import judge
from collector.live import signals as sg
from collector.live.replay import recompute
from collector.live.rules import DEFAULTS_TOML, parse
from collector.schema import connect
from tests.collector.util import sql
from tests.helpers import ROOT, start_collector
from tests.reference_trainer.launch import torchrun

pytestmark = pytest.mark.slow

STRAGGLER_STEP, HANG_STEP = 20, 12
RULES = DEFAULTS_TOML.replace("stuck_s_above = 30", "stuck_s_above = 8")


@contextlib.contextmanager
def _env(**kw):
    old = {k: os.environ.get(k) for k in kw}
    os.environ.update(kw)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _alerts(addr: str, run_id: str) -> list[dict]:
    return sql(addr, f"SELECT * FROM alerts WHERE run_id = '{run_id}' ORDER BY first_ns").to_pylist()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    rules = tmp / "rules.toml"
    rules.write_text(RULES)
    c = start_collector(tmp, listen="unix", extra_args=["--rules", str(rules)])
    out = {"collector": c, "rules": rules, "tmp": tmp}
    try:
        with _env(TRACETOP_ENDPOINT=c.addr, TRACETOP_RUN_ID="strag"):
            r = torchrun(tmp / "strag", nproc=4, trace=True, args=[
                "--pp", "2", "--steps", "30", "--inject-straggler", f"3:150@{STRAGGLER_STEP}"])
        assert r.rc == 0, r.output[-3000:]
        with _env(TRACETOP_ENDPOINT=c.addr, TRACETOP_RUN_ID="hang"):
            h = torchrun(tmp / "hang", nproc=4, trace=True, args=[
                "--pp", "2", "--steps", "20", "--inject-hang", f"1@{HANG_STEP}", "--dist-timeout-s", "35"])
        assert h.rc != 0  # the hang ends the run at the timeout
        out["hang_output"] = h.output
        out["strag_alerts"] = _alerts(c.addr, "strag")
        out["hang_alerts"] = _alerts(c.addr, "hang")
        out["stored"] = sql(c.addr, "SELECT rule, run_id, labels, first_step, state FROM alerts "
                                    "WHERE first_step >= 0").to_pylist()
        out["cli"] = subprocess.run([sys.executable, "-m", "tracetop.cli", "alerts", "--collector", c.addr, "--json"],
                                    cwd=ROOT, capture_output=True, text=True, timeout=60)
        out["hang_beats"] = sql(c.addr, "SELECT rank, step, pending_op, pending_role, pending_since_ns, start_ns "
                                        "FROM heartbeat WHERE run_id = 'hang' ORDER BY start_ns").to_pylist()
        yield out
    finally:
        c.stop()


def test_straggler_alert_names_rank_3_within_3_steps_and_no_victim(live):
    strag = [a for a in live["strag_alerts"] if a["signal"] == "straggler"]
    assert [a["rank"] for a in strag] == [3], json.dumps(strag, default=str)[:2000]
    a = strag[0]
    assert STRAGGLER_STEP <= a["first_step"] <= STRAGGLER_STEP + 1
    assert a["fired_step"] <= STRAGGLER_STEP + 2  # within 3 completed steps of the onset
    assert "rank 3" in a["message"] and "straggler" in a["message"] and "ms" in a["message"]
    onset_ns = sql(live["collector"].addr, f"SELECT start_ns FROM step WHERE run_id = 'strag' AND rank = 3 AND "
                                            f"step = {STRAGGLER_STEP}").column(0)[0].as_py()
    print(f"straggler onset -> firing: {(a['fired_ns'] - onset_ns) / 1e9:.1f} s")


def test_hang_names_rank_1_and_its_collective_and_the_others_wait(live):
    stuck = [a for a in live["hang_alerts"] if a["signal"] == "stuck_collective"]
    assert stuck, (live["hang_alerts"], live["hang_beats"][-8:])
    assert {a["rank"] for a in stuck} == {1}, stuck
    a = stuck[0]
    labels = json.loads(a["labels"])
    assert labels["op"] == "all_reduce" and labels["role"], labels
    assert "rank 1 is stuck in all_reduce" in a["message"]
    # the ranks blocked on it are named as waiting, not as culprits
    assert "wait on it" in a["message"] and all(f"{r}" in a["message"].split("wait on it")[0] for r in (0, 2, 3))
    # onset: when rank 1 entered the collective (its own heartbeat says so)
    since = min(b["pending_since_ns"] for b in live["hang_beats"]
                if b["rank"] == 1 and b["pending_op"] == "all_reduce" and b["step"] == HANG_STEP)
    delay_s = (a["fired_ns"] - since) / 1e9
    print(f"hang onset -> firing: {delay_s:.1f} s")
    assert delay_s < 20


def test_live_alerts_equal_recompute(live):
    db, rules = live["collector"].db, live["rules"]
    c = live["collector"]
    stored, cli = live["stored"], live["cli"]
    assert cli.returncode == 0, cli.stderr
    assert len(json.loads(cli.stdout)) >= len(stored)
    # after the collector stops, recompute over the file and compare the step-judged alerts
    c.stop()
    con = connect(str(db), read_only=True)
    try:
        found = recompute(con, parse(rules.read_text()))
    finally:
        con.close()
    again = {(a.rule, a.run_id, json.dumps(dict(a.labels), sort_keys=True), a.first_step)
             for a in found if a.state != "pending" and a.first_step >= 0}
    assert {(r["rule"], r["run_id"], r["labels"], r["first_step"]) for r in stored} == again
    # the timer rules replayed on the heartbeats' clock name the same hung rank and collective
    live_stuck = {(a["rank"], a["labels"]) for a in live["hang_alerts"] if a["signal"] == "stuck_collective"}
    re_stuck = {(int(a.labels["rank"]), json.dumps(dict(a.labels), sort_keys=True))
                for a in found if a.signal == "stuck_collective" and a.state != "pending"}
    assert live_stuck == re_stuck
    cli = subprocess.run([sys.executable, "-m", "tracetop.cli", "alerts", str(db), "--recompute", "--rules", str(rules),
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert any(r["rule"] == "straggler" and r["rank"] == 3 for r in json.loads(cli.stdout))


def _view_vs_live(con, run_id: str) -> int:
    """Replays the run into a LiveState and compares each step's signals with the SQL views."""
    from collector.live.replay import _STEP_KINDS, _columns
    from collector.live.state import LiveState
    from tracetop.events import Kind

    st = LiveState(window=256)
    st.ingest(Kind.RUN_START, run_id, _columns(con, Kind.RUN_START, "run_id = ?", [run_id]), 0)
    for kind in _STEP_KINDS:
        cols = _columns(con, kind, "run_id = ?", [run_id])
        if cols is not None:
            st.ingest(kind, run_id, cols, 1)
    run = st.runs[run_id]
    strag = {(r[0], r[1]): r[2:] for r in con.execute(
        "SELECT step, rank, others_compute_ms, others_wait_ms, compute_ratio, excess_ms, z_compute FROM stragglers "
        "WHERE run_id = ?", [run_id]).fetchall()}
    grad = {r[0]: r[1:] for r in con.execute(
        "SELECT step, grad_sync_ms_p50, grad_sync_ms_p99, comm_share FROM grad_sync WHERE run_id = ?", [run_id]).fetchall()}
    bub = {(r[0], r[1]): r[2:] for r in con.execute(
        "SELECT step, stage, bubble, compute, waiting, transfer, tail, overhead, stage_imbalance FROM bubble_budget "
        "WHERE run_id = ?", [run_id]).fetchall()}
    tput = {r[0]: r[1] for r in con.execute(
        "SELECT step, per_gpu_tokens_per_s FROM step_throughput WHERE run_id = ?", [run_id]).fetchall()}
    mem = {(r[0], r[1]): r[2:] for r in con.execute(
        "SELECT step, rank, used_bytes, budget_bytes FROM memory_headroom WHERE run_id = ?", [run_id]).fetchall()}
    spikes = {r[0]: r[1] for r in con.execute("SELECT step, spike_share FROM loss_spikes WHERE run_id = ?",
                                              [run_id]).fetchall()}
    n = 0
    for step in range(run.newest_step + 1):
        v = judge.step_view(run, step)
        if v is None:
            continue
        f = judge.step_figures(v)
        sc = f.straggler
        for i, rank in enumerate(v.rank):
            want = strag[(step, int(rank))]
            got = (sc.others_compute_ms[i], sc.others_wait_ms[i], sc.compute_ratio[i], sc.excess_ms[i], sc.z_compute[i])
            np.testing.assert_allclose(np.array(got, float), np.array([np.nan if x is None else x for x in want], float),
                                       rtol=1e-9, atol=1e-9)
            n += 1
        np.testing.assert_allclose([f.grad_sync_p50_ms, f.grad_sync_p99_ms, f.comm_share], grad[step], rtol=1e-9)
        assert f.per_gpu_tokens_per_s == pytest.approx(tput[step], rel=1e-9)
        for i, rank in enumerate(v.rank):
            assert (f.memory_used[i], f.memory_budget[i]) == mem[(step, int(rank))]
        want = spikes.get(step)
        assert (f.loss_spike != f.loss_spike and want is None) or f.loss_spike == pytest.approx(want, rel=1e-9)
        for b in f.budgets:
            want = bub[(step, b.stage)]
            np.testing.assert_allclose([b.bubble, b.compute, b.waiting, b.transfer, b.tail, b.overhead, f.imbalance[0]],
                                       want, rtol=1e-9, atol=1e-12)
    return n


def test_each_signal_equals_its_view(live):
    c = live["collector"]
    c.stop()
    con = connect(str(c.db), read_only=True)
    try:
        n = _view_vs_live(con, "strag")
        # the straggler rank is the one the view flags, from the onset on
        flagged = {r[0] for r in con.execute("SELECT DISTINCT rank FROM stragglers WHERE run_id = 'strag' AND "
                                             "is_straggler AND step >= ?", [STRAGGLER_STEP]).fetchall()}
        assert flagged == {3}
        # the straggler's victims wait: its stage peer's collective wait grew by about the injected 150 ms
        w = con.execute("SELECT avg(wait_ms) FILTER (WHERE step >= 21) - avg(wait_ms) FILTER (WHERE step BETWEEN 5 AND 19)"
                        " FROM step_ranks WHERE run_id = 'strag' AND rank = 2").fetchall()[0][0]
        assert w > 75
    finally:
        con.close()
    assert n >= 4 * 25
    assert sg.GRAD_MIN_BYTES == 1024
