"""Issue 25's item 4: the GPUs screen in a replay shows the GPUs at the step under the cursor.

The fixture's GPU samples are moved to an agent's own run id (`<run>-agent`, as the demo's agent
ships them) and given a utilisation that changes at step 20's end (11% before, 77% after), in a
copy; the app replays it: step 5 shows 11%, step 29 shows 77%, and neither says "no GPU samples"."""

from __future__ import annotations

import shutil

import duckdb

from tests.tui.fixture import FIXTURE, RUN_ID
from tests.tui.pilot import text_of, wait_for
from tui.app import TracetopApp
from tui.sources import FileSource

SIZE = (150, 48)


async def test_replay_shows_the_gpus_at_the_step_under_the_cursor(tmp_path) -> None:
    path = tmp_path / "agent_run_id.duckdb"
    shutil.copyfile(FIXTURE, path)
    con = duckdb.connect(str(path))
    (cut,) = con.execute("SELECT max(start_ns + duration_ns) FROM step WHERE run_id = ? AND step = 20", [RUN_ID]).fetchone()
    con.execute("UPDATE gpu_sample SET run_id = run_id || '-agent', util_pct = CASE WHEN start_ns <= ? THEN 11 ELSE 77 END",
                [cut])
    assert con.execute("SELECT count(*) FROM gpu_sample WHERE run_id = ?", [RUN_ID]).fetchone()[0] == 0
    con.close()
    app = TracetopApp(FileSource(path))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snap is not None, what="the first snapshot")
        await pilot.press("6")
        for step, util in ((5, "11%"), (29, "77%")):
            app.goto_step(step)
            await wait_for(pilot, lambda s=step: app.snap.step == s, what=f"step {step}")
            await pilot.pause()
            shown = text_of(app, "#gpu-tiles")
            assert "no GPU samples" not in shown, shown
            assert "UTL" in shown and util in shown and "°C" in shown, (step, shown)
            assert "risk 0.00 ok" in shown, shown  # the risk line, from the file's agent history
