"""What `tracetop report` and `tracetop export` share after the run: the collector file opened
read-only (configuration locked), and the run they draw (the one named, or the latest)."""

from __future__ import annotations

import os

from tracetop.errors import TracetopError


class PostFileError(TracetopError, RuntimeError):
    """The file or the run cannot be used; the message says why and what there is (exit 2)."""


def open_read_only(path: str):
    """A read-only connection to a collector file, its configuration locked."""
    import duckdb

    from collector.ingest.schema import SchemaError, connect

    if not os.path.exists(path):
        raise PostFileError(f"{path}: no such file")
    try:
        con = connect(path, read_only=True)
    except (SchemaError, duckdb.Error) as e:
        raise PostFileError(f"cannot open {path}: {e}") from e
    con.execute("SET lock_configuration = true")
    return con


def pick_run(con, run: str | None) -> str:
    """`run` when it has steps; without one, the run with the latest step."""
    if run is not None:
        if not con.execute("SELECT count(*) FROM step WHERE run_id = ?", [run]).fetchone()[0]:
            runs = [r for (r,) in con.execute("SELECT DISTINCT run_id FROM step ORDER BY 1").fetchall()]
            raise PostFileError(f"run {run!r} has no steps; runs in the file: {', '.join(runs) or 'none'}")
        return run
    row = con.execute("SELECT run_id FROM step GROUP BY run_id ORDER BY max(start_ns) DESC LIMIT 1").fetchone()
    if row is None:
        raise PostFileError("the file holds no steps: nothing to draw")
    return row[0]


def has_relation(con, name: str) -> bool:
    """Whether the file's main schema has a table or a view of this name (older files lack newer ones)."""
    return bool(con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ? AND schema_name = 'main'",
                            [name]).fetchone()[0] or
                con.execute("SELECT count(*) FROM duckdb_views() WHERE view_name = ? AND schema_name = 'main'",
                            [name]).fetchone()[0])
