"""The live state is bounded by the run's real world size, and no row a rank sends blinds it.

A real collector (its own process, the built-in rules): one heartbeat claiming rank 65535 in a new
run must not grow it by a window of 65,536 ranks (1 GB before this was bounded: measured as the
process's RSS); one outlier step number (10**12) from a plain loop's Tracer must not make every
later row of the run "too old" (a loss spike after it is still named). The rest judges LiveState
and the Evaluator directly, on column batches built here: refusals counted by reason, the world
size capped, the budget over runs, ended runs evicted; first_failure, unheard_rank and silent_rank
on heartbeats whose times are given."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from collector.live.engine import Evaluator
from collector.live.rules import DEFAULTS_TOML, parse
from collector.live.state import MAX_WORLD, PROVISIONAL_RANKS, LiveState, RunState
from tests.collector.util import sql
from tests.support.services import start_collector
from tests.support.wait import wait_for
from tracetop.events import Kind
from tracetop.wire.shipper import Shipper

S = 10**9


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _ship_heartbeat(addr: str, run_id: str, rank: int, step: int = 1) -> None:
    sh = Shipper(addr, run_id=run_id, rank=rank, flush_interval_s=0.05)
    try:
        sh.record(Kind.HEARTBEAT, rank, step, time.time_ns(), 0, "forward", "", "", -1, "h", 1)
        assert sh.flush(30.0)
    finally:
        sh.close(5.0)


@pytest.mark.slow
def test_one_heartbeat_claiming_rank_65535_does_not_grow_the_collector(tmp_path):
    c = start_collector(tmp_path, listen="unix")
    try:
        # warm: the engine's paths and numpy are in memory before the measure
        _ship_heartbeat(c.addr, "warm", 0)
        wait_for(lambda: sql(c.addr, "SELECT count(*) FROM heartbeat").column(0)[0].as_py() >= 1, 30, "warm row")
        time.sleep(1.5)
        before = _rss_bytes(c.proc.pid)
        for i in range(3):  # three new runs, each one heartbeat of rank 65535
            _ship_heartbeat(c.addr, f"evil{i}", 65535)
        wait_for(lambda: sql(c.addr, "SELECT count(*) FROM heartbeat WHERE rank = 65535").column(0)[0].as_py() >= 3,
                 30, "the three rows stored")
        time.sleep(1.5)  # the engine's thread ingested them (it runs every 0.5 s)
        grown = _rss_bytes(c.proc.pid) - before
        print(f"RSS grew {grown / 2**20:.1f} MiB after 3 heartbeats of rank 65535")
        assert grown < 50 * 2**20, f"the collector grew {grown / 2**20:.0f} MiB"  # was ~1 GB per heartbeat
    finally:
        c.stop()


@pytest.mark.slow
def test_an_outlier_step_number_does_not_blind_the_run(tmp_path):
    """A plain loop's Tracer numbers one step 10**12; a loss spike 20 steps later is still named."""
    from trainer_hooks import Tracer

    c = start_collector(tmp_path, listen="unix")
    try:
        t = Tracer(endpoint=c.addr, run_id="outlier", rank=0, world_size=1, wrap_collectives=False, heartbeat_s=1)
        for n in range(34):
            with t.step(10**12 if n == 5 else n):
                with t.phase("forward"):
                    time.sleep(0.002)
                t.set_loss(2.0 - 0.01 * n + (0.6 if n == 28 else 0.0))
        t.close()

        def spikes():
            return [r for r in sql(c.addr, "SELECT signal, first_step FROM alerts WHERE run_id = 'outlier'").to_pylist()
                    if r["signal"] == "loss_spike"]
        got = wait_for(spikes, 30, "the loss spike at step 28", spikes, every_s=0.5)
        assert [r["first_step"] for r in got] == [28]
    finally:
        c.stop()


