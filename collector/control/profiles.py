"""Profiling windows' traces as they come in (``Control.Profile``, trainer_hooks/profiling.py), and
how they are read back (the Perfetto export, `tracetop profile`, the report).

Kept in the run's file: ``profile_chunks`` holds the gzip'd Chrome/Perfetto JSON in its pieces (at
most 1 MiB each), ``profile_traces`` one row per rank and window once its last piece came. In the
file rather than beside it: the trace travels with the file (a copy, a compaction, the read-only
TUI), and nothing dangles when a file moves. Bounded: 64 MiB a rank and window (the rank does not
send more; a piece past the cap is refused here too), at most 16 ranks and 100 steps a window
(collector/control/check.py).
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import grpc

#: the largest trace kept for one rank's window (trainer_hooks/profiling.py MAX_TRACE_BYTES)
MAX_TRACE_BYTES = 64 << 20


class Traces:
    """The next offset expected of each (action, rank) whose trace is on its way."""

    def __init__(self) -> None:
        self.expected: dict[tuple[str, int], int] = {}
        self.done: set[tuple[str, int]] = set()

    def take(self, c: Any, now_ns: int) -> list[tuple[str, list]]:
        """Rows to write for piece ``c`` (a pb.ProfileChunk); raises on one out of order or over the cap."""
        from collector.control.service import ControlError

        key = (c.command_id, int(c.rank))
        if key in self.done:
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"action {c.command_id}: rank {c.rank}'s trace is already stored")
        rows: list[tuple[str, list]] = []
        if c.last and not c.data and c.total_bytes == 0:  # nothing (more) sent: say why
            self.expected.pop(key, None)  # pieces sent before (this collector's, or one before a restart): dropped
            rows.append(("drop", [c.run_id, c.command_id, int(c.rank)]))
            self.done.add(key)
            rows.append(("trace", _trace_row(c, "not_sent", 0, now_ns)))
            return rows
        want = self.expected.get(key, 0)
        if c.offset != want:
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"action {c.command_id} rank {c.rank}: piece at byte {c.offset}, expected {want}")
        end = want + len(c.data)
        if end > MAX_TRACE_BYTES:
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"action {c.command_id} rank {c.rank}: the trace passes the {MAX_TRACE_BYTES >> 20} MiB cap")
        rows.append(("chunk", [c.run_id, c.command_id, int(c.rank), int(c.offset), bytes(c.data)]))
        if c.last:
            if c.total_bytes != end:
                raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"action {c.command_id} rank {c.rank}: {end} bytes came, the rank sent {c.total_bytes}")
            self.expected.pop(key, None)
            self.done.add(key)
            rows.append(("trace", _trace_row(c, "stored", end, now_ns)))
        else:
            self.expected[key] = end
        return rows


def _trace_row(c: Any, state: str, nbytes: int, now_ns: int) -> list:
    return [c.run_id, c.command_id, int(c.rank), state, int(c.first_step), int(c.steps), int(c.start_ns),
            int(c.end_ns), nbytes, c.note, now_ns]


def write(cur: Any, rows: list[tuple[str, list]]) -> None:
    """The control path's writing thread, inside its transaction."""
    for what, row in rows:
        if what == "chunk":
            cur.execute("INSERT INTO profile_chunks VALUES (?, ?, ?, ?, ?)", row)
        elif what == "drop":
            cur.execute("DELETE FROM profile_chunks WHERE run_id = ? AND action_id = ? AND rank = ?", row)
        else:
            cur.execute("INSERT INTO profile_traces VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)


# ---------------------------------------------------------------------- reading back
def traces(con: Any, run_id: str | None = None) -> list[dict]:
    """The windows stored (one dict a rank and window), oldest first; [] for a file without them."""
    from collector.query.post_file import has_relation

    if not has_relation(con, "profile_traces"):
        return []
    where, args = ("WHERE run_id = ?", [run_id]) if run_id else ("", [])
    cur = con.execute(f"SELECT * FROM profile_traces {where} ORDER BY start_ns, rank", args)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def trace_json(con: Any, run_id: str, action_id: str, rank: int) -> dict:
    """One stored trace, parsed (the Chrome/Perfetto JSON the profiler wrote)."""
    parts = con.execute('SELECT data FROM profile_chunks WHERE run_id = ? AND action_id = ? AND rank = ? '
                        'ORDER BY "offset"', [run_id, action_id, rank]).fetchall()
    return json.loads(gzip.decompress(b"".join(bytes(p[0]) for p in parts)))


def wall_ns(trace: dict, ts_us: float) -> int:
    """An event's wall clock ns: Kineto writes ``ts`` in microseconds after ``baseTimeNanoseconds``."""
    return int(trace.get("baseTimeNanoseconds", 0) or 0) + int(round(float(ts_us) * 1000))
