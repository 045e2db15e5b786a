"""The collector's DuckDB schema: tables derived from tracetop/events.py, views, migrations.

The file's schema has its own version (`schema_meta.version`), separate from the wire's
SCHEMA_VERSION. `MIGRATIONS[i]` takes a file from version i to i + 1; `open_store` applies the
missing ones in one transaction when it opens a file for writing, and refuses a file written by a
newer tracetop. Every connection opened here has DuckDB's external access off (no file reads,
COPY, ATTACH or extension installs through SQL); inserts go through registered Arrow tables,
which need none.
"""

from __future__ import annotations

from collections.abc import Callable

from tracetop.events import SCHEMAS, Kind, table_name

DUCK_TYPES = {"i4": "INTEGER", "i8": "BIGINT", "f8": "DOUBLE", "str": "VARCHAR"}


class SchemaError(RuntimeError):
    """The file cannot be used by this version of tracetop (newer schema, locked, not ours)."""


def event_table_ddl(kind: Kind) -> str:
    """CREATE TABLE for one event kind: `run_id` then the kind's columns in record order."""
    cols = ["run_id VARCHAR NOT NULL"] + [f'"{c.name}" {DUCK_TYPES[c.dtype]}' for c in SCHEMAS[kind]]
    return f"CREATE TABLE {table_name(kind)} ({', '.join(cols)})"


def _v1() -> list[str]:
    """Tables: one per event kind, sources (high-water marks), ingest_log, and the runs/gaps views."""
    stmts = [event_table_ddl(kind) for kind in Kind]
    stmts += [
        """CREATE TABLE sources (
            source_id VARCHAR PRIMARY KEY,
            hwm UBIGINT NOT NULL,           -- highest committed seq; a batch with seq <= hwm is a duplicate
            first_seen_ns BIGINT NOT NULL,  -- collector clock at the first commit of this source
            last_seen_ns BIGINT NOT NULL,   -- collector clock at the latest commit
            batches BIGINT NOT NULL,        -- batches committed (duplicates not counted)
            rows BIGINT NOT NULL
        )""",
        """CREATE TABLE ingest_log (
            source_id VARCHAR NOT NULL,
            seq UBIGINT NOT NULL,
            kind VARCHAR NOT NULL,
            n INTEGER NOT NULL,
            first_record_ns BIGINT,         -- producer clock of the batch's oldest record()
            sealed_ns BIGINT,               -- producer clock when the shipper sealed it
            committed_ns BIGINT NOT NULL    -- collector clock when its transaction was committed
        )""",
        # One row per run, from the ranks' RUN_START rows.
        """CREATE VIEW runs AS
        SELECT run_id,
               min(start_ns) AS started_ns,
               max(world_size) AS world_size,
               max(tp) AS tp, max(pp) AS pp, max(dp) AS dp,
               max(zero_stage) AS zero_stage,
               any_value(model_name) AS model_name,
               max(n_params) AS n_params,
               max(flops_per_token) AS flops_per_token,
               max(micro_batch) AS micro_batch,
               max(micro_batches) AS micro_batches,
               max(seq_len) AS seq_len,
               count(DISTINCT rank) AS ranks_started,
               list(DISTINCT hostname ORDER BY hostname) AS hostnames
        FROM run_start GROUP BY run_id""",
        f"CREATE VIEW gaps AS SELECT * FROM {table_name(Kind.GAP)}",
    ]
    return stmts


