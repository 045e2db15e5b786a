"""tui/core.py: the screens' logic as plain functions, on hand-made data and on the fixture."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from collector.query import snapshot as snapmod
from tests.tui.fixture import (
    RUN_ID,
    STRAGGLER_FROM_STEP,
    STRAGGLER_RANK,
    compute_ms,
    connect_ro,
    last_step,
    raw,
)
from tui import core


def _snap(step: int | None = None) -> snapmod.Snapshot:
    con = connect_ro()
    try:
        return snapmod.build(con, RUN_ID, step=step)
    finally:
        con.close()


def test_robust_z_by_hand() -> None:
    x = np.array([10.0, 11.0, 9.0, 10.0, 30.0])
    # median 10, |x - 10| = 0 1 1 0 20 -> MAD 1, scale 1.4826
    z = core.robust_z(x)
    assert z[4] == pytest.approx(20 / 1.4826)
    assert z[0] == 0.0 and z[1] == pytest.approx(1 / 1.4826)
    # all equal: the 5% floor keeps a 10% deviation at z = 2, not infinity
    z = core.robust_z(np.array([100.0, 100.0, 100.0, 110.0]))
    assert z[3] == pytest.approx(10 / 5.0)
    # NaN stays NaN and does not move the median
    z = core.robust_z(np.array([1.0, np.nan, 1.0, 1.0]))
    assert math.isnan(z[1]) and z[0] == 0


def test_robust_z_within_groups() -> None:
    x = np.array([1.0, 1.0, 1.0, 100.0, 100.0, 100.0])
    g = np.array([0, 0, 0, 1, 1, 1])
    assert np.allclose(core.robust_z(x, g), 0)
    assert core.peer_groups(np.repeat([0, 1], 8)) is not None
    assert core.peer_groups(np.array([0, 0, 1, 1])) is None  # too few peers per stage: the whole run


def test_ideal_bubble_formula() -> None:
    for p, m in [(2, 4), (4, 8), (8, 32)]:
        assert core.ideal_bubble(p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert core.ideal_bubble(1, 8) == 0


def test_straggler_marked_only_once_injected() -> None:
    """The injected rank is the one marked on compute (and on wait: it waits least) from the
    injection's step on; before it, no rank is marked."""
    for step in (STRAGGLER_FROM_STEP, last_step()):
        s = _snap(step)
        assert core.stragglers(core.rank_table(s, "compute")) == [STRAGGLER_RANK]
        assert STRAGGLER_RANK in core.stragglers(core.rank_table(s, "wait"))
    s = _snap(STRAGGLER_FROM_STEP - 3)
    assert STRAGGLER_RANK not in core.stragglers(core.rank_table(s, "compute"))


def test_rank_values_are_the_steps_raw_values() -> None:
    step = STRAGGLER_FROM_STEP + 2
    rt = core.rank_table(_snap(step), "compute")
    expected = compute_ms(step)
    assert {int(r): float(v) for r, v in zip(rt.rank, rt.value)} == pytest.approx(expected)
    worst = core.worst_rows(rt, sort="z", limit=1)[0]
    assert worst[0] == max(expected, key=expected.get) == STRAGGLER_RANK
    assert worst[-2] == "STRAGGLER"


def _synthetic(n_stage: int, n_rep: int, n_tp: int, slow: int) -> core.RankTable:
    n = n_stage * n_rep * n_tp
    rank = np.arange(n)
    stage, rep, tp = rank // (n_rep * n_tp), (rank // n_tp) % n_rep, rank % n_tp
    rng = np.random.default_rng(0)
    value = 100 + rng.normal(0, 1, n)
    value[slow] += 50
    node = np.array([f"n{r // 8}" for r in rank], dtype=object)
    return core.RankTable(rank, stage, rep, tp, node, value, core.robust_z(value, core.peer_groups(stage)), "compute")


def test_heatmap_levels_and_drill_down() -> None:
    rt = _synthetic(4, 16, 8, slow=8 * 16 + 8 * 3 + 5)  # stage 1, replica 3, tp 5
    hm = core.heatmap(rt, "rank")
    assert [len(c) for _, c in hm.groups] == [128] * 4
    assert [c.key for c in hm.cells if c.straggler] == [("rank", 157)]
    rep = core.heatmap(rt, "replica")
    assert len(rep.cells) == 64 and all(c.ranks == 8 for c in rep.cells)
    marked = [c for c in rep.cells if c.straggler]
    assert [(c.key, c.worst_rank) for c in marked] == [(("replica", 1, 3), 157)]
    inner = core.heatmap(rt, "rank", mask=core.drill_mask(rt, marked[0].key))
    assert [c.key[1] for c in inner.cells] == list(range(152, 160))
    nodes = core.heatmap(rt, "node")
    assert len(nodes.cells) == 64 and [c.label for c in nodes.cells if c.straggler] == ["n19"]
    assert core.auto_level(512, 64) == "rank" and core.auto_level(16384, 2048) == "replica"
    assert core.auto_level(16384, 4096) == "node"


