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

The collector's writer adds each batch's histogram rows in the same transaction as the batch
(`upsert_sql`), the migration fills them from the stored rows (`upsert_sql` over the table), and
`collector.multifile` derives them from the raw rows (`rows_sql`) for a file older than the
rollups, so the three can never disagree. The SQL here is the shape `_v9` created: change it
only through a new migration.
"""

from __future__ import annotations

from tracetop.events import Kind, table_name

BUCKETS_PER_OCTAVE = 512
GROWTH = 2.0 ** (1.0 / BUCKETS_PER_OCTAVE)
#: the largest relative distance between a reported quantile and the exact one (positive values)
REL_ERROR = (GROWTH - 1.0) / (GROWTH + 1.0)
NONPOSITIVE = -2147483648  # the bucket of values <= 0

STEP_KEYS = ("run_id", "rank")
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
    """The two rollup tables. `metric = 'rows'` (bucket 0) counts every row of the group, and for
    collectives its `total` is the group's exact byte sum. UNIQUE, not PRIMARY KEY: a NULL key
    (never sent by the hooks) makes a row of its own instead of failing the commit."""
    return [
        """CREATE TABLE IF NOT EXISTS step_rollup (
            run_id VARCHAR, rank INTEGER, metric VARCHAR NOT NULL, bucket INTEGER NOT NULL,
            n BIGINT NOT NULL, lo DOUBLE, hi DOUBLE,
            UNIQUE (run_id, rank, metric, bucket))""",
        """CREATE TABLE IF NOT EXISTS collective_rollup (
            run_id VARCHAR, op VARCHAR, role VARCHAR, group_size INTEGER, size_bucket VARCHAR,
            metric VARCHAR NOT NULL, bucket INTEGER NOT NULL,
            n BIGINT NOT NULL, lo DOUBLE, hi DOUBLE, total HUGEINT,
            UNIQUE (run_id, op, role, group_size, size_bucket, metric, bucket))""",
    ]


def rows_sql(table: str, src: str) -> str:
    """SELECT of `table`'s histogram rows for the event rows in relation `src`."""
    kind, keys = TABLES[table]
    k = ", ".join(keys)
    if kind is Kind.STEP:
        base = f"SELECT * FROM {src}"
        parts = [f"SELECT {k}, 'rows' AS metric, 0 AS bucket, NULL::DOUBLE AS v, NULL::HUGEINT AS t FROM b"]
        parts += [f"SELECT {k}, '{m}', {_bucket(m)}, {m}, NULL FROM b WHERE {m} IS NOT NULL" for m in STEP_METRICS]
        total = ""
    else:
        base = (f"SELECT run_id, op, role, group_size, {_SIZE_BUCKET} AS size_bucket, bytes, duration_ns, "
                f"bytes / nullif(duration_ns, 0) AS algbw_gbps FROM {src} WHERE group_size > 0")
        parts = [f"SELECT {k}, 'rows' AS metric, 0 AS bucket, NULL::DOUBLE AS v, bytes::HUGEINT AS t FROM b"]
        parts += [f"SELECT {k}, '{m}', {_bucket(m)}, {m}, NULL FROM b WHERE {m} IS NOT NULL"
                  for m in COLLECTIVE_METRICS]
        total = ", sum(t) AS total"
    union = " UNION ALL ".join(parts)
    return (f"WITH b AS ({base}) SELECT {k}, metric, bucket, count(*) AS n, min(v) AS lo, max(v) AS hi{total} "
            f"FROM ({union}) GROUP BY ALL")


def upsert_sql(table: str, src: str) -> str:
    """Add the histogram of the event rows in `src` to `table` (one statement)."""
    kind, keys = TABLES[table]
    conflict = ", ".join((*keys, "metric", "bucket"))
    total = ", total = total + excluded.total" if kind is Kind.COLLECTIVE else ""
    return (f"INSERT INTO {table} BY NAME {rows_sql(table, src)} ON CONFLICT ({conflict}) DO UPDATE SET "
            f"n = n + excluded.n, lo = least(lo, excluded.lo), hi = greatest(hi, excluded.hi){total}")


def rebuild(con) -> None:
    """Refill both rollups from the stored rows: for a file whose rows were written by something
    other than the collector's writer (a test, the views bench's generator)."""
    for table, (kind, _) in TABLES.items():
        con.execute(f"DELETE FROM {table}")
        con.execute(upsert_sql(table, table_name(kind)))


def for_kind(kind: Kind) -> str | None:
    """The rollup table fed by rows of `kind`, if any."""
    return next((t for t, (k, _) in TABLES.items() if k is kind), None)


