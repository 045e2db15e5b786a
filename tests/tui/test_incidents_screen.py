"""The alerts screen groups by incident: the fixture's run judged again by the built-in rules
(collector/live/replay.py, the live engine's code) into a copy migrated to schema 12, opened in the
app: the straggler's incident first, the SLA breaches it explains under it, the standalone ones
after; the overview lists causes, not consequences."""

from __future__ import annotations

import shutil

from collector.ingest.schema import open_store
from collector.live.engine import ALERT_COLUMNS, alert_row
from collector.live.replay import recompute
from collector.live.rules import defaults
from tests.tui.fixture import FIXTURE, RUN_ID, STRAGGLER_RANK
from tests.tui.pilot import table_rows, text_of, wait_for
from tui.app import TracetopApp
from tui.sources import FileSource

SIZE = (150, 48)


async def test_incident_first_its_consequences_grouped_under_it(tmp_path) -> None:
    path = tmp_path / "incidents.duckdb"
    shutil.copyfile(FIXTURE, path)
    con = open_store(str(path))  # migrates the schema-7 fixture: alerts gain kind and incident_id
    found = [a for a in recompute(con, defaults(), runs=[RUN_ID]) if a.state != "pending"]
    con.execute("DELETE FROM alerts")
    con.executemany(f"INSERT INTO alerts VALUES ({', '.join('?' * len(ALERT_COLUMNS))})", [alert_row(a) for a in found])
    stored = con.execute("SELECT rule, kind, incident_id = id, incident_id <> '' AND incident_id <> id FROM alerts"
                         ).fetchall()
    con.close()
    causes = [r for r in stored if r[2]]
    consequences = [r for r in stored if r[3]]
    assert [r[0] for r in causes] == ["straggler"], stored  # one incident: the injected straggler
    assert consequences, stored  # the run's bubble / imbalance breaches it explains
    app = TracetopApp(FileSource(path))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snap is not None, what="the first snapshot")
        await pilot.press("7")
        await pilot.pause()
        rows = table_rows(app, "#al-table")
        rules = [r[2] for r in rows]
        i = next(k for k, r in enumerate(rules) if r.startswith("straggler (incident: compute"))
        assert f"rank={STRAGGLER_RANK}" in rows[i][3]
        under = rules[i + 1: i + 1 + len(consequences)]
        assert sorted(u.removeprefix("  └ ") for u in under) == sorted(r[0] for r in consequences), rules
        assert all(u.startswith("  └ ") for u in under)
        assert not any(r.startswith("  └ ") for r in rules[:i] + rules[i + 1 + len(consequences):]), rules
        assert any("(SLA)" in r for r in rules)  # standalone breaches say what they are
        assert "1 incident(s)" in text_of(app, "#al-note")
        await pilot.press("1")
        await pilot.pause()
        ov = text_of(app, "#ov-alerts")
        assert "straggler (incident: compute" in ov and "└" not in ov
