"""Read-only SQL: the one gate both `tracetop query FILE` and the collector's Query service use.

Two layers, so that neither alone has to be perfect:
1. DuckDB itself: every connection has `enable_external_access = false` and locked
   configuration (no file reads, COPY, ATTACH, INSTALL/LOAD); a file opened directly is also
   opened `read_only`; in the collector each query runs in its own transaction that is rolled back.
2. Up front, each statement's type as DuckDB's parser sees it must be SELECT (which covers
   DESCRIBE, SHOW, SUMMARIZE, FROM-first and VALUES queries); anything else is refused by name.
   Within a SELECT, the functions and tables it names (DuckDB's own parse tree, json_serialize_sql)
   may not be one of ``DENIED``: functions with a side effect even in a rolled-back transaction
   (``checkpoint()``, ``setseed()``, ``truncate_duckdb_logs()``, logging and profiling switches),
   functions that run SQL given as a string (``query()``: it would pass around this check), and
   those that tell the host's paths and settings (``duckdb_databases()`` names the file's path).

A result is bounded in rows (``max_rows``: the rest is cut, ``truncated``) and in bytes
(``max_bytes``: past it the query stops with QueryLimit, RESOURCE_EXHAUSTED over gRPC), so one
query of wide values cannot take the collector's memory (each Arrow batch is a few hundred rows,
counted as it arrives).
"""

from __future__ import annotations

import json
import re

import duckdb
import pyarrow as pa

from tracetop.errors import TracetopError

ALLOWED = {duckdb.StatementType.SELECT}
DEFAULT_MAX_ROWS = 100_000
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_BYTES = 64 << 20  # a result's Arrow bytes (the collector's --max-query-mb)
_BATCH_ROWS = 256  # rows per Arrow batch read: the byte bound is checked after each

#: Functions and tables a read-only query may not name (see the module doc).
DENIED = frozenset({
    # side effects, even in a transaction that is rolled back
    "checkpoint", "force_checkpoint", "truncate_duckdb_logs", "setseed", "enable_logging", "disable_logging",
    "enable_profiling", "disable_profiling", "add_grammar_extension", "remove_grammar_extension", "add_parquet_key",
    "register_external_resource", "register_external_resource_type", "create_external_resource",
    "destroy_external_resource", "deregister_external_resource", "nextval",
    # SQL given as a string: it would pass around this check
    "query", "query_table", "json_execute_serialized_sql",
    # the host's paths and settings
    "duckdb_databases", "pragma_database_list", "database_list", "duckdb_settings", "current_setting",
    "duckdb_temporary_files", "duckdb_extensions", "duckdb_secrets", "which_secret", "duckdb_external_file_cache",
    "duckdb_logs", "duckdb_log_contexts", "getenv", "pragma_metadata_info", "pragma_storage_info",
})
_DENIED_TEXT = re.compile(r'(?<![A-Za-z0-9_])"?(' + "|".join(sorted(DENIED)) + r')"?(?![A-Za-z0-9_])', re.IGNORECASE)


class QueryLimit(TracetopError):
    """A query ran past a limit (its time); str() says which and what to do."""


class ReadOnlyViolation(TracetopError):
    """The SQL would write, or reach outside the file. str() says what and what to do instead."""


def _refusal(what: str) -> ReadOnlyViolation:
    return ReadOnlyViolation(
        f"tracetop query is read-only: {what} is not allowed; "
        "query a copy of the file with duckdb directly if you need to write"
    )


def check_read_only(con, sql: str) -> list[str]:
    """Parse `sql` with DuckDB and return its statements' texts; raise ReadOnlyViolation if any
    is not a SELECT. Syntax errors surface as duckdb.ParserException."""
    statements = con.extract_statements(sql)
    if not statements:
        raise ReadOnlyViolation("tracetop query: no SQL statement given")
    for stmt in statements:
        if stmt.type not in ALLOWED:
            raise _refusal(stmt.type.name)
        denied = _denied_names(con, stmt.query)
        if denied:
            raise _refusal(f"{', '.join(sorted(denied))}() (it writes, runs SQL given as text, or tells the host's "
                           "paths and settings)")
    return [stmt.query for stmt in statements]


def _denied_names(con, query: str) -> set[str]:
    """The DENIED functions and tables one SELECT names, from DuckDB's parse tree; where DuckDB
    cannot serialize it, every DENIED name that appears in its text as a word (stricter)."""
    try:
        tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [query]).fetchone()[0])
    except Exception:
        tree = {"error": True}
    if tree.get("error"):
        return {m.lower() for m in _DENIED_TEXT.findall(query)}
    names: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("function_name", "table_name") and isinstance(value, str):
                    names.add(value.lower())
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(tree)
    return names & DENIED


def is_refusal(exc: BaseException) -> bool:
    """True for errors that mean "not allowed" rather than "wrong SQL"."""
    return isinstance(exc, ReadOnlyViolation | duckdb.PermissionException)


def run_read_only(con, sql: str, max_rows: int = DEFAULT_MAX_ROWS, *, timeout_s: float | None = None,
                  max_bytes: int | None = DEFAULT_MAX_BYTES) -> tuple[pa.Table, bool]:
    """Run read-only SQL on `con` (a cursor of its own); return (result, truncated).

    Several statements run in order and the last one's result is returned. The statements run in
    a transaction that is rolled back, so even a SELECT with a side effect leaves nothing behind.
    Rows beyond `max_rows` are never produced (the result streams and stops there). With
    `timeout_s`, a query still running after that long is interrupted (DuckDB's own interrupt, which
    leaves the connection usable) and QueryLimit is raised.
    """
    import threading

    queries = check_read_only(con, sql)
    timed_out = threading.Event()

    def interrupt() -> None:
        timed_out.set()
        con.interrupt()

    timer = threading.Timer(timeout_s, interrupt) if timeout_s else None
    con.execute("BEGIN TRANSACTION")
    try:
        if timer is not None:
            timer.daemon = True
            timer.start()
        for q in queries[:-1]:
            con.execute(q).fetchall()
        rel = con.sql(queries[-1])
        reader = rel.to_arrow_reader(min(max_rows + 1, _BATCH_ROWS) if max_rows else _BATCH_ROWS)
        batches, rows, nbytes, truncated = [], 0, 0, False
        for batch in reader:
            nbytes += batch.nbytes
            if max_bytes and nbytes > max_bytes:
                reader.close()
                batches.clear()
                raise QueryLimit(
                    f"query result passed {max_bytes / 2**20:g} MiB after {rows} rows (the collector's "
                    "--max-query-mb); select fewer or narrower columns, aggregate, or add a LIMIT"
                )
            if max_rows and rows + batch.num_rows > max_rows:
                batches.append(batch.slice(0, max_rows - rows))
                truncated = True
                break
            batches.append(batch)
            rows += batch.num_rows
        table = pa.Table.from_batches(batches, schema=reader.schema)
        reader.close()
        del rel
    except QueryLimit:
        raise
    except Exception as e:
        if timed_out.is_set():
            raise QueryLimit(
                f"query stopped after {timeout_s:g} s (the collector's --query-timeout-s); narrow it "
                "(a WHERE on run_id/step, a LIMIT), or run it on the file after the run"
            ) from e
        raise
    finally:
        if timer is not None:
            timer.cancel()
        con.execute("ROLLBACK")
    return table, truncated


def to_ipc(table: pa.Table) -> bytes:
    buf = pa.BufferOutputStream()
    with pa.ipc.new_stream(buf, table.schema) as writer:
        writer.write_table(table)
    return buf.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
