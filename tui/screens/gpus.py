"""6 GPUs: a tile per GPU, by node (memory, utilisation, temperature, power, throttle and XID), at the
snapshot's step (live: the latest; a replay: the step under the cursor), with its hardware risk in a
replay (the hardware_risk view over the day before the step)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from collector.query import snapshot as snapmod
from tui import core
from tui.screens import View

#: Nodes drawn at most (the rest: / filters by node name).
MAX_NODES = 64


def gpu_tile(g: core.GpuTile, risk: core.GpuRisk | None = None) -> Text:
    tile = Text()
    tile.append(f"GPU{g.gpu} ", style="bold")
    tile.append(f"{core.STATUS_MARK[g.status]}{core.STATUS_WORD[g.status]}\n", style=core.STATUS_STYLE[g.status])
    frac_m = g.mem_used_bytes / g.mem_total_bytes if g.mem_total_bytes else float("nan")
    tile.append(f"MEM {core.bar(frac_m, 10)} {core.fmt_num(g.mem_used_bytes, 'B', 0)}/"
                f"{core.fmt_num(g.mem_total_bytes, 'B', 0)}\n")
    tile.append(f"UTL {core.bar(g.util_pct / 100, 10)} {core.fmt_num(g.util_pct, '%', 0)}\n")
    tile.append(f"{core.fmt_num(g.temp_c, '', 0)}°C {core.fmt_num(g.power_w, 'W', 0)} thr {g.throttle} "
                f"xid {g.xid}\n")
    if risk is not None:
        st = core.RISK_STATUS.get(risk.level, core.MISSING)
        tile.append(f"risk {risk.risk:.2f} {risk.level}", style=core.STATUS_STYLE[st])
        tile.append(f" {risk.evidence}\n" if risk.evidence else "\n", style=core.STATUS_STYLE[st])
    if g.reasons:
        tile.append(", ".join(g.reasons), style=core.STATUS_STYLE[g.status])
    return tile


class GpusPane(VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Static("", id="gpu-tiles")
        yield Static("", id="gpu-frag")

    def draw(self, view: View) -> None:
        tiles = core.gpu_tiles(view.snap)
        flt = view.filter
        out = Table.grid(padding=(0, 1))
        risks = core.gpu_risks(view.snap)
        if not tiles:
            when = "the last" if view.live else f"step {view.snap.step}'s last"
            out.add_row(Text(f"no GPU samples in {when} {snapmod.GPU_WINDOW_S:.0f} s (no node agent on the run's "
                             "nodes, or it has no NVML)", style="dim"))
        shown = 0
        for node, gpus in tiles.items():
            if flt and flt.lower() not in node.lower():
                continue
            if shown >= MAX_NODES:
                out.add_row(Text(f"… {len(tiles)} nodes in all: / to filter by node", style="dim"))
                break
            out.add_row(Text(f"node {node}", style="bold"))
            row = Table.grid(padding=(0, 2))
            cells = [gpu_tile(g, risks.get((g.node, g.gpu))) for g in gpus]
            for a in range(0, len(cells), 4):
                row.add_row(*cells[a:a + 4])
            out.add_row(row)
            shown += 1
        self.query_one("#gpu-tiles", Static).update(out)
        self.query_one("#gpu-frag", Static).update(fragmentation_panel(view))


#: Ranks the fragmentation panel lists at most (the highest share first).
MAX_FRAG_RANKS = 16
_SPARK = "▁▂▃▄▅▆▇█"


def fragmentation_panel(view: View) -> Text:
    """Beside the tiles' memory bars: each rank's allocator fragmentation (reserved − allocated, as a
    share of reserved) over the window's steps, a sparkline from 0 to 100% and the last value."""
    measured, shares = core.fragmentation(view.snap)
    t = Text()
    t.append("\nmemory fragmentation by rank (reserved − allocated, share of reserved) over recent steps\n", style="bold")
    if not shares:
        why = ("CPU ranks: the hooks record the resident set, not the bytes of the live tensors"
               if measured.startswith("cpu") else "no memory rows in these steps")
        t.append(f"  not measured: {why}\n", style="dim")
        return t
    ranked = sorted(shares.items(), key=lambda kv: -kv[1][-1])
    for rank, vals in ranked[:MAX_FRAG_RANKS]:
        last = vals[-1]
        style = "red" if last >= 0.5 else "dark_orange" if last >= 0.25 else ""
        t.append(f"  rank {rank:>5}  ")
        t.append("".join(_SPARK[min(int(v * 8), 7)] for v in vals[-40:]), style="dodger_blue1")
        t.append(f"  {last:.0%}\n", style=style)
    if len(ranked) > MAX_FRAG_RANKS:
        t.append(f"  … {len(ranked)} ranks\n", style="dim")
    return t
