"""Columnar batches: numpy columns <-> tracetop.v1.ColumnBatch, with every check a receiver needs.

`encode_batch` is used by the shipper's flusher (never on a training thread's hot path);
`decode_batch` by every receiver (collector, agent relay) before it touches anything. Decoding
checks, in order: schema version, kind, run id and source id, n, column names and lengths
against n * itemsize, dictionary codes in range, and the CRC32C. Any fault raises BatchError
naming it; nothing is returned half-decoded.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import crc32c as _crc32c
import numpy as np

from tracetop.errors import TracetopError
from tracetop.events import NUMPY_DTYPES, OLDEST_READ_SCHEMA, SCHEMA_VERSION, SCHEMAS, Kind, columns_of
from tracetop.wire import tracetop_pb2 as pb

#: run, source and node ids: 1-128 of [A-Za-z0-9._:-], not "." or ".." (they name folders: the
#: spool's, the relay's) and nothing after the last character (``$`` would let "run1\n" through).
ID_RE = re.compile(r"(?!\.{1,2}\Z)[A-Za-z0-9._:\-]{1,128}\Z")
#: How far ahead of its source's high-water mark a batch's seq may be. Seqs may skip (a shipper
#: drops batches it cannot keep), but never by millions; a seq further ahead is refused (fault
#: ``seq_ahead``), not believed: believing it would make every later batch of the source a
#: "duplicate", acked and dropped.
MAX_SEQ_AHEAD = 1 << 24


def source_key(source_id: str, epoch: int) -> str:
    """The receiver's key for one start of a source: its id, and its epoch when it has one
    ("@" is not in ids, so a key never equals another source's id)."""
    return f"{source_id}@{epoch:x}" if epoch else source_id


def source_of_key(key: str) -> str:
    return key.partition("@")[0]


def seq_ahead(source_id: str, epoch: int, seq: int, hwm: int) -> Rejection | None:
    """The Rejection for a seq too far ahead of its source's mark ``hwm`` (None: within reach)."""
    if seq <= hwm + MAX_SEQ_AHEAD:
        return None
    fault = "seq_ahead"
    return Rejection(
        fault,
        f"batch {source_id}/{seq} (epoch {epoch:x}) is {seq - hwm} seqs ahead of what was stored of its source "
        f"(seq {hwm}); more than {MAX_SEQ_AHEAD} ahead is refused, not believed. A shipper numbers its batches "
        "from 1 at each start: restart it (a new epoch), and check that nothing else sends as this source",
        (("tracetop-fault", fault), ("tracetop-rejected-source", source_id), ("tracetop-rejected-seq", str(seq)),
         ("tracetop-rejected-epoch", str(epoch))),
    )
MAX_ROWS = 1 << 22  # 4M rows a batch: far above any shipper's batch size


class BatchError(TracetopError, ValueError):
    """A batch failed validation. `fault` is a short machine-readable name, str() explains."""

    def __init__(self, fault: str, message: str) -> None:
        super().__init__(message)
        self.fault = fault


@dataclass(frozen=True)
class DecodedBatch:
    """A validated batch. Numeric columns are numpy arrays (views on the message bytes);
    string columns are (int32 codes, tuple of strings)."""

    kind: Kind
    run_id: str
    source_id: str
    seq: int
    n: int
    columns: dict[str, np.ndarray | tuple[np.ndarray, tuple[str, ...]]]
    first_record_ns: int
    sealed_ns: int
    nbytes: int
    epoch: int = 0  # the shipper start that sealed it (0: a sender without epochs)

    @property
    def key(self) -> str:
        """The receiver's key for its source: ``source_key(source_id, epoch)``."""
        return source_key(self.source_id, self.epoch)


def _checksum_parts(columns: Sequence[pb.Column], datas: Sequence[bytes] | None = None) -> int:
    """The batch's CRC32C. ``datas``: the columns' data already read (each read of a bytes field
    of a parsed message copies it: upb hands out a new bytes object every time)."""
    crc = 0
    for i, c in enumerate(columns):
        crc = _crc32c.crc32c(c.name.encode(), crc)
        crc = _crc32c.crc32c(c.data if datas is None else datas[i], crc)
        for s in c.dictionary:
            crc = _crc32c.crc32c(s.encode() + b"\0", crc)
    return crc


def dict_encode(values: Sequence[str] | np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Strings -> (int32 codes, dictionary in order of first appearance).

    A dict lookup per value (~50 ns a row, measured) beats the "vectorised" np.unique on an
    object array (~570 ns: it sorts with Python comparisons) or on a fixed-width unicode array
    (~260 ns, most of it the conversion). Telemetry strings are few and repeat a lot."""
    index: dict[str, int] = {}
    codes = [index.setdefault(v if type(v) is str else str(v), len(index)) for v in values]
    return np.fromiter(codes, dtype="<i4", count=len(codes)), list(index)


def _is_encoded(value: object) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], np.ndarray)


def concat_columns(kind: Kind, parts: Sequence[Mapping[str, object]]) -> dict[str, object]:
    """Several column sets of one kind -> one, in order (what `encode_batch` accepts).

    String columns (lists of str or ready ``(codes, dictionary)`` pairs) get one merged
    dictionary, each part's codes remapped into it. Raises KeyError/ValueError/IndexError when a
    part lacks a column or its codes fall outside its dictionary."""
    out: dict[str, object] = {}
    for col in SCHEMAS[kind]:
        values = [p[col.name] for p in parts]
        if col.dtype == "str":
            index: dict[str, int] = {}
            codes = []
            for v in values:
                pair = cast(tuple[Any, list[str]], v) if _is_encoded(v) else dict_encode(cast(Any, v))
                c, d = pair
                remap = np.fromiter((index.setdefault(s, len(index)) for s in d), "<i4", len(d))
                c = np.asarray(c, np.intp)
                if len(c) and (c.min() < 0 or c.max() >= len(d)):
                    raise IndexError(f"concat_columns: {kind.name}.{col.name} codes outside their dictionary")
                codes.append(remap[c] if len(c) else np.zeros(0, "<i4"))
            out[col.name] = (np.concatenate(codes).astype("<i4", copy=False), list(index))
        else:
            out[col.name] = np.concatenate([np.asarray(v, NUMPY_DTYPES[col.dtype]).reshape(-1) for v in values])
    return out


def encode_batch(
    kind: Kind,
    columns: Mapping[str, object],
    *,
    source_id: str,
    seq: int,
    run_id: str,
    first_record_ns: int = 0,
    epoch: int = 0,
) -> pb.ColumnBatch:
    """Build a ColumnBatch from columns keyed by name (every column of the kind's schema).

    Numeric columns: anything np.asarray accepts; they are cast to the contract's dtype.
    String columns: a sequence of str, or a ready (codes, dictionary) pair.
    """
    schema = SCHEMAS[kind]
    missing = [c.name for c in schema if c.name not in columns]
    if missing:
        raise ValueError(f"encode_batch: {kind.name} batch lacks columns {missing}")
    extra = sorted(set(columns) - {c.name for c in schema})
    if extra:
        raise ValueError(f"encode_batch: {kind.name} has no columns {extra}; see tracetop/events.py")
    n = None
    out = []
    datas: list[bytes] = []
    for col in schema:
        value: Any = columns[col.name]
        dictionary: list[str] = []
        if col.dtype == "str":
            if _is_encoded(value):
                codes, dictionary = np.asarray(value[0], dtype="<i4"), list(value[1])
            else:
                codes, dictionary = dict_encode(value)
            arr = codes
        else:
            arr = np.asarray(value, dtype=NUMPY_DTYPES[col.dtype])
        if arr.ndim != 1:
            raise ValueError(f"encode_batch: column {col.name} must be 1-D, got shape {arr.shape}")
        if n is None:
            n = len(arr)
        elif len(arr) != n:
            raise ValueError(f"encode_batch: column {col.name} has {len(arr)} rows, expected {n}")
        datas.append(np.ascontiguousarray(arr).tobytes())
        out.append(pb.Column(name=col.name, data=datas[-1], dictionary=dictionary))
    batch = pb.ColumnBatch(
        schema_version=SCHEMA_VERSION,
        source_id=source_id,
        seq=seq,
        run_id=run_id,
        kind=cast(Any, int(kind)),
        n=n or 0,
        columns=out,
        first_record_ns=first_record_ns,
        sealed_ns=time.time_ns(),
        epoch=epoch,
    )
    batch.crc32c = _checksum_parts(batch.columns, datas)
    return batch


def decode_batch(batch: pb.ColumnBatch) -> DecodedBatch:
    """Validate a received batch and view its columns as numpy arrays. Raises BatchError."""
    if not OLDEST_READ_SCHEMA <= batch.schema_version <= SCHEMA_VERSION:
        raise BatchError(
            "schema_version",
            f"batch from source {batch.source_id!r} has schema {batch.schema_version}, this side reads "
            f"{OLDEST_READ_SCHEMA} to {SCHEMA_VERSION}; upgrade the collector (a newer sender) or the "
            "trainers and agents (an older one) so they are at most one schema apart",
        )
    try:
        kind = Kind(batch.kind)
    except ValueError:
        raise BatchError("kind", f"batch from source {batch.source_id!r} has unknown event kind {batch.kind}") from None
    if not ID_RE.match(batch.run_id):
        raise BatchError("run_id", f"run id {batch.run_id!r} is not 1-128 chars of [A-Za-z0-9._:-]; set TRACETOP_RUN_ID")
    if not ID_RE.match(batch.source_id):
        raise BatchError("source_id", f"source id {batch.source_id!r} is not 1-128 chars of [A-Za-z0-9._:-]")
    if batch.seq < 1:
        raise BatchError("seq", f"batch from source {batch.source_id!r} has seq {batch.seq}; seqs start at 1")
    n = batch.n
    if n > MAX_ROWS:
        raise BatchError("n", f"batch claims {n} rows; the limit is {MAX_ROWS}")
    schema = columns_of(kind, batch.schema_version)
    names = [c.name for c in batch.columns]
    if names != [c.name for c in schema]:
        raise BatchError(
            "columns",
            f"{kind.name} batch has columns {names}, the contract (schema {batch.schema_version}) says "
            f"{[c.name for c in schema]}",
        )
    cols: dict[str, np.ndarray | tuple[np.ndarray, tuple[str, ...]]] = {}
    nbytes = 0
    datas: list[bytes] = []  # each column's data, read once (a read copies it) and viewed, not copied again
    for spec, col in zip(schema, batch.columns):
        dtype = np.dtype(NUMPY_DTYPES[spec.dtype])
        expected = n * dtype.itemsize
        data = col.data
        datas.append(data)
        if len(data) != expected:
            raise BatchError(
                "column_length",
                f"{kind.name} column {spec.name!r} holds {len(data)} bytes, n={n} needs {expected}",
            )
        arr = np.frombuffer(data, dtype=dtype)
        nbytes += expected
        if spec.dtype == "str":
            d = tuple(col.dictionary)
            if n and (arr.min() < 0 or arr.max() >= len(d)):
                raise BatchError("dictionary", f"{kind.name} column {spec.name!r} has codes outside its dictionary")
            cols[spec.name] = (arr, d)
        else:
            cols[spec.name] = arr
    for spec in SCHEMAS[kind][len(schema):]:  # appended since the sender's schema: floats, NaN
        cols[spec.name] = np.full(n, np.nan)
    if _checksum_parts(batch.columns, datas) != batch.crc32c:
        raise BatchError("crc32c", f"batch {batch.source_id}/{batch.seq}: CRC32C mismatch, the payload is corrupt")
    return DecodedBatch(
        kind=kind,
        run_id=batch.run_id,
        source_id=batch.source_id,
        seq=batch.seq,
        n=n,
        columns=cols,
        first_record_ns=batch.first_record_ns,
        sealed_ns=batch.sealed_ns,
        nbytes=nbytes,
        epoch=batch.epoch,
    )


# ---- the receiving side (collector and agent relay): one place decides what a batch is ----


@dataclass(frozen=True)
class Undecodable:
    """What `parse_batch` yields for bytes that are not a ColumnBatch."""

    size: int
    why: str


def parse_batch(raw: bytes) -> pb.ColumnBatch | Undecodable:
    """gRPC request deserializer for Ingest.Stream: parse failures become a marker, so the
    receiver answers INVALID_ARGUMENT naming them rather than gRPC's opaque INTERNAL."""
    from google.protobuf.message import DecodeError

    try:
        return pb.ColumnBatch.FromString(raw)
    except DecodeError as e:
        return Undecodable(len(raw), str(e))


@dataclass(frozen=True)
class Rejection:
    """Why a received message is refused: INVALID_ARGUMENT "<fault>: <message>" with `metadata`
    as trailing metadata (tracetop-fault, and tracetop-rejected-source/-seq when they are known)."""

    fault: str
    message: str
    metadata: tuple[tuple[str, str], ...]


def receive(raw: pb.ColumnBatch | Undecodable) -> DecodedBatch | Rejection:
    """Validate one received message: a DecodedBatch, or the Rejection to answer with."""
    if isinstance(raw, Undecodable):
        fault = "not_a_batch"
        return Rejection(fault, f"not a tracetop.v1.ColumnBatch ({raw.size} bytes: {raw.why})", (("tracetop-fault", fault),))
    try:
        return decode_batch(raw)
    except BatchError as e:
        which: tuple[tuple[str, str], ...] = (("tracetop-fault", e.fault),)
        if ID_RE.match(raw.source_id):
            which += (("tracetop-rejected-source", raw.source_id), ("tracetop-rejected-seq", str(raw.seq)),
                      ("tracetop-rejected-epoch", str(raw.epoch)))
        return Rejection(e.fault, str(e), which)
