"""Sealing: rows and columns taken from the intake become numbered columnar batches.

Vectorised (a few large numpy operations per batch), cut at ``MAX_BATCH_ROWS`` rows and
``BATCH_BYTES`` of column data so every message fits gRPC's default 4 MiB receive limit. Every
loss on the way (a full intake deque, a row of the wrong arity, columns that do not encode, a GAP
row a producer recorded itself) goes through the one drop ledger, and the ledger's rows leave as
this source's next GAP batch (``seal_gaps``). Plain code on the flusher thread: it holds no lock
of its own; ``next_seq`` and ``enqueue`` are the shipper's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tracetop.events import SCHEMAS, Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import concat_columns, dict_encode, encode_batch
from tracetop.wire.intake import Taken
from tracetop.wire.ledger import DropLedger

MiB = 1 << 20
#: A sealed batch never holds more rows than this, nor more than BATCH_BYTES of column data, so
#: every message fits gRPC's default 4 MiB receive limit with room to spare.
MAX_BATCH_ROWS = 65536
BATCH_BYTES = 3 * MiB


def rows_per_batch(kind: Kind, budget_bytes: int = BATCH_BYTES) -> int:
    """The most rows of ``kind`` one batch holds within ``budget_bytes`` (and the caps above)."""
    row_bytes = sum(8 if c.dtype in ("i8", "f8") else 4 for c in SCHEMAS[kind])
    return max(1, min(MAX_BATCH_ROWS, min(BATCH_BYTES, budget_bytes) // row_bytes))


class Sealer:
    """Turns what the intake hands over into batches of one source, and hands each to ``enqueue``.

    Args:
        source_id / run_id / rank: stamped on every batch (rank only on GAP rows).
        ledger: the one drop funnel (tracetop/wire/ledger.py).
        next_seq: the source's next sequence number (the shipper's counter, under its lock).
        enqueue: takes a sealed batch (into the outbox, and the spool where there is one).
        warn_once: ``(key, message)``, logged the first time a key is seen.
        budget_bytes: no batch bigger than this (an eighth of the unacked bound).
        clock_ns: the wall clock for GAP rows.
    """

    def __init__(self, *, source_id: str, run_id: str, rank: int, ledger: DropLedger, epoch: int = 0,
                 next_seq: Callable[[], int], enqueue: Callable[[pb.ColumnBatch], object],
                 warn_once: Callable[[str, str], None], budget_bytes: int, clock_ns: Callable[[], int]) -> None:
        self.source_id = source_id
        self.epoch = epoch  # this shipper start's (ColumnBatch.epoch)
        self.run_id = run_id
        self.rank = rank
        self._ledger = ledger
        self._next_seq = next_seq
        self._enqueue = enqueue
        self._warn_once = warn_once
        self._budget_bytes = budget_bytes
        self._clock_ns = clock_ns
        self.batches_sealed = 0
        self.gap_rows = 0

    def seal(self, taken: Taken) -> None:
        """Seal one pass's take, then the ledger's gap rows."""
        for kind, count in taken.overflow.items():
            self._ledger.note(kind.name.lower(), "queue_full", self.source_id, count)
        for kind, rows, first_ns in taken.rows:
            if kind == Kind.GAP:
                self.fold_gap_rows(rows)
                continue
            step = rows_per_batch(kind, self._budget_bytes)
            for i in range(0, len(rows), step):
                self._seal_rows(kind, rows[i : i + step], first_ns)
        merged: dict[Kind, tuple[list[Mapping[str, Any]], int]] = {}
        for kind, columns, first_ns in taken.columns:
            if kind == Kind.GAP:
                self.fold_gap_rows(column_rows(columns))
                continue
            merged.setdefault(kind, ([], first_ns))[0].append(columns)
        for kind, (parts, first_ns) in merged.items():
            self._seal_parts(kind, parts, first_ns)
        self.seal_gaps()

    def _seal_rows(self, kind: Kind, rows: list[tuple], first_ns: int) -> None:
        schema = SCHEMAS[kind]
        transposed = list(zip(*rows))
        if len(transposed) != len(schema):
            self._warn_once(
                f"arity-{kind}",
                f"tracetop: {kind.name} rows have {len(transposed)} values, the schema has {len(schema)}; "
                f"dropping {len(rows)} rows (see tracetop/events.py)",
            )
            self._ledger.note(kind.name.lower(), "bad_row", self.source_id, len(rows))
            return
        columns = {}
        for col, values in zip(schema, transposed):
            columns[col.name] = dict_encode(values) if col.dtype == "str" else np.asarray(values)
        self.seal_columns(kind, columns, first_ns)

    def _seal_parts(self, kind: Kind, parts: list[Mapping[str, Any]], first_ns: int) -> None:
        """Every ``record_many`` of a kind since the last seal goes out as one batch (cut at the
        row and byte caps), not one each: the emitter hands over a few times per flush interval,
        and each gRPC message costs the process 0.3-0.9 ms of CPU (docs/benchmarks.md, the hooks' cost)."""
        if len(parts) > 1:
            try:
                parts = [concat_columns(kind, parts)]
            except (KeyError, ValueError, TypeError, IndexError):
                pass  # seal them one by one: the faulty part is dropped and counted there
        for columns in parts:
            self.seal_columns(kind, columns, first_ns)

    def seal_columns(self, kind: Kind, columns: Mapping[str, Any], first_ns: int) -> None:
        n = len(next(iter(columns.values())))
        step = rows_per_batch(kind, self._budget_bytes)
        for start in range(0, n, step):
            part = columns if n <= step else {k: _slice(v, start, step) for k, v in columns.items()}
            seq = self._next_seq()
            try:
                batch = encode_batch(kind, part, source_id=self.source_id, seq=seq, run_id=self.run_id,
                                     first_record_ns=first_ns, epoch=self.epoch)
            except (ValueError, TypeError, OverflowError) as e:
                self._warn_once(f"encode-{kind}", f"tracetop: cannot encode {kind.name} rows, dropping them: {e}")
                self._ledger.note(kind.name.lower(), "bad_row", self.source_id, min(step, n - start))
                continue  # the seq is skipped; receivers accept skips
            self.batches_sealed += 1
            self._enqueue(batch)

    def fold_gap_rows(self, rows: list) -> None:
        """GAP rows a producer recorded itself (the agent relay's ``spool_full``) go through the
        ledger like every other loss: counted, and shipped in this source's next gap batch."""
        width = len(SCHEMAS[Kind.GAP])
        bad = 0
        for row in rows:
            try:
                if len(row) != width:
                    raise ValueError(row)
                _rank, _step, _start_ns, _duration_ns, kind, dropped, reason, origin = row
                self._ledger.note(str(kind), str(reason), str(origin), int(dropped))
            except (TypeError, ValueError):
                bad += 1
        if bad:
            self._warn_once("arity-GAP", f"tracetop: {bad} GAP rows do not fit the schema (see tracetop/events.py); dropped")
            self._ledger.note("gap", "bad_row", self.source_id, bad)

    def seal_gaps(self) -> None:
        now = self._clock_ns()
        cols = self._ledger.columns(now, self.rank)
        if cols is None:
            return
        self.gap_rows += len(cols["dropped"])
        batch = encode_batch(Kind.GAP, cols, source_id=self.source_id, seq=self._next_seq(), run_id=self.run_id,
                             first_record_ns=now, epoch=self.epoch)
        self._enqueue(batch)


def column_rows(columns: Mapping[str, Any]) -> list[tuple]:
    """``record_many`` GAP columns back into rows (strings decoded), in schema order."""
    out = []
    for col in SCHEMAS[Kind.GAP]:
        v = columns.get(col.name, ())
        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], np.ndarray):
            v = [v[1][c] for c in v[0].tolist()]
        out.append(list(v.tolist() if isinstance(v, np.ndarray) else v))
    return list(zip(*out))


def _slice(v: Any, start: int, count: int) -> Any:
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], np.ndarray):
        return (v[0][start : start + count], v[1])
    return v[start : start + count]
