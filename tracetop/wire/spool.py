"""The shipper's durable spool: one file per batch, root/<source key>/<seq:020d>.batch.

The source key is ``codec.source_key``: the source id, ``@<epoch>`` after it when the batch has
an epoch (one start of its shipper), so two starts of a source with a fixed id never share a file.

Each file is the batch's protobuf bytes, written to a dot-tmp file, fsynced and renamed, so a
kill -9 leaves either the whole batch or a tmp file (removed at the next start: never acked, its
producer resends it). A file that cannot be parsed back is renamed to ``<name>.unreadable`` (kept
for a look, never replayed again) and its loss recorded once; ``header`` recovers its kind and row
count when the damage lies past them (they are serialised first).

A write that fails (disk full: ENOSPC, a file-size limit: EFBIG, any OSError) leaves nothing
behind: its tmp file is removed, its size is no longer counted (one disk-full episode does not
make the spool "full" for good), and the caller is told (``SpoolWriteError``): the shipper keeps
its own batch in memory and counts the failure, the relay refuses the hook's batch (the hook
keeps it). After the rename the folder is fsynced, so an acked batch's file survives a power cut.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from tracetop.errors import TracetopError
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import source_key, source_of_key
from tracetop.wire.ledger import DropLedger

log = logging.getLogger("tracetop.shipper")

UNREADABLE_SUFFIX = ".unreadable"


class SpoolWriteError(TracetopError, OSError):
    """A batch could not be written to the spool (nothing of it is left there)."""


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Header(NamedTuple):
    """What can be told of a spooled batch from its path and its first bytes (-1: unknown)."""

    source_id: str
    seq: int
    kind: int
    n: int


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def scan_header(data: bytes) -> tuple[int, int]:
    """(kind, n) from a ColumnBatch's bytes, reading fields in order until one is damaged
    (-1 for what was not reached). Fields 5 (kind) and 6 (n) come before the columns."""
    kind = n = -1
    i = 0
    try:
        while i < len(data) and (kind < 0 or n < 0):
            tag, i = _varint(data, i)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                value, i = _varint(data, i)
                if field == 5:
                    kind = value
                elif field == 6:
                    n = value
            elif wire == 2:
                length, i = _varint(data, i)
                i += length
            elif wire == 5:
                i += 4
            elif wire == 1:
                i += 8
            else:
                break
    except ValueError:
        pass
    return kind, n


def check_owned(folder: Path) -> None:
    """Refuse a spool folder another user could have prepared: a symlink, a folder owned by
    someone else, or one others may write (its files are replayed to the collector as data)."""
    import stat

    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise SpoolOwnerError(f"tracetop: spool folder {folder} is a symbolic link (to {os.readlink(folder)}); "
                              "give --spool-dir a real folder of this user's")
    if not stat.S_ISDIR(st.st_mode):
        raise SpoolOwnerError(f"tracetop: spool folder {folder} is not a folder; give --spool-dir a folder")
    if st.st_uid != os.geteuid():
        raise SpoolOwnerError(f"tracetop: spool folder {folder} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {os.geteuid()}); another user may have made it: remove it, or give --spool-dir "
                              "a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SpoolOwnerError(f"tracetop: spool folder {folder} may be written by other users (mode "
                              f"{stat.S_IMODE(st.st_mode):o}); run `chmod go-w {folder}` or give --spool-dir another")


class SpoolOwnerError(TracetopError, OSError):
    """A spool folder this user does not own alone (see ``check_owned``)."""


class Spool:
    """Writes, reads back, removes and replays spooled batches; ``bytes`` is what it holds."""

    def __init__(self, root: Path, max_bytes: int, fsync: bool) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.bytes = 0
        self._lock = threading.Lock()
        self._tmp_counter = itertools.count()
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"tracetop: cannot create spool folder {root}: {e}; pass --spool-dir to a writable folder") from e
        check_owned(root)

    def write(self, batch: pb.ColumnBatch, nbytes: int) -> Path | None:
        """The batch's file once it is on disk; None when it would not fit under max_bytes.
        Raises SpoolWriteError when the disk refuses it (full, a file-size limit): then nothing
        of it is on the spool, no tmp file is left and its size is not counted."""
        with self._lock:
            if self.bytes + nbytes > self.max_bytes:
                return None
            self.bytes += nbytes
        folder = self.root / source_key(batch.source_id, batch.epoch)
        path = folder / f"{batch.seq:020d}.batch"
        tmp = folder / f".{batch.seq:020d}.{os.getpid()}.{next(self._tmp_counter)}.tmp"
        try:
            new_folder = not folder.is_dir()
            if new_folder:
                folder.mkdir(exist_ok=True)
            data = batch.SerializeToString()
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(folder)  # the rename itself is durable
                if new_folder:
                    _fsync_dir(self.root)
        except OSError as e:
            with self._lock:
                self.bytes = max(0, self.bytes - nbytes)  # not on disk: not counted
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise SpoolWriteError(e.errno, f"spool write of batch {batch.source_id}/{batch.seq} to {folder} "
                                  f"failed: {e.strerror or e}") from e
        return path

    def read(self, path: Path) -> pb.ColumnBatch | None:
        try:
            return pb.ColumnBatch.FromString(path.read_bytes())
        except Exception:  # OSError, DecodeError: unreadable either way
            return None

    def remove(self, path: Path, nbytes: int) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return
        with self._lock:
            self.bytes = max(0, self.bytes - nbytes)

    def header(self, path: Path) -> Header:
        """What the path and whatever bytes survive say of an unreadable batch."""
        try:
            seq = int(path.name.split(".", 1)[0])
        except ValueError:
            seq = -1
        try:
            kind, n = scan_header(path.read_bytes())
        except OSError:
            kind = n = -1
        return Header(path.parent.name, seq, kind, n)  # source_id: the folder's name, the source key

    def set_aside(self, path: Path, nbytes: int = 0) -> None:
        """An unreadable file: renamed so it is never replayed again (and no longer counted)."""
        try:
            os.replace(path, path.with_name(path.name + UNREADABLE_SUFFIX))
        except FileNotFoundError:
            return
        except OSError:
            path.unlink(missing_ok=True)
        with self._lock:
            self.bytes = max(0, self.bytes - nbytes)

    def load(self) -> Iterator[tuple[Path, pb.ColumnBatch | None]]:
        """Yield (path, batch) for every spooled batch, per source in seq order; batch is None
        for a file that cannot be read back (the caller records the loss and sets it aside)."""
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)  # an interrupted write: never acked, the hook resends it
            for path in sorted(folder.glob("*.batch")):
                batch = self.read(path)
                if batch is None:
                    log.warning("tracetop: unreadable spool file %s set aside; its loss is recorded as a gap", path)
                    yield path, None
                    continue
                with self._lock:
                    self.bytes += batch.ByteSize()
                yield path, batch

    def replay(self, ledger: DropLedger, high_water: dict[str, int]) -> Iterator[tuple[Path, pb.ColumnBatch]]:
        """Every readable batch on the spool, oldest first (what a killed predecessor accepted), for
        the outbox. ``high_water`` gets each source's highest seq found. An unreadable file is lost:
        its seq still counts as accepted (a resend of it is a duplicate to the relay), so its loss
        is noted in ``ledger`` exactly once, here, and the file is set aside.
        ``high_water`` is keyed by source key (``codec.source_key``: id and epoch)."""
        for path, batch in self.load():
            if batch is None:
                h = self.header(path)
                if h.seq > 0:
                    high_water[h.source_id] = max(high_water.get(h.source_id, 0), h.seq)
                origin = source_of_key(h.source_id)
                if h.kind >= 0 and h.n >= 0:
                    ledger.note_batch(h.kind, "spool_unreadable", origin, h.n)
                else:
                    ledger.note("batch", "spool_unreadable", origin, 1, batches=1)
                self.set_aside(path)
                continue
            key = source_key(batch.source_id, batch.epoch)
            high_water[key] = max(high_water.get(key, 0), batch.seq)
            yield path, batch
