"""4 Collectives: op × role × size bucket over the recent steps (s sorts), and grad-sync p99 per step."""

from __future__ import annotations

import math

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui import core
from tui.screens import View
from tui.widgets import DataTable


class CollectivesPane(VerticalScroll):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.sort = core.COLLECTIVE_SORTS[0]

    def next_sort(self) -> None:
        order = core.COLLECTIVE_SORTS
        self.sort = order[(order.index(self.sort) + 1) % len(order)]

    def compose(self) -> ComposeResult:
        yield DataTable(id="coll-table", zebra_stripes=True)
        yield Static("", id="coll-grad")

    def on_mount(self) -> None:
        self.query_one("#coll-table", DataTable).add_columns("op", "role", "size", "calls", "p50", "p99", "algbw", "busbw")

    def draw(self, view: View) -> None:
        s = view.snap
        t = self.query_one("#coll-table", DataTable)
        t.clear()
        for row in core.collective_rows(s, sort=self.sort, text=view.filter):
            t.add_row(*row)
        g = Text(f"\nsort (s): {self.sort} · op × role × size bucket over steps {s.header.get('collectives_lo')}.."
                 f"{s.step}\n", style="dim")
        g.append(f"grad-sync p99 per step (dp collectives; line {core.GRAD_SYNC_LINE_MS:.0f} ms):\n", style="bold")
        for step, v, st in core.grad_sync_series(s)[-15:]:
            g.append(f"  step {step:>5}  {core.fmt_num(v, 'ms'):>10}  ")
            g.append(core.bar(min(v / (2 * core.GRAD_SYNC_LINE_MS), 1.0) if not math.isnan(v) else float("nan"), 30),
                     style=core.STATUS_STYLE[st])
            g.append(f"  {'ABOVE the line' if st == core.BAD else ''}\n", style=core.STATUS_STYLE[st])
        self.query_one("#coll-grad", Static).update(g)
