"""Codec: round trip, and each validation fault named (the collector and relay rely on these)."""

from __future__ import annotations

import numpy as np
import pytest

from tracetop.events import APPENDED_IN, OLDEST_READ_SCHEMA, SCHEMA_VERSION, SCHEMAS, Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import BatchError, decode_batch, encode_batch


def _collective_columns(n: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        "rank": rng.integers(0, 8, n),
        "step": np.arange(n),
        "start_ns": rng.integers(0, 2**62, n),
        "duration_ns": rng.integers(0, 10**9, n),
        "op": rng.choice(["all_reduce", "send", "recv"], n).tolist(),
        "role": rng.choice(["dp", "tp", "p2p:pp"], n).tolist(),
        "group_size": np.full(n, 2),
        "bytes": rng.integers(0, 2**40, n),
        "peer": np.full(n, -1),
        "dtype": ["float32"] * n,
        "is_async": np.zeros(n),
    }


def _roundtrip(batch: pb.ColumnBatch) -> pb.ColumnBatch:
    return pb.ColumnBatch.FromString(batch.SerializeToString())


def test_round_trip_keeps_every_value() -> None:
    cols = _collective_columns(1000)
    decoded = decode_batch(_roundtrip(encode_batch(Kind.COLLECTIVE, cols, source_id="s", seq=3, run_id="run-1")))
    assert (decoded.kind, decoded.n, decoded.seq, decoded.run_id) == (Kind.COLLECTIVE, 1000, 3, "run-1")
    for col in SCHEMAS[Kind.COLLECTIVE]:
        got = decoded.columns[col.name]
        if col.dtype == "str":
            codes, dictionary = got
            assert np.asarray(dictionary, dtype=object)[codes].tolist() == cols[col.name]
        else:
            np.testing.assert_array_equal(got, np.asarray(cols[col.name]))


def test_nan_survives_as_nan() -> None:
    n = 3
    cols = {c.name: (["x"] * n if c.dtype == "str" else np.full(n, np.nan if c.dtype == "f8" else 1)) for c in SCHEMAS[Kind.GPU_SAMPLE]}
    decoded = decode_batch(encode_batch(Kind.GPU_SAMPLE, cols, source_id="s", seq=1, run_id="r"))
    assert np.isnan(decoded.columns["power_mw"]).all()


def _good() -> pb.ColumnBatch:
    return _roundtrip(encode_batch(Kind.COLLECTIVE, _collective_columns(50), source_id="s", seq=1, run_id="r"))


@pytest.mark.parametrize(
    "corrupt, fault",
    [
        (lambda b: setattr(b.columns[2], "data", b.columns[2].data[:-3]), "column_length"),
        (lambda b: setattr(b, "n", b.n + 1), "column_length"),
        (lambda b: setattr(b, "crc32c", b.crc32c ^ 1), "crc32c"),
        (lambda b: setattr(b, "schema_version", SCHEMA_VERSION + 1), "schema_version"),
        (lambda b: setattr(b, "run_id", "no spaces allowed"), "run_id"),
        (lambda b: setattr(b, "source_id", ""), "source_id"),
        (lambda b: setattr(b, "seq", 0), "seq"),
        (lambda b: setattr(b, "kind", 99), "kind"),
        (lambda b: b.columns.pop(), "columns"),
        (lambda b: b.columns[4].dictionary.pop(), "dictionary"),
    ],
)
def test_each_fault_is_named(corrupt, fault: str) -> None:
    batch = _good()
    corrupt(batch)
    with pytest.raises(BatchError) as err:
        decode_batch(batch)
    assert err.value.fault == fault
    assert str(err.value)  # a sentence, not just a code


def test_flipped_payload_byte_fails_the_checksum() -> None:
    batch = _good()
    data = bytearray(batch.columns[7].data)
    data[5] ^= 0xFF
    batch.columns[7].data = bytes(data)
    with pytest.raises(BatchError, match="CRC32C"):
        decode_batch(batch)


def test_encode_refuses_missing_and_unknown_columns() -> None:
    cols = _collective_columns(2)
    del cols["op"]
    with pytest.raises(ValueError, match="lacks columns"):
        encode_batch(Kind.COLLECTIVE, cols, source_id="s", seq=1, run_id="r")
    cols = _collective_columns(2) | {"bogus": [1, 2]}
    with pytest.raises(ValueError, match="no columns"):
        encode_batch(Kind.COLLECTIVE, cols, source_id="s", seq=1, run_id="r")


def _gpu_columns(n: int) -> dict:
    return {c.name: (["node-1"] * n if c.dtype == "str" else np.arange(n) + 1) for c in SCHEMAS[Kind.GPU_SAMPLE]}


def test_a_batch_one_schema_back_is_read_with_its_missing_columns_as_nan() -> None:
    """A rolling upgrade: an agent still at the older schema (or its spool) keeps being stored."""
    added = APPENDED_IN[SCHEMA_VERSION][Kind.GPU_SAMPLE]
    batch = encode_batch(Kind.GPU_SAMPLE, _gpu_columns(4), source_id="s", seq=1, run_id="r")
    del batch.columns[len(batch.columns) - len(added):]  # what the older agent sent
    batch.schema_version = SCHEMA_VERSION - 1
    from tracetop.wire.codec import _checksum_parts
    batch.crc32c = _checksum_parts(batch.columns)
    decoded = decode_batch(_roundtrip(batch))
    assert [c.name for c in SCHEMAS[Kind.GPU_SAMPLE]] == list(decoded.columns)
    np.testing.assert_array_equal(decoded.columns["power_mw"], np.arange(4) + 1)
    for name in added:
        assert np.isnan(decoded.columns[name]).all()
    # the older schema's batch must not carry the newer columns, and older ones than that are refused
    full = encode_batch(Kind.GPU_SAMPLE, _gpu_columns(4), source_id="s", seq=1, run_id="r")
    full.schema_version = SCHEMA_VERSION - 1
    with pytest.raises(BatchError) as err:
        decode_batch(full)
    assert err.value.fault == "columns"
    batch.schema_version = OLDEST_READ_SCHEMA - 1
    with pytest.raises(BatchError) as err:
        decode_batch(batch)
    assert err.value.fault == "schema_version" and "upgrade" in str(err.value)
