"""The collector's write path: the gRPC edge (`server`), the one writer thread that commits
(`writer`), the file's tables, views and migrations (`schema`, `matviews`, `rollup`), the GAP rows
for sources gone without a clean close (`source_ends`) and the collector's own /metrics
(`metrics`). `collector.app` wires them together."""
