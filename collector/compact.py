"""Small files small: a closed collector file rewritten with 16 KiB blocks.

DuckDB writes a file in 256 KiB blocks and a table's columns start blocks of their own, so a
short run's file is mostly block padding: a 300-step, 2-rank run came to 6.6 MB where its rows
are under 1 MB. `compact(path)` copies the closed file (tables, views, schema_meta: ``COPY FROM
DATABASE``) into a new file with ``BLOCK_SIZE 16384`` beside it and moves it over the original
with one ``os.replace``, only if the copy is smaller (small blocks compress a big table worse: a
synthetic 3.5-million-row table went from 17.6 MB to 68 MB): a crash midway leaves the original as
it was (and a ``.compact.tmp`` that the next compaction overwrites). The collector calls
`at_close` once its connection is closed (collector/app.py); files over TRACETOP_COMPACT_MAX_MB
(default 64) are left as they are: their blocks are full, and the copy takes longer (0.09 s for the
demo's 8.4 MB file, 0.34 s for a 17.6 MB one; docs/benchmarks.md, "Small files"). A copy that
fails leaves the file untouched and the log says why.

    python -m collector.compact FILE      # the same, by hand, on a file no collector holds
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass

from tracetop import env

log = logging.getLogger("collector")

BLOCK_SIZE = 16384
DEFAULT_MAX_MB = 64.0


@dataclass(frozen=True)
class Compacted:
    path: str
    before_bytes: int
    after_bytes: int
    seconds: float
    skipped: str = ""  # why the file was left as it is ("" when compacted)


def max_bytes(explicit_mb: float | None = None) -> float:
    """The largest file compacted: the argument, then TRACETOP_COMPACT_MAX_MB, then DEFAULT_MAX_MB (0: never)."""
    if explicit_mb is None:
        raw = env.get(env.TRACETOP_COMPACT_MAX_MB)
        try:
            explicit_mb = float(raw) if raw else DEFAULT_MAX_MB
        except ValueError:
            log.warning("collector: %s=%r is not a number of MB; using %g", env.TRACETOP_COMPACT_MAX_MB, raw,
                        DEFAULT_MAX_MB)
            explicit_mb = DEFAULT_MAX_MB
    return explicit_mb * 1e6


def compact(path: str, *, limit_bytes: float | None = None) -> Compacted:
    """Rewrite the closed file at ``path`` with small blocks, in place (atomic). Raises duckdb.Error
    on a copy that fails (the original stays); a file too big, with a WAL, or absent is skipped."""
    import duckdb

    t0 = time.monotonic()
    if not os.path.isfile(path):
        return Compacted(path, 0, 0, 0.0, "no such file")
    before = os.path.getsize(path)
    limit = max_bytes() if limit_bytes is None else limit_bytes
    if before > limit:
        return Compacted(path, before, before, 0.0, f"{before / 1e6:.0f} MB is over {limit / 1e6:.0f} MB")
    if os.path.exists(path + ".wal"):
        return Compacted(path, before, before, 0.0, "the file has a write-ahead log (not closed cleanly)")
    tmp = path + ".compact.tmp"
    for stale in (tmp, tmp + ".wal"):
        if os.path.exists(stale):
            os.remove(stale)
    con = duckdb.connect()
    try:
        con.execute(f"ATTACH '{_quote(path)}' AS src (READ_ONLY)")
        con.execute(f"ATTACH '{_quote(tmp)}' AS dst (BLOCK_SIZE {BLOCK_SIZE})")
        con.execute("COPY FROM DATABASE src TO dst")
        con.execute("DETACH dst")
        con.execute("DETACH src")
    except BaseException:
        con.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    con.close()
    after = os.path.getsize(tmp)
    if after >= before:  # big, well-compressed tables lose to small blocks (a 17.6 MB file came out at 68 MB)
        os.remove(tmp)
        return Compacted(path, before, before, time.monotonic() - t0,
                         f"the copy came to {after / 1e6:.1f} MB, not smaller")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return Compacted(path, before, after, time.monotonic() - t0)


def _quote(path: str) -> str:
    return path.replace("'", "''")


def at_close(path: str) -> Compacted | None:
    """The collector's close: compact, log what it did, never raise (the file stays as it was)."""
    try:
        c = compact(path)
    except Exception as e:
        log.warning("collector: the file was not compacted (%s: %s); it is complete as it is", type(e).__name__, e)
        return None
    if not c.skipped:
        log.info("collector: compacted %s: %.2f MB -> %.2f MB in %.2f s", path, c.before_bytes / 1e6,
                 c.after_bytes / 1e6, c.seconds)
    return c


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m collector.compact FILE   (a collector's file that no collector holds)", file=sys.stderr)
        return 2
    try:
        c = compact(args[0], limit_bytes=float("inf"))
    except Exception as e:
        print(f"collector.compact: {args[0]}: {e}; stop the collector that holds it first", file=sys.stderr)
        return 1
    if c.skipped:
        print(f"collector.compact: {args[0]}: left as it is: {c.skipped}", file=sys.stderr)
        return 1
    print(f"{c.path}: {c.before_bytes / 1e6:.2f} MB -> {c.after_bytes / 1e6:.2f} MB in {c.seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
