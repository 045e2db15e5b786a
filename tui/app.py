"""The `tracetop` Textual app: screens over snapshots, fed by a Source from a worker thread.

The screens are panes in tui/screens/ (one module each: widgets, CSS, painter); this module
composes them, owns the workers and the message flow, and holds the keys. Widgets only draw what
tui/core.py computed; I/O (the Watch stream, a file's queries, a rank's drill-down, a decision)
runs in `@work(thread=True)` workers and comes back through `call_from_thread`. On each snapshot
only the visible screen is redrawn (the others are redrawn when shown), and the Ranks heatmap is a
Line-API ScrollView that renders only the lines on screen.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.widgets import ContentSwitcher, Footer, Input, Static, Tab, Tabs

from collector.query import snapshot as snapmod
from tui import keys
from tui.keys import SCREEN_IDS, SCREENS
from tui.screens import Pane, View
from tui.screens.alerts import AlertsPane
from tui.screens.collectives import CollectivesPane
from tui.screens.decide import DECIDING_SCREENS, READ_ONLY, ConfirmScreen, pick, question
from tui.screens.error import ErrorPane
from tui.screens.gpus import GpusPane
from tui.screens.help import HelpScreen
from tui.screens.offload import OffloadPane
from tui.screens.overview import OverviewPane
from tui.screens.pipeline import PipelinePane
from tui.screens.rank_detail import RankDetailPane
from tui.screens.ranks import RanksPane, RanksState
from tui.screens.topology import TopologyPane
from tui.sources import Decision, Source, SourceError, as_source_error
from tui.widgets import FilterBox, HeatmapView, ScrubBar, head_text

#: Source errors after which a live source is not retried.
FINAL_ERRORS = ("unknown run", "collector too old")


class TracetopApp(App[int]):
    TITLE = "tracetop"
    # The chrome's layout; each pane's own rules are in its module's DEFAULT_CSS.
    CSS = """
    Screen { layout: vertical; }
    #head { height: 2; background: $boost; padding: 0 1; }
    #scrub { height: 1; padding: 0 1; }
    #body { height: 1fr; }
    .pane { height: 1fr; }
    DataTable { height: auto; max-height: 1fr; }
    """
    BINDINGS = keys.BINDINGS  # the app's keys, in the footer's order (tui/keys.py says why they are the app's)

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
        self.ranks = RanksState()
        self.error: SourceError | None = error
        self.live_note = ""
        self.stop = threading.Event()
        self.snapshots_applied = 0
        self.replay_step: int | None = None
        self.detail: dict | None = None
        self.decision_note: Text | None = None  # the last approve / reject's answer, shown on screen
        self.deciding: str | None = None        # the action id whose decision is on its way
        self.panes: dict[str, Pane] = {}

    @property
    def live(self) -> bool:
        return self.source is not None and self.source.live

    @property
    def coll_sort(self) -> str:
        """The Collectives screen's sort (s)."""
        return self.query_one(CollectivesPane).sort

    # -- layout --
    def compose(self) -> ComposeResult:
        yield Static("", id="head")
        yield Tabs(*[Tab(title, id=f"tab-{sid}") for sid, title in SCREENS], id="tabs",
                   active=f"tab-{'ranks' if self.current == 'rank-detail' else self.current}")
        yield ScrubBar("", id="scrub")
        panes = (OverviewPane(id="overview", classes="pane"), RanksPane(self.ranks, id="ranks", classes="pane"),
                 RankDetailPane(self.ranks, id="rank-detail", classes="pane"), PipelinePane(id="pipeline", classes="pane"),
                 CollectivesPane(id="collectives", classes="pane"), OffloadPane(id="offload", classes="pane"),
                 GpusPane(id="gpus", classes="pane"), AlertsPane(id="alerts", classes="pane"),
                 TopologyPane(id="topology", classes="pane"))
        self.panes = {str(p.id): p for p in panes}
        with ContentSwitcher(initial=self.current, id="body"):
            yield from panes
            yield ErrorPane(id="error", classes="pane")
        yield FilterBox(placeholder="filter (enter to apply, esc to clear)", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        if self.current != "overview":
            self.switch_to(self.current)
        if self.error is not None or (self.source is None and self.show_no_source):
            self.show_error(self.error or SourceError("no source", "nothing to show", "tracetop ui --help"))
        elif self.source is not None:
            self.start_source()

    # -- sources (workers) --
    def start_source(self) -> None:
        if self.live:
            self.run_live()
        else:
            self.load_step(None)

    def _post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run fn on the UI thread from a worker; False (and stop) once the app has gone."""
        if self.stop.is_set():
            return False
        try:
            self.call_from_thread(self._while_running, fn, *args)
        except RuntimeError:  # the app's loop has closed under us
            self.stop.set()
            return False
        return True

    def _while_running(self, fn: Callable[..., Any], *args: Any) -> None:
        """On the UI thread: fn(*args) unless the app has begun shutting down (Textual stops
        running, then prunes the screens before our on_unmount sets `stop`: a snapshot landing in
        between found no #head, and its worker failed the app)."""
        if self.is_running and not self.stop.is_set():
            fn(*args)

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
                err = as_source_error(e, "retrying; if it persists, report it with the collector's log")
                if not self._post(self.show_error, err):
                    return
                if err.title in FINAL_ERRORS:
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
            self._post(self.show_error, as_source_error(e, "report it with the file's path"))
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

    @work(thread=True, group="control")
    def submit_decision(self, what: str, action_id: str) -> None:
        try:
            answer: Decision | SourceError = self.source.decide(what, action_id)  # type: ignore[union-attr]
        except Exception as e:  # a worker never takes the app down
            answer = as_source_error(e, "see the collector's log")
        self._post(self.on_decision, what, action_id, answer)

    def on_unmount(self) -> None:
        self.stop.set()
        if self.source is not None:
            self.source.close()

    # -- what the workers bring --
    def on_snapshot(self, s: snapmod.Snapshot) -> None:
        if self.paused and self.live:
            self.pending = s
            self.draw_head()
            return
        if self.error is not None:
            self.error = None
            self.query_one("#body", ContentSwitcher).current = self.current
            self.query_one("#tabs", Tabs).display = True
        self.snap = s
        self.snapshots_applied += 1
        self.draw_head()
        self.draw_current()

    def show_error(self, e: SourceError) -> None:
        self.error = e
        if self.snap is None:
            self.query_one("#tabs", Tabs).display = False
            self.query_one("#body", ContentSwitcher).current = "error"
            retrying = self.live and e.title not in FINAL_ERRORS
            self.query_one(ErrorPane).show(e, self.retry_s if retrying else None)
        else:
            self.live_note = f"{e.title}: {e.message} — {e.hint}"
            self.draw_head()

    def on_detail(self, rank: int, d: dict) -> None:
        if self.ranks.detail_rank == rank:
            self.detail = d
            if self.current == "rank-detail":
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

    # -- drawing: the header, and only the current screen --
    def draw_head(self) -> None:
        self.query_one("#head", Static).update(head_text(
            self.snap, description=self.source.description if self.source else "", live=self.live,
            paused=self.paused, note=self.live_note))
        self.query_one(ScrubBar).show(self.snap, self.live)

    def draw_current(self) -> None:
        if self.snap is None or self.snap.header.get("waiting"):
            return
        self.panes[self.current].draw(View(
            snap=self.snap, live=self.live, filter=self.filters.get(self.current, ""),
            decision_note=self.decision_note, detail=self.detail, width=self.size.width))

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
        self.query_one(FilterBox).open(self.filters.get(self.current, ""))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.filters[self.current] = event.value.strip()
        self.query_one(FilterBox).close()
        self.draw_current()
        if self.current == "ranks":
            self.query_one("#heatmap", HeatmapView).focus()

    def action_sort(self) -> None:
        if self.current == "ranks":
            self.ranks.next_sort()
        elif self.current == "collectives":
            self.query_one(CollectivesPane).next_sort()
        else:
            self.notify("s sorts the Ranks and Collectives screens")
            return
        self.draw_current()

    def action_metric(self) -> None:
        if self.current == "topology":  # latency <-> bus bandwidth
            pane = self.query_one(TopologyPane)
            pane.metric = "busbw" if pane.metric == "latency" else "latency"
            self.draw_current()
            return
        self.ranks.next_metric()
        if self.current != "ranks":
            self.switch_to("ranks")
        else:
            self.draw_current()

    def action_level(self) -> None:
        self.ranks.next_level()
        if self.current == "ranks":
            self.draw_current()

    def on_ranks_pane_drill(self, event: RanksPane.Drill) -> None:
        self.drill(event.key)

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

    def action_back(self) -> None:  # type: ignore[override]  # Textual's is a coroutine; it awaits either
        box = self.query_one(FilterBox)
        if box.is_open:
            box.close(clear=True)
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

    # -- replay (a file) --
    def action_step(self, d: int) -> None:
        if self.snap is None or self.source is None or self.live:
            if self.live:
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
        if self.snap is None or self.source is None or self.live:
            return
        self.goto_step(self.snap.header["first_step" if where == "first" else "last_step"])

    def on_scrub_bar_step_asked(self, event: ScrubBar.StepAsked) -> None:
        if self.snap is not None and self.source is not None and not self.live:
            self.goto_step(event.step)

    # -- approve / reject --
    def _action_under_cursor(self) -> str | None:
        """The action id of the Alerts & actions screen's selected row (None when there is none)."""
        return self.query_one(AlertsPane).action_under_cursor()

    def action_decide(self, what: str) -> None:
        """y / n: approve / reject a proposal, after a confirmation (Overview: the newest proposal;
        Alerts & actions: the selected row). The collector has the last word: its refusal, or the
        action's new state, is shown on screen."""
        if self.current not in DECIDING_SCREENS:
            self.notify("y / n decide proposals on the Overview (1) and Alerts & actions (7) screens")
            return
        if self.snap is None or self.snap.header.get("waiting"):
            return
        if not self.live:
            self._refused(what, "?", READ_ONLY)
            return
        selected = self._action_under_cursor() if self.current == "alerts" else None
        target = pick(what, self.current, self.snap, selected)
        if isinstance(target, str):
            self.notify(target, title=what)
            return
        if isinstance(target, SourceError):
            self._refused(what, str(selected), target)
            return
        if self.deciding is not None:
            self.notify(f"still waiting for the answer about action {self.deciding}", title=what)
            return
        action_id = target["id"]
        self.push_screen(ConfirmScreen(question(what, target)), callback=lambda ok: self._confirmed(bool(ok), what, action_id))

    def _confirmed(self, ok: bool, what: str, action_id: str) -> None:
        if not ok:
            self.notify(f"nothing sent: action {action_id} is left as it was", title=what)
            return
        self.deciding = action_id
        self.decision_note = Text(f"… {what} action {action_id}: sent, waiting for the collector", style="yellow")
        self.draw_current()
        self.submit_decision(what, action_id)

    def _refused(self, what: str, action_id: str, e: SourceError) -> None:
        """A refusal on screen: in the screen's note and as a toast (never a traceback)."""
        self.decision_note = Text(f"✖ {what} action {action_id}: {e.title}: {e.message} — {e.hint}", style="bold red")
        self.notify(f"{e.message}\n{e.hint}", title=f"{what}: {e.title}", severity="error", timeout=10)
        self.draw_current()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_quit(self) -> None:  # type: ignore[override]  # (as action_back)
        self.stop.set()
        self.exit(0)
