"""The writer's INSERT path (writer.Staging): a commit's many batches stored exactly, a commit past a
DuckDB row group written as whole row groups (the cheap path: no WAL copy, no re-compression by the
next checkpoint, no partial row groups for checkpoints to merge), and the staged names registered
once, kept through a failed commit's ROLLBACK, and emptied after each commit."""

from __future__ import annotations

import math
import time

import numpy as np

from collector.ingest.schema import open_store
from collector.ingest.writer import (
    ROW_GROUP_ROWS,
    Ack,
    QueuedBatch,
    StreamEnd,
    StreamReplies,
    Writer,
    batch_to_arrow,
)
from tracetop.events import SCHEMAS, Kind
from tracetop.wire.codec import decode_batch, encode_batch

BATCH_ROWS = 16384


class _Acks(StreamReplies):
    def __init__(self) -> None:
        self.acks: list[Ack] = []
        self.ends: list[StreamEnd] = []

    def deliver(self, item) -> None:
        if isinstance(item, Ack):
            self.acks.append(item)
        else:
            self.ends.append(item)


def _queued(replies, kind: Kind, cols: dict, seq: int) -> QueuedBatch:
    n = len(next(iter(cols.values())))
    full = {c.name: cols.get(c.name, [""] * n if c.dtype == "str" else np.zeros(n)) for c in SCHEMAS[kind]}
    b = decode_batch(encode_batch(kind, full, source_id="ins", seq=seq, run_id="run-ins"))
    return QueuedBatch(replies, b, batch_to_arrow(b))


def test_one_commit_of_many_batches_is_stored_exactly_in_whole_row_groups(tmp_path) -> None:
    rng = np.random.default_rng(5)
    con = open_store(str(tmp_path / "w.duckdb"))
    replies = _Acks()
    writer = Writer(con, flush_rows=10**9, flush_interval_s=60.0)
    n_steps = 15  # 15 batches of STEP rows: 245,760 rows, two whole row groups
    ops_by_batch = [("all_reduce", "send"), ("recv", "all_reduce", "broadcast"), ("send",)]
    want_coll: list[tuple[int, int, str]] = []
    seq = 0
    for i in range(n_steps):
        seq += 1
        steps = np.arange(i * BATCH_ROWS, (i + 1) * BATCH_ROWS)
        writer.submit(_queued(replies, Kind.STEP, {"rank": steps % 7, "step": steps, "loss": steps / 3.0}, seq))
    for i, ops in enumerate(ops_by_batch):  # each batch its own dictionary: unified on the way in
        seq += 1
        n = 500
        picks = [ops[j] for j in rng.integers(0, len(ops), n)]
        writer.submit(_queued(replies, Kind.COLLECTIVE, {"rank": np.full(n, i), "step": np.arange(n), "op": picks}, seq))
        want_coll += [(i, s, op) for s, op in zip(range(n), picks)]
    writer.start()  # everything was queued before: one commit
    writer.close()
    assert replies.acks and replies.acks[-1].seq == seq
    rows = n_steps * BATCH_ROWS
    got = con.execute("SELECT count(*), sum(step), sum(rank), sum(loss), count(DISTINCT run_id) FROM step").fetchone()
    steps = np.arange(rows)
    assert got[:3] == (rows, int(steps.sum()), int((steps % 7).sum()))
    assert math.isclose(got[3], float((steps / 3.0).sum()), rel_tol=1e-12) and got[4] == 1
    assert sorted(con.execute("SELECT rank, step, op FROM collective").fetchall()) == sorted(want_coll)
    groups = con.execute("SELECT count(DISTINCT row_group_id) FROM pragma_storage_info('step')").fetchone()[0]
    assert groups == math.ceil(rows / ROW_GROUP_ROWS) == 2  # scanned on several threads: 3 (partial ones)
    con.close()


def test_vacuum_knob_reaches_the_file(tmp_path, monkeypatch) -> None:
    from collector.app import CollectorConfig, duckdb_settings, memory_budget

    budget = memory_budget(CollectorConfig(str(tmp_path / "v.duckdb"), "127.0.0.1:0"))
    for env, want in ((None, None), ("0", 0), ("7", 7)):
        if env is None:
            monkeypatch.delenv("TRACETOP_MAX_VACUUM_TASKS", raising=False)
        else:
            monkeypatch.setenv("TRACETOP_MAX_VACUUM_TASKS", env)
        con = open_store(str(tmp_path / "v.duckdb"), settings=duckdb_settings(budget))
        got = con.execute("SELECT current_setting('max_vacuum_tasks')").fetchone()[0]
        con.close()
        assert got == (want if want is not None else 0)  # off unless asked for (DuckDB's default: 100)


def test_staged_names_outlive_a_failed_commit_and_hold_no_rows_after_a_commit(tmp_path) -> None:
    """Three commits one after another on the writer thread: STEP rows; STEP rows of the same Arrow
    schema that the table refuses (run_id null: its INSERT fails inside the transaction, which is
    rolled back, and its stream is ended); STEP rows again, through the same registered names. The
    first and last are stored, nothing of the middle one; afterwards the staged names read no rows
    (a commit's Arrow memory let go)."""
    import pyarrow as pa

    con = open_store(str(tmp_path / "s.duckdb"))
    writer = Writer(con, flush_rows=1, flush_interval_s=0.0)
    good, bad, again = _Acks(), _Acks(), _Acks()
    first = _queued(good, Kind.STEP, {"step": np.arange(1000), "rank": np.zeros(1000)}, 1)
    refused = _queued(bad, Kind.STEP, {"step": np.arange(1000, 1500), "rank": np.ones(500)}, 2)
    null_run = pa.DictionaryArray.from_arrays(pa.array([None] * 500, pa.int32()), pa.array(["run-ins"]))
    refused = QueuedBatch(bad, refused.batch, refused.table.set_column(0, "run_id", null_run))
    assert refused.table.schema == first.table.schema
    last = _queued(again, Kind.STEP, {"step": np.arange(2000, 2300), "rank": np.full(300, 2)}, 3)
    writer.start()
    for item, replies in ((first, good), (refused, bad), (last, again)):
        writer.submit(item)
        deadline = time.monotonic() + 30
        while not (replies.acks or replies.ends) and time.monotonic() < deadline:
            time.sleep(0.01)
    writer.close()
    assert [a.seq for a in good.acks] == [1] and [a.seq for a in again.acks] == [3]
    assert not bad.acks and bad.ends and "Constraint" in bad.ends[0].store_failed
    got = con.execute("SELECT count(*), sum(step), count(DISTINCT rank) FROM step").fetchone()
    assert got == (1300, sum(range(1000)) + sum(range(2000, 2300)), 2)
    assert con.execute("SELECT list(seq ORDER BY seq) FROM ingest_log").fetchone()[0] == [1, 3]
    names = [n for (n,) in con.execute("SELECT view_name FROM duckdb_views() WHERE view_name LIKE '_tt_in_%'").fetchall()]
    assert sorted(names) == ["_tt_in_log", "_tt_in_sources", "_tt_in_step"]
    assert all(con.execute(f"SELECT count(*) FROM {n}").fetchone()[0] == 0 for n in names)
    con.close()
