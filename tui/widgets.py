"""Widgets the screens share, and the app's chrome (the header line and the replay bar).

The Ranks heatmap is a Line-API ScrollView: it renders only the lines on screen (at 16,384 ranks a
refresh costs what the terminal shows, not what the run holds; tests/tui/test_app.py counts them).
The header and the replay bar are drawn by pure helpers from plain values.
"""

from __future__ import annotations

from typing import Any

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import DataTable as _DataTable
from textual.widgets import Input, Static

from collector.query import snapshot as snapmod
from tui import core

#: The replay bar's length in cells (a click at x on it goes to the step at x / (SCRUB_CELLS - 1)).
SCRUB_CELLS = 50


def status_style(status: str) -> Style:
    return Style.parse(core.STATUS_STYLE[status])


# ---- the Ranks heatmap: only visible lines are rendered -----------------------------------------

class HeatmapView(ScrollView, can_focus=True):
    """Cells in groups (one per pipeline stage), wrapped to the width; a cursor cell."""

    DEFAULT_CSS = """
    HeatmapView { height: 1fr; }
    """
    BINDINGS = [
        Binding("up", "move(0,-1)", show=False), Binding("down", "move(0,1)", show=False),
        Binding("left", "move(-1,0)", show=False), Binding("right", "move(1,0)", show=False),
        Binding("enter", "select", "Drill down", show=False),
    ]

    class Selected(Message):
        def __init__(self, cell: core.Cell) -> None:
            super().__init__()
            self.cell = cell

    class Highlighted(Message):
        def __init__(self, cell: core.Cell | None) -> None:
            super().__init__()
            self.cell = cell

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.hm: core.Heatmap | None = None
        self.cells: list[core.Cell] = []
        self.lines: list[tuple[str, Any]] = []  # ("title", text) | ("cells", (first, last))
        self.cell_w = 14
        self.per_line = 1
        self.cursor = 0
        self.lines_rendered = 0  # counts render_line calls (tests check only visible lines render)

    def set_heatmap(self, hm: core.Heatmap) -> None:
        key = self.cells[self.cursor].key if self.cells and self.cursor < len(self.cells) else None
        self.hm = hm
        self.cells = hm.cells
        self.cursor = next((i for i, c in enumerate(self.cells) if c.key == key), min(self.cursor, max(len(self.cells) - 1, 0)))
        self._relayout()

    def _relayout(self) -> None:
        width = max(self.size.width, 20)
        self.cell_w = 14 if len(self.cells) <= 256 else 2
        self.per_line = max(1, (width - 10) // self.cell_w)
        self.lines = []
        i = 0
        for title, cells in (self.hm.groups if self.hm else []):
            self.lines.append(("title", title))
            for a in range(0, len(cells), self.per_line):
                b = min(a + self.per_line, len(cells))
                self.lines.append(("cells", (i + a, i + b)))
            i += len(cells)
        self.virtual_size = Size(width, len(self.lines))
        self.refresh()

    def on_resize(self, event: events.Resize) -> None:
        self._relayout()

    def render_line(self, y: int) -> Strip:
        self.lines_rendered += 1
        idx = self.scroll_offset.y + y
        width = self.size.width
        if idx >= len(self.lines):
            return Strip.blank(width)
        kind, payload = self.lines[idx]
        if kind == "title":
            return Strip([Segment(f" {payload}".ljust(width), Style(bold=True))]).crop(0, width)
        a, b = payload
        segs = [Segment("          ")]
        metric = self.hm.metric if self.hm else "compute"
        for k in range(a, b):
            c = self.cells[k]
            st = status_style(c.status)
            if k == self.cursor:
                st = st + Style(reverse=True)
            segs.append(Segment(core.cell_text(c, metric, self.cell_w), st))
        return Strip(segs).crop(0, width).extend_cell_length(width)

    def _cell_pos(self, k: int) -> tuple[int, int]:
        for li, (kind, payload) in enumerate(self.lines):
            if kind == "cells" and payload[0] <= k < payload[1]:
                return li, k - payload[0]
        return 0, 0

    def action_move(self, dx: int, dy: int) -> None:
        if not self.cells:
            return
        if dy:
            self.cursor = min(max(self.cursor + dy * self.per_line, 0), len(self.cells) - 1)
        else:
            self.cursor = min(max(self.cursor + dx, 0), len(self.cells) - 1)
        li, _ = self._cell_pos(self.cursor)
        top, h = self.scroll_offset.y, max(self.size.height, 1)
        if li < top:
            self.scroll_to(y=max(li - 1, 0), animate=False)
        elif li >= top + h:
            self.scroll_to(y=li - h + 1, animate=False)
        self.refresh()
        self.post_message(self.Highlighted(self.cells[self.cursor]))

    def action_select(self) -> None:
        if self.cells:
            self.post_message(self.Selected(self.cells[self.cursor]))

    def on_click(self, event: events.Click) -> None:
        off = event.get_content_offset(self)
        if off is None:
            return
        li = self.scroll_offset.y + off.y
        if li >= len(self.lines) or self.lines[li][0] != "cells":
            return
        a, b = self.lines[li][1]
        k = a + max(off.x - 10, 0) // self.cell_w
        if a <= k < b:
            if k == self.cursor and event.chain >= 2:
                self.post_message(self.Selected(self.cells[k]))
            self.cursor = k
            self.refresh()
            self.post_message(self.Highlighted(self.cells[k]))


# ---- the chrome: header line and replay bar ------------------------------------------------------

def head_text(snap: snapmod.Snapshot | None, *, description: str, live: bool, paused: bool, note: str) -> Text:
    """The two header lines: the run's shape and health, then mode, source and step (or why there is none)."""
    head = Text()
    if snap is None or snap.header.get("waiting"):
        head.append(f"tracetop · {description} · ", style="bold")
        head.append("no run has started here yet: point the ranks' hooks at it (TRACETOP_ENDPOINT)"
                    if snap is not None else "connecting…")
        return head
    head.append(core.header_line(snap), style="bold")
    head.append("\n")
    mode = "LIVE" if live else "REPLAY"
    head.append(f"[{mode}] ", style="bold green" if mode == "LIVE" else "bold cyan")
    if paused:
        head.append("⏸ PAUSED (p resumes) ", style="bold yellow")
    head.append(f"{description} · step {snap.step}")
    behind = core.behind_line(snap)
    if behind:
        head.append(f" · ‼ {behind}", style="bold red")
    judged = core.judged_line(snap)
    if judged:
        head.append(f" · ⚠ {judged}", style="yellow")
    if note:
        head.append(f" · ⚠ {note}", style="yellow")
    return head


def scrub_prefix(step: int, first_step: int) -> str:
    """What the replay bar shows before its first cell (a click's x counts from after it)."""
    return f"step {step:>5}  {first_step} "


class ScrubBar(Static):
    """The replay bar (a file only): where the shown step lies in the run; a click on it asks for that step."""

    class StepAsked(Message):
        """A click on the bar: show `step`."""

        def __init__(self, step: int) -> None:
            super().__init__()
            self.step = step

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.span: tuple[int, int, int] | None = None  # (step shown, first, last) while the bar is shown

    def show(self, snap: snapmod.Snapshot | None, live: bool) -> None:
        if snap is None or live or snap.header.get("waiting"):
            self.display = False
            self.span = None
            return
        first, last, at = snap.header["first_step"], snap.header["last_step"], snap.step
        self.span = (at, first, last)
        pos = 0 if last <= first else int((at - first) / (last - first) * (SCRUB_CELLS - 1))
        line = "".join("●" if i == pos else "─" for i in range(SCRUB_CELLS))
        self.update(Text(f"{scrub_prefix(at, first)}{line} {last}   ([ ] ±1, {{ }} ±10, home/end; click the bar)"))
        self.display = True

    def on_click(self, event: events.Click) -> None:
        off = event.get_content_offset(self)
        if off is None or self.span is None:
            return
        at, first, last = self.span
        x = off.x - len(scrub_prefix(at, first))
        if 0 <= x < SCRUB_CELLS:
            self.post_message(self.StepAsked(int(round(first + x / (SCRUB_CELLS - 1) * (last - first)))))


class FilterBox(Input):
    """The filter line (/): docked at the bottom, shown while it is open (enter applies, esc clears)."""

    DEFAULT_CSS = """
    FilterBox { dock: bottom; display: none; }
    FilterBox.on { display: block; }
    """

    @property
    def is_open(self) -> bool:
        return self.has_class("on")

    def open(self, value: str) -> None:
        self.add_class("on")
        self.value = value
        self.focus()

    def close(self, *, clear: bool = False) -> None:
        self.remove_class("on")
        if clear:
            self.value = ""


class DataTable(_DataTable):
    """Textual's DataTable, with every ``str`` cell shown as plain text (``core.plain``): its own
    formatter reads a ``str`` as Rich markup, and the cells hold what ranks sent."""

    def add_row(self, *cells: Any, **kw: Any) -> Any:  # type: ignore[override]
        return super().add_row(*[core.plain(c) if isinstance(c, str) else c for c in cells], **kw)
