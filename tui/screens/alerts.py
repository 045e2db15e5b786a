"""7 Alerts & actions: the alerts (firing and resolved) and the controller's actions; y / n decide
the selected proposal (the app's decide flow asks this pane which row is selected)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui import core
from tui.screens import View
from tui.widgets import DataTable


class AlertsPane(VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Static("", id="al-note")
        yield DataTable(id="al-table", zebra_stripes=True, cursor_type="row")
        yield DataTable(id="ac-table", zebra_stripes=True, cursor_type="row")

    def on_mount(self) -> None:
        self.query_one("#al-table", DataTable).add_columns("state", "severity", "rule", "where", "message")
        self.query_one("#ac-table", DataTable).add_columns("action", "state", "what", "why")

    def draw(self, view: View) -> None:
        s = view.snap
        note = Text()
        if not s.header.get("has_alerts"):
            note.append("No alerts table in this collector / file: it predates live judgments, so it has no alerts.\n",
                        style="dim")
        if not s.header.get("has_actions"):
            note.append("No actions table: this collector / file predates the controller, so it has no proposals.\n",
                        style="dim")
        groups = core.alert_groups(s)
        incidents = [(h, c) for h, c in groups if h.get("incident_id") and h.get("incident_id") == h.get("id")]
        if incidents:
            sla = sum(1 for h, _ in groups if h.get("kind") == "sla" and not h.get("incident_id"))
            note.append(f"{len(incidents)} incident(s), each its cause first and the alerts it explains under it (└, "
                        f"{sum(len(c) for _, c in incidents)} in all); {sla} SLA breach(es) nothing explains.\n")
        if view.live:
            note.append("y approves / n rejects the selected proposal (after a confirmation).", style="dim")
        else:
            note.append("A finished run's file, read-only: proposals are shown, not decided (approve or reject live).", style="dim")
        if view.decision_note is not None:
            note.append("\n")
            note.append_text(view.decision_note)
        self.query_one("#al-note", Static).update(note)
        t = self.query_one("#al-table", DataTable)
        t.clear()
        for state, *rest, st in core.alert_rows(s, view.filter):
            t.add_row(Text(core.STATUS_MARK[st] + " " + state, style=core.STATUS_STYLE[st]), *rest)
        a = self.query_one("#ac-table", DataTable)
        keep = self.action_under_cursor()  # the row a person selected survives the redraw
        a.clear()
        seen: set[str] = set()
        for d in core.action_rows(s, view.filter):
            if d["id"] in seen:
                continue
            seen.add(d["id"])
            a.add_row(d["id"], d["state"], d["what"], d["why"], key=d["id"])
        if keep is not None and keep in seen:
            a.move_cursor(row=a.get_row_index(keep), animate=False)

    def action_under_cursor(self) -> str | None:
        """The action id of the actions table's cursor row (None when the table is empty)."""
        a = self.query_one("#ac-table", DataTable)
        if a.row_count == 0:
            return None
        try:
            key = a.coordinate_to_cell_key(a.cursor_coordinate).row_key.value
        except Exception:  # the cursor is off the rows (the table is being refilled)
            return None
        return str(key) if key is not None else None
