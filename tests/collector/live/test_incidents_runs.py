"""Incidents on a real run: a plain DDP loop (tests/collector/live/failure_loop.py, gloo, 4 ranks
under torchrun) whose rank 2 loads its data 250 ms slower from step 10, into one real collector
(built-in rules, a webhook to a real receiver), read back through the collector's DuckDB.

One run, shared by every assertion: one incident, its culprit rank 2 and cause data; the SLA
breaches that began on the stall's steps (comm_share, grad_sync, where they fire) are its
consequences; `tracetop alerts --collector` lists it grouped and `--incidents` as one row; the
webhook paged the incident once, its consequences carried with it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from collector.live.engine import SLACK_STEPS
from collector.live.rules import DEFAULTS_TOML
from tests.collector.export.tools import Receiver
from tests.collector.live.judged import wait_judged
from tests.collector.live.test_live_runs import _env
from tests.collector.util import sql
from tests.support import ROOT
from tests.support.services import start_collector
from tests.support.torchrun import launch
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow

LOOP = str(ROOT / "tests" / "collector" / "live" / "failure_loop.py")
RANK, DATA_MS, FROM = 2, 250, 10  # 250 ms of data wait on ~30 ms steps
STEPS = 30


def _alerts(addr: str) -> list[dict]:
    return sql(addr, "SELECT * FROM alerts WHERE run_id = 'stall' ORDER BY first_ns").to_pylist()


def _delivered(rx: Receiver, stored: list[dict]) -> bool:
    """Every stored alert that fired was POSTed firing, with the incident it is stored with."""
    sent = {(a["rule"], json.dumps(a["labels"], sort_keys=True), a["first_ns"], a["incident_id"])
            for b in list(rx.bodies) for a in b["alerts"] if a["state"] == "firing"}
    return all((a["rule"], a["labels"], a["first_ns"], a["incident_id"]) in sent for a in stored if a["fired_ns"])


@pytest.fixture(scope="module")
def stall(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("incidents_run")
    rules = tmp / "rules.toml"
    rules.write_text(DEFAULTS_TOML)
    rx = Receiver()
    c = start_collector(tmp, listen="unix", extra_args=["--rules", str(rules), "--webhook", rx.url], metrics=True)
    try:
        with _env(TRACETOP_ENDPOINT=c.addr, TRACETOP_RUN_ID="stall", TRACETOP_HEARTBEAT_S="1", TRACETOP_FLUSH_S="1"):
            run = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", LOOP,
                          "--steps", str(STEPS), "--slow-data", f"{RANK}:{DATA_MS}@{FROM}"], timeout_s=300)
        assert run.rc == 0, run.output[-3000:]
        # every step judged (the last one settles a second after its rows), then the alerts as stored
        wait_for(lambda: sql(c.addr, "SELECT count(*) FROM alerts WHERE run_id = 'stall' AND rule = 'data_stall'")
                 .column(0)[0].as_py(), 60, "the data stall's alert", lambda: _alerts(c.addr), every_s=0.5)
        wait_judged(c, "stall")
        # ...and each alert fired as stored (with its incident) delivered to the webhook
        wait_for(lambda: _delivered(rx, _alerts(c.addr)), 30, "the webhook's copy of the stored alerts",
                 lambda: (_alerts(c.addr), rx.bodies), every_s=0.2)
        out = {"collector": c, "alerts": _alerts(c.addr), "rx": rx,
               "incidents": sql(c.addr, "SELECT * FROM incidents WHERE run_id = 'stall'").to_pylist()}
        print("incidents run alerts:", [(a["rule"], a["rank"], a["first_step"], a["fired_step"], a["kind"],
                                         "cause" if a["incident_id"] == a["id"] else "consequence" if a["incident_id"]
                                         else "") for a in out["alerts"]])
        yield out
    finally:
        c.stop()
        rx.close()


def test_incident_data_stall_on_a_ddp_run_is_one_incident_naming_rank_2(stall):
    alerts = stall["alerts"]
    faults = [a for a in alerts if a["kind"] == "fault"]
    causes = [a for a in faults if a["incident_id"] == a["id"]]
    assert len(causes) == 1, [(a["rule"], a["rank"], a["incident_id"]) for a in faults]
    cause = causes[0]
    assert cause["rule"] == "data_stall" and cause["rank"] == RANK and cause["first_step"] >= FROM - 1, cause
    # one incident per fault: every other fault alert (if any) belongs to it
    assert {a["incident_id"] for a in faults} == {cause["id"]}, [(a["rule"], a["rank"], a["incident_id"]) for a in faults]
    (inc,) = stall["incidents"]
    assert inc["rank"] == RANK and inc["cause"] == "data" and inc["incident_id"] == cause["id"]


def test_incident_its_sla_breaches_are_consequences_not_causes(stall):
    alerts = stall["alerts"]
    cause = next(a for a in alerts if a["rule"] == "data_stall" and a["incident_id"] == a["id"])
    sla = [a for a in alerts if a["kind"] == "sla"]
    on_stall = [a for a in sla if a["first_step"] >= cause["first_step"] - SLACK_STEPS]
    assert any(a["rule"] in ("comm_share", "grad_sync") for a in on_stall), [(a["rule"], a["first_step"]) for a in sla]
    for a in on_stall:  # began on the stall's steps: attached, and saying so
        assert a["incident_id"] == cause["id"], a
        assert "a consequence of incident data_stall on rank 2 (cause: data)" in a["message"], a["message"]
        assert "an SLA breach, not a fault" in a["message"]
    for a in sla:  # one that began long before the stall (a CPU run's exposed communication) stands alone
        if a not in on_stall:
            assert a["incident_id"] == "", a
    (inc,) = stall["incidents"]
    assert inc["consequences"] == sum(1 for a in alerts if a["incident_id"] == cause["id"] and a["id"] != cause["id"])


def test_incident_tracetop_alerts_groups_and_lists_incidents(stall):
    addr = stall["collector"].addr

    def cli(*args) -> list[dict]:
        r = subprocess.run([sys.executable, "-m", "tracetop.cli", "alerts", "--collector", addr, "--run", "stall",
                            "--json", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    rows = cli()
    roles = [(r["rule"], r["role"]) for r in rows]
    i = roles.index(("data_stall", "cause"))
    n = sum(1 for r in rows if r["role"] == "consequence")
    assert all(role == "consequence" for _, role in roles[i + 1: i + 1 + n]), roles  # right under their cause
    (inc,) = cli("--incidents")
    assert inc["cause_rule"] == "data_stall" and inc["cause"] == "data" and inc["rank"] == RANK
    assert inc["consequences"] == n


def test_incident_webhook_pages_the_incident_once(stall):
    bodies = stall["rx"].bodies
    firing = [(b, a) for b in bodies for a in b["alerts"] if a["state"] == "firing" and a["run_id"] == "stall"]
    causes = [a for _, a in firing if a["role"] == "cause"]
    assert [a["rule"] for a in causes] == ["data_stall"], [(a["rule"], a["role"]) for _, a in firing]
    cid = causes[0]["incident_id"]
    for b, a in firing:
        if a["role"] == "consequence":
            assert a["incident_id"] == cid and any(i["incident_id"] == cid and i["culprit"] == f"rank {RANK}"
                                                   for i in b["incidents"]), b
    # the payloads that page hold a cause or a standalone breach, never consequences alone
    assert all(b["page"] == any(a["role"] != "consequence" for a in b["alerts"]) for b in bodies)
