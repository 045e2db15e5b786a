"""The materialized per-step views (migration _v10, collector/ingest/matviews.py) against the original
definitions: a separate in-memory database built by migrations 1-9 only (the views as they were
before _v10, over the raw rows) is filled with the file's raw event rows, and every materialized
view must give the same rows (order-insensitive, floats to a relative 1e-9). Through the real
writer and its roll thread (small ROLL_EVERY_ROWS), with a rank's step rows arriving after its
collectives, late rows for an already materialized step, a file with a tail (read while the
writer runs), after a clean close, on the migrated committed fixture, and over two files."""

from __future__ import annotations

import math
import shutil
import time

import duckdb
import numpy as np
import pytest

from collector.ingest import matviews, rollup
from collector.ingest.schema import MIGRATIONS, open_store
from collector.ingest.writer import QueuedBatch, StreamReplies, Writer, batch_to_arrow
from collector.query.lost_sql import lost_time_over, lost_time_over_v10, lost_time_sql_v8
from collector.query.multifile import connect_many
from tests.collector import matviews_ref
from tests.support import ROOT
from tracetop.events import SCHEMAS, Kind, table_name
from tracetop.wire.codec import decode_batch, encode_batch

FIXTURE = ROOT / "tests" / "fixtures" / "straggler_run.duckdb"
KEYS = {"step_ranks": 3, "stragglers": 4, "grad_sync": 2, "bubble_budget": 3, "step_throughput": 2}


def original_db() -> duckdb.DuckDBPyConnection:
    """An empty in-memory database at schema 9 (the views' original definitions over the raw rows),
    its lost_time being collector/query/lost_sql.py's schema-10 text (schema 8's text, frozen in _v8,
    crossed every repeat of a (run, step, rank) step row with every other)."""
    ref = duckdb.connect(":memory:")
    ref.execute("CREATE TABLE schema_meta (version INTEGER NOT NULL, applied_ns BIGINT NOT NULL)")
    for mig in MIGRATIONS[:9]:
        for stmt in mig():
            ref.execute(stmt)
    # schema 10's text, not the current one (_v17's grouped rewrite): the current text must equal it
    ref.execute(f"CREATE OR REPLACE VIEW lost_time AS {lost_time_over_v10('(SELECT * FROM step_ranks)', '(SELECT * FROM step)')}")
    return ref


def reference(con) -> duckdb.DuckDBPyConnection:
    """A fresh database at schema 9 (the views' original definitions) holding `con`'s raw rows."""
    con.execute("SELECT 1").fetchall()  # finish the connection's last result before con.sql
    ref = original_db()
    for kind in Kind:
        t = table_name(kind)
        rows = con.sql(f"SELECT * FROM {t}").to_arrow_table()
        ref.register("_rows", rows)
        ref.execute(f"INSERT INTO {t} BY NAME SELECT * FROM _rows")
        ref.unregister("_rows")
    return ref


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        if math.isinf(a) or math.isinf(b):
            return a == b
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def check_views(con, ref, views=matviews.VIEWS) -> None:
    """Every view in `views` holds the reference's rows (sorted by all columns, floats to 1e-9)."""
    for v in views:
        got = con.execute(f"SELECT * FROM {v} ORDER BY ALL").fetchall()
        want = ref.execute(f"SELECT * FROM {v} ORDER BY ALL").fetchall()
        assert len(got) == len(want), f"{v}: {len(got)} rows, the original SQL gives {len(want)}"
        for g, w in zip(got, want):
            assert len(g) == len(w) and all(_same(x, y) for x, y in zip(g, w)), f"{v}: {g} != {w}"


def _batch(kind: Kind, cols: dict, seq: int, run_id: str = "run-m"):
    n = len(next(iter(cols.values())))
    full = {}
    for c in SCHEMAS[kind]:
        full[c.name] = cols.get(c.name, [""] * n if c.dtype == "str" else np.zeros(n))
    return encode_batch(kind, full, source_id="mat", seq=seq, run_id=run_id)


RANKS, STAGES = 4, 2


def _run_start(seq: int):
    r = np.arange(RANKS)
    return _batch(Kind.RUN_START, {"rank": r, "step": np.full(RANKS, -1), "world_size": np.full(RANKS, RANKS),
                                   "tp": np.ones(RANKS), "pp": np.full(RANKS, STAGES), "dp": np.full(RANKS, 2),
                                   "stage": r % STAGES, "micro_batches": np.full(RANKS, 4),
                                   "hostname": [f"node{i // 2}" for i in r]}, seq)


def _coll(rng, step: int, ranks, seq: int, n_each: int = 6):
    ranks = np.repeat(np.asarray(ranks), n_each)
    n = len(ranks)
    k = rng.integers(0, 4, n)
    return _batch(Kind.COLLECTIVE, {
        "rank": ranks, "step": np.full(n, step), "start_ns": np.arange(n) + step * 10**9,
        "duration_ns": rng.integers(10_000, 5_000_000, n),
        "op": [("all_reduce", "all_gather_into_tensor", "send", "recv")[i] for i in k],
        "role": [("dp", "tp", "p2p:pp", "p2p:pp")[i] for i in k], "group_size": np.where(k >= 2, 2, 2),
        "bytes": rng.choice([4, 4096, 1 << 20], n), "peer": np.full(n, -1), "dtype": ["bfloat16"] * n}, seq)


