"""The shipper against a real collector process: exactly once through kill -9, never blocking."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest

from collector.bench.chaos import chaos
from collector.bench.loadgen import CollectorProcess
from tests.support.services import scrape_metrics, start_collector
from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport, Shipper


@pytest.mark.slow
def test_exactly_once_through_three_kill_9s(tmp_path: Path) -> None:
    """8 shipper processes, 1M events, the collector SIGKILLed three times and restarted on the same file."""
    result = chaos(sources=8, events=1_000_000, kills=3, kill_every_s=2.0, workdir=tmp_path)
    assert result["kills"] == 3, "the run ended before all kills landed: the check proved nothing"
    assert result["sent"] == 1_000_000
    assert result["all_flushed"]
    assert result["lost"] == 0, result
    assert result["duplicates"] == 0, result
    # no reconnect is required: shipments go as Ingest.Push calls of a few ms, and a kill between
    # two calls may never fail one (the channel reconnects before the next); the kills above landed
    # while the sources shipped (kill_every_s 2 s into a run of 1M events), and nothing was lost or doubled


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _row(i: int) -> tuple:
    return (3, i, 1_700_000_000_000_000_000 + i, 1000, "all_reduce", "dp", 2, 4096, -1, "float32", 0)


def step_row(i: int) -> tuple:
    return (0, i, 1_700_000_000_000_000_000 + i, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 1, 1)


def run_start_row() -> tuple:
    from tracetop.events import SCHEMAS

    given = {"rank": 0, "step": -1, "start_ns": time.time_ns(), "world_size": 1, "tp": 1, "pp": 1, "dp": 1,
             "stage": 0, "micro_batch": 1, "micro_batches": 1, "model_name": "m", "hostname": "h"}
    return tuple(given.get(c.name, "" if c.dtype == "str" else 0.0 if c.dtype == "f8" else 0)
                 for c in SCHEMAS[Kind.RUN_START])


def _time_records(shipper: Shipper, n: int) -> float:
    record = shipper.record
    t0 = time.perf_counter()
    for i in range(n):
        record(Kind.COLLECTIVE, *_row(i))
    return time.perf_counter() - t0


def test_never_blocks_without_a_collector_and_gaps_arrive_later(tmp_path: Path) -> None:
    n = 1_000_000
    # Baseline in the same process and moment: the same calls into a shipper whose receiver is in memory.
    baseline = Shipper(None, run_id="nb", transport=MemoryTransport())
    base_s = _time_records(baseline, n // 10) * 10
    baseline.close()

    addr = f"127.0.0.1:{_free_port()}"  # nothing listens here yet
    max_unacked = 2 << 20
    s = Shipper(addr, run_id="nb", rank=3, max_pending_rows=100_000, max_unacked_bytes=max_unacked)
    down_s = _time_records(s, n)
    time.sleep(0.5)
    st = s.stats()
    # Calls return as fast as into an in-memory receiver (generous bound for a noisy shared machine).
    assert down_s < 5 * base_s + 1.0, (down_s, base_s)
    # Memory stays bounded: nothing beyond the configured budgets is held.
    assert st["pending_rows"] <= 100_000
    assert st["unacked_bytes"] <= max_unacked + (3 << 20)
    assert st["rows_dropped"] > 0, "1M rows cannot fit the budgets; drops must be counted"
    assert not st["connected"]

    c = CollectorProcess(tmp_path / "nb.duckdb", addr)
    c.start()
    try:
        assert s.flush(timeout_s=120), s.stats()
        s.close()
    finally:
        assert c.stop() == 0
    con = duckdb.connect(str(tmp_path / "nb.duckdb"), read_only=True)
    stored, distinct = con.execute("SELECT count(*), count(DISTINCT step) FROM collective WHERE run_id='nb'").fetchone()
    gap_collective = con.execute(
        "SELECT coalesce(sum(dropped), 0) FROM gap WHERE run_id='nb' AND kind='collective' AND origin_source=?", [s.source_id]
    ).fetchone()[0]
    reasons = {r for (r,) in con.execute("SELECT DISTINCT reason FROM gap WHERE run_id='nb'").fetchall()}
    con.close()
    assert stored == distinct, "a row stored twice"
    assert stored > 0, "nothing survived the outage"
    assert stored + gap_collective == n, f"{stored} stored + {gap_collective} reported dropped != {n} recorded"
    assert reasons <= {"queue_full", "unacked_full"} and reasons


def test_rows_survive_a_collector_restart_between_batches(tmp_path: Path) -> None:
    db = tmp_path / "r.duckdb"
    addr = f"unix://{tmp_path / 'c.sock'}"
    c = CollectorProcess(db, addr)
    c.start()
    s = Shipper(addr, run_id="rs", flush_interval_s=0.05)
    for i in range(1000):
        s.record(Kind.COLLECTIVE, *_row(i))
    assert s.flush(30)
    c.stop()
    for i in range(1000, 2000):  # collector down: buffered
        s.record(Kind.COLLECTIVE, *_row(i))
    time.sleep(0.3)
    c.start()
    assert s.flush(60)
    s.close()
    c.stop()
    con = duckdb.connect(str(db), read_only=True)
    steps = np.array([r[0] for r in con.execute("SELECT step FROM collective ORDER BY step").fetchall()])
    con.close()
    np.testing.assert_array_equal(steps, np.arange(2000))


def test_gap_rows_count_exactly_what_was_lost_across_a_reconnect(tmp_path: Path) -> None:
    """A tiny buffer forces drops both before and after the collector appears; a batch in flight on a
    live connection is never dropped, so stored + reported dropped equals recorded, exactly."""
    addr = f"127.0.0.1:{_free_port()}"
    s = Shipper(addr, run_id="gx", max_unacked_bytes=4096, flush_interval_s=0.05)
    step_row = lambda i: (0, i, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 1, 1)  # noqa: E731
    for i in range(150):
        s.record(Kind.STEP, *step_row(i))
        time.sleep(0.002)
    c = CollectorProcess(tmp_path / "gx.duckdb", addr)
    c.start()
    try:
        for i in range(150, 300):
            s.record(Kind.STEP, *step_row(i))
            time.sleep(0.002)
        assert s.flush(60)
        s.close()
    finally:
        assert c.stop() == 0
    con = duckdb.connect(str(tmp_path / "gx.duckdb"), read_only=True)
    stored, distinct = con.execute("SELECT count(*), count(DISTINCT step) FROM step WHERE run_id='gx'").fetchone()
    dropped = con.execute("SELECT coalesce(sum(dropped), 0) FROM gap WHERE run_id='gx' AND kind='step'").fetchone()[0]
    con.close()
    assert stored == distinct
    assert dropped > 0, "the 4 KiB budget must force drops, or this checks nothing"
    assert stored + dropped == 300, (stored, dropped)


def test_one_push_per_burst_and_nothing_open_between(tmp_path: Path) -> None:
    """A gRPC stream costs the producer two Python threads per call and an idle open one keeps
    grpcio's pollers busy, so a burst goes out as Ingest.Push calls: one per burst here (a burst's
    batches gathered into one call), no stream opened, nothing left open between bursts."""
    c = start_collector(tmp_path, extra_args=["--flush-interval-s", "0.05"], metrics=True)
    try:
        s = Shipper(c.addr, run_id="burst", flush_interval_s=60, burst_linger_s=0.05)
        for burst in range(3):
            for i in range(100):
                s.record(Kind.COLLECTIVE, *_row(burst * 100 + i))
                s.record(Kind.STEP, *step_row(burst * 100 + i))
            assert s.flush(30)
            m = scrape_metrics(c.metrics_port)
            assert m["tracetop_collector_streams_open"] == 0
            assert m["tracetop_collector_pushes_total"] == burst + 1, "a burst's two batches went out in one call"
        assert s.stats()["batches_acked"] == 6
        s.close()
        m = scrape_metrics(c.metrics_port)
        assert m["tracetop_collector_streams_total"] == 0
    finally:
        assert c.stop() == 0
    con = duckdb.connect(str(c.db), read_only=True)
    steps = [r[0] for r in con.execute("SELECT step FROM collective ORDER BY step").fetchall()]
    n_steps = con.execute("SELECT count(DISTINCT step) FROM step WHERE run_id = 'burst'").fetchone()[0]
    con.close()
    assert steps == list(range(300))
    assert n_steps == 300


def test_a_receiver_without_push_gets_streams(tmp_path: Path) -> None:
    """A receiver older than Ingest.Push (here a gRPC server with Stream alone) answers
    UNIMPLEMENTED: the shipper streams from then on, and every batch arrives once."""
    from concurrent import futures

    import grpc

    from tracetop.wire import tracetop_pb2 as pb

    got: list[tuple[str, int]] = []

    def stream(request_iterator, context):
        for batch in request_iterator:
            got.append((batch.source_id, batch.seq))
            yield pb.Ack(source_id=batch.source_id, seq=batch.seq)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tracetop.v1.Ingest", {
        "Stream": grpc.stream_stream_rpc_method_handler(
            stream, request_deserializer=pb.ColumnBatch.FromString, response_serializer=pb.Ack.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        s = Shipper(f"127.0.0.1:{port}", run_id="old", flush_interval_s=60)
        for burst in range(3):
            for i in range(10):
                s.record(Kind.COLLECTIVE, *_row(burst * 10 + i))
            assert s.flush(30)
        stats = s.stats()
        s.close()
    finally:
        server.stop(0)
    assert stats["batches_acked"] == 3
    assert sorted(got) == sorted(set(got)) and len(got) == 3, got


def test_a_watched_run_ships_at_the_interval_the_collector_asks(tmp_path: Path) -> None:
    """Freshness on demand: while a Query.Watch stream shows the run, Push replies ask its
    shippers for TRACETOP_FRESH_SHIP_S (here 0.2 s) instead of their own 60 s; once nobody
    watches, the next reply says 0 and the 60 s are back."""
    from tui.sources import CollectorSource

    c = start_collector(tmp_path, extra_args=["--flush-interval-s", "0.05", "--fresh-ship-s", "0.2"])
    try:
        s = Shipper(c.addr, run_id="watched", flush_interval_s=60)
        s.record(Kind.RUN_START, *run_start_row())
        s.record(Kind.STEP, *step_row(0))
        assert s.flush(30)
        assert s.ship_interval_s == 60, "nobody watches yet: the shipper's own interval"
        src = CollectorSource(c.addr, "watched")
        src.open()
        import threading

        stop = threading.Event()
        watching = threading.Thread(target=lambda: [None for _ in src.watch(0.2, stop)], daemon=True)
        watching.start()
        try:
            deadline = time.monotonic() + 60
            while s.ship_interval_s != 0.2:  # the next push's reply carries the request
                s.record(Kind.STEP, *step_row(1))
                assert s.flush(30)
                assert time.monotonic() < deadline, "no Push reply asked for fresh shipments while watched"
                time.sleep(0.1)
            # now a row leaves within the asked interval on its own, with no flush(): well before 60 s
            before = s.stats()["batches_acked"]
            s.record(Kind.STEP, *step_row(2))
            while s.stats()["batches_acked"] == before:
                assert time.monotonic() < deadline, "a row waited for the 60 s interval although the run is watched"
                time.sleep(0.05)
        finally:
            stop.set()
            watching.join(30)
            src.close()
        deadline = time.monotonic() + 60
        while s.ship_interval_s != 60:
            s.record(Kind.STEP, *step_row(3))
            assert s.flush(30)
            assert time.monotonic() < deadline, "the fresh interval outlived the watcher"
            time.sleep(0.1)
        s.close()
    finally:
        assert c.stop() == 0


def test_real_hooks_drain_at_the_interval_a_watched_run_asks(tmp_path: Path) -> None:
    """The hooks' rows wait in the tracer, not in the shipper: the emitter follows the interval the
    collector asks for while the run is watched, so a step ends visible long before the hooks'
    own 60 s (TRACETOP_FLUSH_S here) would have shipped it; nobody watching, it stays put."""
    import threading

    from trainer_hooks.tracer import Tracer
    from tui.sources import CollectorSource

    c = start_collector(tmp_path, extra_args=["--flush-interval-s", "0.05", "--fresh-ship-s", "0.2"])
    try:
        src = CollectorSource(c.addr, "hooks-watched")
        src.open()
        stop = threading.Event()

        def watch() -> None:  # retries while the run is unknown, as the TUI does
            while not stop.is_set():
                try:
                    for _ in src.watch(0.2, stop):
                        pass
                except Exception:
                    time.sleep(0.2)

        watching = threading.Thread(target=watch, daemon=True)
        watching.start()
        t = Tracer(endpoint=c.addr, run_id="hooks-watched", rank=0, world_size=1, wrap_collectives=False,
                   flush_interval_s=120, heartbeat_s=120)
        try:
            deadline = time.monotonic() + 60  # half the hooks' own intervals: only the asked one meets it
            step = 0
            while t.shipper.ship_interval_s != 0.2:  # a push's reply carries the request
                with t.step(step):
                    time.sleep(0.01)
                step += 1
                t.shipper.ship_soon()  # only these first pushes are forced; the steps below are not
                assert time.monotonic() < deadline, "the hooks never took the watched run's interval"
                time.sleep(0.1)
            target = step + 3
            while step < target:
                with t.step(step):
                    time.sleep(0.01)
                step += 1
            seen = None
            while seen is None or seen < target - 1:
                seen = src.sql("SELECT max(step) AS s FROM step WHERE run_id = 'hooks-watched'").column("s")[0].as_py()
                assert time.monotonic() < deadline, f"step {target - 1} waited for the hooks' 60 s interval"
                time.sleep(0.1)
        finally:
            stop.set()
            watching.join(30)
            src.close()
            t.close()
    finally:
        assert c.stop() == 0


class _FreezingProxy:
    """A TCP proxy to ``upstream`` that, while ``frozen`` is set, stops moving bytes both ways and
    keeps every socket open: a host gone silent (no RST, no FIN), as a cut-off network looks."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        import socket
        import threading

        self.upstream = upstream
        self.frozen = threading.Event()
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self.socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:  # the receiver is gone (the test is ending)
                client.close()
                continue
            self.socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst) -> None:
        import time

        try:
            while True:
                while self.frozen.is_set():
                    time.sleep(0.05)
                data = src.recv(65536)
                if not data:
                    break
                while self.frozen.is_set():  # read before the freeze: held, not sent
                    time.sleep(0.05)
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.lsock.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def test_a_silent_receiver_is_found_and_left(tmp_path: Path) -> None:
    """A receiver that goes silent mid-call (no RST) once blocked the shipper forever: now HTTP/2
    keepalive finds it (tracetop.wire.transport.KEEPALIVE_S + KEEPALIVE_TIMEOUT_S), the call fails
    and the shipper reconnects; once the path is back, everything arrives once."""
    import time

    from tracetop.wire import transport

    found_within_s = getattr(transport, "KEEPALIVE_S", 10.0) + getattr(transport, "KEEPALIVE_TIMEOUT_S", 10.0)

    c = start_collector(tmp_path)
    host, port = c.addr.rsplit(":", 1)
    proxy = _FreezingProxy((host, int(port)))
    try:
        s = Shipper(f"127.0.0.1:{proxy.port}", run_id="silent", flush_interval_s=60)
        for i in range(10):
            s.record(Kind.COLLECTIVE, *_row(i))
        assert s.flush(30)
        proxy.frozen.set()
        for i in range(10, 20):
            s.record(Kind.COLLECTIVE, *_row(i))
        s.ship_soon()  # a call goes out into the silence
        time.sleep(1.0)
        before = s.stats()["reconnects"]
        deadline = time.monotonic() + found_within_s + 20
        while s.stats()["reconnects"] == before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.stats()["reconnects"] > before, "the shipper still waits on a receiver that went silent"
        proxy.frozen.clear()
        assert s.flush(60)
        s.close()
    finally:
        proxy.close()
        assert c.stop() == 0
    con = duckdb.connect(str(c.db), read_only=True)
    steps = [r[0] for r in con.execute("SELECT step FROM collective WHERE run_id = 'silent' ORDER BY step").fetchall()]
    con.close()
    assert steps == list(range(20))
