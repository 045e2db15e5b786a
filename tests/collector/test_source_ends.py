"""Sources gone without their clean close (collector/ingest/source_ends.py, pure part) and the live
engine's silent-rank judgment of them. Ground truths: the batches fed in (their seqs, the rank and
step of their heartbeats), the injected clock, and which heartbeat says "closed". The end-to-end
form, with real processes killed -9, is tests/collector/test_chaos_rank_kill.py."""

from __future__ import annotations

import time

import numpy as np

from collector.ingest.source_ends import SourceEnds
from collector.live.engine import Evaluator
from collector.live.rules import parse
from tracetop.events import SCHEMAS, Kind
from tracetop.wire.codec import decode_batch, encode_batch

S = 10**9


def _batch(kind: Kind, source: str, seq: int, rank: int = 0, step: int = 0, phase: str = "forward",
           start_ns: int = 1, n: int = 1):
    cols = {}
    for c in SCHEMAS[kind]:
        if c.name == "phase":
            cols[c.name] = [phase] * n
        elif c.dtype == "str":
            cols[c.name] = ["x"] * n
        elif c.name == "rank":
            cols[c.name] = np.full(n, rank)
        elif c.name == "step":
            cols[c.name] = np.full(n, step)
        elif c.name == "start_ns":
            cols[c.name] = np.arange(start_ns, start_ns + n)
        else:
            cols[c.name] = np.zeros(n)
    return decode_batch(encode_batch(kind, cols, source_id=source, seq=seq, run_id="r"))


class Clock:
    def __init__(self) -> None:
        self.ns = 100 * S

    def __call__(self) -> int:
        return self.ns


def test_a_silent_source_without_its_close_gets_one_row_with_its_last_seq() -> None:
    clock = Clock()
    ends = SourceEnds(after_s=5.0, clock_ns=clock)
    ends.on_commit([_batch(Kind.HEARTBEAT, "killed", 3, rank=2, step=7), _batch(Kind.STEP, "killed", 4, rank=2)])
    ends.on_commit([_batch(Kind.HEARTBEAT, "closes", 1, rank=0), _batch(Kind.HEARTBEAT, "closes", 2, phase="closed")])
    ends.on_commit([_batch(Kind.STEP, "loadgen", 9)])  # no heartbeats: not a rank, not watched
    assert ends.tick(clock.ns + 5 * S) == {}  # not yet silent for more than 5 s
    rows = ends.tick(clock.ns + 6 * S)
    assert rows == {"r": [(2, 7, clock.ns, 6 * S, "unknown", 0, "unclosed:last_seq=4", "killed")]}
    assert ends.tick(clock.ns + 60 * S) == {}  # once
    # heard again (an agent's spool delivered it late): a second row says the first no longer stands alone
    clock.ns += 70 * S
    ends.on_commit([_batch(Kind.STEP, "killed", 5, rank=2)])
    assert ends.tick(clock.ns) == {"r": [(2, 7, clock.ns, 0, "unknown", 0, "resumed:seq=5", "killed")]}


def test_its_rows_are_gap_batches_of_the_collectors_own_source() -> None:
    clock = Clock()
    ends = SourceEnds(after_s=1.0, clock_ns=clock)
    ends.on_commit([_batch(Kind.HEARTBEAT, "a", 1, rank=1, step=3), _batch(Kind.HEARTBEAT, "b", 8, rank=3, step=3)])
    [(raw, n)] = list(ends.batches(clock.ns + 2 * S))
    got = decode_batch(raw)
    assert n == 2 and got.kind == Kind.GAP and got.source_id == ends.own_source and got.seq == 1
    reasons = [got.columns["reason"][1][c] for c in got.columns["reason"][0]]
    assert sorted(reasons) == ["unclosed:last_seq=1", "unclosed:last_seq=8"]
    assert got.columns["dropped"].tolist() == [0, 0]  # the rows lost are not known: none is claimed
    ends.on_commit([got])  # its own rows never make it a watched source
    assert list(ends.batches(clock.ns + 99 * S)) == []


RULES = parse("""
[rule.silent_rank]
signal = "silent_rank"
silent_s_above = 3
severity = "critical"
""")


def _beats(phases: list[str], ns: list[int], step: int = 5) -> dict:
    n = len(phases)
    names = sorted(set(phases))
    return {"rank": np.arange(n, dtype=np.int32), "step": np.full(n, step, np.int64), "start_ns": np.asarray(ns),
            "duration_ns": np.zeros(n, np.int64), "phase": (np.array([names.index(p) for p in phases], np.int32), names),
            "pending_op": (np.zeros(n, np.int32), ("",)), "pending_role": (np.zeros(n, np.int32), ("",)),
            "pending_since_ns": np.full(n, -1, np.int64), "hostname": (np.zeros(n, np.int32), ("h",)),
            "pid": np.zeros(n, np.int32)}


def test_silent_rank_names_the_one_that_did_not_close_while_its_peers_closed() -> None:
    ev = Evaluator(RULES, window=8, settle_s=0.0, run_end_s=600.0)
    # rank 1 beat last at 10 s mid-step; ranks 0 and 2 closed at 12 s
    ev.ingest(Kind.HEARTBEAT, "r", _beats(["closed", "forward", "closed"], [12 * S, 10 * S, 12 * S]), 12 * S)
    fired = [a for a in ev.evaluate_timer(30 * S) if a.state == "firing"]
    assert [a.labels["rank"] for a in fired] == ["1"]
    assert "without its clean close, while rank(s) 0, 2 closed" in fired[0].message