def _pipe(rng, step: int, ranks, seq: int):
    ranks = np.asarray(ranks)
    n = len(ranks) * 2
    return _batch(Kind.PIPE_INSTR, {
        "rank": np.repeat(ranks, 2), "step": np.full(n, step), "duration_ns": rng.integers(1000, 3_000_000, n),
        "stage": np.repeat(ranks, 2) % STAGES, "instr": ["ReduceGrads", "ForwardPass"] * len(ranks)}, seq)


def _steps(rng, step: int, ranks, seq: int):
    ranks = np.asarray(ranks)
    n = len(ranks)
    return _batch(Kind.STEP, {
        "rank": ranks, "step": np.full(n, step), "start_ns": step * 10**9 + ranks,
        "duration_ns": rng.integers(50_000_000, 90_000_000, n), "forward_ns": rng.integers(1_000_000, 9_000_000, n),
        "backward_ns": rng.integers(1_000_000, 9_000_000, n), "optimizer_ns": rng.integers(0, 1_000_000, n),
        "comm_exposed_ns": rng.integers(0, 9_000_000, n), "compute_ns": rng.integers(20_000_000, 40_000_000, n),
        "tokens": np.full(n, 4096), "samples": np.full(n, 8), "loss": rng.random(n) + 1, "micro_batches": np.full(n, 4)},
        seq)


class _Sink(StreamReplies):
    def deliver(self, item) -> None:
        pass


def _state(cur) -> dict:
    return dict(cur.execute("SELECT table_name, rows_upto FROM views_state").fetchall())


def _rolled(con, writer, seq: int, timeout_s: float = 60.0) -> None:
    """Wait until batch `seq` is committed and the roll thread has taken every committed row (the
    caller's last batch holds more than ROLL_EVERY_ROWS rows, so a roll starts after its commit)."""
    deadline = time.monotonic() + timeout_s
    while writer.hwm.get("mat", 0) < seq and time.monotonic() < deadline:
        time.sleep(0.02)
    assert writer.hwm.get("mat", 0) >= seq
    cur = con.cursor()
    try:
        while time.monotonic() < deadline:
            counts = {t: cur.execute(f"SELECT coalesce(max(rowid) + 1, 0) FROM {t}").fetchone()[0] for t in matviews.INPUTS}
            st = _state(cur)
            if all(st.get(t, 0) >= counts[t] for t in matviews.INPUTS):
                return
            time.sleep(0.05)
        raise AssertionError(f"the roll thread did not take the rows: {st} < {counts}")
    finally:
        cur.close()


