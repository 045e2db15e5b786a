"""The `lost_time` SQL: GPU time lost per step and rank, split by cause (collector/live/lost.py's
definition, which its docstring states; tests hold the two equal).

One text, three users: collector/ingest/schema.py's migration 8 creates the view from `lost_time_sql()`;
collector/query/snapshot.py (the TUI's "lost in the last 10 min" line) and `tracetop report` run the same
text bounded to one run and a range of steps, over the view `step_ranks` of schema 5, so they work
on files written before schema 8 too. It lives here because
tracetop/ may not import the collector. Schema 10 (collector/ingest/matviews.py) materializes it per step
over `step_ranks` and the step rows of the steps it recomputes (`lost_time_over`). A change here is
a new migration (`CREATE OR REPLACE VIEW lost_time ...`), with this text copied into the old one,
as schema 8's is (`_SQL_V8`).

A (run, step, rank) with several step rows (a job re-run from a checkpoint under the same run id
re-runs its steps) counts the row that ended last: schema 8's text joined each rank's step rows
with one another (k repeats: k^3 rows for the rank, a collector's close on such a file took
minutes); this one is linear in them, and equal to it when no step row repeats.

Columns (one row per run, step and rank; GPU-ms = ms x GPUs):
run_id, step, rank, stage, node, gpus (the run's GPUs: world size, or the ranks reporting),
end_ns (the rank's step end, its clock), step_ms, step_ms_p50 (median over the step's ranks),
late_ms (how much later the step ended than the what-if), what_if_step_ms, is_pacer (the rank the
step waited for), excess_ms (compute beyond its stage's other ranks' median), data_wait_ms,
straggler_gpu_ms, data_gpu_ms (charged to the pacer: its excess / data wait x gpus),
pipeline_gpu_ms, comm_gpu_ms (on this rank), lost_gpu_ms (their sum).
"""

from __future__ import annotations

DEFAULT_COMM_BASELINE_SHARE = 0.30  # collector/live/lost.py has the same default (a test holds them equal)

