"""`tracetop report FILE [-o report.html] [--run RUN]`: one self-contained HTML file with plots.

Plots are drawn with matplotlib's SVG backend and inlined as `<svg>` elements: no script, no
stylesheet or font from the network, nothing to execute, so the file opens offline, mails well and
renders the same in a headless browser (scripts/report_screenshot.sh). Each section is a
`<section id="...">` so tests (and people) can find it.

Three layers, as everywhere in the collector: `gather_*` run aggregate SQL (bucketed, so a file of
10^8 rows never comes into Python whole) and return plain lists; `plot_*` turn those into SVG text
with no I/O; `build_report` strings it together. `grad_sync_by_step_from_dp_collectives` is this
module's own stand-in for the live engine's `grad_sync` view (which replaces it at merge): per step,
each rank's summed collective time in groups whose role names DP, and the slowest rank's sum (it
includes waiting for the slowest DP peer, which is what a step pays).
"""

from __future__ import annotations

import argparse
import html
import io
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from collector.query.summary import render, summarize
from tracetop.errors import TracetopError

GRAD_SYNC_SLO_MS = 200.0
MAX_STEP_BUCKETS = 600
MAX_RANK_BUCKETS = 256
PHASES = (("data_wait_ns", "data wait"), ("forward_ns", "forward"), ("backward_ns", "backward"),
          ("optimizer_ns", "optimizer"), ("comm_exposed_ns", "exposed comm"))
SECTIONS = ("step-time", "lost", "rank-heatmap", "bubble", "collectives", "comm-topology", "grad-sync", "offload",
            "memory", "hardware-risk", "incidents", "alerts", "actions", "gaps")
LOST_TOP_RANKS = 16
#: the progress bar appears (on a terminal) for files at least this big
PROGRESS_MIN_BYTES = 20 * 1024 * 1024


class ReportError(TracetopError, RuntimeError):
    """Cannot write a report: the message says why and what to do."""


# ----------------------------------------------------------------------------- gathering (SQL)


def _has_table(con, name: str) -> bool:
    return bool(con.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE table_name = ? AND schema_name = 'main'", [name]
    ).fetchone()[0] or con.execute(
        "SELECT count(*) FROM duckdb_views() WHERE view_name = ? AND schema_name = 'main'", [name]
    ).fetchone()[0])