def test_writer_materializes_exactly_with_late_rows_and_a_tail(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(rollup, "ROLL_EVERY_ROWS", 40)
    rng = np.random.default_rng(11)
    con = open_store(str(tmp_path / "m.duckdb"))
    writer = Writer(con, flush_rows=50, flush_interval_s=0.02)
    writer.start()
    sink = _Sink()
    seq = 0

    def send(b) -> None:
        nonlocal seq
        writer.submit(QueuedBatch(sink, decode_batch(b), batch_to_arrow(decode_batch(b))))

    try:
        seq += 1
        send(_run_start(seq))
        for step in range(8):  # rank 3's step row comes two steps after its collectives
            for make in (_coll, _pipe):
                seq += 1
                send(make(rng, step, range(RANKS), seq))
            seq += 1
            send(_steps(rng, step, [0, 1, 2], seq))
            if step >= 2:
                seq += 1
                send(_steps(rng, step - 2, [3], seq))
        seq += 1
        send(_coll(rng, 7, range(RANKS), seq, n_each=12))  # 48 rows > ROLL_EVERY_ROWS: a roll after it
        _rolled(con, writer, seq)
        cur = con.cursor()
        done = {s for (s,) in cur.execute("SELECT DISTINCT step FROM step_ranks_m").fetchall()}
        pending = {s for (s,) in cur.execute("SELECT step FROM views_pending").fetchall()}
        assert done == set(range(6)) and pending == {6, 7}  # 6, 7 lack rank 3's step row
        check_views(cur, reference(cur))  # pending steps: the original SQL over their rows

        # late rows for materialized step 2 (a collective of rank 0), committed, not rolled: a tail
        monkeypatch.setattr(rollup, "ROLL_EVERY_ROWS", 10**9)
        seq += 1
        send(_coll(rng, 2, [0], seq, n_each=3))
        seq += 1
        send(_steps(rng, 6, [3], seq))
        deadline = time.monotonic() + 60
        while writer.hwm.get("mat", 0) < seq and time.monotonic() < deadline:
            time.sleep(0.02)
        assert matviews.pending_rows(cur) > 0  # rows past the watermarks: the views read them live
        ref = reference(cur)
        check_views(cur, ref)
        # the planted error: a materialized row changed, outside the live set, fails the comparison
        cur.execute("UPDATE step_ranks_m SET wait_ms = wait_ms + 1 WHERE step = 4 AND rank = 1").fetchall()
        with pytest.raises(AssertionError, match="step_ranks"):
            check_views(cur, ref, ("step_ranks",))
        cur.execute("UPDATE step_ranks_m SET wait_ms = wait_ms - 1 WHERE step = 4 AND rank = 1").fetchall()
        check_views(cur, ref)
        cur.close()

        monkeypatch.setattr(rollup, "ROLL_EVERY_ROWS", 40)
        seq += 1
        send(_coll(rng, 7, range(RANKS), seq, n_each=12))
        _rolled(con, writer, seq)  # step 2 recomputed with its late rows, step 6 now complete
        cur = con.cursor()
        assert {s for (s,) in cur.execute("SELECT step FROM views_pending").fetchall()} == {7}
        check_views(cur, reference(cur))
        cur.close()
    finally:
        writer.close()
    # a clean close materializes the pending step: an empty live set, the same views
    assert matviews.pending_rows(con) == 0
    assert con.execute("SELECT count(DISTINCT step) FROM step_ranks_m").fetchone()[0] == 8
    check_views(con, reference(con))
    con.close()


def test_migrated_fixture_gives_the_original_views(tmp_path) -> None:
    """The committed fixture (schema 7, a real 4-rank run) migrated to 10: every step
    materialized, none live, and every view the original SQL's rows; a planted error fails."""
    path = tmp_path / "fx.duckdb"
    shutil.copy(FIXTURE, path)
    con = open_store(str(path))
    try:
        assert matviews.pending_rows(con) == 0
        steps = con.execute("SELECT count(DISTINCT step) FROM step WHERE step >= 0").fetchone()[0]
        assert con.execute("SELECT count(DISTINCT step) FROM step_ranks_m").fetchone()[0] == steps > 0
        ref = reference(con)
        check_views(con, ref)
        con.execute("UPDATE grad_sync_m SET grad_sync_ms_p50 = grad_sync_ms_p50 * (1 + 1e-6) WHERE step = 3").fetchall()
        with pytest.raises(AssertionError, match="grad_sync"):
            check_views(con, ref, ("grad_sync",))
        assert con.execute("SELECT count(*) FROM lost_time_m WHERE lost_gpu_ms > 0").fetchone()[0] > 0
        con.execute("UPDATE lost_time_m SET lost_gpu_ms = lost_gpu_ms * (1 + 1e-6) WHERE lost_gpu_ms > 0").fetchall()
        with pytest.raises(AssertionError, match="lost_time"):
            check_views(con, ref, ("lost_time",))
    finally:
        con.close()


def test_two_files_give_the_original_views(tmp_path) -> None:
    """`tracetop query A B`: the views over a migrated fixture and a file with rows past its
    watermarks are the original SQL over both files' rows."""
    a = tmp_path / "a.duckdb"
    shutil.copy(FIXTURE, a)
    open_store(str(a)).close()
    b = tmp_path / "b.duckdb"
    con = open_store(str(b))
    con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns, comm_exposed_ns, tokens) "
                "SELECT 'run-b', i % 2, i // 2, i, 1000000 + i * 1000, 500000 + i, 10 * i, 100 FROM range(20) r(i)")
    con.execute("INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, bytes) "
                "SELECT 'run-b', i % 2, i // 4, i, 10000 + i, 'all_reduce', 'dp', 2, 4096 FROM range(40) r(i)")
    assert matviews.pending_rows(con) > 0
    con.close()
    many = connect_many([str(a), str(b)])
    ref = original_db()
    try:
        for kind in Kind:
            t = table_name(kind)
            ref.register("_rows", many.sql(f"SELECT * FROM {t}").to_arrow_table())
            ref.execute(f"INSERT INTO {t} BY NAME SELECT * FROM _rows")
            ref.unregister("_rows")
        check_views(many, ref)
        runs = {r for (r,) in many.execute("SELECT DISTINCT run_id FROM step_ranks").fetchall()}
        assert runs == {"fixture-straggler", "run-b"}
    finally:
        ref.close()
        many.close()


def test_a_late_run_start_row_makes_its_run_live(tmp_path) -> None:
    """A run_start row past its watermark (a rank's stage changed after its steps were
    materialized) puts every step of its run in the live set: the views follow the new stage at
    once, and again after the next roll re-materializes them."""
    path = tmp_path / "fx.duckdb"
    shutil.copy(FIXTURE, path)
    con = open_store(str(path))
    try:
        run, rank, stage = con.execute("SELECT run_id, rank, stage FROM run_start ORDER BY rank LIMIT 1").fetchone()
        before = con.execute("SELECT count(*) FROM step_ranks WHERE rank = ? AND stage = ?", [rank, stage + 7]).fetchall()
        con.execute("INSERT INTO run_start (run_id, rank, step, stage, world_size, pp, dp) VALUES (?, ?, -1, ?, 4, 2, 2)",
                    [run, rank, stage + 7]).fetchall()
        assert matviews.pending_rows(con) == 1
        after = con.execute("SELECT count(*) FROM step_ranks WHERE rank = ? AND stage = ?", [rank, stage + 7]).fetchall()
        assert before[0][0] == 0 and after[0][0] > 0  # max(stage) per rank: the new row wins
        check_views(con, reference(con))
        assert matviews.advance(con) > 0  # every step of the run recomputed
        assert matviews.pending_rows(con) == 0
        check_views(con, reference(con))
    finally:
        con.close()


