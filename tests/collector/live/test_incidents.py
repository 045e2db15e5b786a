"""Incidents (issue 22): a fault opens one incident naming the culprit and the cause; the SLA
breaches of the same steps it explains, a hang's waiters and other ranks' memory alerts are its
consequences. Driven through the real Evaluator (live state, judge, the built-in rules) with
column batches built here, and stored through alert_row into a real DuckDB file (schema 12:
kind, incident_id, the incidents view); older files still open and read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from collector.ingest import schema
from collector.ingest.schema import open_store
from collector.live.engine import ALERT_COLUMNS, AlertBook, Evaluator, alert_row
from collector.live.model import FIRING
from collector.live.rules import RulesError, defaults, parse
from tests.collector.live.test_engine import _run_start
from tracetop.events import Kind

RANKS = 4


def _step(step: int, compute_ms, data_ms, wait_ms) -> tuple[dict, dict]:
    """A plain DDP step: compute, data wait, then the gradient all-reduce (exposed), per rank."""
    n = RANKS
    compute, data, wait = (np.asarray(x, float) * 1e6 for x in (compute_ms, data_ms, wait_ms))
    dur = (compute + data + wait).astype(np.int64)
    z = np.zeros(n, np.int64)
    start = np.full(n, step * 10**9, np.int64)
    st = {"rank": np.arange(n, dtype=np.int32), "step": np.full(n, step, np.int64), "start_ns": start,
          "duration_ns": dur, "data_wait_ns": data.astype(np.int64), "forward_ns": compute.astype(np.int64),
          "backward_ns": z, "optimizer_ns": z, "comm_exposed_ns": wait.astype(np.int64),
          "compute_ns": compute.astype(np.int64), "tokens": np.full(n, 1024, np.int64), "samples": np.full(n, 32, np.int64),
          "loss": np.full(n, np.nan), "micro_batch": np.full(n, 8, np.int32), "micro_batches": np.full(n, 1, np.int32)}
    co = {"rank": np.arange(n, dtype=np.int32), "step": np.full(n, step, np.int64), "start_ns": start,
          "duration_ns": wait.astype(np.int64), "op": (np.zeros(n, np.int32), ("all_reduce",)),
          "role": (np.zeros(n, np.int32), ("dp",)), "group_size": np.full(n, n, np.int32),
          "bytes": np.full(n, 1 << 20, np.int64), "peer": np.full(n, -1, np.int32),
          "dtype": (np.zeros(n, np.int32), ("float32",)), "is_async": np.zeros(n, np.int32)}
    return st, co


def _memory(step: int, used_mb: float, budget_mb: float) -> dict:
    n = RANKS
    return {"rank": np.arange(n, dtype=np.int32), "step": np.full(n, step, np.int64),
            "start_ns": np.full(n, step * 10**9, np.int64), "duration_ns": np.zeros(n, np.int64),
            "allocated_bytes": np.full(n, int(used_mb * 2**20), np.int64), "reserved_bytes": np.zeros(n, np.int64),
            "rss_bytes": np.zeros(n, np.int64), "peak_bytes": np.full(n, int(used_mb * 2**20), np.int64),
            "budget_bytes": np.full(n, int(budget_mb * 2**20), np.int64)}


def _drive(rules, steps: int, shape) -> Evaluator:
    """Feed `steps` steps of shape(step) -> (compute, data, wait[, memory MiB]) and judge each."""
    ev = Evaluator(rules, window=16, settle_s=0.0)
    ev.ingest(Kind.RUN_START, "r", _run_start(RANKS), 0)
    for s in range(steps):
        compute, data, wait, *mem = shape(s)
        st, co = _step(s, compute, data, wait)
        now = (s + 1) * 10**9
        ev.ingest(Kind.COLLECTIVE, "r", co, now)
        if mem:
            ev.ingest(Kind.MEMORY, "r", _memory(s, mem[0], 700), now)
        ev.ingest(Kind.STEP, "r", st, now)
        ev.evaluate_ready(now + 1, 0.0)
    return ev


def _data_stall(s: int):
    """rank 2's data loader takes 400 ms from step 6; the others wait for it in the all-reduce."""
    slow = s >= 6
    return ([50] * 4, [5, 5, 400 if slow else 5, 5], [420 if slow else 5] * 2 + [10] + [420 if slow else 5])