def _bucket(con, table: str, run_id: str, col: str, most: int) -> int:
    lo, hi = con.execute(f"SELECT min({col}), max({col}) FROM {table} WHERE run_id = ?", [run_id]).fetchone()
    if lo is None:
        return 1
    return max(1, -(-(hi - lo + 1) // most))


def gather_steps(con, run_id: str) -> dict:
    """Per step (bucketed to at most MAX_STEP_BUCKETS): median across ranks of step time and of each phase."""
    w = _bucket(con, "step", run_id, "step", MAX_STEP_BUCKETS)
    phase_cols = ", ".join(f"median({c}) / 1e6" for c, _ in PHASES)
    rows = con.execute(
        f"SELECT (step // {w}) * {w} AS s, median(duration_ns) / 1e6, {phase_cols} FROM step "
        "WHERE run_id = ? GROUP BY s ORDER BY s", [run_id]).fetchall()
    return {"bucket": w, "step": [r[0] for r in rows], "step_ms": [r[1] for r in rows],
            "phases": {label: [r[2 + i] or 0.0 for r in rows] for i, (_, label) in enumerate(PHASES)}}


def gather_lost(con, run_id: str, comm_baseline_share: float = 0.30) -> dict:
    """What the run lost (collector/query/lost_sql.py, the lost_time view's text over this run): GPU-ms per
    cause summed per step bucket, per cause, per node and for the ranks charged the most."""
    from collector.query.lost_sql import lost_time_sql

    if not _has_table(con, "step_ranks"):
        return {}
    w = _bucket(con, "step", run_id, "step", MAX_STEP_BUCKETS)
    params = {"run": run_id, "lo": 0, "hi": 2**62}
    con.execute(f"CREATE OR REPLACE TEMP TABLE _lost AS {lost_time_sql(comm_baseline_share=comm_baseline_share, bounded=True)}",
                params)
    try:
        causes = ("straggler", "data", "pipeline", "comm")
        sums = ", ".join(f"sum({c}_gpu_ms)" for c in causes)
        steps = con.execute(f"SELECT (step // {w}) * {w} AS s, {sums} FROM _lost GROUP BY s ORDER BY s").fetchall()
        total = con.execute(f"SELECT {sums}, count(*), count(DISTINCT step) FROM _lost").fetchone()
        held = con.execute("SELECT sum(g) FROM (SELECT any_value(step_ms_p50) * any_value(gpus) AS g FROM _lost "
                           "GROUP BY step)").fetchone()[0] or 0.0
        ranks = con.execute(f"SELECT rank, any_value(node), {sums}, sum(lost_gpu_ms) AS l, "
                            "count(*) FILTER (WHERE is_pacer AND straggler_gpu_ms > 0) FROM _lost GROUP BY rank "
                            f"ORDER BY l DESC, rank LIMIT {LOST_TOP_RANKS}").fetchall()
        nodes = con.execute(f"SELECT coalesce(node, '?'), count(DISTINCT rank), {sums}, sum(lost_gpu_ms) AS l FROM _lost "
                            "GROUP BY ALL ORDER BY l DESC LIMIT 32").fetchall()
    finally:
        con.execute("DROP TABLE IF EXISTS temp._lost")
    return {"bucket": w, "causes": causes, "step": [r[0] for r in steps],
            "by_step": {c: [r[1 + i] or 0.0 for r in steps] for i, c in enumerate(causes)},
            "total": {c: total[i] or 0.0 for i, c in enumerate(causes)}, "steps": total[5] or 0, "held_gpu_ms": held,
            "ranks": ranks, "nodes": nodes}


def gather_heatmap(con, run_id: str) -> dict:
    """Median compute ms per (rank bucket, step bucket)."""
    ws = _bucket(con, "step", run_id, "step", MAX_STEP_BUCKETS)
    wr = _bucket(con, "step", run_id, "rank", MAX_RANK_BUCKETS)
    rows = con.execute(
        f"SELECT (rank // {wr}) * {wr} AS r, (step // {ws}) * {ws} AS s, median(compute_ns) / 1e6 FROM step "
        "WHERE run_id = ? GROUP BY r, s", [run_id]).fetchall()
    ranks = sorted({r for r, _, _ in rows})
    steps = sorted({s for _, s, _ in rows})
    ri, si = {r: i for i, r in enumerate(ranks)}, {s: i for i, s in enumerate(steps)}
    grid = [[None] * len(steps) for _ in ranks]
    for r, s, v in rows:
        grid[ri[r]][si[s]] = v
    return {"ranks": ranks, "steps": steps, "grid": grid, "rank_bucket": wr, "step_bucket": ws}


def gather_bubble(con, run_id: str) -> list[tuple]:
    """(stage, mean measured bubble, ideal) per stage, from the bubble_by_stage view."""
    if not _has_table(con, "bubble_by_stage"):
        return []
    return con.execute(
        "SELECT stage, avg(bubble_rate), any_value(ideal_bubble_rate), count(*) FROM bubble_by_stage "
        "WHERE run_id = ? GROUP BY stage ORDER BY stage", [run_id]).fetchall()


_BUS_FACTOR = """CASE WHEN op LIKE 'all_reduce%' THEN 2.0 * (group_size - 1) / group_size
     WHEN op LIKE '%all_gather%' OR op LIKE '%reduce_scatter%' OR op LIKE 'all_to_all%'
          THEN 1.0 * (group_size - 1) / group_size ELSE 1.0 END"""


def gather_collectives(con, run_id: str) -> list[tuple]:
    """(op, role, size bucket bytes, calls, median ms, median busbw GB/s) with sizes bucketed by
    powers of two; busbw per NCCL-tests (the collective_stats view's factors)."""
    return con.execute(
        f"""SELECT op, role, CAST(pow(2, round(log2(greatest(bytes, 1)))) AS BIGINT) AS size,
                   count(*), median(duration_ns) / 1e6,
                   median(bytes / nullif(duration_ns, 0) * {_BUS_FACTOR})
            FROM collective WHERE run_id = ? AND group_size > 0
            GROUP BY op, role, size ORDER BY op, role, size""", [run_id]).fetchall()


def grad_sync_by_step_from_dp_collectives(con, run_id: str) -> list[tuple[int, float]]:
    """(step, ms): per step, the largest over ranks of the rank's summed duration of collectives in
    DP groups (role 'dp' or a role joined with '|' that names dp). Replaced by the live engine's
    grad_sync view at merge."""
    return con.execute(
        """SELECT step, max(ms) FROM (
               SELECT step, rank, sum(duration_ns) / 1e6 AS ms FROM collective
               WHERE run_id = ? AND list_contains(string_split(role, '|'), 'dp') AND step >= 0
               GROUP BY step, rank)
           GROUP BY step ORDER BY step""", [run_id]).fetchall()


def gather_offload(con, run_id: str) -> list[tuple]:
    """(direction, step bucket, GB/s) over the time spent copying."""
    w = _bucket(con, "offload", run_id, "step", MAX_STEP_BUCKETS)
    return con.execute(
        f"SELECT direction, (step // {w}) * {w} AS s, sum(bytes) / nullif(sum(duration_ns), 0) FROM offload "
        "WHERE run_id = ? GROUP BY direction, s ORDER BY direction, s", [run_id]).fetchall()


def gather_memory(con, run_id: str) -> dict:
    """Per rank (up to 16 shown, the highest peaks): GB over steps, and the budget where declared."""
    w = _bucket(con, "memory", run_id, "step", MAX_STEP_BUCKETS)
    used = "CASE WHEN allocated_bytes >= 0 THEN allocated_bytes ELSE rss_bytes END"
    top = [r for (r,) in con.execute(
        f"SELECT rank FROM memory WHERE run_id = ? GROUP BY rank ORDER BY max({used}) DESC, rank LIMIT 16",
        [run_id]).fetchall()]
    series = {}
    for r in top:
        series[r] = con.execute(
            f"SELECT (step // {w}) * {w} AS s, max({used}) / 1e9 FROM memory WHERE run_id = ? AND rank = ? "
            "GROUP BY s ORDER BY s", [run_id, r]).fetchall()
    budget = con.execute("SELECT max(budget_bytes) / 1e9 FROM memory WHERE run_id = ? AND budget_bytes > 0",
                         [run_id]).fetchone()[0]
    source = con.execute("SELECT max(allocated_bytes) >= 0 FROM memory WHERE run_id = ?", [run_id]).fetchone()[0]
    return {"series": series, "budget_gb": budget, "what": "device allocated" if source else "process RSS"}


def gather_events_table(con, table: str, run_id: str) -> tuple[list[str], list[tuple]] | None:
    """The alerts/actions table's rows for the run (None when the file has no such table)."""
    if not _has_table(con, table):
        return None
    cols = [c for (c,) in con.execute(
        "SELECT column_name FROM duckdb_columns() WHERE table_name = ? ORDER BY column_index", [table]).fetchall()]
    where = "WHERE run_id = ?" if "run_id" in cols else ""
    order = next((c for c in ("fired_ns", "start_ns", "created_ns", "ts_ns", "time_ns", "applied_ns") if c in cols),
                 None)
    sql = f"SELECT * FROM {table} {where}" + (f" ORDER BY {order}" if order else "") + " LIMIT 500"
    return cols, con.execute(sql, [run_id] if where else []).fetchall()


def gather_incidents(con, run_id: str) -> dict | None:
    """The run's incidents (the `incidents` view: each cause with its culprit and consequences)
    and how many SLA breaches stood alone; None for a file from before incidents (schema 11-)."""
    if not _has_table(con, "incidents"):
        return None
    rows = con.execute(
        "SELECT state, severity, rule, cause, CASE WHEN rank IS NOT NULL THEN 'rank ' || rank "
        "|| coalesce(', stage ' || stage, '') WHEN gpu IS NOT NULL THEN 'GPU ' || gpu || coalesce(' on ' || node, '') "
        "WHEN stage IS NOT NULL THEN 'stage ' || stage ELSE 'the run' END AS culprit, first_step, last_step, "
        "consequences, array_to_string(consequence_rules, ', '), message "
        "FROM incidents WHERE run_id = ? ORDER BY first_ns", [run_id]).fetchall()
    alone = con.execute("SELECT count(*) FROM alerts WHERE run_id = ? AND kind = 'sla' AND incident_id = ''",
                        [run_id]).fetchone()[0]
    return {"rows": rows, "standalone_sla": int(alone)}


def incidents_html(d: dict) -> str:
    rows = d["rows"]
    cons = sum(r[7] for r in rows)
    head = (f"<p>{len(rows)} incident(s): each names its culprit and cause; {cons} alert(s) attached to them as "
            f"consequences (SLA breaches they explain, waiters), not causes of their own; {d['standalone_sla']} SLA "
            "breach(es) nothing explains (the alerts table below lists them all, with kind and incident_id)</p>")
    return head + _table_html(["state", "severity", "rule", "cause", "culprit", "first step", "last step",
                               "consequences", "consequence rules", "message"], rows)


def gather_gaps(con, run_id: str) -> list[tuple]:
    return con.execute(
        "SELECT kind, reason, origin_source, sum(dropped), count(*) FROM gap WHERE run_id = ? "
        "GROUP BY ALL ORDER BY 4 DESC", [run_id]).fetchall()


# ----------------------------------------------------------------------------- plotting (pure)


def _figure(w: float = 9.0, h: float = 3.4):
    import matplotlib
    from matplotlib.figure import Figure

    # what ranks send is data: a '$' in an op, a role, a rule or a message is a dollar sign, never
    # mathtext (one '$\\x$' made matplotlib raise and aborted the whole report). Text objects read
    # it when made, so it is set before any is.
    matplotlib.rcParams["text.parse_math"] = False
    return Figure(figsize=(w, h), layout="constrained")


def _svg(fig) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "tracetop"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def plot_steps(d: dict) -> str:
    fig = _figure()
    ax = fig.subplots()
    labels = list(d["phases"])
    ax.stackplot(d["step"], *[d["phases"][k] for k in labels], labels=labels, alpha=0.75)
    ax.plot(d["step"], d["step_ms"], color="black", lw=1.4, label="step time")
    ax.set_xlabel("step" + (f" (buckets of {d['bucket']})" if d["bucket"] > 1 else ""))
    ax.set_ylabel("ms (median over ranks)")
    ax.legend(loc="upper left", fontsize=7, ncol=3)
    ax.set_title("step time and phases over steps")
    return _svg(fig)


def plot_lost(d: dict) -> str:
    fig = _figure(9.0, 3.2)
    ax = fig.subplots()
    causes = list(d["causes"])
    ys = [[v / 1e3 for v in d["by_step"][c]] for c in causes]
    ax.stackplot(d["step"], *ys, labels=[c if c != "comm" else "exposed comm" for c in causes], alpha=0.8,
                 colors=["#d62728", "#7f7f7f", "#1f77b4", "#ff7f0e"])
    ax.set_xlabel("step" + (f" (buckets of {d['bucket']})" if d["bucket"] > 1 else ""))
    ax.set_ylabel("GPU-seconds lost" + (" per bucket" if d["bucket"] > 1 else " per step"))
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    ax.set_title("GPU time lost per step, by cause")
    return _svg(fig)


def _money(x: float) -> str:
    return f"{x:,.2f}" if abs(x) >= 1 else f"{x:.3g}"


def lost_html(d: dict, cost) -> str:
    """The lost-time section: a plot, the causes with GPU-hours (and money where priced), the ranks
    charged the most and the nodes."""
    from collector.live.lost import gpu_hours

    total = sum(d["total"].values())
    held = d["held_gpu_ms"]
    money = cost.priced
    head = ["cause", "GPU-hours", "share of lost", "share of GPU time"] + ([f"cost ({cost.currency})"] if money else [])
    rows = []
    for c in (*d["causes"], "all"):
        v = total if c == "all" else d["total"][c]
        rows.append((c if c != "comm" else "exposed comm (above the baseline)", gpu_hours(v),
                     f"{v / total:.1%}" if total else "–", f"{v / held:.1%}" if held else "–")
                    + ((_money(cost.money(gpu_hours(v))),) if money else ()))
    rank_rows = [(r[0], r[1], *(gpu_hours(x or 0.0) for x in r[2:7]), f"{(r[6] or 0) / total:.1%}" if total else "–", r[7])
                 for r in d["ranks"]]
    node_rows = [(r[0], r[1], *(gpu_hours(x or 0.0) for x in r[2:7])) for r in d["nodes"]]
    price = (f"at {cost.price_per_gpu_hour:g} {cost.currency} per GPU-hour" if money
             else "no price declared (--price-per-gpu-hour, or price_per_gpu_hour in the rules file's [cost])")
    note = (f"<p>{gpu_hours(total):.3g} GPU-hours lost over {d['steps']} steps ({total / held:.1%} of the "
            f"{gpu_hours(held):.3g} GPU-hours the steps held), {price}. Straggler and data time are charged to the "
            "rank the step waited for (every GPU waited it); pipeline waiting above the 1F1B ideal and exposed "
            f"communication above {cost.comm_baseline_share:.0%} of the what-if step to the rank that waited. The "
            "telemetry's own time is not in the rows, so it is not split out. SQL: the lost_time view.</p>") if held else ""
    return (plot_lost(d) + note + _table_html(head, rows)
            + "<h3>ranks charged the most</h3>" + _table_html(
                ["rank", "node", "straggler GPU-h", "data GPU-h", "pipeline GPU-h", "comm GPU-h", "all GPU-h", "share",
                 "steps it paced"], rank_rows)
            + "<h3>by node</h3>" + _table_html(
                ["node", "ranks", "straggler GPU-h", "data GPU-h", "pipeline GPU-h", "comm GPU-h", "all GPU-h"], node_rows))


def plot_heatmap(d: dict) -> str:
    import numpy as np

    fig = _figure(9.0, max(2.4, min(8.0, 0.9 + 0.22 * len(d["ranks"]))))
    ax = fig.subplots()
    grid = np.array([[np.nan if v is None else v for v in row] for row in d["grid"]], dtype=float)
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma",
                   extent=(d["steps"][0] - 0.5, d["steps"][-1] + d["step_bucket"] - 0.5, len(d["ranks"]) - 0.5, -0.5))
    ax.set_yticks(range(len(d["ranks"])), [str(r) for r in d["ranks"]] if len(d["ranks"]) <= 32 else None)
    if len(d["ranks"]) > 32:
        ax.set_yticks([])
    ax.set_ylabel("rank" + (f" (buckets of {d['rank_bucket']})" if d["rank_bucket"] > 1 else ""))
    ax.set_xlabel("step")
    fig.colorbar(im, ax=ax, label="compute ms")
    ax.set_title("compute time per rank and step (a straggler is a bright row)")
    return _svg(fig)


def plot_bubble(rows: list[tuple]) -> str:
    fig = _figure(7.0, 3.0)
    ax = fig.subplots()
    stages = [r[0] for r in rows]
    ax.bar([s - 0.2 for s in stages], [r[1] for r in rows], width=0.4, label="measured (mean over steps)")
    ax.bar([s + 0.2 for s in stages], [r[2] for r in rows], width=0.4, label="ideal (p-1)/(m+p-1)")
    ax.set_xticks(stages, [f"stage {s}" for s in stages])
    ax.set_ylabel("bubble fraction")
    ax.legend(fontsize=8)
    ax.set_title("pipeline bubble by stage against the 1F1B ideal")
    return _svg(fig)


def plot_collectives(rows: list[tuple]) -> str:
    fig = _figure(10.0, 3.6)
    ax1, ax2 = fig.subplots(1, 2)
    groups: dict[tuple, list] = {}
    for op, role, size, _calls, ms, busbw in rows:
        groups.setdefault((op, role), []).append((size, ms, busbw))
    for (op, role), pts in groups.items():
        xs = [p[0] for p in pts]
        ax1.plot(xs, [p[1] for p in pts], marker="o", ms=3, lw=1, label=f"{op} [{role}]")
        ax2.plot(xs, [p[2] if p[2] is not None else float("nan") for p in pts], marker="o", ms=3, lw=1)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size per rank (bytes)")
    ax1.set_ylabel("latency ms (median)")
    ax2.set_ylabel("busbw GB/s (median)")
    ax1.legend(fontsize=6)
    ax1.set_title("collective latency vs size")
    ax2.set_title("bus bandwidth vs size (NCCL-tests)")
    return _svg(fig)


def plot_grad_sync(rows: list[tuple[int, float]], slo_ms: float) -> str:
    fig = _figure(9.0, 3.0)
    ax = fig.subplots()
    steps, ms = [r[0] for r in rows], [r[1] for r in rows]
    over = [(s, v) for s, v in rows if v > slo_ms]
    ax.plot(steps, ms, lw=1.2, label="grad-sync ms (slowest rank)")
    if over:
        ax.scatter([s for s, _ in over], [v for _, v in over], color="crimson", s=10, zorder=3, label="over the line")
    ax.axhline(slo_ms, color="crimson", ls="--", lw=1, label=f"{slo_ms:g} ms")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    ax.set_title("grad-sync per step (DP-group collectives) against its line")
    return _svg(fig)


def plot_offload(rows: list[tuple]) -> str:
    fig = _figure(9.0, 3.0)
    ax = fig.subplots()
    by: dict[str, list] = {}
    for direction, s, gbps in rows:
        by.setdefault(direction, []).append((s, gbps))
    for direction, pts in by.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", lw=1, label=direction)
    ax.set_xlabel("step")
    ax.set_ylabel("GB/s while copying")
    ax.legend(fontsize=8)
    ax.set_title("offload bandwidth by direction")
    return _svg(fig)


def plot_memory(d: dict) -> str:
    fig = _figure(9.0, 3.2)
    ax = fig.subplots()
    for r, pts in d["series"].items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=f"rank {r}")
    if d["budget_gb"]:
        ax.axhline(d["budget_gb"], color="crimson", ls="--", lw=1, label=f"budget {d['budget_gb']:.2f} GB")
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_ylabel(f"GB ({d['what']})")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("memory per rank against budget")
    return _svg(fig)