def test_a_rank_that_stops_leaves_steps_pending_only_until_they_settle(tmp_path) -> None:
    """Rank 3 sends no step rows after step 1 (it died): its run's steps never complete, so each
    is materialized once the run has rows SETTLE_STEPS steps later; the views stay exact."""
    con = open_store(str(tmp_path / "d.duckdb"))
    try:
        con.execute("INSERT INTO run_start (run_id, rank, step, stage, world_size, pp, dp) "
                    "SELECT 'run-d', i, -1, i % 2, 4, 2, 2 FROM range(4) r(i)").fetchall()
        last = matviews.SETTLE_STEPS + 9
        con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns, comm_exposed_ns, tokens) "
                    f"SELECT 'run-d', i % 4, i // 4, i, 1000000 + i * 997, 500000 + i * 13, i, 100 "
                    f"FROM range(4 * ({last} + 1)) r(i) WHERE i % 4 < 3 OR i // 4 <= 1").fetchall()
        con.execute("INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, bytes) "
                    f"SELECT 'run-d', i % 4, i // 8, i, 10000 + i, 'all_reduce', 'dp', 2, 4096 "
                    f"FROM range(8 * ({last} + 1)) r(i)").fetchall()
        matviews.advance(con)
        pending = sorted(s for (s,) in con.execute("SELECT step FROM views_pending").fetchall())
        assert pending == list(range(last - matviews.SETTLE_STEPS + 1, last + 1))
        assert con.execute("SELECT count(DISTINCT step) FROM step_ranks_m").fetchall()[0][0] == last + 1 - len(pending)
        check_views(con, reference(con))
    finally:
        con.close()


def test_repeated_step_rows_give_one_lost_time_row_per_rank_exactly(tmp_path) -> None:
    """A (run, step, rank) with REPEAT step rows (a job re-run from a checkpoint under the same run
    id; tests/collector/util writes 62): lost_time keeps the one that ended last, one row per
    (run, step, rank) where schema 8's text gave REPEAT^3, and the materialized view equals
    lost_sql's text over the raw rows, live and after a roll; a planted error fails."""
    repeat, ranks, steps = 7, 4, 3
    con = open_store(str(tmp_path / "r.duckdb"))
    try:
        con.execute("INSERT INTO run_start (run_id, rank, step, stage, world_size, pp, dp, micro_batches, hostname) "
                    f"SELECT 'run-r', i, -1, i % 2, {ranks}, 2, 2, 4, 'n' || (i // 2) FROM range({ranks}) r(i)").fetchall()
        # attempt a (0..repeat-1) of (step, rank): start and length differ per attempt, so which one counts matters
        con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns, forward_ns, backward_ns, "
                    "comm_exposed_ns, data_wait_ns, micro_batches, tokens) "
                    "SELECT 'run-r', r, s, s * 10000000000 + ((a * 7919) % " + str(repeat) + ") * 1000000000 + r, "
                    "60000000 + ((a * 31 + r * 17 + s) % 11) * 1000000, 30000000 + ((a * 13 + r * 7) % 5) * 4000000, "
                    "5000000 + r * 100000, 6000000, (a * 3 + r) * 1000000, ((a + r) % 3) * 2000000, 4, 4096 "
                    f"FROM range({repeat}) x(a), range({ranks}) y(r), range({steps}) z(s)").fetchall()
        con.execute("INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, bytes) "
                    f"SELECT 'run-r', i % {ranks}, i // {4 * ranks} % {steps}, i, 10000 + i * 37, "
                    "CASE WHEN i % 2 = 0 THEN 'all_reduce' ELSE 'send' END, CASE WHEN i % 2 = 0 THEN 'dp' ELSE 'p2p:pp' END, "
                    f"2, 1048576 FROM range({4 * ranks * steps}) r(i)").fetchall()
        keys = ranks * steps
        assert matviews.pending_rows(con) > 0
        check_views(con, reference(con))  # all live: the original SQL over the rows
        matviews.advance(con, final=True)
        assert matviews.pending_rows(con) == 0
        assert con.execute("SELECT count(*) FROM lost_time_m").fetchone()[0] == keys
        ref = reference(con)
        check_views(con, ref)
        # the counted row is each key's last-ending step row (its end and its length)
        got = con.execute("SELECT run_id, step, rank, end_ns, step_ms FROM lost_time ORDER BY ALL").fetchall()
        want = con.execute("SELECT run_id, step, rank, arg_max(start_ns + duration_ns, start_ns + duration_ns), "
                           "arg_max(duration_ns, start_ns + duration_ns) / 1e6 FROM step GROUP BY ALL ORDER BY ALL").fetchall()
        assert got == want and len(got) == keys
        # schema 8's text crossed the repeats: REPEAT^3 rows a key (why the close took minutes)
        assert ref.execute(f"SELECT count(*) FROM ({lost_time_sql_v8()})").fetchone()[0] == keys * repeat**3
        con.execute("UPDATE lost_time_m SET end_ns = end_ns + 1 WHERE rank = 1 AND step = 2").fetchall()
        with pytest.raises(AssertionError, match="lost_time"):
            check_views(con, ref, ("lost_time",))
    finally:
        con.close()


