"""The per-step views materialized beside the rows (schema version of migration `_v10`).

`step_ranks` aggregated 5*10^7 collective and 3*10^7 pipe_instr rows per (run, step, rank) on every
read, and `stragglers`, `grad_sync`, `bubble_budget`, `step_throughput` (and through them
`run_scaling`, `scaling_efficiency`, `loss_spikes`) and `lost_time` (which also reads `step`) read
it: 17 to 228 s at 10^8 rows. Each of the six is a function of one step's rows (it partitions by run and step), plus per-run
inputs from `run_start`. So each has a table `<view>_m` with exactly the view's columns, holding
the rows of the *materialized* steps, and:

- `views_state`: a rowid watermark per input table (step, collective, pipe_instr, run_start): its
  rows below the mark have been taken into the `_m` tables (the event tables are append-only, so
  rowids are dense and never move);
- `views_pending`: the (run_id, step) keys rolled past the watermarks but not materialized yet
  (a step still incomplete: not every started rank of the run has its step row; for a run without
  run_start rows, the run has no rows of a later step yet or the step has fewer ranks' step rows
  than its recently materialized steps).

The *live set* is every (run_id, step) with a row past a watermark in step / collective /
pipe_instr, every step of a run with a run_start row past its watermark, and the pending keys.
Each view reads `<view>_m` outside the live set UNION ALL its original SQL (the functions below,
the single source for both) restricted to the live set, so a view always equals its original
definition over the stored rows, whatever has or has not been materialized: a crashed
collector's file is correct, only slower to read. The derived views' live part reads step_ranks'
live part, so they compose.

`advance` (the writer's `tracetop-rollup` thread, beside collector/ingest/rollup.py, and at close with
final=True; one transaction) takes the rows past the watermarks, recomputes each touched step
wholly from the raw rows (filtered by the step range as SQL literals, so the zonemaps prune),
replaces its `_m` rows when the step is complete, keeps the incomplete ones pending, and moves the
watermarks; at close everything pending is materialized, so a cleanly closed file has an empty live
set. Late rows for a materialized step put it back in the live set until the next roll.
`collector.query.multifile` uses the original SQL over the raw rows (rowids are per file).
The SQL here is the shape `_v10` created: change it only through a new migration.
"""

from __future__ import annotations

#: the input tables whose rows past a watermark make steps live
INPUTS = ("step", "collective", "pipe_instr", "run_start")
#: materialized views, in dependency order (step_ranks first)
VIEWS = ("step_ranks", "stragglers", "grad_sync", "bubble_budget", "step_throughput", "lost_time")
#: a step is materialized, complete or not, once its run has rows this many steps later (a rank that
#: died never completes its steps; rows arriving later still make the step live again)
SETTLE_STEPS = 16
#: steps of this many step rows at most are recomputed in one statement (bounded memory): stragglers'
#: per-stage lists and joins over 1.6M rows passed the 366 MB DuckDB gets of the default 1 GB budget
CHUNK_ROWS = 250_000

_GRAD = ("list_contains(string_split(role, '|'), 'dp') AND (ltrim(op, '_') LIKE 'all_reduce%' OR "
         "ltrim(op, '_') LIKE 'reduce_scatter%' OR ltrim(op, '_') LIKE 'all_gather%') AND bytes >= 1024")
#: _GRAD's FILTER for the roll, counting the same rows: 'dp' is one of role's '|'-separated parts
#: exactly when '|dp|' is in '|' || role || '|', and the op's three ltrim/LIKEs run only on rows
#: that pass the cheap tests (a projection evaluates every AND'ed term of every row, CASE only its
#: branch's rows). At 16,384 ranks the pipeline file's step_ranks went from 53 to 38 ms CPU a step and
#: the live roll of the mix from 307 to 267 (roll_cost, A/B). NULL where _GRAD is NULL or false (a
#: FILTER drops both).
_GRAD_ROLL = ("CASE WHEN bytes >= 1024 AND contains('|' || role || '|', '|dp|') THEN ltrim(op, '_') LIKE 'all_reduce%' "
              "OR ltrim(op, '_') LIKE 'reduce_scatter%' OR ltrim(op, '_') LIKE 'all_gather%' END")


