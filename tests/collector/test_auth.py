"""Closed by default: bearer tokens on every service and on /metrics, TLS and mutual TLS, the
query limits. A real collector process each time; certificates made with openssl."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from tests.support import ROOT
from tests.support.services import start_collector
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc
from tracetop.wire.auth import CONTROL, INGEST, QUERY, AuthSetupError, ClientAuth, ServerAuth, role_of

TOKEN = "t0ken-abc123-not-in-any-log"
CONTROL_TOKEN = "c0ntrol-xyz789"


def _token_file(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def _meta(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else ()


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# ---- pure parts -----------------------------------------------------------------------------
def test_roles_by_method() -> None:
    assert role_of("/tracetop.v1.Ingest/Stream") == INGEST
    assert role_of("/tracetop.v1.Ingest/Clock") == INGEST
    assert role_of("/tracetop.v1.Query/Sql") == QUERY
    assert role_of("/tracetop.v1.Query/Watch") == QUERY
    assert role_of("/tracetop.v1.Control/Subscribe") == INGEST  # rank 0's hooks listen for commands
    assert role_of("/tracetop.v1.Control/Report") == INGEST
    assert role_of("/tracetop.v1.Control/Poll") == INGEST  # rank 0 polls for commands
    assert role_of("/tracetop.v1.Control/Submit") == CONTROL


def test_check_names_what_is_missing_and_never_the_token(tmp_path: Path) -> None:
    auth = ServerAuth.from_files(token_file=str(_token_file(tmp_path / "t", TOKEN)),
                                 control_token_file=str(_token_file(tmp_path / "c", CONTROL_TOKEN)))
    assert "needs a bearer token" in auth.check("/tracetop.v1.Query/Sql", [])
    wrong = auth.check("/tracetop.v1.Query/Sql", _meta("nope"))
    assert "not one this collector accepts" in wrong and "nope" not in wrong
    assert auth.check("/tracetop.v1.Query/Sql", _meta(TOKEN)) is None
    assert auth.check("/tracetop.v1.Query/Sql", _meta(CONTROL_TOKEN)) is None
    assert "ingest token may not" in auth.check("/tracetop.v1.Control/Submit", _meta(TOKEN))
    assert auth.check("/tracetop.v1.Control/Submit", _meta(CONTROL_TOKEN)) is None
    assert auth.check("/tracetop.v1.Ingest/Stream", _meta(CONTROL_TOKEN)) is not None  # control cannot ingest
    no_control = ServerAuth.from_files(token_file=str(tmp_path / "t"))
    assert "none is configured" in no_control.check("/tracetop.v1.Control/Submit", _meta(TOKEN))
    assert ServerAuth().check("/tracetop.v1.Query/Sql", []) is None  # nothing demanded by default


def test_bad_token_files_are_refused_with_the_fix(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.write_text(TOKEN)
    loose.chmod(0o644)
    with pytest.raises(AuthSetupError, match="chmod 600"):
        ServerAuth.from_files(token_file=str(loose))
    empty = _token_file(tmp_path / "empty", "")
    with pytest.raises(AuthSetupError, match="holds no token"):
        ServerAuth.from_files(token_file=str(empty))
    with pytest.raises(AuthSetupError, match="cannot read"):
        ClientAuth.from_options(token_file=str(tmp_path / "missing"))
    same = _token_file(tmp_path / "same", TOKEN)
    with pytest.raises(AuthSetupError, match="share a token"):
        ServerAuth.from_files(token_file=str(same), control_token_file=str(same))
    with pytest.raises(AuthSetupError, match="--tls-key"):
        ServerAuth.from_files(tls_cert=str(same))
    assert TOKEN not in repr(ClientAuth.from_options(token_file=str(same)))


# ---- a real collector with a token ------------------------------------------------------------
def test_token_required_on_every_service_and_metrics(tmp_path: Path) -> None:
    tok = _token_file(tmp_path / "token", TOKEN)
    ctl = _token_file(tmp_path / "control", CONTROL_TOKEN)
    c = start_collector(tmp_path, "unix", metrics=True,
                        extra_args=["--token-file", str(tok), "--control-token-file", str(ctl)])
    try:
        with grpc.insecure_channel(c.addr) as ch:
            ingest, query, control = pb_grpc.IngestStub(ch), pb_grpc.QueryStub(ch), pb_grpc.ControlStub(ch)
            clock = lambda t: ingest.Clock(pb.ClockRequest(client_send_ns=1), metadata=_meta(t), timeout=30)  # noqa: E731
            sql = lambda t: query.Sql(pb.QueryRequest(sql="SELECT 1"), metadata=_meta(t), timeout=30)  # noqa: E731

            def stream(t):
                return list(ingest.Stream(iter(()), metadata=_meta(t), timeout=30))

            def watch(t):
                return next(iter(query.Watch(pb.WatchRequest(run_id="r"), metadata=_meta(t), timeout=30)), None)

            def subscribe(t):
                return next(iter(control.Subscribe(pb.SubscribeRequest(run_id="r"), metadata=_meta(t), timeout=5)), None)

            for call in (clock, sql, stream, watch, subscribe):
                for token, refused in ((None, True), ("wrong", True), (TOKEN, False)):
                    code = _code(lambda call=call, token=token: call(token))
                    assert (code == grpc.StatusCode.UNAUTHENTICATED) == refused, (call, token, code)
            assert clock(TOKEN).server_recv_ns > 0
            assert sql(TOKEN).arrow_ipc
            try:
                sql(None)
            except grpc.RpcError as e:
                assert "bearer token" in e.details() and TOKEN not in e.details()
        url = f"http://127.0.0.1:{c.metrics_port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=10)
        assert e.value.code == 401
        ok = urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"}), timeout=10)
        assert b"tracetop_collector" in ok.read()
        # the CLI client: refused without the token (exit 2, says why), answers with it
        q = [sys.executable, "-m", "tracetop.cli", "query", "--collector", c.addr]
        r = subprocess.run([*q, "SELECT 42 AS x"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "UNAUTHENTICATED" in r.stderr and TOKEN not in r.stderr + r.stdout
        r = subprocess.run([*q, "--token-file", str(tok), "--json", "SELECT 42 AS x"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and '"x": 42' in r.stdout, r.stderr
        env = dict(os.environ, TRACETOP_TOKEN_FILE=str(tok))
        r = subprocess.run([*q, "--json", "SELECT 7 AS y"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and '"y": 7' in r.stdout, r.stderr
    finally:
        assert c.stop() == 0
    assert TOKEN not in c.text() and CONTROL_TOKEN not in c.text()


def test_runaway_query_is_cut_off_and_the_collector_lives_on(tmp_path: Path) -> None:
    c = start_collector(tmp_path, "unix", extra_args=["--query-timeout-s", "3", "--max-query-rows", "10",
                                                      "--memory-limit-mb", "256"])
    try:
        with grpc.insecure_channel(c.addr) as ch:
            query = pb_grpc.QueryStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                query.Sql(pb.QueryRequest(sql="SELECT sum(i) FROM range(100000000000) t(i)"), timeout=120)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--query-timeout-s" in e.value.details()
            # an endless row source stops at the row cap without building the rest
            reply = query.Sql(pb.QueryRequest(sql="SELECT * FROM range(1000000000000)"), timeout=120)
            assert reply.truncated
            from collector.query.readonly import from_ipc

            assert from_ipc(reply.arrow_ipc).num_rows == 10
            # a query that would hold ~800 MB is refused under a 256 MB cap
            with pytest.raises(grpc.RpcError) as e:
                query.Sql(pb.QueryRequest(sql="SELECT list(i) FROM range(100000000) t(i)"), timeout=120)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--memory-limit-mb" in e.value.details()
            assert from_ipc(query.Sql(pb.QueryRequest(sql="SELECT 5 AS v"), timeout=30).arrow_ipc).to_pylist() == [{"v": 5}]
    finally:
        assert c.stop() == 0


# ---- TLS --------------------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca_and_cert(d: Path, name: str, ca: str = "ca") -> None:
    """A CA (if missing) and a certificate for localhost/127.0.0.1 it signed: d/{ca}.pem, d/{name}.{pem,key}."""
    if not (d / f"{ca}.pem").exists():
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={ca}",
                 "-keyout", f"{ca}.key", "-out", f"{ca}.pem", cwd=d)
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem", cwd=d)
    for f in d.glob("*.key"):
        f.chmod(0o600)


def _sql_over_tls(addr: str, auth: ClientAuth) -> grpc.StatusCode:
    with auth.channel(addr) as ch:
        return _code(lambda: pb_grpc.QueryStub(ch).Sql(pb.QueryRequest(sql="SELECT 1"), timeout=20,
                                                       metadata=auth.metadata()))


def test_tls_round_trip_and_mutual_tls_refuses_an_unknown_client(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    d.mkdir()
    _ca_and_cert(d, "server")
    _ca_and_cert(d, "client")
    _ca_and_cert(d, "stranger", ca="otherca")  # a client cert from a CA the collector does not know
    # TLS only (on loopback: off it, TLS without client authentication is refused): a TLS client gets
    # through, a plaintext one does not, and nobody may command (TLS names no control role)
    c = start_collector(tmp_path, "127.0.0.1:0",
                        extra_args=["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key")])
    try:
        port = c.addr.rpartition(":")[2]
        addr = f"localhost:{port}"
        tls = ClientAuth.from_options(tls_ca=str(d / "ca.pem"))
        assert _sql_over_tls(addr, tls) == grpc.StatusCode.OK
        assert _sql_over_tls(addr, ClientAuth()) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
        with tls.channel(addr) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.ControlStub(ch).Submit(pb.ControlRequest(), timeout=20)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--control-token-file" in e.value.details()
        r = subprocess.run([sys.executable, "-m", "tracetop.cli", "query", "--collector", addr, "--tls-ca",
                            str(d / "ca.pem"), "--json", "SELECT 3 AS z"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and '"z": 3' in r.stdout, r.stderr
    finally:
        assert c.stop() == 0
    # mutual TLS: only clients whose certificate the given CA signed
    c = start_collector(tmp_path, "127.0.0.1:0", db=tmp_path / "m.duckdb",
                        extra_args=["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"),
                                    "--tls-client-ca", str(d / "ca.pem")])
    try:
        addr = f"localhost:{c.addr.rpartition(':')[2]}"
        ok = ClientAuth.from_options(tls_ca=str(d / "ca.pem"), tls_cert=str(d / "client.pem"), tls_key=str(d / "client.key"))
        assert _sql_over_tls(addr, ok) == grpc.StatusCode.OK
        stranger = ClientAuth.from_options(tls_ca=str(d / "ca.pem"), tls_cert=str(d / "stranger.pem"),
                                           tls_key=str(d / "stranger.key"))
        assert _sql_over_tls(addr, stranger) == grpc.StatusCode.UNAVAILABLE
        assert _sql_over_tls(addr, ClientAuth.from_options(tls_ca=str(d / "ca.pem"))) == grpc.StatusCode.UNAVAILABLE
        with ok.channel(addr) as ch:  # a known client certificate is no control role either
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.ControlStub(ch).Submit(pb.ControlRequest(), timeout=20)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        assert c.stop() == 0


def _refused_at_start(tmp_path: Path, listen: str, *extra: str) -> str:
    db = tmp_path / f"refused-{abs(hash((listen, extra)))}.duckdb"
    r = subprocess.run([sys.executable, "-m", "collector", "--db", str(db), "--listen", listen, *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    assert "listening" not in r.stdout and not db.exists()
    return r.stderr


def test_off_loopback_tls_without_client_authentication_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    d.mkdir()
    _ca_and_cert(d, "server")
    err = _refused_at_start(tmp_path, "0.0.0.0:0", "--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"))
    assert "--tls-client-ca" in err and "--token-file" in err, err


def test_a_name_starting_with_127_is_not_loopback(tmp_path: Path) -> None:
    err = _refused_at_start(tmp_path, "127.example.com:0")
    assert "not loopback" in err, err


def test_a_token_over_plain_tcp_off_loopback_is_refused(tmp_path: Path) -> None:
    tok = _token_file(tmp_path / "token", TOKEN)
    err = _refused_at_start(tmp_path, "0.0.0.0:0", "--token-file", str(tok))
    assert "clear text" in err and "--tls-cert" in err and TOKEN not in err, err


def test_non_loopback_without_tls_or_token_refused_at_start(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "collector", "--db", str(tmp_path / "x.duckdb"), "--listen", "0.0.0.0:0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tls-cert" in r.stderr and "--token-file" in r.stderr
    assert "listening" not in r.stdout and not (tmp_path / "x.duckdb").exists()


# ---- the clients that ship: hooks (env vars) and the agent (flags) ---------------------------
_HOOK = """
import sys
from trainer_hooks import Tracer
t = Tracer(rank=0, world_size=1, run_id=sys.argv[2], endpoint=sys.argv[1], wrap_collectives=False, close_timeout_s=5)
for n in range(5):
    with t.step(n):
        pass
