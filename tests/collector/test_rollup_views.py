"""step_summary and collective_stats over the rollups (migration _v9, collector/ingest/rollup.py) against
the exact computation over the raw rows: counts and sums equal, quantiles within rollup.REL_ERROR
(exact where a bucket's end is the value). On the migrated fixture (a real run's file, rolled up
by the migration), on a file a real collector wrote over gRPC in several commits (rolled up by
the writer), and over two files of different schema versions (tracetop query A B)."""

from __future__ import annotations

import shutil
import time
from collections import defaultdict

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from collector.ingest import rollup
from collector.ingest.schema import open_store
from collector.ingest.writer import QueuedBatch, StreamReplies, Writer, batch_to_arrow
from collector.query.multifile import connect_many
from tests.collector.util import Feeder
from tests.support import ROOT
from tests.support.services import start_collector
from tracetop.events import Kind, table_name
from tracetop.wire.codec import decode_batch, encode_batch

FIXTURE = ROOT / "tests" / "fixtures" / "straggler_run.duckdb"
TOL = rollup.REL_ERROR * (1 + 1e-9)


def _q(values, q: float) -> float:
    return float(np.quantile(np.asarray(values, dtype=np.float64), q))  # linear: quantile_cont's rule


def _size_bucket(b: int) -> str:
    return "<1KiB" if b < 1024 else "1KiB-1MiB" if b < 1 << 20 else "1MiB-64MiB" if b < 1 << 26 else ">=64MiB"


def _factor(op: str, n: int) -> float:
    if op.startswith("all_reduce"):
        return 2.0 * (n - 1) / n
    if "all_gather" in op or "reduce_scatter" in op or op.startswith("all_to_all"):
        return (n - 1) / n
    return 1.0


def expected_step_summary(con) -> dict:
    g = defaultdict(list)
    for run, rank, d, c, x, w in con.execute(
            "SELECT run_id, rank, duration_ns, compute_ns, comm_exposed_ns, data_wait_ns FROM step").fetchall():
        g[(run, rank)].append((d, c, x, w))
    out = {}
    for key, rows in g.items():
        d, c, x, w = (list(col) for col in zip(*rows))
        out[key] = (len(rows), _q(d, .5) / 1e6, _q(d, .99) / 1e6, _q(c, .5) / 1e6, _q(x, .5) / 1e6, _q(w, .5) / 1e6)
    return out


def expected_collective_stats(con) -> dict:
    g = defaultdict(list)
    for run, op, role, n, b, d in con.execute(
            "SELECT run_id, op, role, group_size, bytes, duration_ns FROM collective WHERE group_size > 0").fetchall():
        g[(run, op, role, n, _size_bucket(b))].append((b, d))
    out = {}
    for (run, op, role, n, sb), rows in g.items():
        b, d = (list(col) for col in zip(*rows))
        algbw = [x / y for x, y in rows if y != 0]
        out[(run, op, role, n, sb)] = (len(rows), sum(b), _q(b, .5), _q(d, .5) / 1e6, _q(d, .99) / 1e6,
                                       _q(algbw, .5), _q(algbw, .5) * _factor(op, n))
    return out


def check_views(con, want_steps: dict, want_colls: dict) -> None:
    got = {(r[0], r[1]): r[2:] for r in con.execute("SELECT * FROM step_summary").fetchall()}
    assert set(got) == set(want_steps)
    for key, want in want_steps.items():
        assert got[key][0] == want[0], key  # steps: exact
        assert got[key][1:] == pytest.approx(want[1:], rel=TOL, abs=1e-12), key
    cols = [r[0] for r in con.execute("DESCRIBE collective_stats").fetchall()]
    assert cols[:5] == ["run_id", "op", "role", "group_size", "size_bucket"]
    got = {r[:5]: r[5:] for r in con.execute("SELECT * FROM collective_stats").fetchall()}
    assert set(got) == set(want_colls)
    for key, want in want_colls.items():
        assert got[key][:2] == want[:2], key  # calls, total_bytes: exact
        assert got[key][2:] == pytest.approx(want[2:], rel=TOL, abs=1e-15), key


def test_migrated_fixture_views_equal_the_raw_rows(tmp_path) -> None:
    db = tmp_path / "f.duckdb"
    shutil.copy(FIXTURE, db)
    old = duckdb.connect(str(db), read_only=True)
    assert not old.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'step_rollup'").fetchone()[0]
    old.close()
    con = open_store(str(db))  # migrates: _v9 fills the rollups from the stored rows
    want_steps, want_colls = expected_step_summary(con), expected_collective_stats(con)
    assert len(want_steps) >= 4 and len(want_colls) >= 4
    check_views(con, want_steps, want_colls)
    # the straggler the fixture was made with (rank 3, compute +150 ms from step 20) stands out
    top = con.execute("SELECT rank FROM step_summary ORDER BY compute_ms_p50 DESC LIMIT 1").fetchone()[0]
    assert top == 3
    con.close()


