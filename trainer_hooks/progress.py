"""A rank's progress record: what a SIGKILL takes from it is counted by a neighbour.

A rank killed outright (SIGKILL, the OOM killer) loses what its hooks held in memory: the steps it
completed since its last acked shipment. Nobody can count them from the wire (whatever would tell
them had to leave the rank after its death). So each Tracer keeps two counters in a small file in
shared memory (``/dev/shm/tracetop-<uid>/``, mode 0600 in a 0700 folder of the user's own):

    steps completed (the training thread, one ``struct.pack_into`` a step: a memory store)
    STEP rows the endpoint acked (the shipper's sender thread, on each ack)

A clean close, or an exit flush that got everything acked, removes the file. A file whose process
is gone and whose counts differ is a rank that died holding steps: the first Tracer of the same
user on that node to look (a surviving rank at its SIGTERM or exit flush: torchrun ends the other
ranks of the node right after one dies; or the next job's ranks at their start) claims it (an
atomic rename: exactly one claimer) and ships one GAP row for it: ``rank`` and ``run_id`` of the
dead rank, ``step`` its last completed step, ``kind 'step'``, ``dropped`` = completed − acked,
``reason 'died_unacked:steps=A-B'`` (the steps, for the completed steps are numbered in order),
``origin_source`` its source id (as its own source ``<source_id>:lost``, seq 1). The count is of
steps not *acked*: a shipment the endpoint stored but had not acked when the process died is
counted too (so it can exceed the loss; the steps named tell a reader which to look for); it never
falls short. Not counted: ranks whose whole node died, or whose node never runs
tracetop again (the collector's ``unclosed`` row still marks them); STEP rows the dead rank had
itself dropped and counted (its buffer bound) would be counted twice.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from tracetop.events import Kind

MAGIC = b"TTP1"
#: magic, pid, steps completed, the last step completed, STEP rows acked, header length; then the
#: JSON header (run id, rank, source id)
_HEAD = struct.Struct("<4sqqqqi")
_COMPLETED, _ACKED = 12, 28  # completed and last step: one pack at 12
_PAIR = struct.Struct("<qq")
SIZE = 4096
#: the reason's prefix; the reason names the steps: ``died_unacked:steps=A-B``
REASON = "died_unacked"


def reason(first: int, last: int) -> str:
    """The GAP row's reason for steps ``first``..``last`` completed and not acked at the death."""
    return f"{REASON}:steps={first}-{last}"


def folder() -> Path:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"tracetop-{os.getuid()}"


def _own_folder() -> Path | None:
    """The folder, created 0700, and only if it is a real folder of this user's (never a link)."""
    d = folder()
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError:
        return None
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return d


class Progress:
    """This rank's record (see the module doc). Every method is cheap and never raises."""

    def __init__(self, run_id: str, rank: int, source_id: str) -> None:
        self.completed = 0
        self.acked = 0
        self.path: Path | None = None
        self._mm: mmap.mmap | None = None
        d = _own_folder()
        if d is None:
            return
        path = d / f"{os.getpid()}-{rank}.progress"
        header = json.dumps({"run_id": run_id, "rank": rank, "source_id": source_id}).encode()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        except OSError:
            return
        try:
            os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        except OSError:
            os.close(fd)
            return
        os.close(fd)
        _HEAD.pack_into(self._mm, 0, MAGIC, os.getpid(), 0, -1, 0, len(header))
        self._mm[_HEAD.size:_HEAD.size + len(header)] = header
        self.path = path

    def step_done(self, step: int) -> None:
        """The training thread: one more step completed (``step``)."""
        mm = self._mm
        if mm is not None:
            self.completed += 1
            _PAIR.pack_into(mm, _COMPLETED, self.completed, step)

    def on_acked(self, kind: int, rows: int) -> None:
        """The shipper's sender: ``rows`` of ``kind`` acked."""
        mm = self._mm
        if mm is not None and kind == Kind.STEP:
            self.acked += rows
            struct.pack_into("<q", mm, _ACKED, self.acked)

    def remove(self) -> None:
        """Everything is handed over (a clean close): no record is left behind."""
        mm, path = self._mm, self.path
        self._mm = self.path = None
        try:
            if path is not None:
                path.unlink()
            if mm is not None:
                mm.close()
        except (OSError, BufferError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead too (its parent has not reaped it yet)
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:][:1] != "Z"
    except (OSError, ValueError):
        return True


def read(path: Path) -> dict | None:
    try:
        data = path.read_bytes()[:SIZE]
        magic, pid, completed, last_step, acked, n = _HEAD.unpack_from(data, 0)
        if magic != MAGIC:
            return None
        return {"pid": pid, "completed": completed, "last_step": last_step, "acked": acked,
                **json.loads(data[_HEAD.size:_HEAD.size + n].decode())}
    except (OSError, ValueError, struct.error):
        return None


def claim_dead(sink: Any, run_id: str, clock_ns: Any = time.time_ns) -> int:
    """Count the steps of every dead rank of ``run_id`` whose record is in the folder, as a GAP row
    through ``sink`` (``forward``); returns the steps counted. Records of dead processes with
    nothing to count are removed, whatever their run. Never raises."""
    from tracetop.wire.codec import encode_batch

    total = 0
    try:
        d = _own_folder()
        if d is None:
            return 0
        for path in d.glob("*.progress"):
            try:
                pid = int(path.name.split("-", 1)[0])
            except ValueError:
                continue
            if pid == os.getpid() or _alive(pid):
                continue
            rec = read(path)
            if rec is not None and rec["completed"] > rec["acked"] and rec.get("run_id") != run_id:
                continue  # another run's loss: left to its own ranks (a restart under the same run id)
            claimed = path.with_name(f"{path.name}.claimed-{os.getpid()}")
            try:
                os.rename(path, claimed)  # one claimer only
            except OSError:
                continue
            rec = read(claimed)
            try:
                if rec is None or rec["completed"] <= rec["acked"]:
                    continue
                lost = rec["completed"] - rec["acked"]
                now = clock_ns()
                row = {"rank": [int(rec["rank"])], "step": [rec["last_step"]], "start_ns": [now],
                       "duration_ns": [0], "kind": ["step"], "dropped": [lost],
                       "reason": [reason(rec["last_step"] - lost + 1, rec["last_step"])],
                       "origin_source": [str(rec["source_id"])]}
                batch = encode_batch(Kind.GAP, row, source_id=f"{rec['source_id']}:lost", seq=1,
                                     run_id=str(rec["run_id"]), first_record_ns=now)
                if sink.forward(batch):
                    total += lost
            finally:
                try:
                    claimed.unlink()
                except OSError:
                    pass
    except Exception:
        return total
    return total
