"""The relay in-process, over a real unix-socket gRPC server and the real shipper (its memory
transport stands in for the collector): validation, spool-then-ack, dedup, a full spool."""

from __future__ import annotations

import queue
import threading

import grpc
import numpy as np
import pytest

from agent.relay import Relay
from tracetop.errors import ListenError
from tracetop.events import SCHEMAS, Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc
from tracetop.wire.codec import encode_batch
from tracetop.wire.shipper import MemoryTransport, Shipper


def _batch(seq: int, n: int = 10, source: str = "hook-7") -> pb.ColumnBatch:
    cols = {c.name: np.arange(n) for c in SCHEMAS[Kind.STEP]}
    return encode_batch(Kind.STEP, cols, source_id=source, seq=seq, run_id="r1")


class _Stream:
    """A client stream to the relay: put batches, read acks, see how it ended."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.q: queue.Queue = queue.Queue()
        self.acks: list[tuple[str, int]] = []
        self.call = pb_grpc.IngestStub(self.channel).Stream(iter(self.q.get, None))
        self.error: grpc.RpcError | None = None
        self.got_ack = threading.Semaphore(0)
        self.ended = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for a in self.call:
                self.acks.append((a.source_id, a.seq))
                self.got_ack.release()
        except grpc.RpcError as e:
            self.error = e
        self.ended.set()

    def send(self, b: pb.ColumnBatch) -> None:
        self.q.put(b)

    def wait_acks(self, k: int) -> None:
        for _ in range(k):
            assert self.got_ack.acquire(timeout=10), f"acks so far: {self.acks}"

    def close(self) -> None:
        self.q.put(None)
        self.ended.wait(10)
        self.channel.close()


def _round_trip(target: str) -> None:
    """One batch to the relay at target and its ack back (fails the test if no ack comes)."""
    s = _Stream(target)
    s.send(_batch(1))
    s.wait_acks(1)
    s.close()


@pytest.fixture
def relay_env(tmp_path):
    made = []

    def make(spool_max_bytes: int = 1 << 30):
        mem = MemoryTransport()
        shipper = Shipper(
            None,
            run_id="agent-run",
            source_id="agent:test",
            transport=mem,
            spool_dir=tmp_path / "spool",
            spool_max_bytes=spool_max_bytes,
            flush_interval_s=0.05,
        )
        sock = f"unix://{tmp_path / 'relay.sock'}"
        relay = Relay(shipper, [sock]).start()
        made.append((relay, shipper))
        return relay, shipper, mem, sock

    yield make
    for relay, shipper in made:
        relay.stop(0.1)
        shipper.close(1)


def test_acks_after_spool_and_dedups_resends(relay_env):
    relay, shipper, mem, sock = relay_env()
    s = _Stream(sock)
    for seq in (1, 2, 3):
        s.send(_batch(seq))
    s.wait_acks(3)
    s.send(_batch(2))  # a resend of something already spooled
    s.wait_acks(1)
    s.close()
    assert s.acks == [("hook-7", 1), ("hook-7", 2), ("hook-7", 3), ("hook-7", 3)]
    assert s.error is None
    assert shipper.flush(10)
    hook = [b for b in mem.batches if b.source_id == "hook-7"]
    assert [b.seq for b in hook] == [1, 2, 3]  # source and seqs kept, the resend not forwarded
    st = relay.stats()
    assert st["relay_batches"] == 3 and st["relay_rows"] == 30 and st["relay_duplicates"] == 1


@pytest.mark.parametrize(
    "corrupt, fault",
    [
        (lambda b: setattr(b, "crc32c", b.crc32c ^ 1), "crc32c"),
        (lambda b: setattr(b, "schema_version", 99), "schema_version"),
        (lambda b: setattr(b, "n", b.n + 1), "column_length"),
        (lambda b: setattr(b, "run_id", "bad run id!"), "run_id"),
    ],
)
def test_malformed_batch_refused_naming_fault_never_spooled(relay_env, tmp_path, corrupt, fault):
    relay, shipper, mem, sock = relay_env()
    s = _Stream(sock)
    s.send(_batch(1))
    s.wait_acks(1)
    bad = _batch(2)
    corrupt(bad)
    s.send(bad)
    assert s.ended.wait(10)
    s.close()
    assert s.error is not None and s.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert s.error.details().startswith(f"{fault}:")
    md = dict(s.error.trailing_metadata())
    assert md["tracetop-fault"] == fault
    assert (md["tracetop-rejected-source"], md["tracetop-rejected-seq"]) == ("hook-7", "2")
    assert not (tmp_path / "spool" / "hook-7" / f"{2:020d}.batch").exists()
    assert shipper.flush(10)
    assert [b.seq for b in mem.batches if b.source_id == "hook-7"] == [1]
    assert relay.stats()["relay_rejected"] == 1


def test_garbage_bytes_refused(relay_env):
    relay, shipper, mem, sock = relay_env()
    channel = grpc.insecure_channel(sock)
    call = channel.stream_stream(
        "/tracetop.v1.Ingest/Stream", request_serializer=lambda x: x, response_deserializer=pb.Ack.FromString
    )
    with pytest.raises(grpc.RpcError) as ei:
        list(call(iter([b"\xff\xff\xff\xff not a protobuf"])))
    channel.close()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith("not_a_batch:")


def test_full_spool_refuses_without_ack_and_records_no_loss(relay_env):
    relay, shipper, mem, sock = relay_env(spool_max_bytes=100)  # smaller than one batch
    s = _Stream(sock)
    s.send(_batch(1, n=50))
    s.send(_batch(2, n=50))
    assert s.ended.wait(10)
    s.close()
    assert s.acks == []  # not acked: the hook keeps it and resends
    assert s.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "spool is full" in s.error.details()
    # A resend of the same batch is refused again but reported once.
    s2 = _Stream(sock)
    s2.send(_batch(1, n=50))
    assert s2.ended.wait(10)
    s2.close()
    assert relay.stats()["spool_full"] == 2
    assert shipper.flush(10)
    assert not [b for b in mem.batches if b.source_id == "hook-7"]
    # a refusal is not a loss: the hook keeps the batch (its own ledger records a drop, if any)
    assert not [r for r in mem.rows(Kind.GAP)["reason"] if r == "spool_full"]


def test_second_relay_on_a_live_socket_is_refused(relay_env, tmp_path):
    relay, shipper, mem, sock = relay_env()
    with pytest.raises(ListenError, match="already listening"):
        Relay(shipper, [sock]).start()


def test_stale_socket_file_is_replaced(tmp_path):
    path = tmp_path / "stale.sock"
    path.write_bytes(b"")  # what a kill -9'd agent leaves behind (nobody answers on it)
    shipper = Shipper(None, run_id="r", transport=MemoryTransport())
    relay = Relay(shipper, [f"unix://{path}"]).start()
    try:
        _round_trip(f"unix://{path}")
    finally:
        relay.stop(0.1)
        shipper.close(1)


def test_restarted_relay_acks_resends_of_what_the_killed_agent_spooled(tmp_path):
    spool = tmp_path / "spool"
    # The killed agent: its shipper never reached a collector, so its spool holds hook-7 1..3.
    dead = Shipper("unix:///nonexistent/collector.sock", run_id="r", source_id="agent:old", spool_dir=spool)
    for seq in (1, 2, 3):
        assert dead.forward(_batch(seq))
    dead.close(0.1)

    mem = MemoryTransport()
    shipper = Shipper(None, run_id="r", transport=mem, spool_dir=spool)  # replays 1..3
    assert shipper.replayed_high_water == {"hook-7": 3}
    sock = f"unix://{tmp_path / 'relay.sock'}"
    relay = Relay(shipper, [sock], high_water=shipper.replayed_high_water).start()
    try:
        s = _Stream(sock)
        s.send(_batch(3))  # its ack was lost in the kill: the hook resends it
        s.send(_batch(4))
        s.wait_acks(2)
        s.close()
        assert shipper.flush(10)
    finally:
        relay.stop(0.1)
        shipper.close(1)
    assert s.acks == [("hook-7", 3), ("hook-7", 4)]
    assert [b.seq for b in mem.batches if b.source_id == "hook-7"] == [1, 2, 3, 4]
    assert relay.stats()["relay_duplicates"] == 1
    assert shipper.stats()["spool_bytes"] == 0


def test_loopback_tcp_listen_and_non_loopback_refused():
    shipper = Shipper(None, run_id="r", transport=MemoryTransport())
    with pytest.raises(ListenError, match="loopback only"):
        Relay(shipper, ["0.0.0.0:0"]).start()
    relay = Relay(shipper, ["127.0.0.1:0"]).start()
    try:
        (addr,) = relay.addresses()
        assert addr.startswith("127.0.0.1:") and not addr.endswith(":0")
        _round_trip(addr)
    finally:
        relay.stop(0.1)
        shipper.close(1)
