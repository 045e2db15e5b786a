"""Rank detail (enter on a rank, esc back): one rank's phases per step, its collectives over those
steps, and its GPU now. The detail is loaded by the app's worker and comes in `View.detail`."""

from __future__ import annotations

import numpy as np
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui import core
from tui.screens import View
from tui.screens.ranks import RanksState

STEP_COLUMNS = ("step", "step_ms", "data_wait_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_exposed_ms",
                "compute_ms", "wait_ms", "collectives", "mem_bytes")


class RankDetailPane(VerticalScroll):
    def __init__(self, state: RanksState, **kw) -> None:
        super().__init__(**kw)
        self.state = state

    def compose(self) -> ComposeResult:
        yield Static("", id="detail")

    def draw(self, view: View) -> None:
        r = self.state.detail_rank
        if r is None:
            return
        rt = self.state.table(view.snap)
        i = np.flatnonzero(rt.rank == r)
        where = ""
        if i.size:
            k = int(i[0])
            where = f"stage {rt.stage[k]} · replica {rt.replica[k]} · tp {rt.tp_rank[k]} · node {rt.node[k]}"
        out = Table.grid()
        out.add_row(core.plain(f"rank {r} · {where} · steps to {view.snap.step} (esc back)\n", style="bold"))
        d = view.detail
        if d is None:
            out.add_row(Text("loading…", style="dim"))
        else:
            t = Table(title="phases per step (ms)", title_justify="left", box=None)
            cols = STEP_COLUMNS
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
                ct.add_row(core.plain(row["op"]), core.plain(row["role"]), str(row["calls"]), core.fmt_num(row["bytes"], "B"),
                           core.fmt_num(row["total_ms"], "", 1), core.fmt_num(row["duration_ms_p99"], "", 2))
            out.add_row(ct)
            gpu = view.snap.table("ranks")
            g = [x for x in gpu.to_pylist() if x["rank"] == r]
            if g:
                out.add_row(Text(f"\nGPU util now: {core.fmt_num(g[0]['gpu_util_pct'], '%')} · memory now: "
                                 f"{core.fmt_num(g[0]['mem_bytes'], 'B')}"))
        self.query_one("#detail", Static).update(out)
