"""`--tls-server-name` / TRACETOP_TLS_SERVER_NAME reaches every client channel: the hooks' and the
agent's shippers (Ingest.Stream), the agent's clock probe and control relay, and the ClientAuth
channel of query/ui/control. A real collector process serves TLS with a certificate issued to a
name that is not the address the clients dial (127.0.0.1), so TLS fails without the override and
succeeds with it; nothing else differs between the two cases."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from tests.support.services import start_collector
from tracetop import env
from tracetop.events import Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc
from tracetop.wire.auth import ClientAuth
from tracetop.wire.shipper import Shipper

NAME = "collector.tracetop.internal"  # the certificate's only name; the clients dial 127.0.0.1


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    (d / "san.ext").write_text(f"subjectAltName=DNS:{NAME}\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={NAME}", "-keyout", "server.key",
             "-out", "server.csr", cwd=d)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "server.pem", cwd=d)
    for f in d.glob("*.key"):
        f.chmod(0o600)
    return d


@pytest.fixture(scope="module")
def tls_collector(pki: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("col")
    c = start_collector(tmp, "127.0.0.1:0", extra_args=["--tls-cert", str(pki / "server.pem"),
                                                         "--tls-key", str(pki / "server.key"), "--no-rules"])
    yield c
    assert c.stop() == 0


def _heartbeats(s: Shipper, n: int) -> None:
    for i in range(n):
        s.record(Kind.HEARTBEAT, 0, i, 1_000 + i, 0, "idle", "", "", -1, "host", 1)


def test_hooks_shipper_checks_the_name_given_by_tls_server_name(tls_collector, pki: Path, monkeypatch) -> None:
    from trainer_hooks.tracer import client_auth

    monkeypatch.setenv(env.TRACETOP_TLS_CA, str(pki / "ca.pem"))
    # without the override the certificate (issued to NAME) does not match 127.0.0.1: nothing gets through
    monkeypatch.delenv(env.TRACETOP_TLS_SERVER_NAME, raising=False)
    plain = Shipper(tls_collector.addr, run_id="sn", source_id="hooks-no-name", flush_interval_s=0.02,
                    reconnect_max_s=0.1, **client_auth())
    _heartbeats(plain, 5)
    assert not plain.flush(3.0)
    assert plain.stats()["batches_acked"] == 0
    plain.close(0.1)
    # with it, the same shipper setup is acked
    monkeypatch.setenv(env.TRACETOP_TLS_SERVER_NAME, NAME)
    kw = client_auth()
    assert kw["channel_options"] == [("grpc.ssl_target_name_override", NAME)]
    named = Shipper(tls_collector.addr, run_id="sn", source_id="hooks-named", flush_interval_s=0.02, **kw)
    _heartbeats(named, 5)
    assert named.flush(30.0), named.stats()
    named.close(5.0)


def test_agent_shipper_and_auth_channels_take_the_server_name(tls_collector, pki: Path) -> None:
    from agent.clock import grpc_exchange
    from agent.daemon import shipper_auth_kwargs

    auth = ClientAuth.from_options(tls_ca=str(pki / "ca.pem"), tls_server_name=NAME)
    s = Shipper(tls_collector.addr, run_id="sn", source_id="agent-named", flush_interval_s=0.02,
                **shipper_auth_kwargs(auth))
    _heartbeats(s, 3)
    assert s.flush(30.0), s.stats()
    s.close(5.0)
    # the ClientAuth channel (query, ui, control, the agent's control relay) and the clock probe
    with auth.channel(tls_collector.addr) as ch:
        reply = pb_grpc.QueryStub(ch).Sql(pb.QueryRequest(sql="SELECT 1"), timeout=30)
        assert reply.arrow_ipc
    exchange, close = grpc_exchange(tls_collector.addr, timeout_s=30.0, auth=auth)
    try:
        recv_ns, send_ns = exchange(1)
        assert recv_ns > 0 and send_ns >= recv_ns
    finally:
        close()
    wrong = ClientAuth.from_options(tls_ca=str(pki / "ca.pem"))
    with wrong.channel(tls_collector.addr) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.QueryStub(ch).Sql(pb.QueryRequest(sql="SELECT 1"), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
