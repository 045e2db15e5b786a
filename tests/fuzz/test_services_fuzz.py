"""Property tests against a real collector process: arbitrary bytes and arbitrary valid batches on
Ingest.Stream, arbitrary SQL on Query.Sql. Every call ends in a status that names the fault (or
success); none crashes the collector, which keeps answering, and every acked batch is stored."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.test_codec_fuzz import valid_batches
from tests.support.services import start_collector
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
#: what a query may end with: answered, refused (writes/files), wrong SQL, or cut off by a limit
SQL_CODES = {grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
             grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    c = start_collector(tmp, "unix", extra_args=["--query-timeout-s", "5"])
    channel = grpc.insecure_channel(c.addr)
    yield c, channel
    channel.close()
    assert c.stop() == 0, c.text()  # the collector's own output says why it did not exit cleanly


def _raw_stream(channel, messages: list[bytes]):
    call = channel.stream_stream("/tracetop.v1.Ingest/Stream", request_serializer=lambda b: b,
                                 response_deserializer=pb.Ack.FromString)
    acks, code, details = [], grpc.StatusCode.OK, ""
    try:
        for ack in call(iter(messages), timeout=60):
            acks.append(ack)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
    return acks, code, details


def _alive(channel) -> None:
    reply = pb_grpc.QueryStub(channel).Sql(pb.QueryRequest(sql="SELECT 1 AS one"), timeout=30)
    assert reply.arrow_ipc


@SETTINGS
@given(st.binary(min_size=1, max_size=2048))
def test_arbitrary_bytes_on_ingest(collector, raw: bytes) -> None:
    _, channel = collector
    acks, code, details = _raw_stream(channel, [raw])
    assert not acks
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details, (code, details)
    _alive(channel)


_seq = iter(range(1, 10**9))


@SETTINGS
@given(valid_batches())
def test_arbitrary_valid_batches_are_stored_exactly(collector, b) -> None:
    _, channel = collector
    _, _, batch = b
    batch.source_id = "fuzz-valid"
    batch.seq = next(_seq)
    acks, code, details = _raw_stream(channel, [batch.SerializeToString()])
    assert code == grpc.StatusCode.OK, details
    assert [a.seq for a in acks][-1:] == [batch.seq]
    from collector.query.readonly import from_ipc

    n = from_ipc(pb_grpc.QueryStub(channel).Sql(pb.QueryRequest(
        sql=f"SELECT sum(n) AS n FROM ingest_log WHERE source_id = 'fuzz-valid' AND seq = {batch.seq}"),
        timeout=30).arrow_ipc).to_pylist()[0]["n"]
    assert n == batch.n


SQLISH = st.one_of(
    st.text(max_size=80),
    st.builds(lambda a, b: f"SELECT {a} FROM {b}", st.text(max_size=20), st.sampled_from(
        ["step", "collective", "runs", "range(10)", "read_csv('/etc/passwd')", "'x'", "ingest_log"])),
    st.sampled_from(["DROP TABLE step", "COPY step TO '/tmp/x.csv'", "ATTACH '/tmp/a.db'", "INSTALL httpfs",
                     "SET enable_external_access = true", "PRAGMA database_list", "SELECT * FROM range(1e12)",
                     "CREATE TABLE t AS SELECT 1", "SELECT 1; DELETE FROM step", "CALL pragma_version()"]),
)


@SETTINGS
@given(SQLISH)
def test_arbitrary_sql_on_query(collector, sql: str) -> None:
    _, channel = collector
    code = grpc.StatusCode.OK
    try:
        pb_grpc.QueryStub(channel).Sql(pb.QueryRequest(sql=sql, max_rows=100), timeout=60)
    except grpc.RpcError as e:
        code = e.code()
        assert e.details(), sql
    assert code in SQL_CODES, (sql, code)
    _alive(channel)