def test_a_run_whose_ranks_all_stopped_without_closing_singles_none_out() -> None:
    ev = Evaluator(RULES, window=8, settle_s=0.0, run_end_s=600.0)
    ev.ingest(Kind.HEARTBEAT, "r", _beats(["forward", "forward", "forward"], [10 * S, 10 * S, 10 * S]), 10 * S)
    assert [a for a in ev.evaluate_timer(30 * S) if a.state == "firing"] == []
    # and a run whose ranks all closed is simply over
    ev = Evaluator(RULES, window=8, settle_s=0.0, run_end_s=600.0)
    ev.ingest(Kind.HEARTBEAT, "r", _beats(["closed", "closed"], [10 * S, 11 * S]), 11 * S)
    assert [a for a in ev.evaluate_timer(30 * S) if a.state == "firing"] == []


def test_the_hooks_last_heartbeat_at_a_clean_close_says_closed() -> None:
    from tracetop.wire.transport import MemoryTransport
    from trainer_hooks.tracer import Tracer

    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="c", transport=mem, wrap_collectives=False, heartbeat_s=0.05)
    with tracer.step(0):
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while not len(mem.rows(Kind.HEARTBEAT)["phase"]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert "closed" not in list(mem.rows(Kind.HEARTBEAT)["phase"])  # beats while it runs are not closes
    tracer.close()
    hb = mem.rows(Kind.HEARTBEAT)
    last = int(np.argmax(hb["start_ns"]))
    assert hb["phase"][last] == "closed" and list(hb["phase"]).count("closed") == 1


def test_a_closed_rank_still_counts_for_stuck_collective() -> None:
    """The hung rank ends by its timeout and closes while its peers still wait in their collectives:
    they are waiters, not culprits (stuck_collective keeps the closed rank in its judgment)."""
    stuck = parse("""
[rule.stuck_collective]
signal = "stuck_collective"
stuck_s_above = 3
severity = "critical"
""")
    ev = Evaluator(stuck, window=8, settle_s=0.0, run_end_s=600.0)
    hb = _beats(["closed", "comm", "comm"], [20 * S, 20 * S, 20 * S], step=12)
    hb["pending_op"] = (np.array([0, 1, 1], np.int32), ("", "all_reduce"))
    hb["pending_role"] = (np.array([0, 1, 1], np.int32), ("", "dp"))
    hb["pending_since_ns"] = np.array([-1, 10 * S, 10 * S], np.int64)
    hb["step"] = np.array([13, 12, 12], np.int64)  # rank 0 went on, then ended: 1 and 2 were left behind
    before = Evaluator(stuck, window=8, settle_s=0.0, run_end_s=600.0)
    ev.ingest(Kind.HEARTBEAT, "r", hb, 20 * S)
    # the same heartbeats with rank 0 idle instead of closed: the judgment must be the same
    idle = dict(hb, phase=(np.array([0, 1, 1], np.int32), ("idle", "comm")))
    before.ingest(Kind.HEARTBEAT, "r", idle, 20 * S)
    fired = sorted(a.labels["rank"] for a in ev.evaluate_timer(21 * S) if a.state == "firing")
    assert fired == sorted(a.labels["rank"] for a in before.evaluate_timer(21 * S) if a.state == "firing")
    assert fired == ["1", "2"]


def test_a_source_heard_before_a_collector_restart_that_never_closes_gets_its_row(tmp_path) -> None:
    """A real collector hears a rank's heartbeats and is killed (-9) before the source's silence is
    long enough for its row; the next collector on the file writes the source's unclosed row (it
    used to forget every source heard before it), and a third does not report it again."""
    import json
    import signal
    import subprocess
    import sys

    import duckdb

    from tests.support import ROOT
    from tests.support.services import start_collector
    from tracetop.wire.shipper import Shipper

    db = tmp_path / "c.duckdb"
    sql = "SELECT rank, step, reason FROM gap WHERE run_id = 'restart' AND reason LIKE 'unclosed%'"
    c = start_collector(tmp_path, "unix", db=db, extra_args=["--unclosed-after-s", "600", "--no-rules"])
    s = Shipper(c.addr, run_id="restart", rank=2, flush_interval_s=0.1)
    try:
        for step in range(3):
            s.record(Kind.HEARTBEAT, 2, step, time.time_ns(), 0, "forward", "", "", -1, "h", 7)
            time.sleep(0.2)
        assert s.flush(30.0), "the collector did not ack the heartbeats"
    finally:
        s.close(1.0)
    time.sleep(6.5)  # the watch is saved every 5 s
    c.stop(signal.SIGKILL)
    after = ["--unclosed-after-s", "3", "--no-rules"]
    c2 = start_collector(tmp_path, "unix", db=db, extra_args=after)
    try:
        rows: list = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not rows:
            out = subprocess.run([sys.executable, "-m", "tracetop.cli", "query", "--collector", c2.addr, "--json", sql],
                                 cwd=ROOT, capture_output=True, text=True, timeout=60)
            rows = json.loads(out.stdout or "[]")
            time.sleep(0.5)
        assert len(rows) == 1, f"unclosed rows after the restart: {rows}"
        assert rows[0]["rank"] == 2 and rows[0]["step"] == 2 and rows[0]["reason"].startswith("unclosed:last_seq=")
    finally:
        c2.stop()
    c3 = start_collector(tmp_path, "unix", db=db, extra_args=after)
    time.sleep(3.0)
    c3.stop()
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert len(con.execute(sql).fetchall()) == 1, "reported again by the next collector"
    finally:
        con.close()
