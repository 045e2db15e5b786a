"""y / n in the TUI against a real collector: real proposals (Control.Submit PROPOSE without
approval, as the controller makes them in advise mode) approved and rejected from the Alerts &
actions screen and the Overview, the new state read back from the actions table the next Watch
snapshot carries; the refusals (not proposed any more, no control token, an unknown id, a
read-only file) on screen, never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from tests.support.services import start_collector
from tests.tui.fixture import FIXTURE, RUN_ID, replay_into
from tests.tui.pilot import table_rows, text_of, wait_for
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc
from tracetop.wire.auth import ClientAuth
from tui.app import TracetopApp
from tui.screens.decide import ConfirmScreen
from tui.sources import CollectorSource, FileSource, SourceError

SIZE = (150, 48)
INGEST_TOKEN, CONTROL_TOKEN = "ingest-token-for-the-tui-test", "control-token-for-the-tui-test"


def _submit(addr: str, req: pb.ControlRequest, token: str | None = None) -> pb.ControlReply:
    meta = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(addr) as ch:
        return pb_grpc.ControlStub(ch).Submit(req, timeout=30, metadata=meta)


def propose(addr: str, micro_batch: int, token: str | None = None) -> str:
    """A proposal waiting for a person (what the controller does in advise mode)."""
    req = pb.ControlRequest(op=pb.PROPOSE, run_id=RUN_ID, kind=pb.SET_MICRO_BATCH, int_value=micro_batch,
                            by="controller", rule="memory", reason=f"test proposal mb {micro_batch}", approve=False)
    return _submit(addr, req, token).action_id


def state_in_table(app: TracetopApp, action_id: str) -> str | None:
    return next((r[1] for r in table_rows(app, "#ac-table") if r[0] == action_id), None)


async def _select(pilot, app: TracetopApp, action_id: str) -> None:
    table = app.query_one("#ac-table")
    table.focus()
    table.move_cursor(row=table.get_row_index(action_id))
    await pilot.pause(0.3)  # a snapshot or two redraw the table: the selection stays
    assert app._action_under_cursor() == action_id


async def test_approve_and_reject_proposals_from_the_tui(tmp_path: Path) -> None:
    c = start_collector(tmp_path)
    try:
        replay_into(c.addr, steps=(-1, 3))  # the run's RUN_START rows: the collector knows its shape (mb 4 x 4)
        a_ok, a_no, a_raced = propose(c.addr, 2), propose(c.addr, 1), propose(c.addr, 8)
        app = TracetopApp(CollectorSource(c.addr), interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.snap is not None and len(app.snap.table("actions")) == 3,
                           what="the three proposals in a snapshot")
            # Overview: y on the newest proposal; someone else rejects it while the question is open
            assert f"y approves / n rejects proposal {a_raced}" in text_of(app, "#ov-alerts")
            await pilot.press("y")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the confirmation")
            assert f"Approve action {a_raced}?" in text_of(app.screen, "#confirm")
            _submit(c.addr, pb.ControlRequest(op=pb.REJECT, action_id=a_raced, by="person:other"))
            await pilot.press("y")
            await wait_for(pilot, lambda: app.decision_note is not None and "✖" in app.decision_note.plain,
                           what="the collector's refusal")
            ov = text_of(app, "#ov-alerts", width=400)
            assert f"action {a_raced} is dismissed, not proposed" in ov and "nothing was sent" in ov

            # Alerts & actions: approve one row, reject another, each after its confirmation
            await pilot.press("7")
            await wait_for(pilot, lambda: state_in_table(app, a_raced) == "dismissed", what="the raced row dismissed")
            await _select(pilot, app, a_ok)
            await pilot.press("y")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the confirmation")
            await pilot.press("n")  # no: nothing is sent
            await pilot.pause(0.5)
            assert state_in_table(app, a_ok) == "proposed"
            await pilot.press("y")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the confirmation")
            await pilot.press("enter")
            await wait_for(pilot, lambda: state_in_table(app, a_ok) == "approved", what=f"action {a_ok} approved")
            assert f"✔ action {a_ok} approved" in text_of(app, "#al-note", width=400)
            await _select(pilot, app, a_no)
            await pilot.press("n")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the confirmation")
            assert f"Reject action {a_no}?" in text_of(app.screen, "#confirm")
            await pilot.press("y")
            await wait_for(pilot, lambda: state_in_table(app, a_no) == "dismissed", what=f"action {a_no} dismissed")
            # y on a row that is no proposal: refused on screen, no question asked
            await _select(pilot, app, a_ok)
            await pilot.press("y")
            await pilot.pause(0.3)
            assert not isinstance(app.screen, ConfirmScreen)
            assert f"action {a_ok} is approved, not proposed" in text_of(app, "#al-note", width=400)
    finally:
        assert c.stop() == 0, c.text()
    import duckdb  # what the TUI did is what the collector's file holds

    con = duckdb.connect(str(c.db), read_only=True)
    states = dict(con.execute("SELECT action_id, state FROM actions").fetchall())
    by = dict(con.execute("SELECT action_id, approved_by FROM actions").fetchall())
    con.close()
    assert states == {a_ok: "approved", a_no: "dismissed", a_raced: "dismissed"}, states
    assert by[a_ok].startswith("person:")


def _token_file(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    return path


def test_control_token_unknown_id_and_file_refusals(tmp_path: Path) -> None:
    tok, ctl = _token_file(tmp_path / "t", INGEST_TOKEN), _token_file(tmp_path / "c", CONTROL_TOKEN)
    c = start_collector(tmp_path, "unix", extra_args=["--token-file", str(tok), "--control-token-file", str(ctl)])
    try:
        replay_into(c.addr, steps=(-1, 1), token=INGEST_TOKEN)
        aid = propose(c.addr, 2, token=CONTROL_TOKEN)
        ingest_only = CollectorSource(c.addr, auth=ClientAuth(token=INGEST_TOKEN))
        ingest_only.open()
        with pytest.raises(SourceError) as e:
            ingest_only.decide("approve", aid)
        assert e.value.title == "no control token" and "--control-token-file" in e.value.hint
        ingest_only.close()
        # the control token alone serves for the snapshots and the decision
        with_control = CollectorSource(c.addr, control_token=CONTROL_TOKEN)
        with_control.open()
        assert with_control.snapshot_at(None).header["run_id"] == RUN_ID
        with pytest.raises(SourceError) as e:
            with_control.decide("approve", "9999")
        assert e.value.title == "unknown action" and "9999" in e.value.message
        d = with_control.decide("approve", aid)
        assert (d.action_id, d.state) == (aid, "approved")
        with pytest.raises(SourceError) as e:
            with_control.decide("reject", aid)
        assert e.value.title == "cannot reject" and "not proposed" in e.value.message
        with_control.close()
    finally:
        assert c.stop() == 0, c.text()
    with pytest.raises(SourceError) as e:
        FileSource(FIXTURE).decide("approve", "1")
    assert e.value.title == "read-only" and "--collector" in e.value.hint


async def test_a_file_is_read_only() -> None:
    app = TracetopApp(FileSource(FIXTURE))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snap is not None, what="the fixture")
        await pilot.press("7", "y")
        await pilot.pause(0.2)
        assert not isinstance(app.screen, ConfirmScreen)
        assert "read-only" in text_of(app, "#al-note", width=400)