def _rows(table: str, keys: str | None, lo: int | None = None, hi: int | None = None) -> str:
    """`table`'s rows with step >= 0: those whose (run_id, step) is in relation `keys` (an
    uncorrelated SEMI JOIN: the keys are the hash table, so an empty or small key set reads
    little; a correlated EXISTS scanned the whole table) and in literal steps lo..hi, when given."""
    semi = f" SEMI JOIN {keys} k ON k.run_id = x.run_id AND k.step = x.step" if keys is not None else ""
    rng = f" AND x.step BETWEEN {int(lo)} AND {int(hi)}" if lo is not None and hi is not None else ""
    if keys is not None and table == "step":
        # the live set reads `step` too, and DuckDB then built the SEMI JOIN's hash table from all
        # 10^7 step rows (1.9 s with an empty live set); IN keeps the keys on the build side
        semi = ""
        rng += f" AND {{'r': x.run_id, 's': x.step}} IN (SELECT {{'r': run_id, 's': step}} FROM {keys})"
    return f"(SELECT x.* FROM {table} x{semi} WHERE x.step >= 0{rng})"


def step_ranks_sql(keys: str | None = None, lo: int | None = None, hi: int | None = None) -> str:
    """_v5's step_ranks SELECT (its `step` rows filtered before the joins: the same rows, and the
    restriction is applied before them); restricted to the (run_id, step) keys of relation `keys` (and steps
    lo..hi) when given. With a step range, the collective and pipe_instr rows are read by the range
    alone: they only meet the (restricted) step rows through LEFT JOINs, so keys outside `keys` drop out
    there, and the SEMI JOIN cost more than the aggregation (330k collective rows a step at 16k ranks)."""
    ranged = lo is not None and hi is not None  # the roll's (the views' text is _v10's: a change is a migration)
    by_range = None if ranged else keys  # the live views (no range) keep the SEMI JOIN: it reads little
    grad = _GRAD_ROLL if ranged else _GRAD
    return f"""WITH c AS (
            SELECT run_id, step, rank,
                   sum(duration_ns) FILTER (WHERE role NOT LIKE 'p2p%') AS coll_wait_ns,
                   sum(duration_ns) FILTER (WHERE {grad}) AS grad_sync_ns,
                   sum(duration_ns) FILTER (WHERE role LIKE 'p2p%') AS p2p_ns,
                   sum(bytes) FILTER (WHERE role LIKE 'p2p%') AS p2p_bytes,
                   max(bytes / duration_ns) FILTER (WHERE role LIKE 'p2p%' AND duration_ns > 0) AS best_p2p_bytes_per_ns
            FROM {_rows('collective', by_range, lo, hi)} GROUP BY run_id, step, rank
        ), i AS (
            SELECT run_id, step, rank, sum(duration_ns) AS reduce_ns
            FROM {_rows('pipe_instr', by_range, lo, hi)} WHERE instr IN ('ReduceGrads', 'ReduceTiedGrads')
            GROUP BY run_id, step, rank
        ), r AS (
            SELECT run_id, rank, max(stage) AS stage FROM run_start GROUP BY run_id, rank
        )
        SELECT s.run_id, s.step, s.rank, coalesce(r.stage, -1) AS stage,
               s.duration_ns / 1e6 AS step_ms, s.compute_ns / 1e6 AS compute_ms,
               coalesce(c.coll_wait_ns, 0) / 1e6 AS wait_ms, coalesce(c.grad_sync_ns, 0) / 1e6 AS grad_sync_ms,
               coalesce(c.p2p_ns, 0) / 1e6 AS p2p_ms, coalesce(c.p2p_bytes, 0) AS p2p_bytes,
               coalesce(c.best_p2p_bytes_per_ns, 0) AS best_p2p_bytes_per_ns,
               coalesce(i.reduce_ns, 0) / 1e6 AS reduce_ms, s.optimizer_ns / 1e6 AS optimizer_ms,
               (s.forward_ns + s.backward_ns) / 1e6 AS fwd_bwd_ms, s.comm_exposed_ns / 1e6 AS comm_exposed_ms,
               s.tokens, s.samples, s.loss
        FROM {_rows('step', keys, lo, hi)} s
        LEFT JOIN r ON r.run_id = s.run_id AND r.rank = s.rank
        LEFT JOIN c ON c.run_id = s.run_id AND c.step = s.step AND c.rank = s.rank
        LEFT JOIN i ON i.run_id = s.run_id AND i.step = s.step AND i.rank = s.rank"""