# ---------------------------------------------------------------- LiveState / Evaluator directly
def _beats(ranks, ns, phases=None, step=5, ops=None) -> dict:
    n = len(ranks)
    phases = phases or ["forward"] * n
    ops = ops or [""] * n
    pn, on = sorted(set(phases)), sorted(set(ops))
    return {"rank": np.asarray(ranks, np.int32), "step": np.full(n, step, np.int64), "start_ns": np.asarray(ns, np.int64),
            "duration_ns": np.zeros(n, np.int64), "phase": (np.array([pn.index(p) for p in phases], np.int32), pn),
            "pending_op": (np.array([on.index(o) for o in ops], np.int32), on),
            "pending_role": (np.zeros(n, np.int32), ("dp",)), "pending_since_ns": np.asarray(ns, np.int64) - S,
            "hostname": (np.zeros(n, np.int32), ("h",)), "pid": np.zeros(n, np.int32)}


def _run_start(ranks, world: int, ns: int) -> dict:
    n = len(ranks)
    i4 = np.ones(n, np.int32)
    s = (np.zeros(n, np.int32), ("",))
    return {"rank": np.asarray(ranks, np.int32), "step": np.full(n, -1, np.int64), "start_ns": np.full(n, ns, np.int64),
            "duration_ns": np.zeros(n, np.int64), "world_size": np.full(n, world, np.int64), "tp": i4, "pp": i4,
            "dp": i4 * world, "zero_stage": i4, "stage": np.full(n, -1, np.int32), "model_name": s,
            "n_params": np.zeros(n, np.int64), "flops_per_token": np.full(n, np.nan), "peak_flops": np.full(n, np.nan),
            "micro_batch": i4, "micro_batches": i4, "seq_len": i4, "hostname": s, "pid": i4, "ds_config_json": s,
            "meta_json": s}


def test_ranks_outside_the_world_size_are_refused_and_counted():
    st = LiveState(window=64)
    st.ingest(Kind.HEARTBEAT, "new", _beats([65535], [S]), S)
    run = st.runs["new"]
    assert run.ranks == 0 and run.refused == {"rank_before_world_size": 1} and run.nbytes < 2**20
    st.ingest(Kind.HEARTBEAT, "new", _beats([PROVISIONAL_RANKS - 1], [S]), S)  # before a RUN_START: up to 4096
    assert run.ranks == PROVISIONAL_RANKS
    st.ingest(Kind.RUN_START, "small", _run_start([0, 1, 2, 3], 4, S), S)
    small = st.runs["small"]
    st.ingest(Kind.HEARTBEAT, "small", _beats([1, 9, -1], [S, S, S]), S)
    assert small.ranks == 4 and small.refused == {"rank_outside_world": 1, "negative_rank": 1}
    assert small.hb_ns[1] == S
    st.ingest(Kind.RUN_START, "huge", _run_start([0], 10**9, S), S)
    assert st.runs["huge"].world_size == MAX_WORLD and st.runs["huge"].ranks == 1
    assert st.refused()["rank_outside_world"] == 1


def test_the_live_state_budget_holds_over_runs():
    st = LiveState(window=64, max_bytes=64 * 2**20)
    for i in range(8):  # each run: 1000 ranks x 64 steps x ~240 B = 15 MB
        st.ingest(Kind.RUN_START, f"r{i}", _run_start(list(range(1000)), 1000, S), S)
    assert st.nbytes <= 64 * 2**20
    assert st.refused()["live_state_full"] >= 1000


def test_a_world_larger_than_the_budget_is_judged_in_part_and_the_rest_counted():
    st = LiveState(window=64, max_bytes=8 * 2**20)
    st.ingest(Kind.RUN_START, "big", _run_start(list(range(1000)), 1000, S), S)
    run = st.runs["big"]
    fits = 8 * 2**20 // run.bytes_per_rank()  # ~570 ranks of 14 KiB: as many as the budget holds
    assert fits - 2 <= run.ranks <= fits and st.nbytes <= 8 * 2**20
    assert st.refused()["live_state_full"] == 1000 - run.ranks
    assert run.started[:run.ranks].all()  # the ranks it holds are taken, not dropped with the rest


#: a rank's live state over the default 64-step window
_PER_RANK = RunState("x", 64).bytes_per_rank()