@pytest.fixture(scope="module")
def stall() -> Evaluator:
    return _drive(defaults(), 20, _data_stall)


def test_incident_data_stall_takes_grad_sync_and_comm_share_as_consequences(stall, tmp_path):
    alerts = [a for a in stall.book.all() if a.state == FIRING]
    by_rule = {a.rule: a for a in alerts}
    assert {"data_stall", "grad_sync", "comm_share"} <= set(by_rule), [a.rule for a in alerts]
    cause = by_rule["data_stall"]
    assert cause.kind == "fault" and cause.labels["rank"] == "2" and cause.incident_id == cause.id
    assert cause.role == "cause"
    for rule in ("grad_sync", "comm_share"):
        a = by_rule[rule]
        assert a.kind == "sla" and a.incident_id == cause.id and a.role == "consequence", a
        assert "an SLA breach, not a fault" in a.message
        assert "a consequence of incident data_stall on rank 2 (cause: data)" in a.message, a.message
    # one incident: every fault alert of the run is its cause or attached to it
    assert {a.incident_id for a in alerts if a.incident_id} == {cause.id}
    (inc, cons), = stall.book.incidents("r")
    assert inc == cause and {a.rule for a in cons} == {"grad_sync", "comm_share"}
    # stored through the engine's row into a real file: the incidents view says the same
    con = open_store(str(tmp_path / "i.duckdb"))
    con.executemany(f"INSERT OR REPLACE INTO alerts VALUES ({', '.join('?' * len(ALERT_COLUMNS))})",
                    [alert_row(a) for a in alerts])
    rows = con.execute("SELECT run_id, rule, cause, rank, consequences, consequence_rules, state, incident_id "
                       "FROM incidents").fetchall()
    assert rows == [("r", "data_stall", "data", 2, 2, ["comm_share", "grad_sync"], "firing", cause.id)]
    kinds = dict(con.execute("SELECT rule, kind FROM alerts").fetchall())
    assert kinds["grad_sync"] == "sla" and kinds["data_stall"] == "fault"
    con.close()


def test_incident_sla_breach_fired_before_its_cause_is_attached_when_the_cause_fires():
    # comm_share holds 1 step, the straggler 5: the SLA breach fires first, standalone, then joins
    rules = parse('[rule.straggler]\nsignal = "straggler"\nexcess_ms_above = 50\nfor_steps = 5\n'
                  '[rule.comm_share]\nsignal = "comm_share"\ncomm_share_above = 0.3\nfor_steps = 1\n')
    book_seen: list = []

    def shape(s):
        slow = s >= 4
        return ([50, 50, 50, 350 if slow else 50], [5] * 4, [310 if slow else 5] * 3 + [10])

    ev = _drive(rules, 12, shape)
    book_seen = {a.rule: a for a in ev.book.firing()}
    strag, comm = book_seen["straggler"], book_seen["comm_share"]
    assert comm.fired_step < strag.fired_step, (comm.fired_step, strag.fired_step)
    assert comm.incident_id == strag.id and strag.incident_id == strag.id and strag.labels["rank"] == "3"


def test_incident_sla_breach_that_began_long_before_the_fault_stays_standalone():
    # exposed communication high from step 0 (a CPU run's ordinary state), a straggler from step 12
    def shape(s):
        slow = s >= 12
        return ([50, 50, 50, 350 if slow else 50], [5] * 4, [320 if slow else 100] * 3 + [10 if slow else 100])

    ev = _drive(defaults(), 22, shape)
    firing = {a.rule: a for a in ev.book.firing()}
    assert firing["comm_share"].first_step < 3 and firing["comm_share"].incident_id == ""
    assert firing["comm_share"].role == "" and firing["comm_share"].kind == "sla"
    assert firing["straggler"].incident_id == firing["straggler"].id


def test_incident_memory_pressure_on_every_rank_is_one_incident():
    ev = _drive(defaults(), 8, lambda s: ([50] * 4, [5] * 4, [5] * 4, 690 if s >= 3 else 300))
    mem = [a for a in ev.book.firing() if a.rule == "memory"]
    assert len(mem) == RANKS
    ids = {a.incident_id for a in mem}
    assert len(ids) == 1 and sum(a.role == "cause" for a in mem) == 1, [(a.labels, a.incident_id) for a in mem]