#: The judgment both stragglers SELECTs end with, over their relation `o` (rank, its stage's others).
STRAGGLER_JUDGMENT = """SELECT run_id, step, stage, rank, stage_ranks, compute_ms, wait_ms, others_compute_ms, others_wait_ms,
               compute_ms / others_compute_ms AS compute_ratio, compute_ms - others_compute_ms AS excess_ms,
               z_compute, z_wait,
               coalesce(compute_ms - others_compute_ms > 50 AND compute_ms / others_compute_ms > 1.5
                        AND wait_ms < others_wait_ms AND (stage_ranks < 5 OR z_compute > 3.5), false) AS is_straggler
        FROM (SELECT *,
                     CASE WHEN stage_ranks < 2 THEN NULL WHEN madc > 0 THEN (compute_ms - mc) / (1.4826 * madc)
                          WHEN compute_ms > mc THEN 'infinity'::DOUBLE WHEN compute_ms < mc THEN '-infinity'::DOUBLE
                          ELSE 0 END AS z_compute,
                     CASE WHEN stage_ranks < 2 THEN NULL WHEN madw > 0 THEN (wait_ms - mw) / (1.4826 * madw)
                          WHEN wait_ms > mw THEN 'infinity'::DOUBLE WHEN wait_ms < mw THEN '-infinity'::DOUBLE
                          ELSE 0 END AS z_wait
              FROM o)"""


def _at_or_before(v: str, x: str) -> str:
    """Whether value v's first position in its stage's sorted values (NULLs last, as ORDER BY and
    list_sort put them) is at or before the position holding x: v <= x, a NULL being the largest."""
    return f"(CASE WHEN {x} IS NULL THEN true WHEN {v} IS NULL THEN false ELSE {v} <= {x} END)"


def stragglers_sql(sr: str = "step_ranks") -> str:
    """The stragglers SELECT over the step_ranks relation `sr` (_v17): `stragglers_windows_sql`'s rows,
    exactly, from grouped aggregates joined back instead of four window passes. Per stage: its count,
    medians and one sorted list of each value (linear: a list per stage, not per row), from which the
    four sorted values around the median; a rank's "others" median is read at ia or ia + 1 (ib or
    ib + 1) as its own value is or is not at or before position ia (ib): the windows' row_number
    position among ties differs, but removing any one of equal values leaves the same values. The
    MAD is a median over the rows joined with their stage's median, grouped again."""
    def picks(v: str, lst: str) -> str:
        return (f"{lst}[(stage_ranks - 2) // 2 + 1] AS {v}_a0, {lst}[(stage_ranks - 2) // 2 + 2] AS {v}_a1, "
                f"{lst}[(stage_ranks - 1) // 2 + 1] AS {v}_b0, {lst}[(stage_ranks - 1) // 2 + 2] AS {v}_b1")

    def others(v: str) -> str:
        return (f"CASE WHEN q.stage_ranks > 1 THEN ((CASE WHEN {_at_or_before('s.' + v, 'q.' + v + '_a0')} "
                f"THEN q.{v}_a1 ELSE q.{v}_a0 END) + (CASE WHEN {_at_or_before('s.' + v, 'q.' + v + '_b0')} "
                f"THEN q.{v}_b1 ELSE q.{v}_b0 END)) / 2 END")

    def same(a: str, b: str) -> str:  # the windows' partitions: NULL keys are one partition
        return " AND ".join(f"{a}.{c} IS NOT DISTINCT FROM {b}.{c}" for c in ("run_id", "step", "stage"))

    return f"""WITH l AS (
            SELECT run_id, step, stage, count(*) AS stage_ranks, median(compute_ms) AS mc, median(wait_ms) AS mw,
                   list_sort(list(compute_ms)) AS cl, list_sort(list(wait_ms)) AS wl
            FROM {sr} GROUP BY run_id, step, stage
        ), q AS (
            SELECT run_id, step, stage, stage_ranks, mc, mw, {picks('compute_ms', 'cl')}, {picks('wait_ms', 'wl')} FROM l
        ), j AS (
            SELECT s.run_id, s.step, s.stage, s.rank, q.stage_ranks, s.compute_ms, s.wait_ms, q.mc, q.mw,
                   {others('compute_ms')} AS others_compute_ms, {others('wait_ms')} AS others_wait_ms
            FROM {sr} s JOIN q ON {same('q', 's')}
        ), d AS (
            SELECT run_id, step, stage, median(abs(compute_ms - mc)) AS madc, median(abs(wait_ms - mw)) AS madw
            FROM j GROUP BY run_id, step, stage
        ), o AS (
            SELECT j.*, d.madc, d.madw FROM j JOIN d ON {same('d', 'j')}
        )
        {STRAGGLER_JUDGMENT}"""