# schema 17's text (materialized by collector/ingest/matviews.py, run bounded by the TUI and the report):
# _SQL_V10's rows, exactly, with its window passes over (run, step[, stage]) replaced by grouped
# aggregates joined back (56 -> ~40 ms CPU a step at 16,384 ranks): the stage's others' median from one
# sorted list a stage (a rank's value at or before a position: <= the value there, NULLs last, which
# among ties picks another row than row_number did but leaves the same values), and the pacer, the
# lowest rank of those latest by their own doing, as the max of (own_late_ms, -rank)
_SQL = """
WITH k AS (SELECT run_id, step, rank, any_value(stage) AS stage, any_value(p2p_ms) AS p2p_ms,
                  any_value(p2p_bytes) AS p2p_bytes, any_value(best_p2p_bytes_per_ns) AS best_p2p_bytes_per_ns
           FROM {sr} GROUP BY run_id, step, rank),
-- one step row per (run, step, rank): the one that ended last (a step re-run after a restart from a
-- checkpoint; the others' figures are not mixed in, and repeats cost linear time, not their cube)
s AS (SELECT run_id, step, rank, data_wait_ns, start_ns + duration_ns AS end_ns, micro_batches,
             duration_ns / 1e6 AS step_ms, compute_ns / 1e6 AS compute_ms, (forward_ns + backward_ns) / 1e6 AS fwd_bwd_ms,
             comm_exposed_ns / 1e6 AS comm_exposed_ms
      FROM {step}
      QUALIFY row_number() OVER (PARTITION BY run_id, step, rank
                                 ORDER BY start_ns + duration_ns DESC, duration_ns DESC, compute_ns DESC,
                                          forward_ns + backward_ns DESC, comm_exposed_ns DESC, data_wait_ns DESC,
                                          micro_batches DESC) = 1),
sr AS (SELECT k.*, s.* EXCLUDE (run_id, step, rank) FROM k JOIN s ON s.run_id = k.run_id AND s.step = k.step AND s.rank = k.rank),
-- the median compute of each rank's stage's *other* ranks (the stragglers view's others_compute_ms):
-- the stage's sorted values at the 4 positions around its median, from one sorted list a stage; a
-- rank's own value is at or before position x when it is <= the value there (NULLs last)
q AS (SELECT run_id, step, stage, n, cl[(n - 2) // 2 + 1] AS va, cl[(n - 2) // 2 + 2] AS va1,
             cl[(n - 1) // 2 + 1] AS vb, cl[(n - 1) // 2 + 2] AS vb1
      FROM (SELECT run_id, step, stage, count(*) AS n, list_sort(list(compute_ms)) AS cl FROM sr GROUP BY run_id, step, stage)),
-- per step: what the windows over (run, step) gave, as one grouped aggregate joined back
w AS (SELECT run_id, step, max(micro_batches) AS micro_batches, max(best_p2p_bytes_per_ns) AS best, count(*) AS n
      FROM sr GROUP BY run_id, step),
r AS (SELECT run_id, max(pp) AS pp, max(micro_batches) AS micro_batches, max(world_size) AS world_size
      FROM run_start {runs} GROUP BY run_id),
h AS (SELECT run_id, rank, any_value(hostname) AS node FROM run_start {runs} GROUP BY run_id, rank),
a AS (
    SELECT sr.run_id, sr.step, sr.rank, sr.stage, h.node, sr.step_ms, sr.fwd_bwd_ms, sr.p2p_ms, sr.p2p_bytes,
           sr.comm_exposed_ms, sr.end_ns,
           greatest(sr.compute_ms - coalesce(
               CASE WHEN q.n > 1 THEN ((CASE WHEN (CASE WHEN q.va IS NULL THEN true WHEN sr.compute_ms IS NULL THEN false ELSE sr.compute_ms <= q.va END) THEN q.va1 ELSE q.va END)
                                       + (CASE WHEN (CASE WHEN q.vb IS NULL THEN true WHEN sr.compute_ms IS NULL THEN false ELSE sr.compute_ms <= q.vb END) THEN q.vb1 ELSE q.vb END)) / 2 END,
               sr.compute_ms), 0) AS excess_ms,
           greatest(coalesce(sr.data_wait_ns, 0) / 1e6, 0) AS data_wait_ms,
           coalesce(r.pp, 1) AS pp,
           coalesce(nullif(greatest(w.micro_batches, 0), 0), r.micro_batches, 0) AS m,
           w.best AS best,
           greatest(coalesce(r.world_size, 0), w.n) AS gpus
    FROM sr
    JOIN w ON w.run_id = sr.run_id AND w.step = sr.step
    LEFT JOIN q ON q.run_id = sr.run_id AND q.step = sr.step AND q.stage = sr.stage
    LEFT JOIN r ON r.run_id = sr.run_id
    LEFT JOIN h ON h.run_id = sr.run_id AND h.rank = sr.rank
), b AS (
    SELECT *, excess_ms + data_wait_ms AS own_late_ms,
           CASE WHEN best > 0 THEN least(p2p_bytes / (best * 1e6), p2p_ms) ELSE 0 END AS transfer_ms,
           CASE WHEN pp > 1 AND m > 0 THEN fwd_bwd_ms * ((pp - 1) / m) ELSE 0 END AS ideal_wait_ms
    FROM a
), p AS (
    -- the pacer: the rank latest by its own doing, the lowest rank of a tie (own_late_ms is never NULL)
    SELECT run_id, step, max(own_late_ms) AS late_ms, median(step_ms) AS step_ms_p50,
           -max({{'l': own_late_ms, 'r': -CAST(rank AS BIGINT)}}).r AS pacer
    FROM b GROUP BY run_id, step
), c AS (
    SELECT b.*, p.late_ms, p.step_ms_p50, p.pacer FROM b JOIN p ON p.run_id = b.run_id AND p.step = b.step
), d AS (
    SELECT *, late_ms - own_late_ms AS victim_ms, greatest(p2p_ms - transfer_ms - ideal_wait_ms, 0) AS pipe_excess_ms,
           greatest(step_ms_p50 - late_ms, 0) AS what_if_step_ms, (rank = pacer AND late_ms > 0) AS is_pacer
    FROM c
), e AS (
    SELECT *,
           CASE WHEN is_pacer THEN excess_ms * gpus ELSE 0 END AS straggler_gpu_ms,
           CASE WHEN is_pacer THEN data_wait_ms * gpus ELSE 0 END AS data_gpu_ms,
           greatest(pipe_excess_ms - victim_ms, 0) AS pipeline_gpu_ms,
           greatest(greatest(greatest(comm_exposed_ms - p2p_ms, 0) - {baseline} * what_if_step_ms, 0)
                    - greatest(victim_ms - pipe_excess_ms, 0), 0) AS comm_gpu_ms
    FROM d
)
SELECT run_id, step, rank, stage, node, gpus, end_ns, step_ms, step_ms_p50, late_ms, what_if_step_ms, is_pacer,
       excess_ms, data_wait_ms, straggler_gpu_ms, data_gpu_ms, pipeline_gpu_ms, comm_gpu_ms,
       straggler_gpu_ms + data_gpu_ms + pipeline_gpu_ms + comm_gpu_ms AS lost_gpu_ms
FROM e"""

