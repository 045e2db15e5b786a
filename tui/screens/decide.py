"""Approve / reject (y / n, live only): which action a key decides, the confirmation that asks
before anything is sent, and its text. The app runs the flow (a worker sends; the collector's
answer or refusal comes back on screen)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Static

from collector.query import snapshot as snapmod
from tui import core
from tui.screens.overview import newest_proposal
from tui.sources import SourceError

#: The screens y / n decide on.
DECIDING_SCREENS = ("overview", "alerts")

READ_ONLY = SourceError("read-only", "read-only: this is a finished run's file, nothing here sends commands",
                        "approve or reject on the live run (tracetop ui --collector ADDR)")


def pick(what: str, screen: str, snap: snapmod.Snapshot, selected: str | None) -> dict | SourceError | str:
    """The action `what` (approve / reject) would decide on `screen`: the newest proposal on the
    Overview, the `selected` row on Alerts & actions (a core.action_rows row). Else why not: a
    SourceError (a refusal, shown on screen) or a line for a toast."""
    if screen == "overview":
        target = newest_proposal(snap)
        return target if target is not None else "no proposal waiting for a decision"
    rows = {d["id"]: d for d in core.action_rows(snap)}
    if selected is None or selected not in rows:
        return "no action selected (↑ ↓ on the actions table)"
    target = rows[selected]
    if target["state"] != "proposed":
        return SourceError(
            f"cannot {what}", f"action {target['id']} is {target['state']}, not proposed: only a proposal can "
            f"be {'approved' if what == 'approve' else 'rejected'}", "pick a proposed row (↑ ↓)")
    return target


def question(what: str, action: dict) -> Text:
    """The confirmation's text for `what` (approve / reject) on `action` (a core.action_rows row)."""
    q = Text()
    q.append(f"{'Approve' if what == 'approve' else 'Reject'} action {action['id']}?\n\n", style="bold")
    q.append(f"{action['what']}  ({action['why']})\n\n")
    q.append("Approving sends it to every rank of the run at its next step boundary.\n" if what == "approve"
             else "Rejecting drops it: nothing is sent.\n")
    q.append("\ny / enter: yes   n / esc: no", style="bold")
    return q


class ConfirmScreen(ModalScreen[bool]):
    """Asks before an approve / reject is sent: y or enter sends it, n or esc does not."""

    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Static { width: 90; height: auto; border: thick $warning; background: $panel; padding: 1 2; }
    """
    BINDINGS = [Binding("y,enter", "answer(True)", "Send"), Binding("n,escape", "answer(False)", "Cancel")]

    def __init__(self, question: Text) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        yield Static(self.question, id="confirm")

    def action_answer(self, ok: bool) -> None:
        self.dismiss(ok)
