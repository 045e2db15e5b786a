"""3 Pipeline: the bubble of each stage against its ideal, and the last step's schedule as a Gantt."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui import core
from tui.screens import View


class PipelinePane(VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Static("", id="pipe-bubbles")
        yield Static("", id="pipe-gantt")

    def draw(self, view: View) -> None:
        s = view.snap
        rows = core.bubble_rows(s)
        t = Table(box=None)
        for c in ("stage", "bubble", "meter", "ideal", "status"):
            t.add_column(c)
        if not rows:
            t.add_row("–", "–", "no pipeline (PP 1) or no steps yet", "", "")
        for r in rows:
            t.add_row(str(r.stage), Text(f"{r.rate * 100:.1f}%", style=core.STATUS_STYLE[r.status]),
                      Text(r.bar(40), style=core.STATUS_STYLE[r.status]), f"{r.ideal * 100:.1f}%",
                      Text(core.STATUS_MARK[r.status] + " " + core.STATUS_WORD[r.status], style=core.STATUS_STYLE[r.status]))
        self.query_one("#pipe-bubbles", Static).update(Group(Text(
            f"bubble per stage at step {s.step} (| = ideal (p−1)/(m+p−1); ! orange above 20%, ‼ red above 30%)",
            style="bold"), t))
        width = max(view.width - 22, 20)
        span, lines = core.gantt_rows(s, width=width)
        g = Table(box=None, show_header=False)
        g.add_column(no_wrap=True)
        g.add_column(no_wrap=True)
        for stage, rank, line in lines:
            text = Text()
            for ch in line:
                text.append(ch, style=core.INSTR_STYLE.get(ch, "grey50" if ch == "·" else "white"))
            g.add_row(f"stage {stage} r{rank}", text)
        self.query_one("#pipe-gantt", Static).update(Group(Text(
            f"\nstep {s.step} schedule on each stage's first rank ({span:.0f} ms; F fwd B bwd >/< act »/« grad "
            "L load R reduce O opt · idle)", style="bold"), g))