def plot_timeline(cols: list[str], rows: list[tuple], title: str) -> str | None:
    """Events over time (or step), one row per rule/kind; None when no time or step column."""
    tcol = next((c for c in ("fired_ns", "start_ns", "created_ns", "ts_ns", "time_ns", "applied_ns") if c in cols), None)
    xcol = tcol or ("step" if "step" in cols else None)
    if xcol is None or not rows:
        return None
    label = next((c for c in ("rule", "name", "kind", "action", "key", "command") if c in cols), None)
    xi = cols.index(xcol)
    xs = [r[xi] for r in rows if r[xi] is not None]
    if not xs:
        return None
    x0 = min(xs) if tcol else 0
    labels = sorted({str(r[cols.index(label)]) for r in rows}) if label else ["event"]
    fig = _figure(9.0, max(2.0, 0.8 + 0.3 * len(labels)))
    ax = fig.subplots()
    for r in rows:
        if r[xi] is None:
            continue
        y = labels.index(str(r[cols.index(label)])) if label else 0
        ax.scatter([(r[xi] - x0) / 1e9 if tcol else r[xi]], [y], s=18, color="crimson")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("seconds since the first" if tcol else "step")
    ax.set_title(title)
    return _svg(fig)


# ----------------------------------------------------------------------------- assembly


