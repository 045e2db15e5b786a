"""Bad input over a real collector process on loopback: each fault answered with a status naming it,
nothing of the bad batch stored, and a well-behaved source streaming at the same time unaffected."""

from __future__ import annotations

import threading

import grpc
import pytest
from google.protobuf.message import DecodeError

from tests.collector.util import Feeder, batch, scalar, trailing
from tests.support.services import scrape_metrics, start_collector
from tracetop.wire import tracetop_pb2 as pb

N = 100  # rows per batch


class Steady:
    """A good source streaming one batch every ~20 ms on its own stream, for the whole module."""

    def __init__(self, addr: str) -> None:
        self.feeder = Feeder(addr)
        self.sent = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.sent += 1
            self.feeder.send(batch("steady", self.sent, N))

    def acked(self) -> int:
        return self.feeder.acks.get("steady", 0)

    def progresses(self) -> None:
        """The steady source keeps getting acks: one for a batch sent after this call."""
        target = self.sent + 1
        self.feeder.wait_ack("steady", target, timeout_s=30)


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    c = start_collector(tmp_path_factory.mktemp("bad"), extra_args=["--max-batch-mb", "4", "--flush-interval-s", "0.1"], metrics=True)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def steady(collector):
    s = Steady(collector.addr)
    yield s
    s.stop.set()
    s.thread.join()
    s.feeder.close()
    assert s.feeder.wait_end() is None, "the steady stream ended with an error"
    # Everything it sent was acked and stored once.
    assert s.feeder.acks["steady"] == s.sent
    assert scalar(collector.addr, "SELECT rows FROM sources WHERE source_id = 'steady'") == s.sent * N


def _truncate_column(b: pb.ColumnBatch) -> None:
    b.columns[2].data = b.columns[2].data[:-8]


def _wrong_n(b: pb.ColumnBatch) -> None:
    b.n = b.n + 1


def _bad_crc(b: pb.ColumnBatch) -> None:
    data = bytearray(b.columns[3].data)
    data[0] ^= 0xFF
    b.columns[3].data = bytes(data)


def _schema_version(b: pb.ColumnBatch) -> None:
    b.schema_version = 99


def _bad_run_id(b: pb.ColumnBatch) -> None:
    b.run_id = "no spaces/allowed"


@pytest.mark.parametrize(
    "name, corrupt, fault, says",
    [
        ("truncated", _truncate_column, "column_length", "bytes, n=100 needs"),
        ("wrong-n", _wrong_n, "column_length", "n=101"),
        ("bad-crc", _bad_crc, "crc32c", "CRC32C mismatch"),
        ("schema", _schema_version, "schema_version", "schema 99"),
        ("run-id", _bad_run_id, "run_id", "not 1-128 chars"),
    ],
)
def test_bad_batch_named_nothing_stored_others_unaffected(collector, steady, name, corrupt, fault, says):
    source = f"bad-{name}"
    f = Feeder(collector.addr)
    f.send(batch(source, 1, N))
    f.wait_ack(source, 1)
    bad = batch(source, 2, N)
    corrupt(bad)
    f.send(bad)
    err = f.wait_end()
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(f"{fault}:") and says in err.details(), err.details()
    md = trailing(err)
    assert md["tracetop-fault"] == fault
    if fault != "run_id":
        assert (md["tracetop-rejected-source"], md["tracetop-rejected-seq"]) == (source, "2")
    assert f.acks[source] == 1  # the good batch before it was acked, the bad one never
    # Nothing of the bad batch is stored: only batch 1's rows, only seq 1 in the log.
    assert scalar(collector.addr, f"SELECT count(*) FROM ingest_log WHERE source_id = '{source}'") == 1
    assert scalar(collector.addr, f"SELECT rows FROM sources WHERE source_id = '{source}'") == N
    steady.progresses()


def test_oversized_message_resource_exhausted(collector, steady):
    f = Feeder(collector.addr)
    f.send(batch("big", 1, N))
    f.wait_ack("big", 1)
    big = batch("big", 2, 60_000)  # 60k STEP rows = 5.7 MB > --max-batch-mb 4 (the smallest allowed)
    assert big.ByteSize() > 1024 * 1024
    f.send(big)
    err = f.wait_end()
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert "larger than max" in err.details() or "1048576" in err.details(), err.details()
    assert scalar(collector.addr, "SELECT count(*) FROM ingest_log WHERE source_id = 'big'") == 1
    assert scalar(collector.addr, "SELECT sum(n) FROM ingest_log WHERE source_id = 'big'") == N
    steady.progresses()


def test_garbage_bytes_named(collector, steady):
    garbage = b"\xff\xff\xff\xff\x0f garbage"
    with pytest.raises(DecodeError):
        pb.ColumnBatch.FromString(garbage)  # the premise: these bytes are not a ColumnBatch
    f = Feeder(collector.addr, raw=True)
    f.send(batch("garbage-src", 1, N).SerializeToString())
    f.wait_ack("garbage-src", 1)
    f.send(garbage)
    err = f.wait_end()
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a tracetop.v1.ColumnBatch" in err.details()
    assert trailing(err)["tracetop-fault"] == "not_a_batch"
    assert scalar(collector.addr, "SELECT count(*) FROM ingest_log WHERE source_id = 'garbage-src'") == 1
    steady.progresses()


def test_duplicates_acked_not_stored(collector, steady):
    f = Feeder(collector.addr)
    for seq in (1, 2, 3):
        f.send(batch("dup", seq, N))
    f.wait_ack("dup", 3)
    f.close()
    assert f.wait_end() is None
    # A shipper reconnects and resends 2 and 3 (never acked in its view), then 5 (it dropped 4).
    g = Feeder(collector.addr)
    for seq in (2, 3):
        g.send(batch("dup", seq, N))
    g.wait_ack("dup", 3)
    g.send(batch("dup", 5, N))
    g.wait_ack("dup", 5)
    g.close()
    assert g.wait_end() is None
    seqs = scalar(collector.addr, "SELECT list(seq ORDER BY seq) FROM ingest_log WHERE source_id = 'dup'")
    assert seqs == [1, 2, 3, 5]
    assert scalar(collector.addr, "SELECT hwm FROM sources WHERE source_id = 'dup'") == 5
    assert scalar(collector.addr, "SELECT count(*) FROM step WHERE run_id = 'run-1' AND step IN (1, 2, 3, 5)") >= 4 * N


def test_prometheus_counts_what_happened(collector, steady):
    before = scrape_metrics(collector.metrics_port)
    f = Feeder(collector.addr)
    for seq in (1, 2, 3):
        f.send(batch("prom", seq, 7, kind=pb.COLLECTIVE))
    f.wait_ack("prom", 3)
    f.send(batch("prom", 2, 7, kind=pb.COLLECTIVE))  # a duplicate
    f.wait_ack("prom", 3)
    bad = batch("prom", 4, 7, kind=pb.COLLECTIVE)
    _bad_crc(bad)
    f.send(bad)
    assert f.wait_end().code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape_metrics(collector.metrics_port)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta('tracetop_collector_events_stored_total{kind="collective"}') == 21
    assert delta('tracetop_collector_events_received_total{kind="collective"}') == 28  # 3 + the duplicate
    assert delta('tracetop_collector_batches_rejected_total{fault="crc32c"}') == 1
    assert delta("tracetop_collector_duplicates_total") == 1
    assert delta("tracetop_collector_batch_latency_seconds_count") >= 3
    assert "tracetop_collector_writer_queue_depth" in after
