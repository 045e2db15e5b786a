"""1 Overview: the run's verdict (a finished run's file), its figures, its stragglers, step time by phase, firing alerts and the latest actions."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from collector.query import snapshot as snapmod
from tui import core
from tui.screens import View


def newest_proposal(snap: snapmod.Snapshot | None) -> dict | None:
    """The proposal y / n decide on the Overview: the newest one still proposed."""
    return next((a for a in core.action_rows(snap) if a["state"] == "proposed"), None) if snap else None


class OverviewPane(VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Static("", id="ov-verdict")
        yield Static("", id="ov-figures")
        yield Static("", id="ov-phases")
        yield Static("", id="ov-alerts")

    def draw(self, view: View) -> None:
        s = view.snap
        verdict = s.header.get("verdict")  # a finished run's file (tui/sources.py FileSource); live: none yet
        self.query_one("#ov-verdict", Static).update(
            core.plain(verdict + "\n") if verdict else Text(""))
        t = Table(box=None, show_header=False, padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        t.add_column()
        for f in core.overview_figures(s):
            t.add_row(f.label, Text(f.value, style=core.STATUS_STYLE[f.status]), Text(
                (core.STATUS_WORD[f.status] + " " if f.status != core.OK else "") + f.note, style="dim"))
        strag = core.stragglers(core.rank_table(s, "compute"))
        t.add_row("stragglers (display z ≥ 3 on compute)", Text(
            ", ".join(f"rank {r}" for r in strag) or "none", style=core.STATUS_STYLE[core.BAD if strag else core.OK]),
            Text("‼ " if strag else "", style="bold red"))
        self.query_one("#ov-figures", Static).update(t)
        ph = Table(box=None, show_header=False)
        ph.add_column(justify="right")
        ph.add_column(justify="right")
        ph.add_column()
        for step, total, segs in core.phase_rows(s, width=50):
            bar = Text()
            for g, n, style in segs:
                bar.append(g * n, style=style)
            ph.add_row(str(step), core.fmt_num(total, "ms"), bar)
        self.query_one("#ov-phases", Static).update(Group(
            Text("step time and its phases (p50 step; d data F fwd B bwd O opt c exposed comm)", style="bold"), ph))
        al = Text("\n")
        firing = core.firing_summary(s)
        al.append("firing alerts: ", style="bold")
        if not s.header.get("has_alerts"):
            al.append("none known (no alerts table: this collector or file predates live judgments)\n", style="dim")
        else:
            al.append_text(core.plain(("\n  ".join([""] + firing) if firing else "none") + "\n"))
        al.append("latest actions: ", style="bold")
        acts = core.action_rows(s)[:5]
        if not s.header.get("has_actions"):
            al.append("none known (no actions table: this collector or file predates the controller)", style="dim")
        else:
            al.append_text(core.plain("\n  ".join([""] + [f"{a['id']} {a['state']} {a['what']} ({a['why']})" for a in acts])
                                      if acts else "none"))
            prop = newest_proposal(s)
            if prop is not None and view.live:
                al.append(f"\n  y approves / n rejects proposal {prop['id']} ({prop['what']})", style="bold")
        if view.decision_note is not None:
            al.append("\n")
            al.append_text(view.decision_note)
        self.query_one("#ov-alerts", Static).update(al)