@dataclass
class Progress:
    """A one-line bar on stderr, drawn only when `enabled` (a terminal and a large file)."""

    total: int
    enabled: bool
    done: int = 0
    out: object = field(default=sys.stderr)

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        fill = int(width * self.done / self.total)
        self.out.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {what:<24}")
        if self.done == self.total:
            self.out.write("\n")
        self.out.flush()


def gather_topology(con, run_id: str) -> dict:
    """The comm_topology view of the run (collector/query/dashboard.py): node x node median latency,
    each group's cross-node share, the slowest links, and the groups judged over the threshold."""
    from collector.query import dashboard

    links = dashboard.rows(con, f"SELECT src_node, dst_node, sum(calls) AS calls, sum(time_ms) AS time_ms, "
                                 f"sum(calls * latency_ms_p50) / sum(calls) AS latency_ms FROM "
                                 f"({dashboard.comm_topology_sql()}) WHERE run_id = ? GROUP BY ALL", [run_id])
    groups = dashboard.rows(con, f"SELECT role, \"group\", nodes, calls, time_ms, cross_time_share, cross_bytes_share "
                                  f"FROM ({dashboard.comm_cross_share_sql()}) WHERE run_id = ? "
                                  "ORDER BY cross_time_share DESC, time_ms DESC", [run_id])
    return {"links": links, "groups": groups, "slowest": dashboard.slowest_links(con, run_id, limit=8),
            "over": dashboard.cross_node_groups(con, run_id), "threshold": dashboard.CROSS_NODE_SHARE}


