"""The collector's benchmarks (`tracetop bench ingest|chaos|views|live|raw`, DESIGN §9) and what
they drive: `loadgen` (shipper processes and a collector process), `chaos_proxy` (a TCP proxy that
drops and stalls), `rank_kill` (kill -9 a rank of a real run). `rollup_commit` and `views_ab` are
one-off measurements behind figures in docs/benchmarks.md (`python -m collector.bench.NAME`). Nothing of
the product imports this package."""
