"""The collector's own Prometheus metrics, on a registry of its own (never the global one)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from collector.ingest.writer import FlushStats
from collector.live.model import CollectorLag
from tracetop.events import Kind, table_name

log = logging.getLogger("tracetop.collector")

#: the collector says it is behind when the oldest batch not yet committed has waited this long,
#: or a stream is held by backpressure
BEHIND_AFTER_S = 2.0
#: ... and says it caught up once it kept up (no stream held, no batch waiting that long) this long
CAUGHT_UP_AFTER_S = 2.0


def gap_rows(batches: Sequence) -> int:
    """Rows the shippers counted as not stored in these committed batches: the `dropped` column of
    their GAP rows, less the rows counting whole batches (kind "batch": a refused batch, its rows
    not known). A source that ended without its close claims 0 (source_ends.py)."""
    n = 0
    for b in batches:
        if b.kind != Kind.GAP:
            continue
        codes, dictionary = b.columns["kind"]
        dropped = np.asarray(b.columns["dropped"])
        whole = [i for i, d in enumerate(dictionary) if d == "batch"]
        n += int(dropped[~np.isin(codes, whole)].sum()) if whole else int(dropped.sum())
    return n


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
            "1 while the collector is behind: a stream held, or the oldest batch not yet committed waited over "
            "BEHIND_AFTER_S (2 s), until it has kept up for CAUGHT_UP_AFTER_S (2 s)", registry=r)
        self.commit_wait = Gauge(
            "tracetop_collector_commit_wait_seconds",
            "How long the batches of the latest commit waited in the writer's queue (the oldest)", registry=r)
        self.queue_bytes = Gauge(
            "tracetop_collector_writer_queue_bytes", "Bytes (Arrow) waiting for the writer thread", registry=r)
        self.oldest_wait = Gauge(
            "tracetop_collector_oldest_wait_seconds",
            "How long the oldest batch not yet committed (queued or in the commit running) has waited", registry=r)
        self.not_stored = Counter(
            "tracetop_collector_rows_not_stored",
            "Rows the shippers counted as not stored (the dropped rows of committed GAP rows)", registry=r)
        self._lock = threading.Lock()
        #: the oldest uncommitted batch's wait now (`attach(writer)`); without a writer, the latest commit's
        self._oldest_wait_s: Callable[[], float] = lambda: self._wait_s
        self.oldest_wait.set_function(lambda: self._oldest_wait_s())
        self.behind.set_function(lambda: 1.0 if self.is_behind else 0.0)  # now, at each scrape
        self._gap_rows = 0
        self._gap_rows_behind = 0  # _gap_rows when it last fell behind
        self._queue_bytes = 0

    def attach_live(self, engine) -> None:
        """Put the live engine's own losses on /metrics (`LIVE_COUNTS`): what it could not judge or
        store is counted where an operator's alert can see it, not only in the log."""
        self.registry.register(ReadCounts(engine, LIVE_COUNTS))

    def attach(self, writer) -> None:
        """Judge "behind" by `writer`'s oldest uncommitted batch (Writer.oldest_wait_s), now; count its checkpoints."""
        self._oldest_wait_s = writer.oldest_wait_s
        self.registry.register(ReadCounts(writer, WRITER_COUNTS))

    def on_commit(self, batches: Sequence) -> None:
        """The writer's committed batches: count what the shippers say they did not get stored."""
        n = gap_rows(batches)
        if n:
            self.not_stored.inc(n)
            with self._lock:
                self._gap_rows += n

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
    _keeping_up_since = 0.0

    def hold(self, delta: int, held_s: float = 0.0) -> None:
        """A stream is held (+1) by backpressure, or let go (-1) after held_s seconds."""
        self._held_now += delta
        self.held.set(self._held_now)
        if held_s:
            self.held_seconds.inc(held_s)
        self._update_behind()

    def _update_behind(self) -> float:
        """Behind now? Logs the change; returns the oldest uncommitted batch's wait. It has caught up
        once it kept up for CAUGHT_UP_AFTER_S: under overload the held streams are let go for a moment
        each time the writer takes its queue, which is no catching up."""
        wait_s = self._oldest_wait_s()
        behind_now = self._held_now > 0 or wait_s > BEHIND_AFTER_S
        now = time.monotonic()
        with self._lock:
            if behind_now:
                self._keeping_up_since = 0.0
            elif self._behind_since and not self._keeping_up_since:
                self._keeping_up_since = now
            behind = behind_now or (bool(self._behind_since) and now - self._keeping_up_since < CAUGHT_UP_AFTER_S)
            if behind and not self._behind_since:
                self._behind_since = now
                self._gap_rows_behind = self._gap_rows
                log.warning("collector: behind: %d streams held by backpressure, the oldest batch not yet "
                            "committed waited %.1f s; shippers keep, spool or drop (and count) what is not taken",
                            self._held_now, wait_s)
            elif not behind and self._behind_since:
                log.warning("collector: caught up after %.1f s behind (%d rows counted as not stored by the "
                            "shippers meanwhile)", self._keeping_up_since - self._behind_since,
                            self._gap_rows - self._gap_rows_behind)
                self._behind_since = self._keeping_up_since = 0.0
        return wait_s

    @property
    def is_behind(self) -> bool:
        self._update_behind()
        return bool(self._behind_since)

    def lag(self) -> CollectorLag:
        """How far behind the collector is now (the `collector_behind` rule's input, the TUI's line)."""
        wait_s = self._update_behind()
        since = self._behind_since
        return CollectorLag(behind_s=time.monotonic() - since if since else 0.0, oldest_wait_s=wait_s,
                            streams_held=max(self._held_now, 0), rows_not_stored=self._gap_rows - self._gap_rows_behind,
                            queue_mb=self._queue_bytes / 2**20)

    def on_queue(self, depth: int, rows: int, nbytes: int = 0) -> None:
        self.queue_depth.set(depth)
        self.queue_rows.set(rows)
        self.queue_bytes.set(nbytes)
        self._queue_bytes = nbytes


