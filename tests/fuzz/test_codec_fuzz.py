"""Property tests on the codec: any bytes, and any well-formed-but-wrong batch, give a named
fault (never a crash, never a half-decoded batch); any valid batch decodes to what was encoded."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracetop.events import SCHEMAS, Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import DecodedBatch, Rejection, encode_batch, parse_batch, receive

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = st.sampled_from(list(Kind))
TEXT = st.text(max_size=12)  # any unicode, NUL and surrogate-free by construction of str


@st.composite
def columns(draw, kind: Kind, n: int) -> dict:
    out: dict = {}
    for col in SCHEMAS[kind]:
        if col.dtype == "str":
            out[col.name] = draw(st.lists(TEXT, min_size=n, max_size=n))
        elif col.dtype == "f8":
            out[col.name] = np.array(draw(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=n, max_size=n)), "<f8")
        else:
            lo, hi = (-(2**31), 2**31 - 1) if col.dtype == "i4" else (-(2**63), 2**63 - 1)
            out[col.name] = np.array(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), "<" + col.dtype)
    return out


@st.composite
def valid_batches(draw) -> tuple[Kind, dict, pb.ColumnBatch]:
    kind = draw(KINDS)
    n = draw(st.integers(0, 20))
    cols = draw(columns(kind, n))
    seq = draw(st.integers(1, 2**63))
    return kind, cols, encode_batch(kind, cols, source_id="fz", seq=seq, run_id="fuzz-run")


@SETTINGS
@given(st.binary(max_size=4096))
def test_any_bytes_are_a_named_rejection_or_a_batch(raw: bytes) -> None:
    got = receive(parse_batch(raw))
    assert isinstance(got, Rejection | DecodedBatch)
    if isinstance(got, Rejection):
        assert got.fault and got.message and ("tracetop-fault", got.fault) in got.metadata


@SETTINGS
@given(valid_batches())
def test_valid_batches_round_trip(b) -> None:
    kind, cols, batch = b
    got = receive(parse_batch(batch.SerializeToString()))
    assert isinstance(got, DecodedBatch) and got.kind == kind
    for spec in SCHEMAS[kind]:
        value = got.columns[spec.name]
        if spec.dtype == "str":
            codes, dictionary = value
            assert [dictionary[c] for c in codes] == list(cols[spec.name])
        else:
            np.testing.assert_array_equal(value, cols[spec.name])


MUTATIONS = {
    "n": lambda b, d: setattr(b, "n", b.n + d.draw(st.integers(1, 5))),
    "schema_version": lambda b, d: setattr(b, "schema_version", d.draw(st.integers(0, 2**31 - 1).filter(lambda v: v != b.schema_version))),
    "kind": lambda b, d: setattr(b, "kind", d.draw(st.integers(15, 2**31 - 1))),
    "run_id": lambda b, d: setattr(b, "run_id", d.draw(st.sampled_from(["", "a b", "x" * 129, "é", "a/b"]))),
    "seq": lambda b, d: setattr(b, "seq", 0),
    "crc32c": lambda b, d: setattr(b, "crc32c", (b.crc32c + d.draw(st.integers(1, 2**31))) % 2**32),
    "columns": lambda b, d: b.columns.pop(d.draw(st.integers(0, len(b.columns) - 1))),
    "column_data": lambda b, d: b.columns[d.draw(st.integers(0, len(b.columns) - 1))].MergeFrom(
        pb.Column(data=d.draw(st.binary(min_size=1, max_size=9)))),
}


@SETTINGS
@given(valid_batches(), st.sampled_from(sorted(MUTATIONS)), st.data())
def test_well_formed_but_wrong_batches_are_refused_by_name(b, what: str, data) -> None:
    kind, _, batch = b
    MUTATIONS[what](batch, data)
    got = receive(parse_batch(batch.SerializeToString()))
    assert isinstance(got, Rejection), f"a batch with a wrong {what} was accepted"
    assert got.fault and str(got.message)