def test_stragglers_in_linear_time_gives_the_list_sqls_rows_with_ties_and_nulls() -> None:
    """matviews.stragglers_sql (four sorted values a stage, no list per row) against _v5's list SQL:
    stages of 1 to 9 ranks and one of 600, tied and NULL compute and wait times, planted stragglers."""
    con = duckdb.connect(":memory:")
    con.execute("SELECT setseed(0.25)")
    con.execute("""CREATE TABLE sr AS SELECT 'r' || (i % 2) AS run_id, (i // 17) % 40 AS step,
        CASE WHEN i < 600 THEN 9 ELSE (i % 5) END AS stage, i AS rank,
        CASE WHEN random() < 0.1 THEN NULL WHEN i % 97 = 0 THEN 900.0 ELSE round(random() * 5) * 20 END AS compute_ms,
        CASE WHEN random() < 0.1 THEN NULL ELSE round(random() * 4) END AS wait_ms FROM range(6000) t(i)""")
    windows, old = matviews_ref.stragglers_windows_sql("sr"), matviews_ref.stragglers_lists_sql("sr")
    assert con.execute(f"SELECT count(*) FROM ({windows}) WHERE is_straggler").fetchone()[0] > 0
    for a, b in ((windows, old), (old, windows)):
        assert con.execute(f"SELECT count(*) FROM (SELECT * FROM ({a}) EXCEPT ALL SELECT * FROM ({b}))").fetchone()[0] == 0


def test_stragglers_grouped_gives_the_window_sqls_rows_with_ties_nulls_and_nans() -> None:
    """_v17's stragglers SQL (grouped aggregates joined back) against _v13's window SQL and _v5's list SQL:
    stages of 1 to 9 ranks and one of 600, tied, NULL and NaN times, a NULL stage; same columns and types."""
    con = duckdb.connect(":memory:")
    con.execute("SELECT setseed(0.5)")
    con.execute("""CREATE TABLE sr AS SELECT 'r' || (i % 2) AS run_id, (i // 17) % 40 AS step,
        CASE WHEN i < 600 THEN 9 ELSE nullif(i % 5, 4) END AS stage, i AS rank,
        CASE WHEN random() < 0.1 THEN NULL WHEN i % 97 = 0 THEN 900.0 WHEN i % 89 = 0 THEN 'nan'::DOUBLE
             ELSE round(random() * 5) * 20 END AS compute_ms,
        CASE WHEN random() < 0.1 THEN NULL ELSE round(random() * 4) END AS wait_ms FROM range(6000) t(i)""")
    new = matviews.stragglers_sql("sr")
    assert con.execute(f"DESCRIBE {new}").fetchall() == con.execute(f"DESCRIBE {matviews_ref.stragglers_windows_sql('sr')}").fetchall()
    assert con.execute(f"SELECT count(*) FROM ({new}) WHERE is_straggler").fetchone()[0] > 0
    assert con.execute(f"SELECT count(*) FROM ({new}) WHERE stage IS NULL AND others_compute_ms IS NOT NULL").fetchone()[0] > 0
    for ref in (matviews_ref.stragglers_windows_sql("sr"), matviews_ref.stragglers_lists_sql("sr")):
        for a, b in ((new, ref), (ref, new)):
            assert con.execute(f"SELECT count(*) FROM (SELECT * FROM ({a}) EXCEPT ALL SELECT * FROM ({b}))").fetchone()[0] == 0
    # the planted error: one rank's wait changed in the relation only the new SQL reads
    con.execute("CREATE TABLE sr2 AS SELECT * REPLACE (CASE WHEN rank = 700 THEN wait_ms + 1 ELSE wait_ms END AS wait_ms) FROM sr")
    assert con.execute(f"SELECT count(*) FROM (SELECT * FROM ({matviews.stragglers_sql('sr2')}) "
                       f"EXCEPT ALL SELECT * FROM ({matviews_ref.stragglers_windows_sql('sr')}))").fetchone()[0] > 0


def _lost_rows(tmp_path):
    """A file with two runs: 'run-p' (run_start rows: 3 stages of 5 ranks, one rank without a
    run_start row, tied and NULL compute, a slow rank, repeated step rows of one step, p2p) and
    'run-q' (no run_start rows); every view materialized. Backward differs by stage: with every stage's
    median forward + backward equal, bubble_budget's slow_stage (arg_max over a tie) is any stage, and
    the file and the reference picked differently about half the time."""
    con = open_store(str(tmp_path / "lost.duckdb"))
    con.execute("INSERT INTO run_start (run_id, rank, step, stage, world_size, pp, dp, micro_batches, hostname) "
                "SELECT 'run-p', i, -1, i % 3, 16, 3, 5, 4, 'n' || (i // 4) FROM range(15) r(i)").fetchall()
    con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns, forward_ns, backward_ns, "
                "comm_exposed_ns, data_wait_ns, micro_batches, tokens) "
                "SELECT run, r, s, s * 10000000000 + r * 1000 + a * 7, 60000000 + ((r * 7 + s) % 4) * 1000000 + a, "
                "CASE WHEN (r + s) % 11 = 0 THEN NULL WHEN r = 4 AND s = 3 THEN 90000000 "
                "     ELSE 30000000 + ((r * 3 + s) % 3) * 2000000 END, "
                "5000000, 6000000 + (r % 3) * 1000000, ((r + a) % 5) * 1000000, ((r + s) % 3) * 2000000, 4, 4096 "
                "FROM (SELECT 'run-p' AS run, r FROM range(16) t(r) UNION ALL SELECT 'run-q', r FROM range(5) t(r)), "
                "range(6) u(s), range(3) v(a) WHERE a = 0 OR (s = 2 AND r % 4 = 1)").fetchall()
    con.execute("INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, bytes) "
                "SELECT 'run-p', i % 16, (i // 16) % 6, i, 10000 + (i * 37) % 5000000, "
                "CASE WHEN i % 3 = 0 THEN 'all_reduce' ELSE 'send' END, CASE WHEN i % 3 = 0 THEN 'dp' ELSE 'p2p:pp' END, "
                "2, 1048576 * (1 + i % 4) FROM range(16 * 6 * 4) r(i)").fetchall()
    matviews.advance(con, final=True)
    return con