def _v2() -> list[str]:
    """Views people ask for first: step_summary, collective_stats, offload_bandwidth (DESIGN §6)."""
    return [
        """CREATE VIEW step_summary AS
        SELECT run_id, rank,
               count(*) AS steps,
               quantile_cont(duration_ns, 0.5) / 1e6 AS step_ms_p50,
               quantile_cont(duration_ns, 0.99) / 1e6 AS step_ms_p99,
               quantile_cont(compute_ns, 0.5) / 1e6 AS compute_ms_p50,
               quantile_cont(comm_exposed_ns, 0.5) / 1e6 AS comm_exposed_ms_p50,
               quantile_cont(data_wait_ns, 0.5) / 1e6 AS data_wait_ms_p50
        FROM step GROUP BY run_id, rank""",
        # NCCL-tests conventions: algbw = size / time with size the per-rank payload; busbw =
        # algbw * factor, factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter
        # and all_to_all, 1 for broadcast, reduce and point-to-point. bytes/ns = GB/s.
        """CREATE VIEW collective_stats AS
        WITH c AS (
            SELECT run_id, op, role, group_size, bytes, duration_ns,
                   bytes / nullif(duration_ns, 0) AS algbw_gbps,
                   CASE WHEN op LIKE 'all_reduce%' THEN 2.0 * (group_size - 1) / group_size
                        WHEN op LIKE '%all_gather%' OR op LIKE '%reduce_scatter%' OR op LIKE 'all_to_all%'
                             THEN 1.0 * (group_size - 1) / group_size
                        ELSE 1.0 END AS bus_factor
            FROM collective WHERE group_size > 0
        )
        SELECT run_id, op, role, group_size,
               count(*) AS calls,
               sum(bytes) AS total_bytes,
               quantile_cont(bytes, 0.5) AS bytes_p50,
               quantile_cont(duration_ns, 0.5) / 1e6 AS duration_ms_p50,
               quantile_cont(duration_ns, 0.99) / 1e6 AS duration_ms_p99,
               quantile_cont(algbw_gbps, 0.5) AS algbw_gbps,
               quantile_cont(algbw_gbps * bus_factor, 0.5) AS busbw_gbps
        FROM c GROUP BY run_id, op, role, group_size""",
        # Device<->host<->NVMe copies: GB/s over the time spent copying (bytes/ns = GB/s).
        """CREATE VIEW offload_bandwidth AS
        SELECT run_id, rank, direction, what,
               count(*) AS transfers,
               sum(bytes) AS total_bytes,
               sum(duration_ns) / 1e6 AS total_ms,
               sum(bytes) / nullif(sum(duration_ns), 0) AS gbps
        FROM offload GROUP BY run_id, rank, direction, what""",
    ]


def _v3() -> list[str]:
    """bubble_by_stage (DESIGN §3): 1 - (forward + backward compute) / schedule wall time, per stage
    and step, beside the balanced-1F1B ideal (p-1)/(m+p-1). forward_ns/backward_ns are the
    ForwardPass/BackwardPass self times the hooks record; duration_ns is the whole train_batch."""
    return [
        """CREATE VIEW bubble_by_stage AS
        SELECT s.run_id, r.stage, s.step,
               count(*) AS ranks,
               1 - sum(s.forward_ns + s.backward_ns) / sum(s.duration_ns) AS bubble_rate,
               (max(r.pp) - 1) / (max(r.micro_batches) + max(r.pp) - 1) AS ideal_bubble_rate
        FROM step s
        JOIN run_start r ON r.run_id = s.run_id AND r.rank = s.rank
        WHERE r.pp > 1 AND s.duration_ns > 0
        GROUP BY s.run_id, r.stage, s.step""",
    ]


def _v4() -> list[str]:
    """Wire schema 2: STEP rows carry the loss and the micro-batch shape in force. A fresh file's
    `step` table already has them (_v1 derives it from tracetop/events.py), hence IF NOT EXISTS."""
    return [
        "ALTER TABLE step ADD COLUMN IF NOT EXISTS loss DOUBLE",
        "ALTER TABLE step ADD COLUMN IF NOT EXISTS micro_batch INTEGER",
        "ALTER TABLE step ADD COLUMN IF NOT EXISTS micro_batches INTEGER",
    ]