def grad_sync_sql(sr: str = "step_ranks") -> str:
    """_v5's grad_sync SELECT over `sr`."""
    return f"""SELECT run_id, step, count(*) AS ranks,
               quantile_cont(grad_sync_ms, 0.5) AS grad_sync_ms_p50, quantile_cont(grad_sync_ms, 0.99) AS grad_sync_ms_p99,
               sum(comm_exposed_ms) / nullif(sum(step_ms), 0) AS comm_share,
               sum(compute_ms) / nullif(sum(compute_ms) + sum(comm_exposed_ms), 0) AS within_run_efficiency
        FROM {sr} GROUP BY run_id, step"""


def bubble_budget_sql(sr: str = "step_ranks") -> str:
    """_v5's bubble_budget SELECT over `sr`."""
    return f"""WITH b AS (
            SELECT *, max(best_p2p_bytes_per_ns) OVER (PARTITION BY run_id, step) AS best
            FROM {sr} WHERE stage >= 0
        ), t AS (
            SELECT *, CASE WHEN best > 0 THEN least(p2p_bytes / (best * 1e6), p2p_ms) ELSE 0 END AS transfer_ms FROM b
        ), s AS (
            SELECT run_id, step, stage, count(*) AS ranks, sum(step_ms) AS d, sum(fwd_bwd_ms) AS comp,
                   sum(transfer_ms) AS tr, sum(p2p_ms) AS p2p, sum(reduce_ms + optimizer_ms) AS tail,
                   median(fwd_bwd_ms) AS compute_ms
            FROM t GROUP BY run_id, step, stage HAVING sum(step_ms) > 0
        )
        SELECT run_id, step, stage, ranks, 1 - comp / d AS bubble, comp / d AS compute, p2p / d - tr / d AS waiting,
               tr / d AS transfer, tail / d AS tail, 1 - comp / d - (p2p / d - tr / d) - tr / d - tail / d AS overhead,
               compute_ms,
               max(compute_ms) OVER w / nullif(min(compute_ms) OVER w, 0) AS stage_imbalance,
               arg_max(stage, compute_ms) OVER w AS slow_stage
        FROM s WINDOW w AS (PARTITION BY run_id, step)"""


def step_throughput_sql(sr: str = "step_ranks") -> str:
    """_v5's step_throughput SELECT over `sr`."""
    return f"""SELECT sr.run_id, sr.step,
               median(sr.tokens / ((sr.step_ms) / 1e3)) FILTER (WHERE sr.tokens >= 0 AND sr.step_ms > 0)
                   * max(r.dp) / greatest(max(r.world_size), count(*)) AS per_gpu_tokens_per_s
        FROM {sr} sr JOIN runs r ON r.run_id = sr.run_id GROUP BY sr.run_id, sr.step"""


def lost_time_sql(sr: str = "step_ranks", keys: str | None = None, lo: int | None = None,
                  hi: int | None = None) -> str:
    """collector/query/lost_sql.py's lost_time SELECT (built-in baseline) over `sr`, its `step` rows
    restricted as step_ranks' are (keys, steps lo..hi). It reads one step row per (run, step, rank),
    so a step's cost is linear in its rows however often a step row repeats."""
    from collector.query.lost_sql import lost_time_over

    return lost_time_over(sr, _rows("step", keys, lo, hi))


