"""Pilot tests: every screen and every binding of the app, on the fixture file (FileSource) and
on a live collector (CollectorSource); the error screens."""

from __future__ import annotations

import shutil

import duckdb
import pytest
from textual.widgets import ContentSwitcher, Tabs

from collector.query import snapshot as snapmod
from tests.support.services import start_collector
from tests.tui.fixture import (
    FIXTURE,
    RUN_ID,
    STRAGGLER_FROM_STEP,
    STRAGGLER_RANK,
    compute_ms,
    last_step,
    raw,
    replay_into,
)
from tests.tui.pilot import table_rows, text_of, wait_for
from tui import core
from tui.app import TracetopApp
from tui.bench import sim
from tui.keys import HELP, SCREEN_IDS
from tui.screens.help import HelpScreen
from tui.sources import CollectorSource, FileSource
from tui.widgets import HeatmapView

SIZE = (150, 48)


def file_app() -> TracetopApp:
    return TracetopApp(FileSource(FIXTURE))


async def opened(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.snap is not None, what="the first snapshot")


async def test_number_keys_tab_and_clicks_switch_screens() -> None:
    app = file_app()
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        for i, sid in enumerate(SCREEN_IDS):
            await pilot.press(str(i + 1))
            assert app.current == sid
            assert app.query_one("#body", ContentSwitcher).current == sid
            assert app.query_one("#tabs", Tabs).active == f"tab-{sid}"
        await pilot.press("tab")
        assert app.current == SCREEN_IDS[0]
        await pilot.press("shift+tab")
        assert app.current == SCREEN_IDS[-1]
        await pilot.click("#tab-pipeline")
        await pilot.pause()
        assert app.current == "pipeline"


async def test_overview_shows_the_run_and_its_straggler() -> None:
    app = file_app()
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        text = text_of(app, "#ov-figures")
        assert f"rank {STRAGGLER_RANK}" in text
        verdict = text_of(app, "#ov-verdict")  # issue 27: a finished run's verdict opens the overview
        assert verdict.startswith("verdict: straggler") and f"rank {STRAGGLER_RANK}" in verdict and "next:" in verdict
        world, tp, pp, dp = raw("SELECT max(world_size), max(tp), max(pp), max(dp) FROM run_start")[0]
        head = text_of(app, "#head")
        assert f"TP{tp} × PP{pp} × DP{dp}" in head and f"{world}/{world} ranks" in head
        assert f"step {last_step()}" in head
        phases = text_of(app, "#ov-phases")
        assert str(last_step()) in phases and "F" in phases


async def test_ranks_heatmap_marks_the_straggler_and_metric_level_keys() -> None:
    app = file_app()
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        await pilot.press("2")
        hm = app.query_one("#heatmap", HeatmapView)
        world = raw("SELECT count(DISTINCT rank) FROM run_start")[0][0]
        assert len(hm.cells) == world
        assert [c.key[1] for c in hm.cells if c.straggler] == [STRAGGLER_RANK]
        assert table_rows(app, "#ranks-side")[0][0] == str(STRAGGLER_RANK)
        assert f"rank {STRAGGLER_RANK}" in text_of(app, "#ranks-status")
        seen = []
        for _ in core.METRIC_ORDER:
            seen.append(app.ranks.metric)
            await pilot.press("m")
        assert seen == list(core.METRIC_ORDER) and app.ranks.metric == "compute"
        await pilot.press("m")  # wait: the straggler waits least
        assert STRAGGLER_RANK in [c.key[1] for c in hm.cells if c.straggler]
        await pilot.press("a")
        assert app.ranks.level == "rank"
        await pilot.press("a")
        assert app.ranks.level == "replica" and all(c.key[0] == "replica" for c in hm.cells)
        await pilot.press("a")
        assert app.ranks.level == "node" and all(c.key[0] == "node" for c in hm.cells)