t.close()
print("stats", t.stats()["shipper"].get("batches_acked", 0))
"""


def _stored_steps(c, run_id: str, token: str) -> int:
    with grpc.insecure_channel(c.addr) as ch:
        reply = pb_grpc.QueryStub(ch).Sql(pb.QueryRequest(sql=f"SELECT count(*) AS n FROM step WHERE run_id = '{run_id}'"),
                                          metadata=_meta(token), timeout=30)
    from collector.query.readonly import from_ipc

    return from_ipc(reply.arrow_ipc).to_pylist()[0]["n"]


def test_hooks_and_agent_present_their_token(tmp_path: Path) -> None:
    from tests.support.services import start_agent

    tok = _token_file(tmp_path / "token", TOKEN)
    c = start_collector(tmp_path, "unix", extra_args=["--token-file", str(tok)])
    try:
        base = dict(os.environ, TRACETOP_FLUSH_S="0.2")
        base.pop("TRACETOP_TOKEN_FILE", None)
        # hooks straight to the collector: refused without the token, stored with it
        r = subprocess.run([sys.executable, "-c", _HOOK, c.addr, "no-token"], cwd=ROOT, env=base,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]  # telemetry never breaks the trainer
        r = subprocess.run([sys.executable, "-c", _HOOK, c.addr, "with-token"], cwd=ROOT,
                           env=dict(base, TRACETOP_TOKEN_FILE=str(tok)), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert _stored_steps(c, "with-token", TOKEN) == 5
        assert _stored_steps(c, "no-token", TOKEN) == 0
        # hooks -> agent (a local unix socket, no token) -> collector (the agent presents the token)
        sock = f"unix://{tmp_path / 'agent.sock'}"
        agent = start_agent(c.addr, sock, tmp_path / "spool", "--fake-gpus", "1", "--token-file", str(tok))
        try:
            r = subprocess.run([sys.executable, "-c", _HOOK, sock, "via-agent"], cwd=ROOT, env=base,
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr[-2000:]
            agent.wait_drained()
        finally:
            agent.service.stop(timeout_s=60)
        assert _stored_steps(c, "via-agent", TOKEN) == 5
    finally:
        assert c.stop() == 0
    assert TOKEN not in c.text()


def test_commands_need_the_control_token(tmp_path: Path) -> None:
    tok = _token_file(tmp_path / "token", TOKEN)
    ctl = _token_file(tmp_path / "control", CONTROL_TOKEN)
    c = start_collector(tmp_path, "unix", extra_args=["--token-file", str(tok), "--control-token-file", str(ctl)])
    try:
        cmd = [sys.executable, "-m", "tracetop.cli", "control", "--collector", c.addr, "--run", "no-such-run",
               "set-micro-batch", "2"]
        r = subprocess.run([*cmd, "--token-file", str(tok)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "ingest token may not" in r.stderr, r.stderr
        r = subprocess.run([*cmd, "--token-file", str(ctl)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        # through the gate: the Control service itself now answers (and refuses an unknown run by name)
        assert "no-such-run" in r.stderr + r.stdout and "token" not in r.stderr, r.stderr
    finally:
        assert c.stop() == 0
    assert CONTROL_TOKEN not in c.text() and TOKEN not in c.text()


def test_a_query_token_makes_the_ranks_token_ingest_only(tmp_path: Path) -> None:
    """With --query-token-file the ranks' --token-file token may ingest, never query."""
    from tests.collector.util import batch

    tok = _token_file(tmp_path / "token", TOKEN)
    qtok = _token_file(tmp_path / "query", "qu3ry-t0ken-456")
    c = start_collector(tmp_path, "unix", extra_args=["--token-file", str(tok), "--query-token-file", str(qtok)])
    try:
        with grpc.insecure_channel(c.addr) as ch:
            ingest, query = pb_grpc.IngestStub(ch), pb_grpc.QueryStub(ch)
            reply = ingest.Push(pb.PushRequest(batches=[batch("rank-0", 1, 10).SerializeToString()]),
                                metadata=_meta(TOKEN), timeout=30)
            assert not reply.end_code and reply.acks[0].seq == 1
            with pytest.raises(grpc.RpcError) as e:
                query.Sql(pb.QueryRequest(sql="SELECT 1"), metadata=_meta(TOKEN), timeout=30)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "query token" in e.value.details()
            assert TOKEN not in e.value.details()
            assert _code(lambda: query.Sql(pb.QueryRequest(sql="SELECT 1"), metadata=_meta("qu3ry-t0ken-456"),
                                           timeout=30)) == grpc.StatusCode.OK
            assert _code(lambda: ingest.Push(pb.PushRequest(), metadata=_meta("qu3ry-t0ken-456"),
                                             timeout=30)) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert c.stop() == 0
