"""Rollups behind `step_summary` and `collective_stats` (schema version of migration `_v9`).

At 10^8 event rows those two views computed exact `quantile_cont` medians over 10^7 step and
5*10^7 collective rows on every read (2.1 s and 7.9 s on the shared 2-core machine). An exact
median needs every value, or an order-statistic index DuckDB does not have, so no rollup can
hold exact medians in less space than the rows. The rollups hold instead, per view group and
metric, a histogram with log-spaced buckets of 512 per octave (a bucket spans a factor
2^(1/512), 0.135%) and, per bucket, the exact count, smallest and largest value:

- counts and sums (`steps`, `calls`, `total_bytes`) are exact;
- a quantile is found exactly by rank (the cumulative counts name the bucket holding the value
  at each rank quantile_cont interpolates between); the value there is exact when it is the
  bucket's smallest or largest (or the bucket holds one distinct value), and otherwise the
  bucket's middle 2*2^((b+1)/512)/(1+2^(1/512)), clamped to [smallest, largest]: within a
  relative 0.0677% (= (2^(1/512)-1)/(2^(1/512)+1), REL_ERROR) of the exact value. Non-positive
  values share one bucket (exact only at its ends).

The rollup covers a table's rows up to a watermark (`rollup_state.rows_upto`, a rowid: the
event tables are append-only, so rowids are dense and never move); the views add the histogram
of the rows past it (the tail) computed on read, through `step_hist` / `collective_hist`, so they
count every stored row and can never disagree with them. The migration rolls up all stored rows;
the collector's writer advances the watermark (`advance`, one transaction: the rows past it
rolled up, the watermark moved) once ROLL_EVERY_ROWS rows of a kind have been committed past it
and when it closes, and compacts a rollup (re-sums its rows) when it has doubled since the last
compaction. Rolling up per commit instead cost 5x the commit itself (a commit's few rows per
bucket do not compress); in chunks it costs one GROUP BY per chunk. `collector.query.multifile`
derives the histograms from the raw rows (`rows_sql`) for a file older than the rollups.
The SQL here is the shape `_v9` created: change it only through a new migration.
"""

from __future__ import annotations

from tracetop.events import Kind, table_name

BUCKETS_PER_OCTAVE = 512
GROWTH = 2.0 ** (1.0 / BUCKETS_PER_OCTAVE)
#: the largest relative distance between a reported quantile and the exact one (positive values)
REL_ERROR = (GROWTH - 1.0) / (GROWTH + 1.0)
NONPOSITIVE = -2147483648  # the bucket of values <= 0
#: the writer rolls a kind's rows up once this many are past the watermark (and when it closes)
ROLL_EVERY_ROWS = 200_000
#: a rollup is compacted when it has more rows than this and twice its last compacted size
COMPACT_MIN_ROWS = 100_000

STEP_KEYS = ("run_id", "rank")
#: metric codes (UTINYINT in the tables: integer keys sort and group twice as fast as strings);
#: 0 is `rows`, every row of the group
STEP_METRICS = ("duration_ns", "compute_ns", "comm_exposed_ns", "data_wait_ns")
COLLECTIVE_KEYS = ("run_id", "op", "role", "group_size", "size_bucket")
COLLECTIVE_METRICS = ("bytes", "duration_ns", "algbw_gbps")

#: rollup table -> (the event kind it is made from, its group keys)
TABLES = {"step_rollup": (Kind.STEP, STEP_KEYS), "collective_rollup": (Kind.COLLECTIVE, COLLECTIVE_KEYS)}

_SIZE_BUCKET = ("CASE WHEN bytes < 1024 THEN '<1KiB' WHEN bytes < 1048576 THEN '1KiB-1MiB' "
                "WHEN bytes < 67108864 THEN '1MiB-64MiB' ELSE '>=64MiB' END")


def _bucket(v: str) -> str:
    return (f"CASE WHEN {v} > 0 THEN CAST(floor(log2({v}) * {BUCKETS_PER_OCTAVE}) AS INTEGER) "
            f"ELSE {NONPOSITIVE} END")