def test_cells_carry_a_mark_not_only_colour() -> None:
    rt = _synthetic(2, 2, 2, slow=3)
    cells = core.heatmap(rt, "rank").cells
    slow = next(c for c in cells if c.key == ("rank", 3))
    assert "S" in core.cell_text(slow, "compute", 14) and core.cell_text(slow, "compute", 2)[0] == "S"
    calm = next(c for c in cells if c.key == ("rank", 0))
    assert "S" not in core.cell_text(calm, "compute", 14)
    assert core.z_glyph(0.5) != core.z_glyph(3.5)


def test_filter_terms() -> None:
    rt = _synthetic(4, 4, 2, slow=0)
    assert core.filter_mask(rt, "stage=1").sum() == 8
    assert core.filter_mask(rt, "stage=1 replica=2").sum() == 2
    assert list(rt.rank[core.filter_mask(rt, "7")]) == [7]
    assert core.filter_mask(rt, "z>3").sum() == 1
    assert core.filter_mask(rt, "n1").sum() == 8  # node name substring


def test_pipeline_rows_from_the_fixture() -> None:
    step = last_step()
    s = _snap(step)
    rows = core.bubble_rows(s)
    expect = dict(raw("SELECT stage, bubble_rate FROM bubble_by_stage WHERE run_id = ? AND step = ?", [RUN_ID, step]))
    assert {r.stage: r.rate for r in rows} == pytest.approx(expect)
    pp, m = raw("SELECT max(pp), max(micro_batches) FROM run_start WHERE run_id = ?", [RUN_ID])[0]
    assert all(r.ideal == pytest.approx((pp - 1) / (m + pp - 1)) for r in rows)
    for r in rows:
        assert r.status == core.bubble_status(r.rate)
    span, lines = core.gantt_rows(s, width=60)
    assert [st for st, _, _ in lines] == list(range(pp))
    n_fwd = raw("SELECT count(*) FROM pipe_instr WHERE run_id = ? AND step = ? AND rank = 0 AND instr = 'ForwardPass'",
                [RUN_ID, step])[0][0]
    assert n_fwd == m and "F" in lines[0][2] and "B" in lines[0][2]


def test_bubble_and_grad_sync_status_words() -> None:
    assert core.bubble_status(0.1) == core.OK and core.bubble_status(0.25) == core.WARN
    assert core.bubble_status(0.35) == core.BAD
    t = pa.table({"step": [1, 2], "grad_sync_ms_p99": [150.0, 250.0]})
    series = core.grad_sync_series(snapmod.Snapshot({"step": 2}, {"steps": t}))
    assert [st for _, _, st in series] == [core.OK, core.BAD]


def test_collective_rows_count_the_raw_calls() -> None:
    step = last_step()
    s = _snap(step)
    lo = s.header["collectives_lo"]
    rows = core.collective_rows(s, sort="calls")
    total = raw("SELECT count(*) FROM collective WHERE run_id = ? AND step BETWEEN ? AND ? AND group_size > 0",
                [RUN_ID, lo, step])[0][0]
    assert sum(int(r[3]) for r in rows) == total
    assert [int(r[3]) for r in rows] == sorted((int(r[3]) for r in rows), reverse=True)
    assert all("all_reduce" in r[0] for r in core.collective_rows(s, text="all_reduce"))


def test_overview_figures_from_raw() -> None:
    step = last_step()
    figs = {f.label: f for f in core.overview_figures(_snap(step))}
    p50 = raw("SELECT quantile_cont(duration_ns, 0.5) / 1e6 FROM step WHERE run_id = ? AND step = ?", [RUN_ID, step])[0][0]
    assert figs["step time p50 / max"].value.startswith(core.fmt_num(p50, "ms"))
    assert figs["step"].value == str(step)
    tp, pp, world = raw("SELECT max(tp), max(pp), max(world_size) FROM run_start WHERE run_id = ?", [RUN_ID])[0]
    tps = raw("SELECT sum(tokens_per_s) FROM throughput WHERE run_id = ? AND step = ?", [RUN_ID, step])[0][0]
    assert figs["tokens/s"].value == core.fmt_num(tps / (tp * pp), "", 0)  # each replica's ranks report its tokens
    samples, step_max = raw("SELECT sum(samples), max(duration_ns) / 1e9 FROM step WHERE run_id = ? AND step = ?",
                            [RUN_ID, step])[0]
    assert figs["samples/s per GPU"].value == core.fmt_num(samples / (tp * pp) / step_max / world, "", 2)


