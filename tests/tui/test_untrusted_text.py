"""What ranks send is data, not markup (issue 23 §5): a collective op, a role, a hostname and an
alert message holding Rich markup (``[/]``, ``[@click=…]``, ``[link=…]``) and terminal control
sequences (an OSC 52 clipboard write, a screen clear) are shown as they were sent, on a copy of the
fixture file. Before: the collectives screen raised MarkupError on ``[/]`` and ``[@click=app.quit]``
was a live action."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb

from tests.tui.fixture import FIXTURE
from tests.tui.pilot import table_rows, wait_for
from tui.app import TracetopApp
from tui.sources import FileSource

SIZE = (150, 48)
OP = "all_reduce[/]"
ROLE = "[@click=app.quit]dp[/]"
HOST = "vm[link=http://example.invalid]x[/link]"
OSC52 = "\x1b]52;c;aGk=\x07"
MESSAGE = f"[bold red]fake[/] {OSC52}\x1b[2J done"


def _poisoned(tmp_path: Path) -> Path:
    db = tmp_path / "poisoned.duckdb"
    shutil.copy(FIXTURE, db)
    con = duckdb.connect(str(db))
    con.execute("UPDATE collective SET op = ?, role = ? WHERE op = 'all_reduce' AND role = 'dp'", [OP, ROLE])
    con.execute("UPDATE run_start SET hostname = ?", [HOST])
    con.execute("UPDATE heartbeat SET hostname = ?", [HOST])
    con.execute("UPDATE alerts SET message = ? WHERE rule = 'straggler'", [MESSAGE])
    con.close()
    return db


async def test_markup_and_escapes_from_ranks_are_shown_as_text(tmp_path: Path) -> None:
    app = TracetopApp(FileSource(_poisoned(tmp_path)))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snap is not None, what="the first snapshot")
        for key in "1234567":
            await pilot.press(key)
            await pilot.pause()
        assert app.is_running  # no MarkupError took it down, no [@click] quit it
        await pilot.press("4")
        await pilot.pause()
        rows = table_rows(app, "#coll-table")
        assert any(r[0] == OP and r[1] == ROLE for r in rows), rows[:3]
        await pilot.press("7")
        await pilot.pause()
        alerts = [" ".join(r) for r in table_rows(app, "#al-table")]
        shown = [a for a in alerts if "[bold red]fake[/]" in a]
        assert shown, alerts
        assert "\x1b" not in shown[0] and "\x07" not in shown[0] and "\ufffd]52;c;aGk=\ufffd" in shown[0]
