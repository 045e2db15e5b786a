"""Read-only SQL: the one gate both `tracetop query FILE` and the collector's Query service use.

Two layers, so that neither alone has to be perfect:
1. DuckDB itself: every connection has `enable_external_access = false` and locked
   configuration (no file reads, COPY, ATTACH, INSTALL/LOAD); a file opened directly is also
   opened `read_only`; in the collector each query runs in its own transaction that is rolled back.
2. Up front, each statement's type as DuckDB's parser sees it must be SELECT (which covers
   DESCRIBE, SHOW, SUMMARIZE, FROM-first and VALUES queries); anything else is refused by name.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa

from tracetop.errors import TracetopError

ALLOWED = {duckdb.StatementType.SELECT}
DEFAULT_MAX_ROWS = 100_000
DEFAULT_TIMEOUT_S = 30.0


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
    return [stmt.query for stmt in statements]


def is_refusal(exc: BaseException) -> bool:
    """True for errors that mean "not allowed" rather than "wrong SQL"."""
    return isinstance(exc, ReadOnlyViolation | duckdb.PermissionException)


def run_read_only(con, sql: str, max_rows: int = DEFAULT_MAX_ROWS, *, timeout_s: float | None = None
                  ) -> tuple[pa.Table, bool]:
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
        reader = rel.to_arrow_reader(min(max_rows + 1, 65_536) if max_rows else 65_536)
        batches, rows, truncated = [], 0, False
        for batch in reader:
            if max_rows and rows + batch.num_rows > max_rows:
                batches.append(batch.slice(0, max_rows - rows))
                truncated = True
                break
            batches.append(batch)
            rows += batch.num_rows
        table = pa.Table.from_batches(batches, schema=reader.schema)
        reader.close()
        del rel
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