def test_gpu_tiles_status() -> None:
    t = pa.table({"node": ["a", "a", "b"], "gpu": [0, 1, 0], "uuid": ["x", "y", "z"], "util_pct": [90.0, 10.0, 50.0],
                  "mem_used_bytes": [1.0, 99.0, 1.0], "mem_total_bytes": [100.0, 100.0, 100.0],
                  "temp_c": [60.0, 60.0, 90.0], "power_mw": [1e5, 1e5, 1e5], "clock_event_reasons": [0.0, 0.0, 8.0],
                  "ecc_uncorrected": [0.0, 0.0, 0.0], "sampled_ns": [1, 1, 1]})
    tiles = core.gpu_tiles(snapmod.Snapshot({}, {"gpus": t}))
    assert [g.status for g in tiles["a"]] == [core.OK, core.WARN]
    assert tiles["b"][0].status == core.BAD and tiles["b"][0].throttle == "HW"
    assert "memory full" in tiles["a"][1].reasons


def test_alert_rows_order_and_words() -> None:
    t = pa.table({"rule": ["a", "b", "c"], "state": ["resolved", "firing", "pending"],
                  "severity": ["warning", "critical", "info"], "labels": ['{"rank":"3"}', "", ""],
                  "message": ["m1", "rank 3 slow", "m3"]})
    rows = core.alert_rows(snapmod.Snapshot({}, {"alerts": t}))
    assert [r[0] for r in rows] == ["FIRING", "PENDING", "RESOLVED"]
    assert rows[0][-1] == core.BAD
    assert core.firing_summary(snapmod.Snapshot({}, {"alerts": t})) == ["critical b : rank 3 slow"]


def test_offload_rows() -> None:
    rate = pa.table({"step": [1, 1, 2], "direction": ["d2h", "h2d", "d2h"], "bytes": [10, 20, 30],
                     "gbps": [1.5, 2.0, 3.0]})
    last = pa.table({"start_ns": [2_000_000_000, 1_000_000_000], "rank": [0, 1], "direction": ["h2nvme", "d2h"],
                     "what": ["optim_state", "grads"], "bytes": [3 * 1024**3, 1024], "duration_ms": [12.5, 0.25]})
    s = snapmod.Snapshot({"step": 2}, {"offload_rate": rate, "offload_last": last})
    assert core.offload_series(s) == {"d2h": [(1, 1.5), (2, 3.0)], "h2d": [(1, 2.0)]}
    rows = core.offload_last_rows(s)
    assert rows[0][0] == "00:00:02.000" and rows[0][2] == "3.0 GiB" and rows[0][3:5] == ("host", "nvme")
    assert rows[1][3:5] == ("device", "host") and rows[1][5] == "grads"


def test_overview_lost_line_names_the_injected_straggler() -> None:
    """lost in the last N: GPU-h, share and rank, from the lost_time text over the fixture's rows."""
    import re

    from collector.query.lost_sql import lost_time_sql
    from tests.tui.fixture import STRAGGLER_FROM_STEP

    step = last_step()
    f = core.lost_figure(_snap(step))
    assert f is not None and f.label.startswith("lost in the last ")
    sql = snapmod.inline(lost_time_sql(bounded=True), {"run": RUN_ID, "lo": 0, "hi": step})
    total_ms, rank3_ms = raw(f"SELECT sum(lost_gpu_ms), sum(lost_gpu_ms) FILTER (WHERE rank = 3) FROM ({sql})")[0]
    assert f.value == f"{total_ms / 3.6e6:.2g} GPU-h"
    assert f.note.startswith(f"{rank3_ms / total_ms:.0%} rank 3") and rank3_ms / total_ms >= 0.8
    before = core.lost_figure(_snap(STRAGGLER_FROM_STEP - 1))
    m = re.match(r"(\d+)% rank (\d+)", before.note)
    assert m and not (m.group(2) == "3" and int(m.group(1)) >= 50), before.note  # not rank 3's before the onset


def test_behind_line_only_while_the_collector_says_it_is_behind():
    Snapshot = snapmod.Snapshot
    assert core.behind_line(Snapshot({"run_id": "r", "step": 3})) == ""
    lag = {"behind_s": 34.2, "oldest_wait_s": 12.34, "streams_held": 6, "rows_not_stored": 693452, "queue_mb": 120.0}
    line = core.behind_line(Snapshot({"run_id": "r", "step": 3, "collector_behind": lag}))
    assert line == ("collector behind 34 s: oldest batch waited 12.3 s, 6 streams held, 693,452 rows not stored "
                    "(gap rows); what is shown is late")