async def test_enter_drills_down_and_esc_goes_back() -> None:
    app = file_app()
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        await pilot.press("2", "a", "a")  # replica level: a cell per (stage, replica)
        hm = app.query_one("#heatmap", HeatmapView)
        hm.focus()
        target = next(i for i, c in enumerate(hm.cells) if c.worst_rank == STRAGGLER_RANK)
        hm.cursor = 0
        for _ in range(target):
            await pilot.press("right")
        await pilot.press("enter")
        assert app.ranks.drill and all(c.key[0] == "rank" for c in hm.cells)
        assert STRAGGLER_RANK in [c.key[1] for c in hm.cells]
        hm.cursor = next(i for i, c in enumerate(hm.cells) if c.key == ("rank", STRAGGLER_RANK))
        await pilot.press("enter")
        assert app.current == "rank-detail" and app.ranks.detail_rank == STRAGGLER_RANK
        await wait_for(pilot, lambda: app.detail is not None, what="the rank's detail")
        detail = text_of(app, "#detail", width=220)
        assert f"rank {STRAGGLER_RANK}" in detail
        steps = app.detail["steps"].to_pylist()
        assert steps[-1]["step"] == last_step()
        assert steps[-1]["compute_ms"] == pytest.approx(compute_ms(last_step())[STRAGGLER_RANK])
        await pilot.press("escape")
        assert app.current == "ranks" and app.ranks.drill
        await pilot.press("escape")
        assert app.current == "ranks" and not app.ranks.drill


async def test_mouse_click_selects_and_double_click_drills() -> None:
    app = file_app()
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        await pilot.press("2")
        hm = app.query_one("#heatmap", HeatmapView)
        k = next(i for i, c in enumerate(hm.cells) if c.key == ("rank", STRAGGLER_RANK))
        li, pos = hm._cell_pos(k)
        offset = (10 + pos * hm.cell_w + 2, li)
        await pilot.click("#heatmap", offset=offset)
        assert hm.cursor == k
        await pilot.click("#heatmap", offset=offset, times=2)
        await pilot.pause()
        assert app.current == "rank-detail" and app.ranks.detail_rank == STRAGGLER_RANK


async def test_filter_and_sort() -> None:
    app = file_app()
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        await pilot.press("2", "slash")
        await pilot.press(*"stage=1", "enter")
        hm = app.query_one("#heatmap", HeatmapView)
        stage1 = {r for (r,) in raw("SELECT rank FROM run_start WHERE stage = 1")}
        assert {c.key[1] for c in hm.cells} == stage1
        await pilot.press("escape")
        assert len(hm.cells) == raw("SELECT count(DISTINCT rank) FROM run_start")[0][0]
        await pilot.press("s")
        assert app.ranks.sort == "rank"
        assert [r[0] for r in table_rows(app, "#ranks-side")] == sorted((r[0] for r in table_rows(app, "#ranks-side")), key=int)
        await pilot.press("4")
        calls = [int(r[3]) for r in table_rows(app, "#coll-table")]
        await pilot.press("s")
        assert app.coll_sort == "calls"
        calls = [int(r[3]) for r in table_rows(app, "#coll-table")]
        assert calls == sorted(calls, reverse=True)
        await pilot.press("slash", *"all_reduce", "enter")
        assert all("all_reduce" in r[0] for r in table_rows(app, "#coll-table"))


async def test_scrubber_replays_a_step() -> None:
    """`tracetop ui FILE` after the run: scrub back to the step before the injection and forward
    again; each step shows that step's raw values."""
    app = file_app()
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        last = last_step()
        await pilot.press("2")
        await pilot.press("left_square_bracket")
        await wait_for(pilot, lambda: app.snap.step == last - 1, what="step -1")
        await pilot.press("left_curly_bracket")
        await wait_for(pilot, lambda: app.snap.step == last - 11, what="step -10")
        target = STRAGGLER_FROM_STEP - 1
        while app.snap.step != target:
            d = -1 if app.snap.step > target else 1
            want = app.snap.step + d
            await pilot.press("left_square_bracket" if d < 0 else "right_square_bracket")
            await wait_for(pilot, lambda w=want: app.snap.step == w, what=f"step {want}")
        hm = app.query_one("#heatmap", HeatmapView)
        got = {c.key[1]: c.value for c in hm.cells}
        assert got == pytest.approx(compute_ms(target))
        assert STRAGGLER_RANK not in [c.key[1] for c in hm.cells if c.straggler]
        assert f"step {target}" in text_of(app, "#head") and f"step {target:>5}" in text_of(app, "#scrub")
        await pilot.press("right_square_bracket")
        await wait_for(pilot, lambda: app.snap.step == STRAGGLER_FROM_STEP, what="the injection's step")
        assert [c.key[1] for c in hm.cells if c.straggler] == [STRAGGLER_RANK]
        await pilot.press("home")
        first = raw("SELECT min(step) FROM step")[0][0]
        await wait_for(pilot, lambda: app.snap.step == first, what="the first step")
        await pilot.press("end")
        await wait_for(pilot, lambda: app.snap.step == last, what="the last step")
        await pilot.click("#scrub", offset=(len(f" step {last:>5}  {first} "), 0))  # padding 1, then the bar
        await wait_for(pilot, lambda: app.snap.step == first, what="a click on the bar's start")


