"""A profiling window's trace arriving at the Control service (``Control.Profile``), on a real
DuckDB store (in memory): pieces in order are stored and read back whole; a piece out of order, past
the cap, from a rank the action did not name, or from a start that is not the rank's own is refused;
a window that sent nothing is stored as such with its note. And the request checks: ranks, steps."""

from __future__ import annotations

import gzip
import json

import grpc
import pytest

from collector.control import profiles
from collector.control.service import ControlError, ControlService
from collector.ingest.schema import open_store
from tracetop.wire import tracetop_pb2 as pb


@pytest.fixture
def svc():
    con = open_store(":memory:")
    for rank in range(4):
        con.execute("INSERT INTO run_start (run_id, rank, world_size, dp, pp, zero_stage, micro_batch, micro_batches) "
                    "VALUES ('r', ?, 4, 4, 1, 0, 4, 1)", [rank])
    s = ControlService(con, ttl_s=60)
    for rank in range(4):
        s.note_source(f"src-{rank}@1", "r", rank, 1)
    yield s
    s.close()
    con.close()


def piece(a, rank, offset, data, last=False, total=0, note=""):
    return pb.ProfileChunk(run_id="r", rank=rank, source_key=f"src-{rank}@1", command_id=a.action_id, offset=offset,
                           data=data, last=last, total_bytes=total, first_step=40, steps=3, start_ns=10, end_ns=20,
                           note=note)


def test_pieces_in_order_are_stored_and_read_back(svc):
    a = svc.propose("r", "profile", 3, by="person:t", approve=True, values=[1, 3])
    trace = {"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1.5, "dur": 2.0}], "baseTimeNanoseconds": 7}
    blob = gzip.compress(json.dumps(trace).encode())
    half = len(blob) // 2
    svc.on_profile(piece(a, 1, 0, blob[:half]))
    with pytest.raises(ControlError) as e:  # a piece resent or skipped: refused, says where it stands
        svc.on_profile(piece(a, 1, 0, blob[:half]))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and f"expected {half}" in e.value.message
    svc.on_profile(piece(a, 1, half, blob[half:], last=True, total=len(blob)))
    svc.on_profile(piece(a, 3, 0, b"", last=True, note="over the cap: on rank 3's disk at /tmp/x"))
    svc.flush()
    rows = {w["rank"]: w for w in profiles.traces(svc._cur, "r")}
    assert rows[1]["state"] == "stored" and rows[1]["bytes"] == len(blob) and rows[1]["first_step"] == 40
    assert rows[3]["state"] == "not_sent" and "rank 3's disk" in rows[3]["note"]
    assert profiles.trace_json(svc._cur, "r", a.action_id, 1) == trace
    assert profiles.wall_ns(trace, 1.5) == 7 + 1500


def test_pieces_refused(svc):
    a = svc.propose("r", "profile", 3, by="person:t", approve=True, values=[1])
    with pytest.raises(ControlError, match="did not name rank 2"):
        svc.on_profile(piece(a, 2, 0, b"x"))
    bad = piece(a, 1, 0, b"x")
    bad.source_key = "src-2@1"  # rank 2's start speaking as rank 1
    with pytest.raises(ControlError, match="not this rank's shipper start"):
        svc.on_profile(bad)
    with pytest.raises(ControlError, match="cap"):
        svc.on_profile(piece(a, 1, 0, b"x" * (profiles.MAX_TRACE_BYTES + 1)))


@pytest.mark.parametrize("steps, ranks, words", [
    (0, [1], "give 1 to 100 steps"), (101, [1], "give 1 to 100 steps"), (3, [4], "no rank 4 in run r"),
    (3, [], "name the ranks"), (3, [1, 1], "named twice"), (3, list(range(17)), "at most 16")])
def test_bad_requests(svc, steps, ranks, words):
    with pytest.raises(ControlError) as e:
        svc.propose("r", "profile", steps, by="person:t", approve=True, values=ranks)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.message
    assert not svc.actions  # nothing stored, nothing sent
