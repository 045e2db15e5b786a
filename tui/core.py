"""What each screen shows, from a snapshot: rows, cells, words and colours. No UI, no I/O.

Every function here takes plain data (a collector.query.snapshot.Snapshot: a header and pyarrow tables)
and returns plain records; the widgets in tui/app.py only draw them. Colour never carries meaning
alone: every coloured thing also has a word or a mark (`STATUS_MARK`).

Robust z-scores ("display z"): z = (x - median) / max(1.4826 * MAD, 5% of |median|, 1e-9), over
the rank's peers: its pipeline stage when every stage has at least PEER_MIN ranks, else the whole
run (stages do different work, but a 4-rank run has too few peers per stage for a median). The
floor keeps ranks that differ by noise from being marked. A rank is marked a straggler on the
chosen metric when its z is at least Z_MARK in the metric's bad direction (compute, step time and
memory high; collective wait and GPU utilisation low: the straggler computes longest and waits
least, DESIGN §3). The live engine's alert-based straggler flag (k consecutive steps) comes with
its alerts; this mark is one step's display.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracetop.text import printable

# ---- words and colours ---------------------------------------------------------------------

OK, WARN, BAD, MISSING = "ok", "warn", "bad", "missing"
STATUS_STYLE = {OK: "green", WARN: "dark_orange", BAD: "bold red", MISSING: "grey50"}
#: The mark that goes with each status wherever a colour does.
STATUS_MARK = {OK: " ", WARN: "!", BAD: "‼", MISSING: "?"}
STATUS_WORD = {OK: "ok", WARN: "warning", BAD: "danger", MISSING: "no data"}

Z_MARK = 3.0
Z_WARN = 2.0
PEER_MIN = 8

#: metric key -> (column in the ranks section, unit, bad direction (+1 high is bad, -1 low is bad), title)
METRICS: dict[str, tuple[str, str, int, str]] = {
    "compute": ("compute_ms", "ms", +1, "compute (fwd+bwd+opt)"),
    "wait": ("wait_ms", "ms", -1, "collective wait"),
    "step": ("step_ms", "ms", +1, "step time"),
    "memory": ("mem_bytes", "B", +1, "memory"),
    "gpu": ("gpu_util_pct", "%", -1, "GPU util"),
}
METRIC_ORDER = tuple(METRICS)
LEVELS = ("rank", "replica", "node")

BUBBLE_WARN = 0.20
BUBBLE_BAD = 0.30
GRAD_SYNC_LINE_MS = 200.0


def plain(value: Any, style: str = "") -> Any:
    """What a rank sent (a hostname, an op, a role, a rule's message), shown as it is: a Rich Text,
    so no ``[...]`` in it is read as markup (``[/]`` raised, ``[@click=...]`` ran an action), with
    every control character shown as U+FFFD instead of sent to the terminal."""
    from rich.text import Text

    return Text(printable(str(value)), style=style)


def fmt_num(x: float | None, unit: str = "", digits: int = 1) -> str:
    """A number for a person: NaN/None → '–'; bytes scaled to KiB..TiB."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if unit == "B":
        v = float(x)
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(v) < 1024 or u == "TiB":
                return f"{v:.{digits}f} {u}" if u != "B" else f"{v:.0f} B"
            v /= 1024
    if unit == "%":
        return f"{x:.{digits}f}%"
    return f"{x:,.{digits}f}{(' ' + unit) if unit else ''}"


def col(table, name: str, dtype: Any = float) -> np.ndarray:
    """A column as numpy (NULL → NaN for floats); an absent column → all NaN."""
    n = table.num_rows
    if name not in table.column_names:
        return np.full(n, np.nan) if dtype is float else np.zeros(n, dtype=dtype)
    c = table.column(name)
    if dtype is float:
        return np.asarray(c.to_numpy(zero_copy_only=False), dtype=float)
    if dtype is str:
        return np.asarray(c.to_numpy(zero_copy_only=False), dtype=object)
    return np.asarray(c.fill_null(-1).to_numpy(zero_copy_only=False), dtype=dtype)


# ---- robust z-scores -------------------------------------------------------------------------

def robust_z(values: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
    """Robust z-scores of `values` within each group (NaN stays NaN). See the module docstring."""
    values = np.asarray(values, dtype=float)
    z = np.full(values.shape, np.nan)
    if groups is None:
        groups = np.zeros(values.shape, dtype=np.int64)
    for g in np.unique(groups):
        idx = np.flatnonzero((groups == g) & ~np.isnan(values))
        if idx.size == 0:
            continue
        x = values[idx]
        med = float(np.median(x))
        mad = float(np.median(np.abs(x - med)))
        scale = max(1.4826 * mad, 0.05 * abs(med), 1e-9)
        z[idx] = (x - med) / scale
    return z


def peer_groups(stage: np.ndarray) -> np.ndarray | None:
    """Stages as peer groups when each has at least PEER_MIN ranks, else None (the whole run)."""
    if stage.size == 0:
        return None
    _, counts = np.unique(stage, return_counts=True)
    return stage if counts.min() >= PEER_MIN else None


# ---- the Ranks screen -------------------------------------------------------------------------

@dataclass(frozen=True)
class RankTable:
    """The ranks section as numpy columns, with the chosen metric's z-scores."""

    rank: np.ndarray
    stage: np.ndarray
    replica: np.ndarray
    tp_rank: np.ndarray
    node: np.ndarray      # object array of str
    value: np.ndarray     # the metric, NaN where the rank has not reported
    z: np.ndarray
    metric: str

    @property
    def n(self) -> int:
        return int(self.rank.size)

    def badness(self) -> np.ndarray:
        """z in the metric's bad direction (larger is worse), NaN → -inf."""
        b = self.z * METRICS[self.metric][2]
        return np.where(np.isnan(b), -np.inf, b)


def rank_table(snap, metric: str = "compute") -> RankTable:
    t = snap.table("ranks")
    column = METRICS[metric][0]
    stage = col(t, "stage", np.int64)
    value = col(t, column)
    return RankTable(
        rank=col(t, "rank", np.int64), stage=stage, replica=col(t, "replica", np.int64),
        tp_rank=col(t, "tp_rank", np.int64), node=col(t, "node", str), value=value,
        z=robust_z(value, peer_groups(stage)), metric=metric,
    )


def stragglers(rt: RankTable, z_mark: float = Z_MARK) -> list[int]:
    """Ranks whose z is at least z_mark in the metric's bad direction, worst first."""
    b = rt.badness()
    idx = np.flatnonzero(b >= z_mark)
    return [int(rt.rank[i]) for i in idx[np.argsort(-b[idx])]]


def z_status(badness: float) -> str:
    if badness is None or math.isnan(badness) or badness == -math.inf:
        return MISSING
    if badness >= Z_MARK:
        return BAD
    if badness >= Z_WARN:
        return WARN
    return OK


#: Density glyphs by |z| (so the heatmap reads without colour too): <1, <2, <3, >=3.
Z_GLYPHS = ("·", "░", "▒", "▓")


def z_glyph(z: float) -> str:
    if z is None or math.isnan(z):
        return "?"
    a = abs(z)
    return Z_GLYPHS[0 if a < 1 else 1 if a < 2 else 2 if a < 3 else 3]


@dataclass(frozen=True)
class Cell:
    key: tuple            # ("rank", r) | ("replica", stage, replica) | ("node", name)
    label: str
    value: float          # the metric (median over the cell's ranks)
    z: float              # the cell's worst rank's z
    ranks: int
    worst_rank: int
    status: str
    straggler: bool

    @property
    def mark(self) -> str:
        return "S" if self.straggler else STATUS_MARK[self.status]


@dataclass(frozen=True)
class Heatmap:
    level: str
    metric: str
    groups: list[tuple[str, list[Cell]]] = field(default_factory=list)  # row label, cells in order

    @property
    def cells(self) -> list[Cell]:
        return [c for _, cells in self.groups for c in cells]


def auto_level(n_ranks: int, n_replica_cells: int) -> str:
    """The finest level that stays readable: ranks up to 512, else replicas up to 2,048 cells, else nodes."""
    if n_ranks <= 512:
        return "rank"
    if n_replica_cells <= 2048:
        return "replica"
    return "node"


def filter_mask(rt: RankTable, text: str) -> np.ndarray:
    """`/` filter on ranks: space-separated terms, all must hold. `stage=1`, `replica=0`, `tp=2`,
    `rank=3` (or a bare number), `node=NAME`, `z>3`; any other word matches node names."""
    mask = np.ones(rt.n, dtype=bool)
    for term in text.split():
        key, op, val = _split_term(term)
        if key is None:
            if term.isdigit():
                mask &= rt.rank == int(term)
            else:
                mask &= np.array([term.lower() in str(n).lower() for n in rt.node], dtype=bool)
            continue
        if key == "z":
            b = rt.badness()
            try:
                v = float(val)
            except ValueError:
                continue
            mask &= (b > v) if op == ">" else (b < v) if op == "<" else np.isclose(b, v)
            continue
        arr = {"stage": rt.stage, "replica": rt.replica, "dp": rt.replica, "tp": rt.tp_rank, "rank": rt.rank}.get(key)
        if arr is None and key == "node":
            mask &= np.array([str(n) == val for n in rt.node], dtype=bool)
            continue
        if arr is None or not val.lstrip("-").isdigit():
            continue
        v = int(val)
        mask &= (arr > v) if op == ">" else (arr < v) if op == "<" else (arr == v)
    return mask


def _split_term(term: str) -> tuple[str | None, str, str]:
    for op in ("=", ">", "<"):
        if op in term:
            k, _, v = term.partition(op)
            return k.strip().lower(), op, v.strip()
    return None, "", ""


def heatmap(rt: RankTable, level: str, *, mask: np.ndarray | None = None) -> Heatmap:
    """Cells laid out by (pipeline stage × data-parallel replica × tensor rank): one group (row)
    per stage; at `replica` level a cell is a (stage, replica) over its tensor ranks; at `node`
    level a cell is a node (one group). A cell's z is its worst rank's."""
    sel = np.flatnonzero(mask) if mask is not None else np.arange(rt.n)
    bad = rt.badness()
    if sel.size == 0:
        return Heatmap(level, rt.metric, [])
    if level == "rank":
        order = sel[np.lexsort((rt.tp_rank[sel], rt.replica[sel], rt.stage[sel]))]
        groups: list[tuple[str, list[Cell]]] = []
        stages = rt.stage[order]
        bounds = np.flatnonzero(np.diff(stages)) + 1
        for chunk in np.split(order, bounds):
            cells = []
            for i in chunk:
                b = float(bad[i])
                st = z_status(b)
                cells.append(Cell(("rank", int(rt.rank[i])), f"r{int(rt.rank[i])}", float(rt.value[i]), float(rt.z[i]),
                                  1, int(rt.rank[i]), st, st == BAD))
            groups.append((f"stage {int(rt.stage[chunk[0]])}", cells))
        return Heatmap(level, rt.metric, groups)
    if level == "replica":
        keys = np.stack([rt.stage[sel], rt.replica[sel]], axis=1)
        title = "stage {}"
    elif level == "node":
        _, node_codes = np.unique(rt.node[sel].astype(str), return_inverse=True)
        keys = np.stack([np.zeros(sel.size, dtype=np.int64), node_codes.astype(np.int64)], axis=1)
        title = "nodes"
    else:
        raise ValueError(f"level {level!r}: one of {', '.join(LEVELS)}")
    # Vectorised per cell (16,384 ranks → 2,048 cells in a few ms): sort by (cell, badness desc),
    # so each cell's first row is its worst rank; the value is the cell's mean (NaN ignored).
    s_bad_all = bad[sel]
    order = np.lexsort((-s_bad_all, keys[:, 1], keys[:, 0]))
    s_sel, s_keys = sel[order], keys[order]
    change = np.flatnonzero(np.any(np.diff(s_keys, axis=0) != 0, axis=1)) + 1
    starts = np.concatenate([[0], change]).astype(np.int64)
    ends = np.concatenate([change, [s_sel.size]]).astype(np.int64)
    vals = rt.value[s_sel]
    ok = ~np.isnan(vals)
    sums = np.add.reduceat(np.where(ok, vals, 0.0), starts)
    cnts = np.add.reduceat(ok.astype(np.int64), starts)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(cnts > 0, sums / np.maximum(cnts, 1), np.nan)
    worst = s_sel[starts]
    groups_d: dict[int, list[Cell]] = {}
    names = rt.node
    for j in range(starts.size):
        w = int(worst[j])
        b = float(bad[w])
        st = z_status(b)
        g0, g1 = int(s_keys[starts[j], 0]), int(s_keys[starts[j], 1])
        if level == "replica":
            key: tuple = ("replica", g0, g1)
            label = f"d{g1}"
        else:
            name = str(names[w])
            key, label = ("node", name), name
        groups_d.setdefault(g0, []).append(
            Cell(key, label, float(means[j]), float(rt.z[w]), int(ends[j] - starts[j]), int(rt.rank[w]), st, st == BAD))
    return Heatmap(level, rt.metric, [(title.format(g), cells) for g, cells in groups_d.items()])


def drill_mask(rt: RankTable, key: tuple) -> np.ndarray:
    """The ranks inside an aggregated cell."""
    if key[0] == "replica":
        return (rt.stage == key[1]) & (rt.replica == key[2])
    if key[0] == "node":
        return np.array([str(n) == key[1] for n in rt.node], dtype=bool)
    return rt.rank == key[1]


def cell_text(c: Cell, metric: str, width: int) -> str:
    """A cell's text at a given width: always carries the mark (colour never alone)."""
    if width <= 2:
        return ("S" if c.straggler else z_glyph(c.z)) + (" " if width == 2 else "")
    z = "  –  " if math.isnan(c.z) else f"{c.z:+5.1f}"
    text = f"{c.label:>6} {z}{c.mark}"
    return text[:width].ljust(width)


def worst_rows(rt: RankTable, *, sort: str = "z", limit: int = 20, mask: np.ndarray | None = None) -> list[tuple]:
    """The side table: (rank, stage, replica, tp, node, value text, z text, status) rows."""
    idx = np.flatnonzero(mask) if mask is not None else np.arange(rt.n)
    bad = rt.badness()[idx]
    if sort == "rank":
        order = idx[np.argsort(rt.rank[idx], kind="stable")]
    elif sort == "value":
        v = rt.value[idx] * METRICS[rt.metric][2]
        order = idx[np.argsort(-np.where(np.isnan(v), -np.inf, v), kind="stable")]
    else:
        order = idx[np.argsort(-bad, kind="stable")]
    unit = METRICS[rt.metric][1]
    all_bad = rt.badness()
    out = []
    for i in order[:limit]:
        st = z_status(float(all_bad[i]))
        out.append((int(rt.rank[i]), int(rt.stage[i]), int(rt.replica[i]), int(rt.tp_rank[i]), str(rt.node[i]),
                    fmt_num(float(rt.value[i]), unit), "–" if math.isnan(rt.z[i]) else f"{rt.z[i]:+.1f}",
                    ("STRAGGLER" if st == BAD else STATUS_WORD[st]), st))
    return out


# ---- the Overview -------------------------------------------------------------------------------

def _last(table, name: str) -> float:
    v = col(table, name)
    return float(v[-1]) if v.size else float("nan")


def header_line(snap) -> str:
    h = snap.header
    zero = h.get("zero_stage", -1)
    return (f"run {h.get('run_id', '?')} · TP{h.get('tp', 1)} × PP{h.get('pp', 1)} × DP{h.get('dp', 1)} · "
            f"ZeRO {zero if zero >= 0 else '?'} · offload {h.get('offload', 'none')} · model {h.get('model_name') or '?'} · "
            f"{h.get('ranks_started', 0)}/{h.get('world_size', 0)} ranks · {h.get('nodes', 0)} node"
            f"{'s' if h.get('nodes', 0) != 1 else ''}")


def judged_line(snap) -> str:
    """Where the live judgments stand on part of the run (a live snapshot's `live_judged`): steps
    judged at the deadline without every rank, steps skipped unjudged to keep up. '' when every
    step was judged on every rank (and for a file: the recompute says it in each alert)."""
    j = snap.header.get("live_judged") if snap is not None else None
    if not j:
        return ""
    parts = []
    n = int(j.get("steps_incomplete", 0))
    if n:
        parts.append(f"{n:,} step{'s' if n != 1 else ''} judged on part of the ranks "
                     f"(latest {int(j.get('last_incomplete_step', -1))})")
    k = int(j.get("steps_skipped", 0))
    if k:
        parts.append(f"{k:,} step{'s' if k != 1 else ''} skipped unjudged to keep up")
    return " · ".join(parts)


def behind_line(snap) -> str:
    """While the collector says it is behind (a live snapshot's `collector_behind`, CollectorLag's
    fields): how far, so that what is shown is read as late. '' otherwise (and for a file)."""
    lag = snap.header.get("collector_behind") if snap is not None else None
    if not lag:
        return ""
    held = int(lag.get("streams_held", 0))
    return (f"collector behind {float(lag.get('behind_s', 0)):.0f} s: oldest batch waited "
            f"{float(lag.get('oldest_wait_s', 0)):.1f} s"
            + (f", {held} stream{'s' if held != 1 else ''} held" if held else "")
            + f", {int(lag.get('rows_not_stored', 0)):,} rows not stored (gap rows); what is shown is late")


@dataclass(frozen=True)
class Figure:
    label: str
    value: str
    status: str = OK
    note: str = ""


def overview_figures(snap) -> list[Figure]:
    """The Overview's figures at the snapshot's step."""
    h = snap.header
    steps = snap.table("steps")
    ranks = snap.table("ranks")
    step_ms = _last(steps, "step_ms_p50")
    step_max = _last(steps, "step_ms_max")
    # Every rank of a model replica (its TP × PP ranks) reports the replica's tokens and samples,
    # so the run's figures are the sums over ranks divided by TP × PP.
    replica_ranks = max(int(h.get("tp", 1)) * int(h.get("pp", 1)), 1)
    tokens = _last(steps, "tokens") / replica_ranks
    tps = _last(steps, "tokens_per_s") / replica_ranks
    if math.isnan(tps) and step_ms > 0 and not math.isnan(tokens):
        tps = tokens / (step_max / 1e3)
    samples = _last(steps, "samples") / replica_ranks
    n_ranks = max(int(h.get("world_size", 0)) or ranks.num_rows, 1)
    sps_gpu = samples / (step_max / 1e3) / n_ranks if step_max and step_max > 0 and not math.isnan(samples) else float("nan")
    mfu = _last(steps, "mfu")
    compute = col(ranks, "compute_ms")
    exposed = col(ranks, "comm_exposed_ms")
    eff = float(np.nansum(compute) / (np.nansum(compute) + np.nansum(exposed))) if np.nansum(compute) > 0 else float("nan")
    grad = _last(steps, "grad_sync_ms_p99")
    grad_status = MISSING if math.isnan(grad) else BAD if grad > GRAD_SYNC_LINE_MS else OK
    rep = int(np.nansum(col(ranks, "reported")))
    lost = lost_figure(snap)
    return [
        Figure("step", f"{h.get('step', -1)}", OK, f"of {h.get('first_step', 0)}..{h.get('last_step', -1)}"),
        Figure("ranks reporting", f"{rep}/{ranks.num_rows}", OK if rep == ranks.num_rows else WARN),
        Figure("step time p50 / max", f"{fmt_num(step_ms, 'ms')} / {fmt_num(step_max, 'ms')}"),
        Figure("tokens/s", fmt_num(tps, "", 0)),
        Figure("samples/s per GPU", fmt_num(sps_gpu, "", 2)),
        Figure("MFU", "–" if math.isnan(mfu) else f"{mfu * 100:.1f}%", MISSING if math.isnan(mfu) else OK,
               "" if not math.isnan(mfu) else "needs declared FLOPs and device peak"),
        Figure("scaling eff. (compute / compute+exposed comm)", "–" if math.isnan(eff) else f"{eff * 100:.1f}%"),
        Figure("grad-sync p99", fmt_num(grad, "ms"), grad_status,
               f"line {GRAD_SYNC_LINE_MS:.0f} ms: " + ("ABOVE" if grad_status == BAD else "below" if grad_status == OK else "no dp collectives")),
        *([lost] if lost else []),
    ]


def _span(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def lost_figure(snap) -> Figure | None:
    """'lost in the last 10 min: 3.2 GPU-h, 81% rank 3' from the snapshot's `lost` section (GPU time
    lost to stragglers, data, pipeline waiting and exposed comm: the lost_time view's definition)."""
    t = snap.table("lost")
    if t.num_rows == 0:
        return None
    rows = t.to_pylist()
    total = next((r for r in rows if r["rank"] is None), None)
    if total is None or not total["steps"]:
        return None
    lost_ms = float(total["lost_gpu_ms"] or 0.0)
    window = float(snap.header.get("lost_window_s", 600.0))
    covered = (int(total["last_end_ns"]) - int(total["first_end_ns"])) / 1e9
    label = f"lost in the last {_span(window if covered >= 0.9 * window else covered)}"
    gpu_h = lost_ms / 3.6e6
    value = f"{gpu_h:.1f} GPU-h" if gpu_h >= 0.95 else f"{gpu_h:.2g} GPU-h"
    top = next((r for r in rows if r["rank"] is not None), None)
    note = ""
    if top is not None and lost_ms > 0:
        share = float(top["lost_gpu_ms"]) / lost_ms
        causes = {c: float(total[c + "_gpu_ms"] or 0.0) for c in ("straggler", "data", "pipeline", "comm")}
        note = f"{share:.0%} rank {top['rank']}; most to {max(causes, key=lambda c: causes[c])}"
    return Figure(label, value, WARN if top is not None and lost_ms > 0 and share >= 0.5 else OK, note)


PHASES = ("data_wait_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_exposed_ms")
PHASE_GLYPH = {"data_wait_ms": "d", "forward_ms": "F", "backward_ms": "B", "optimizer_ms": "O", "comm_exposed_ms": "c"}
PHASE_STYLE = {"data_wait_ms": "grey62", "forward_ms": "dodger_blue1", "backward_ms": "medium_purple1",
               "optimizer_ms": "gold1", "comm_exposed_ms": "indian_red"}


def phase_rows(snap, width: int = 40, last: int = 12) -> list[tuple[int, float, list[tuple[str, int, str]]]]:
    """Recent steps: (step, step_ms p50, [(phase glyph, chars, style)]) with bars scaled to the
    longest step shown. Glyphs name the phase so the bar reads without colour."""
    steps = snap.table("steps")
    if steps.num_rows == 0:
        return []
    s = col(steps, "step", np.int64)[-last:]
    total = col(steps, "step_ms_p50")[-last:]
    parts = {p: col(steps, p)[-last:] for p in PHASES}
    scale = width / max(float(np.nanmax(total)) if np.any(~np.isnan(total)) else 1.0, 1e-9)
    out = []
    for i in range(s.size):
        segs = []
        for p in PHASES:
            v = parts[p][i]
            n = 0 if math.isnan(v) else int(round(v * scale))
            if n:
                segs.append((PHASE_GLYPH[p], n, PHASE_STYLE[p]))
        out.append((int(s[i]), float(total[i]), segs))
    return out


# ---- Pipeline -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BubbleRow:
    stage: int
    rate: float
    ideal: float
    status: str

    def bar(self, width: int = 30) -> str:
        n = 0 if math.isnan(self.rate) else max(0, min(width, int(round(self.rate * width))))
        ideal_at = None if math.isnan(self.ideal) else min(width - 1, int(round(self.ideal * width)))
        chars = ["█" if i < n else "·" for i in range(width)]
        if ideal_at is not None:
            chars[ideal_at] = "|"
        return "".join(chars)


def bubble_status(rate: float) -> str:
    if math.isnan(rate):
        return MISSING
    return BAD if rate > BUBBLE_BAD else WARN if rate > BUBBLE_WARN else OK


def ideal_bubble(pp: int, micro_batches: int) -> float:
    """(p-1)/(m+p-1): the balanced-1F1B floor."""
    if pp <= 1 or micro_batches <= 0:
        return 0.0
    return (pp - 1) / (micro_batches + pp - 1)


def bubble_rows(snap) -> list[BubbleRow]:
    t = snap.table("bubble")
    if t.num_rows == 0:
        return []
    steps = col(t, "step", np.int64)
    at = snap.step if snap.step in set(steps.tolist()) else int(steps.max())
    sel = steps == at
    st, rate, ideal = col(t, "stage", np.int64)[sel], col(t, "bubble_rate")[sel], col(t, "ideal_bubble_rate")[sel]
    return [BubbleRow(int(s), float(r), float(i), bubble_status(float(r))) for s, r, i in sorted(zip(st, rate, ideal))]


INSTR_GLYPH = {"ForwardPass": "F", "BackwardPass": "B", "SendActivation": ">", "RecvActivation": "<",
               "SendGrad": "»", "RecvGrad": "«", "LoadMicroBatch": "L", "OptimizerStep": "O",
               "ReduceGrads": "R", "ReduceTiedGrads": "T"}
INSTR_STYLE = {"F": "dodger_blue1", "B": "medium_purple1", "O": "gold1", "R": "indian_red", "T": "indian_red",
               "L": "grey62"}


def gantt_rows(snap, width: int = 80) -> tuple[float, list[tuple[int, int, str]]]:
    """The snapshot step's schedule: (span_ms, [(stage, rank, line of `width` glyphs)]). Each
    instruction paints its glyph over its time span (F forward, B backward, >/< activations,
    »/« grads, L load, O optimizer, R reduce); idle time stays '·'."""
    t = snap.table("gantt")
    if t.num_rows == 0:
        return 0.0, []
    stage, rank = col(t, "stage", np.int64), col(t, "rank", np.int64)
    start, dur = col(t, "start_ms"), col(t, "duration_ms")
    instr = col(t, "instr", str)
    span = float(np.nanmax(start + dur)) or 1.0
    rows = []
    for s in sorted(set(stage.tolist())):
        line = ["·"] * width
        for i in np.flatnonzero(stage == s):
            g = INSTR_GLYPH.get(str(instr[i]), "?")
            a = int(start[i] / span * width)
            b = max(a + 1, int(math.ceil((start[i] + dur[i]) / span * width)))
            for k in range(a, min(b, width)):
                line[k] = g
        rows.append((int(s), int(rank[np.flatnonzero(stage == s)[0]]), "".join(line)))
    return span, rows


# ---- Collectives, offload ---------------------------------------------------------------------

COLLECTIVE_SORTS = ("p99", "calls", "size", "op")


def collective_rows(snap, *, sort: str = "p99", text: str = "") -> list[tuple]:
    t = snap.table("collectives")
    rows = t.to_pylist()
    if text:
        rows = [r for r in rows if text.lower() in f"{r['op']} {r['role']}".lower()]
    key = {"p99": lambda r: -(r["duration_ms_p99"] or 0), "calls": lambda r: -r["calls"],
           "size": lambda r: -(r["size_bucket_bytes"] or 0), "op": lambda r: (r["op"], r["role"])}[sort]
    rows.sort(key=key)
    return [(r["op"], r["role"], "≥ " + fmt_num(r["size_bucket_bytes"], "B"), str(r["calls"]),
             fmt_num(r["duration_ms_p50"], "ms", 2), fmt_num(r["duration_ms_p99"], "ms", 2),
             fmt_num(r["algbw_gbps"], "GB/s", 3), fmt_num(r["busbw_gbps"], "GB/s", 3)) for r in rows]


def grad_sync_series(snap) -> list[tuple[int, float, str]]:
    t = snap.table("steps")
    out = []
    for s, v in zip(col(t, "step", np.int64), col(t, "grad_sync_ms_p99")):
        st = MISSING if math.isnan(v) else BAD if v > GRAD_SYNC_LINE_MS else OK
        out.append((int(s), float(v), st))
    return out


def offload_series(snap) -> dict[str, list[tuple[int, float]]]:
    t = snap.table("offload_rate")
    out: dict[str, list[tuple[int, float]]] = {}
    for r in t.to_pylist():
        out.setdefault(r["direction"], []).append((int(r["step"]), float(r["gbps"] or 0.0)))
    return out


def offload_last_rows(snap) -> list[tuple]:
    import datetime as dt

    rows = []
    for r in snap.table("offload_last").to_pylist():
        when = dt.datetime.fromtimestamp(r["start_ns"] / 1e9, dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        src, _, dst = {"d2h": "device→host", "h2d": "host→device", "h2nvme": "host→nvme", "nvme2h": "nvme→host",
                       "h2h": "host→host"}.get(r["direction"], r["direction"] + "→?").partition("→")
        rows.append((when, str(r["rank"]), fmt_num(float(r["bytes"]), "B"), src, dst, r["what"],
                     fmt_num(r["duration_ms"], "ms", 2)))
    return rows


# ---- GPUs ---------------------------------------------------------------------------------------

# NVML clock event reasons: which count as a throttle, and how bad.
_THROTTLE_WARN = 0x4 | 0x40          # SW power cap, SW thermal slowdown
_THROTTLE_BAD = 0x8 | 0x80 | 0x100   # HW slowdown, HW thermal, HW power brake


@dataclass(frozen=True)
class GpuTile:
    node: str
    gpu: int
    util_pct: float
    mem_used_bytes: float
    mem_total_bytes: float
    temp_c: float
    power_w: float
    throttle: str
    xid: str
    status: str
    reasons: tuple[str, ...]


def gpu_tiles(snap) -> dict[str, list[GpuTile]]:
    t = snap.table("gpus")
    xids: dict[tuple[str, int], list[str]] = {}
    for r in snap.table("xids").to_pylist():
        xids.setdefault((r["node"], int(r["gpu"])), []).append(str(r["xid"]))
    out: dict[str, list[GpuTile]] = {}
    for r in t.to_pylist():
        reasons = []
        temp = r["temp_c"] if r["temp_c"] is not None else float("nan")
        used, total = r["mem_used_bytes"] or 0.0, r["mem_total_bytes"] or 0.0
        bits = int(r["clock_event_reasons"] or 0)
        ecc = r["ecc_uncorrected"] or 0
        x = xids.get((r["node"], int(r["gpu"])), [])
        status = OK
        if bits & _THROTTLE_BAD or temp >= 85 or ecc > 0 or x:
            status = BAD
        elif bits & _THROTTLE_WARN or temp >= 75 or (total and used / total >= 0.95):
            status = WARN
        if temp >= 75:
            reasons.append(f"{temp:.0f}°C")
        if bits & (_THROTTLE_WARN | _THROTTLE_BAD):
            reasons.append("throttled")
        if ecc > 0:
            reasons.append(f"ECC {ecc:.0f}")
        if x:
            reasons.append("XID " + ",".join(x))
        if total and used / total >= 0.95:
            reasons.append("memory full")
        throttle = "HW" if bits & _THROTTLE_BAD else "SW" if bits & _THROTTLE_WARN else "none"
        out.setdefault(r["node"], []).append(GpuTile(
            r["node"], int(r["gpu"]), float(r["util_pct"] if r["util_pct"] is not None else float("nan")),
            float(used), float(total), float(temp), float((r["power_mw"] or float("nan")) / 1000.0),
            throttle, ",".join(x) or "none", status, tuple(reasons)))
    return out


@dataclass(frozen=True)
class GpuRisk:
    """One GPU's hardware_risk row (collector/query/dashboard.py): level ok / watch / fail_likely."""

    level: str
    risk: float
    evidence: str


RISK_STATUS = {"ok": OK, "watch": WARN, "fail_likely": BAD}


def gpu_risks(snap) -> dict[tuple[str, int], GpuRisk]:
    """(node, gpu) -> its risk, from the snapshot's gpu_risk section (empty live, or in an older one)."""
    out = {}
    for r in snap.table("gpu_risk").to_pylist():
        out[(r["node"], int(r["gpu"]))] = GpuRisk(str(r["level"]), float(r["risk"] or 0.0), str(r["evidence"] or ""))
    return out


def fragmentation(snap) -> tuple[str, dict[int, list[float]]]:
    """(what is measured, rank -> fragmentation share per step over the window) from the
    snapshot's fragmentation section; no ranks where nothing is measured (CPU)."""
    out: dict[int, list[float]] = {}
    measured = ""
    for r in snap.table("fragmentation").to_pylist():
        measured = measured or str(r["measured"] or "")
        if r["frag_share"] is not None:
            out.setdefault(int(r["rank"]), []).append(float(r["frag_share"]))
    return measured, out


def bar(frac: float, width: int) -> str:
    if frac is None or math.isnan(frac):
        return "?" * width
    n = max(0, min(width, int(round(frac * width))))
    return "█" * n + "░" * (width - n)


# ---- Alerts & actions ------------------------------------------------------------------------------

#: the cause an incident names, by its cause alert's signal (collector/live/model.py CAUSES)
_CAUSES = {"straggler": "compute", "data_stall": "data", "stuck_collective": "hang", "silent_rank": "silent",
           "first_failure": "failure", "unheard_rank": "never heard", "memory": "memory", "loss_spike": "loss"}
_STATE_ORDER = {"firing": 0, "pending": 1, "resolved": 2}


def _where(r: Mapping) -> str:
    labels = r.get("labels")
    if isinstance(labels, str) and labels.startswith("{"):  # the alerts table's JSON
        try:
            labels = json.loads(labels)
        except ValueError:
            pass
    if isinstance(labels, Mapping):
        return ",".join(f"{k}={v}" for k, v in labels.items())
    if isinstance(labels, Sequence) and not isinstance(labels, str):
        return ",".join(f"{k}={v}" for k, v in labels)
    return str(labels or r.get("scope", ""))


def alert_groups(snap) -> list[tuple[dict, list[dict]]]:
    """The alerts as (head, consequences): each incident's cause with the alerts attached to it,
    and each standalone alert alone; firing groups first, then pending, resolved (a group takes its
    head's state, its newest first as the table is read). Files from before incidents (no
    incident_id column) give every alert alone. A consequence whose cause is not among the rows
    read stands alone, saying whose it is."""
    rows = [dict(r) for r in snap.table("alerts").to_pylist()]
    by_id = {str(r.get("id")): r for r in rows if r.get("id") is not None}
    heads: list[dict] = []
    members: dict[str, list[dict]] = {}
    for r in rows:
        iid = r.get("incident_id") or ""
        if iid and iid != r.get("id") and iid in by_id:
            members.setdefault(iid, []).append(r)
        else:
            heads.append(r)
    order = [(_STATE_ORDER.get(str(h.get("state")), 3), i) for i, h in enumerate(heads)]
    out = []
    for _, i in sorted(order):
        h = heads[i]
        cons = sorted(members.get(str(h.get("id")), []), key=lambda r: _STATE_ORDER.get(str(r.get("state")), 3))
        out.append((h, cons))
    return out


def _role(r: Mapping) -> str:
    iid = r.get("incident_id") or ""
    return "" if not iid else "cause" if iid == r.get("id") else "consequence"


def _rule_text(r: Mapping, consequence: bool, n_cons: int) -> str:
    rule = str(r.get("rule", "?"))
    if consequence:
        return "  └ " + rule
    if _role(r) == "cause":
        cause = _CAUSES.get(str(r.get("signal", "")), str(r.get("signal") or rule))
        more = f", +{n_cons}" if n_cons else ""
        return f"{rule} (incident: {cause}{more})"
    if r.get("kind") in ("sla", "hardware"):
        return f"{rule} ({str(r.get('kind')).upper() if r.get('kind') == 'sla' else 'hardware'})"
    return rule


def alert_rows(snap, text: str = "") -> list[tuple[str, str, str, str, str, str]]:
    """(state, severity, rule, where, message, status) rows, grouped by incident: a cause first
    ('straggler (incident: compute, +3)'), its consequences under it ('  └ grad_sync'), then the
    next group; firing groups first, then pending, resolved. A filter keeps a group whole when any
    of its rows matches."""
    out: list[tuple[str, str, str, str, str, str]] = []
    for head, cons in alert_groups(snap):
        group = []
        for r, is_cons in [(head, False)] + [(c, True) for c in cons]:
            state = str(r.get("state", "?"))
            sev = str(r.get("severity", "?"))
            status = BAD if state == "firing" and sev == "critical" else WARN if state == "firing" else OK
            group.append((state.upper(), sev, _rule_text(r, is_cons, len(cons)), _where(r), str(r.get("message", "")),
                          status))
        if text and not any(text.lower() in " ".join(row[:5]).lower() for row in group):
            continue
        out.extend(group)
    return out


def action_rows(snap, text: str = "") -> list[dict]:
    """The controller's actions as dicts with at least id, state, what, why (whatever columns exist)."""
    out = []
    for r in snap.table("actions").to_pylist():
        d = {
            "id": str(r.get("action_id", r.get("command_id", r.get("id", "?")))),
            "state": str(r.get("state", r.get("status", "?"))),
            "what": " ".join(str(r[k]) for k in ("kind", "command", "int_value", "value") if r.get(k) is not None),
            "why": str(r.get("reason", r.get("why", r.get("rule", "")))),
        }
        if text and text.lower() not in " ".join(d.values()).lower():
            continue
        out.append(d)
    return out


def firing_summary(snap) -> list[str]:
    """The firing alerts that are not consequences (causes say how many they explain)."""
    return [f"{r[1]} {r[2]} {r[3]}: {r[4]}" for r in alert_rows(snap) if r[0] == "FIRING" and not r[2].startswith("  └")]


# ---- Topology --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """Communication on one (src_node, dst_node) link over the snapshot's collective steps."""

    src: str
    dst: str
    calls: int
    bytes: float
    time_ms: float
    latency_ms: float  # the calls' median durations, weighted by calls
    busbw_gbps: float  # likewise


def topology(snap) -> tuple[list[str], dict[tuple[str, str], Link]]:
    """The nodes (sorted) and the node x node links of the snapshot's topology section."""
    acc: dict[tuple[str, str], list[float]] = {}
    for r in snap.table("topology").to_pylist():
        a = acc.setdefault((r["src_node"], r["dst_node"]), [0, 0.0, 0.0, 0.0, 0.0])
        n = int(r["calls"] or 0)
        a[0] += n
        a[1] += float(r["bytes"] or 0)
        a[2] += float(r["time_ms"] or 0.0)
        a[3] += n * float(r["latency_ms_p50"] or 0.0)
        a[4] += n * float(r["busbw_gbps"] or 0.0)
    links = {k: Link(k[0], k[1], int(a[0]), a[1], a[2], a[3] / a[0] if a[0] else float("nan"),
                     a[4] / a[0] if a[0] else float("nan")) for k, a in acc.items()}
    nodes = sorted({n for k in links for n in k})
    return nodes, links


def group_shares(snap) -> list[tuple[str, str, int, float, float, float]]:
    """(role, group, nodes, time_ms, cross-node share of time, of bytes) per group, most cross-node first."""
    acc: dict[tuple[str, str], list] = {}
    for r in snap.table("topology").to_pylist():
        a = acc.setdefault((r["role"], r["group"]), [set(), 0.0, 0.0, 0.0, 0.0])
        a[0].update((r["src_node"], r["dst_node"]))
        t, b = float(r["time_ms"] or 0.0), float(r["bytes"] or 0)
        a[1] += t
        a[3] += b
        if r["cross_node"]:
            a[2] += t
            a[4] += b
    rows = [(role, grp, len(a[0]), a[1], a[2] / a[1] if a[1] else 0.0, a[4] / a[3] if a[3] else 0.0)
            for (role, grp), a in acc.items()]
    return sorted(rows, key=lambda r: (-r[4], r[1]))


def slowest_links(snap, limit: int = 10) -> list[tuple[str, str, str, str, str, str, str]]:
    """The drill-down: (group, op, src → dst, calls, size, p50, busbw) by median latency, slowest first."""
    rows = sorted(snap.table("topology").to_pylist(), key=lambda r: -(r["latency_ms_p50"] or 0.0))[:limit]
    return [(r["group"], r["op"], f"{r['src_node']} → {r['dst_node']}", str(r["calls"]), fmt_num(float(r["bytes"] or 0), "B"),
             fmt_num(r["latency_ms_p50"], "ms", 2), fmt_num(r["busbw_gbps"], "GB/s", 3)) for r in rows]
