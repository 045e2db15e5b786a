"""Several collector files as one: `tracetop query A.duckdb B.duckdb ... "SQL"`.

A run spread over several collectors leaves one file per collector, each with the same tables and
the same views. Views name tables unqualified (`FROM step`), so attaching the files alone would
leave `step_summary` reading one file's `step`. Instead:

1. a fresh in-memory database ATTACHes every file READ_ONLY (as f0, f1, ...);
2. each table becomes a TEMP view `UNION ALL BY NAME` over the files that have it (a column a
   file lacks, from an older schema, reads NULL there); the rollups' `step_hist` and
   `collective_hist` are made per file (collector/ingest/rollup.py: a file older than the rollups gets
   them from its rows);
3. each view is recreated as a TEMP view from its stored SQL (the definition of the file with
   the newest schema), so its unqualified names now resolve to the unions of step 2; the
   materialized per-step views (collector/ingest/matviews.py) from their original SQL over the rows;
4. then external access is switched off and the configuration locked, as for one file: no
   further ATTACH, no file reads, no COPY. The SQL gate (collector.query.readonly) runs as usual.

The same rows stored in two files (a copy) are counted twice: the union does not deduplicate (and a
view that joins two tables then sees each pair four times). Files of different collectors hold
different ranks, so their unions are disjoint.
"""

from __future__ import annotations

import re

from tracetop.errors import TracetopError

_CREATE_VIEW = re.compile(r"^\s*CREATE\s+(OR\s+REPLACE\s+)?VIEW\s+", re.IGNORECASE)


class MultiFileError(TracetopError, RuntimeError):
    """A file cannot be attached (missing, not a tracetop file, held by a writer)."""


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def connect_many(paths: list[str]):
    """An in-memory DuckDB connection presenting the union of `paths` under the usual names."""
    import duckdb

    from collector.ingest.schema import STORE_VERSION

    con = duckdb.connect(":memory:")
    try:
        tables: dict[str, list[str]] = {}
        views: dict[str, tuple[int, str]] = {}
        for i, path in enumerate(paths):
            alias = f"f{i}"
            try:
                con.execute(f"ATTACH {_literal(path)} AS {alias} (READ_ONLY)")
            except duckdb.Error as e:
                raise MultiFileError(f"cannot open {path}: {str(e).splitlines()[0]}") from e
            version = _version(con, alias, path)
            if version > STORE_VERSION:
                raise MultiFileError(f"{path} has schema version {version}, this tracetop knows up to "
                                     f"{STORE_VERSION}; upgrade tracetop to read it")
            for (name,) in con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = ? AND schema_name = 'main'",
                [alias],
            ).fetchall():
                tables.setdefault(name, []).append(alias)
            for name, sql in con.execute(
                "SELECT view_name, sql FROM duckdb_views() WHERE database_name = ? AND schema_name = 'main' "
                "AND NOT internal",
                [alias],
            ).fetchall():
                if name not in views or version > views[name][0]:
                    views[name] = (version, sql)
        for name, aliases in tables.items():
            union = " UNION ALL BY NAME ".join(f"SELECT * FROM {a}.main.{_ident(name)}" for a in aliases)
            con.execute(f"CREATE TEMP VIEW {_ident(name)} AS {union}")
        hist = _hist_views(tables)
        for sql in hist.values():
            con.execute(sql)
        _create_views(con, {n: _original(n, sql) for n, (_, sql) in views.items() if n not in tables and n not in hist})
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except Exception:
        con.close()
        raise
    return con


def _hist_views(tables: dict[str, list[str]]) -> dict[str, str]:
    """`step_hist` / `collective_hist` over several files: per file its rollup and the histogram of
    its rows past the rollup's watermark, or, for a file older than the rollups, the histogram of
    all its rows (collector/ingest/rollup.py). The stored definitions name the file's own tables."""
    from collector.ingest import rollup
    from tracetop.events import table_name

    out = {}
    for table, view in rollup.HIST_VIEWS.items():
        raw = table_name(rollup.TABLES[table][0])
        parts = []
        for a in tables.get(raw, []):
            if a in tables.get(table, []):
                parts.append(f"SELECT * FROM {a}.main.{_ident(table)}")
                parts.append(rollup.rows_sql(table, rollup.tail(table, f"{a}.main.")))
            else:
                parts.append(rollup.rows_sql(table, f"{a}.main.{_ident(raw)}"))
        if parts:
            out[view] = f"CREATE TEMP VIEW {_ident(view)} AS " + " UNION ALL BY NAME ".join(parts)
    return out


def _original(name: str, sql: str) -> str:
    """A materialized view (collector/ingest/matviews.py: its `_m` rows and watermarks are per file, by
    rowid) over several files is its original SQL over the unions of the raw rows."""
    from collector.ingest import matviews

    if name not in matviews.VIEWS:
        return sql
    body = matviews.step_ranks_sql() if name == "step_ranks" else matviews.derived_sql(name, "step_ranks")
    return f"CREATE VIEW {_ident(name)} AS {body}"


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _version(con, alias: str, path: str) -> int:
    has = con.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE database_name = ? AND table_name = 'schema_meta'", [alias]
    ).fetchone()[0]
    if not has:
        raise MultiFileError(f"{path} holds no schema_meta: it is not a tracetop collector file")
    return int(con.execute(f"SELECT coalesce(max(version), 0) FROM {alias}.main.schema_meta").fetchone()[0])


def _create_views(con, views: dict[str, str]) -> None:
    """Views may read other views: create in rounds until all exist (their order is not stored)."""
    import duckdb

    pending = dict(views)
    while pending:
        errors = {}
        created = 0
        for name, sql in list(pending.items()):
            temp_sql = _CREATE_VIEW.sub("CREATE TEMP VIEW ", sql, count=1)
            try:
                con.execute(temp_sql)
                del pending[name]
                created += 1
            except duckdb.CatalogException as e:
                errors[name] = e
        if errors and not created:  # a round that made nothing: what is left can never be made
            name, e = next(iter(errors.items()))
            raise MultiFileError(f"view {name} cannot be recreated over the files: {str(e).splitlines()[0]}")
