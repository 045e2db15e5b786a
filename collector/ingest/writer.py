"""The one writer: decoded batches in, group commits into DuckDB, cumulative acks out.

gRPC handlers only decode, validate and convert a batch to Arrow (`batch_to_arrow`), then
`submit` it. The writer thread drains whatever is queued once ~`flush_rows` rows are waiting or
the oldest item has waited `flush_interval_s`, and commits the lot in one transaction: per event
kind one `INSERT … SELECT` from the concatenated Arrow tables, the ingest log, and each source's
high-water mark. Only then does it hand each stream its acks. Under load the queue grows while a
commit runs, so commits grow with it (group commit), which is what makes ingest fast.

Once `rollup.ROLL_EVERY_ROWS` step or collective rows are past their rollup's watermark, a second
thread (`tracetop-rollup`, its own cursor and transactions) rolls them up for the views
(collector/ingest/rollup.py), so commits never wait for it; the writer rolls up the rest when it closes.
The same thread materializes the per-step views (collector/ingest/matviews.py) once ROLL_EVERY_ROWS rows of
their inputs are past their watermarks and step rows that can complete a step have come since its last
roll (VIEWS_ROLL_BOUND), and everything pending at close. It rolls when the writer has no backlog
(less than a commit's worth queued) and, in a collector, has committed nothing for ROLL_QUIET_S,
waiting ROLL_DEFER_S at most, so a burst commits first, and at a
lower CPU priority (`roll_nice`): where the cores are short, commits come first. It never checkpoints
itself: it asks the writer thread to, so no lowered thread holds the commits behind DuckDB's lock.

Bounded: the queue holds at most `max_queued_rows` rows and `max_queued_bytes` Arrow bytes (and one
batch): past them `full()` is true and the gRPC edge holds the streams (backpressure, counted in the
collector's metrics as "behind"); the shippers then keep, spool or drop and count (gap rows).

Exactly once: a batch with seq <= its source's high-water mark (committed, or accepted earlier in
the same group) is a duplicate: acked, not stored. Seqs may skip; hwm becomes the batch's seq.
A source here is one start of a shipper: (source_id, epoch), keyed ``source_key`` (``id@epoch``
in the ``sources`` table; a plain id for senders without epochs), so a restarted shipper with a
fixed source_id starts a mark of its own. The gRPC edge refuses a seq far ahead of the mark
(codec.seq_ahead) before it gets here.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from collector.ingest import matviews, rollup
from tracetop.events import SCHEMAS, Kind, table_name
from tracetop.wire.codec import DecodedBatch

log = logging.getLogger("tracetop.collector")

#: the roll thread waits this long at most for the writer to have no backlog
ROLL_DEFER_S = 5.0
#: ... and, in a collector (`Writer(roll_quiet_s=)`), for the writer to have committed nothing for this
#: long: between bursts, not in a gap between two of a burst's commits. Under a burst the queue is
#: short of a commit's worth after each commit (the sources are on the same cores), and the roll
#: started there, taking the cores the burst's commits wanted; now a burst longer than ROLL_DEFER_S
#: rolls every ROLL_DEFER_S (each roll larger). The views are exact whatever the lag. A/B:
#: `bench ingest --ab "TRACETOP_ROLL_QUIET_S=0"` (0: the old wait), docs/benchmarks.md
ROLL_QUIET_S = 0.25
#: the niceness the collector's roll thread adds to its own (Linux; `Writer(roll_nice=)`). Where the
#: cores are short the writer's commits and the gRPC edge take them first and the roll takes what is
#: left; where they are not, it changes nothing. The views stay exact whatever the roll's lag (they
#: read the rows past their watermarks). `bench ingest --ab "TRACETOP_ROLL_NICE=0"`, 5 + 5 at load
#: 0.8-3.3: 921k lowered against 831k ev/s (the roll's CPU during the runs 0.26 against 0.44 CPU-s per
#: M rows, the same through the close); at 16,384 ranks (2 + 2, 120 s) CPU, p99 and RSS unchanged
ROLL_NICE = 10
#: the views roll whatever came once this many times ROLL_EVERY_ROWS rows of their inputs are past
#: their watermarks. Below it they roll only after step rows that can complete a step: of a step newer
#: than the run's at the last views roll, or older than the run's newest (a late rank). A step is
#: complete once its run has rows of a later step, or all its started ranks' step rows (which come
#: just before the next step's): a roll while a step's other rows came in found nothing to take (two
#: of three rolls at 16,384 ranks, ~20 ms CPU each). The views are exact whenever they roll.
VIEWS_ROLL_BOUND = 4
#: a checkpoint due after a commit is tried this many times, this far apart, before it waits for the
#: next commit: a reader's scan holds DuckDB's checkpoint lock for a few ms, a roll's transaction longer.
#: A batch queued meanwhile ends the tries at once (its commit tries again): in the rows bench the
#: writer slept in these tries in 14% of its samples while the roll held the lock and sources waited
CHECKPOINT_TRIES = 4
CHECKPOINT_RETRY_S = 0.005


_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _wal_and_threshold(con) -> tuple[str | None, int]:
    """The file's WAL path (None in memory) and DuckDB's checkpoint_threshold in bytes."""
    (path,) = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchone()
    (setting,) = con.execute("SELECT current_setting('checkpoint_threshold')").fetchone()
    value, _, unit = str(setting).partition(" ")
    return (f"{path}.wal" if path else None), int(float(value) * _UNITS.get(unit, 1))


def lower_thread_priority(nice: int) -> None:
    """Add `nice` to the calling thread's niceness (Linux, where it is per thread; elsewhere nothing,
    as a process-wide change would slow every thread). A lowered thread cannot raise it again
    without privileges."""
    if nice <= 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # (a sandbox without setpriority): the thread runs as the others do
        log.warning("collector: could not lower thread %s's priority (%s); it runs as the others do",
                    threading.current_thread().name, e)


def batch_to_arrow(batch: DecodedBatch) -> pa.Table:
    """A validated batch as an Arrow table shaped like its DuckDB table (run_id first).

    Vectorised: numeric columns are zero-copy views, string columns stay dictionary-encoded
    (DuckDB decodes them into VARCHAR on insert), float NaN becomes NULL.
    """
    n = batch.n
    arrays = [pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([batch.run_id]))]
    names = ["run_id"]
    for col in SCHEMAS[batch.kind]:
        value = batch.columns[col.name]
        if col.dtype == "str":
            codes, dictionary = value
            arrays.append(pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(dictionary, pa.string())))
        elif col.dtype == "f8":
            arrays.append(pa.array(value, from_pandas=True))  # NaN -> null
        else:
            arrays.append(pa.array(value))
        names.append(col.name)
    return pa.Table.from_arrays(arrays, names=names)


#: DuckDB's row group (rows). A transaction that appends at least this many rows to a table has
#: them compressed and written to the file at commit, as whole row groups, instead of copied into
#: the table, logged in the WAL and compressed again by the next checkpoint.
ROW_GROUP_ROWS = 122_880


class Staging:
    """Arrow tables the writer's statements read by name (`_tt_in_<name>`): each name registered on
    the connection once, its table swapped in before each commit.

    DuckDB's Python client takes the GIL back several times in every statement it runs, whatever its
    rows (to check for Ctrl-C), and a registration is a statement (CREATE VIEW), its removal another:
    registering a commit's tables and dropping them again was 6 of its 11 statements. While the gRPC
    edge holds the GIL each take waits up to the switch interval. DuckDB reads a registered object's
    `__arrow_c_stream__` to bind its name and again to scan it, so the name stays and the rows change:
    a one-kind commit takes the GIL ~59 times instead of ~89 (counted in gdb), and 114,688 STEP rows
    commit in 77-79 ms instead of 96-101 beside a thread that holds the GIL (40-45 ms of CPU either
    way; docs/benchmarks.md). For one thread (a registration belongs to its connection)."""

    def __init__(self, con) -> None:
        self.con = con
        self._staged: dict[str, _Staged] = {}

    def put(self, name: str, table: pa.Table) -> str:
        """Make `table` what `_tt_in_<name>` reads; returns that name. A name new (or of a new schema) is
        registered: a statement of the transaction open on the connection, if one is, undone by its
        ROLLBACK. Put new names before BEGIN."""
        staged = self._staged.get(name)
        if staged is None or staged.table.schema != table.schema:
            staged = _Staged(table.schema)
            self.con.complete()  # (DuckDB refuses a registration while a result of execute() is unread)
            self.con.register(f"_tt_in_{name}", staged)
            self._staged[name] = staged
        staged.table = table
        return f"_tt_in_{name}"

    def stage_rows(self, table: str, tables: list[pa.Table]) -> str:
        """One kind's queued Arrow tables, as one chunk, staged for `INSERT INTO <table> SELECT * FROM
        <the name returned>` (a new name is registered: stage before BEGIN).

        DuckDB scans a many-chunk Arrow table on several threads, each filling row groups of its own:
        a 245,760-row commit of 15 batches left 3 partial row groups, which the next checkpoint merged,
        compressing those rows a second time. One chunk is scanned by one thread into whole row groups.
        STEP rows in 245,760-row commits: 0.43 CPU-s per million stored (commits and closing checkpoint)
        against 0.98-1.3 from the many-chunk table (`python -m collector.bench.writer --commit-rows
        245760`); below a row group per table it changes nothing measurable. The cost: one copy of the
        kind's queued rows until `clear` (bounded by the queue's bytes)."""
        return self.put(table, pa.concat_tables(tables).combine_chunks())

    def clear(self) -> None:
        """Let go of every staged table (each name then reads no rows), so their memory is freed."""
        for staged in self._staged.values():
            staged.table = staged.table.schema.empty_table()

    def close(self) -> None:
        for name in self._staged:
            self.con.unregister(f"_tt_in_{name}")
        self._staged.clear()


class _Staged:
    """What DuckDB reads for one staged name: the table put last."""

    def __init__(self, schema: pa.Schema) -> None:
        self.table = schema.empty_table()

    def __arrow_c_stream__(self, requested_schema=None):
        return self.table.__arrow_c_stream__(requested_schema)


def insert_rows(con, table: str, tables: list[pa.Table]) -> None:
    """INSERT one kind's Arrow tables into `table` as the writer does (`Staging.stage_rows`), on a
    connection of one's own (tests); nothing stays registered."""
    staging = Staging(con)
    try:
        con.execute(f"INSERT INTO {table} SELECT * FROM {staging.stage_rows(table, tables)}")
    finally:
        staging.close()


#: the ingest log's and the sources' rows of a commit, as the writer stages them
LOG_SCHEMA = pa.schema([("source_id", pa.string()), ("seq", pa.uint64()), ("kind", pa.string()), ("n", pa.int32()),
                        ("first_record_ns", pa.int64()), ("sealed_ns", pa.int64()), ("committed_ns", pa.int64())])
SOURCES_SCHEMA = pa.schema([("source_id", pa.string()), ("hwm", pa.uint64()), ("first_seen_ns", pa.int64()),
                            ("last_seen_ns", pa.int64()), ("batches", pa.int64()), ("rows", pa.int64())])


@dataclass(frozen=True)
class Ack:
    source_id: str
    seq: int
    epoch: int = 0


@dataclass(frozen=True)
class StreamEnd:
    """The last thing a stream receives. All fields empty: finished cleanly (client closed its side)."""

    fault: str = ""  # a rejected batch: the fault, a message, trailing metadata naming the batch
    message: str = ""
    metadata: tuple[tuple[str, str], ...] = ()
    shutdown: bool = False
    store_failed: str = ""


class StreamReplies:
    """Where the writer delivers one stream's (or push's) replies: its acks, then its end.
    `deliver` must be thread-safe. `failed` is set when a commit holding its batches failed: its
    later queued batches are dropped too (they would otherwise move the high-water mark past the
    lost ones, turning their resend into a "duplicate")."""

    failed = False

    def deliver(self, item: Ack | StreamEnd) -> None:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass
class QueuedBatch:
    """A decoded batch (and its Arrow table) waiting for the writer; its ack goes to `replies`."""

    replies: StreamReplies
    batch: DecodedBatch
    table: pa.Table


@dataclass
class Barrier:
    """Sent after a stream's last batch: delivered to that stream after the acks for everything it
    submitted before (so a rejected batch's stream first gets acks for what came before it)."""

    replies: StreamReplies
    end: StreamEnd


@dataclass
class FlushStats:
    batches: int = 0
    rows: int = 0
    duplicates: int = 0
    rows_by_kind: dict[Kind, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)
    #: how long the oldest batch of this commit waited in the queue (s)
    wait_s: float = 0.0


class Writer:
    """Owns the write connection; one thread. `submit` may be called from any thread."""

    def __init__(
        self,
        con,
        *,
        flush_rows: int = 10_000,
        flush_interval_s: float = 0.5,
        max_queued_rows: int = 2_000_000,
        max_queued_bytes: int = 256 * 2**20,
        clock_ns: Callable[[], int] = time.time_ns,
        on_flush: Callable[[FlushStats], None] | None = None,
        on_queue: Callable[[int, int, int], None] | None = None,
        on_commit: Callable[[list[DecodedBatch]], None] | None = None,
        roll_nice: int = 0,
        roll_quiet_s: float = 0.0,
    ) -> None:
        self.con = con
        #: the roll waits for the writer to have committed nothing this long (ROLL_QUIET_S in a collector)
        self.roll_quiet_s = roll_quiet_s
        self._committed_mono = 0.0  # when the latest commit ended
        #: the niceness the roll thread adds to its own (ROLL_NICE in a collector; 0: none)
        self.roll_nice = roll_nice
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.max_queued_rows = max_queued_rows
        #: the queue's bound in Arrow bytes: past it (or max_queued_rows) the gRPC edge holds the
        #: streams (backpressure), so the queue's memory stays bounded whatever is offered
        self.max_queued_bytes = max_queued_bytes
        self.clock_ns = clock_ns
        self.on_flush = on_flush
        self.on_queue = on_queue
        # after each commit, the committed batches (decoded columns): the live path. Must return
        # at once (the live engine only appends them to its bounded inbox).
        self.on_commit = on_commit
        self.hwm: dict[str, int] = dict(
            (s, int(h)) for s, h in con.execute("SELECT source_id, hwm FROM sources").fetchall()
        )
        self._items: list[QueuedBatch | Barrier] = []
        self._queued_rows = 0
        self._queued_bytes = 0
        self.peak_queued_bytes = 0  # the most the queue held (Arrow bytes)
        self._oldest_mono = 0.0
        self._wait_s = 0.0  # the oldest item's wait, at the latest take
        self._inflight_mono = 0.0  # when the oldest item of the commit running now was queued (0: none)
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="tracetop-writer", daemon=True)
        self.flushes = 0
        # rows of each rolled-up kind committed past its rollup's watermark (a hint: the watermark
        # in the file is the truth)
        self._unrolled: dict[str, int] = {t: rollup.tail_rows(con, t) for t in rollup.TABLES}
        # rows past the materialized views' watermarks, and pending steps (collector/ingest/matviews.py)
        self._unrolled["views"] = matviews.pending_rows(con)
        # per run, the newest step of its committed step rows, and that at the last views roll
        self._newest_step: dict[str, int] = {}
        self._views_rolled_at: dict[str, int] = {}
        self._late_step_rows = False  # step rows older than their run's newest, since the last views roll
        self._roll_lock = threading.Lock()
        self._roll_wanted = threading.Event()
        self._roll_stop = False
        self._checkpoint_asked = False  # by the roll thread, after a roll: the writer thread checks it
        self._roll_cursor = con.cursor()  # made here: a connection is not to be shared across threads
        # the commits' Arrow inputs, by name; the ingest log's and the sources' registered here, so a
        # commit registers only a kind new to it (before its BEGIN)
        self._staging = Staging(con)
        self._staging.put("log", LOG_SCHEMA.empty_table())
        self._staging.put("sources", SOURCES_SCHEMA.empty_table())
        self._roller = threading.Thread(target=self._roll_loop, name="tracetop-rollup", daemon=True)
        self._wal, self._checkpoint_bytes = _wal_and_threshold(con)
        # `_checkpoint_if_due`'s: checkpoints run, their seconds, and those put off to a later try
        self.checkpoints = 0
        self.checkpoint_s = 0.0
        self.checkpoints_deferred = 0

    # -- producer side ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._roller.start()

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def oldest_wait_s(self) -> float:
        """How long the oldest batch not yet committed (in the commit running now, else queued) has
        waited so far; 0 when nothing waits. Any thread (a racy read of two floats: a gauge)."""
        t = self._inflight_mono or (self._oldest_mono if self._items else 0.0)
        return time.monotonic() - t if t else 0.0

    def full(self) -> bool:
        return self._queued_rows >= self.max_queued_rows or self._queued_bytes >= self.max_queued_bytes

    def submit(self, item: QueuedBatch | Barrier) -> bool:
        """Queue an item; False once the writer is closing (the item is not taken)."""
        with self._cond:
            if self._closing:
                return False
            if not self._items:
                self._oldest_mono = time.monotonic()
            self._items.append(item)
            if isinstance(item, QueuedBatch):
                self._queued_rows += item.batch.n
                self._queued_bytes += item.table.nbytes
                self.peak_queued_bytes = max(self.peak_queued_bytes, self._queued_bytes)
            if len(self._items) == 1 or self._queued_rows >= self.flush_rows or isinstance(item, Barrier):
                self._cond.notify()
            depth, rows, nbytes = len(self._items), self._queued_rows, self._queued_bytes
        if self.on_queue:
            self.on_queue(depth, rows, nbytes)
        return True

    def ask_checkpoint(self) -> None:
        """Have the writer thread check soon whether a checkpoint is due (`_checkpoint_if_due`), even
        with nothing queued: the roll thread asks after each roll, its transaction (the checkpoint
        lock's usual holder) committed."""
        with self._cond:
            self._checkpoint_asked = True
            self._cond.notify()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop taking items, commit and ack everything queued, then return."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        self._roll_stop = True
        self._roll_wanted.set()
        if self._roller.is_alive():
            self._roller.join(timeout_s)
        if not self._roller.ident:  # never started: its cursor is still open
            self._roll_cursor.close()
        if not self._thread.is_alive() and not self._roller.is_alive():
            self._roll_up(self.con, 0)  # a cleanly closed file has no tail

    # -- writer thread ---------------------------------------------------------------------
    def _take(self) -> list[QueuedBatch | Barrier] | None:
        with self._cond:
            while not self._items and not self._closing and not self._checkpoint_asked:
                self._cond.wait()
            self._checkpoint_asked = False  # (a commit below checks too)
            if not self._items:
                return None if self._closing else []  # closing and drained; or: check the checkpoint
            deadline = self._oldest_mono + self.flush_interval_s
            while (
                not self._closing
                and self._queued_rows < self.flush_rows
                and not isinstance(self._items[-1], Barrier)
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._wait_s = time.monotonic() - self._oldest_mono
            self._inflight_mono = self._oldest_mono
            items, self._items, self._queued_rows, self._queued_bytes = self._items, [], 0, 0
        if self.on_queue:
            self.on_queue(0, 0, 0)
        return items

    def _run(self) -> None:
        while True:
            items = self._take()
            if items is None:
                return
            if not items:  # the roll asked
                self._checkpoint_if_due(self.con)
                continue
            try:
                self.flush(items)
            except Exception as e:  # keep serving: the shippers still hold these batches
                log.exception("collector: commit failed")
                self._inflight_mono = 0.0
                self._fail(items, f"{type(e).__name__}: {e}")

    def flush(self, items: list[QueuedBatch | Barrier]) -> FlushStats:
        """Commit `items` in one transaction, then deliver acks and barriers. Called by the
        writer thread (and directly by tests of the pure ordering logic)."""
        stats = FlushStats(wait_s=self._wait_s)
        hwm = dict(self.hwm)
        accepted: list[QueuedBatch] = []
        acks: dict[StreamReplies, dict[str, tuple[str, int]]] = defaultdict(dict)
        for item in items:
            if isinstance(item, Barrier) or item.replies.failed:
                continue
            b = item.batch
            key = b.key
            acks[item.replies][key] = (b.source_id, b.epoch)
            if b.seq <= hwm.get(key, 0):
                stats.duplicates += 1
                continue
            hwm[key] = b.seq
            accepted.append(item)
        if accepted:
            t0 = time.perf_counter()
            committed_ns = self._commit(accepted, hwm)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "commit: %d batches, %d rows, %.1f ms",
                    len(accepted), sum(i.batch.n for i in accepted), (time.perf_counter() - t0) * 1e3,
                )
            self.hwm = hwm
            self._inflight_mono = 0.0
            self._committed_mono = time.monotonic()
            for item in accepted:
                b = item.batch
                stats.batches += 1
                stats.rows += b.n
                stats.rows_by_kind[b.kind] = stats.rows_by_kind.get(b.kind, 0) + b.n
                if b.sealed_ns > 0:
                    stats.latencies_s.append(max(0, committed_ns - b.sealed_ns) / 1e9)
        self.flushes += 1
        self._inflight_mono = 0.0
        if self.on_flush:  # counted before acked: a sender that saw its ack (or its stream's end) scrapes it
            self.on_flush(stats)
        for replies, sources in acks.items():
            for key in sorted(sources):
                source, epoch = sources[key]
                replies.deliver(Ack(source, self.hwm.get(key, 0), epoch))
        for item in items:
            if isinstance(item, Barrier) and not item.replies.failed:
                item.replies.deliver(item.end)
        if self.on_commit and accepted:
            try:
                self.on_commit([i.batch for i in accepted])
            except Exception:  # the live path never fails a commit
                log.exception("collector: on_commit failed")
        if accepted:
            self._checkpoint_if_due(self.con)
        with self._roll_lock:
            self._note_steps(accepted)
            for kind, n in stats.rows_by_kind.items():
                table = rollup.for_kind(kind)
                if table:
                    self._unrolled[table] += n
                if table_name(kind) in matviews.INPUTS:
                    self._unrolled["views"] += n
            if max(self._unrolled.values()) > rollup.ROLL_EVERY_ROWS:
                self._roll_wanted.set()
        return stats

    def _checkpoint_if_due(self, con) -> None:
        """CHECKPOINT once the WAL has passed DuckDB's checkpoint threshold: by the writer thread after
        a commit (its acks sent), and when the roll thread asks, after a roll.

        DuckDB checkpoints on its own at a commit only when no other transaction is open, since every
        commit here updates `sources`' marks; at 16,384 ranks the roll, the source-end watch and the
        live queries left few such moments: the WAL grew to ~290 MB, and the checkpoint that finally
        ran held every commit for seconds (p99 record → commit 3.4 s). This one runs beside readers
        (DuckDB makes it a concurrent checkpoint). It gives way while a scan or another write
        transaction holds DuckDB's checkpoint lock: tried again a few ms later, then at the next
        commit, and once the roll's transaction (the usual holder) has committed.
        Commits wait while it runs (0.4 s at 64 MB on a quiet machine, 1-2 s at load 5), so it waits
        for the writer's queue to drain, up to twice the threshold: ranks ship in bursts at their
        step boundaries, and a checkpoint between bursts delays no batch."""
        if not self._wal:
            return
        try:
            wal = os.stat(self._wal).st_size
        except OSError:  # no WAL: nothing to checkpoint
            return
        if wal < self._checkpoint_bytes or (self._items and wal < 2 * self._checkpoint_bytes):
            return  # (with batches queued, it waits for the queue to drain, up to twice the threshold)
        for attempt in range(CHECKPOINT_TRIES):
            try:
                t0 = time.perf_counter()
                con.execute("CHECKPOINT")
            except duckdb.TransactionException:  # a scan or another writer holds the lock
                if attempt + 1 < CHECKPOINT_TRIES and not self._queued_within(CHECKPOINT_RETRY_S):
                    continue
                with self._roll_lock:
                    self.checkpoints_deferred += 1
            except duckdb.Error:
                log.exception("collector: checkpoint failed (DuckDB will try again on a later commit)")
            else:
                with self._roll_lock:
                    self.checkpoints += 1
                    self.checkpoint_s += time.perf_counter() - t0
            return

    def _queued_within(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for an item to be queued (`submit` wakes the writer thread on the
        first); whether one is."""
        with self._cond:
            if not self._items and not self._closing:
                self._cond.wait(timeout_s)
            return bool(self._items)

    def _note_steps(self, accepted: list[QueuedBatch]) -> None:
        """Keep each run's newest committed step row's step (under the roll lock)."""
        for item in accepted:
            if item.batch.kind is Kind.STEP and item.batch.n:
                lo, hi = pc.min_max(item.table.column("step")).values()
                lo, hi, run = lo.as_py(), hi.as_py(), item.batch.run_id
                if lo is None:
                    continue
                newest = self._newest_step.get(run)
                if newest is None or hi > newest:
                    self._newest_step[run] = hi
                if newest is not None and lo < newest:
                    self._late_step_rows = True

    def _views_due(self, n: int, at_least: int) -> bool:
        """Whether the views roll now (under the roll lock): see VIEWS_ROLL_BOUND."""
        if at_least == 0 or n > VIEWS_ROLL_BOUND * at_least:
            return True
        return n > at_least and (self._late_step_rows or any(
            step > self._views_rolled_at.get(run, step - 1) for run, step in self._newest_step.items()))

    def _roll_loop(self) -> None:
        lower_thread_priority(self.roll_nice)
        try:
            while True:
                self._roll_wanted.wait()
                self._roll_wanted.clear()
                # roll when the writer has no backlog (a commit's worth queued) and has committed
                # nothing for roll_quiet_s, for at most ROLL_DEFER_S: a burst commits first; the
                # views read the tail meanwhile (exact)
                deadline = time.monotonic() + ROLL_DEFER_S
                while not self._roll_stop and (now := time.monotonic()) < deadline and (
                        self._queued_rows >= self.flush_rows or now - self._committed_mono < self.roll_quiet_s):
                    time.sleep(0.05)
                if self._roll_stop:
                    return
                self._roll_up(self._roll_cursor, rollup.ROLL_EVERY_ROWS)
                self.ask_checkpoint()  # by the writer thread: this one may run lowered
        finally:
            self._roll_cursor.close()

    def _roll_up(self, con, at_least: int) -> None:
        """Roll up each kind with more than `at_least` rows past its watermark. A failure leaves
        them in the tail, which the views read from the rows."""
        for table in (*rollup.TABLES, "views"):
            with self._roll_lock:
                n = self._unrolled[table]
                rolled_at, late = self._views_rolled_at, self._late_step_rows
                due = self._views_due(n, at_least) if table == "views" else n > at_least
                if not due:  # (at close, at_least 0, the views roll their pending steps too)
                    continue
                self._unrolled[table] = 0
                if table == "views":
                    self._views_rolled_at, self._late_step_rows = dict(self._newest_step), False
            try:
                if table == "views":  # at close (at_least 0) pending steps are materialized too
                    matviews.advance(con, final=at_least == 0)
                else:
                    rollup.advance(con, table)
            except Exception:
                log.exception("collector: rolling up %s failed", table)
                with self._roll_lock:
                    self._unrolled[table] += n
                    if table == "views":
                        self._views_rolled_at, self._late_step_rows = rolled_at, late

    def _commit(self, accepted: list[QueuedBatch], hwm: dict[str, int]) -> int:
        by_kind: dict[Kind, list[pa.Table]] = defaultdict(list)
        for item in accepted:
            by_kind[item.batch.kind].append(item.table)
        per_source: dict[str, list[int]] = {}
        for item in accepted:
            b = item.batch
            agg = per_source.setdefault(b.key, [0, 0])
            agg[0] += 1
            agg[1] += b.n
        con, staging = self.con, self._staging
        try:
            inserts = [(table_name(kind), staging.stage_rows(table_name(kind), tables)) for kind, tables in by_kind.items()]
            con.execute("BEGIN TRANSACTION")
            try:
                for table, staged in inserts:
                    con.execute(f"INSERT INTO {table} SELECT * FROM {staged}")
                committed_ns = self.clock_ns()
                log_rows = staging.put("log", pa.table(
                    {
                        "source_id": [i.batch.source_id for i in accepted],
                        "seq": [i.batch.seq for i in accepted],
                        "kind": [table_name(i.batch.kind) for i in accepted],
                        "n": [i.batch.n for i in accepted],
                        "first_record_ns": [i.batch.first_record_ns or None for i in accepted],
                        "sealed_ns": [i.batch.sealed_ns or None for i in accepted],
                        "committed_ns": [committed_ns] * len(accepted),
                    },
                    schema=LOG_SCHEMA,
                ))
                sources = list(per_source)
                source_rows = staging.put("sources", pa.table(
                    {
                        "source_id": sources,
                        "hwm": [hwm[s] for s in sources],
                        "first_seen_ns": [committed_ns] * len(sources),
                        "last_seen_ns": [committed_ns] * len(sources),
                        "batches": [per_source[s][0] for s in sources],
                        "rows": [per_source[s][1] for s in sources],
                    },
                    schema=SOURCES_SCHEMA,
                ))
                con.execute(f"INSERT INTO ingest_log SELECT * FROM {log_rows}")
                con.execute(
                    f"INSERT INTO sources SELECT * FROM {source_rows} ON CONFLICT (source_id) DO UPDATE SET "
                    "hwm = excluded.hwm, last_seen_ns = excluded.last_seen_ns, "
                    "batches = sources.batches + excluded.batches, rows = sources.rows + excluded.rows"
                )
                con.execute("COMMIT")
            except Exception:
                try:
                    con.execute("ROLLBACK")
                except Exception:
                    log.exception("collector: rollback failed")
                raise
        finally:
            staging.clear()
        return committed_ns

    def _fail(self, items: list[QueuedBatch | Barrier], why: str) -> None:
        """A commit failed: nothing of `items` is stored; end their streams so shippers resend."""
        seen: set[StreamReplies] = set()
        for item in items:
            if item.replies not in seen and not item.replies.failed:
                seen.add(item.replies)
                item.replies.failed = True
                item.replies.deliver(StreamEnd(store_failed=why))
