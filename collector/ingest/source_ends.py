"""Sources that ended without their clean close: a GAP row says so, with the last seq stored.

A rank's hooks end their telemetry with a last heartbeat whose phase is ``closed``
(trainer_hooks.tracer.Tracer.close: everything before it was handed on or counted in a GAP row of
its own). A source that sent heartbeats, then fell silent for ``after_s`` without that heartbeat,
ended some other way: killed (-9, OOM), its node lost, or cut off. What it had handed on (acked by
the collector, or on an agent's spool, which delivers it later) is stored exactly once; what was
only in its memory is lost, and nobody can count it. So the collector records one GAP row for it:

    rank, step        the source's rank and the step of its last heartbeat
    start_ns          when the collector last committed anything of it
    duration_ns       how long it had been silent when the row was written
    kind "unknown", dropped 0      the rows lost are not known (0: nothing is claimed as counted)
    reason "unclosed:last_seq=N"   N: the last batch seq stored for that source
    origin_source     the source id

If such a source is heard again (it was cut off, not gone: an agent's spool delivers late), a
second row ``reason "resumed:seq=N"`` (dropped 0) says the first one no longer stands alone.

The watch outlives a restart of the collector: it is kept in the file's ``source_watch`` table
(the collector's own bookkeeping, created here, not part of the versioned schema), saved every few
seconds and at a clean stop, and loaded at start; a source heard before the restart that never
closes gets its row (its silence counted from when it was last heard, by the wall clock across the
restart), and one already reported is not reported again. Only sources that send heartbeats
(trainer ranks) are watched, at most ``max_sources`` at once (the least recently heard let go,
counted in ``sources_dropped``); rows are written through the writer like any batch, by a source
of the collector's own (``collector:ends:<id>``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tracetop.events import Kind

log = logging.getLogger("tracetop.collector")

CLOSED_PHASE = "closed"
DEFAULT_AFTER_S = 30.0


@dataclass
class _Source:
    run_id: str
    rank: int = -1
    step: int = -1
    last_seq: int = 0
    last_ns: int = 0
    reported: bool = False
    last_mono_ns: int = 0  # the collector's monotonic clock at the latest commit (for the silence interval)


def _last_string(col, i: int) -> str:
    codes, dictionary = col
    return str(dictionary[int(codes[i])]) if len(dictionary) else ""


class SourceEnds:
    """Fed by the writer's on_commit (cheap, never blocks); ``tick(now_ns)`` returns the GAP rows due,
    per run (pure; the thread started by ``start`` writes them through ``submit``)."""

    def __init__(self, *, after_s: float = DEFAULT_AFTER_S, clock_ns: Callable[[], int] = time.time_ns,
                 mono_ns: Callable[[], int] = time.monotonic_ns, max_sources: int = 1 << 18) -> None:
        self.after_s = after_s
        self.clock_ns = clock_ns  # the collector's wall clock: the rows' times
        self.mono_ns = mono_ns  # the collector's monotonic clock: how long a source has been silent
        #: the most sources watched at once; past it the least recently heard is let go, counted
        self.max_sources = max_sources
        self.sources_dropped = 0
        self._lock = threading.Lock()
        self._watched: dict[str, _Source] = {}  # heartbeat sources not (yet) closed
        self._resumed: list[tuple[str, _Source]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.own_source = f"collector:ends:{uuid.uuid4().hex[:12]}"
        self._seq = 0
        self.rows_written = 0
        self._changes = 0  # bumped at every change of the watch; save() writes when it moved
        self._saved_changes = 0
        self.loaded = 0  # sources loaded from the file at start
        self._cur = None

    # -- the writer's side ------------------------------------------------------------------
    def on_commit(self, batches: Sequence) -> None:
        now, mono = self.clock_ns(), self.mono_ns()
        with self._lock:
            self._changes += 1
            for b in batches:
                if b.source_id == self.own_source:
                    continue
                s = self._watched.get(b.source_id)
                if b.kind == Kind.HEARTBEAT and b.n:
                    if s is None:
                        s = self._watched[b.source_id] = _Source(b.run_id)
                        if len(self._watched) > self.max_sources:
                            self._watched.pop(next(iter(self._watched)))  # the least recently heard
                            self.sources_dropped += 1
                    else:  # kept in order of last heard (dicts keep insertion order)
                        self._watched[b.source_id] = self._watched.pop(b.source_id)
                    i = int(np.argmax(np.asarray(b.columns["start_ns"])))
                    if _last_string(b.columns["phase"], i) == CLOSED_PHASE:
                        del self._watched[b.source_id]  # a clean close: nothing to say
                        continue
                    s.rank = int(b.columns["rank"][i])
                    s.step = int(b.columns["step"][i])
                if s is None:
                    continue
                s.last_seq = max(s.last_seq, int(b.seq))
                s.last_ns, s.last_mono_ns = now, mono
                if s.reported:
                    s.reported = False
                    self._resumed.append((b.source_id, _Source(s.run_id, s.rank, s.step, s.last_seq, now)))

    # -- the timer ----------------------------------------------------------------------------
    def tick(self, now_ns: int, mono_now_ns: int | None = None) -> dict[str, list[tuple]]:
        """run_id -> GAP rows (schema order) due now: sources silent for after_s, and resumed ones.
        ``mono_now_ns`` (the monotonic clock, as the thread passes it): the silence is measured on it,
        so a collector clock stepped forward writes no false row; None: on ``now_ns`` (tests)."""
        out: dict[str, list[tuple]] = {}
        with self._lock:
            for source_id, s in self._watched.items():
                silent_ns = now_ns - s.last_ns if mono_now_ns is None else mono_now_ns - s.last_mono_ns
                if not s.reported and silent_ns > self.after_s * 1e9:
                    s.reported = True
                    self._changes += 1
                    out.setdefault(s.run_id, []).append(
                        (s.rank, s.step, s.last_ns, silent_ns, "unknown", 0, f"unclosed:last_seq={s.last_seq}", source_id))
            for source_id, s in self._resumed:
                out.setdefault(s.run_id, []).append(
                    (s.rank, s.step, s.last_ns, 0, "unknown", 0, f"resumed:seq={s.last_seq}", source_id))
            self._resumed.clear()
        return out

    def batches(self, now_ns: int, mono_now_ns: int | None = None):
        """The rows due now as encoded batches of the collector's own source (one per run)."""
        from tracetop.events import SCHEMAS
        from tracetop.wire.codec import encode_batch

        for run_id, rows in self.tick(now_ns, mono_now_ns).items():
            cols = {c.name: [r[j] for r in rows] for j, c in enumerate(SCHEMAS[Kind.GAP])}  # encode casts
            self._seq += 1
            yield encode_batch(Kind.GAP, cols, source_id=self.own_source, seq=self._seq, run_id=run_id,
                               first_record_ns=now_ns), len(rows)

    # -- kept in the file ---------------------------------------------------------------------
    _COLUMNS = ("source_id", "run_id", "rank", "step", "last_seq", "last_ns", "reported")

    def attach(self, con) -> SourceEnds:
        """Keep the watch in ``con``'s file (its own cursor): load what a previous collector left."""
        self._cur = con.cursor()
        self._cur.execute("""CREATE TABLE IF NOT EXISTS source_watch (
            source_id VARCHAR, run_id VARCHAR, rank INTEGER, step BIGINT, last_seq UBIGINT,
            last_ns BIGINT,     -- collector clock when it was last heard
            reported BOOLEAN    -- its unclosed row is written
        )""")
        rows = self._cur.execute(f"SELECT {', '.join(self._COLUMNS)} FROM source_watch ORDER BY last_ns").fetchall()
        now, mono = self.clock_ns(), self.mono_ns()
        with self._lock:
            for sid, run, rank, step, seq, last_ns, reported in rows:
                if sid in self._watched:
                    continue
                src = _Source(run, int(rank), int(step), int(seq), int(last_ns), bool(reported))
                src.last_mono_ns = mono - max(0, now - int(last_ns))  # silent since then, across the restart
                self._watched[sid] = src
            self.loaded = len(rows)
        return self

    def save(self) -> None:
        """Write the watch to the file (one transaction; nothing when nothing changed)."""
        cur = getattr(self, "_cur", None)
        if cur is None:
            return
        import pyarrow as pa

        with self._lock:
            if self._saved_changes == self._changes:
                return
            changes = self._changes
            rows = [(sid, s.run_id, s.rank, s.step, s.last_seq, s.last_ns, s.reported) for sid, s in self._watched.items()]
        cols = list(zip(*rows)) if rows else [[] for _ in self._COLUMNS]
        types = [pa.string(), pa.string(), pa.int32(), pa.int64(), pa.uint64(), pa.int64(), pa.bool_()]
        table = pa.table([pa.array(c, t) for c, t in zip(cols, types)], names=list(self._COLUMNS))
        cur.execute("BEGIN")
        try:
            cur.execute("DELETE FROM source_watch")
            cur.register("_tracetop_watch", table)
            cur.execute("INSERT INTO source_watch SELECT * FROM _tracetop_watch")
            cur.unregister("_tracetop_watch")
            cur.execute("COMMIT")
        except Exception:
            cur.execute("ROLLBACK")
            raise
        self._saved_changes = changes

    def start(self, submit: Callable[[object], bool], tick_s: float = 1.0, save_every_s: float = 5.0) -> SourceEnds:
        """Write due rows every tick_s through ``submit(pb.ColumnBatch) -> bool`` (on a daemon thread),
        and save the watch to the file (``attach``) every save_every_s."""
        def loop() -> None:
            next_save = time.monotonic() + save_every_s
            while not self._stop.wait(tick_s):
                try:
                    for batch, n in self.batches(self.clock_ns(), self.mono_ns()):
                        if submit(batch):
                            self.rows_written += n
                    if time.monotonic() >= next_save:
                        next_save = time.monotonic() + save_every_s
                        self.save()
                except Exception:  # the watch never takes the collector down
                    log.exception("collector: recording unclosed sources failed")

        self._thread = threading.Thread(target=loop, name="tracetop-source-ends", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def close(self) -> None:
        """Save the watch one last time (after the writer's last commits) and let the file go."""
        self.stop()
        try:
            self.save()
        except Exception:
            log.exception("collector: saving the source-end watch failed")
        cur = getattr(self, "_cur", None)
        if cur is not None:
            cur.close()
            self._cur = None