class ReadCounts:
    """Counters read from an object at each scrape: `families` is (name, help, read(obj)) each."""

    def __init__(self, obj, families: tuple) -> None:
        self.obj = obj
        self.families = families

    def describe(self):
        return [CounterMetricFamily(name, doc) for name, doc, _ in self.families]

    def collect(self):
        for name, doc, read in self.families:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], read(self.obj))
            yield family


#: the live engine's counts (collector.live.engine.LiveEngine): batches dropped from its full inbox
#: (their steps not judged), steps judged at the deadline without every rank, alert rows dropped past
#: the ones kept across failed stores (never in the file), and its errors (a judgment or a store that raised)
LIVE_COUNTS = (
    ("tracetop_live_batches_dropped", "Committed batches the live engine dropped from its full inbox "
                                      "(their steps were not judged live)", lambda e: e.stats.batches_dropped),
    ("tracetop_live_alert_rows_lost", "Alert rows dropped past the ones kept across failed stores "
                                      "(not in the file)", lambda e: e.alert_rows_lost),
    ("tracetop_live_steps_incomplete", "Steps judged live without every rank's STEP row (15 s after "
                                       "the first came): rows arriving later can make a recompute differ",
     lambda e: e.stats.steps_incomplete),
    ("tracetop_live_errors", "Live judgments or alert stores that raised (see the log)", lambda e: e.errors),
    ("tracetop_live_rows_refused", "Rows the live state did not take, their ranks not judged live: its share "
                                   "of --memory-cap-mb full, a rank outside the run's world, a step older than "
                                   "the window", lambda e: e.rows_refused()),
)

#: the writer's checkpoints (Writer._checkpoint_if_due): commits wait while one runs
WRITER_COUNTS = (
    ("tracetop_collector_checkpoints", "DuckDB checkpoints run once the WAL passed its threshold",
     lambda w: w.checkpoints),
    ("tracetop_collector_checkpoint_seconds", "Seconds spent in those checkpoints (commits wait meanwhile)",
     lambda w: w.checkpoint_s),
    ("tracetop_collector_checkpoints_deferred", "Checkpoints put off to a later try: a scan or another write "
                                                "transaction held DuckDB's checkpoint lock", lambda w: w.checkpoints_deferred),
)


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
