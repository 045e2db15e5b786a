"""5 Offload: ZeRO offload GB/s by direction over the recent steps, and the last transfers."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui import core
from tui.screens import View
from tui.widgets import DataTable

SPARK = "▁▂▃▄▅▆▇█"


class OffloadPane(VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Static("", id="off-rate")
        yield DataTable(id="off-table", zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one("#off-table", DataTable).add_columns("time (UTC)", "rank", "size", "source", "target", "what", "took")

    def draw(self, view: View) -> None:
        series = core.offload_series(view.snap)
        t = Text()
        t.append("offload GB/s by direction over recent steps\n", style="bold")
        if not series:
            t.append("no offload transfers in these steps (ZeRO offload off, or the run has no ZeRO-2/3 shape)\n",
                     style="dim")
        for direction, pts in series.items():
            vals = [v for _, v in pts]
            top = max(vals) or 1.0
            t.append(f"  {direction:>7}  ")
            t.append("".join(SPARK[min(int(v / top * 7), 7)] for v in vals[-60:]), style="dodger_blue1")
            t.append(f"  last {vals[-1]:.2f} GB/s, max {top:.2f}\n")
        t.append("\nthe last 10 transfers:", style="bold")
        self.query_one("#off-rate", Static).update(t)
        table = self.query_one("#off-table", DataTable)
        table.clear()
        for row in core.offload_last_rows(view.snap):
            table.add_row(*row)