DERIVED = {"stragglers": stragglers_sql, "grad_sync": grad_sync_sql, "bubble_budget": bubble_budget_sql,
           "step_throughput": step_throughput_sql}
#: the derived views that also read the raw `step` rows: (sr, keys, lo, hi)
WITH_STEP = {"lost_time": lost_time_sql}


def derived_sql(view: str, sr: str, keys: str | None = None, lo: int | None = None, hi: int | None = None) -> str:
    """A derived view's SELECT over the step_ranks relation `sr` (and the step rows of keys lo..hi)."""
    return WITH_STEP[view](sr, keys, lo, hi) if view in WITH_STEP else DERIVED[view](sr)


def original_sql(view: str, keys: str | None = None) -> str:
    """The view's original SELECT over the raw rows (restricted to relation `keys` when given)."""
    sr = f"({step_ranks_sql(keys)})"
    return step_ranks_sql(keys) if view == "step_ranks" else derived_sql(view, sr, keys)


def _mark(table: str, prefix: str = "") -> str:
    return f"coalesce((SELECT max(rows_upto) FROM {prefix}views_state WHERE table_name = '{table}'), 0)"


def live_sql() -> str:
    """The live set: (run_id, step) keys whose rows the `_m` tables may not hold."""
    tails = " UNION ALL ".join(f"SELECT run_id, step FROM {t} WHERE rowid >= {_mark(t)}"
                               for t in ("step", "collective", "pipe_instr"))
    return (f"(SELECT DISTINCT run_id, step FROM ({tails} UNION ALL SELECT run_id, step FROM views_pending "
            f"UNION ALL SELECT run_id, step FROM step_ranks_m WHERE run_id IN "
            f"(SELECT run_id FROM run_start WHERE rowid >= {_mark('run_start')})) WHERE step >= 0)")


def view_sql(view: str) -> str:
    """CREATE OR REPLACE VIEW: the materialized rows outside the live set, the original SQL inside it."""
    live = live_sql()
    return (f"CREATE OR REPLACE VIEW {view} AS SELECT m.* FROM {view}_m m ANTI JOIN {live} l "
            f"ON l.run_id = m.run_id AND l.step = m.step UNION ALL SELECT * FROM ({original_sql(view, live)})")


def ddl() -> list[str]:
    """The `_m` tables (the views' own columns, from their SQL), the watermarks, the pending keys."""
    stmts = [
        """CREATE TABLE IF NOT EXISTS views_state (
            table_name VARCHAR PRIMARY KEY,  -- an input table of the materialized views
            rows_upto BIGINT NOT NULL        -- its rows with rowid < rows_upto are in the _m tables
        )""",
        "CREATE TABLE IF NOT EXISTS views_pending (run_id VARCHAR NOT NULL, step BIGINT NOT NULL)",
    ]
    stmts += [f"CREATE TABLE IF NOT EXISTS {v}_m AS SELECT * FROM ({original_sql(v)}) LIMIT 0" for v in VIEWS]
    return stmts


def migration() -> list[str]:
    """_v10's statements: the tables and the views over them. Every stored step is then
    materialized by `rebuild` (the migration's `post`, in chunks of steps: one statement over
    10^7 step rows ran out of 8 GB), as a closing writer leaves them: an empty live set."""
    return [*ddl(), *(view_sql(v) for v in VIEWS)]


def _marks(con) -> dict[str, tuple[int, int]]:
    old = dict(con.execute("SELECT table_name, rows_upto FROM views_state").fetchall())
    out = {}
    for t in INPUTS:
        # from the mark on only: the rowid filter skips the row groups below it (max(rowid) over the
        # whole table read all of them: 10 ms a roll per 10^7 rows, growing with the file)
        mark = int(old.get(t, 0))
        new = con.execute(f"SELECT coalesce(max(rowid) + 1, {mark}) FROM {t} WHERE rowid >= {mark}").fetchone()[0]
        out[t] = (mark, int(new))
    return out