def plot_topology(d: dict) -> str:
    import numpy as np
    nodes = sorted({r["src_node"] for r in d["links"]} | {r["dst_node"] for r in d["links"]})[:32]
    at = {n: i for i, n in enumerate(nodes)}
    grid = np.full((len(nodes), len(nodes)), np.nan)
    for r in d["links"]:
        if r["src_node"] in at and r["dst_node"] in at:
            grid[at[r["src_node"]], at[r["dst_node"]]] = r["latency_ms"]
    fig = _figure(4.5 + 0.2 * len(nodes), 3.0 + 0.2 * len(nodes))
    ax = fig.subplots()
    im = ax.imshow(grid, cmap="RdYlGn_r")
    ax.set_xticks(range(len(nodes)), nodes, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(nodes)), nodes, fontsize=7)
    for i in range(len(nodes)):
        for j in range(len(nodes)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xlabel("to node")
    ax.set_ylabel("from node")
    fig.colorbar(im, ax=ax, label="median latency (ms)")
    ax.set_title("communication latency by node pair")
    return _svg(fig)


def topology_html(d: dict) -> str:
    th = d["threshold"]
    verdict = ("<p><b>" + "; ".join(f"{html.escape(g['group'])}: {g['cross_time_share']:.0%} of its time cross-node"
                                    for g in d["over"]) + f"</b> (above {th:.0%}: all-reduce timeouts follow "
               "cross-node traffic; place the group's ranks on fewer nodes)</p>") if d["over"] else \
        f"<p>no DP/TP group spends over {th:.0%} of its communication time on cross-node links</p>"
    groups = [(g["role"], g["group"], g["nodes"], g["calls"], f"{g['time_ms']:.0f}", f"{g['cross_time_share']:.0%}",
               f"{g['cross_bytes_share']:.0%}") for g in d["groups"][:20]]
    slow = [(r["group"], r["op"], f"{r['src_node']} → {r['dst_node']}", r["calls"], f"{r['latency_ms_p50']:.2f}",
             f"{r['latency_ms_p99']:.2f}", f"{(r['busbw_gbps'] or 0):.3f}") for r in d["slowest"]]
    return (plot_topology(d) + verdict
            + _table_html(["role", "group", "nodes", "calls", "time ms", "cross-node time", "cross-node bytes"], groups)
            + "<p>the slowest links</p>"
            + _table_html(["group", "op", "link", "calls", "p50 ms", "p99 ms", "busbw GB/s"], slow))


def gather_fragmentation(con, run_id: str) -> dict:
    """Per rank, the memory_fragmentation view's share by step (GPU ranks only), and the ranks the
    trend judges fragmenting."""
    from collector.query import dashboard

    rows = dashboard.rows(con, f"SELECT rank, step, frag_share FROM ({dashboard.memory_fragmentation_sql()}) "
                                "WHERE run_id = ? AND frag_share IS NOT NULL ORDER BY rank, step", [run_id])
    series: dict[int, list[tuple[int, float]]] = {}
    for r in rows:
        series.setdefault(int(r["rank"]), []).append((int(r["step"]), float(r["frag_share"])))
    return {"series": series, "rising": dashboard.fragmenting_ranks(con, run_id)}


def fragmentation_html(d: dict) -> str:
    if not d["series"]:
        return ("<p>fragmentation: not measured (CPU ranks: the hooks record the resident set, not the "
                "bytes of the live tensors; on GPU it is the allocator's reserved − allocated)</p>")
    fig = _figure(9.0, 2.8)
    ax = fig.subplots()
    for r, pts in list(d["series"].items())[:32]:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=f"rank {r}")
    ax.set_xlabel("step")
    ax.set_ylabel("reserved − allocated, share")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("allocator fragmentation per rank")
    rising = "".join(f"<li>rank {r['rank']}: {r['frag_share_first']:.0%} → {r['frag_share_last']:.0%} "
                     f"(+{r['frag_share_per_100_steps']:.0%} per 100 steps)</li>" for r in d["rising"])
    return _svg(fig) + (f"<p><b>fragmentation rising</b></p><ul>{rising}</ul>" if rising else "")