def ddl() -> list[str]:
    """The two rollup tables and their watermarks. `metric = 0` (bucket 0) counts every row of
    the group, and for collectives its `total` is the group's exact byte sum; metric m > 0 is
    STEP_METRICS / COLLECTIVE_METRICS[m - 1]. Rows are appended
    (several per key until a compaction re-sums them): readers sum them by key."""
    return [
        """CREATE TABLE IF NOT EXISTS step_rollup (
            run_id VARCHAR, rank INTEGER, metric UTINYINT NOT NULL, bucket INTEGER NOT NULL,
            n BIGINT NOT NULL, lo DOUBLE, hi DOUBLE)""",
        """CREATE TABLE IF NOT EXISTS collective_rollup (
            run_id VARCHAR, op VARCHAR, role VARCHAR, group_size INTEGER, size_bucket VARCHAR,
            metric UTINYINT NOT NULL, bucket INTEGER NOT NULL,
            n BIGINT NOT NULL, lo DOUBLE, hi DOUBLE, total HUGEINT)""",
        """CREATE TABLE IF NOT EXISTS rollup_state (
            table_name VARCHAR PRIMARY KEY,  -- the event table
            rows_upto BIGINT NOT NULL,       -- its rows with rowid < rows_upto are in the rollup
            compacted_rows BIGINT NOT NULL   -- the rollup's row count after its last compaction
        )""",
    ]


def rows_sql(table: str, src: str) -> str:
    """SELECT of `table`'s histogram rows for the event rows in relation `src`."""
    kind, keys = TABLES[table]
    k = ", ".join(keys)
    if kind is Kind.STEP:
        base = f"SELECT * FROM {src}"
        parts = [f"SELECT {k}, 0::UTINYINT AS metric, 0 AS bucket, NULL::DOUBLE AS v, NULL::HUGEINT AS t FROM b"]
        parts += [f"SELECT {k}, {i + 1}, {_bucket(m)}, {m}, NULL FROM b WHERE {m} IS NOT NULL"
                  for i, m in enumerate(STEP_METRICS)]
        total = ""
    else:
        base = (f"SELECT run_id, op, role, group_size, {_SIZE_BUCKET} AS size_bucket, bytes, duration_ns, "
                f"bytes / nullif(duration_ns, 0) AS algbw_gbps FROM {src} WHERE group_size > 0")
        parts = [f"SELECT {k}, 0::UTINYINT AS metric, 0 AS bucket, NULL::DOUBLE AS v, bytes::HUGEINT AS t FROM b"]
        parts += [f"SELECT {k}, {i + 1}, {_bucket(m)}, {m}, NULL FROM b WHERE {m} IS NOT NULL"
                  for i, m in enumerate(COLLECTIVE_METRICS)]
        total = ", sum(t) AS total"
    union = " UNION ALL ".join(parts)
    return (f"SELECT * FROM (WITH b AS ({base}) SELECT {k}, metric, bucket, count(*) AS n, min(v) AS lo, "
            f"max(v) AS hi{total} FROM ({union}) GROUP BY ALL)")


def collective_rows_sql(src: str) -> str:
    """`rows_sql('collective_rollup', src)`'s rows, exactly, in two aggregates: the rows grouped first
    by their keys and their three metrics' buckets together (counts, min, max, the byte sum: sums
    and extremes of parts are those of the whole), then each metric's histogram from those groups.
    The union of four copies of every row into one string-keyed aggregate cost 2x more at 16,384
    ranks (a step's calls of one key fall in few buckets: 655k rows became 4k groups first); where
    nearly every row is its own bucket triple (uniformly random durations over 100x) it costs ~10%
    more (collector/bench/roll_cost.py --live). Used by the writer's roll (`_advance_in`); the views
    keep `rows_sql`."""
    k = ", ".join(COLLECTIVE_KEYS)
    base = (f"SELECT run_id, op, role, group_size, {_SIZE_BUCKET} AS size_bucket, bytes, duration_ns, "
            f"bytes / nullif(duration_ns, 0) AS algbw_gbps FROM {src} WHERE group_size > 0")
    buckets = ", ".join(f"{_bucket(m)} AS b{i}" for i, m in enumerate(COLLECTIVE_METRICS))
    aggs = ", ".join(f"count({m}) AS n{i}, min({m})::DOUBLE AS lo{i}, max({m})::DOUBLE AS hi{i}"
                     for i, m in enumerate(COLLECTIVE_METRICS))
    g = f"SELECT {k}, {buckets}, count(*) AS n, sum(bytes::HUGEINT) AS t, {aggs} FROM ({base}) GROUP BY ALL"
    parts = [f"SELECT {k}, 0::UTINYINT AS metric, 0 AS bucket, CAST(sum(n) AS BIGINT) AS n, NULL::DOUBLE AS lo, "
             "NULL::DOUBLE AS hi, sum(t) AS total FROM g GROUP BY ALL"]
    parts += [f"SELECT {k}, {i + 1}::UTINYINT, b{i}, CAST(sum(n{i}) AS BIGINT), min(lo{i}), max(hi{i}), NULL "
              f"FROM g WHERE n{i} > 0 GROUP BY ALL" for i in range(len(COLLECTIVE_METRICS))]
    return f"SELECT * FROM (WITH g AS ({g}) {' UNION ALL '.join(parts)})"