def _chunks(steps: list[int], per_step_rows: int) -> list[tuple[int, int]]:
    per = max(1, CHUNK_ROWS // max(1, per_step_rows))
    return [(steps[i], steps[min(i + per, len(steps)) - 1]) for i in range(0, len(steps), per)]


def _rows_per_step(con, steps: list[int]) -> int:
    """Step rows a step number holds, for sizing the chunks: the runs' started ranks, or the step rows
    stored at these step numbers on average when more (a run without run_start rows says no ranks:
    sized as one row a step, a roll of 200k such steps took 1.6M rows in one statement and ran DuckDB
    out of memory, failing the roll again at every try)."""
    started = con.execute("SELECT coalesce(max(ranks_started), 1) * (SELECT count(DISTINCT run_id) FROM _tt_done) "
                          "FROM runs").fetchone()[0]
    stored = con.execute(f"SELECT count(*) FROM step WHERE step BETWEEN {steps[0]} AND {steps[-1]}").fetchone()[0]
    return max(1, int(started or 1), -(-int(stored) // len(steps)))


def advance_in(con, *, final: bool = False) -> int:
    """Materialize the steps touched since the watermarks (in the caller's transaction). final:
    every touched step, complete or not (a writer closing). Returns the steps materialized."""
    marks = _marks(con)
    tails = [f"SELECT run_id, step FROM {t} WHERE rowid >= {old} AND rowid < {new}"
             for t, (old, new) in marks.items() if t != "run_start" and new > old]
    old, new = marks["run_start"]
    if new > old:
        tails.append(f"SELECT run_id, step FROM step_ranks_m WHERE run_id IN "
                     f"(SELECT run_id FROM run_start WHERE rowid >= {old} AND rowid < {new})")
    tails.append("SELECT run_id, step FROM views_pending")
    con.execute(f"CREATE OR REPLACE TEMP TABLE _tt_touched AS SELECT DISTINCT run_id, step FROM "
                f"({' UNION ALL '.join(tails)}) WHERE step >= 0")
    lo, hi = con.execute("SELECT min(step), max(step) FROM _tt_touched").fetchone()
    # a run without run_start rows whose only touched step is its newest has nothing complete (no later
    # step, nothing SETTLE_STEPS later): when every touched run is one, the test below is skipped (two of
    # the three rolls a step at 16k ranks, while the step's rows come in)
    waiting = lo is not None and not final and con.execute(
        "SELECT count(*) = 0 FROM (SELECT run_id FROM _tt_touched GROUP BY run_id "
        "HAVING count(*) > 1 OR run_id IN (SELECT run_id FROM run_start))").fetchone()[0]
    if waiting:
        con.execute("CREATE OR REPLACE TEMP TABLE _tt_done AS SELECT * FROM _tt_touched LIMIT 0")
    elif final or lo is None:  # (nothing touched: a roll reads no more; the steps' scans below had no bound)
        con.execute("CREATE OR REPLACE TEMP TABLE _tt_done AS SELECT * FROM _tt_touched")
    else:
        # complete: each of the run's started ranks has its step row, or the run has rows SETTLE_STEPS
        # steps later. A run with no run_start rows does not say its ranks: its step is complete once it
        # has as many ranks' step rows as its recently materialized steps had (grad_sync_m.ranks, its
        # step rows a step) and the run has rows of a later step. Taking such a step as soon as it had a
        # step row materialized it again at every roll while its ranks' rows came in (3-7 times a step
        # at 16k ranks, the more the further the collector was behind)
        rng = f"AND s.step BETWEEN {int(lo)} AND {int(hi)}"
        seen = f"AND step BETWEEN {int(lo) - SETTLE_STEPS} AND {int(hi)}"
        con.execute(f"""CREATE OR REPLACE TEMP TABLE _tt_done AS
            WITH n AS (SELECT s.run_id, s.step, count(DISTINCT s.rank) AS ranks FROM step s
                       WHERE EXISTS (SELECT 1 FROM _tt_touched t WHERE t.run_id = s.run_id AND t.step = s.step) {rng}
                         AND (NOT EXISTS (SELECT 1 FROM run_start r WHERE r.run_id = s.run_id)
                              OR EXISTS (SELECT 1 FROM run_start r WHERE r.run_id = s.run_id AND r.rank = s.rank))
                       GROUP BY ALL),
                 r AS (SELECT run_id, count(DISTINCT rank) AS started FROM run_start GROUP BY run_id),
                 newest AS (SELECT run_id, max(step) AS step FROM _tt_touched GROUP BY run_id),
                 seen AS (SELECT run_id, max(ranks) AS ranks FROM grad_sync_m
                          WHERE run_id IN (SELECT run_id FROM newest) {seen} GROUP BY run_id)
            SELECT t.run_id, t.step FROM _tt_touched t
            LEFT JOIN n ON n.run_id = t.run_id AND n.step = t.step
            LEFT JOIN r ON r.run_id = t.run_id
            LEFT JOIN newest ON newest.run_id = t.run_id
            LEFT JOIN seen ON seen.run_id = t.run_id
            WHERE n.ranks >= r.started
               OR (r.started IS NULL AND n.ranks >= coalesce(seen.ranks, 1) AND t.step < newest.step)
               OR t.step + {SETTLE_STEPS} <= newest.step""")
    steps = [s for (s,) in con.execute("SELECT DISTINCT step FROM _tt_done ORDER BY 1").fetchall()]
    if steps:
        for lo, hi in _chunks(steps, _rows_per_step(con, steps)):
            keys = f"(SELECT * FROM _tt_done WHERE step BETWEEN {lo} AND {hi})"
            # a step materialized before has step_ranks_m rows (every view's rows come from them): when
            # none of these steps has, there is nothing to delete (six statements less a roll)
            again = con.execute(f"SELECT count(*) FROM (SELECT 1 FROM step_ranks_m WHERE step BETWEEN {lo} AND {hi} "
                                "LIMIT 1)").fetchone()[0]
            for v in VIEWS if again else ():
                con.execute(f"DELETE FROM {v}_m m WHERE m.step BETWEEN {lo} AND {hi} AND EXISTS "
                            f"(SELECT 1 FROM {keys} k WHERE k.run_id = m.run_id AND k.step = m.step)")
            con.execute(f"CREATE OR REPLACE TEMP TABLE _tt_sr AS {step_ranks_sql(keys, lo, hi)}")
            con.execute("INSERT INTO step_ranks_m SELECT * FROM _tt_sr")
            for v in VIEWS[1:]:
                con.execute(f"INSERT INTO {v}_m SELECT * FROM ({derived_sql(v, '_tt_sr', keys, lo, hi)})")
        con.execute("DROP TABLE _tt_sr")
    con.execute("DELETE FROM views_pending")
    con.execute("INSERT INTO views_pending SELECT run_id, step FROM _tt_touched t WHERE NOT EXISTS "
                "(SELECT 1 FROM _tt_done d WHERE d.run_id = t.run_id AND d.step = t.step)")
    moved = [f"('{t}', {int(new)})" for t, (old, new) in marks.items() if new != old]
    if moved:  # one statement (one upsert a table cost ~2 ms each)
        con.execute(f"INSERT OR REPLACE INTO views_state VALUES {', '.join(moved)}")
    con.execute("DROP TABLE _tt_touched")
    con.execute("DROP TABLE _tt_done")
    return len(steps)


def advance(con, *, final: bool = False) -> int:
    """`advance_in` in its own transaction (the writer's roll thread, and its close)."""
    con.execute("BEGIN TRANSACTION")
    try:
        n = advance_in(con, final=final)
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
        raise
    return n


def rebuild(con) -> None:
    """Materialize every stored step again, in the caller's transaction: for a file written by
    something other than the collector's writer (a test, the views bench's generator), and _v10."""
    for v in VIEWS:
        con.execute(f"DELETE FROM {v}_m")
    con.execute("DELETE FROM views_pending")
    con.execute("DELETE FROM views_state")
    advance_in(con, final=True)


def pending_rows(con) -> int:
    """Rows past the watermarks plus pending keys: 0 when the live set is empty."""
    n = sum(con.execute(f"SELECT count(*) FROM {t} WHERE rowid >= {_mark(t)}").fetchall()[0][0] for t in INPUTS)
    return n + con.execute("SELECT count(*) FROM views_pending").fetchall()[0][0]
