"""The shipper: the one client every producer uses to get events to a collector (or an agent).

Three promises (DESIGN §4):

* **The caller never waits.** ``record()`` appends a tuple to a bounded per-kind deque under a
  lock that is only ever held for an append or a swap; no protobuf, no I/O, no allocation beyond
  the tuple. When a kind's buffer is full the oldest rows are dropped and counted.
* **Nothing is lost silently.** A flusher thread turns buffered rows into columnar batches
  (vectorised, a few large numpy operations per batch), numbers them per source (``seq``), and
  keeps each one until the receiver acks it (cumulative acks). After a reconnect everything
  unacked is resent; the receiver drops duplicates. Every drop — a full buffer, the unacked
  budget exceeded, a batch the receiver refused — becomes a GAP row that is itself shipped.
* **Bounded memory, optional disk spool.** Unacked batches are bounded by ``max_unacked_bytes``
  (oldest own batches dropped first, with a gap row). With ``spool_dir`` every batch is written
  to disk before it counts as accepted (``forward`` returns only then: the agent acks hooks on
  that), survives a kill -9, and is replayed on the next start.

Transports: gRPC (``Ingest.Stream``) by default; ``MemoryTransport`` for tests and in-process use.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracetop.events import SCHEMAS, Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import concat_columns, decode_batch, dict_encode, encode_batch

log = logging.getLogger("tracetop.shipper")

MiB = 1 << 20
#: gRPC message cap used by the default channel (the collector's default max is 64 MiB).
MAX_MESSAGE_BYTES = 64 * MiB
#: A sealed batch never holds more rows than this, nor more than BATCH_BYTES of column data, so
#: every message fits gRPC's default 4 MiB receive limit with room to spare.
MAX_BATCH_ROWS = 65536
BATCH_BYTES = 3 * MiB


def _rows_per_batch(kind: Kind, budget_bytes: int = BATCH_BYTES) -> int:
    row_bytes = sum(8 if c.dtype in ("i8", "f8") else 4 for c in SCHEMAS[kind])
    return max(1, min(MAX_BATCH_ROWS, min(BATCH_BYTES, budget_bytes) // row_bytes))

_GAP_COLUMNS = [c.name for c in SCHEMAS[Kind.GAP]]


@dataclass
class _Entry:
    source_id: str
    seq: int
    kind: int
    n: int
    nbytes: int
    batch: pb.ColumnBatch | None  # None when only the spool file holds it
    spool_path: Path | None
    own: bool
    idx: int = 0  # enqueue order; flush() waits for every entry up to an index
    sent_epoch: int = -1  # the connection it was last sent on


@dataclass
class ShipperStats:
    recorded: int = 0
    batches_sealed: int = 0
    batches_sent: int = 0
    batches_acked: int = 0
    rows_acked: int = 0
    rows_dropped: int = 0
    batches_dropped: int = 0
    batches_rejected: int = 0
    gap_rows: int = 0
    spool_full: int = 0
    reconnects: int = 0
    unacked_batches: int = 0
    unacked_bytes: int = 0
    spool_bytes: int = 0
    connected: bool = False
    last_error: str = ""
    dropped_by_reason: dict[str, int] = field(default_factory=dict)


class MemoryTransport:
    """An in-process receiver: validates and keeps every batch, acks at once.

    For tests and for tools that want the rows without a collector. ``rows(kind)`` returns the
    columns of every batch of that kind concatenated (strings decoded)."""

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self._lock = threading.Lock()

    def send(self, batch: pb.ColumnBatch) -> None:
        decoded = decode_batch(batch)
        with self._lock:
            self.batches.append(decoded)

    def rows(self, kind: Kind) -> dict[str, np.ndarray]:
        with self._lock:
            got = [b for b in self.batches if b.kind == kind]
        out: dict[str, np.ndarray] = {}
        for col in SCHEMAS[kind]:
            parts = []
            for b in got:
                v = b.columns[col.name]
                if isinstance(v, tuple):
                    codes, dictionary = v
                    parts.append(np.asarray(dictionary, dtype=object)[codes] if len(dictionary) else np.zeros(0, object))
                else:
                    parts.append(v)
            out[col.name] = np.concatenate(parts) if parts else np.zeros(0)
        return out


def default_channel(target: str):  # -> grpc.Channel
    import grpc

    return grpc.insecure_channel(
        target,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ],
    )


class Shipper:
    """Batches, numbers, ships, spools and resends events of one source.

    Args:
        endpoint: a collector or agent address (``host:port`` or ``unix:///path``).
        run_id: the run every event belongs to.
        source_id: this producer's id (default: a fresh uuid-based id).
        rank: put into this source's GAP rows (-1 for node-level producers).
        flush_rows / flush_interval_s: seal a kind's buffer at this many rows or this age.
        max_pending_rows: per-kind buffer bound; beyond it the oldest rows are dropped and counted.
        max_unacked_bytes: memory bound on sealed-but-unacked batches.
        spool_dir / spool_max_bytes: durable spool (agent); replayed at start.
        transport: None for gRPC to ``endpoint``, or an object with ``send(batch)`` (MemoryTransport).
        channel_factory: builds the gRPC channel (tests may inject options).
        clock_ns: wall clock in ns (injectable).
        burst_linger_s: a stream stays open this long after its last batch for more, then
            half-closes; the next batch opens a new one. None: one stream held open throughout.
    """

    def __init__(
        self,
        endpoint: str | None,
        *,
        run_id: str,
        source_id: str | None = None,
        rank: int = -1,
        flush_rows: int = 4096,
        flush_interval_s: float = 0.25,
        max_pending_rows: int = 1 << 20,
        max_unacked_bytes: int = 256 * MiB,
        spool_dir: str | os.PathLike[str] | None = None,
        spool_max_bytes: int = 1 << 30,
        spool_fsync: bool = True,
        transport: Any = None,
        channel_factory: Callable[[str], Any] = default_channel,
        clock_ns: Callable[[], int] = time.time_ns,
        reconnect_max_s: float = 1.0,
        burst_linger_s: float = 0.1,
    ) -> None:
        if transport is None and not endpoint:
            raise ValueError("Shipper: no endpoint; pass one or set TRACETOP_ENDPOINT (e.g. 127.0.0.1:7000)")
        self.endpoint = endpoint
        self.run_id = run_id
        self.source_id = source_id or f"src-{uuid.uuid4().hex[:16]}"
        self.rank = rank
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.max_unacked_bytes = max_unacked_bytes
        self._transport = transport
        self._channel_factory = channel_factory
        self._clock_ns = clock_ns
        self._reconnect_max_s = reconnect_max_s
        self.burst_linger_s = burst_linger_s

        # --- producer side: guarded by _lock, held only for append / swap ---
        self._lock = threading.Lock()
        self._max_pending = max_pending_rows
        self._pending: dict[Kind, collections.deque] = {k: collections.deque(maxlen=max_pending_rows) for k in Kind}
        self._first_ns: dict[Kind, int] = {}
        self._overflow: dict[Kind, int] = dict.fromkeys(Kind, 0)
        self._bulk: list[tuple[Kind, Mapping[str, Any], int]] = []
        self._bulk_rows = 0

        # --- outbox: guarded by _cv ---
        self._cv = threading.Condition()
        self._unacked: collections.OrderedDict[tuple[str, int], _Entry] = collections.OrderedDict()
        self._by_source: dict[str, collections.deque] = {}
        self._to_send: collections.deque = collections.deque()
        self._unacked_bytes = 0
        self._mem_bytes = 0
        self._epoch = 0
        self._seq = 0
        self._enq_counter = 0
        self._gap_pending: dict[tuple[str, str, str], int] = {}  # (kind, reason, origin) -> count
        self._limbo: dict[str, dict[int, _Entry]] = {}  # dropped while in flight: source -> seq -> entry
        self.stats_ = ShipperStats()

        self._seal_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set when a buffer reaches flush_rows or bulk columns arrive
        self._ship_now = False  # ship_soon(): the flusher's next pass seals everything
        self._closing = False
        self._warned: set[str] = set()

        self._spool: _Spool | None = None
        #: source -> highest seq found on the spool at start (what a killed predecessor had accepted).
        self.replayed_high_water: dict[str, int] = {}
        if spool_dir is not None:
            self._spool = _Spool(Path(spool_dir), spool_max_bytes, spool_fsync)
            self._replay_spool()

        self._flusher = threading.Thread(target=self._run_flusher, name="tracetop-flusher", daemon=True)
        self._sender = threading.Thread(target=self._run_sender, name="tracetop-sender", daemon=True)
        self._flusher.start()
        self._sender.start()

    # ------------------------------------------------------------------ producer API
    def record(self, kind: Kind, *row: Any) -> None:
        """Append one row (columns in tracetop.events.SCHEMAS[kind] order). Never blocks."""
        with self._lock:
            q = self._pending[kind]
            if len(q) == self._max_pending:
                self._overflow[kind] += 1
            elif not q:
                self._first_ns[kind] = self._clock_ns()
            q.append(row)
            if len(q) == self.flush_rows:
                self._wake.set()  # once per batch: seal it now rather than at the next tick

    def record_many(self, kind: Kind, columns: Mapping[str, Any]) -> None:
        """Queue whole columns (numpy arrays, or lists of str for string columns) as rows."""
        n = len(next(iter(columns.values())))
        if n == 0:
            return
        with self._lock:
            self._bulk.append((kind, columns, self._clock_ns()))
            self._bulk_rows += n
            full = self._bulk_rows >= self.flush_rows
        if full:
            self._wake.set()

    def forward(self, batch: pb.ColumnBatch) -> bool:
        """Relay a batch sealed elsewhere, keeping its source_id and seq. With a spool, returns
        only once the batch is on disk; returns False (and counts it) when the spool is full."""
        return self._enqueue(batch, own=False)

    def ship_soon(self) -> None:
        """Seal everything recorded so far on the flusher thread now, without waiting for acks
        (the hooks call it with each heartbeat: liveness arrives at once, in the same shipment)."""
        self._ship_now = True
        self._wake.set()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Seal everything recorded so far and wait until it is acked. True if it was."""
        self._seal(force=True)
        deadline = time.monotonic() + timeout_s
        with self._cv:
            target = self._enq_counter
            while self._unacked and next(iter(self._unacked.values())).idx <= target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush for up to timeout_s, then stop. Unacked batches without a spool are reported lost."""
        if self._closing:
            return
        ok = self.flush(timeout_s)
        self._closing = True
        self._stop.set()
        self._wake.set()
        with self._cv:
            self._epoch += 1
            self._cv.notify_all()
        self._flusher.join(timeout=2.0)
        self._sender.join(timeout=2.0)
        if not ok and self._spool is None:
            with self._cv:
                rows = sum(e.n for e in self._unacked.values())
            if rows:
                log.warning(
                    "tracetop: %d events of source %s were not acked by %s before close; they are lost",
                    rows, self.source_id, self.endpoint,
                )

    def stats(self) -> dict[str, Any]:
        with self._cv:
            s = self.stats_
            s.unacked_batches = len(self._unacked)
            s.unacked_bytes = self._unacked_bytes
            s.spool_bytes = self._spool.bytes if self._spool else 0
            d = dict(s.__dict__)
            d["dropped_by_reason"] = dict(s.dropped_by_reason)
        with self._lock:
            d["pending_rows"] = sum(len(q) for q in self._pending.values()) + sum(
                len(next(iter(cols.values()))) for _, cols, _ in self._bulk
            )
        return d

    # ------------------------------------------------------------------ sealing
    def _has_pending(self) -> bool:
        return bool(self._bulk or self._gap_pending or any(self._pending.values()))

    def _run_flusher(self) -> None:
        busy_tick = max(0.01, self.flush_interval_s / 4)
        tick = busy_tick
        while True:
            self._wake.wait(tick)
            self._wake.clear()
            if self._stop.is_set():
                return
            # Idle: wake once per flush interval (a first record then waits at most that long).
            tick = busy_tick if self._has_pending() else self.flush_interval_s
            force, self._ship_now = self._ship_now, False
            try:
                self._seal(force=force)
            except Exception as e:  # never let the flusher die: count, log once, go on
                self._warn_once("flusher", f"tracetop: shipper flusher error (continuing): {e!r}")

    def _seal(self, force: bool) -> None:
        with self._seal_lock:
            now = self._clock_ns()
            due: list[tuple[Kind, list, int]] = []
            with self._lock:
                for kind, q in self._pending.items():
                    if not q:
                        continue
                    age_s = (now - self._first_ns.get(kind, now)) / 1e9
                    if force or len(q) >= self.flush_rows or age_s >= self.flush_interval_s:
                        self._pending[kind] = collections.deque(maxlen=self._max_pending)
                        due.append((kind, list(q), self._first_ns.pop(kind, now)))
                bulk: list[tuple[Kind, Mapping[str, Any], int]] = []
                if self._bulk and (
                    force or self._bulk_rows >= self.flush_rows or (now - self._bulk[0][2]) / 1e9 >= self.flush_interval_s
                ):
                    bulk, self._bulk, self._bulk_rows = self._bulk, [], 0
                overflow = {k: v for k, v in self._overflow.items() if v}
                for k in overflow:
                    self._overflow[k] = 0
            for kind, count in overflow.items():
                self._note_drop(kind.name.lower(), "queue_full", self.source_id, count)
            for kind, rows, first_ns in due:
                step = _rows_per_batch(kind, self.max_unacked_bytes // 8)
                for i in range(0, len(rows), step):
                    self._seal_rows(kind, rows[i : i + step], first_ns)
            merged: dict[Kind, tuple[list[Mapping[str, Any]], int]] = {}
            for kind, columns, first_ns in bulk:
                merged.setdefault(kind, ([], first_ns))[0].append(columns)
            for kind, (parts, first_ns) in merged.items():
                self._seal_bulk(kind, parts, first_ns)
            self._seal_gaps()

    def _seal_rows(self, kind: Kind, rows: list[tuple], first_ns: int) -> None:
        schema = SCHEMAS[kind]
        transposed = list(zip(*rows))
        if len(transposed) != len(schema):
            self._warn_once(
                f"arity-{kind}",
                f"tracetop: {kind.name} rows have {len(transposed)} values, the schema has {len(schema)}; "
                f"dropping {len(rows)} rows (see tracetop/events.py)",
            )
            self._note_drop(kind.name.lower(), "bad_row", self.source_id, len(rows))
            return
        columns = {}
        for col, values in zip(schema, transposed):
            columns[col.name] = dict_encode(values) if col.dtype == "str" else np.asarray(values)
        self._seal_columns(kind, columns, first_ns)

    def _seal_bulk(self, kind: Kind, parts: list[Mapping[str, Any]], first_ns: int) -> None:
        """Every ``record_many`` of a kind since the last seal goes out as one batch (cut at the
        row and byte caps), not one each: the emitter hands over a few times per flush interval,
        and each gRPC message costs the process 0.3-0.9 ms of CPU (trainer_hooks/README.md "Cost")."""
        if len(parts) > 1:
            try:
                parts = [concat_columns(kind, parts)]
            except (KeyError, ValueError, TypeError, IndexError):
                pass  # seal them one by one: the faulty part is dropped and counted there
        for columns in parts:
            self._seal_columns(kind, columns, first_ns)

    def _seal_columns(self, kind: Kind, columns: Mapping[str, Any], first_ns: int) -> None:
        n = len(next(iter(columns.values())))
        step = _rows_per_batch(kind, self.max_unacked_bytes // 8)
        for start in range(0, n, step):
            part = columns if n <= step else {k: _slice(v, start, step) for k, v in columns.items()}
            with self._cv:
                self._seq += 1
                seq = self._seq
            try:
                batch = encode_batch(kind, part, source_id=self.source_id, seq=seq, run_id=self.run_id, first_record_ns=first_ns)
            except (ValueError, TypeError, OverflowError) as e:
                self._warn_once(f"encode-{kind}", f"tracetop: cannot encode {kind.name} rows, dropping them: {e}")
                self._note_drop(kind.name.lower(), "bad_row", self.source_id, min(step, n - start))
                continue  # the seq is skipped; receivers accept skips
            self.stats_.batches_sealed += 1
            self._enqueue(batch, own=True)

    def _note_drop(self, kind: str, reason: str, origin: str, count: int) -> None:
        with self._cv:
            key = (kind, reason, origin)
            self._gap_pending[key] = self._gap_pending.get(key, 0) + count
            self.stats_.rows_dropped += count if kind != "batch" else 0
            self.stats_.dropped_by_reason[reason] = self.stats_.dropped_by_reason.get(reason, 0) + count

    def _seal_gaps(self) -> None:
        with self._cv:
            gaps, self._gap_pending = self._gap_pending, {}
        if not gaps:
            return
        now = self._clock_ns()
        n = len(gaps)
        cols = {
            "rank": np.full(n, self.rank, "<i4"),
            "step": np.full(n, -1, "<i8"),
            "start_ns": np.full(n, now, "<i8"),
            "duration_ns": np.zeros(n, "<i8"),
            "kind": [k for k, _, _ in gaps],
            "dropped": np.fromiter(gaps.values(), "<i8", n),
            "reason": [r for _, r, _ in gaps],
            "origin_source": [o for _, _, o in gaps],
        }
        self.stats_.gap_rows += n
        with self._cv:
            self._seq += 1
            seq = self._seq
        batch = encode_batch(Kind.GAP, cols, source_id=self.source_id, seq=seq, run_id=self.run_id, first_record_ns=now)
        self._enqueue(batch, own=True)

    # ------------------------------------------------------------------ outbox
    def _enqueue(self, batch: pb.ColumnBatch, own: bool) -> bool:
        nbytes = batch.ByteSize()
        spool_path = None
        with self._cv:
            if (batch.source_id, batch.seq) in self._unacked:
                return True  # already held (and spooled): a resend, not new data
        if self._spool is not None:
            spool_path = self._spool.write(batch, nbytes)
            if spool_path is None:
                with self._cv:
                    self.stats_.spool_full += 1
                if not own:
                    return False
                self._warn_once("spool-full", f"tracetop: spool {self._spool.root} is full; keeping batches in memory only")
        entry = _Entry(batch.source_id, batch.seq, batch.kind, batch.n, nbytes, batch, spool_path, own)
        with self._cv:
            key = (entry.source_id, entry.seq)
            if key in self._unacked:
                return True
            self._enq_counter += 1
            entry.idx = self._enq_counter
            if spool_path is not None and self._mem_bytes + nbytes > self.max_unacked_bytes:
                entry.batch = None  # the spool holds it; read back when sent
            else:
                self._mem_bytes += nbytes
                if spool_path is None:
                    self._make_room_locked(nbytes)
            self._unacked[key] = entry
            self._by_source.setdefault(entry.source_id, collections.deque()).append(entry.seq)
            self._to_send.append(key)
            self._unacked_bytes += nbytes
            self._cv.notify_all()
        return True

    def _make_room_locked(self, nbytes: int) -> None:
        """Drop the oldest memory-only batches until nbytes more fit (each drop becomes a gap row).

        A batch in flight on the open stream may already be stored by the receiver, so its drop is
        not counted yet: it waits in limbo (metadata only) until an ack covers it (stored, no gap)
        or the stream ends without one (counted then: the only case where a gap row can over-count,
        if the receiver committed it and died before acking)."""
        if self._mem_bytes <= self.max_unacked_bytes:
            return
        for key in list(self._unacked.keys()):
            if self._mem_bytes <= self.max_unacked_bytes:
                break
            e = self._unacked[key]
            if e.spool_path is not None or e.batch is None:
                continue
            self._remove_locked(key)
            if e.sent_epoch == self._epoch:
                if e.kind != Kind.GAP:
                    e.batch = None  # keep only the metadata
                self._limbo.setdefault(e.source_id, {})[e.seq] = e
            else:
                self._count_lost_locked(e)

    def _count_lost_locked(self, e: _Entry) -> None:
        if e.kind == Kind.GAP and e.own and e.batch is not None:
            # A gap batch is only counts: fold them back so the next gap row carries them.
            self._refold_gaps_locked(e.batch)
            return
        self.stats_.batches_dropped += 1
        kind = Kind(e.kind).name.lower() if e.kind in Kind._value2member_map_ else "batch"
        gk = (kind, "unacked_full", e.source_id)
        self._gap_pending[gk] = self._gap_pending.get(gk, 0) + e.n
        self.stats_.rows_dropped += e.n
        self.stats_.dropped_by_reason["unacked_full"] = self.stats_.dropped_by_reason.get("unacked_full", 0) + e.n

    def _end_limbo_locked(self) -> None:
        """The stream ended: limbo batches were never acked; count them lost now."""
        limbo, self._limbo = self._limbo, {}
        for entries in limbo.values():
            for e in entries.values():
                self._count_lost_locked(e)

    def _refold_gaps_locked(self, batch: pb.ColumnBatch) -> None:
        cols = decode_batch(batch).columns

        def strings(name: str) -> list[str]:
            codes, dictionary = cols[name]  # type: ignore[misc]
            return [dictionary[c] for c in codes.tolist()]

        for kind, reason, origin, dropped in zip(
            strings("kind"), strings("reason"), strings("origin_source"), cols["dropped"].tolist()  # type: ignore[union-attr]
        ):
            self._gap_pending[(kind, reason, origin)] = self._gap_pending.get((kind, reason, origin), 0) + dropped

    def _remove_locked(self, key: tuple[str, int]) -> _Entry | None:
        e = self._unacked.pop(key, None)
        if e is None:
            return None
        self._unacked_bytes -= e.nbytes
        if e.batch is not None:
            self._mem_bytes -= e.nbytes
        dq = self._by_source.get(e.source_id)
        if dq is not None:
            try:
                dq.remove(e.seq)
            except ValueError:
                pass
            if not dq:
                del self._by_source[e.source_id]
        return e

    def _on_ack(self, source_id: str, seq: int) -> None:
        done: list[_Entry] = []
        with self._cv:
            dq = self._by_source.get(source_id)
            while dq and dq[0] <= seq:
                s = dq.popleft()
                e = self._unacked.pop((source_id, s), None)
                if e is not None:
                    self._unacked_bytes -= e.nbytes
                    if e.batch is not None:
                        self._mem_bytes -= e.nbytes
                    done.append(e)
            if dq is not None and not dq:
                self._by_source.pop(source_id, None)
            limbo = self._limbo.get(source_id)
            if limbo:
                for s in [s for s in limbo if s <= seq]:
                    del limbo[s]  # it was stored after all: no gap
            self.stats_.batches_acked += len(done)
            self.stats_.rows_acked += sum(e.n for e in done)
            self._cv.notify_all()
        if self._spool is not None:
            for e in done:
                if e.spool_path is not None:
                    self._spool.remove(e.spool_path, e.nbytes)

    def _replay_spool(self) -> None:
        assert self._spool is not None
        for path, batch in self._spool.load():
            high = self.replayed_high_water
            high[batch.source_id] = max(high.get(batch.source_id, 0), batch.seq)
            nbytes = batch.ByteSize()
            with self._cv:
                key = (batch.source_id, batch.seq)
                keep = self._mem_bytes + nbytes <= self.max_unacked_bytes
                self._enq_counter += 1
                entry = _Entry(
                    batch.source_id, batch.seq, batch.kind, batch.n, nbytes, batch if keep else None, path, False,
                    self._enq_counter,
                )
                if keep:
                    self._mem_bytes += nbytes
                self._unacked[key] = entry
                self._by_source.setdefault(batch.source_id, collections.deque()).append(batch.seq)
                self._to_send.append(key)
                self._unacked_bytes += nbytes

    # ------------------------------------------------------------------ sending
    def _next_to_send(self, epoch: int, linger_s: float | None = None) -> pb.ColumnBatch | None:
        """Blocks until a batch is due on this connection; None when the connection is over, or
        when nothing came for ``linger_s`` (the end of a burst)."""
        deadline = None if linger_s is None else time.monotonic() + linger_s
        with self._cv:
            while True:
                if self._epoch != epoch:
                    return None
                while self._to_send:
                    key = self._to_send.popleft()
                    e = self._unacked.get(key)
                    if e is None:
                        continue
                    batch = e.batch
                    if batch is None and e.spool_path is not None:
                        batch = self._spool.read(e.spool_path) if self._spool else None
                        if batch is None:
                            self._remove_locked(key)
                            continue
                    e.sent_epoch = epoch
                    self.stats_.batches_sent += 1
                    return batch
                if self._closing:
                    return None
                if deadline is None:
                    self._cv.wait(1.0)  # enqueue, epoch changes and close all notify
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)

    def _requests(self, epoch: int):
        while True:
            batch = self._next_to_send(epoch, self.burst_linger_s)
            if batch is None:
                return
            yield batch

    def _wait_for_work(self) -> bool:
        """Sender between bursts: True once a batch waits (between bursts every unacked batch is
        one to send), False when stopping."""
        with self._cv:
            while not self._unacked and not self._closing and not self._stop.is_set():
                self._cv.wait(5.0)
            return bool(self._unacked) and not self._stop.is_set()

    def _new_epoch_locked(self) -> int:
        """A new connection: everything unacked goes out again, oldest first."""
        self._epoch += 1
        self._to_send = collections.deque(self._unacked.keys())
        return self._epoch

    def _run_sender(self) -> None:
        if self._transport is not None:
            self._run_transport_sender()
            return
        import grpc

        from tracetop.wire import tracetop_pb2_grpc

        channel = self._channel_factory(self.endpoint)  # type: ignore[arg-type]
        stub = tracetop_pb2_grpc.IngestStub(channel)
        backoff = 0.05
        while not self._stop.is_set():
            if not self._wait_for_work():
                break
            with self._cv:
                epoch = self._new_epoch_locked()
            # One stream per burst: it carries what is due plus whatever comes within
            # burst_linger_s, half-closes, and ends once the receiver has acked everything. An
            # open but idle gRPC stream costs the process ~1.5 ms of CPU a second in grpcio's
            # polling threads (trainer_hooks/README.md "Cost"); between bursts there is none.
            call = stub.Stream(self._requests(epoch))
            clean = False
            try:
                for ack in call:
                    if not self.stats_.connected:
                        self.stats_.connected = True
                        backoff = 0.05
                    self._on_ack(ack.source_id, ack.seq)
                clean = True  # the receiver acked what it took and ended the stream (or we closed ours)
            except grpc.RpcError as e:
                self.stats_.connected = False
                code = e.code() if hasattr(e, "code") else None
                detail = e.details() if hasattr(e, "details") else str(e)
                self.stats_.last_error = f"{code}: {detail}"
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    self._drop_rejected(e, detail or "")
                    backoff = 0.05
                else:
                    if self.stats_.reconnects == 0:
                        self._warn_once("connect", f"tracetop: cannot reach {self.endpoint} ({code}); buffering and retrying")
                    self.stats_.reconnects += 1
            finally:
                call.cancel()
                with self._cv:
                    if self._epoch == epoch:
                        self._epoch += 1
                    self._end_limbo_locked()
                    self._cv.notify_all()
            if self._stop.is_set():
                break
            if clean:
                with self._cv:
                    unacked_sent = any(e.sent_epoch == epoch for e in self._unacked.values())
                if not unacked_sent:
                    continue  # a burst like any other; the next opens when a batch is due
            self._stop.wait(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, self._reconnect_max_s)
        channel.close()

    def _drop_rejected(self, err: Any, detail: str) -> None:
        md = {k: v for k, v in (err.trailing_metadata() or ())} if hasattr(err, "trailing_metadata") else {}
        source, seq = md.get("tracetop-rejected-source"), md.get("tracetop-rejected-seq")
        self._warn_once(f"rejected-{detail[:40]}", f"tracetop: {self.endpoint} refused a batch: {detail}")
        if source is None or seq is None:
            return
        with self._cv:
            e = self._remove_locked((source, int(seq)))
            self.stats_.batches_rejected += 1
            if e is not None:
                fault = md.get("tracetop-fault") or (detail.split(":", 1)[0][:40] if detail else "invalid")
                gk = (Kind(e.kind).name.lower() if e.kind in Kind._value2member_map_ else "batch", f"rejected:{fault}", e.source_id)
                self._gap_pending[gk] = self._gap_pending.get(gk, 0) + e.n
                self.stats_.rows_dropped += e.n
        if e is not None and e.spool_path is not None and self._spool is not None:
            self._spool.remove(e.spool_path, e.nbytes)

    def _run_transport_sender(self) -> None:
        with self._cv:
            epoch = self._new_epoch_locked()
        self.stats_.connected = True
        while True:
            batch = self._next_to_send(epoch)
            if batch is None:
                with self._cv:
                    if self._stop.is_set():
                        return
                    epoch = self._new_epoch_locked()
                continue
            try:
                self._transport.send(batch)
            except Exception as e:
                self._warn_once("transport", f"tracetop: transport refused a batch: {e}")
                with self._cv:
                    self._remove_locked((batch.source_id, batch.seq))
                    self.stats_.batches_rejected += 1
                continue
            self._on_ack(batch.source_id, batch.seq)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


class NullShipper:
    """The disabled shipper (TRACETOP_DISABLE=1): same API, does nothing."""

    source_id = "disabled"
    run_id = "disabled"

    def record(self, kind: Kind, *row: Any) -> None:
        pass

    def record_many(self, kind: Kind, columns: Mapping[str, Any]) -> None:
        pass

    def forward(self, batch: pb.ColumnBatch) -> bool:
        return True

    def ship_soon(self) -> None:
        pass

    def flush(self, timeout_s: float = 0.0) -> bool:
        return True

    def close(self, timeout_s: float = 0.0) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


def _slice(v: Any, start: int, count: int) -> Any:
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], np.ndarray):
        return (v[0][start : start + count], v[1])
    return v[start : start + count]


class _Spool:
    """One file per batch under root/<source_id>/<seq>.batch, written tmp+fsync+rename."""

    def __init__(self, root: Path, max_bytes: int, fsync: bool) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.bytes = 0
        self._lock = threading.Lock()
        self._tmp_counter = itertools.count()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"tracetop: cannot create spool folder {root}: {e}; pass --spool-dir to a writable folder") from e

    def write(self, batch: pb.ColumnBatch, nbytes: int) -> Path | None:
        with self._lock:
            if self.bytes + nbytes > self.max_bytes:
                return None
            self.bytes += nbytes
        folder = self.root / batch.source_id
        folder.mkdir(exist_ok=True)
        path = folder / f"{batch.seq:020d}.batch"
        tmp = folder / f".{batch.seq:020d}.{os.getpid()}.{next(self._tmp_counter)}.tmp"
        data = batch.SerializeToString()
        with open(tmp, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def read(self, path: Path) -> pb.ColumnBatch | None:
        try:
            return pb.ColumnBatch.FromString(path.read_bytes())
        except (OSError, Exception):
            return None

    def remove(self, path: Path, nbytes: int) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return
        with self._lock:
            self.bytes = max(0, self.bytes - nbytes)

    def load(self):
        """Yield (path, batch) for every spooled batch, per source in seq order."""
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)  # an interrupted write: never acked, the hook resends it
            for path in sorted(folder.glob("*.batch")):
                batch = self.read(path)
                if batch is None:
                    log.warning("tracetop: unreadable spool file %s skipped", path)
                    continue
                with self._lock:
                    self.bytes += batch.ByteSize()
                yield path, batch
