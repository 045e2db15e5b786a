"""hardware_risk (collector/query/dashboard.py) on fake-NVML traces of degrading and healthy GPUs.

Ten fake GPUs on two nodes are sampled by the agent's own GPUSampler through its NVML funnel
(agent/fake_nvml.py follows pynvml's API) every 10 simulated minutes for 12 h, shipped by a real
Shipper to a real collector. Four degrade (each fails at hour 24 in the story, XID 79), one of them
through corrected ECC errors alone (their rate doubling every 2 h) and a row remap left pending;
six stay healthy, five of them with the noise a healthy fleet has (a single uncorrected ECC error,
SW power capping at 80 °C, a short HW slowdown burst, an application XID 13, corrected ECC errors
and PCIe replays at a flat rate). Ground truth: the degradation the test
wrote. The view is read at hours 4, 8 and 12 (its until_ns), i.e. 20, 16 and 12 h before the
failure: precision and recall at each are printed (docs/dashboard.md quotes them) and asserted at
12 h ahead (the seed's horizon).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import duckdb

from agent.fake_nvml import FakeGPU, FakeNVML
from agent.gpu import GPUSampler, xid_columns
from agent.nvml import NVML
from collector.live import rules as R
from collector.live.replay import recompute
from collector.query import dashboard
from tests.support.services import start_collector
from tracetop.events import Kind
from tracetop.wire.shipper import Shipper

T0 = 1_800_000_000 * 10**9
STEP_S = 600
HOURS = 12
H = 3600 * 10**9
DEGRADING = {("node-7", 3), ("node-7", 1), ("node-8", 2), ("node-7", 4)}


def _state(node: str, gpu: int, h: float, g: FakeGPU) -> list[int]:
    """Set GPU (node, gpu)'s readings at hour h; return the XIDs raised in this interval."""
    g.util_pct, g.temp_c, g.sm_clock_mhz, g.clock_event_reasons, g.power_mw = 90, 62, 1980, 0, 600_000
    xids: list[int] = []
    k = round(h * 3600 / STEP_S)
    if (node, gpu) == ("node-7", 3):  # ECC doubling every 2 h from hour 2, rows remapped from hour 6
        g.ecc_uncorrected = int(2 ** ((h - 2) / 2)) if h >= 2 else 0
        g.remapped_uncorrectable = int((h - 6) / 2) if h >= 6 else 0
    elif (node, gpu) == ("node-7", 1):  # rows remapped every hour from hour 4, a slow ECC rise, XID 63 at 10 h
        g.remapped_correctable = int(h - 4) if h >= 4 else 0
        g.ecc_uncorrected = int(h / 3)
        if k == 10 * 3600 // STEP_S:
            xids.append(63)
    elif (node, gpu) == ("node-8", 2):  # heating up: HW thermal slowdown, clocks falling, ECC from hour 6
        g.temp_c = int(70 + 1.5 * h)
        if h >= 4 and k % 3 == 0:
            g.clock_event_reasons, g.sm_clock_mhz = 0x40 | 0x8, 1200
        g.ecc_uncorrected = int(2 ** ((h - 6) / 3)) if h >= 6 else 0
    elif (node, gpu) == ("node-7", 4):  # corrected ECC errors doubling every 2 h, a row remap pending from hour 9
        g.ecc_corrected = int(4 * 2 ** (h / 2))
        g.remap_pending = h >= 9
    elif (node, gpu) == ("node-8", 0):  # healthy: one ECC error at hour 5, never another; a few corrected ones
        g.ecc_uncorrected = 1 if h >= 5 else 0
        g.ecc_corrected = int(h / 2)
    elif (node, gpu) == ("node-8", 4):  # healthy: corrected ECC errors at a flat ~3/h (jittered), a few PCIe replays
        g.ecc_corrected = int(3 * h) + k % 3
        g.pcie_replays = k // 12
    elif (node, gpu) == ("node-8", 1):  # healthy: SW power cap most of the time, warm
        g.clock_event_reasons, g.temp_c, g.power_mw = 0x4, 80, 700_000
    elif (node, gpu) == ("node-8", 3):  # healthy: a 40-minute HW slowdown burst at hour 7
        if 7 <= h < 7.7:
            g.clock_event_reasons, g.sm_clock_mhz = 0x8, 1400
    elif (node, gpu) == ("node-7", 0) and k == 3 * 3600 // STEP_S:  # healthy: an application's XID 13
        xids.append(13)
    return xids