def gather_risk(con, run_id: str) -> list[dict]:
    """The hardware_risk view over the run's nodes' agent samples (any agent run id)."""
    from collector.query import dashboard

    where = "node IN (SELECT hostname FROM run_start WHERE run_id = $run) OR run_id = $run"
    sql = dashboard.hardware_risk_sql(where=where.replace("$run", "?"))
    return dashboard.rows(con, sql, [run_id, run_id, run_id, run_id])


def risk_html(rows: list[dict]) -> str:
    bad = [r for r in rows if r["level"] == "fail_likely"]
    head = ("<p><b>" + "<br>".join(html.escape(f"GPU {r['gpu']} on {r['node']}: {r['evidence']} — likely to fail")
                                   for r in bad) + "</b></p>") if bad else \
        "<p>no GPU at risk (score from the agent's NVML history: ECC, remapped rows, XIDs, throttling, clocks)</p>"
    table = [(r["node"], r["gpu"], r["samples"], f"{r['hours']:.1f}", f"{r['risk']:.2f}", r["level"], r["evidence"])
             for r in rows[:64]]
    return head + _table_html(["node", "gpu", "samples", "hours", "risk", "level", "evidence"], table)


#: a stored trace up to this size is linked in the report itself (a data: URI); larger ones by command
PROFILE_LINK_MAX_BYTES = 8 << 20


def profiles_html(con, run_id: str) -> str:
    """The run's profiling windows: per rank, its steps and a link that saves the trace (open it in
    ui.perfetto.dev), and the export that draws it beside tracetop's own timeline."""
    import base64

    from collector.control import profiles

    rows = profiles.traces(con, run_id)
    if not rows:
        return _none("no profiling window in this run (`tracetop profile --run RUN --steps N` takes one)")
    out = []
    for w in rows:
        first, n = int(w["first_step"]), int(w["steps"] or 0)
        link = html.escape(w["note"] or "no trace")
        if w["state"] == "stored" and int(w["bytes"] or 0) <= PROFILE_LINK_MAX_BYTES:
            blob = b"".join(bytes(p[0]) for p in con.execute(
                'SELECT data FROM profile_chunks WHERE run_id = ? AND action_id = ? AND rank = ? ORDER BY "offset"',
                [run_id, w["action_id"], w["rank"]]).fetchall())
            name = f"{run_id}-rank{w['rank']}-action{w['action_id']}.trace.json.gz"
            link = (f'<a download="{html.escape(name)}" href="data:application/gzip;base64,'
                    f'{base64.b64encode(blob).decode()}">{html.escape(name)}</a> ({len(blob) / 1024:.0f} KiB)')
        elif w["state"] == "stored":
            link = f"{int(w['bytes']) / 2**20:.1f} MiB: too large to link here; use the export below"
        out.append((w["action_id"], w["rank"], f"{first}..{first + n - 1}", w["state"], link))
    lo = min(int(w["first_step"]) for w in rows)
    hi = max(int(w["first_step"]) + max(1, int(w["steps"] or 0)) - 1 for w in rows)
    body = _table_html(["action", "rank", "steps", "state", "trace (open in ui.perfetto.dev)"], [])
    cells = "".join(f"<tr><td>{html.escape(str(a))}</td><td>{r}</td><td>{s}</td><td>{html.escape(st)}</td>"
                    f"<td>{lk}</td></tr>" for a, r, s, st, lk in out)
    body = body.replace("</tbody>", cells + "</tbody>", 1)
    return body + (f"<p>Beside tracetop's own timeline: <code>tracetop export FILE --perfetto profile.json --run "
                   f"{html.escape(run_id)} --steps {lo}:{hi}</code>, then open profile.json in ui.perfetto.dev.</p>")