def _refused_of_a_world(where: Path, world: int, args: list[str]) -> float:
    """A collector with `args` (metrics on) takes a RUN_START of `world` ranks, then one heartbeat of
    a rank outside the world (refused, counted: committed after the RUN_START, so judged after it).
    The live rows it refused, from /metrics, once that one is counted."""
    from tests.support.services import scrape_metrics

    where.mkdir()
    c = start_collector(where, listen="unix", metrics=True, extra_args=args)
    try:
        sh = Shipper(c.addr, run_id="world", rank=0, flush_interval_s=0.05)
        try:
            sh.record_many(Kind.RUN_START, _run_start(list(range(world)), world, time.time_ns()))
            assert sh.flush(30.0)
        finally:
            sh.close(5.0)
        _ship_heartbeat(c.addr, "world", world + 5)
        port = c.metrics_port
        assert port is not None
        reads: list[float] = []

        def settled() -> bool:  # non-zero, and the same over 2 s (the engine takes its inbox every 0.5 s)
            reads.append(scrape_metrics(port).get("tracetop_live_rows_refused_total", 0))
            return len(reads) > 4 and reads[-1] > 0 and reads[-1] == reads[-5]

        wait_for(settled, 60, "the refused rows counted", lambda: reads[-5:], every_s=0.5)
        return reads[-1]
    finally:
        c.stop()


@pytest.mark.slow
def test_the_memory_cap_bounds_the_live_state_and_metrics_count_the_ranks_not_judged(tmp_path):
    """--memory-cap-mb's live share (collector/app.py memory_budget): at 512 MB it holds ~5,900 ranks
    of a 64-step window, so a RUN_START of 8,192 ranks is taken in part and the rest counted on
    /metrics (with a heartbeat of a rank outside the world, counted in both); at 1,536 MB (the default
    cap's ceiling: 1/8 of RAM, at most that) the same world is taken whole."""
    from collector.app import CollectorConfig, memory_budget

    world = 8192
    small = memory_budget(CollectorConfig("x", memory_cap_mb=512)).live_bytes // _PER_RANK
    assert small < world <= memory_budget(CollectorConfig("x", memory_cap_mb=1536)).live_bytes // _PER_RANK
    got = _refused_of_a_world(tmp_path / "small", world, ["--memory-cap-mb", "512"])
    assert world - small + 1 <= got <= world - small + 3, (got, small)
    assert _refused_of_a_world(tmp_path / "large", world, ["--memory-cap-mb", "1536"]) == 1  # the outside rank alone


def test_an_ended_run_is_evicted_after_a_while():
    ev = Evaluator(parse(DEFAULTS_TOML), window=8, run_end_s=60.0, evict_after_s=300.0)
    ev.ingest(Kind.RUN_START, "done", _run_start([0, 1], 2, 10 * S), 10 * S)
    ev.ingest(Kind.HEARTBEAT, "done", _beats([0, 1], [10 * S, 10 * S], ["closed", "closed"]), 10 * S)
    ev.evaluate_timer(100 * S)
    assert ev.state.runs["done"].ended
    ev.evaluate_timer(200 * S)
    assert "done" in ev.state.runs
    ev.evaluate_timer(400 * S)
    assert "done" not in ev.state.runs and ev.state.evicted == 1


def _fired(changed) -> list[tuple[str, str]]:
    return [(a.signal, a.labels.get("rank", "")) for a in changed if a.state == "firing"]


def test_first_failure_names_the_rank_that_went_first_once():
    """Rank 3 last heard at 10 s; ranks 0-2 (ended by the launcher, no close) last at 11-12 s."""
    ev = Evaluator(parse(DEFAULTS_TOML), window=8, run_end_s=600.0)
    ev.ingest(Kind.RUN_START, "k", _run_start([0, 1, 2, 3], 4, 1 * S), 1 * S)
    ev.ingest(Kind.HEARTBEAT, "k", _beats([0, 1, 2, 3], [12 * S, 11 * S, 12 * S, 10 * S],
                                          ops=["all_reduce", "all_reduce", "all_reduce", ""]), 12 * S)
    fired = []
    for t in range(13, 60):
        fired += _fired(ev.evaluate_timer(t * S))
    assert fired == [("first_failure", "3")]
    a = [x for x in ev.book.all() if x.signal == "first_failure"][0]
    assert a.severity == "critical" and "rank 3 failed first" in a.message and "1.0 s before any other rank" in a.message
    assert "ranks 0, 1, 2 ended without their clean close after it" in a.message