def _random_batches(rng, seq0: int, n: int):
    """Steps and collectives with values dense enough that histogram buckets hold many each."""
    ranks = rng.integers(0, 4, n)
    steps = {"rank": ranks, "step": np.arange(n) // 4, "start_ns": np.arange(n) * 1000,
             "duration_ns": rng.integers(900_000_000, 901_000_000, n),   # ~1.1 k values a bucket
             "data_wait_ns": np.where(rng.random(n) < 0.5, 0, rng.integers(1, 50_000, n)),  # zeros: exact ends
             "forward_ns": np.zeros(n), "backward_ns": np.zeros(n), "optimizer_ns": np.zeros(n),
             "comm_exposed_ns": rng.integers(10_000_000, 60_000_000, n), "compute_ns": rng.integers(1, 10**9, n),
             "tokens": np.zeros(n), "samples": np.zeros(n), "loss": rng.random(n),
             "micro_batch": np.ones(n), "micro_batches": np.ones(n)}
    ops = np.array(["all_reduce", "all_gather_into_tensor", "send", "reduce_scatter_tensor"])
    k = rng.integers(0, 4, n)
    colls = {"rank": ranks, "step": np.arange(n) // 4, "start_ns": np.arange(n) * 1000,
             "duration_ns": np.where(rng.random(n) < 0.01, 0, rng.integers(50_000, 60_000, n)),  # some 0: no algbw
             "op": list(ops[k]), "role": [("dp", "tp", "p2p:pp", "dp")[i] for i in k],
             "group_size": np.where(k == 2, 2, 8), "bytes": rng.choice([4, 4096, 1 << 20, (1 << 20) + 4096, 1 << 26], n),
             "peer": np.full(n, -1), "dtype": ["bfloat16"] * n, "is_async": np.zeros(n)}
    return (encode_batch(Kind.STEP, steps, source_id="rollup", seq=seq0, run_id="run-r"),
            encode_batch(Kind.COLLECTIVE, colls, source_id="rollup", seq=seq0 + 1, run_id="run-r"))


def test_writer_rollups_equal_the_raw_rows(tmp_path) -> None:
    rng = np.random.default_rng(7)
    collector = start_collector(tmp_path, extra_args=["--flush-rows", "1000"])
    try:
        feeder = Feeder(collector.addr)
        seq = 1
        for _ in range(6):  # several commits: each adds to the same histogram rows
            for b in _random_batches(rng, seq, 2500):
                feeder.send(b)
            seq += 2
            feeder.wait_ack("rollup", seq - 1)
        feeder.close()
    finally:
        collector.stop()
    con = duckdb.connect(str(collector.db), read_only=True)
    assert con.execute("SELECT count(*) FROM step").fetchone()[0] == 15000
    # what the writer kept commit by commit is what the stored rows give in one go
    for table in rollup.TABLES:
        kept = con.execute(f"SELECT * FROM {table} ORDER BY ALL").fetchall()
        derived = con.execute(f"SELECT * FROM ({rollup.rows_sql(table, table_name(rollup.TABLES[table][0]))}) "
                              "ORDER BY ALL").fetchall()
        assert kept and kept == derived, table
    assert con.execute("SELECT max(n) FROM step_rollup WHERE metric = 1")  # duration_ns.fetchone()[0] > 100
    check_views(con, expected_step_summary(con), expected_collective_stats(con))
    con.close()


def test_two_files_old_and_new_schema(tmp_path) -> None:
    """`tracetop query OLD NEW`: the old file (schema 7, no rollups, attached read-only) has its
    histograms derived from its rows, the new one its rollup and its tail, so the views count
    every row of both files."""
    new = tmp_path / "new.duckdb"
    con = open_store(str(new))
    con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns, comm_exposed_ns, "
                "data_wait_ns) SELECT 'run-n', i % 2, i // 2, i, 1000000 + i * 1000, 500000 + i, 0, 0 FROM range(40) r(i)")
    con.execute("INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, bytes) "
                "SELECT 'run-n', i % 2, i // 2, i, 10000 + i, 'all_reduce', 'dp', 2, 4096 FROM range(40) r(i)")
    rollup.rebuild(con)
    # and rows past the watermark (a collector killed before it rolled them up): the tail
    con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns, comm_exposed_ns, "
                "data_wait_ns) SELECT 'run-n', i % 2, 20 + i // 2, i, 5000000 + i, 700000 + i, 0, 0 FROM range(10) r(i)")
    assert rollup.tail_rows(con, "step_rollup") == 10
    con.close()
    many = connect_many([str(FIXTURE), str(new)])
    try:
        check_views(many, expected_step_summary(many), expected_collective_stats(many))
        runs = {r for (r,) in many.execute("SELECT DISTINCT run_id FROM step_summary").fetchall()}
        assert runs == {"fixture-straggler", "run-n"}
    finally:
        many.close()