def _table_html(headers: list[str], rows: list[tuple]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return html.escape("" if v is None else str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{html.escape(title)}</h2>\n{body}\n</section>'


def _none(text: str) -> str:
    return f'<p class="none">{html.escape(text)}</p>'


CSS = """body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:17px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
pre{background:#f6f6f6;padding:10px;font-size:12px;overflow-x:auto}table{border-collapse:collapse;font-size:12px}
td,th{border:1px solid #ddd;padding:2px 8px;text-align:right}.none{color:#777;font-style:italic}
svg{max-width:100%;height:auto}"""


def compare_html(d: dict) -> str:
    """The headline figures of `tracetop compare` (collector/query/compare.py's diff) as a table."""
    def f(x: float, fmt: str = ".2f") -> str:
        return "-" if x != x else format(x, fmt)

    rows = [(k, f(h["a"]), f(h["b"]), f(h["delta"], "+.2f"), "-" if h["pct"] != h["pct"] else f"{h['pct']:+.1f}%",
             h["unit"]) for k, h in d["headline"].items()]
    return (f"<p>A (baseline): {html.escape(d['a'])}<br>B (this run): {html.escape(d['b'])}</p>"
            + _table_html(["figure", "A", "B", "B−A", "change", "unit"], rows))


def build_report(con, run_id: str, *, slo_ms: float = GRAD_SYNC_SLO_MS, progress: Progress | None = None,
                 source: str = "", cost=None, baseline: str | None = None) -> str:
    from collector.live.lost import CostSettings

    cost = cost or CostSettings()
    prog = progress or Progress(total=len(SECTIONS) + 1, enabled=False)
    parts: list[str] = []
    from collector.query import verdict

    parts.append(_section("verdict", "verdict: what bounds this run, and what to try next",
                          f"<pre>{html.escape(verdict.render(verdict.verdict_of(con, run_id)))}</pre>"))
    if baseline:  # `--compare`: this run against a baseline (collector/query/compare.py)
        from collector.query import compare

        path, base_run = compare.split_ref(baseline)
        if source and os.path.realpath(path) == os.path.realpath(source):  # the same file: this connection
            from collector.query.post_file import PostFileError, pick_run

            try:
                base_id = pick_run(con, base_run)
            except PostFileError as e:
                raise compare.CompareError(f"{path}: {e}") from None
            base = compare.profile(con, base_id, f"{path}:{base_id}")
        else:
            base = compare.open_profile(baseline)
        d = compare.diff(base, compare.profile(con, run_id, f"{source}:{run_id}"))
        parts.append(_section("compare", "against the baseline", compare_html(d)))
    summary = summarize(con, run_id)
    prog.step("summary")
    text = f"<pre>{html.escape(render(summary))}</pre>"
    if len(summary.ranks) > 32:  # a long per-rank table folds away; the heatmap shows every rank
        text = f"<details><summary>per-rank summary ({len(summary.ranks)} ranks)</summary>{text}</details>"
    parts.append(_section("summary", "summary", text))

    steps = gather_steps(con, run_id)
    parts.append(_section("step-time", "step time and phases",
                          plot_steps(steps) if steps["step"] else _none("no step rows")))
    prog.step("step time")
    lost = gather_lost(con, run_id, cost.comm_baseline_share)
    parts.append(_section("lost", "what it cost: GPU time lost, by cause",
                          lost_html(lost, cost) if lost.get("step") else _none("no step rows to judge")))
    prog.step("lost time")
    hm = gather_heatmap(con, run_id)
    parts.append(_section("rank-heatmap", "rank heatmap",
                          plot_heatmap(hm) if hm["ranks"] else _none("no step rows")))
    prog.step("heatmap")
    bub = gather_bubble(con, run_id)
    parts.append(_section("bubble", "pipeline bubble by stage",
                          plot_bubble(bub) + _table_html(["stage", "measured", "ideal", "steps"], bub) if bub
                          else _none("no pipeline in this run (pp = 1): no bubble to draw")))
    prog.step("bubble")
    coll = gather_collectives(con, run_id)
    parts.append(_section("collectives", "collectives: latency and bus bandwidth against message size",
                          plot_collectives(coll) if coll else _none("no collective rows")))
    prog.step("collectives")
    topo = gather_topology(con, run_id)
    parts.append(_section("comm-topology", "communication topology: latency by node pair, cross-node share by group",
                          topology_html(topo) if topo["links"] else _none("no collective rows")))
    prog.step("comm-topology")
    gs = grad_sync_by_step_from_dp_collectives(con, run_id)
    over = sum(1 for _, v in gs if v > slo_ms)
    parts.append(_section("grad-sync", "grad-sync per step",
                          (plot_grad_sync(gs, slo_ms) + f"<p>{over} of {len(gs)} steps over {slo_ms:g} ms "
                           "(computed here from the collective rows of DP groups: the slowest rank's sum per "
                           "step; the live engine's grad_sync view replaces it)</p>") if gs
                          else _none("no collectives in DP groups (dp = 1?)")))
    prog.step("grad-sync")
    off = gather_offload(con, run_id)
    parts.append(_section("offload", "offload bandwidth", plot_offload(off) if off
                          else _none("no offload copies in this run (no ZeRO offload)")))
    prog.step("offload")
    mem = gather_memory(con, run_id)
    parts.append(_section("memory", "memory per rank", plot_memory(mem) + (
        "" if mem["budget_gb"] else "<p>no budget declared (budget_bytes = -1)</p>")
        + fragmentation_html(gather_fragmentation(con, run_id)) if mem["series"] else _none("no memory rows")))
    prog.step("memory")
    risk = gather_risk(con, run_id)
    parts.append(_section("hardware-risk", "hardware risk ahead of failure (per GPU)", risk_html(risk) if risk
                          else _none("no GPU samples from an agent on this run's nodes")))
    prog.step("hardware-risk")
    inc = gather_incidents(con, run_id)
    parts.append(_section("incidents", "incidents: cause and consequence", _none(
        "this file predates incidents (schema 11 or older, or no alerts table): its alerts stand alone below")
        if inc is None else incidents_html(inc) if inc["rows"] else _none(
        f"no incident in this run: no fault fired ({inc['standalone_sla']} SLA breach(es), below)")))
    prog.step("incidents")
    for sid, table, who in (("alerts", "alerts", "the live engine's rules write it"),
                            ("actions", "actions", "the controller writes it")):
        got = gather_events_table(con, table, run_id)
        if got is None:
            body = _none(f"this file has no {table} table ({who}; files from collectors without them have none)")
        elif not got[1]:
            body = _none(f"no {table} for this run")
        else:
            plot = plot_timeline(got[0], got[1], f"{table} over time")
            body = (plot or "") + _table_html(got[0], got[1])
        parts.append(_section(sid, f"{table} timeline", body))
        prog.step(table)
    parts.append(_section("profiles", "profiling windows (tracetop profile)", profiles_html(con, run_id)))
    gaps = gather_gaps(con, run_id)
    parts.append(_section("gaps", "gaps (events dropped)", _table_html(
        ["kind", "reason", "origin source", "dropped", "gap rows"], gaps) if gaps
        else _none("none: nothing was dropped")))
    prog.step("gaps")
    title = f"tracetop report: run {run_id}"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    head = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n<h1>{html.escape(title)}</h1>"
            f"<p>from {html.escape(source)}, written {stamp}</p>\n")
    return head + "\n".join(parts) + "\n</body></html>\n"


# ----------------------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a collector's DuckDB file (no collector holding it)")
    parser.add_argument("-o", "--output", type=Path, default=Path("report.html"), help="default report.html")
    parser.add_argument("--run", default=None, help="which run (default: the latest)")
    parser.add_argument("--grad-sync-slo-ms", type=float, default=GRAD_SYNC_SLO_MS,
                        help=f"the grad-sync line (default {GRAD_SYNC_SLO_MS:g} ms)")
    parser.add_argument("--price-per-gpu-hour", type=float, default=None, metavar="PRICE",
                        help="show lost GPU-hours as money too (wins over $TRACETOP_PRICE_PER_GPU_HOUR and --rules)")
    parser.add_argument("--currency", default=None, help="the price's currency (default the rules file's, else USD)")
    parser.add_argument("--compare", default=None, metavar="BASELINE",
                        help="a section comparing this run against BASELINE (FILE or FILE:RUN), as tracetop compare")
    parser.add_argument("--rules", default=None, metavar="FILE",
                        help="a rules file whose [cost] table gives the price and the communication baseline")


def run(args: argparse.Namespace) -> int:
    from collector.query.post_file import PostFileError, open_read_only, pick_run

    try:
        con = open_read_only(args.file)
    except PostFileError as e:
        print(f"tracetop report: {e}", file=sys.stderr)
        return 2
    from collector.live.lost import CostError, CostSettings, with_price
    from collector.live.rules import RulesError, parse_cost
    from tracetop import env

    try:
        cost = CostSettings()
        if args.rules:
            try:
                text = Path(args.rules).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CostError(f"cannot read the rules file {args.rules}: {e}") from None
            cost = parse_cost(text, args.rules)
        cost = with_price(cost, args.price_per_gpu_hour, env.get(env.TRACETOP_PRICE_PER_GPU_HOUR), args.currency)
    except (RulesError, CostError) as e:
        print(f"tracetop report: {e}", file=sys.stderr)
        return 2
    try:
        try:
            run_id = pick_run(con, args.run)
        except PostFileError as e:
            print(f"tracetop report: {args.file}: {e}", file=sys.stderr)
            return 2
        big = os.path.getsize(args.file) >= PROGRESS_MIN_BYTES
        prog = Progress(total=len(SECTIONS) + 1, enabled=big and sys.stderr.isatty())
        from collector.query.compare import CompareError

        try:
            text = build_report(con, run_id, slo_ms=args.grad_sync_slo_ms, progress=prog, source=str(args.file),
                                cost=cost, baseline=getattr(args, "compare", None))
        except CompareError as e:
            print(f"tracetop report: --compare: {e}", file=sys.stderr)
            return 2
    finally:
        con.close()
    out: Path = args.output
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    print(f"tracetop report: {out} ({len(text) / 1e3:.0f} kB, run {run_id})")
    return 0