def _raw(table: str) -> str:
    return table_name(TABLES[table][0])


def tail(table: str, prefix: str = "") -> str:
    """The rows of `table`'s event table past its watermark (`prefix`: another database's, "f0.main.")."""
    raw = _raw(table)
    return (f"(SELECT * FROM {prefix}{raw} WHERE rowid >= coalesce((SELECT max(rows_upto) FROM {prefix}rollup_state "
            f"WHERE table_name = '{raw}'), 0))")


def advance_sql(table: str) -> list[str]:
    """Roll up the rows past the watermark and move it (run in one transaction)."""
    raw = _raw(table)
    return [
        f"INSERT INTO rollup_state SELECT '{raw}', 0, 0 WHERE NOT EXISTS "
        f"(SELECT 1 FROM rollup_state WHERE table_name = '{raw}')",
        f"INSERT INTO {table} BY NAME {rows_sql(table, tail(table))}",
        f"UPDATE rollup_state SET rows_upto = (SELECT coalesce(max(rowid) + 1, 0) FROM {raw}) "
        f"WHERE table_name = '{raw}'",
    ]


def compact_sql(table: str) -> list[str]:
    """Re-sum `table`'s rows by key (run in one transaction; the sums do not change)."""
    kind, keys = TABLES[table]
    k = ", ".join((*keys, "metric", "bucket"))
    total = ", sum(total) AS total" if kind is Kind.COLLECTIVE else ""
    return [
        f"CREATE TEMP TABLE _tt_compact AS SELECT {k}, CAST(sum(n) AS BIGINT) AS n, min(lo) AS lo, max(hi) AS hi"
        f"{total} FROM {table} GROUP BY ALL",
        f"DELETE FROM {table}",
        f"INSERT INTO {table} BY NAME SELECT * FROM _tt_compact",
        "DROP TABLE _tt_compact",
        f"UPDATE rollup_state SET compacted_rows = (SELECT count(*) FROM {table}) WHERE table_name = '{_raw(table)}'",
    ]


def _in_transaction(con, stmts: list[str]) -> None:
    con.execute("BEGIN TRANSACTION")
    try:
        for stmt in stmts:
            con.execute(stmt)
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
        raise


def _advance_in(con, table: str) -> None:
    """`advance_sql`'s work with the watermarks as literals (in the caller's transaction): the rowid
    filters then skip the row groups below the mark, where `advance_sql`'s subquery mark and its
    max(rowid) over the whole table read every row group of the event table (tens of ms a roll,
    growing with the file)."""
    raw = _raw(table)
    con.execute(advance_sql(table)[0])  # the table's rollup_state row, when it has none
    old = int(con.execute(f"SELECT max(rows_upto) FROM rollup_state WHERE table_name = '{raw}'").fetchone()[0])
    new = int(con.execute(f"SELECT coalesce(max(rowid) + 1, {old}) FROM {raw} WHERE rowid >= {old}").fetchone()[0])
    if new > old:
        rows = f"(SELECT * FROM {raw} WHERE rowid >= {old} AND rowid < {new})"
        sql = collective_rows_sql(rows) if table == "collective_rollup" else rows_sql(table, rows)
        con.execute(f"INSERT INTO {table} BY NAME {sql}")
        con.execute(f"UPDATE rollup_state SET rows_upto = {new} WHERE table_name = '{raw}'")


def advance(con, table: str) -> None:
    """Roll up `table`'s tail; compact it when it has doubled since its last compaction."""
    con.execute("BEGIN TRANSACTION")
    try:
        _advance_in(con, table)
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
        raise
    rows, compacted = con.execute(
        f"SELECT (SELECT count(*) FROM {table}), max(compacted_rows) FROM rollup_state "
        f"WHERE table_name = '{_raw(table)}'").fetchone()
    if rows > max(2 * (compacted or 0), COMPACT_MIN_ROWS):
        _in_transaction(con, compact_sql(table))