def test_a_rank_silent_while_the_others_beat_is_silent_rank_alone():
    ev = Evaluator(parse(DEFAULTS_TOML), window=8, run_end_s=600.0)
    ev.ingest(Kind.RUN_START, "s", _run_start([0, 1], 2, 1 * S), 1 * S)
    fired = []
    for t in range(2, 80):
        ranks = [0, 1] if t < 10 else ([0] if t < 40 else [])  # rank 1 frozen at 10 s, all gone at 40 s
        if ranks:
            ev.ingest(Kind.HEARTBEAT, "s", _beats(ranks, [t * S] * len(ranks)), t * S)
        fired += _fired(ev.evaluate_timer(t * S))
    assert fired == [("silent_rank", "1")]  # and no first_failure beside it when the run then stops


def test_a_rank_never_heard_while_its_peers_report_is_named():
    ev = Evaluator(parse(DEFAULTS_TOML), window=8, run_end_s=600.0)
    ev.ingest(Kind.RUN_START, "u", _run_start([0, 2, 3], 4, 10 * S), 10 * S)
    fired = []
    for t in range(10, 40):
        ev.ingest(Kind.HEARTBEAT, "u", _beats([0, 2, 3], [t * S] * 3, ops=["all_reduce"] * 3), t * S)
        got = _fired(ev.evaluate_timer(t * S))
        fired += [(x, t) for x in got]
    assert fired == [(("unheard_rank", "1"), 26)]
    a = [x for x in ev.book.all() if x.signal == "unheard_rank"][0]
    assert "rank 1 of 4 was never heard from" in a.message and "ranks 0, 2, 3 wait in all_reduce" in a.message


def _steps(rank: int, steps) -> dict:
    steps = np.asarray(list(steps), np.int64)
    n = len(steps)
    z = np.zeros(n, np.int64)
    return {"rank": np.full(n, rank, np.int32), "step": steps, "start_ns": steps * 10**7 + S, "duration_ns": z + 10**7,
            "data_wait_ns": z, "forward_ns": z, "backward_ns": z, "optimizer_ns": z, "comm_exposed_ns": z,
            "compute_ns": z, "tokens": z, "samples": z, "loss": np.full(n, np.nan),
            "micro_batch": np.full(n, -1, np.int32), "micro_batches": np.full(n, -1, np.int32)}


def test_ranks_shipping_in_turn_more_steps_than_the_window_do_not_re_anchor():
    """Fast steps: one rank's shipment moves the window 100 steps on before the others ship theirs."""
    st = LiveState(window=64)
    st.ingest(Kind.RUN_START, "f", _run_start([0, 1, 2, 3], 4, S), S)
    for base in (0, 100, 200):
        for r in range(4):
            st.ingest(Kind.STEP, "f", _steps(r, range(base, base + 100)), S + base)
    run = st.runs["f"]
    assert run.reanchored == 0 and run.newest_step == 299
    assert run.present[[run.slot_of(s) for s in range(236, 300)]].all()


def test_one_outlier_step_among_four_ranks_re_anchors_at_once():
    st = LiveState(window=64)
    st.ingest(Kind.RUN_START, "o", _run_start([0, 1, 2, 3], 4, S), S)
    for r in range(4):
        st.ingest(Kind.STEP, "o", _steps(r, range(0, 20)), S)
    st.ingest(Kind.STEP, "o", _steps(2, [10**12]), S)
    for s in range(20, 30):
        for r in range(4):
            st.ingest(Kind.STEP, "o", _steps(r, [s]), S)
    run = st.runs["o"]
    assert run.reanchored == 1 and run.newest_step == 29 and run.refused.get("step_outlier", 0) == 0
    # from the third rank's row after the outlier on, every row is in (steps 21..29 complete)
    assert run.present[[run.slot_of(s) for s in range(21, 30)]].all()