def _ship(endpoint: str) -> None:
    now = [T0]
    nodes = {n: FakeNVML([FakeGPU() for _ in range(5)]) for n in ("node-7", "node-8")}
    samplers = {}
    for n, fake in nodes.items():
        nvml = NVML(fake)
        nvml.start()
        samplers[n] = GPUSampler(nvml, n, clock_ns=lambda: now[0])
    sh = Shipper(endpoint, run_id="risk-agent", source_id="agent:risk")
    try:
        for k in range(HOURS * 3600 // STEP_S + 1):
            now[0] = T0 + k * STEP_S * 10**9
            for n, fake in nodes.items():
                events = []
                for i, g in enumerate(fake.gpus):
                    events += [(now[0], i, x) for x in _state(n, i, k * STEP_S / 3600, g)]
                gpu, _ = samplers[n].sample()
                sh.record_many(Kind.GPU_SAMPLE, gpu)
                if events:
                    sh.record_many(Kind.XID, xid_columns(n, events))
        assert sh.flush(30.0)
    finally:
        sh.close()


def _scores(db, hours: float) -> tuple[set, float, float, list[dict]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        flagged = dashboard.risky_gpus(con, until_ns=T0 + int(hours * H))
    finally:
        con.close()
    got = {(r["node"], r["gpu"]) for r in flagged}
    tp = len(got & DEGRADING)
    precision = tp / len(got) if got else math.nan
    return got, precision, tp / len(DEGRADING), flagged


def test_degrading_gpus_are_flagged_12h_ahead_healthy_ones_are_not(tmp_path) -> None:
    collector = start_collector(tmp_path, listen="unix")
    try:
        _ship(collector.addr)
    finally:
        assert collector.stop() == 0, collector.text()
    con = duckdb.connect(str(collector.db), read_only=True)
    try:
        dashboard.install(con)
        levels = {(n, g): lv for n, g, lv in con.execute("SELECT node, gpu, level FROM hardware_risk").fetchall()}
    finally:
        con.close()
    assert len(levels) == 10 and all(levels[k] == "fail_likely" for k in DEGRADING), levels
    for hours in (4, 8, 12):
        got, p, r, _ = _scores(collector.db, hours)
        print(f"risk at hour {hours} ({24 - hours} h before failure): flagged {sorted(got)} precision {p:.2f} recall {r:.2f}")
    got, precision, recall, flagged = _scores(collector.db, 12)
    assert (precision, recall) == (1.0, 1.0), flagged
    msg = {(r["node"], r["gpu"]): r["message"] for r in flagged}[("node-7", 3)]
    assert msg.startswith("GPU 3 on node-7: uncorrected ECC errors") and "doubling every" in msg, msg
    assert "rows remapped" in msg and msg.endswith("likely to fail"), msg
    cecc = {(r["node"], r["gpu"]): r for r in flagged}[("node-7", 4)]
    assert cecc["message"].startswith("GPU 4 on node-7: corrected ECC errors doubling every "), cecc["message"]
    assert 1.5 <= cecc["cecc_doubling_h"] <= 2.5, cecc  # the trace's 2 h, read from the two halves' rates
    assert "a row remap pending" in cecc["message"] and cecc["message"].endswith("likely to fail"), cecc
    # each healthy GPU's noise is seen, not judged a failure
    assert levels[("node-8", 0)] == "ok" or levels[("node-8", 0)] == "watch"
    assert levels[("node-8", 4)] == "ok", levels  # corrected errors at a flat rate are not a trend
    assert all(levels[k] != "fail_likely" for k in levels if k not in DEGRADING), levels
    # the live rule (built in: risk points above 3, over the last 12 h of samples) alerted the same
    # four, each with its evidence, as hardware alerts with an incident of their own; no healthy one
    con = duckdb.connect(str(collector.db), read_only=True)
    try:
        alerts = dashboard.rows(con, "SELECT * FROM alerts WHERE signal = 'hardware_risk'", [])
    finally:
        con.close()
    live = {(a["node"], a["gpu"]): a for a in alerts}
    assert set(live) == DEGRADING, alerts
    for a in alerts:
        assert (a["state"], a["kind"], a["rule"]) == ("firing", "hardware", "hardware_risk"), a
        assert a["incident_id"] == a["id"] and a["value"] >= 4, a
    assert live[("node-7", 3)]["message"] == msg, (live[("node-7", 3)], msg)
    assert all(a["message"].endswith("likely to fail") for a in alerts), alerts
    # the post-mortem recompute over the same file judges the rule too, as the live engine's last
    # tick did: the same four GPUs, the same points and words (the file has no steps, GPUs only)
    con = duckdb.connect(str(collector.db), read_only=True)
    try:
        again = [a for a in recompute(con, R.defaults()) if a.state != "pending"]
    finally:
        con.close()
    redo = {(a.labels["node"], int(a.labels["gpu"])): a for a in again if a.rule == "hardware_risk"}
    assert set(redo) == DEGRADING, again
    for k, found in redo.items():
        assert (found.state, found.kind, found.value, found.message) == (
            "firing", "hardware", live[k]["value"], live[k]["message"]), (found, live[k])
    cli = subprocess.run([sys.executable, "-m", "tracetop.cli", "alerts", str(collector.db), "--recompute", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    rows = [r for r in json.loads(cli.stdout) if r["rule"] == "hardware_risk"]
    assert {(json.loads(r["labels"])["node"], int(json.loads(r["labels"])["gpu"])) for r in rows} == DEGRADING, rows
    # the rules it cannot judge from a file are named, not left out silently
    assert "rule ecc is not recomputed" in cli.stderr and "rule collector_behind is not recomputed" in cli.stderr, \
        cli.stderr
