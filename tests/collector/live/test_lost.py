"""What did it cost: the lost-time definition on hand-computed steps, a simulated 1F1B pipeline, the
same definition in the `lost_time` view over a real DuckDB file, and the [cost] settings."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from collector.ingest.schema import open_store
from collector.live import lost
from collector.live import signals as sg
from collector.live.rules import DEFAULTS_TOML, RulesError, parse_all, parse_cost
from collector.query import lost_sql
from tests.support import ROOT


def _step(compute, *, stage=None, step_ms=None, data=None, fwd_bwd=None, p2p=None, p2p_bytes=None, comm=None,
          pp=1, m=1, gpus=None, baseline=lost.DEFAULT_COMM_BASELINE_SHARE):
    compute = np.asarray(compute, float)
    n = len(compute)
    z = np.zeros(n)
    stage = np.asarray(stage if stage is not None else [-1] * n)
    sc = sg.straggler_scores(stage, compute, z)
    return lost.step_lost(np.arange(n), np.asarray(step_ms if step_ms is not None else [compute.max()] * n, float),
                          compute, sc.others_compute_ms, np.asarray(data if data is not None else z, float),
                          np.asarray(fwd_bwd if fwd_bwd is not None else compute, float),
                          np.asarray(p2p if p2p is not None else z, float),
                          np.asarray(p2p_bytes if p2p_bytes is not None else z, float), 0.0,
                          np.asarray(comm if comm is not None else z, float), pp=pp, micro_batches=m,
                          gpus=gpus or n, comm_baseline_share=baseline)


def test_one_rank_150_ms_slower_loses_150_ms_times_4_ranks_per_step():
    base, slow = 100.0, 150.0
    # every other rank waits the 150 ms in its collectives (plus 10 ms of its own, under the baseline)
    comm = [slow + 10, slow + 10, slow + 10, 10]
    s = _step([base, base, base, base + slow], step_ms=[base + slow + 10] * 4, comm=comm)
    assert s.pacer == 3 and s.late_ms == pytest.approx(slow)
    assert s.straggler_gpu_ms.tolist() == pytest.approx([0, 0, 0, slow * 4])
    assert s.total_gpu_ms == pytest.approx(slow * 4)   # the victims' waits are not counted twice
    assert s.by_cause() == pytest.approx({"straggler": 600.0, "data": 0.0, "pipeline": 0.0, "comm": 0.0})
    assert s.what_if_step_ms == pytest.approx(base + 10)
    # 1000 such steps: 600 GPU-s = 1/6 GPU-hour; priced at 3/GPU-h: 0.50
    book = lost.RunLost()
    for i in range(1000):
        book.add(lost.StepLost(**{**s.__dict__, "step": i, "end_ns": i * 260_000_000}))
    assert lost.gpu_hours(sum(book.gpu_ms.values())) == pytest.approx(1 / 6)
    assert book.top_rank() == (3, pytest.approx(1.0))
    assert lost.CostSettings(price_per_gpu_hour=3.0).money(1 / 6) == pytest.approx(0.5)


def test_balanced_ranks_lose_nothing_and_two_stragglers_cost_the_slower_one():
    assert _step([100.0] * 4).total_gpu_ms == 0
    s = _step([100, 100, 130, 190])
    # the step waits for the slowest; rank 2's 30 ms hide inside rank 3's 90
    assert s.pacer == 3 and s.by_cause()["straggler"] == pytest.approx(90 * 4)


def test_a_data_wait_holds_every_rank_up_once():
    s = _step([100.0] * 4, data=[0, 0, 40, 0], comm=[40, 40, 0, 40], step_ms=[140] * 4)
    assert s.pacer == 2 and s.by_cause() == pytest.approx({"straggler": 0, "data": 160, "pipeline": 0, "comm": 0})


def test_exposed_communication_above_the_baseline_is_lost_on_each_rank():
    # step 200 ms, baseline 25%: 50 ms of exposed comm is expected, 80 ms on rank 1 loses 30
    s = _step([120.0] * 4, step_ms=[200] * 4, comm=[50, 80, 20, 50], baseline=0.25)
    assert s.comm_gpu_ms.tolist() == pytest.approx([0, 30, 0, 0])


def _one_f_one_b(p: int, m: int, fwd_ms: list[float], bwd_ms: list[float]) -> tuple[float, list[float]]:
    """Simulate a 1F1B schedule (each stage: p-s-1 warm-up forwards, then one forward one backward,
    then the cool-down backwards; a forward waits for the previous stage's, a backward for the next
    stage's). Returns (makespan, each stage's idle time)."""
    order = []
    for s in range(p):
        warm = min(p - s - 1, m)
        ops = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                ops.append(("F", f))
                f += 1
            ops.append(("B", b))
            b += 1
        order.append(ops)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    while any(pos[s] < len(order[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] >= len(order[s]):
                continue
            kind, i = order[s][pos[s]]
            dep = (("F", s - 1, i) if s > 0 else None) if kind == "F" else (("B", s + 1, i) if s < p - 1 else ("F", s, i))
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep is not None else 0.0)
            free[s] = done[(kind, s, i)] = start + (fwd_ms[s] if kind == "F" else bwd_ms[s])
            pos[s] += 1
            moved = True
        assert moved, "schedule deadlocked"
    span = max(free)
    return span, [span - m * (fwd_ms[s] + bwd_ms[s]) for s in range(p)]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_a_balanced_pipeline_loses_nothing_beyond_the_ideal_bubble(p, m):
    f, b = 5.0, 10.0
    span, idle = _one_f_one_b(p, m, [f] * p, [b] * p)
    # the simulation is 1F1B: its bubble is the formula's
    assert 1 - m * (f + b) / span == pytest.approx((p - 1) / (m + p - 1))
    compute = [m * (f + b)] * p
    s = _step(compute, stage=list(range(p)), step_ms=[span] * p, p2p=idle, comm=idle, pp=p, m=m)
    assert s.total_gpu_ms == pytest.approx(0.0, abs=1e-9)


def test_a_slow_stage_costs_the_others_their_waiting_above_the_ideal():
    p, m, f, b = 4, 8, 5.0, 10.0
    fwd, bwd = [f] * p, [b] * p
    fwd[2], bwd[2] = 2 * f, 2 * b   # stage 2 computes twice as long
    span, idle = _one_f_one_b(p, m, fwd, bwd)
    compute = [m * (fwd[s] + bwd[s]) for s in range(p)]
    s = _step(compute, stage=list(range(p)), step_ms=[span] * p, p2p=idle, comm=idle, pp=p, m=m)
    ideal = [c * (p - 1) / m for c in compute]
    want = [max(0.0, idle[i] - ideal[i]) for i in range(p)]
    assert s.pipeline_gpu_ms.tolist() == pytest.approx(want)
    assert s.pipeline_gpu_ms[2] == pytest.approx(0.0, abs=1e-9) and s.pipeline_gpu_ms.sum() > 0
    assert s.by_cause()["straggler"] == 0  # one rank a stage: nobody to straggle against


def test_window_keeps_the_last_seconds_of_step_time():
    book = lost.RunLost(window_s=10.0)
    for i in range(100):
        rank = 3 if i >= 50 else 1
        arr = np.zeros(4)
        arr[rank] = 4.0
        book.add(lost.StepLost(i, i * 1_000_000_000, 4, 1000.0, 1.0, 999.0, rank, np.arange(4), arr / 4, arr, *[np.zeros(4)] * 3))
    causes, wall_ms, ranks, span = book.window()
    assert span == pytest.approx(10.0) and len(book.recent) == 11 and wall_ms == pytest.approx(11_000)
    assert lost.top_rank(ranks, sum(causes.values())) == (3, pytest.approx(1.0))
    assert book.top_rank() == (1, pytest.approx(0.5))  # tie: the lower rank


# ------------------------------------------------------------------ the view over a real file

def _file_with_rows(path, rows, *, pp=1, m=1):
    """A real collector file: run_start, step and p2p collective rows written through SQL."""
    con = open_store(str(path))
    n = len(rows)
    for r in range(n):
        con.execute("INSERT INTO run_start (run_id, rank, step, start_ns, duration_ns, world_size, tp, pp, dp, stage, "
                    "micro_batches, hostname) VALUES ('r', ?, -1, 0, 0, ?, 1, ?, ?, ?, ?, ?)",
                    [r, n, pp, n // pp, (r * pp) // n if pp > 1 else -1, m, f"node{r // 2}"])
    for step, ranks in enumerate([rows] * 3):
        for r, (compute, data, fb, p2p, comm, dur) in enumerate(ranks):
            ns = lambda ms: int(ms * 1e6)  # noqa: E731
            con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns, data_wait_ns, forward_ns, "
                        "backward_ns, optimizer_ns, comm_exposed_ns, compute_ns, tokens, samples, micro_batches) "
                        "VALUES ('r', ?, ?, ?, ?, ?, ?, 0, 0, ?, ?, 0, 0, ?)",
                        [r, step, step * 10**9, ns(dur), ns(data), ns(fb), ns(comm), ns(compute), m])
            if p2p:
                con.execute("INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, "
                            "bytes, peer) VALUES ('r', ?, ?, 0, ?, 'recv', 'p2p:pp', 2, 1000, 0)", [r, step, ns(p2p)])
    return con


def test_the_view_gives_the_functions_numbers(tmp_path):
    #        compute data fwd_bwd p2p comm step
    rows = [(100, 0, 90, 30, 160, 260), (100, 5, 90, 60, 150, 260), (250, 0, 240, 5, 10, 260), (100, 0, 90, 2, 150, 260)]
    con = _file_with_rows(tmp_path / "f.duckdb", rows, pp=2, m=4)
    got = con.execute("SELECT step, rank, straggler_gpu_ms, data_gpu_ms, pipeline_gpu_ms, comm_gpu_ms, lost_gpu_ms, "
                      "is_pacer, node, gpus FROM lost_time ORDER BY step, rank").fetchall()
    cols = np.array(rows, float).T
    stage = np.array([0, 0, 1, 1])
    sc = sg.straggler_scores(stage, cols[0], np.zeros(4))
    # p2p bytes 1000 over the step's fastest call (2 ms): 1000 bytes per 2 ms
    want = lost.step_lost(np.arange(4), cols[5], cols[0], sc.others_compute_ms, cols[1], cols[2], cols[3],
                          np.full(4, 1000.0), 1000 / 2.0, cols[4], pp=2, micro_batches=4, gpus=4)
    assert len(got) == 12
    for row in got:
        i = row[1]
        assert row[2:7] == pytest.approx((want.straggler_gpu_ms[i], want.data_gpu_ms[i], want.pipeline_gpu_ms[i],
                                          want.comm_gpu_ms[i], want.lost_gpu_ms[i]), rel=1e-9, abs=1e-9)
        assert row[7] == (i == want.pacer) and row[8] == f"node{i // 2}" and row[9] == 4
    assert want.pacer == 2 and want.by_cause()["straggler"] == pytest.approx(150 * 4)
    # the bounded text the TUI and the report run gives the view's numbers
    bounded = con.execute(lost_sql.lost_time_sql(bounded=True).replace("$run", "'r'").replace("$lo", "1")
                          .replace("$hi", "1") + " ORDER BY rank").fetchall()
    assert [r[-1] for r in bounded] == pytest.approx([r[6] for r in got if r[0] == 1])
    con.close()


def test_defaults_agree():
    assert lost_sql.DEFAULT_COMM_BASELINE_SHARE == lost.DEFAULT_COMM_BASELINE_SHARE
    assert parse_cost(DEFAULTS_TOML) == lost.CostSettings()


# ------------------------------------------------------------------ settings

def test_cost_table_is_validated_with_lines():
    rules, cost = parse_all('[cost]\nprice_per_gpu_hour = 2.5\ncurrency = "EUR"\nwindow_s = 60\n')
    assert cost == lost.CostSettings(price_per_gpu_hour=2.5, currency="EUR", window_s=60.0) and rules == []
    with pytest.raises(RulesError) as e:
        parse_all('[cost]\nprice_per_gpu_hour = 0\ncomm_baseline_share = 1.5\nprice_per_hour = 3\n', "r.toml")
    text = str(e.value)
    assert "r.toml:2: price_per_gpu_hour: 0 is out of range: must be > 0" in text
    assert "r.toml:3: comm_baseline_share: 1.5 is out of range" in text
    assert "r.toml:4: price_per_hour: unknown key in [cost]; did you mean 'price_per_gpu_hour'?" in text
    with pytest.raises(RulesError, match="currency"):
        parse_all('[cost]\ncurrency = 3\n')


def test_price_flag_then_env_then_file():
    file = lost.CostSettings(price_per_gpu_hour=1.0)
    assert lost.with_price(file, None, None).price_per_gpu_hour == 1.0
    assert lost.with_price(file, None, "2.5").price_per_gpu_hour == 2.5
    assert lost.with_price(file, 4.0, "2.5").price_per_gpu_hour == 4.0
    for bad in (-1.0, 0.0, math.inf):
        with pytest.raises(lost.CostError, match="positive number"):
            lost.with_price(file, bad, None)
    with pytest.raises(lost.CostError, match="TRACETOP_PRICE_PER_GPU_HOUR='two' is not a number"):
        lost.with_price(file, None, "two")


def test_collector_refuses_a_bad_price_and_writes_nothing(tmp_path):
    db = tmp_path / "c.duckdb"
    r = subprocess.run([sys.executable, "-m", "tracetop.cli", "collector", "--db", str(db), "--listen",
                        f"unix://{tmp_path / 's'}", "--price-per-gpu-hour", "-2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--price-per-gpu-hour -2.0: a price per GPU-hour must be a positive number" in r.stderr
    assert not db.exists()


def test_cost_per_hour_text():
    # 150 ms x 4 GPUs lost in every 200 ms step: 3 GPUs' worth, 3 GPU-h per hour
    assert lost.cost_per_hour_text(600.0, 200.0, lost.CostSettings()) == "3.00 GPU-h per hour"
    assert lost.cost_per_hour_text(600.0, 200.0, lost.CostSettings(price_per_gpu_hour=2.0)) == \
        "3.00 GPU-h per hour (6.00 USD/h at 2 per GPU-h)"


# ------------------------------------------------------------------ the reference run (the fixture)
# tests/fixtures/straggler_run.duckdb: a real 4-rank PP2 x DP2 run with --inject-straggler 3:150@20,
# recorded by scripts/make_fixture.py (its constants name the injection).
FIXTURE = ROOT / "tests" / "fixtures" / "straggler_run.duckdb"
RUN, RANK, MS, FROM = "fixture-straggler", 3, 150.0, 20


def _fixture_lost(con) -> dict[tuple[int, int], tuple]:
    sql = lost_sql.lost_time_sql(bounded=True)
    rows = con.execute(f"SELECT step, rank, straggler_gpu_ms, data_gpu_ms, pipeline_gpu_ms, comm_gpu_ms, lost_gpu_ms, "
                       f"end_ns FROM ({sql})", {"run": RUN, "lo": 0, "hi": 10**9}).fetchall()
    return {(r[0], r[1]): r[2:] for r in rows}


def test_reference_run_loses_to_rank_3_from_step_20_in_the_view_and_the_live_code():
    from collector.ingest.schema import connect
    from collector.live.engine import Evaluator
    from collector.live.replay import _STEP_KINDS, _columns
    from collector.live.rules import defaults
    from tracetop.events import Kind

    con = connect(str(FIXTURE), read_only=True)
    try:
        view = _fixture_lost(con)
        ev = Evaluator(defaults(), window=256, cost=lost.CostSettings(window_s=1.0, price_per_gpu_hour=2.0))
        ev.ingest(Kind.RUN_START, RUN, _columns(con, Kind.RUN_START, "run_id = ?", [RUN]), 0)
        for kind in _STEP_KINDS:
            cols = _columns(con, kind, "run_id = ? AND step >= 0", [RUN])
            if cols is not None:
                ev.ingest(kind, RUN, cols, 1)
    finally:
        con.close()
    run = ev.state.runs[RUN]
    for step in range(run.newest_step + 1):
        ev.evaluate_step(run, step, 0, 0.0)
    steps = sorted({s for s, _ in view})
    injected = MS * 4  # every one of the 4 GPUs waits the 150 ms
    after = [s for s in steps if s >= FROM]
    before = [s for s in steps if s < FROM]
    total_after = sum(view[(s, r)][4] for s in after for r in range(4))
    rank3_after = sum(view[(s, RANK)][4] for s in after)
    print(f"fixture: from step {FROM} {rank3_after / total_after:.0%} of the lost GPU time is rank 3's "
          f"({rank3_after / len(after):.0f} GPU-ms a step); before, {sum(view[(s, RANK)][4] for s in before) / len(before):.1f}")
    assert rank3_after / total_after >= 0.8
    assert 0.8 * injected <= rank3_after / len(after) <= 1.3 * injected
    assert all(view[(s, RANK)][4] < 0.15 * injected for s in before)  # near zero before the onset
    # the live code's gauges: whole-run sums per cause are the view's; the last second is rank 3's
    g = ev.gauges_by_run[RUN]
    for i, cause in enumerate(lost.CAUSES):
        assert g.lost_gpu_s[cause] == pytest.approx(sum(v[i] for v in view.values()) / 1e3, rel=1e-9, abs=1e-12)
    assert g.lost_top_rank == RANK and g.lost_window_top_rank == RANK and g.lost_window_top_rank_share >= 0.8
    newest = max(v[5] for v in view.values())
    recent = {s for (s, _), v in view.items() if max(view[(s, r)][5] for r in range(4)) >= newest - 1e9}
    assert min(recent) >= FROM
    assert sum(g.lost_window_gpu_s.values()) == pytest.approx(
        sum(v[4] for (s, _), v in view.items() if s in recent) / 1e3, rel=1e-9)
    # the straggler alert's message prices it
    a = next(a for a in ev.book.all() if a.signal == "straggler" and a.labels.get("rank") == str(RANK))
    assert "GPU-h per hour" in a.message and "USD/h at 2 per GPU-h" in a.message


def test_the_window_keeps_a_bounded_number_of_ranks_per_step():
    n = 10_000
    book = lost.RunLost(window_s=1e9)
    rng = np.random.default_rng(1)
    for i in range(50):
        comm = rng.uniform(0, 1, n)
        book.add(lost.StepLost(i, i, n, 100.0, 0.0, 100.0, -1, np.arange(n), np.zeros(n), np.zeros(n), np.zeros(n),
                               np.zeros(n), comm))
    assert all(len(e[3]) <= lost.WINDOW_TOP_RANKS for e in book.recent)
    causes, _, ranks, _ = book.window()
    assert causes["comm"] == pytest.approx(sum(book.gpu_ms.values()))   # the cause sums stay exact
    assert len(ranks) <= lost.WINDOW_TOP_RANKS * 50 and len(book.by_rank) >= n