def _v6() -> list[str]:
    """The closed loop's audit trail (DESIGN §4, §9): `actions`, one row per action with its whole
    life (proposed -> approved -> sent -> received -> applied / rejected / lost -> verified /
    rolled back), and `action_ranks`, every rank's report about it."""
    return [
        """CREATE TABLE IF NOT EXISTS actions (
            action_id VARCHAR NOT NULL,
            run_id VARCHAR NOT NULL,
            kind VARCHAR NOT NULL,          -- micro_batch | offload
            value BIGINT NOT NULL,          -- the micro-batch size, or 1 = offload on / 0 = off
            previous_value BIGINT,          -- in force when it was proposed: what a rollback restores
            rollback_of VARCHAR,            -- the action this one undoes, NULL for a new change
            state VARCHAR NOT NULL,         -- proposed approved sent received applied rejected lost
                                            -- dismissed verified rolled_back inconsistent
            rule VARCHAR,                   -- the rule or policy behind it (manual: 'manual')
            reason VARCHAR,                 -- why, in words
            expected VARCHAR,               -- the expected effect
            proposed_by VARCHAR, proposed_ns BIGINT,
            approved_by VARCHAR, approved_ns BIGINT,
            sent_ns BIGINT, expires_ns BIGINT, received_ns BIGINT,
            step BIGINT,                    -- the step boundary where the ranks applied it (or undid it)
            ranks_expected INTEGER, ranks_applied INTEGER, ranks_refused INTEGER, ranks_undone INTEGER,
            outcome VARCHAR,                -- the last word, readable: who applied, who refused and why
            done_ns BIGINT,
            verification VARCHAR,           -- verified / rolled back: what moved, over how many steps
            verified_ns BIGINT,
            updated_ns BIGINT NOT NULL
        )""",
        """CREATE TABLE IF NOT EXISTS action_ranks (
            action_id VARCHAR NOT NULL,
            run_id VARCHAR NOT NULL,
            rank INTEGER NOT NULL,
            stage VARCHAR NOT NULL,         -- received | applied | refused | undone | undo_failed
            step BIGINT,                    -- the step boundary it speaks of (-1: none)
            message VARCHAR,
            micro_batch INTEGER, micro_batches INTEGER,  -- in force on the rank after it
            reported_ns BIGINT NOT NULL
        )""",
    ]


#: MIGRATIONS[i] takes a file from schema version i to i + 1. Append only; never edit a shipped one.
MIGRATIONS: list[Callable[[], list[str]]] = [_v1, _v2, _v3, _v4, _v6]
STORE_VERSION = len(MIGRATIONS)


def connect(path: str, *, read_only: bool = False, duckdb_module=None):
    """A DuckDB connection with external access off. Raises SchemaError when another process
    holds the file (DuckDB allows one writer process)."""
    import duckdb

    duckdb = duckdb_module or duckdb
    try:
        return duckdb.connect(path, read_only=read_only, config={"enable_external_access": False})
    except duckdb.IOException as e:
        if "lock" in str(e).lower():
            raise SchemaError(
                f"{path} is held by another process (a running collector?): {str(e).splitlines()[0]}. "
                "Query it through that collector with `tracetop query --collector ADDR \"SQL\"`"
            ) from e
        raise


def stored_version(con) -> int:
    """The file's schema version; 0 for a fresh (empty) file."""
    has = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'schema_meta'"
    ).fetchone()[0]
    if not has:
        tables = con.execute("SELECT count(*) FROM information_schema.tables").fetchone()[0]
        if tables:
            raise SchemaError("the file holds tables but no schema_meta: it is not a tracetop collector file")
        return 0
    row = con.execute("SELECT max(version) FROM schema_meta").fetchone()
    return int(row[0] or 0)


def migrate(con, path: str = "") -> tuple[int, int]:
    """Bring the file to STORE_VERSION in one transaction. Returns (from_version, to_version)."""
    found = stored_version(con)
    if found > STORE_VERSION:
        raise SchemaError(
            f"{path or 'the file'} has schema version {found}, this tracetop knows up to {STORE_VERSION}; "
            "upgrade tracetop to read or write it"
        )
    if found == STORE_VERSION:
        return found, found
    con.execute("BEGIN TRANSACTION")
    try:
        if found == 0:
            con.execute("CREATE TABLE schema_meta (version INTEGER NOT NULL, applied_ns BIGINT NOT NULL)")
        for version in range(found, STORE_VERSION):
            for stmt in MIGRATIONS[version]():
                con.execute(stmt)
            con.execute(
                "INSERT INTO schema_meta VALUES (?, CAST(epoch_ns(now()) AS BIGINT))", [version + 1]
            )
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
        raise
    return found, STORE_VERSION


def open_store(path: str):
    """Open (or create) a collector file for writing, migrated to STORE_VERSION, with its
    configuration locked so that no SQL can turn external access back on."""
    con = connect(path)
    try:
        migrate(con, path)
        con.execute("SET lock_configuration = true")
    except Exception:
        con.close()
        raise
    return con