# schema 10's text (_v10 .. _v16; the reference _SQL is held equal to in tests)
_SQL_V10 = """
WITH k AS (SELECT run_id, step, rank, any_value(stage) AS stage, any_value(p2p_ms) AS p2p_ms,
                  any_value(p2p_bytes) AS p2p_bytes, any_value(best_p2p_bytes_per_ns) AS best_p2p_bytes_per_ns
           FROM {sr} GROUP BY run_id, step, rank),
-- one step row per (run, step, rank): the one that ended last (a step re-run after a restart from a
-- checkpoint; the others' figures are not mixed in, and repeats cost linear time, not their cube)
s AS (SELECT run_id, step, rank, data_wait_ns, start_ns + duration_ns AS end_ns, micro_batches,
             duration_ns / 1e6 AS step_ms, compute_ns / 1e6 AS compute_ms, (forward_ns + backward_ns) / 1e6 AS fwd_bwd_ms,
             comm_exposed_ns / 1e6 AS comm_exposed_ms
      FROM {step}
      QUALIFY row_number() OVER (PARTITION BY run_id, step, rank
                                 ORDER BY start_ns + duration_ns DESC, duration_ns DESC, compute_ns DESC,
                                          forward_ns + backward_ns DESC, comm_exposed_ns DESC, data_wait_ns DESC,
                                          micro_batches DESC) = 1),
sr AS (SELECT k.*, s.* EXCLUDE (run_id, step, rank) FROM k JOIN s ON s.run_id = k.run_id AND s.step = k.step AND s.rank = k.rank),
-- the median compute of each rank's stage's *other* ranks (the stragglers view's others_compute_ms,
-- from the 4 order statistics it needs per stage instead of a list per row: O(n log n) a stage)
g AS (SELECT run_id, step, stage, rank, compute_ms,
             row_number() OVER (PARTITION BY run_id, step, stage ORDER BY compute_ms) - 1 AS pos,
             count(*) OVER (PARTITION BY run_id, step, stage) AS n
      FROM sr),
q AS (SELECT run_id, step, stage,
             max(compute_ms) FILTER (WHERE pos = (n - 2) // 2) AS va, max(compute_ms) FILTER (WHERE pos = (n - 2) // 2 + 1) AS va1,
             max(compute_ms) FILTER (WHERE pos = (n - 1) // 2) AS vb, max(compute_ms) FILTER (WHERE pos = (n - 1) // 2 + 1) AS vb1
      FROM g GROUP BY run_id, step, stage),
st AS (SELECT g.run_id, g.step, g.rank,
              CASE WHEN g.n > 1 THEN ((CASE WHEN (g.n - 2) // 2 >= g.pos THEN q.va1 ELSE q.va END)
                                      + (CASE WHEN (g.n - 1) // 2 >= g.pos THEN q.vb1 ELSE q.vb END)) / 2 END
                  AS others_compute_ms
       FROM g JOIN q ON q.run_id = g.run_id AND q.step = g.step AND q.stage = g.stage),
r AS (SELECT run_id, max(pp) AS pp, max(micro_batches) AS micro_batches, max(world_size) AS world_size
      FROM run_start {runs} GROUP BY run_id),
h AS (SELECT run_id, rank, any_value(hostname) AS node FROM run_start {runs} GROUP BY run_id, rank),
a AS (
    SELECT sr.run_id, sr.step, sr.rank, sr.stage, h.node, sr.step_ms, sr.fwd_bwd_ms, sr.p2p_ms, sr.p2p_bytes,
           sr.comm_exposed_ms, sr.end_ns,
           greatest(sr.compute_ms - coalesce(st.others_compute_ms, sr.compute_ms), 0) AS excess_ms,
           greatest(coalesce(sr.data_wait_ns, 0) / 1e6, 0) AS data_wait_ms,
           coalesce(r.pp, 1) AS pp,
           coalesce(nullif(greatest(max(sr.micro_batches) OVER w, 0), 0), r.micro_batches, 0) AS m,
           max(sr.best_p2p_bytes_per_ns) OVER w AS best,
           greatest(coalesce(r.world_size, 0), count(*) OVER w) AS gpus
    FROM sr
    LEFT JOIN st ON st.run_id = sr.run_id AND st.step = sr.step AND st.rank = sr.rank
    LEFT JOIN r ON r.run_id = sr.run_id
    LEFT JOIN h ON h.run_id = sr.run_id AND h.rank = sr.rank
    WINDOW w AS (PARTITION BY sr.run_id, sr.step)
), b AS (
    SELECT *, excess_ms + data_wait_ms AS own_late_ms,
           CASE WHEN best > 0 THEN least(p2p_bytes / (best * 1e6), p2p_ms) ELSE 0 END AS transfer_ms,
           CASE WHEN pp > 1 AND m > 0 THEN fwd_bwd_ms * ((pp - 1) / m) ELSE 0 END AS ideal_wait_ms
    FROM a
), c AS (
    SELECT *, max(own_late_ms) OVER w AS late_ms, median(step_ms) OVER w AS step_ms_p50,
           first_value(rank) OVER (PARTITION BY run_id, step ORDER BY own_late_ms DESC, rank
                                   ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING) AS pacer
    FROM b WINDOW w AS (PARTITION BY run_id, step)
), d AS (
    SELECT *, late_ms - own_late_ms AS victim_ms, greatest(p2p_ms - transfer_ms - ideal_wait_ms, 0) AS pipe_excess_ms,
           greatest(step_ms_p50 - late_ms, 0) AS what_if_step_ms, (rank = pacer AND late_ms > 0) AS is_pacer
    FROM c
), e AS (
    SELECT *,
           CASE WHEN is_pacer THEN excess_ms * gpus ELSE 0 END AS straggler_gpu_ms,
           CASE WHEN is_pacer THEN data_wait_ms * gpus ELSE 0 END AS data_gpu_ms,
           greatest(pipe_excess_ms - victim_ms, 0) AS pipeline_gpu_ms,
           greatest(greatest(greatest(comm_exposed_ms - p2p_ms, 0) - {baseline} * what_if_step_ms, 0)
                    - greatest(victim_ms - pipe_excess_ms, 0), 0) AS comm_gpu_ms
    FROM d
)
SELECT run_id, step, rank, stage, node, gpus, end_ns, step_ms, step_ms_p50, late_ms, what_if_step_ms, is_pacer,
       excess_ms, data_wait_ms, straggler_gpu_ms, data_gpu_ms, pipeline_gpu_ms, comm_gpu_ms,
       straggler_gpu_ms + data_gpu_ms + pipeline_gpu_ms + comm_gpu_ms AS lost_gpu_ms
FROM e"""