def _quantiles(table: str, keys: tuple[str, ...], wanted: list[tuple[str, float]]) -> str:
    """CTEs h, c, t, v, qv: per group, metric and q the quantile_cont value from the histogram.
    quantile_cont's own rule: position (n-1)q, the values at floor and ceil of it, interpolated."""
    k = ", ".join(keys)
    targets = " UNION ALL ".join(f"SELECT '{m}' AS metric, {q}::DOUBLE AS q" for m, q in wanted)
    rep = f"2 * pow(2, (bucket + 1) / {BUCKETS_PER_OCTAVE}.0) / (1 + pow(2, 1 / {BUCKETS_PER_OCTAVE}.0))"

    def at(r: str) -> str:
        return (f"CASE WHEN {r} = c0 THEN lo WHEN {r} = c1 - 1 THEN hi WHEN bucket = {NONPOSITIVE} THEN (lo + hi) / 2 "
                f"ELSE greatest(lo, least(hi, {rep})) END")

    return f"""h AS (SELECT {k}, metric, bucket, sum(n) AS n, min(lo) AS lo, max(hi) AS hi
                FROM {table} WHERE metric <> 'rows' GROUP BY ALL),
        c AS (SELECT *, sum(n) OVER (PARTITION BY {k}, metric ORDER BY bucket ROWS UNBOUNDED PRECEDING) AS c1,
                     sum(n) OVER (PARTITION BY {k}, metric) AS total FROM h),
        t AS (SELECT c.*, c1 - n AS c0, w.q, (total - 1) * w.q AS pos, floor((total - 1) * w.q) AS r_lo,
                     ceil((total - 1) * w.q) AS r_hi
              FROM c JOIN ({targets}) w ON w.metric = c.metric),
        v AS (SELECT {k}, metric, q, any_value(pos) AS pos, any_value(r_lo) AS r_lo,
                     any_value({at('r_lo')}) FILTER (WHERE c0 <= r_lo AND r_lo < c1) AS v_lo,
                     any_value({at('r_hi')}) FILTER (WHERE c0 <= r_hi AND r_hi < c1) AS v_hi
              FROM t GROUP BY ALL),
        qv AS (SELECT {k}, metric, q, v_lo + (pos - r_lo) * (v_hi - v_lo) AS value FROM v)"""


def _pick(metric: str, q: float) -> str:
    return f"max(value) FILTER (WHERE metric = '{metric}' AND q = {q}::DOUBLE)"


def step_summary_view() -> str:
    k = ", ".join(STEP_KEYS)
    wanted = [("duration_ns", 0.5), ("duration_ns", 0.99), ("compute_ns", 0.5), ("comm_exposed_ns", 0.5),
              ("data_wait_ns", 0.5)]
    return f"""CREATE OR REPLACE VIEW step_summary AS
        WITH {_quantiles('step_rollup', STEP_KEYS, wanted)},
        g AS (SELECT {k}, sum(n) AS steps FROM step_rollup WHERE metric = 'rows' GROUP BY ALL),
        p AS (SELECT {k},
                     {_pick('duration_ns', 0.5)} / 1e6 AS step_ms_p50,
                     {_pick('duration_ns', 0.99)} / 1e6 AS step_ms_p99,
                     {_pick('compute_ns', 0.5)} / 1e6 AS compute_ms_p50,
                     {_pick('comm_exposed_ns', 0.5)} / 1e6 AS comm_exposed_ms_p50,
                     {_pick('data_wait_ns', 0.5)} / 1e6 AS data_wait_ms_p50
              FROM qv GROUP BY ALL)
        SELECT g.run_id, g.rank, CAST(g.steps AS BIGINT) AS steps, p.step_ms_p50, p.step_ms_p99, p.compute_ms_p50,
               p.comm_exposed_ms_p50, p.data_wait_ms_p50
        FROM g LEFT JOIN p ON p.run_id IS NOT DISTINCT FROM g.run_id AND p.rank IS NOT DISTINCT FROM g.rank"""


def collective_stats_view() -> str:
    k = ", ".join(COLLECTIVE_KEYS)
    wanted = [("bytes", 0.5), ("duration_ns", 0.5), ("duration_ns", 0.99), ("algbw_gbps", 0.5)]
    join = " AND ".join(f"p.{c} IS NOT DISTINCT FROM g.{c}" for c in COLLECTIVE_KEYS)
    # NCCL-tests bus factor: constant within a group (op and group size are keys), so the median of
    # algbw * factor is the median of algbw times the factor
    factor = ("CASE WHEN g.op LIKE 'all_reduce%' THEN 2.0 * (g.group_size - 1) / g.group_size "
              "WHEN g.op LIKE '%all_gather%' OR g.op LIKE '%reduce_scatter%' OR g.op LIKE 'all_to_all%' "
              "THEN 1.0 * (g.group_size - 1) / g.group_size ELSE 1.0 END")
    return f"""CREATE OR REPLACE VIEW collective_stats AS
        WITH {_quantiles('collective_rollup', COLLECTIVE_KEYS, wanted)},
        g AS (SELECT {k}, sum(n) AS calls, sum(total) AS total_bytes FROM collective_rollup WHERE metric = 'rows'
              GROUP BY ALL),
        p AS (SELECT {k},
                     {_pick('bytes', 0.5)} AS bytes_p50,
                     {_pick('duration_ns', 0.5)} / 1e6 AS duration_ms_p50,
                     {_pick('duration_ns', 0.99)} / 1e6 AS duration_ms_p99,
                     {_pick('algbw_gbps', 0.5)} AS algbw_gbps
              FROM qv GROUP BY ALL)
        SELECT g.run_id, g.op, g.role, g.group_size, g.size_bucket, CAST(g.calls AS BIGINT) AS calls,
               g.total_bytes, p.bytes_p50, p.duration_ms_p50, p.duration_ms_p99, p.algbw_gbps,
               p.algbw_gbps * {factor} AS busbw_gbps
        FROM g LEFT JOIN p ON {join}"""


def migration() -> list[str]:
    """_v9's statements: the tables, filled from the stored rows, and the two views over them."""
    return [*ddl(), upsert_sql("step_rollup", "step"), upsert_sql("collective_rollup", "collective"),
            step_summary_view(), collective_stats_view()]
