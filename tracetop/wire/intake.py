"""The shipper's intake: what producers recorded and nothing has sealed yet.

Plain state behind one lock that is only ever held for an append or a swap (the caller never
waits): a bounded deque of row tuples per kind, and whole column sets from ``record_many``. When a
kind's deque is full the oldest rows fall out and are counted (``overflow``), and the sealer hands
that count to the drop ledger as ``queue_full``. ``take`` swaps out what is due.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from tracetop.events import Kind

#: (kind, column name -> numpy array or (codes, dictionary) pair, first record time in ns)
Columns = tuple[Kind, Mapping[str, Any], int]


class Taken(NamedTuple):
    """What one seal pass took out of the intake."""

    rows: list[tuple[Kind, list[tuple], int]]  # (kind, rows, first record ns), kinds whose rows were due
    columns: list[Columns]  # every record_many since the last take, when due
    overflow: dict[Kind, int]  # rows that fell out of a full deque since the last take


class Intake:
    """Rows and columns recorded and not yet sealed, per kind.

    Args:
        flush_rows: a kind is due at this many rows (and ``wake()`` is called once when it gets there).
        max_pending_rows: each kind's deque bound; past it the oldest rows are dropped and counted.
        clock_ns: the wall clock stamping a kind's first pending row (the batch's first_record_ns).
        wake: called (outside no lock of the caller's) when a seal should run now.
        mono_s: the monotonic clock that says when a kind is due: a wall clock stepped back an hour
            once held every row back for that hour (its age read negative).
    """

    def __init__(self, flush_rows: int, max_pending_rows: int, clock_ns: Callable[[], int],
                 wake: Callable[[], None], mono_s: Callable[[], float] = time.monotonic) -> None:
        self.flush_rows = flush_rows
        self._max_pending = max_pending_rows
        self._clock_ns = clock_ns
        self._mono_s = mono_s
        self._first_mono: dict[Kind, float] = {}
        self._columns_mono = 0.0  # when the oldest recorded columns came
        self._wake = wake
        self._lock = threading.Lock()
        self._rows: dict[Kind, collections.deque] = {k: collections.deque(maxlen=max_pending_rows) for k in Kind}
        self._first_ns: dict[Kind, int] = {}
        self._overflow: dict[Kind, int] = dict.fromkeys(Kind, 0)
        self._columns: list[Columns] = []
        self._column_rows = 0

    def record(self, kind: Kind, row: tuple) -> None:
        with self._lock:
            q = self._rows[kind]
            if len(q) == self._max_pending:
                self._overflow[kind] += 1
            elif not q:
                self._first_ns[kind] = self._clock_ns()
                self._first_mono[kind] = self._mono_s()
            q.append(row)
            if len(q) == self.flush_rows:
                self._wake()  # once per batch: seal it now rather than at the next tick

    def record_many(self, kind: Kind, columns: Mapping[str, Any]) -> None:
        n = len(next(iter(columns.values())))
        if n == 0:
            return
        with self._lock:
            if not self._columns:
                self._columns_mono = self._mono_s()
            self._columns.append((kind, columns, self._clock_ns()))
            self._column_rows += n
            full = self._column_rows >= self.flush_rows
        if full:
            self._wake()

    def take(self, now_ns: int, interval_s: float, force: bool) -> Taken:
        """Swap out every kind whose rows are due (``force``, ``flush_rows`` of them, or the first
        one ``interval_s`` old), the recorded columns when due likewise, and the overflow counts."""
        rows: list[tuple[Kind, list[tuple], int]] = []
        columns: list[Columns] = []
        mono = self._mono_s()
        with self._lock:
            for kind, q in self._rows.items():
                if not q:
                    continue
                age_s = mono - self._first_mono.get(kind, mono)
                if force or len(q) >= self.flush_rows or age_s >= interval_s:
                    self._rows[kind] = collections.deque(maxlen=self._max_pending)
                    self._first_mono.pop(kind, None)
                    rows.append((kind, list(q), self._first_ns.pop(kind, now_ns)))
            if self._columns and (
                force or self._column_rows >= self.flush_rows or mono - self._columns_mono >= interval_s
            ):
                columns, self._columns, self._column_rows = self._columns, [], 0
            overflow = {k: v for k, v in self._overflow.items() if v}
            for k in overflow:
                self._overflow[k] = 0
        return Taken(rows, columns, overflow)

    def has_rows(self) -> bool:
        return bool(self._columns or any(self._rows.values()))

    def pending_rows(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._rows.values()) + sum(
                len(next(iter(cols.values()))) for _, cols, _ in self._columns)