# schema 8's text (migration _v8 creates the view from it; _v10 replaces it): every step row of a
# (run, step, rank) joined with every other one, so k repeats gave k^3 rows
_SQL_V8 = """
WITH sr AS (SELECT * FROM step_ranks {steps}),
-- the median compute of each rank's stage's *other* ranks (the stragglers view's others_compute_ms,
-- from the 4 order statistics it needs per stage instead of a list per row: O(n log n) a stage)
g AS (SELECT run_id, step, stage, rank, compute_ms,
             row_number() OVER (PARTITION BY run_id, step, stage ORDER BY compute_ms) - 1 AS pos,
             count(*) OVER (PARTITION BY run_id, step, stage) AS n
      FROM sr),
q AS (SELECT run_id, step, stage,
             max(compute_ms) FILTER (WHERE pos = (n - 2) // 2) AS va, max(compute_ms) FILTER (WHERE pos = (n - 2) // 2 + 1) AS va1,
             max(compute_ms) FILTER (WHERE pos = (n - 1) // 2) AS vb, max(compute_ms) FILTER (WHERE pos = (n - 1) // 2 + 1) AS vb1
      FROM g GROUP BY run_id, step, stage),
st AS (SELECT g.run_id, g.step, g.rank,
              CASE WHEN g.n > 1 THEN ((CASE WHEN (g.n - 2) // 2 >= g.pos THEN q.va1 ELSE q.va END)
                                      + (CASE WHEN (g.n - 1) // 2 >= g.pos THEN q.vb1 ELSE q.vb END)) / 2 END
                  AS others_compute_ms
       FROM g JOIN q ON q.run_id = g.run_id AND q.step = g.step AND q.stage = g.stage),
s AS (SELECT run_id, step, rank, data_wait_ns, start_ns + duration_ns AS end_ns, micro_batches FROM step {steps}),
r AS (SELECT run_id, max(pp) AS pp, max(micro_batches) AS micro_batches, max(world_size) AS world_size
      FROM run_start {runs} GROUP BY run_id),
h AS (SELECT run_id, rank, any_value(hostname) AS node FROM run_start {runs} GROUP BY run_id, rank),
a AS (
    SELECT sr.run_id, sr.step, sr.rank, sr.stage, h.node, sr.step_ms, sr.fwd_bwd_ms, sr.p2p_ms, sr.p2p_bytes,
           sr.comm_exposed_ms, s.end_ns,
           greatest(sr.compute_ms - coalesce(st.others_compute_ms, sr.compute_ms), 0) AS excess_ms,
           greatest(coalesce(s.data_wait_ns, 0) / 1e6, 0) AS data_wait_ms,
           coalesce(r.pp, 1) AS pp,
           coalesce(nullif(greatest(max(s.micro_batches) OVER w, 0), 0), r.micro_batches, 0) AS m,
           max(sr.best_p2p_bytes_per_ns) OVER w AS best,
           greatest(coalesce(r.world_size, 0), count(*) OVER w) AS gpus
    FROM sr
    LEFT JOIN st ON st.run_id = sr.run_id AND st.step = sr.step AND st.rank = sr.rank
    LEFT JOIN s ON s.run_id = sr.run_id AND s.step = sr.step AND s.rank = sr.rank
    LEFT JOIN r ON r.run_id = sr.run_id
    LEFT JOIN h ON h.run_id = sr.run_id AND h.rank = sr.rank
    WINDOW w AS (PARTITION BY sr.run_id, sr.step)
), b AS (
    SELECT *, excess_ms + data_wait_ms AS own_late_ms,
           CASE WHEN best > 0 THEN least(p2p_bytes / (best * 1e6), p2p_ms) ELSE 0 END AS transfer_ms,
           CASE WHEN pp > 1 AND m > 0 THEN fwd_bwd_ms * ((pp - 1) / m) ELSE 0 END AS ideal_wait_ms
    FROM a
), c AS (
    SELECT *, max(own_late_ms) OVER w AS late_ms, median(step_ms) OVER w AS step_ms_p50,
           first_value(rank) OVER (PARTITION BY run_id, step ORDER BY own_late_ms DESC, rank
                                   ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING) AS pacer
    FROM b WINDOW w AS (PARTITION BY run_id, step)
), d AS (
    SELECT *, late_ms - own_late_ms AS victim_ms, greatest(p2p_ms - transfer_ms - ideal_wait_ms, 0) AS pipe_excess_ms,
           greatest(step_ms_p50 - late_ms, 0) AS what_if_step_ms, (rank = pacer AND late_ms > 0) AS is_pacer
    FROM c
), e AS (
    SELECT *,
           CASE WHEN is_pacer THEN excess_ms * gpus ELSE 0 END AS straggler_gpu_ms,
           CASE WHEN is_pacer THEN data_wait_ms * gpus ELSE 0 END AS data_gpu_ms,
           greatest(pipe_excess_ms - victim_ms, 0) AS pipeline_gpu_ms,
           greatest(greatest(greatest(comm_exposed_ms - p2p_ms, 0) - {baseline} * what_if_step_ms, 0)
                    - greatest(victim_ms - pipe_excess_ms, 0), 0) AS comm_gpu_ms
    FROM d
)
SELECT run_id, step, rank, stage, node, gpus, end_ns, step_ms, step_ms_p50, late_ms, what_if_step_ms, is_pacer,
       excess_ms, data_wait_ms, straggler_gpu_ms, data_gpu_ms, pipeline_gpu_ms, comm_gpu_ms,
       straggler_gpu_ms + data_gpu_ms + pipeline_gpu_ms + comm_gpu_ms AS lost_gpu_ms
FROM e"""