def test_lost_time_grouped_gives_the_schema_10_rows_with_ties_nulls_and_repeats(tmp_path) -> None:
    """lost_sql's _v17 text (grouped aggregates, no window passes) against its schema-10 text over the
    same rows: two runs, stages, tied and NULL compute, repeated step rows, p2p; same columns and
    types, a pacer and lost time in them; a planted error fails."""
    con = _lost_rows(tmp_path)
    try:
        sr, step = f"({matviews.step_ranks_sql()})", "(SELECT * FROM step WHERE step >= 0)"
        new, old = lost_time_over(sr, step), lost_time_over_v10(sr, step)
        assert con.execute(f"DESCRIBE {new}").fetchall() == con.execute(f"DESCRIBE {old}").fetchall()
        for a, b in ((new, old), (old, new)):
            assert con.execute(f"SELECT count(*) FROM (SELECT * FROM ({a}) EXCEPT ALL SELECT * FROM ({b}))").fetchone()[0] == 0
        n, pacers, lost, runs = con.execute(f"SELECT count(*), count(*) FILTER (WHERE is_pacer), "
                                            f"count(*) FILTER (WHERE lost_gpu_ms > 0), count(DISTINCT run_id) FROM ({new})").fetchone()
        assert n == 6 * 21 and pacers > 0 and lost > 0 and runs == 2
        planted = lost_time_over(sr, "(SELECT * REPLACE (CASE WHEN rank = 4 AND step = 3 THEN compute_ns + 1 "
                                     "ELSE compute_ns END AS compute_ns) FROM step WHERE step >= 0)")
        assert con.execute(f"SELECT count(*) FROM (SELECT * FROM ({planted}) EXCEPT ALL SELECT * FROM ({old}))").fetchone()[0] > 0
        check_views(con, reference(con))  # the materialized rows, from the grouped text, against schema 10's
    finally:
        con.close()


def test_a_schema_16_file_gets_the_grouped_views_and_the_same_rows(tmp_path, monkeypatch) -> None:
    """A file written at schema 16 (its stragglers and lost_time views the window texts, its steps
    materialized by them) opened by this version: _v17 creates the two views again from the grouped
    texts, the _m rows stay, and every view equals the original SQL, before and after a roll."""
    old_lost = lambda sr, keys=None, lo=None, hi=None: lost_time_over_v10(sr, matviews._rows("step", keys, lo, hi))  # noqa: E731
    monkeypatch.setitem(matviews.DERIVED, "stragglers", matviews_ref.stragglers_windows_sql)
    monkeypatch.setitem(matviews.WITH_STEP, "lost_time", old_lost)
    monkeypatch.setattr("collector.ingest.schema.MIGRATIONS", MIGRATIONS[:16])
    monkeypatch.setattr("collector.ingest.schema.STORE_VERSION", 16)
    con = _lost_rows(tmp_path)
    path = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchone()[0]
    con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns, comm_exposed_ns, tokens) "
                "SELECT 'run-p', i, 6, i, 1000000, 500000 + i, 0, 1 FROM range(16) t(i)").fetchall()  # a live step
    texts = dict(con.execute("SELECT view_name, sql FROM duckdb_views() WHERE view_name IN ('stragglers', 'lost_time')").fetchall())
    assert con.execute("SELECT max(version) FROM schema_meta").fetchone()[0] == 16
    con.close()
    monkeypatch.undo()
    con = open_store(path)
    try:
        assert con.execute("SELECT max(version) FROM schema_meta").fetchone()[0] == len(MIGRATIONS) == 17
        now = dict(con.execute("SELECT view_name, sql FROM duckdb_views() WHERE view_name IN ('stragglers', 'lost_time')").fetchall())
        assert all(now[v] != texts[v] and "list_sort(list(compute_ms))" in now[v] for v in now) and len(now) == 2
        assert matviews.pending_rows(con) > 0
        check_views(con, reference(con))
        matviews.advance(con, final=True)
        check_views(con, reference(con))
    finally:
        con.close()


def _rank_step_rows(con, run: str, step: int, ranks) -> None:
    """Step rows and two collectives a rank for `ranks` of `step` (values vary by rank and step)."""
    for r in ranks:
        con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns, comm_exposed_ns, tokens) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, 100)",
                    [run, r, step, step * 10**9 + r, 10**6 + 997 * r + 31 * step, 5 * 10**5 + 13 * r * step, 7 * r]).fetchall()
        con.execute("INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, bytes) "
                    "SELECT ?, ?, ?, i, 10000 + i * 37 + ?, 'all_reduce', 'dp', 4, 4096 FROM range(2) t(i)",
                    [run, r, step, r * step]).fetchall()


