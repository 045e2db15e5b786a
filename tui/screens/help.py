"""? Help: every key and what it does (tui/keys.py:HELP, the one list)."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Static

from tui.keys import HELP


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: 96; height: auto; border: round $accent; background: $panel; padding: 1 2; }
    """
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        t = Table(title="tracetop keys", show_header=True, expand=True, box=None)
        t.add_column("key", style="bold", no_wrap=True)
        t.add_column("does")
        for k, what in HELP:
            t.add_row(k, what)
        yield Static(t, id="help")

    def on_click(self) -> None:
        self.dismiss()