def lost_time_sql(*, comm_baseline_share: float = DEFAULT_COMM_BASELINE_SHARE, bounded: bool = False) -> str:
    """The SELECT. bounded: restricted to `$run` and steps `$lo`..`$hi` (named parameters, or
    collector.query.snapshot.inline), so a query reads only those rows."""
    steps = "WHERE run_id = $run AND step BETWEEN $lo AND $hi" if bounded else ""
    runs = "WHERE run_id = $run" if bounded else ""
    return lost_time_over(f"(SELECT * FROM step_ranks {steps})", f"(SELECT * FROM step {steps})",
                          runs=runs, comm_baseline_share=comm_baseline_share)


def lost_time_over(sr: str, step: str, *, runs: str = "",
                   comm_baseline_share: float = DEFAULT_COMM_BASELINE_SHARE) -> str:
    """The SELECT over the step_ranks relation `sr` and the step rows `step` (the same (run, step,
    rank) keys; collector/ingest/matviews.py passes one chunk of steps), run_start filtered by `runs`."""
    b = float(comm_baseline_share)
    if not 0.0 <= b <= 1.0:
        raise ValueError(f"comm_baseline_share {comm_baseline_share!r} must lie in 0..1")
    return _SQL.format(sr=sr, step=step, runs=runs, baseline=repr(b)).strip()