def test_a_run_without_run_start_rows_materializes_a_step_once_its_ranks_are_in(tmp_path) -> None:
    """A run with no run_start rows does not say how many ranks it has: a step is taken once the run
    has rows of a later step and the step has as many ranks' step rows as the run's recently
    materialized steps (not as soon as it has one, which materialized it again at every roll while its
    ranks' rows came in). The views equal the original SQL at every point."""
    con = open_store(str(tmp_path / "n.duckdb"))
    try:
        def materialized() -> dict[int, int]:
            return dict(con.execute("SELECT step, count(*) FROM step_ranks_m GROUP BY step").fetchall())

        _rank_step_rows(con, "run-n", 0, [0, 1])
        matviews.advance(con)
        assert materialized() == {} and matviews.pending_rows(con) == 1  # step 0: no later step yet
        check_views(con, reference(con))
        _rank_step_rows(con, "run-n", 0, [2, 3])
        _rank_step_rows(con, "run-n", 1, [0, 1, 2, 3])
        matviews.advance(con)
        assert materialized() == {0: 4}  # step 1 is the newest: pending
        _rank_step_rows(con, "run-n", 2, [0, 1])  # ranks 2 and 3 late
        _rank_step_rows(con, "run-n", 3, [0, 1, 2, 3])
        matviews.advance(con)
        assert materialized() == {0: 4, 1: 4}  # step 2 has 2 of the 4 ranks step 0 had: pending
        assert sorted(s for (s,) in con.execute("SELECT step FROM views_pending").fetchall()) == [2, 3]
        check_views(con, reference(con))
        _rank_step_rows(con, "run-n", 2, [2, 3])
        matviews.advance(con)
        assert materialized() == {0: 4, 1: 4, 2: 4}
        check_views(con, reference(con))
        matviews.advance(con, final=True)  # a writer closing: everything, complete or not
        assert materialized() == {0: 4, 1: 4, 2: 4, 3: 4} and matviews.pending_rows(con) == 0
        check_views(con, reference(con))
    finally:
        con.close()


