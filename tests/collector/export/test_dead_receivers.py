"""A dead Alertmanager, webhook and OTLP endpoint never slow ingest and never block shutdown.

The receivers are blackholes: they take the TCP connection and never answer, so every request
waits for its client's whole timeout (here 30 s; the worst a receiver can do). The engine's
stand-in publishes from the writer's thread right after each commit, where the live engine is fed:
a sink that sent on the caller's thread would hold every commit for 30 s."""

from __future__ import annotations

import signal
import time
from dataclasses import replace

import pytest

from collector import app
from collector.bench import loadgen
from collector.export import Exports
from collector.export.alertmanager import AlertmanagerSink
from collector.export.webhook import WebhookSink
from tests.collector.util import Feeder, batch
from tests.support.services import scrape_metrics, start_collector

from .records import gauges, resolved, straggler
from .tools import Blackhole, refused_port

SOURCES = 2
EVENTS = 500_000  # per source; ~30 commits of 16,384 rows each


def _run(tmp_path, name: str, dead: bool) -> dict:
    holes = [Blackhole() for _ in range(3)] if dead else []
    if dead:
        am, hook, otlp = holes
        exports = Exports(
            [AlertmanagerSink(f"http://{am.addr}", resend_s=0.2, timeout_s=30, queue_calls=4),
             WebhookSink(f"http://{hook.addr}/h", timeout_s=30, queue_calls=4)],
            otlp_endpoint=otlp.addr, otlp_interval_s=0.2, otlp_timeout_s=30,
        )
    else:
        exports = Exports()
    g = [gauges("load")]
    h = app.serve(app.CollectorConfig(str(tmp_path / f"{name}.duckdb"), metrics_port=0), exports=exports,
                  gauges_fn=lambda: g, alerts_fn=lambda: [])
    commits = {"n": 0}
    base_on_flush = h.collector.writer.on_flush
    a = straggler(run_id="load")

    def on_flush(stats) -> None:  # the live engine's feed: after commit, on the writer's thread
        base_on_flush(stats)
        commits["n"] += 1
        if commits["n"] % 2:
            exports.publish([a], [a])
        else:
            exports.publish([resolved(a)], [])
        exports.publish([replace(a, value=float(commits["n"]))], [a])

    h.collector.writer.on_flush = on_flush
    start = tmp_path / f"{name}.start"
    try:
        procs = loadgen.start_sources(h.address, "load", SOURCES, EVENTS, start_file=start)
        loadgen.release(start, procs)
        t0 = time.monotonic()
        loadgen.collect_sources(procs)
        ingest_s = time.monotonic() - t0
        dropped = scrape_metrics(h.metrics_port).get('tracetop_export_publishes_dropped_total{sink="alertmanager"}')
    finally:
        t1 = time.monotonic()
        h.stop()
        stop_s = time.monotonic() - t1
        for x in holes:
            x.close()
    stored = loadgen.count_stored(tmp_path / f"{name}.duckdb", "load")
    return {"ingest_s": ingest_s, "stop_s": stop_s, "stored": stored, "commits": commits["n"],
            "dropped": dropped, "stats": exports.stats()}


@pytest.mark.slow
def test_dead_receivers_do_not_slow_ingest_or_block_shutdown(tmp_path):
    runs = {"none": [], "dead": []}
    for i in range(2):  # interleaved A/B/A/B: the machine's load hits both alike
        runs["none"].append(_run(tmp_path, f"none{i}", dead=False))
        runs["dead"].append(_run(tmp_path, f"dead{i}", dead=True))
    for r in runs["none"] + runs["dead"]:
        assert r["stored"]["per_source"] == {i: (EVENTS, EVENTS) for i in range(SOURCES)}, r["stored"]
        assert r["commits"] >= 10
    none_s = min(r["ingest_s"] for r in runs["none"])
    dead_s = min(r["ingest_s"] for r in runs["dead"])
    print(f"ingest {SOURCES}x{EVENTS} rows: none {[round(r['ingest_s'], 2) for r in runs['none']]} s, "
          f"dead {[round(r['ingest_s'], 2) for r in runs['dead']]} s; stop none "
          f"{[round(r['stop_s'], 2) for r in runs['none']]} s, dead {[round(r['stop_s'], 2) for r in runs['dead']]} s")
    assert dead_s / none_s < 2.0, f"ingest with dead receivers took {dead_s:.2f} s vs {none_s:.2f} s with none"
    for r in runs["dead"]:
        # the receivers would hold each request 30 s; shutdown is bounded well below that
        assert r["stop_s"] < 15, f"shutdown took {r['stop_s']:.1f} s with dead receivers"
        s = r["stats"]
        assert s["alertmanager"]["requests"] >= 1 and s["webhook"]["requests"] >= 1 and s["otlp"]["requests"] >= 1
        # the sinks' threads sat in 30 s requests: their queues of 4 filled, and the rest was counted
        assert r["dropped"] and r["dropped"] > 0 and s["alertmanager"]["dropped"] >= r["dropped"]


def test_collector_process_with_dead_outputs_ingests_and_stops_cleanly(tmp_path):
    """The CLI flags end to end: the outputs start with the collector, batches are acked and stored,
    SIGTERM exits 0."""
    hole = Blackhole()
    try:
        c = start_collector(tmp_path, metrics=True, extra_args=[
            "--alertmanager", f"http://{hole.addr}", "--webhook", f"http://127.0.0.1:{refused_port()}/h",
            "--otlp", hole.addr, "--otlp-interval-s", "0.2"])
        f = Feeder(c.addr)
        for seq in range(1, 6):
            f.send(batch("src-a", seq))
        f.wait_ack("src-a", 5)
        f.close()
        f.wait_end()
        m = scrape_metrics(c.metrics_port)
        for sink in ("alertmanager", "webhook", "otlp"):  # each output runs (idle: no engine publishes yet)
            assert f'tracetop_export_requests_total{{sink="{sink}"}}' in m, sorted(m)
        assert m['tracetop_collector_events_stored_total{kind="step"}'] == 500
        t0 = time.monotonic()
        assert c.stop(signal.SIGTERM) == 0, c.text()
        print(f"collector process with dead outputs: SIGTERM -> exit {time.monotonic() - t0:.2f} s")
        assert "stopped; everything acked is committed" in c.text()
    finally:
        hole.close()
