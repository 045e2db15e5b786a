"""Query.Watch's snapshots: one function the gRPC handler calls, on the collector's own cursor.

Until the live engine (collector/live) keeps per-run state, a snapshot is built by the bounded
queries of tracetop/snapshot.py (`WHERE step BETWEEN latest-N AND latest` on step, collective,
pipe_instr, memory, throughput; a time window on gpu_sample), on a cursor of the writer's own
connection, in a worker thread (never on the event loop). The Cursor remembers the newest
complete step, so finding the next one reads only rows at or after it: nothing re-reads the file.

When the live engine lands, `snapshot` is the one place to switch to its state.
"""

from __future__ import annotations

from tracetop import snapshot as snap

#: Rates a client may ask for, in seconds between snapshots.
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 60.0
DEFAULT_INTERVAL_S = 1.0


class UnknownRun(LookupError):
    """The asked-for run is not in this collector; str() lists the runs it has."""


def clamp_interval(interval_s: float) -> float:
    if not interval_s or interval_s != interval_s:  # 0 or NaN: the default
        return DEFAULT_INTERVAL_S
    return min(max(float(interval_s), MIN_INTERVAL_S), MAX_INTERVAL_S)


def newest_run(con) -> str | None:
    rows = con.execute(snap.RUNS_SQL).fetchall()
    return rows[-1][0] if rows else None


def snapshot(con, run_id: str, *, cursor: snap.Cursor | None = None,
             window_steps: int = snap.DEFAULT_WINDOW_STEPS) -> bytes:
    """Arrow IPC bytes of run `run_id`'s snapshot at its latest complete step (tracetop/snapshot.py
    says what it holds). `con` is a cursor owned by the calling thread. Raises UnknownRun."""
    try:
        s = snap.build(con, run_id, cursor=cursor, window_steps=window_steps, source="collector")
    except snap.SnapshotError as e:
        raise UnknownRun(str(e)) from e
    return snap.encode(s)