async def test_pipeline_collectives_offload_gpus_alerts_screens() -> None:
    app = file_app()
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        await pilot.press("3")
        bubbles = text_of(app, "#pipe-bubbles")
        for _stage, rate in raw("SELECT stage, bubble_rate FROM bubble_by_stage WHERE step = ?", [last_step()]):
            assert f"{rate * 100:.1f}%" in bubbles
        assert "stage 0" in text_of(app, "#pipe-gantt")
        await pilot.press("4")
        groups = raw("""SELECT count(*) FROM (SELECT DISTINCT op, role,
                        CASE WHEN bytes > 0 THEN floor(log2(bytes)) ELSE -1 END FROM collective
                        WHERE group_size > 0 AND step BETWEEN ? AND ?)""", [app.snap.header["collectives_lo"], last_step()])
        assert len(table_rows(app, "#coll-table")) == groups[0][0]
        assert "grad-sync p99" in text_of(app, "#coll-grad")
        await pilot.press("5")
        n_off = raw("SELECT count(*) FROM offload")[0][0]
        assert len(table_rows(app, "#off-table")) == min(n_off, 10)
        assert ("no offload transfers" in text_of(app, "#off-rate")) == (n_off == 0)
        await pilot.press("6")
        tiles = text_of(app, "#gpu-tiles")
        for node, gpu in raw("SELECT DISTINCT node, gpu FROM gpu_sample"):
            assert f"node {node}" in tiles and f"GPU{gpu}" in tiles
        await pilot.press("7")
        note = text_of(app, "#al-note")
        assert "read-only" in note
        for key in ("y", "n"):
            before = len(app._notifications)
            await pilot.press(key)
            await pilot.pause()
            assert len(app._notifications) > before
            assert "read-only" in str(list(app._notifications)[-1].message)


async def test_help_lists_every_binding_and_closes() -> None:
    app = file_app()
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        help_text = text_of(app.screen, "#help")
        for b in app.BINDINGS:
            key = b.key
            shown = {"slash": "/", "question_mark": "?", "left_square_bracket": "[", "right_square_bracket": "]",
                     "left_curly_bracket": "{", "right_curly_bracket": "}", "escape": "esc"}.get(key, key)
            if key.isdigit():
                assert f"1 … {len(SCREEN_IDS)}" in help_text
                continue
            assert shown.split("+")[-1] in help_text, f"binding {key} is not in the help"
        assert len(HELP) >= 10
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_quit() -> None:
    app = file_app()
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


async def test_pause_holds_the_live_view(tmp_path) -> None:
    c = start_collector(tmp_path)
    try:
        k = STRAGGLER_FROM_STEP
        replay_into(c.addr, steps=(-1, k))
        app = TracetopApp(CollectorSource(c.addr), interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.snap is not None and app.snap.step == k, what=f"step {k} live")
            assert "[LIVE]" in text_of(app, "#head")
            await pilot.press("p")
            assert "PAUSED" in text_of(app, "#head")
            replay_into(c.addr, steps=(k + 1, last_step()))
            await wait_for(pilot, lambda: app.pending is not None and app.pending.step == last_step(), what="newer data")
            assert app.snap.step == k  # held
            await pilot.press("p")
            assert app.snap.step == last_step() and "PAUSED" not in text_of(app, "#head")
            await pilot.press("2")
            assert [c.key[1] for c in app.query_one("#heatmap", HeatmapView).cells if c.straggler] == [STRAGGLER_RANK]
    finally:
        assert c.stop() == 0, c.text()