def test_the_rolls_grad_sync_filter_counts_the_views_rows(tmp_path) -> None:
    """The roll's step_ranks (a step range: `_GRAD_ROLL`) and the views' (`_GRAD`) give the same
    rows over every role / op / bytes shape that decides a grad sync: '|'-joined roles, 'dp' inside
    another word, ops with leading '_', bytes around 1024, NULLs."""
    con = open_store(str(tmp_path / "g.duckdb"))
    roles = ["dp", "tp", "dp|tp", "tp|dp", "pp|dp|tp", "xdp", "dpx", "dp2|tp", "", "|dp", "dp|", "||", None, "p2p:pp"]
    ops = ["all_reduce", "__all_reduce_coalesced", "reduce_scatter_tensor", "_all_gather_into_tensor", "send",
           "broadcast", "", None, "xall_reduce"]
    sizes = [None, 0, 1023, 1024, 1 << 20]
    con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns, compute_ns) "
                "SELECT 'g', r, s, 0, 1000000, 500000 FROM range(64) a(r), range(2) b(s)")
    con.executemany("INSERT INTO collective (run_id, rank, step, start_ns, duration_ns, op, role, group_size, bytes) "
                    "VALUES ('g', ?, ?, 0, ?, ?, ?, 8, ?)",
                    [(i % 64, i // 64 % 2, 1000 + i, ops[i % len(ops)], roles[i // len(ops) % len(roles)],
                      sizes[i // (len(ops) * len(roles)) % len(sizes)]) for i in range(len(ops) * len(roles) * len(sizes))])
    keys = "(SELECT DISTINCT run_id, step FROM step)"
    rolled = con.execute(f"SELECT * FROM ({matviews.step_ranks_sql(keys, 0, 1)}) ORDER BY ALL").fetchall()
    views = con.execute(f"SELECT * FROM ({matviews.step_ranks_sql(keys)}) ORDER BY ALL").fetchall()
    assert len(views) == 128 and rolled == views
    assert sum(1 for r in views if r[7] > 0) > 10  # grad_sync_ms: some ranks have grad syncs, some none
    assert sum(1 for r in views if r[7] == 0) > 10
    con.close()


def test_a_roll_is_chunked_by_the_rows_a_step_holds_when_the_run_does_not_say_its_ranks(tmp_path, monkeypatch) -> None:
    """A run without run_start rows says no ranks: its steps were sized as one row each, so a roll
    of 200k such steps of 8 ranks went to one statement of 1.6M rows and ran DuckDB out of memory
    (again at every retry). Chunks follow the step rows stored; the views stay the original SQL's."""
    monkeypatch.setattr(matviews, "CHUNK_ROWS", 40)
    con = open_store(str(tmp_path / "c.duckdb"))
    try:
        for step in range(30):
            _rank_step_rows(con, "run-c", step, range(8))
        steps = list(range(30))
        con.execute("CREATE TEMP TABLE _tt_done AS SELECT 'run-c' AS run_id, range AS step FROM range(30)")
        chunks = matviews._chunks(steps, matviews._rows_per_step(con, steps))
        con.execute("DROP TABLE _tt_done")
        assert all(hi - lo + 1 <= 5 for lo, hi in chunks) and len(chunks) == 6  # 40 rows: 5 steps of 8
        matviews.advance(con, final=True)
        assert con.execute("SELECT count(*) FROM step_ranks_m").fetchone()[0] == 240
        check_views(con, reference(con))
    finally:
        con.close()


def test_a_roll_that_only_waits_on_a_runs_newest_step_keeps_it_pending(tmp_path) -> None:
    """Rolls whose rows past the watermarks (and pending keys) touch only the newest step of runs
    without run_start rows take nothing and leave those keys pending, every watermark at its table's
    end (rows of a step < 0 touch nothing); a later step completes the one before; a run with
    run_start rows completes a step with its started ranks' rows. The views equal the original SQL
    at every point."""
    con = open_store(str(tmp_path / "w.duckdb"))
    try:
        def state() -> tuple[list, dict, dict]:
            pending = sorted(con.execute("SELECT run_id, step FROM views_pending").fetchall())
            done = dict(con.execute("SELECT step, count(*) FROM step_ranks_m GROUP BY step").fetchall())
            ends = {t: con.execute(f"SELECT coalesce(max(rowid) + 1, 0) FROM {t}").fetchone()[0] for t in matviews.INPUTS}
            assert _state(con) == {t: n for t, n in ends.items() if n}, "a watermark short of its table's end"
            return pending, done, ends

        _rank_step_rows(con, "run-w", 0, [0, 1])
        _rank_step_rows(con, "run-w", -1, [0])  # a step < 0: in no view
        assert matviews.advance(con) == 0
        assert state()[:2] == ([("run-w", 0)], {})
        check_views(con, reference(con))
        con.execute("INSERT INTO collective (run_id, rank, step, duration_ns, op, role, group_size, bytes) "
                    "VALUES ('run-w', 2, 0, 5000, 'all_reduce', 'dp', 4, 4096)")  # collectives only, same step
        assert matviews.advance(con) == 0
        assert state()[:2] == ([("run-w", 0)], {})
        check_views(con, reference(con))
        _rank_step_rows(con, "run-x", 0, [0])  # two runs' newest steps: both pending
        assert matviews.advance(con) == 0
        assert state()[:2] == ([("run-w", 0), ("run-x", 0)], {})
        _rank_step_rows(con, "run-w", 1, [0, 1])  # a later step: step 0 is complete
        assert matviews.advance(con) == 1
        assert state()[:2] == ([("run-w", 1), ("run-x", 0)], {0: 2})
        check_views(con, reference(con))
    finally:
        con.close()
    con = open_store(str(tmp_path / "y.duckdb"))
    try:
        con.execute("INSERT INTO run_start (run_id, rank, step, world_size, stage) VALUES ('run-y', 0, -1, 1, 0)")
        matviews.advance(con)
        _rank_step_rows(con, "run-y", 0, [0])  # one step of a run that says its ranks: complete with rank 0's
        assert matviews.advance(con) == 1
        assert dict(con.execute("SELECT step, count(*) FROM step_ranks_m GROUP BY step").fetchall()) == {0: 1}
        assert matviews.pending_rows(con) == 0
        check_views(con, reference(con))
    finally:
        con.close()


def test_the_views_roll_after_step_rows_that_can_complete_a_step(tmp_path, monkeypatch) -> None:
    """The writer's roll rule (collector/ingest/writer.py VIEWS_ROLL_BOUND): past ROLL_EVERY_ROWS rows,
    the views roll after step rows of a step newer than at their last roll or older than the run's
    newest (a late rank), not after a step's other rows (they complete nothing), and after
    VIEWS_ROLL_BOUND times ROLL_EVERY_ROWS rows whatever came; the rollups as before. The views equal
    the original SQL throughout (rolled or not) and after the close."""
    monkeypatch.setattr(rollup, "ROLL_EVERY_ROWS", 40)
    rng = np.random.default_rng(5)
    con = open_store(str(tmp_path / "r.duckdb"))
    writer = Writer(con)  # not started: the test commits (flush) and rolls (_roll_up) itself
    seq = 0

    def commit_and_roll(*makes) -> bool:
        """Commit the batches, roll as the roll thread does; whether the views rolled."""
        nonlocal seq
        items = []
        for make in makes:
            seq += 1
            b = decode_batch(make(seq))
            items.append(QueuedBatch(_Sink(), b, batch_to_arrow(b)))
        writer.flush(items)
        before = _state(con)
        writer._roll_up(con, rollup.ROLL_EVERY_ROWS)
        return _state(con) != before

    try:
        assert commit_and_roll(lambda q: _steps(rng, 0, range(RANKS), q), lambda q: _coll(rng, 0, range(RANKS), q, 12))
        assert not commit_and_roll(lambda q: _coll(rng, 0, range(RANKS), q, 12))  # step 0's collectives
        assert con.execute("SELECT count(*) FROM collective_rollup").fetchone()[0] > 0  # the rollup did roll
        check_views(con, reference(con))
        assert commit_and_roll(lambda q: _steps(rng, 1, range(RANKS), q), lambda q: _coll(rng, 1, range(RANKS), q, 12))
        assert {s for (s,) in con.execute("SELECT DISTINCT step FROM step_ranks_m").fetchall()} == {0}
        assert not commit_and_roll(lambda q: _pipe(rng, 1, range(RANKS), q), lambda q: _coll(rng, 1, range(RANKS), q, 12))
        assert commit_and_roll(lambda q: _steps(rng, 0, [1], q), lambda q: _coll(rng, 1, range(RANKS), q, 12))  # late
        assert not commit_and_roll(*[lambda q: _coll(rng, 1, range(RANKS), q, 10)] * 3)  # 120 rows of 160
        check_views(con, reference(con))
        assert commit_and_roll(lambda q: _coll(rng, 1, range(RANKS), q, 12))  # 168 > 4 * 40: the bound
        check_views(con, reference(con))
    finally:
        writer._roll_cursor.close()  # (the threads never started: close's own roll, without joining them)
    writer._roll_up(con, 0)
    assert matviews.pending_rows(con) == 0
    check_views(con, reference(con))
    con.close()
