"""The drop ledger: every row the shipper loses goes through ``DropLedger.note``, once.

From that one place come both the GAP rows that are shipped (``columns``) and the per-reason
counters of ``Shipper.stats()``, so the two cannot disagree and no loss path can skip either.

Reasons (the GAP table's ``reason`` column):

    queue_full         a kind's row buffer was full: the oldest rows were dropped at record()
    bad_row            rows that cannot be encoded (wrong arity, bad values)
    unacked_full       the unacked budget was exceeded: the oldest memory-only batch was dropped
                       (a batch in flight is counted only when its stream ends without an ack)
    rejected:<fault>   the receiver refused the batch (``fault`` as it named it)
    spool_unreadable   a spooled batch could not be read back from disk
    spool_full         (no longer written) the agent relay once recorded a refused hook batch
                       here; a refusal is not a loss (the hook keeps and resends the batch, and
                       records its own drops), so the relay now only counts it in its metrics.
                       Older files may hold such rows: they are refusals, not losses.

GAP rows that producers record themselves are folded into this ledger when the shipper seals.

``kind`` is the event kind's name, or ``"batch"`` when not even that is known (an unreadable
spool file whose header is gone): then ``dropped`` counts batches, not rows.
"""

from __future__ import annotations

import threading

import numpy as np

from tracetop.events import Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import decode_batch

_KIND_VALUES = frozenset(int(k) for k in Kind)


def kind_name(kind: int) -> str:
    """``Kind(kind).name.lower()``, or ``"batch"`` for a value no Kind has."""
    return Kind(kind).name.lower() if kind in _KIND_VALUES else "batch"


class DropLedger:
    """Counts losses by (kind, reason, origin_source) until they are sealed into GAP rows.

    Thread-safe (a small lock of its own, never held while calling out)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str, str], int] = {}
        self.rows_dropped = 0
        self.batches_dropped = 0
        self.batches_rejected = 0
        self.by_reason: dict[str, int] = {}

    def note(self, kind: str, reason: str, origin: str, count: int, *, batches: int = 0, ship: bool = True) -> None:
        """``count`` rows of ``kind`` from source ``origin`` are lost for ``reason`` (``batches``:
        how many whole batches that was). ``ship=False``: counted, but no GAP row is made (for a
        lost GAP batch the receiver refused: a new one would be refused the same way)."""
        if count <= 0 and not batches:
            return
        with self._lock:
            if ship:
                key = (kind, reason, origin)
                self._pending[key] = self._pending.get(key, 0) + count
            if kind != "batch":
                self.rows_dropped += count
            self.by_reason[reason] = self.by_reason.get(reason, 0) + count
            if reason.startswith("rejected:"):
                self.batches_rejected += batches
            else:
                self.batches_dropped += batches

    def note_batch(self, kind: int, reason: str, origin: str, rows: int, *, ship: bool = True) -> None:
        """One whole batch (``kind`` as on the wire) of ``rows`` rows is lost."""
        self.note(kind_name(kind), reason, origin, rows, batches=1, ship=ship)

    def refold(self, batch: pb.ColumnBatch) -> None:
        """A GAP batch of our own was dropped unsent: its counts go back into the pending ones
        (already counted once, so the counters stay as they are)."""
        cols = decode_batch(batch).columns

        def strings(name: str) -> list[str]:
            codes, dictionary = cols[name]
            return [dictionary[c] for c in codes.tolist()]

        with self._lock:
            for kind, reason, origin, dropped in zip(
                strings("kind"), strings("reason"), strings("origin_source"), cols["dropped"].tolist()  # type: ignore[union-attr]
            ):
                key = (kind, reason, origin)
                self._pending[key] = self._pending.get(key, 0) + dropped

    def __bool__(self) -> bool:
        return bool(self._pending)

    def take(self) -> dict[tuple[str, str, str], int]:
        """Everything noted since the last take: (kind, reason, origin) -> dropped."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending

    def columns(self, now_ns: int, rank: int) -> dict | None:
        """The GAP rows of everything noted since the last call (None when nothing was)."""
        gaps = self.take()
        if not gaps:
            return None
        n = len(gaps)
        return {
            "rank": np.full(n, rank, "<i4"),
            "step": np.full(n, -1, "<i8"),
            "start_ns": np.full(n, now_ns, "<i8"),
            "duration_ns": np.zeros(n, "<i8"),
            "kind": [k for k, _, _ in gaps],
            "dropped": np.fromiter(gaps.values(), "<i8", n),
            "reason": [r for _, r, _ in gaps],
            "origin_source": [o for _, _, o in gaps],
        }

    def counters(self) -> dict:
        with self._lock:
            return {
                "rows_dropped": self.rows_dropped,
                "batches_dropped": self.batches_dropped,
                "batches_rejected": self.batches_rejected,
                "dropped_by_reason": dict(self.by_reason),
            }
