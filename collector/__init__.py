"""The collector: ingest into DuckDB exactly once, schema and views, the read-only query service."""
