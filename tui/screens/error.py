"""The error screen: what went wrong with the source and what to do (shown until a snapshot comes)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from tui.sources import SourceError


def error_text(e: SourceError, retry_s: float | None) -> Text:
    """The screen's text; `retry_s`: the source is retried every that many seconds (None: it is not)."""
    t = Text()
    t.append(f"✖ {e.title}\n\n", style="bold red")
    t.append(f"{e.message}\n\n")
    t.append("what to do: ", style="bold")
    t.append(f"{e.hint}\n\n")
    t.append("q quits" + (f", retrying every {retry_s:.0f} s" if retry_s is not None else ""), style="dim")
    return t


class ErrorPane(Vertical):
    DEFAULT_CSS = """
    ErrorPane { padding: 2 4; }
    """

    def compose(self) -> ComposeResult:
        yield Static("", id="error-text")

    def show(self, e: SourceError, retry_s: float | None) -> None:
        self.query_one("#error-text", Static).update(error_text(e, retry_s))
