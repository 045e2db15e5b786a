"""The ranks' ingest-only token (`tracetop token ingest`): a real collector with --token-file takes
the ranks' rows with it, refuses a query or a command with it (PERMISSION_DENIED, naming the token
to use), and still answers the operator's token for both (acceptance hard-auth)."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from tests.support import ROOT
from tests.support.services import start_collector
from tracetop.wire import auth


def _tracetop(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetop.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def closed(tmp_path_factory):
    d = tmp_path_factory.mktemp("ingest-token")
    op = d / "operator.token"
    op.write_text("operator-s3cret-42\n")
    op.chmod(0o600)
    ranks = d / "ranks.token"
    r = _tracetop("token", "ingest", "--token-file", str(op), "--out", str(ranks))
    assert r.returncode == 0, r.stderr
    col = start_collector(d, "unix", extra_args=["--token-file", str(op)])
    yield col, op, ranks
    col.stop()


def test_derived_token_file_is_private_and_not_the_operators(closed):
    _col, op, ranks = closed
    assert ranks.stat().st_mode & 0o777 == 0o600
    text = ranks.read_text()
    assert "operator-s3cret-42" not in text and text.strip() == auth.ingest_token("operator-s3cret-42")
    again = _tracetop("token", "ingest", "--token-file", str(op), "--out", str(ranks))
    assert again.returncode == 2 and "cannot create" in again.stderr  # never overwrites


def test_ranks_ship_with_it_but_may_not_query_or_command(closed, monkeypatch):
    import trainer_hooks

    col, op, ranks = closed
    monkeypatch.setenv("TRACETOP_TOKEN_FILE", str(ranks))
    t = trainer_hooks.Tracer(endpoint=col.addr, run_id="ingest-only", rank=0, world_size=1, wrap_collectives=False,
                             flush_interval_s=0.2, close_timeout_s=5.0)
    for i in range(3):
        with t.step(i):
            time.sleep(0.01)
    t.close()
    assert t.shipper.stats()["unacked_batches"] == 0, "the collector did not ack the ranks' token"

    monkeypatch.delenv("TRACETOP_TOKEN_FILE")
    denied = _tracetop("query", "--collector", col.addr, "--token-file", str(ranks), "SELECT count(*) FROM step")
    assert denied.returncode != 0
    assert "PERMISSION_DENIED" in denied.stderr + denied.stdout or "may not" in denied.stderr + denied.stdout
    assert "ingest-only" in denied.stderr + denied.stdout and "--token-file" in denied.stderr + denied.stdout

    ok = _tracetop("query", "--collector", col.addr, "--token-file", str(op), "--json",
                   "SELECT count(*) AS n FROM step WHERE run_id='ingest-only'")
    assert ok.returncode == 0, ok.stderr
    assert '"n": 3' in ok.stdout, ok.stdout

    # a command with the ranks' token: refused by role, before anything is looked at
    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc

    ch = grpc.insecure_channel(col.addr)
    try:
        stub = pb_grpc.ControlStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Submit(pb.ControlRequest(), metadata=(("authorization", "Bearer " + ranks.read_text().strip()),),
                         timeout=10)
        # this collector has no control token: commands are refused to everyone, the ranks included
        assert e.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
        assert "control token" in e.value.details()
    finally:
        ch.close()


def test_role_check_names_the_token_to_use(tmp_path):
    op = tmp_path / "op"
    op.write_text("op-token-1\n")
    op.chmod(0o600)
    ctl = tmp_path / "ctl"
    ctl.write_text("ctl-token-1\n")
    ctl.chmod(0o600)
    a = auth.ServerAuth.from_files(token_file=str(op), control_token_file=str(ctl))
    ranks = [(auth.HEADER, "Bearer " + auth.ingest_token("op-token-1"))]
    assert a.check("/tracetop.v1.Ingest/Push", ranks) is None
    q = a.check("/tracetop.v1.Query/Sql", ranks)
    assert "may not" in q and "operator's token" in q
    c = a.check("/tracetop.v1.Control/Submit", ranks)
    assert "may not" in c and "control token" in c
    assert a.check("/tracetop.v1.Query/Sql", [(auth.HEADER, "Bearer op-token-1")]) is None
    # a token derived from some other secret is nobody's
    assert "not one this collector accepts" in a.check("/tracetop.v1.Ingest/Push",
                                                       [(auth.HEADER, "Bearer " + auth.ingest_token("other"))])