class _Sink(StreamReplies):
    def __init__(self) -> None:
        self.got: list = []

    def deliver(self, item) -> None:
        self.got.append(item)


def test_writer_rolls_up_in_chunks_and_views_count_the_tail(tmp_path, monkeypatch) -> None:
    """The real Writer over a real file, with a small roll-up chunk: while it runs, the rollup
    covers the rows up to its watermark and the views add the tail; after close, no tail."""
    monkeypatch.setattr(rollup, "ROLL_EVERY_ROWS", 3000)
    monkeypatch.setattr(rollup, "COMPACT_MIN_ROWS", 1000)
    rng = np.random.default_rng(3)
    con = open_store(str(tmp_path / "w.duckdb"))
    writer = Writer(con, flush_rows=1000, flush_interval_s=0.05)
    writer.start()
    sink = _Sink()
    seq = 1
    for _ in range(8):
        for b in _random_batches(rng, seq, 1000):
            writer.submit(QueuedBatch(sink, decode_batch(b), batch_to_arrow(decode_batch(b))))
        seq += 2
    cur = con.cursor()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the roller has run at least once (its thread, its cursor)
        state = dict(cur.execute("SELECT table_name, rows_upto FROM rollup_state").fetchall())
        if state.get("step", 0) > 0 and state.get("collective", 0) > 0:
            break
        time.sleep(0.05)
    assert state["step"] > 0 and state["collective"] > 0
    cur.close()
    for b in _random_batches(rng, seq, 500):  # committed, not yet rolled up
        writer.submit(QueuedBatch(sink, decode_batch(b), batch_to_arrow(decode_batch(b))))
    while writer.hwm.get("rollup", 0) < seq + 1:
        time.sleep(0.05)
    cur = con.cursor()
    assert rollup.tail_rows(cur, "step_rollup") > 0  # the views read a tail here
    check_views(cur, expected_step_summary(cur), expected_collective_stats(cur))
    cur.close()
    writer.close()
    assert rollup.tail_rows(con, "step_rollup") == 0 and rollup.tail_rows(con, "collective_rollup") == 0
    assert con.execute("SELECT count(*) FROM step").fetchone()[0] == 8500
    check_views(con, expected_step_summary(con), expected_collective_stats(con))
    con.close()


def test_roll_rows_equal_the_views_rows(tmp_path) -> None:
    """The writer's roll builds the collective histogram in two aggregates (`collective_rows_sql`);
    its rows are the views' `rows_sql` rows exactly, over rows with NULL, zero, negative and huge
    values, several values a bucket and calls outside any group (group_size 0)."""
    con = open_store(str(tmp_path / "r.duckdb"))
    rng = np.random.default_rng(11)
    n = 20_000
    dur = rng.choice([None, 0, -5, 1, 2, 1000, 1001, 10**12], n).tolist()
    dur = [d if d is None or rng.random() < 0.5 else int(rng.integers(1, 10**9)) for d in dur]
    size = rng.choice([None, 0, -1, 1, 1023, 1024, 1 << 20, (1 << 26) + 3, 2**62], n).tolist()
    ops = rng.choice(["all_reduce", "all_gather", "send"], n).tolist()
    rows = pa.table({"run_id": [f"run-{i % 2}" if i % 97 else None for i in range(n)], "op": ops,
                     "role": ["dp" if i % 3 else None for i in range(n)],
                     "group_size": pa.array([i % 4 for i in range(n)], pa.int32()),
                     "bytes": pa.array(size, pa.int64()), "duration_ns": pa.array(dur, pa.int64())})
    con.register("rows", rows)
    con.execute("CREATE TABLE src AS SELECT * FROM rows")
    fast = con.execute(f"SELECT * FROM ({rollup.collective_rows_sql('src')}) ORDER BY ALL").fetchall()
    views = con.execute(f"SELECT * FROM ({rollup.rows_sql('collective_rollup', 'src')}) ORDER BY ALL").fetchall()
    assert len(views) > 100 and fast == views
    con.close()
