"""Per-run summaries read back from a collector's DuckDB file: the SQL and a plain-text rendering.

`summarize(con, run_id)` runs the queries and returns plain rows; `render(summary)` turns them into
text. The demo prints this and `tracetop report` opens with it; it is also what a person would ask of
the file first.
"""

from __future__ import annotations

from dataclasses import dataclass

RANKS_SQL = """
SELECT s.rank,
       any_value(r.stage) AS stage,
       count(*) AS steps,
       median(s.duration_ns) / 1e6 AS step_ms,
       median(s.compute_ns) / 1e6 AS compute_ms,
       median(s.comm_exposed_ns) / 1e6 AS collective_wait_ms,
       median(s.data_wait_ns) / 1e6 AS data_wait_ms
FROM step s LEFT JOIN run_start r ON r.run_id = s.run_id AND r.rank = s.rank
WHERE s.run_id = ? AND s.step >= ?
GROUP BY s.rank ORDER BY s.rank
"""

BUBBLE_SQL = """
SELECT stage, max(ranks) AS ranks, avg(bubble_rate) AS bubble_rate, any_value(ideal_bubble_rate) AS ideal_bubble_rate
FROM bubble_by_stage
WHERE run_id = ? AND step >= ?
GROUP BY stage ORDER BY stage
"""

COLLECTIVES_SQL = """
SELECT op, role,
       count(*) AS calls,
       median(bytes) AS bytes_per_call,
       quantile_cont(duration_ns, 0.5) / 1e6 AS p50_ms,
       quantile_cont(duration_ns, 0.99) / 1e6 AS p99_ms
FROM collective
WHERE run_id = ? AND step >= ?
GROUP BY op, role ORDER BY sum(duration_ns) DESC
"""


@dataclass(frozen=True)
class Summary:
    run_id: str
    layout: tuple | None
    ranks: list[tuple]
    bubble: list[tuple]
    collectives: list[tuple]
    gaps: int
    skipped_steps: int


def latest_run(con) -> str | None:
    row = con.execute("SELECT run_id FROM run_start ORDER BY start_ns DESC LIMIT 1").fetchone()
    if row is None:
        row = con.execute("SELECT run_id FROM step ORDER BY start_ns DESC LIMIT 1").fetchone()
    return row[0] if row else None


def summarize(con, run_id: str, skip_steps: int = 1) -> Summary:
    """The run's figures, leaving out its first `skip_steps` steps (warm-up)."""
    layout = con.execute(
        "SELECT max(world_size), max(tp), max(pp), max(dp), max(zero_stage), any_value(model_name), max(micro_batches) "
        "FROM run_start WHERE run_id = ?",
        [run_id],
    ).fetchone()
    first = con.execute("SELECT coalesce(min(step), 0) FROM step WHERE run_id = ?", [run_id]).fetchone()[0]
    since = first + skip_steps
    gaps = con.execute("SELECT coalesce(sum(dropped), 0) FROM gap WHERE run_id = ?", [run_id]).fetchone()[0]
    return Summary(
        run_id=run_id,
        layout=layout if layout and layout[0] is not None else None,
        ranks=con.execute(RANKS_SQL, [run_id, since]).fetchall(),
        bubble=con.execute(BUBBLE_SQL, [run_id, since]).fetchall(),
        collectives=con.execute(COLLECTIVES_SQL, [run_id, since]).fetchall(),
        gaps=int(gaps),
        skipped_steps=skip_steps,
    )


def _table(headers: list[str], rows: list[tuple], fmts: list[str]) -> str:
    cells = [[("-" if v is None else format(v, f)) for v, f in zip(row, fmts)] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def render(s: Summary) -> str:
    out = [f"run {s.run_id}"]
    if s.layout:
        world, tp, pp, dp, zero, model, m = s.layout
        out[0] += f": {world} ranks = TP {tp} x PP {pp} x DP {dp}"
        # a plain loop declares no ZeRO stage, model or micro-batches (-1, ''): say only what was declared
        declared = [(zero, f"ZeRO {zero}"), (model, f"model {model}"), (m, f"{m} micro-batches")]
        out[0] += "".join(f", {text}" for v, text in declared if v not in (None, -1, ""))
    out.append(f"(medians over steps after the first {s.skipped_steps})")
    out += ["", "per rank"]
    out.append(_table(
        ["rank", "stage", "steps", "step ms", "compute ms", "collective wait ms", "data wait ms"],
        s.ranks, ["d", "d", "d", ".1f", ".1f", ".1f", ".1f"],
    ))
    if s.ranks:
        top = max(s.ranks, key=lambda r: r[4] or 0)
        others = sorted(r[4] for r in s.ranks if r is not top and r[4] is not None)
        if others:
            mid = others[len(others) // 2]
            out.append(f"slowest compute: rank {top[0]}, {top[4] - mid:+.1f} ms against the median of the other ranks")
    if s.bubble:
        out += ["", "pipeline bubble by stage"]
        out.append(_table(["stage", "ranks", "bubble", "ideal (p-1)/(m+p-1)"], s.bubble, ["d", "d", ".3f", ".3f"]))
    out += ["", "collectives by op and role"]
    out.append(_table(["op", "role", "calls", "bytes/call", "p50 ms", "p99 ms"], s.collectives, ["s", "s", "d", ".0f", ".3f", ".3f"]))
    out += ["", f"gaps: {s.gaps} events dropped" if s.gaps else "gaps: none (nothing dropped)"]
    return "\n".join(out)