def tail_rows(con, table: str) -> int:
    """How many rows of `table`'s event table are past its watermark."""
    return con.execute(f"SELECT count(*) FROM {tail(table)}").fetchone()[0]


def rebuild(con) -> None:
    """Roll up all stored rows again: for a file whose rows were written by something other than
    the collector's writer (a test, the views bench's generator), in the caller's transaction."""
    for table in TABLES:
        con.execute(f"DELETE FROM {table}")
        con.execute(f"DELETE FROM rollup_state WHERE table_name = '{_raw(table)}'")
        for stmt in advance_sql(table):
            con.execute(stmt)
        con.execute(f"UPDATE rollup_state SET compacted_rows = (SELECT count(*) FROM {table}) "
                    f"WHERE table_name = '{_raw(table)}'")


def for_kind(kind: Kind) -> str | None:
    """The rollup table fed by rows of `kind`, if any."""
    return next((t for t, (k, _) in TABLES.items() if k is kind), None)


def _tag(q: float) -> str:
    return f"q{round(q * 1000):04d}"


def _quantiles(table: str, keys: tuple[str, ...], qs: tuple[float, ...]) -> str:
    """CTEs h, c, qv: per group and metric, column q0500 (etc.) holds the quantile_cont value for
    each q from the histogram. quantile_cont's own rule: position (n-1)q, the values at its floor
    and ceiling rank, interpolated; one pass over the buckets (conditional aggregates pick the
    bucket holding each rank)."""
    k = ", ".join(keys)
    rep = f"2 * pow(2, (bucket + 1) / {BUCKETS_PER_OCTAVE}.0) / (1 + pow(2, 1 / {BUCKETS_PER_OCTAVE}.0))"

    def at(r: str) -> str:
        return (f"CASE WHEN {r} = c1 - n THEN lo WHEN {r} = c1 - 1 THEN hi WHEN bucket = {NONPOSITIVE} "
                f"THEN (lo + hi) / 2 ELSE greatest(lo, least(hi, {rep})) END")

    def pick(r: str) -> str:
        return f"any_value({at(r)}) FILTER (WHERE c1 - n <= {r} AND {r} < c1)"

    cols = []
    # BIGINT counts and DOUBLE q: sums of BIGINT are HUGEINT and a literal 0.5 is DECIMAL, whose
    # arithmetic costs 10x more per row
    for q in qs:
        lo, hi = f"floor((total - 1) * {q}::DOUBLE)", f"ceil((total - 1) * {q}::DOUBLE)"
        cols.append(f"{pick(lo)} AS {_tag(q)}_lo, {pick(hi)} AS {_tag(q)}_hi")
    # the buckets holding a rank that is read: one or two per q (the rest need no values)
    near = [f"(c1 - n <= ceil((total - 1) * {q}::DOUBLE) AND floor((total - 1) * {q}::DOUBLE) < c1)" for q in qs]
    interp = ", ".join(f"{_tag(q)}_lo + ((total - 1) * {q}::DOUBLE - floor((total - 1) * {q}::DOUBLE)) * ({_tag(q)}_hi - {_tag(q)}_lo) "
                       f"AS {_tag(q)}" for q in qs)
    return f"""h AS (SELECT {k}, metric, bucket, CAST(sum(n) AS BIGINT) AS n, min(lo) AS lo, max(hi) AS hi
                FROM {table} WHERE metric > 0 GROUP BY ALL),
        c AS (SELECT *, CAST(sum(n) OVER (PARTITION BY {k}, metric ORDER BY bucket ROWS UNBOUNDED PRECEDING) AS BIGINT) AS c1,
                     CAST(sum(n) OVER (PARTITION BY {k}, metric) AS BIGINT) AS total FROM h),
        v AS (SELECT {k}, metric, any_value(total) AS total, {", ".join(cols)} FROM c WHERE {" OR ".join(near)}
              GROUP BY ALL),
        qv AS (SELECT {k}, metric, {interp} FROM v)"""


def _pick(metrics: tuple[str, ...], metric: str, q: float) -> str:
    return f"max({_tag(q)}) FILTER (WHERE metric = {1 + metrics.index(metric)})"


