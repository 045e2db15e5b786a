"""The gRPC transport against real gRPC servers: how a stream's end maps to Rejected / Disconnected,
call metadata and channel credentials reaching the server, and a real collector's rejection
arriving in its own file as a gap row with the fault it named."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import duckdb
import grpc
import numpy as np
import pytest

from tests.support.services import start_collector
from tracetop.events import SCHEMAS, Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc
from tracetop.wire.codec import encode_batch
from tracetop.wire.shipper import Shipper
from tracetop.wire.transport import Disconnected, GrpcTransport, Rejected


def _batch(seq: int, n: int = 10, source: str = "hook"):
    cols = {c.name: (["x"] * n if c.dtype == "str" else np.full(n, seq)) for c in SCHEMAS[Kind.STEP]}
    return encode_batch(Kind.STEP, cols, source_id=source, seq=seq, run_id="tr")


class _Ingest(pb_grpc.IngestServicer):
    """A real gRPC Ingest server whose Stream handler each test writes."""

    def __init__(self, handle: Callable) -> None:
        self.handle = handle
        self.metadata: list[dict] = []
        self.security: list[list[bytes]] = []

    def Stream(self, request_iterator, context):
        self.metadata.append(dict(context.invocation_metadata()))
        self.security.append(context.auth_context().get("transport_security_type", []))
        yield from self.handle(request_iterator, context)


@pytest.fixture
def ingest_server(tmp_path: Path):
    made = []

    def make(handle: Callable) -> tuple[str, _Ingest]:
        servicer = _Ingest(handle)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_IngestServicer_to_server(servicer, server)
        addr = f"unix://{tmp_path / f's{len(made)}.sock'}"
        server.add_insecure_port(addr)
        server.start()
        made.append(server)
        return addr, servicer

    yield make
    for server in made:
        server.stop(0)


def _ack_first_then(abort: Callable):
    def handle(requests, context):
        first = next(requests)
        yield pb.Ack(source_id=first.source_id, seq=first.seq)
        bad = next(requests)
        abort(bad, context)

    return handle


def test_invalid_argument_with_trailing_metadata_is_a_named_rejection(ingest_server) -> None:
    def abort(bad, context):
        context.set_trailing_metadata((("tracetop-fault", "crc32c"), ("tracetop-rejected-source", bad.source_id),
                                       ("tracetop-rejected-seq", str(bad.seq))))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "crc32c: the payload is corrupt")

    addr, _ = ingest_server(_ack_first_then(abort))
    t = GrpcTransport(addr)
    acks = []
    with pytest.raises(Rejected) as ei:
        for ack in t.stream(iter([_batch(1), _batch(2)])):
            acks.append((ack.source_id, ack.seq))
    t.close()
    assert acks == [("hook", 1)]
    assert (ei.value.fault, ei.value.source_id, ei.value.seq) == ("crc32c", "hook", 2)


def test_invalid_argument_without_metadata_is_an_unnamed_rejection(ingest_server) -> None:
    def abort(bad, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not_a_batch: 12 bytes")

    addr, _ = ingest_server(_ack_first_then(abort))
    t = GrpcTransport(addr)
    with pytest.raises(Rejected) as ei:
        list(t.stream(iter([_batch(1), _batch(2)])))
    t.close()
    assert (ei.value.fault, ei.value.source_id, ei.value.seq) == ("not_a_batch", None, None)


def test_any_other_end_is_a_disconnect(ingest_server, tmp_path: Path) -> None:
    def abort(bad, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "collector is shutting down")

    addr, _ = ingest_server(_ack_first_then(abort))
    t = GrpcTransport(addr)
    with pytest.raises(Disconnected, match="shutting down"):
        list(t.stream(iter([_batch(1), _batch(2)])))
    t.close()
    nobody = GrpcTransport(f"unix://{tmp_path / 'nobody.sock'}")
    with pytest.raises(Disconnected, match="UNAVAILABLE"):
        list(nobody.stream(iter([_batch(1)])))
    nobody.close()


def _self_signed(tmp_path: Path) -> tuple[bytes, bytes]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return key.read_bytes(), cert.read_bytes()


def test_channel_credentials_and_call_metadata_reach_the_server(tmp_path: Path) -> None:
    """What TLS / bearer tokens will use, passed straight through the Shipper: a TLS channel
    (a server that speaks only TLS) and metadata on every stream."""
    key, cert = _self_signed(tmp_path)

    def ack_all(requests, context):
        for b in requests:
            yield pb.Ack(source_id=b.source_id, seq=b.seq)

    servicer = _Ingest(ack_all)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_IngestServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    try:
        addr = f"127.0.0.1:{port}"
        s = Shipper(addr, run_id="tr", flush_interval_s=0.02,
                    channel_credentials=grpc.ssl_channel_credentials(root_certificates=cert),
                    call_metadata=(("authorization", "Bearer t0ken"),))
        s.record(Kind.HEARTBEAT, 0, 1, 2, 0, "fwd", "", "", -1, "host", 7)
        assert s.flush(30), s.stats()
        s.close()
        assert servicer.metadata and all(md.get("authorization") == "Bearer t0ken" for md in servicer.metadata)
        assert servicer.security and all(sec == [b"ssl"] for sec in servicer.security), servicer.security
        plain = GrpcTransport(addr)  # the server speaks only TLS: without the credentials, no stream
        with pytest.raises(Disconnected):
            list(plain.stream(iter([_batch(1)])))
        plain.close()
    finally:
        server.stop(0)


def test_a_real_collectors_rejection_lands_as_a_gap_row_and_the_rest_is_stored(tmp_path: Path) -> None:
    c = start_collector(tmp_path, listen="unix")
    try:
        s = Shipper(c.addr, run_id="tr", source_id="agent-x", flush_interval_s=0.02)
        bad = _batch(2, n=70)
        bad.crc32c ^= 1
        for b in (_batch(1, n=10), bad, _batch(3, n=30)):
            assert s.forward(b)
        assert s.flush(60), s.stats()
        st = s.stats()
        s.close()
    finally:
        assert c.stop() == 0
    con = duckdb.connect(str(c.db), read_only=True)
    stored = sorted(r[0] for r in con.execute("SELECT DISTINCT step FROM step WHERE run_id='tr'").fetchall())
    gaps = con.execute("SELECT kind, reason, origin_source, sum(dropped) FROM gap WHERE run_id='tr' GROUP BY ALL").fetchall()
    con.close()
    assert stored == [1, 3]
    assert gaps == [("step", "rejected:crc32c", "hook", 70)]
    assert st["dropped_by_reason"] == {"rejected:crc32c": 70} and st["batches_rejected"] == 1