def lost_time_over_v10(sr: str, step: str) -> str:
    """Schema 10's text (built-in baseline) over `sr` and `step`: the reference `lost_time_over` equals."""
    return _SQL_V10.format(sr=sr, step=step, runs="", baseline=repr(DEFAULT_COMM_BASELINE_SHARE)).strip()


def lost_time_sql_v8() -> str:
    """Schema 8's view text (migration _v8; the built-in baseline, unbounded)."""
    return _SQL_V8.format(steps="", runs="", baseline=repr(DEFAULT_COMM_BASELINE_SHARE)).strip()


def lost_steps_sql(*, comm_baseline_share: float = DEFAULT_COMM_BASELINE_SHARE, top: int = 16) -> str:
    """Per step of `$run` in `$lo`..`$hi`: a row with rank NULL holding the step's sums by cause and
    its end, then its `top` most-charged ranks (what a live watcher caches once per step)."""
    return f"""
WITH l AS ({lost_time_sql(comm_baseline_share=comm_baseline_share, bounded=True)}),
t AS (SELECT step, NULL::INTEGER AS rank, sum(straggler_gpu_ms) AS straggler_gpu_ms, sum(data_gpu_ms) AS data_gpu_ms,
             sum(pipeline_gpu_ms) AS pipeline_gpu_ms, sum(comm_gpu_ms) AS comm_gpu_ms, sum(lost_gpu_ms) AS lost_gpu_ms,
             max(end_ns) AS end_ns
      FROM l GROUP BY step),
r AS (SELECT step, rank, straggler_gpu_ms, data_gpu_ms, pipeline_gpu_ms, comm_gpu_ms, lost_gpu_ms, end_ns FROM l
      WHERE lost_gpu_ms > 0 QUALIFY row_number() OVER (PARTITION BY step ORDER BY lost_gpu_ms DESC, rank) <= {int(top)})
SELECT * FROM t UNION ALL SELECT * FROM r ORDER BY step, rank NULLS FIRST""".strip()


def lost_window_sql(*, comm_baseline_share: float = DEFAULT_COMM_BASELINE_SHARE, top: int = 5) -> str:
    """Over steps `$lo`..`$hi` of `$run` whose end lies at or after `$since_ns`: the totals (the row
    whose rank is NULL) and the `top` ranks most lost is charged to, by cause, with the steps and
    the span of step time covered."""
    return f"""
WITH l AS ({lost_time_sql(comm_baseline_share=comm_baseline_share, bounded=True)}),
w AS (SELECT * FROM l WHERE end_ns >= $since_ns)
SELECT rank, sum(straggler_gpu_ms) AS straggler_gpu_ms, sum(data_gpu_ms) AS data_gpu_ms,
       sum(pipeline_gpu_ms) AS pipeline_gpu_ms, sum(comm_gpu_ms) AS comm_gpu_ms, sum(lost_gpu_ms) AS lost_gpu_ms,
       count(DISTINCT step) AS steps,
       min(end_ns) AS first_end_ns, max(end_ns) AS last_end_ns
FROM w GROUP BY GROUPING SETS ((rank), ())
ORDER BY rank IS NOT NULL, lost_gpu_ms DESC, rank LIMIT {int(top) + 1}""".strip()
