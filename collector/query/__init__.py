"""The collector's read side: the read model (``snapshot``, ``lost_sql``) over its schema, and the
read-only query service. Importing this package loads nothing heavy: DuckDB, pyarrow and grpc load
inside the functions that need them, so the TUI may use the read model without the ingest path."""
