"""The collector's own Prometheus metrics, on a registry of its own (never the global one)."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from collector.ingest.writer import FlushStats
from tracetop.events import table_name

log = logging.getLogger("tracetop.collector")

#: the collector says it is behind when a batch waited this long in its queue, or a stream is held
BEHIND_AFTER_S = 2.0


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

        self.held = Gauge(
            "tracetop_collector_streams_held",
            "Streams held by backpressure now (the writer's queue is full: the collector is behind)", registry=r)
        self.held_seconds = Counter(
            "tracetop_collector_backpressure_seconds",
            "Seconds streams spent held by backpressure (summed over streams)", registry=r)
        self.behind = Gauge(
            "tracetop_collector_behind",
            "1 while the collector is behind: a stream held, or the oldest queued batch waited over "
            "BEHIND_AFTER_S for its commit", registry=r)
        self.commit_wait = Gauge(
            "tracetop_collector_commit_wait_seconds",
            "How long the batches of the latest commit waited in the writer's queue (the oldest)", registry=r)
        self.queue_bytes = Gauge(
            "tracetop_collector_writer_queue_bytes", "Bytes (Arrow) waiting for the writer thread", registry=r)

    def on_flush(self, stats: FlushStats) -> None:
        for kind, rows in stats.rows_by_kind.items():
            self.stored.labels(table_name(kind)).inc(rows)
        if stats.duplicates:
            self.duplicates.inc(stats.duplicates)
        for s in stats.latencies_s:
            self.latency.observe(s)
        if stats.batches:
            self.flushes.inc()
            self.commit_wait.set(stats.wait_s)
            self._wait_s = stats.wait_s
            self._update_behind()

    # -- behind: backpressure on the streams, or commits waiting -----------------------------------
    _held_now = 0
    _wait_s = 0.0
    _behind_since = 0.0

    def hold(self, delta: int, held_s: float = 0.0) -> None:
        """A stream is held (+1) by backpressure, or let go (-1) after held_s seconds."""
        self._held_now += delta
        self.held.set(self._held_now)
        if held_s:
            self.held_seconds.inc(held_s)
        self._update_behind()

    def _update_behind(self) -> None:
        behind = self._held_now > 0 or self._wait_s > BEHIND_AFTER_S
        if behind and not self._behind_since:
            self._behind_since = time.monotonic()
            log.warning("collector: behind: %d streams held by backpressure, the latest commit's oldest batch "
                        "waited %.1f s; shippers keep, spool or drop (and count) what is not taken",
                        self._held_now, self._wait_s)
        elif not behind and self._behind_since:
            log.warning("collector: caught up after %.1f s behind", time.monotonic() - self._behind_since)
            self._behind_since = 0.0
        self.behind.set(1 if behind else 0)

    @property
    def is_behind(self) -> bool:
        return bool(self._behind_since)

    def on_queue(self, depth: int, rows: int, nbytes: int = 0) -> None:
        self.queue_depth.set(depth)
        self.queue_rows.set(rows)
        self.queue_bytes.set(nbytes)


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
