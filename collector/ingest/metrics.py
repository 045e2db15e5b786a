"""The collector's own Prometheus metrics, on a registry of its own (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from collector.ingest.writer import FlushStats
from tracetop.events import table_name


class CollectorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.received = Counter(
            "tracetop_collector_events_received", "Rows received in valid batches, by kind", ["kind"], registry=r
        )
        self.stored = Counter(
            "tracetop_collector_events_stored", "Rows committed to the file, by kind", ["kind"], registry=r
        )
        self.rejected = Counter(
            "tracetop_collector_batches_rejected", "Batches refused, by fault", ["fault"], registry=r
        )
        self.duplicates = Counter(
            "tracetop_collector_duplicates", "Resent batches acked without storing them", registry=r
        )
        self.latency = Histogram(
            "tracetop_collector_batch_latency_seconds",
            "Shipper sealed a batch -> the collector committed it (crosses clocks on multi-node)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0),
            registry=r,
        )
        self.queue_depth = Gauge(
            "tracetop_collector_writer_queue_depth", "Items waiting for the writer thread", registry=r
        )
        self.queue_rows = Gauge(
            "tracetop_collector_writer_queue_rows", "Rows waiting for the writer thread", registry=r
        )
        self.flushes = Counter("tracetop_collector_commits", "Writer transactions committed", registry=r)
        self.streams = Counter("tracetop_collector_streams", "Ingest streams opened", registry=r)
        self.pushes = Counter("tracetop_collector_pushes", "Ingest.Push calls (a burst in one call)", registry=r)
        self.streams_open = Gauge(
            "tracetop_collector_streams_open", "Ingest streams open now (shippers open one per burst)", registry=r
        )

    def on_flush(self, stats: FlushStats) -> None:
        for kind, rows in stats.rows_by_kind.items():
            self.stored.labels(table_name(kind)).inc(rows)
        if stats.duplicates:
            self.duplicates.inc(stats.duplicates)
        for s in stats.latencies_s:
            self.latency.observe(s)
        if stats.batches:
            self.flushes.inc()

    def on_queue(self, depth: int, rows: int) -> None:
        self.queue_depth.set(depth)
        self.queue_rows.set(rows)


def serve_metrics(port: int, registry: CollectorRegistry, addr: str = "127.0.0.1", auth=None):
    """Start the /metrics HTTP endpoint in its own thread; returns (server, thread).

    With ``auth`` (tracetop.wire.auth.ServerAuth) demanding a token, a scrape must send
    ``Authorization: Bearer <token>`` (Prometheus: ``authorization: {credentials_file: ...}``) and gets
    401 otherwise; with TLS it serves HTTPS with the collector's certificate (and asks for a client
    certificate under mutual TLS)."""
    if auth is None or not auth.closed:
        from prometheus_client import start_http_server

        return start_http_server(port, addr=addr, registry=registry)
    return _serve_guarded(port, addr, registry, auth)


def _serve_guarded(port: int, addr: str, registry: CollectorRegistry, auth):
    from tracetop.wire.auth import serve_metrics_http  # shared with the agent's /metrics

    return serve_metrics_http(port, addr, registry, auth)
