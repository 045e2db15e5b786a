"""SVG snapshots of every screen from the committed fixture (pytest-textual-snapshot).

After regenerating the fixture (scripts/make_fixture.py) or changing a screen on purpose, review
and accept the new pictures with `pytest tests/tui/test_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

import pytest

from tests.tui.fixture import FIXTURE, STRAGGLER_FROM_STEP
from tests.tui.pilot import wait_for
from tui.app import TracetopApp
from tui.sources import FileSource

SIZE = (130, 42)


async def _loaded(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.snap is not None, what="the fixture's snapshot")
    await pilot.pause()


@pytest.mark.parametrize("screen,keys", [
    ("overview", ["1"]),
    ("ranks", ["2"]),
    ("pipeline", ["3"]),
    ("collectives", ["4"]),
    ("offload", ["5"]),
    ("gpus", ["6"]),
    ("alerts", ["7"]),
    ("help", ["question_mark"]),
    ("topology", ["8"]),
])
def test_screen(snap_compare, screen: str, keys: list[str]) -> None:
    async def run_before(pilot) -> None:
        await _loaded(pilot)
        for k in keys:
            await pilot.press(k)
        await pilot.pause()

    assert snap_compare(TracetopApp(FileSource(FIXTURE)), terminal_size=SIZE, run_before=run_before)


def test_rank_detail_of_the_straggler(snap_compare) -> None:
    async def run_before(pilot) -> None:
        await _loaded(pilot)
        await pilot.press("2")
        pilot.app.drill(("rank", int(str(pilot.app.query_one("#ranks-side").get_row_at(0)[0]))))  # a Text cell
        await wait_for(pilot, lambda: pilot.app.detail is not None, what="the rank's detail")
        await pilot.pause()

    assert snap_compare(TracetopApp(FileSource(FIXTURE)), terminal_size=SIZE, run_before=run_before)


def test_replay_before_the_injection(snap_compare) -> None:
    async def run_before(pilot) -> None:
        await _loaded(pilot)
        await pilot.press("2")
        pilot.app.goto_step(STRAGGLER_FROM_STEP - 1)
        await wait_for(pilot, lambda: pilot.app.snap.step == STRAGGLER_FROM_STEP - 1, what="the replayed step")
        await pilot.pause()

    assert snap_compare(TracetopApp(FileSource(FIXTURE)), terminal_size=SIZE, run_before=run_before)


def test_error_screen_nothing_answers(snap_compare) -> None:
    from tui.sources import CollectorSource

    async def run_before(pilot) -> None:
        await wait_for(pilot, lambda: pilot.app.error is not None, what="the error screen")
        await pilot.pause()

    app = TracetopApp(CollectorSource("127.0.0.1:9", connect_timeout_s=0.3), retry_s=3600)
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
