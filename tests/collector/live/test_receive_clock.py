"""Heartbeat times on the collector's clock (collector/live/state.py ``receive_clock``): a rank whose
clock is 40 s off, or stepped back, is judged by when its rows arrive, not by what its clock says.
The silence check (`silent_rank`, the engine's own) is run as the collector runs it; the same rows
with the flag off (the ranks' clocks, as a replay of a file uses them) show what it prevents."""

from __future__ import annotations

import numpy as np

from collector.live.engine import Evaluator
from collector.live.rules import parse
from tests.collector.live.test_engine import _run_start
from tracetop.events import Kind

S = 10**9
SILENT = parse('[rule.s]\nsignal = "silent_rank"\nsilent_s_above = 20\n')


def _hb(rank: int, rank_clock_ns: int, step: int, since_ns: int = -1, op: str = "") -> dict:
    return {"rank": np.array([rank], np.int32), "step": np.array([step], np.int64),
            "start_ns": np.array([rank_clock_ns], np.int64), "duration_ns": np.zeros(1, np.int64),
            "phase": (np.zeros(1, np.int32), ("step",)), "pending_op": (np.zeros(1, np.int32), (op,)),
            "pending_role": (np.zeros(1, np.int32), ("dp" if op else "",)),
            "pending_since_ns": np.array([since_ns], np.int64), "hostname": (np.zeros(1, np.int32), ("h",)),
            "pid": np.zeros(1, np.int32)}


def _beat_for(receive_clock: bool, skew_s: float, seconds: int = 60) -> list:
    """Two ranks beat every 5 s for ``seconds`` (collector time); rank 1's clock is ``skew_s`` off."""
    ev = Evaluator(SILENT, window=8, settle_s=0.0)
    ev.state.receive_clock = receive_clock
    t0 = 1_000 * S
    ev.ingest(Kind.RUN_START, "r", _run_start(2), t0)
    fired = []
    for t in range(0, seconds + 1, 5):
        now = t0 + t * S
        ev.ingest(Kind.HEARTBEAT, "r", _hb(0, now, t), now)
        ev.ingest(Kind.HEARTBEAT, "r", _hb(1, now + int(skew_s * S), t), now)
        fired += [(a.rule, a.labels.get("rank"), a.state) for a in ev.evaluate_timer(now + 2 * S)]
    return fired


def test_a_rank_clock_40s_behind_is_not_silent():
    assert _beat_for(True, -40) == []
    # what it prevents: on the rank's own clock it read silent for 40 s while it beat every 5 s
    assert ("s", "1", "firing") in _beat_for(False, -40)


def test_a_rank_clock_40s_ahead_that_stops_is_found_silent_in_time():
    ev = Evaluator(SILENT, window=8, settle_s=0.0)
    ev.state.receive_clock = True
    t0 = 1_000 * S
    ev.ingest(Kind.RUN_START, "r", _run_start(2), t0)
    for t in range(0, 31, 5):
        now = t0 + t * S
        ev.ingest(Kind.HEARTBEAT, "r", _hb(0, now, t), now)
        if t <= 10:  # rank 1 (clock 40 s ahead) dies after t = 10
            ev.ingest(Kind.HEARTBEAT, "r", _hb(1, now + 40 * S, t), now)
    fired = [(a.labels.get("rank"), a.state) for a in ev.evaluate_timer(t0 + 31 * S)]
    # 21 s silent on the collector's clock; on its own clock (40 s ahead) it would read -19 s: never
    assert ("1", "firing") in fired


def test_a_rank_clock_stepped_back_keeps_the_rank_heard():
    ev = Evaluator(SILENT, window=8, settle_s=0.0)
    ev.state.receive_clock = True
    t0 = 1_000 * S
    ev.ingest(Kind.RUN_START, "r", _run_start(2), t0)
    fired = []
    for t in range(0, 61, 5):
        now = t0 + t * S
        ev.ingest(Kind.HEARTBEAT, "r", _hb(0, now, t), now)
        back = -3_600 * S if t >= 20 else 0  # NTP steps rank 1's clock back an hour at t = 20
        ev.ingest(Kind.HEARTBEAT, "r", _hb(1, now + back, t), now)
        fired += [(a.labels.get("rank"), a.state) for a in ev.evaluate_timer(now + 2 * S)]
    assert fired == []
    run = ev.state.runs["r"]
    assert int(run.hb_ns[1]) == t0 + 60 * S and int(run.hb_step[1]) == 60


def test_time_in_a_collective_is_measured_on_the_rank_clock_then_carried_to_the_collectors():
    ev = Evaluator(SILENT, window=8, settle_s=0.0)
    ev.state.receive_clock = True
    t0 = 1_000 * S
    ev.ingest(Kind.RUN_START, "r", _run_start(2), t0)
    skew = 40 * S
    # rank 1 entered an all_reduce 12 s before its heartbeat (its clock), received at t0
    ev.ingest(Kind.HEARTBEAT, "r", _hb(1, t0 + skew, 3, since_ns=t0 + skew - 12 * S, op="all_reduce"), t0)
    run = ev.state.runs["r"]
    assert int(run.hb_since[1]) == t0 - 12 * S and int(run.hb_ns[1]) == t0
