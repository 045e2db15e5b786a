"""The TUI's screens, one module each (harlequin's components): a pane in the app's body that owns
its widgets, its CSS and its painter.

The app composes the panes into one ContentSwitcher (a pane's id is its screen's id), owns the
workers and the keys, and asks the pane on screen to draw from a `View`; painters only turn a
snapshot into text and table rows with tui/core.py, they do no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rich.text import Text

    from collector.query.snapshot import Snapshot


@dataclass(frozen=True)
class View:
    """What a painter reads: the snapshot on screen and the app's state around it, as plain values."""

    snap: Snapshot
    live: bool                          # a running collector (decisions possible); False: a finished run's file
    filter: str = ""                    # this screen's filter (/), "" for none
    decision_note: Text | None = None   # the answer to the last approve / reject
    detail: dict | None = None          # the drilled-into rank's detail (a worker loads it), None meanwhile
    width: int = 80                     # the terminal's width in cells


class Pane(Protocol):
    """The contract a screen module fulfils: a widget whose id is its screen's id (the body's
    ContentSwitcher shows it by that id) and that redraws itself from a View.

    The app calls `draw` on the pane shown only: on each snapshot while it is shown, and when it is
    shown; the others keep what they last drew."""

    @property
    def id(self) -> str | None: ...

    def draw(self, view: View) -> None: ...