def test_incident_kind_override_and_its_error():
    (r,) = parse('[rule.s]\nsignal = "straggler"\nexcess_ms_above = 50\nkind = "sla"\n')
    assert r.alert_kind == "sla"
    assert defaults()[0].alert_kind == "fault"
    with pytest.raises(RulesError) as e:
        parse('[rule.s]\nsignal = "straggler"\nexcess_ms_above = 50\nkind = "faults"\n', "r.toml")
    msg = str(e.value)
    assert "r.toml:4: kind:" in msg and "did you mean 'fault'" in msg and "sla" in msg


def test_incident_a_hangs_waiters_join_the_first_hang_named():
    book = AlertBook()
    silent, stuck = (parse(f'[rule.{n}]\nsignal = "{n}"\n{k} = 5\n')[0]
                     for n, k in (("silent_rank", "silent_s_above"), ("stuck_collective", "stuck_s_above")))
    from collector.live.judge import Obs

    book.update(silent, "r", [Obs("rank", {"rank": "1"}, 20, True, "rank 1 silent")], -1, 10**9, True)
    got = book.update(stuck, "r", [Obs("rank", {"rank": "0", "op": "all_reduce", "role": "dp"}, 30, True, "stuck")],
                      -1, 2 * 10**9, True)
    (a,) = got
    cause = book.firing()[0]
    assert cause.rule == "silent_rank" and a.incident_id == cause.id and a.is_consequence


def test_incident_columns_migrate_an_older_file_and_it_still_reads(tmp_path):
    """A schema-11 file: opened read-only it reads as before (no kind column); opened for writing
    it migrates, its rows get their kind and, being from before incidents, stand alone or as causes."""
    path = str(tmp_path / "old.duckdb")
    con = schema.connect(path)
    con.execute("CREATE TABLE schema_meta (version INTEGER NOT NULL, applied_ns BIGINT NOT NULL)")
    for v in range(11):
        for stmt in schema.MIGRATIONS[v]():
            con.execute(stmt)
        post = getattr(schema.MIGRATIONS[v], "post", None)
        if post is not None:
            post(con)
        con.execute("INSERT INTO schema_meta VALUES (?, 0)", [v + 1])
    row = ("grad_sync|r||3", "grad_sync", "grad_sync", "warning", "firing", "r", "run", None, None, None, None, "{}",
           3, 9, 1, 2, 2, 5, 250.0, 200.0, "p99 250 ms")
    row2 = ("straggler|r|rank=3|4", "straggler", "straggler", "warning", "firing", "r", "rank", 3, None, None, None,
            json.dumps({"rank": "3"}), 4, 9, 1, 2, 2, 8, 90.0, 50.0, "rank 3 computes")
    con.executemany(f"INSERT INTO alerts VALUES ({', '.join('?' * 21)})", [row, row2])
    con.close()
    ro = schema.connect(path, read_only=True)
    assert schema.stored_version(ro) == 11 and ro.execute("SELECT count(*) FROM alerts").fetchone()[0] == 2
    ro.close()
    old = _alerts_cli(path)
    assert [r["rule"] for r in old] == ["grad_sync", "straggler"] and "kind" not in old[0]
    con = open_store(path)
    got = dict(((r, (k, i)) for r, k, i in con.execute("SELECT rule, kind, incident_id FROM alerts").fetchall()))
    assert got == {"grad_sync": ("sla", ""), "straggler": ("fault", "straggler|r|rank=3|4")}
    assert con.execute("SELECT rule, cause, consequences FROM incidents").fetchall() == [("straggler", "compute", 0)]
    con.close()
    assert [(r["rule"], r["kind"], r["role"]) for r in _alerts_cli(path)] == [("grad_sync", "sla", ""),
                                                                             ("straggler", "fault", "cause")]
    assert [r["cause_rule"] for r in _alerts_cli(path, "--incidents")] == ["straggler"]


def _alerts_cli(path: str, *args: str) -> list[dict]:
    import subprocess
    import sys

    from tests.support import ROOT

    r = subprocess.run([sys.executable, "-m", "tracetop.cli", "alerts", path, "--json", *args], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
