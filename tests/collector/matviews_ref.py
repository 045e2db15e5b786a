"""The stragglers SQL texts earlier schemas stored (_v5's, _v13's), kept as the references
collector/ingest/matviews.py's `stragglers_sql` must give the rows of (test_matviews.py, beside this file).
Nothing else runs them: a file's views are created again by each migration that changes them."""

from __future__ import annotations

from collector.ingest.matviews import STRAGGLER_JUDGMENT


def stragglers_lists_sql(sr: str = "step_ranks") -> str:
    """_v5's stragglers SELECT over the step_ranks relation `sr`, as _v5 wrote it: each row carries its
    stage's sorted values as a list, so a stage of n ranks costs n^2 (at 16,384 ranks in one stage,
    2 GB and 129 s per step). Kept as the reference `stragglers_sql` must equal (tests)."""
    return f"""WITH g AS (
            SELECT run_id, step, stage, rank, compute_ms, wait_ms,
                   count(*) OVER w AS stage_ranks,
                   list_sort(list(compute_ms) OVER w) AS cl, list_sort(list(wait_ms) OVER w) AS wl,
                   row_number() OVER (PARTITION BY run_id, step, stage ORDER BY compute_ms) - 1 AS pc,
                   row_number() OVER (PARTITION BY run_id, step, stage ORDER BY wait_ms) - 1 AS pw,
                   median(compute_ms) OVER w AS mc, median(wait_ms) OVER w AS mw
            FROM {sr} WINDOW w AS (PARTITION BY run_id, step, stage)
        ), m AS (
            SELECT *, median(abs(compute_ms - mc)) OVER w AS madc, median(abs(wait_ms - mw)) OVER w AS madw,
                   (stage_ranks - 2) // 2 AS ia, (stage_ranks - 1) // 2 AS ib
            FROM g WINDOW w AS (PARTITION BY run_id, step, stage)
        ), o AS (
            SELECT *,
                   CASE WHEN stage_ranks > 1 THEN (cl[ia + CAST(ia >= pc AS INTEGER) + 1]
                                                   + cl[ib + CAST(ib >= pc AS INTEGER) + 1]) / 2 END AS others_compute_ms,
                   CASE WHEN stage_ranks > 1 THEN (wl[ia + CAST(ia >= pw AS INTEGER) + 1]
                                                   + wl[ib + CAST(ib >= pw AS INTEGER) + 1]) / 2 END AS others_wait_ms
            FROM m
        )
        {STRAGGLER_JUDGMENT}"""


def stragglers_windows_sql(sr: str = "step_ranks") -> str:
    """_v13's stragglers SELECT over the step_ranks relation `sr`: `stragglers_lists_sql`'s rows,
    exactly, in time and memory linear in the ranks. "Others" is the median of the stage without
    this rank: the values at sorted positions ia and ib of the stage less this rank (at position pc),
    which are the stage's sorted values at ia or ia + 1 and ib or ib + 1; those four values per
    stage are window aggregates, not a list per row. Kept as the reference `stragglers_sql` must equal
    (tests): its four window passes over (run, step, stage) were 54 ms a step at 16,384 ranks."""
    def at(v: str, pos: str) -> str:
        return ", ".join(f"any_value({v}) FILTER (WHERE {pos} = {j}) OVER w AS {v}_{n}"
                         for n, j in (("a0", "ia"), ("a1", "ia + 1"), ("b0", "ib"), ("b1", "ib + 1")))

    def others(v: str, pos: str) -> str:
        return (f"CASE WHEN stage_ranks > 1 THEN ((CASE WHEN ia >= {pos} THEN {v}_a1 ELSE {v}_a0 END) "
                f"+ (CASE WHEN ib >= {pos} THEN {v}_b1 ELSE {v}_b0 END)) / 2 END")

    return f"""WITH g AS (
            SELECT run_id, step, stage, rank, compute_ms, wait_ms,
                   count(*) OVER w AS stage_ranks,
                   row_number() OVER (PARTITION BY run_id, step, stage ORDER BY compute_ms) - 1 AS pc,
                   row_number() OVER (PARTITION BY run_id, step, stage ORDER BY wait_ms) - 1 AS pw,
                   median(compute_ms) OVER w AS mc, median(wait_ms) OVER w AS mw
            FROM {sr} WINDOW w AS (PARTITION BY run_id, step, stage)
        ), m AS (
            SELECT *, median(abs(compute_ms - mc)) OVER w AS madc, median(abs(wait_ms - mw)) OVER w AS madw,
                   (stage_ranks - 2) // 2 AS ia, (stage_ranks - 1) // 2 AS ib
            FROM g WINDOW w AS (PARTITION BY run_id, step, stage)
        ), k AS (
            SELECT *, {at('compute_ms', 'pc')}, {at('wait_ms', 'pw')}
            FROM m WINDOW w AS (PARTITION BY run_id, step, stage)
        ), o AS (
            SELECT *, {others('compute_ms', 'pc')} AS others_compute_ms, {others('wait_ms', 'pw')} AS others_wait_ms
            FROM k
        )
        {STRAGGLER_JUDGMENT}"""
