"""The writer cuts a large take into commits of at most COMMIT_TABLE_ROWS rows of one table (DuckDB's
optimistic writes past a row group cost memory and file): in order, every row stored once, each
stream's acks before its end."""

from __future__ import annotations

import threading

import numpy as np

from collector.ingest.schema import open_store
from collector.ingest.writer import (
    Ack,
    Barrier,
    QueuedBatch,
    StreamEnd,
    StreamReplies,
    Writer,
    batch_to_arrow,
)
from tracetop.events import SCHEMAS, Kind
from tracetop.wire.codec import decode_batch, encode_batch


class _Replies(StreamReplies):
    def __init__(self) -> None:
        self.got: list = []
        self.ended = threading.Event()

    def deliver(self, item) -> None:
        self.got.append(item)
        if isinstance(item, StreamEnd):
            self.ended.set()


def _batch(seq: int, n: int):
    steps = np.arange((seq - 1) * n, seq * n, dtype="<i8")
    cols = {c.name: steps for c in SCHEMAS[Kind.STEP]}
    cols.update(rank=np.zeros(n, "<i4"), micro_batch=np.zeros(n, "<i4"), micro_batches=np.ones(n, "<i4"),
                loss=np.zeros(n))
    return decode_batch(encode_batch(Kind.STEP, cols, source_id="src", seq=seq, run_id="r"))


def test_a_take_over_the_table_bound_commits_in_parts_in_order(tmp_path) -> None:
    con = open_store(str(tmp_path / "w.duckdb"))
    writer = Writer(con, flush_rows=10**9, flush_interval_s=5.0)  # one take: everything queued below
    replies = _Replies()
    n = 60_000  # two batches exceed the bound (100,000): three commits
    for seq in (1, 2, 3):
        b = _batch(seq, n)
        assert writer.submit(QueuedBatch(replies, b, batch_to_arrow(b)))
    writer.submit(Barrier(replies, StreamEnd()))
    writer.start()
    try:
        assert replies.ended.wait(120)
    finally:
        writer.close()
    acks = [a.seq for a in replies.got if isinstance(a, Ack)]
    assert acks == [1, 2, 3] and replies.got[-1] == StreamEnd()
    assert con.execute("SELECT count(*), count(DISTINCT step) FROM step").fetchone() == (3 * n, 3 * n)
    commits = con.execute("SELECT count(DISTINCT committed_ns), max(n) FROM ingest_log").fetchone()
    assert commits == (3, n)
    assert con.execute("SELECT hwm FROM sources WHERE source_id = 'src'").fetchone()[0] == 3
    con.close()