def step_summary_view() -> str:
    k = ", ".join(STEP_KEYS)
    return f"""CREATE OR REPLACE VIEW step_summary AS
        WITH {_quantiles('step_hist', STEP_KEYS, (0.5, 0.99))},
        g AS (SELECT {k}, sum(n) AS steps FROM step_hist WHERE metric = 0 GROUP BY ALL),
        p AS (SELECT {k},
                     {_pick(STEP_METRICS, 'duration_ns', 0.5)} / 1e6 AS step_ms_p50,
                     {_pick(STEP_METRICS, 'duration_ns', 0.99)} / 1e6 AS step_ms_p99,
                     {_pick(STEP_METRICS, 'compute_ns', 0.5)} / 1e6 AS compute_ms_p50,
                     {_pick(STEP_METRICS, 'comm_exposed_ns', 0.5)} / 1e6 AS comm_exposed_ms_p50,
                     {_pick(STEP_METRICS, 'data_wait_ns', 0.5)} / 1e6 AS data_wait_ms_p50
              FROM qv GROUP BY ALL)
        SELECT g.run_id, g.rank, CAST(g.steps AS BIGINT) AS steps, p.step_ms_p50, p.step_ms_p99, p.compute_ms_p50,
               p.comm_exposed_ms_p50, p.data_wait_ms_p50
        FROM g LEFT JOIN p ON p.run_id IS NOT DISTINCT FROM g.run_id AND p.rank IS NOT DISTINCT FROM g.rank"""


def collective_stats_view() -> str:
    k = ", ".join(COLLECTIVE_KEYS)
    join = " AND ".join(f"p.{c} IS NOT DISTINCT FROM g.{c}" for c in COLLECTIVE_KEYS)
    # NCCL-tests bus factor: constant within a group (op and group size are keys), so the median of
    # algbw * factor is the median of algbw times the factor
    factor = ("CASE WHEN g.op LIKE 'all_reduce%' THEN 2.0 * (g.group_size - 1) / g.group_size "
              "WHEN g.op LIKE '%all_gather%' OR g.op LIKE '%reduce_scatter%' OR g.op LIKE 'all_to_all%' "
              "THEN 1.0 * (g.group_size - 1) / g.group_size ELSE 1.0 END")
    return f"""CREATE OR REPLACE VIEW collective_stats AS
        WITH {_quantiles('collective_hist', COLLECTIVE_KEYS, (0.5, 0.99))},
        g AS (SELECT {k}, sum(n) AS calls, sum(total) AS total_bytes FROM collective_hist WHERE metric = 0
              GROUP BY ALL),
        p AS (SELECT {k},
                     {_pick(COLLECTIVE_METRICS, 'bytes', 0.5)} AS bytes_p50,
                     {_pick(COLLECTIVE_METRICS, 'duration_ns', 0.5)} / 1e6 AS duration_ms_p50,
                     {_pick(COLLECTIVE_METRICS, 'duration_ns', 0.99)} / 1e6 AS duration_ms_p99,
                     {_pick(COLLECTIVE_METRICS, 'algbw_gbps', 0.5)} AS algbw_gbps
              FROM qv GROUP BY ALL)
        SELECT g.run_id, g.op, g.role, g.group_size, g.size_bucket, CAST(g.calls AS BIGINT) AS calls,
               g.total_bytes, p.bytes_p50, p.duration_ms_p50, p.duration_ms_p99, p.algbw_gbps,
               p.algbw_gbps * {factor} AS busbw_gbps
        FROM g LEFT JOIN p ON {join}"""


def hist_view(table: str) -> str:
    """`step_hist` / `collective_hist`: the rollup's rows and the tail's histogram, one relation."""
    return (f"CREATE OR REPLACE VIEW {HIST_VIEWS[table]} AS SELECT * FROM {table} "
            f"UNION ALL BY NAME {rows_sql(table, tail(table))}")


HIST_VIEWS = {"step_rollup": "step_hist", "collective_rollup": "collective_hist"}


def migration() -> list[str]:
    """_v9's statements: the tables, all stored rows rolled up, the views over them."""
    stmts = ddl()
    for table in TABLES:
        stmts += advance_sql(table)
        stmts.append(f"UPDATE rollup_state SET compacted_rows = (SELECT count(*) FROM {table}) "
                     f"WHERE table_name = '{_raw(table)}'")
        stmts.append(hist_view(table))
    return [*stmts, step_summary_view(), collective_stats_view()]