def test_one_shipment_holding_an_outlier_step_re_anchors_within_it():
    """One rank's one shipment (a fast plain loop): steps 0-4, 10**12, 6-33 in order."""
    st = LiveState(window=64)
    st.ingest(Kind.STEP, "one", _steps(0, [0, 1, 2, 3, 4, 10**12, *range(6, 34)]), S)
    run = st.runs["one"]
    assert run.newest_step == 33 and run.reanchored == 1 and run.refused == {"step_outlier": 1}
    assert run.present[[run.slot_of(s) for s in (0, 4, 6, 33)], 0].all()


def test_an_outlier_step_is_not_counted_as_a_trillion_skipped_steps():
    ev = Evaluator(parse(DEFAULTS_TOML), window=64, settle_s=0.0)
    ev.ingest(Kind.RUN_START, "o", _run_start([0, 1, 2, 3], 4, S), S)
    for r in range(4):
        ev.ingest(Kind.STEP, "o", _steps(r, range(0, 20)), S)
    ev.evaluate_ready(2 * S, 0.0, final=True)
    ev.ingest(Kind.STEP, "o", _steps(2, [10**12]), 3 * S)
    ev.evaluate_ready(3 * S, 0.0)  # judged while the outlier held the window: a huge skip, for now
    for s in range(20, 30):
        for r in range(4):
            ev.ingest(Kind.STEP, "o", _steps(r, [s]), 4 * S)
    ev.evaluate_ready(5 * S, 0.0, final=True)
    run = ev.state.runs["o"]
    assert run.reanchored == 1 and run.last_judged == 29
    assert ev.stats.steps_skipped < 64, ev.stats.steps_skipped


def _hang_beats(ranks, now_ns: int, step: dict, ops: dict, since_ns: dict) -> dict:
    """One heartbeat per rank at now_ns: its step, the collective it is in and since when."""
    n = len(ranks)
    on = sorted({ops[r] for r in ranks})
    return {"rank": np.asarray(ranks, np.int32), "step": np.asarray([step[r] for r in ranks], np.int64),
            "start_ns": np.full(n, now_ns, np.int64), "duration_ns": np.zeros(n, np.int64),
            "phase": (np.zeros(n, np.int32), ("step",)),
            "pending_op": (np.array([on.index(ops[r]) for r in ranks], np.int32), on),
            "pending_role": (np.zeros(n, np.int32), ("dp",)),
            "pending_since_ns": np.asarray([since_ns[r] for r in ranks], np.int64),
            "hostname": (np.zeros(n, np.int32), ("h",)), "pid": np.zeros(n, np.int32)}


def test_a_hang_heard_every_10_s_is_named_stuck_once_until_it_ends():
    """Rank 1 hangs in a broadcast at 20 s while ranks 0, 2, 3 wait in their all-reduce; every rank
    beats every 10 s (a slower heartbeat than the default 5 s, or late deliveries), the engine ticks
    every 0.5 s, the hang ends at 100 s. Between two heartbeats rank 1 is unheard for longer than half
    the stuck threshold: the alert must not resolve and fire again at every heartbeat."""
    ev = Evaluator(parse(DEFAULTS_TOML), window=8, run_end_s=600.0)
    ranks = [0, 1, 2, 3]
    ev.ingest(Kind.RUN_START, "h", _run_start(ranks, 4, 1 * S), 1 * S)
    changes = []
    for tick in range(2, 240):
        t = tick * S // 2
        if t % (10 * S) == 0:
            hung = 20 * S <= t < 100 * S
            ops = {r: ("broadcast" if r == 1 else "all_reduce") if hung else "" for r in ranks}
            since = {r: (20 * S if r == 1 else 21 * S) if hung else -1 for r in ranks}
            step = {r: 7 if hung else t // S for r in ranks}
            ev.ingest(Kind.HEARTBEAT, "h", _hang_beats(ranks, t, step, ops, since), t)
        changes += [(a.signal, a.labels.get("rank", ""), a.state, t // S) for a in ev.evaluate_timer(t)
                    if a.state != "pending"]
    stuck = [c for c in changes if c[0] == "stuck_collective"]
    assert [c[:3] for c in stuck] == [("stuck_collective", "1", "firing"), ("stuck_collective", "1", "resolved")], changes
    assert 35 <= stuck[0][3] <= 45 and stuck[1][3] >= 100, stuck
    assert not [c for c in changes if c[0] != "stuck_collective" and c[2] == "firing"], changes
