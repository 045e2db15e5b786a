"""The `tracetop` Textual app: screens over snapshots, fed by a Source from a worker thread.

Widgets only draw what tui/core.py computed; I/O (the Watch stream, a file's queries, a rank's
drill-down) runs in `@work(thread=True)` workers and comes back through `call_from_thread`. On
each snapshot only the visible screen is redrawn (the others are redrawn when shown), and the
Ranks heatmap is a Line-API ScrollView that renders only the lines on screen.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np
from rich.console import Group
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.geometry import Size
from textual.message import Message
from textual.screen import ModalScreen
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import ContentSwitcher, DataTable, Footer, Input, Static, Tab, Tabs

from collector.query import snapshot as snapmod
from tui import core
from tui.sources import Decision, Source, SourceError

SCREENS: tuple[tuple[str, str], ...] = (
    ("overview", "1 Overview"),
    ("ranks", "2 Ranks"),
    ("pipeline", "3 Pipeline"),
    ("collectives", "4 Collectives"),
    ("offload", "5 Offload"),
    ("gpus", "6 GPUs"),
    ("alerts", "7 Alerts & actions"),
)
SCREEN_IDS = tuple(s for s, _ in SCREENS)

#: Every binding with what it does, for `?` and the README (one list, so they agree).
HELP: tuple[tuple[str, str], ...] = (
    ("1 … 7, tab / shift+tab", "switch screen (or click a tab)"),
    ("/", "filter the screen's rows (Ranks: stage=1 replica=0 tp=0 rank=3 node=NAME z>3, or a rank number)"),
    ("s", "sort (Ranks side table: z / rank / value; Collectives: p99 / calls / size / op)"),
    ("m", "Ranks: next metric (compute, collective wait, step time, memory, GPU util)"),
    ("a", "Ranks: aggregation level (auto, rank, replica, node)"),
    ("arrows, mouse", "Ranks: move the cell cursor (click a cell to select it)"),
    ("enter", "drill down (an aggregated cell → its ranks; a rank → its phases, collectives, memory)"),
    ("esc", "back (out of a drill-down, a filter, this help)"),
    ("[ ] { } home end", "replay a file: step −1 / +1 / −10 / +10 / first / last"),
    ("p", "pause / resume live updates"),
    ("y / n", "approve / reject a proposal (advise mode), after a confirmation: on Alerts & actions the selected "
              "row, on the Overview the newest proposal; live only, with --control-token-file where needed"),
    ("?", "this help"),
    ("q", "quit"),
)


def _style(status: str) -> Style:
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
        self.lines: list[tuple[str, object]] = []  # ("title", text) | ("cells", (first, last))
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
        a, b = payload  # type: ignore[misc]
        segs = [Segment("          ")]
        metric = self.hm.metric if self.hm else "compute"
        for k in range(a, b):
            c = self.cells[k]
            st = _style(c.status)
            if k == self.cursor:
                st = st + Style(reverse=True)
            segs.append(Segment(core.cell_text(c, metric, self.cell_w), st))
        return Strip(segs).crop(0, width).extend_cell_length(width)

    def _cell_pos(self, k: int) -> tuple[int, int]:
        for li, (kind, payload) in enumerate(self.lines):
            if kind == "cells" and payload[0] <= k < payload[1]:  # type: ignore[index]
                return li, k - payload[0]  # type: ignore[index]
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
        a, b = self.lines[li][1]  # type: ignore[misc]
        k = a + max(off.x - 10, 0) // self.cell_w
        if a <= k < b:
            if k == self.cursor and event.chain >= 2:
                self.post_message(self.Selected(self.cells[k]))
            self.cursor = k
            self.refresh()
            self.post_message(self.Highlighted(self.cells[k]))


class ScrubBar(Static):
    """The replay bar: a click on it moves to that step."""

    def on_click(self, event: events.Click) -> None:
        off = event.get_content_offset(self)
        if off is not None:
            self.app.scrub_click(off.x)  # type: ignore[attr-defined]


# ---- help -------------------------------------------------------------------------------------------

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


# ---- the app -----------------------------------------------------------------------------------------

@dataclass
class RanksState:
    metric: str = "compute"
    level: str = "auto"
    sort: str = "z"
    drill: list[tuple] = field(default_factory=list)  # stack of drilled-into cell keys
    detail_rank: int | None = None


class TracetopApp(App[int]):
    TITLE = "tracetop"
    CSS = """
    Screen { layout: vertical; }
    #head { height: 2; background: $boost; padding: 0 1; }
    #scrub { height: 1; padding: 0 1; }
    #body { height: 1fr; }
    #filter { dock: bottom; display: none; }
    #filter.on { display: block; }
    .pane { height: 1fr; }
    #ranks-side { width: 62; }
    #ranks-status { height: 3; padding: 0 1; }
    #error { padding: 2 4; }
    DataTable { height: auto; max-height: 1fr; }
    """
    BINDINGS = [
        *[Binding(str(i + 1), f"show('{sid}')", title.split(" ", 1)[1], show=False) for i, (sid, title) in enumerate(SCREENS)],
        Binding("tab", "cycle(1)", "Next screen", show=False, priority=True),
        Binding("shift+tab", "cycle(-1)", "Previous screen", show=False, priority=True),
        Binding("slash", "filter", "Filter"),
        Binding("s", "sort", "Sort"),
        Binding("m", "metric", "Metric"),
        Binding("a", "level", "Aggregate"),
        Binding("escape", "back", "Back"),
        Binding("p", "pause", "Pause"),
        Binding("left_square_bracket", "step(-1)", "Step −1", show=False),
        Binding("right_square_bracket", "step(1)", "Step +1", show=False),
        Binding("left_curly_bracket", "step(-10)", "Step −10", show=False),
        Binding("right_curly_bracket", "step(10)", "Step +10", show=False),
        Binding("home", "step_to('first')", show=False),
        Binding("end", "step_to('last')", show=False),
        Binding("y", "decide('approve')", "Approve", show=False),
        Binding("n", "decide('reject')", "Reject", show=False),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, source: Source | None, *, interval_s: float = 0.5, error: SourceError | None = None,
                 retry_s: float = 2.0, initial: str = "overview", show_no_source: bool = True) -> None:
        super().__init__()
        self.source = source
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.snap: snapmod.Snapshot | None = None
        self.pending: snapmod.Snapshot | None = None
        self.paused = False
        self.current = initial
        self.show_no_source = show_no_source
        self.filters: dict[str, str] = {}
        self.coll_sort = "p99"
        self.ranks = RanksState()
        self.rank_table_cache: core.RankTable | None = None
        self.error: SourceError | None = error
        self.live_note = ""
        self.stop = threading.Event()
        self.snapshots_applied = 0
        self.replay_step: int | None = None
        self.detail: dict | None = None
        self.decision_note: Text | None = None  # the last approve / reject's answer, shown on screen
        self.deciding: str | None = None        # the action id whose decision is on its way

    # -- layout --
    def compose(self) -> ComposeResult:
        yield Static("", id="head")
        yield Tabs(*[Tab(title, id=f"tab-{sid}") for sid, title in SCREENS], id="tabs",
                   active=f"tab-{'ranks' if self.current == 'rank-detail' else self.current}")
        yield ScrubBar("", id="scrub")
        with ContentSwitcher(initial=self.current, id="body"):
            with VerticalScroll(id="overview", classes="pane"):
                yield Static("", id="ov-figures")
                yield Static("", id="ov-phases")
                yield Static("", id="ov-alerts")
            with Vertical(id="ranks", classes="pane"):
                yield Static("", id="ranks-status")
                with Horizontal():
                    yield HeatmapView(id="heatmap")
                    yield DataTable(id="ranks-side", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="rank-detail", classes="pane"):
                yield Static("", id="detail")
            with VerticalScroll(id="pipeline", classes="pane"):
                yield Static("", id="pipe-bubbles")
                yield Static("", id="pipe-gantt")
            with VerticalScroll(id="collectives", classes="pane"):
                yield DataTable(id="coll-table", zebra_stripes=True)
                yield Static("", id="coll-grad")
            with VerticalScroll(id="offload", classes="pane"):
                yield Static("", id="off-rate")
                yield DataTable(id="off-table", zebra_stripes=True)
            with VerticalScroll(id="gpus", classes="pane"):
                yield Static("", id="gpu-tiles")
            with VerticalScroll(id="alerts", classes="pane"):
                yield Static("", id="al-note")
                yield DataTable(id="al-table", zebra_stripes=True, cursor_type="row")
                yield DataTable(id="ac-table", zebra_stripes=True, cursor_type="row")
            with Vertical(id="error", classes="pane"):
                yield Static("", id="error-text")
        yield Input(placeholder="filter (enter to apply, esc to clear)", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        side = self.query_one("#ranks-side", DataTable)
        side.add_columns("rank", "stage", "dp", "tp", "node", "value", "z", "mark")
        self.query_one("#coll-table", DataTable).add_columns(
            "op", "role", "size", "calls", "p50", "p99", "algbw", "busbw")
        self.query_one("#off-table", DataTable).add_columns("time (UTC)", "rank", "size", "source", "target", "what", "took")
        self.query_one("#al-table", DataTable).add_columns("state", "severity", "rule", "where", "message")
        self.query_one("#ac-table", DataTable).add_columns("action", "state", "what", "why")
        if self.current != "overview":
            self.switch_to(self.current)
        if self.error is not None or (self.source is None and self.show_no_source):
            self.show_error(self.error or SourceError("no source", "nothing to show", "tracetop ui --help"))
        elif self.source is not None:
            self.start_source()

    # -- sources (workers) --
    def start_source(self) -> None:
        if self.source is not None and self.source.live:
            self.run_live()
        else:
            self.load_step(None)

    def _post(self, fn, *args) -> bool:
        """Run fn on the UI thread from a worker; False (and stop) once the app has gone."""
        if self.stop.is_set():
            return False
        try:
            self.call_from_thread(fn, *args)
        except RuntimeError:  # the app's loop has closed under us
            self.stop.set()
            return False
        return True

    @work(thread=True, exclusive=True, group="source")
    def run_live(self) -> None:
        src = self.source
        assert src is not None
        while not self.stop.is_set():
            try:
                if not src.is_open:
                    src.open()
                for s in src.watch(self.interval_s, self.stop):
                    if not self._post(self.on_snapshot, s):
                        return
            except Exception as e:  # a worker never takes the app down: every failure becomes a screen
                if self.stop.is_set():
                    return
                if not isinstance(e, SourceError):
                    e = SourceError("unexpected error", f"{type(e).__name__}: {e}",
                                    "retrying; if it persists, report it with the collector's log")
                if not self._post(self.show_error, e):
                    return
                if e.title in ("unknown run", "collector too old"):
                    return
                src.close()
                if self.stop.wait(self.retry_s):
                    return

    @work(thread=True, exclusive=True, group="source")
    def load_step(self, step: int | None) -> None:
        src = self.source
        assert src is not None
        try:
            if not src.is_open:
                src.open()
            s = src.snapshot_at(step)
        except Exception as e:
            if not isinstance(e, SourceError):
                e = SourceError("unexpected error", f"{type(e).__name__}: {e}", "report it with the file's path")
            self._post(self.show_error, e)
            return
        if step is not None and step != self.replay_step:
            return  # a later key asked for another step: this one is stale (keys outrun loads)
        self._post(self.on_snapshot, s)

    @work(thread=True, exclusive=True, group="detail")
    def load_detail(self, rank: int, step: int) -> None:
        try:
            d = self.source.rank_detail(rank, step)  # type: ignore[union-attr]
        except Exception as e:
            msg = f"{e.title}: {e.message}" if isinstance(e, SourceError) else f"{type(e).__name__}: {e}"
            self._post(self.notify, msg)
            return
        self._post(self.on_detail, rank, d)

    def on_unmount(self) -> None:
        self.stop.set()
        if self.source is not None:
            self.source.close()

    # -- applying snapshots --
    def on_snapshot(self, s: snapmod.Snapshot) -> None:
        if self.paused and self.source is not None and self.source.live:
            self.pending = s
            self.draw_head()
            return
        if self.error is not None:
            self.error = None
            self.query_one("#body", ContentSwitcher).current = self.current
            self.query_one("#tabs", Tabs).display = True
        self.snap = s
        self.rank_table_cache = None
        self.snapshots_applied += 1
        self.draw_head()
        self.draw_current()

    def show_error(self, e: SourceError) -> None:
        self.error = e
        if self.snap is None:
            self.query_one("#tabs", Tabs).display = False
            body = self.query_one("#body", ContentSwitcher)
            body.current = "error"
            t = Text()
            t.append(f"✖ {e.title}\n\n", style="bold red")
            t.append(f"{e.message}\n\n")
            t.append("what to do: ", style="bold")
            t.append(f"{e.hint}\n\n")
            t.append("q quits" + (f", retrying every {self.retry_s:.0f} s" if self.source is not None and self.source.live
                                  and e.title not in ("unknown run", "collector too old") else ""), style="dim")
            self.query_one("#error-text", Static).update(t)
        else:
            self.live_note = f"{e.title}: {e.message} — {e.hint}"
            self.draw_head()

    # -- drawing: the header, and only the current screen --
    def draw_head(self) -> None:
        head = Text()
        if self.snap is None or self.snap.header.get("waiting"):
            what = self.source.description if self.source else ""
            head.append(f"tracetop · {what} · ", style="bold")
            head.append("no run has started here yet: point the ranks' hooks at it (TRACETOP_ENDPOINT)"
                        if self.snap is not None else "connecting…")
        else:
            head.append(core.header_line(self.snap), style="bold")
            head.append("\n")
            mode = "LIVE" if self.source is not None and self.source.live else "REPLAY"
            head.append(f"[{mode}] ", style="bold green" if mode == "LIVE" else "bold cyan")
            if self.paused:
                head.append("⏸ PAUSED (p resumes) ", style="bold yellow")
            head.append(f"{self.source.description if self.source else ''} · step {self.snap.step}")
            if self.live_note:
                head.append(f" · ⚠ {self.live_note}", style="yellow")
        self.query_one("#head", Static).update(head)
        scrub = self.query_one("#scrub", Static)
        if self.snap is not None and not (self.source and self.source.live) and not self.snap.header.get("waiting"):
            first, last, at = self.snap.header["first_step"], self.snap.header["last_step"], self.snap.step
            width = 50
            pos = 0 if last <= first else int((at - first) / (last - first) * (width - 1))
            line = "".join("●" if i == pos else "─" for i in range(width))
            scrub.update(Text(f"step {at:>5}  {first} {line} {last}   ([ ] ±1, {{ }} ±10, home/end; click the bar)"))
            scrub.display = True
        else:
            scrub.display = False

    def draw_current(self) -> None:
        if self.snap is None or self.snap.header.get("waiting"):
            return
        getattr(self, f"draw_{self.current.replace('-', '_')}")()

    def draw_overview(self) -> None:
        s = self.snap
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
            al.append(("\n  ".join([""] + firing) if firing else "none") + "\n")
        al.append("latest actions: ", style="bold")
        acts = core.action_rows(s)[:5]
        if not s.header.get("has_actions"):
            al.append("none known (no actions table: this collector or file predates the controller)", style="dim")
        else:
            al.append("\n  ".join([""] + [f"{a['id']} {a['state']} {a['what']} ({a['why']})" for a in acts]) if acts else "none")
            prop = self.overview_proposal()
            if prop is not None and self.source is not None and self.source.live:
                al.append(f"\n  y approves / n rejects proposal {prop['id']} ({prop['what']})", style="bold")
        if self.decision_note is not None:
            al.append("\n")
            al.append_text(self.decision_note)
        self.query_one("#ov-alerts", Static).update(al)

    def overview_proposal(self) -> dict | None:
        """The proposal y / n decide on the Overview: the newest one still proposed."""
        return next((a for a in core.action_rows(self.snap) if a["state"] == "proposed"), None) if self.snap else None

    def rank_table(self) -> core.RankTable:
        if self.rank_table_cache is None or self.rank_table_cache.metric != self.ranks.metric:
            self.rank_table_cache = core.rank_table(self.snap, self.ranks.metric)
        return self.rank_table_cache

    def ranks_mask(self, rt: core.RankTable) -> np.ndarray:
        mask = core.filter_mask(rt, self.filters.get("ranks", ""))
        if self.ranks.drill:
            mask &= core.drill_mask(rt, self.ranks.drill[-1])
        return mask

    def ranks_level(self, rt: core.RankTable, mask: np.ndarray) -> str:
        if self.ranks.drill:
            return "rank"
        if self.ranks.level != "auto":
            return self.ranks.level
        n_cells = int(np.unique(rt.stage[mask] * (int(rt.replica.max(initial=0)) + 1) + rt.replica[mask]).size)
        return core.auto_level(int(mask.sum()), n_cells)

    def draw_ranks(self) -> None:
        rt = self.rank_table()
        mask = self.ranks_mask(rt)
        level = self.ranks_level(rt, mask)
        hm = core.heatmap(rt, level, mask=mask)
        self.query_one("#heatmap", HeatmapView).set_heatmap(hm)
        side = self.query_one("#ranks-side", DataTable)
        side.clear()
        for row in core.worst_rows(rt, sort=self.ranks.sort, limit=20, mask=mask):
            *cells, st = row
            cells[-1] = Text(("‼ " if st == core.BAD else core.STATUS_MARK[st] + " ") + cells[-1], style=core.STATUS_STYLE[st])
            side.add_row(*[str(c) if not isinstance(c, Text) else c for c in cells], key=str(row[0]))
        col_, unit, sign, title = core.METRICS[rt.metric]
        strag = core.stragglers(rt)
        st = Text()
        st.append(f"metric (m): {title} · level (a): {level}{' (auto)' if self.ranks.level == 'auto' and not self.ranks.drill else ''}"
                  f" · {int(mask.sum())}/{rt.n} ranks · sort (s): {self.ranks.sort}")
        if self.ranks.drill:
            st.append(f" · drilled into {self.ranks.drill[-1][0]} {self.ranks.drill[-1][1:]} (esc back)")
        if self.filters.get("ranks"):
            st.append(f" · filter: {self.filters['ranks']}")
        st.append("\n")
        st.append(f"display z ≥ {core.Z_MARK:.0f} {'high' if sign > 0 else 'low'} = S straggler: ", style="bold")
        st.append(", ".join(f"rank {r}" for r in strag[:12]) + (" …" if len(strag) > 12 else "") if strag else "none",
                  style=core.STATUS_STYLE[core.BAD if strag else core.OK])
        st.append(f"\ncells: label z mark; marks S straggler ‼ |z|≥{core.Z_MARK:.0f} ! ≥{core.Z_WARN:.0f} ? no data; "
                  "compact: · ░ ▒ ▓ by |z|", style="dim")
        self.query_one("#ranks-status", Static).update(st)

    def draw_rank_detail(self) -> None:
        r = self.ranks.detail_rank
        if r is None:
            return
        rt = self.rank_table()
        i = np.flatnonzero(rt.rank == r)
        where = ""
        if i.size:
            k = int(i[0])
            where = f"stage {rt.stage[k]} · replica {rt.replica[k]} · tp {rt.tp_rank[k]} · node {rt.node[k]}"
        out = Table.grid()
        out.add_row(Text(f"rank {r} · {where} · steps to {self.snap.step} (esc back)\n", style="bold"))
        d = self.detail
        if d is None:
            out.add_row(Text("loading…", style="dim"))
        else:
            t = Table(title="phases per step (ms)", title_justify="left", box=None)
            cols = ["step", "step_ms", "data_wait_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_exposed_ms",
                    "compute_ms", "wait_ms", "collectives", "mem_bytes"]
            for c in cols:
                t.add_column(c.replace("_ms", "").replace("_bytes", ""), justify="right")
            for row in d["steps"].to_pylist()[-15:]:
                t.add_row(*[(str(row[c]) if c in ("step", "collectives") else core.fmt_num(row[c], "B") if c == "mem_bytes"
                             else core.fmt_num(row[c], "", 1)) for c in cols])
            out.add_row(t)
            ct = Table(title="\ncollectives over these steps", title_justify="left", box=None)
            for c in ("op", "role", "calls", "bytes", "total ms", "p99 ms"):
                ct.add_column(c, justify="right")
            for row in d["collectives"].to_pylist():
                ct.add_row(row["op"], row["role"], str(row["calls"]), core.fmt_num(row["bytes"], "B"),
                           core.fmt_num(row["total_ms"], "", 1), core.fmt_num(row["duration_ms_p99"], "", 2))
            out.add_row(ct)
            gpu = self.snap.table("ranks")
            g = [x for x in gpu.to_pylist() if x["rank"] == r]
            if g:
                out.add_row(Text(f"\nGPU util now: {core.fmt_num(g[0]['gpu_util_pct'], '%')} · memory now: "
                                 f"{core.fmt_num(g[0]['mem_bytes'], 'B')}"))
        self.query_one("#detail", Static).update(out)

    def draw_pipeline(self) -> None:
        s = self.snap
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
        width = max(self.size.width - 22, 20)
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

    def draw_collectives(self) -> None:
        t = self.query_one("#coll-table", DataTable)
        t.clear()
        for row in core.collective_rows(self.snap, sort=self.coll_sort, text=self.filters.get("collectives", "")):
            t.add_row(*row)
        g = Text(f"\nsort (s): {self.coll_sort} · op × role × size bucket over steps {self.snap.header.get('collectives_lo')}.."
                 f"{self.snap.step}\n", style="dim")
        g.append(f"grad-sync p99 per step (dp collectives; line {core.GRAD_SYNC_LINE_MS:.0f} ms):\n", style="bold")
        for step, v, st in core.grad_sync_series(self.snap)[-15:]:
            g.append(f"  step {step:>5}  {core.fmt_num(v, 'ms'):>10}  ")
            g.append(core.bar(min(v / (2 * core.GRAD_SYNC_LINE_MS), 1.0) if not math.isnan(v) else float("nan"), 30),
                     style=core.STATUS_STYLE[st])
            g.append(f"  {'ABOVE the line' if st == core.BAD else ''}\n", style=core.STATUS_STYLE[st])
        self.query_one("#coll-grad", Static).update(g)

    def draw_offload(self) -> None:
        series = core.offload_series(self.snap)
        t = Text()
        t.append("offload GB/s by direction over recent steps\n", style="bold")
        if not series:
            t.append("no offload transfers in these steps (ZeRO offload off, or the run has no ZeRO-2/3 shape)\n",
                     style="dim")
        blocks = "▁▂▃▄▅▆▇█"
        for direction, pts in series.items():
            vals = [v for _, v in pts]
            top = max(vals) or 1.0
            t.append(f"  {direction:>7}  ")
            t.append("".join(blocks[min(int(v / top * 7), 7)] for v in vals[-60:]), style="dodger_blue1")
            t.append(f"  last {vals[-1]:.2f} GB/s, max {top:.2f}\n")
        t.append("\nthe last 10 transfers:", style="bold")
        self.query_one("#off-rate", Static).update(t)
        table = self.query_one("#off-table", DataTable)
        table.clear()
        for row in core.offload_last_rows(self.snap):
            table.add_row(*row)

    def draw_gpus(self) -> None:
        tiles = core.gpu_tiles(self.snap)
        flt = self.filters.get("gpus", "")
        out = Table.grid(padding=(0, 1))
        if not tiles:
            out.add_row(Text(f"no GPU samples in the last {snapmod.GPU_WINDOW_S:.0f} s (no node agent, or it has no NVML)",
                             style="dim"))
        shown = 0
        for node, gpus in tiles.items():
            if flt and flt.lower() not in node.lower():
                continue
            if shown >= 64:
                out.add_row(Text(f"… {len(tiles)} nodes in all: / to filter by node", style="dim"))
                break
            out.add_row(Text(f"node {node}", style="bold"))
            row = Table.grid(padding=(0, 2))
            cells = []
            for g in gpus:
                tile = Text()
                tile.append(f"GPU{g.gpu} ", style="bold")
                tile.append(f"{core.STATUS_MARK[g.status]}{core.STATUS_WORD[g.status]}\n", style=core.STATUS_STYLE[g.status])
                frac_m = g.mem_used_bytes / g.mem_total_bytes if g.mem_total_bytes else float("nan")
                tile.append(f"MEM {core.bar(frac_m, 10)} {core.fmt_num(g.mem_used_bytes, 'B', 0)}/"
                            f"{core.fmt_num(g.mem_total_bytes, 'B', 0)}\n")
                tile.append(f"UTL {core.bar(g.util_pct / 100, 10)} {core.fmt_num(g.util_pct, '%', 0)}\n")
                tile.append(f"{core.fmt_num(g.temp_c, '', 0)}°C {core.fmt_num(g.power_w, 'W', 0)} thr {g.throttle} "
                            f"xid {g.xid}\n")
                if g.reasons:
                    tile.append(", ".join(g.reasons), style=core.STATUS_STYLE[g.status])
                cells.append(tile)
            for a in range(0, len(cells), 4):
                row.add_row(*cells[a:a + 4])
            out.add_row(row)
            shown += 1
        self.query_one("#gpu-tiles", Static).update(out)

    def draw_alerts(self) -> None:
        s = self.snap
        note = Text()
        if not s.header.get("has_alerts"):
            note.append("No alerts table in this collector / file: it predates live judgments, so it has no alerts.\n", style="dim")
        if not s.header.get("has_actions"):
            note.append("No actions table: this collector / file predates the controller, so it has no proposals.\n", style="dim")
        if self.source is not None and self.source.live:
            note.append("y approves / n rejects the selected proposal (after a confirmation).", style="dim")
        else:
            note.append("A finished run's file, read-only: proposals are shown, not decided (approve or reject live).", style="dim")
        if self.decision_note is not None:
            note.append("\n")
            note.append_text(self.decision_note)
        self.query_one("#al-note", Static).update(note)
        t = self.query_one("#al-table", DataTable)
        t.clear()
        for *row, st in core.alert_rows(s, self.filters.get("alerts", "")):
            row[0] = Text(core.STATUS_MARK[st] + " " + row[0], style=core.STATUS_STYLE[st])
            t.add_row(*row)
        a = self.query_one("#ac-table", DataTable)
        keep = self._action_under_cursor()  # the row a person selected survives the redraw
        a.clear()
        seen: set[str] = set()
        for d in core.action_rows(s, self.filters.get("alerts", "")):
            if d["id"] in seen:
                continue
            seen.add(d["id"])
            a.add_row(d["id"], d["state"], d["what"], d["why"], key=d["id"])
        if keep is not None and keep in seen:
            a.move_cursor(row=a.get_row_index(keep), animate=False)

    def _action_under_cursor(self) -> str | None:
        """The action id of the actions table's cursor row (None when the table is empty)."""
        a = self.query_one("#ac-table", DataTable)
        if a.row_count == 0:
            return None
        try:
            key = a.coordinate_to_cell_key(a.cursor_coordinate).row_key.value
        except Exception:  # the cursor is off the rows (the table is being refilled)
            return None
        return str(key) if key is not None else None

    def on_detail(self, rank: int, d: dict) -> None:
        if self.ranks.detail_rank == rank:
            self.detail = d
            if self.current == "rank-detail":
                self.draw_rank_detail()

    # -- navigation --
    def switch_to(self, sid: str) -> None:
        self.current = sid
        if self.error is not None and self.snap is None:
            return
        self.query_one("#body", ContentSwitcher).current = sid
        tab_id = "ranks" if sid == "rank-detail" else sid
        tabs = self.query_one("#tabs", Tabs)
        if tabs.active != f"tab-{tab_id}":
            tabs.active = f"tab-{tab_id}"
        self.draw_current()
        if sid == "ranks":
            self.query_one("#heatmap", HeatmapView).focus()

    def on_tabs_tab_activated(self, event: Tabs.TabActivated) -> None:
        if not self.query("#body"):  # shutting down
            return
        sid = event.tab.id.removeprefix("tab-") if event.tab and event.tab.id else "overview"
        if sid == "ranks" and self.current == "rank-detail":
            return
        if sid != self.current:
            self.switch_to(sid)

    def action_show(self, sid: str) -> None:
        self.switch_to(sid)

    def action_cycle(self, d: int) -> None:
        cur = "ranks" if self.current == "rank-detail" else self.current
        i = (SCREEN_IDS.index(cur) + d) % len(SCREEN_IDS) if cur in SCREEN_IDS else 0
        self.switch_to(SCREEN_IDS[i])

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("on")
        box.value = self.filters.get(self.current, "")
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.filters[self.current] = event.value.strip()
        event.input.remove_class("on")
        self.draw_current()
        if self.current == "ranks":
            self.query_one("#heatmap", HeatmapView).focus()

    def action_sort(self) -> None:
        if self.current == "ranks":
            order = ("z", "rank", "value")
            self.ranks.sort = order[(order.index(self.ranks.sort) + 1) % len(order)]
        elif self.current == "collectives":
            order = core.COLLECTIVE_SORTS
            self.coll_sort = order[(order.index(self.coll_sort) + 1) % len(order)]
        else:
            self.notify("s sorts the Ranks and Collectives screens")
            return
        self.draw_current()

    def action_metric(self) -> None:
        order = core.METRIC_ORDER
        self.ranks.metric = order[(order.index(self.ranks.metric) + 1) % len(order)]
        if self.current != "ranks":
            self.switch_to("ranks")
        else:
            self.draw_current()

    def action_level(self) -> None:
        order = ("auto", *core.LEVELS)
        self.ranks.level = order[(order.index(self.ranks.level) + 1) % len(order)]
        self.ranks.drill = []
        if self.current == "ranks":
            self.draw_current()

    def on_heatmap_view_selected(self, event: HeatmapView.Selected) -> None:
        self.drill(event.cell.key)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "ranks-side" and event.row_key.value is not None:
            self.drill(("rank", int(event.row_key.value)))

    def drill(self, key: tuple) -> None:
        if key[0] == "rank":
            self.ranks.detail_rank = int(key[1])
            self.detail = None
            self.switch_to("rank-detail")
            if self.snap is not None:
                self.load_detail(int(key[1]), self.snap.step)
        else:
            self.ranks.drill.append(key)
            self.draw_current()

    def action_back(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_class("on"):
            box.remove_class("on")
            box.value = ""
            self.filters[self.current] = ""
            self.draw_current()
            return
        if self.current == "rank-detail":
            self.ranks.detail_rank = None
            self.switch_to("ranks")
        elif self.current == "ranks" and self.ranks.drill:
            self.ranks.drill.pop()
            self.draw_current()
        elif self.filters.get(self.current):
            self.filters[self.current] = ""
            self.draw_current()

    def action_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused and self.pending is not None:
            s, self.pending = self.pending, None
            self.on_snapshot(s)
        self.draw_head()

    def action_step(self, d: int) -> None:
        if self.snap is None or self.source is None or self.source.live:
            if self.source is not None and self.source.live:
                self.notify("stepping replays a file (tracetop ui FILE); live, p pauses")
            return
        h = self.snap.header
        base = self.replay_step if self.replay_step is not None else self.snap.step
        self.goto_step(min(max(base + d, h["first_step"]), h["last_step"]))

    def goto_step(self, step: int) -> None:
        """Replay: show `step` (loaded in a worker; a newer request makes older ones stale)."""
        self.replay_step = step
        self.load_step(step)

    def action_step_to(self, where: str) -> None:
        if self.snap is None or self.source is None or self.source.live:
            return
        self.goto_step(self.snap.header["first_step" if where == "first" else "last_step"])

    def scrub_click(self, x: int) -> None:
        if self.snap is None or self.source is None or self.source.live:
            return
        h = self.snap.header
        x -= len(f"step {self.snap.step:>5}  {h['first_step']} ")
        if 0 <= x < 50:
            self.goto_step(int(round(h["first_step"] + x / 49 * (h["last_step"] - h["first_step"]))))

    def action_decide(self, what: str) -> None:
        """y / n: approve / reject a proposal, after a confirmation (Overview: the newest proposal;
        Alerts & actions: the selected row). The collector has the last word: its refusal, or the
        action's new state, is shown on screen."""
        if self.current not in ("overview", "alerts"):
            self.notify("y / n decide proposals on the Overview (1) and Alerts & actions (7) screens")
            return
        if self.snap is None or self.snap.header.get("waiting"):
            return
        if self.source is None or not self.source.live:
            self._refused(what, "?", SourceError("read-only", "read-only: this is a finished run's file, nothing here sends "
                                                 "commands", "approve or reject on the live run (tracetop ui --collector ADDR)"))
            return
        if self.current == "overview":
            target = self.overview_proposal()
            if target is None:
                self.notify("no proposal waiting for a decision", title=what)
                return
        else:
            rows = {d["id"]: d for d in core.action_rows(self.snap)}
            key = self._action_under_cursor()
            if key is None or key not in rows:
                self.notify("no action selected (↑ ↓ on the actions table)", title=what)
                return
            target = rows[key]
            if target["state"] != "proposed":
                self._refused(what, target["id"], SourceError(
                    f"cannot {what}", f"action {target['id']} is {target['state']}, not proposed: only a proposal can "
                    f"be {'approved' if what == 'approve' else 'rejected'}", "pick a proposed row (↑ ↓)"))
                return
        if self.deciding is not None:
            self.notify(f"still waiting for the answer about action {self.deciding}", title=what)
            return
        q = Text()
        q.append(f"{'Approve' if what == 'approve' else 'Reject'} action {target['id']}?\n\n", style="bold")
        q.append(f"{target['what']}  ({target['why']})\n\n")
        q.append("Approving sends it to every rank of the run at its next step boundary.\n" if what == "approve"
                 else "Rejecting drops it: nothing is sent.\n")
        q.append("\ny / enter: yes   n / esc: no", style="bold")
        action_id = target["id"]
        self.push_screen(ConfirmScreen(q), callback=lambda ok: self._confirmed(bool(ok), what, action_id))

    def _confirmed(self, ok: bool, what: str, action_id: str) -> None:
        if not ok:
            self.notify(f"nothing sent: action {action_id} is left as it was", title=what)
            return
        self.deciding = action_id
        self.decision_note = Text(f"… {what} action {action_id}: sent, waiting for the collector", style="yellow")
        self.draw_current()
        self.submit_decision(what, action_id)

    @work(thread=True, group="control")
    def submit_decision(self, what: str, action_id: str) -> None:
        try:
            answer: Decision | SourceError = self.source.decide(what, action_id)  # type: ignore[union-attr]
        except SourceError as e:
            answer = e
        except Exception as e:  # a worker never takes the app down
            answer = SourceError("unexpected error", f"{type(e).__name__}: {e}", "see the collector's log")
        self._post(self.on_decision, what, action_id, answer)

    def _refused(self, what: str, action_id: str, e: SourceError) -> None:
        """A refusal on screen: in the screen's note and as a toast (never a traceback)."""
        self.decision_note = Text(f"✖ {what} action {action_id}: {e.title}: {e.message} — {e.hint}", style="bold red")
        self.notify(f"{e.message}\n{e.hint}", title=f"{what}: {e.title}", severity="error", timeout=10)
        self.draw_current()

    def on_decision(self, what: str, action_id: str, answer: Decision | SourceError) -> None:
        self.deciding = None
        if isinstance(answer, SourceError):
            self._refused(what, action_id, answer)
            return
        msg = f" ({answer.message})" if answer.message else ""
        self.decision_note = Text(f"✔ action {answer.action_id} {answer.state}{msg}", style="bold green")
        self.notify(f"action {answer.action_id}: {answer.state}{msg}", title=what)
        self.draw_current()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_quit(self) -> None:
        self.stop.set()
        self.exit(0)