async def _error_text(app: TracetopApp) -> str:
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.error is not None, what="the error screen")
        assert app.query_one("#body", ContentSwitcher).current == "error"
        return text_of(app, "#error-text")


async def test_error_screens(tmp_path) -> None:
    text = await _error_text(TracetopApp(CollectorSource("127.0.0.1:9", connect_timeout_s=0.3), retry_s=60))
    assert "nothing answers" in text and "what to do" in text and "tracetop ui FILE.duckdb" in text
    text = await _error_text(TracetopApp(FileSource(FIXTURE, "no-such-run")))
    assert "unknown run" in text and RUN_ID in text
    newer = tmp_path / "newer.duckdb"
    shutil.copyfile(FIXTURE, newer)
    con = duckdb.connect(str(newer))
    con.execute("INSERT INTO schema_meta VALUES (?, 0)", [snapmod.MAX_STORE_VERSION + 1])
    con.close()
    text = await _error_text(TracetopApp(FileSource(newer)))
    assert "newer schema" in text and "upgrade tracetop" in text
    held = tmp_path / "held.duckdb"
    shutil.copyfile(FIXTURE, held)
    c = start_collector(tmp_path, db=held)
    try:
        text = await _error_text(TracetopApp(FileSource(held)))
        assert "held by a running collector" in text and "--collector" in text
    finally:
        assert c.stop() == 0


async def test_only_visible_heatmap_lines_render_at_16k_ranks() -> None:
    app = TracetopApp(sim.SimSource(16384), interval_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snap is not None, what="a simulated snapshot")
        await pilot.press("2", "a")  # rank level: every one of 16,384 ranks a cell
        await pilot.pause(0.3)
        hm = app.query_one("#heatmap", HeatmapView)
        assert len(hm.cells) == 16384 and len(hm.lines) > hm.size.height * 4
        before = hm.lines_rendered
        n = app.snapshots_applied
        await wait_for(pilot, lambda: app.snapshots_applied >= n + 2, what="two more snapshots")
        await pilot.pause(0.2)
        per_refresh = (hm.lines_rendered - before) / (app.snapshots_applied - n)
        assert per_refresh <= hm.size.height * 3, (per_refresh, hm.size.height, len(hm.lines))
        assert [c.key for c in hm.cells if c.straggler] == [("rank", 16384 // 3)]


async def test_alerts_and_actions_fill_in_when_their_tables_exist(tmp_path) -> None:
    """The fixture's own `alerts` (the live engine judged its run while it ran) name the injected
    straggler; a controller proposal added to its `actions` table shows beside them."""
    path = tmp_path / "with_actions.duckdb"
    shutil.copyfile(FIXTURE, path)
    con = duckdb.connect(str(path))
    (message,) = con.execute("SELECT message FROM alerts WHERE rule = 'straggler' AND rank = ? AND state = 'firing'",
                             [STRAGGLER_RANK]).fetchone()
    con.execute("INSERT INTO actions (action_id, run_id, kind, value, state, rule, reason, proposed_ns, updated_ns) "
                "VALUES ('a1', ?, 'micro_batch', 2, 'proposed', 'memory', 'memory above 0.90 of budget', 1, 1)", [RUN_ID])
    con.close()
    app = TracetopApp(FileSource(path))
    async with app.run_test(size=SIZE) as pilot:
        await opened(pilot)
        ov = text_of(app, "#ov-alerts")
        assert "straggler" in ov and f"rank {STRAGGLER_RANK}" in ov and "a1 proposed micro_batch 2" in ov
        await pilot.press("7")
        rows = table_rows(app, "#al-table")
        strag = [r for r in rows if r[2] == "straggler"]
        assert strag and strag[0][0].endswith("FIRING") and message[:40] in strag[0][4]
        assert table_rows(app, "#ac-table")[0][:2] == ["a1", "proposed"]
