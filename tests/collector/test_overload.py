"""Offered more than it can take: a real collector with a memory budget far under the load, real
shipper processes that never wait for acks (as training loops). The gRPC edge holds the streams
once the writer's queue is at its budget, so the queue never holds more than its bound and one
batch; the collector says it is behind; every row sent is stored once or counted by its shipper
(gap rows in the file). Timings are the benchmark's (`tracetop bench ingest --mix realistic`)."""

from __future__ import annotations

import logging

from collector.app import CollectorConfig, memory_budget, serve
from collector.bench import loadgen

SOURCES, EVENTS, CHUNK = 4, 8 * 16384, 16384


def test_overloaded_collector_holds_streams_within_its_budget_and_counts_what_it_did_not_take(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tracetop.collector")
    config = CollectorConfig(str(tmp_path / "o.duckdb"), memory_cap_mb=1)  # a 128 KiB queue; a batch is ~2 MB
    budget = memory_budget(config)
    h = serve(config)
    start = tmp_path / "go"
    try:
        procs = loadgen.start_sources(h.address, "load", SOURCES, EVENTS, start_file=start, trainer_like=True,
                                      chunk_rows=CHUNK, buffer_bytes=6 * 2**20)
        loadgen.release(start, procs)
        results = loadgen.collect_sources(procs, timeout_s=300)
        writer, metrics = h.collector.writer, h.collector.metrics
        held_s = metrics.registry.get_sample_value("tracetop_collector_backpressure_seconds_total")
    finally:
        h.stop()
    assert writer.max_queued_bytes == budget.queue_bytes == 2**20 // 8
    batch_bytes = CHUNK * 8 * 16  # an upper bound on one STEP batch's Arrow bytes (16 columns of <= 8 B)
    assert writer.peak_queued_bytes <= writer.max_queued_bytes + batch_bytes
    assert held_s and held_s > 0  # streams were held
    assert any("collector: behind" in r.getMessage() for r in caplog.records)
    counts = loadgen.count_stored(tmp_path / "o.duckdb", "load")
    sent = sum(r["sent"] for r in results)
    dropped = sum(r["rows_dropped"] for r in results)
    assert sent == SOURCES * EVENTS
    assert all(stored == distinct for stored, distinct in counts["per_source"].values())  # none twice
    stored = sum(stored for stored, _ in counts["per_source"].values())
    assert counts["gaps_dropped"] == dropped  # what a shipper dropped, its gap rows say
    assert stored + dropped == sent
