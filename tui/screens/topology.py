"""8 Topology: communication by (node, node) link over the collectives' steps: a node x node matrix
coloured by median latency (or bus bandwidth, m), the cross-node share of each group's time, and the
slowest links by group and op (the drill-down). The comm_topology view (collector/query/dashboard.py)
says how a collective is charged to a link."""

from __future__ import annotations

import math

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from collector.query import snapshot as snapmod
from collector.query.dashboard import CROSS_NODE_SHARE
from tui import core
from tui.screens import View
from tui.widgets import DataTable

#: Nodes drawn in the matrix at most (the rest: / filters by node name).
MAX_NODES = 16
_SHADES = ("green", "yellow", "dark_orange", "red")


def _shade(value: float, lo: float, hi: float, higher_is_worse: bool) -> str:
    if math.isnan(value) or hi <= lo:
        return "green"
    frac = (value - lo) / (hi - lo)
    frac = frac if higher_is_worse else 1 - frac
    return _SHADES[min(int(frac * len(_SHADES)), len(_SHADES) - 1)]


def matrix(nodes: list[str], links: dict[tuple[str, str], core.Link], metric: str) -> Table:
    """The node x node table: rows send, columns receive; a cell is its link's latency or busbw."""
    t = Table(title=f"{'latency p50' if metric == 'latency' else 'busbw p50'}, row → column",
              title_justify="left", show_lines=False)
    t.add_column("from \\ to", style="bold")
    for n in nodes:
        t.add_column(n, justify="right")
    vals = [getattr(lk, "latency_ms" if metric == "latency" else "busbw_gbps") for lk in links.values()]
    vals = [v for v in vals if not math.isnan(v)]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 0.0)
    for a in nodes:
        cells: list[Text | str] = [a]
        for b in nodes:
            lk = links.get((a, b))
            if lk is None:
                cells.append(Text("·", style="dim"))
                continue
            v = lk.latency_ms if metric == "latency" else lk.busbw_gbps
            label = core.fmt_num(v, "ms", 2) if metric == "latency" else core.fmt_num(v, "GB/s", 3)
            cells.append(Text(f"{label} ({lk.calls})", style=_shade(v, lo, hi, metric == "latency")))
        t.add_row(*cells)
    return t


class TopologyPane(VerticalScroll):
    metric = "latency"

    def compose(self) -> ComposeResult:
        yield Static("", id="topo-matrix")
        yield Static("", id="topo-groups")
        yield DataTable(id="topo-links", zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one("#topo-links", DataTable).add_columns("group", "op", "link", "calls", "bytes (all)", "p50", "busbw")

    def draw(self, view: View) -> None:
        nodes, links = core.topology(view.snap)
        flt = view.filter.lower()
        if flt:
            nodes = [n for n in nodes if flt in n.lower()]
        top = Text()
        if not links:
            big = view.live and view.snap.header.get("ranks_started", 0) > snapmod.LIVE_MAX_RANKS["topology"]
            top.append(f"not drawn live above {snapmod.LIVE_MAX_RANKS['topology']} ranks: replay the run's file\n"
                       if big else "no collectives in these steps\n", style="dim")
            self.query_one("#topo-matrix", Static).update(top)
        else:
            shown = nodes[:MAX_NODES]
            out = Table.grid()
            out.add_row(matrix(shown, {k: v for k, v in links.items() if k[0] in shown and k[1] in shown}, self.metric))
            if len(nodes) > MAX_NODES:
                out.add_row(Text(f"… {len(nodes)} nodes: / to filter by node", style="dim"))
            self.query_one("#topo-matrix", Static).update(out)
        g = Text()
        g.append("cross-node share of each group's time (bytes)\n", style="bold")
        for role, grp, n_nodes, time_ms, share, bshare in core.group_shares(view.snap)[:12]:
            over = share > CROSS_NODE_SHARE and any(r in ("dp", "tp") for r in role.split("|"))
            g.append(f"  {grp:<24} {n_nodes} node{'s' if n_nodes != 1 else ''}  {core.fmt_num(time_ms, 'ms', 0):>9}  "
                     f"{share:5.0%} ({bshare:.0%})", style="bold red" if over else "")
            g.append(f"  ‼ above {CROSS_NODE_SHARE:.0%}\n" if over else "\n", style="bold red")
        g.append("\nthe slowest links (group, op):", style="bold")
        self.query_one("#topo-groups", Static).update(g)
        table = self.query_one("#topo-links", DataTable)
        table.clear()
        for row in core.slowest_links(view.snap):
            table.add_row(*row)
