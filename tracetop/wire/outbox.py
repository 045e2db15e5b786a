"""The unacked book: every sealed or forwarded batch from enqueue until an ack covers it.

Plain state, no threads and no I/O (the shipper guards it with its condition variable and does
the spool reads and deletes): tests drive it step by step.

* ``add`` books a batch. Memory-only batches count against ``max_memory_bytes``; beyond it the
  oldest memory-only batches are dropped (``unacked_full``, through the ledger). A spooled batch
  is never dropped: past the budget only its metadata stays in memory.
* A connection is an *epoch*. ``new_epoch`` queues everything unacked to be sent again, oldest
  first; ``next_due`` hands out what is due on that epoch.
* **Limbo.** A batch dropped for the budget while in flight on the open stream may already be
  stored by the receiver, so its loss is not counted yet: it waits (metadata only) until an ack
  covers it (stored: no gap) or its stream ends without one (counted then; the one case where a
  gap row can over-count, if the receiver stored it and died before acking).
* ``ack`` is cumulative per source. ``reject`` drops the batch a receiver refused (named, or the
  first one sent on the stream and not acked: receivers ack everything before a bad batch).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

from tracetop.events import Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import source_key, source_of_key
from tracetop.wire.ledger import DropLedger

Key = tuple[str, int]  # (source_id, seq)


@dataclass
class Entry:
    source_id: str
    seq: int
    kind: int
    n: int
    nbytes: int
    batch: pb.ColumnBatch | None  # None when only the spool file holds it (or in limbo)
    spool_path: Path | None
    own: bool
    idx: int = 0  # enqueue order; flush() waits for every entry up to an index
    sent_epoch: int = -1  # the connection it was last sent on

    @property
    def key(self) -> Key:
        return (self.source_id, self.seq)


class Outbox:
    def __init__(self, ledger: DropLedger, max_memory_bytes: int) -> None:
        self.ledger = ledger
        self.max_memory_bytes = max_memory_bytes
        self.unacked: collections.OrderedDict[Key, Entry] = collections.OrderedDict()
        self._by_source: dict[str, collections.deque] = {}
        self._to_send: collections.deque = collections.deque()
        self._sent: collections.deque = collections.deque()  # keys sent on this epoch, in order
        self.limbo: dict[str, dict[int, Entry]] = {}  # dropped while in flight: source -> seq -> entry
        self.unacked_bytes = 0
        self.mem_bytes = 0
        self.epoch = 0
        self.enqueued = 0  # the idx of the newest entry

    def __contains__(self, key: Key) -> bool:
        return key in self.unacked

    def __len__(self) -> int:
        return len(self.unacked)

    # ---- booking ----
    def add(self, batch: pb.ColumnBatch, nbytes: int, spool_path: Path | None, own: bool) -> Entry | None:
        """Book a batch (None if it is already booked: a resend, not new data)."""
        source = source_key(batch.source_id, batch.epoch)  # one start of the source (codec.source_key)
        key = (source, batch.seq)
        if key in self.unacked:
            return None
        self.enqueued += 1
        e = Entry(source, batch.seq, batch.kind, batch.n, nbytes, batch, spool_path, own, self.enqueued)
        if spool_path is not None and self.mem_bytes + nbytes > self.max_memory_bytes:
            e.batch = None  # the spool holds it; read back when sent
        else:
            self.mem_bytes += nbytes
            if spool_path is None:
                self._make_room()
        self.unacked[key] = e
        self._by_source.setdefault(e.source_id, collections.deque()).append(e.seq)
        self._to_send.append(key)
        self.unacked_bytes += nbytes
        return e

    def _make_room(self) -> None:
        """Drop the oldest memory-only batches until the budget holds (the newest, being booked,
        is not in the book yet: it is kept)."""
        if self.mem_bytes <= self.max_memory_bytes:
            return
        for key in list(self.unacked.keys()):
            if self.mem_bytes <= self.max_memory_bytes:
                break
            e = self.unacked[key]
            if e.spool_path is not None or e.batch is None:
                continue
            self._remove(key)
            if e.sent_epoch == self.epoch:
                if e.kind != Kind.GAP:
                    e.batch = None  # keep only the metadata
                self.limbo.setdefault(e.source_id, {})[e.seq] = e
            else:
                self._lost(e, "unacked_full")

    def _lost(self, e: Entry, reason: str) -> None:
        if e.kind == Kind.GAP and e.own and e.batch is not None and reason == "unacked_full":
            self.ledger.refold(e.batch)  # a gap batch is only counts: the next gap row carries them
            return
        # a refused GAP batch of our own is counted, not re-made: the new one would fare the same
        self.ledger.note_batch(e.kind, reason, source_of_key(e.source_id), e.n, ship=not (e.kind == Kind.GAP and e.own))

    def _remove(self, key: Key) -> Entry | None:
        e = self.unacked.pop(key, None)
        if e is None:
            return None
        self.unacked_bytes -= e.nbytes
        if e.batch is not None:
            self.mem_bytes -= e.nbytes
        dq = self._by_source.get(e.source_id)
        if dq is not None:
            try:
                dq.remove(e.seq)
            except ValueError:
                pass
            if not dq:
                del self._by_source[e.source_id]
        return e

    # ---- connections ----
    def new_epoch(self) -> int:
        """A new connection: everything unacked goes out again, oldest first."""
        self.epoch += 1
        self._to_send = collections.deque(self.unacked.keys())
        self._sent.clear()
        return self.epoch

    def next_due(self, epoch: int) -> Entry | None:
        """The next entry to send on ``epoch`` (marked sent), or None when none is due."""
        if epoch != self.epoch:
            return None
        while self._to_send:
            key = self._to_send.popleft()
            e = self.unacked.get(key)
            if e is None:
                continue
            e.sent_epoch = epoch
            self._sent.append(key)
            return e
        return None

    def interrupt(self) -> None:
        """End the open connection's sending (close): its next_due returns None from now."""
        self.epoch += 1

    def end_stream(self, epoch: int) -> None:
        """The stream of ``epoch`` ended: nothing more is sent on it, and its limbo batches were
        never acked: count them lost now."""
        if self.epoch == epoch:
            self.epoch += 1
        limbo, self.limbo = self.limbo, {}
        for entries in limbo.values():
            for e in entries.values():
                self._lost(e, "unacked_full")

    def sent_unacked(self, epoch: int) -> bool:
        """Whether a batch sent on ``epoch`` is still unacked (the stream ended short)."""
        return any(e.sent_epoch == epoch for e in self.unacked.values())

    # ---- answers ----
    def key_for(self, source_id: str, epoch: int) -> str:
        """The source key an answer names. A receiver older than epochs answers with epoch 0:
        then the one start of ``source_id`` held here, if there is just one."""
        key = source_key(source_id, epoch)
        if epoch or key in self._by_source or key in self.limbo:
            return key
        prefix = source_id + "@"
        held = {k for k in (*self._by_source, *self.limbo) if k.startswith(prefix)}
        return held.pop() if len(held) == 1 else key

    def ack(self, source_id: str, seq: int) -> list[Entry]:
        """Every batch of ``source_id`` up to ``seq`` is stored: the acked entries."""
        done: list[Entry] = []
        dq = self._by_source.get(source_id)
        while dq and dq[0] <= seq:
            e = self.unacked.pop((source_id, dq.popleft()), None)
            if e is not None:
                self.unacked_bytes -= e.nbytes
                if e.batch is not None:
                    self.mem_bytes -= e.nbytes
                done.append(e)
        if dq is not None and not dq:
            self._by_source.pop(source_id, None)
        limbo = self.limbo.get(source_id)
        if limbo:
            for s in [s for s in limbo if s <= seq]:
                del limbo[s]  # it was stored after all: no gap
            if not limbo:
                del self.limbo[source_id]
        sent = self._sent
        while sent and sent[0] not in self.unacked and not self._in_limbo(sent[0]):
            sent.popleft()
        return done

    def _in_limbo(self, key: Key) -> bool:
        return key[1] in self.limbo.get(key[0], ())

    def reject(self, fault: str, source_id: str | None = None, seq: int | None = None) -> Entry | None:
        """The receiver refused a batch: the one named, else the first sent on the last stream
        that is neither acked nor already counted. It is dropped for good (``rejected:<fault>``)."""
        key: Key | None = (source_id, seq) if source_id is not None and seq is not None else None
        if key is None:
            key = next((k for k in self._sent if k in self.unacked or self._in_limbo(k)), None)
        if key is None:
            return None
        e = self._remove(key)
        if e is None:
            e = self.limbo.get(key[0], {}).pop(key[1], None)
            if e is None:
                return None
        self._lost(e, f"rejected:{fault}")
        return e

    def drop(self, e: Entry, reason: str) -> None:
        """Drop a booked entry for good (its spooled copy cannot be read back)."""
        if self._remove(e.key) is not None:
            self._lost(e, reason)

    # ---- flush ----
    def unacked_through(self, idx: int) -> bool:
        """Whether a batch booked at or before ``idx`` is still unacked (booking order = key order)."""
        return bool(self.unacked) and next(iter(self.unacked.values())).idx <= idx

    def rows(self) -> int:
        return sum(e.n for e in self.unacked.values())
