"""2 Ranks: every rank (or replica, or node) as a heatmap cell, the worst ranks beside it; the
state its keys change (m metric, a level, s sort, enter / esc drill) is `RanksState`, shared with
the rank detail screen."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Static

from collector.query import snapshot as snapmod
from tui import core
from tui.screens import View
from tui.widgets import DataTable, HeatmapView

SORTS = ("z", "rank", "value")


@dataclass
class RanksState:
    metric: str = "compute"
    level: str = "auto"
    sort: str = "z"
    drill: list[tuple] = field(default_factory=list)  # stack of drilled-into cell keys
    detail_rank: int | None = None
    # the rank table of the snapshot shown, for the metric shown (both screens draw from it)
    _table: core.RankTable | None = field(default=None, repr=False)
    _table_of: snapmod.Snapshot | None = field(default=None, repr=False)

    def next_metric(self) -> None:
        order = core.METRIC_ORDER
        self.metric = order[(order.index(self.metric) + 1) % len(order)]

    def next_level(self) -> None:
        order = ("auto", *core.LEVELS)
        self.level = order[(order.index(self.level) + 1) % len(order)]
        self.drill = []

    def next_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]

    def table(self, snap: snapmod.Snapshot) -> core.RankTable:
        """The rank table of `snap` for the metric shown (built once per snapshot and metric)."""
        if self._table is None or self._table_of is not snap or self._table.metric != self.metric:
            self._table, self._table_of = core.rank_table(snap, self.metric), snap
        return self._table

    def mask(self, rt: core.RankTable, text: str) -> np.ndarray:
        """The ranks shown: the filter's, within the cell drilled into."""
        mask = core.filter_mask(rt, text)
        if self.drill:
            mask &= core.drill_mask(rt, self.drill[-1])
        return mask

    def level_of(self, rt: core.RankTable, mask: np.ndarray) -> str:
        """The aggregation level shown: ranks inside a drill-down, else the chosen one (auto: by count)."""
        if self.drill:
            return "rank"
        if self.level != "auto":
            return self.level
        n_cells = int(np.unique(rt.stage[mask] * (int(rt.replica.max(initial=0)) + 1) + rt.replica[mask]).size)
        return core.auto_level(int(mask.sum()), n_cells)


class RanksPane(Vertical):
    DEFAULT_CSS = """
    #ranks-side { width: 62; }
    #ranks-status { height: 3; padding: 0 1; }
    """

    class Drill(Message):
        """Enter (or a double click) on a cell or on a row of the side table: drill into `key`."""

        def __init__(self, key: tuple) -> None:
            super().__init__()
            self.key = key

    def __init__(self, state: RanksState, **kw) -> None:
        super().__init__(**kw)
        self.state = state

    def on_heatmap_view_selected(self, event: HeatmapView.Selected) -> None:
        event.stop()
        self.post_message(self.Drill(event.cell.key))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.data_table.id == "ranks-side" and event.row_key.value is not None:
            self.post_message(self.Drill(("rank", int(event.row_key.value))))

    def compose(self) -> ComposeResult:
        yield Static("", id="ranks-status")
        with Horizontal():
            yield HeatmapView(id="heatmap")
            yield DataTable(id="ranks-side", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one("#ranks-side", DataTable).add_columns("rank", "stage", "dp", "tp", "node", "value", "z", "mark")

    def draw(self, view: View) -> None:
        state = self.state
        rt = state.table(view.snap)
        mask = state.mask(rt, view.filter)
        level = state.level_of(rt, mask)
        hm = core.heatmap(rt, level, mask=mask)
        self.query_one("#heatmap", HeatmapView).set_heatmap(hm)
        side = self.query_one("#ranks-side", DataTable)
        side.clear()
        for row in core.worst_rows(rt, sort=state.sort, limit=20, mask=mask):
            *cells, st = row
            cells[-1] = Text(("‼ " if st == core.BAD else core.STATUS_MARK[st] + " ") + cells[-1], style=core.STATUS_STYLE[st])
            side.add_row(*[str(c) if not isinstance(c, Text) else c for c in cells], key=str(row[0]))
        col_, unit, sign, title = core.METRICS[rt.metric]
        strag = core.stragglers(rt)
        st = Text()
        st.append(f"metric (m): {title} · level (a): {level}{' (auto)' if state.level == 'auto' and not state.drill else ''}"
                  f" · {int(mask.sum())}/{rt.n} ranks · sort (s): {state.sort}")
        if state.drill:
            st.append(f" · drilled into {state.drill[-1][0]} {state.drill[-1][1:]} (esc back)")
        if view.filter:
            st.append(f" · filter: {view.filter}")
        st.append("\n")
        st.append(f"display z ≥ {core.Z_MARK:.0f} {'high' if sign > 0 else 'low'} = S straggler: ", style="bold")
        st.append(", ".join(f"rank {r}" for r in strag[:12]) + (" …" if len(strag) > 12 else "") if strag else "none",
                  style=core.STATUS_STYLE[core.BAD if strag else core.OK])
        st.append(f"\ncells: label z mark; marks S straggler ‼ |z|≥{core.Z_MARK:.0f} ! ≥{core.Z_WARN:.0f} ? no data; "
                  "compact: · ░ ▒ ▓ by |z|", style="dim")
        self.query_one("#ranks-status", Static).update(st)
