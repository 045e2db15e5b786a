"""`tracetop export`: Perfetto trace-event JSON (a track per rank grouped by node, event counts equal
to the file's rows, clock offsets applied, slices nesting per track) and Parquet (one dataset per
table, partitioned by run, read back equal)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import duckdb
import pytest

from collector.ingest.schema import open_store
from tests.support import ROOT

TT = [sys.executable, "-m", "tracetop.cli", "export"]
FIXTURE = ROOT / "tests" / "fixtures" / "straggler_run.duckdb"


def _export(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*TT, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("perfetto") / "t.json"
    r = _export(FIXTURE, "--perfetto", out)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def test_perfetto_tracks_and_counts_match_the_file(trace: dict) -> None:
    con = duckdb.connect(str(FIXTURE), read_only=True)
    run_id = trace["otherData"]["run_id"]
    ev = trace["traceEvents"]
    n = {t: con.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [run_id]).fetchone()[0]
         for t in ("step", "pipe_instr", "collective", "offload")}
    by_cat = defaultdict(int)
    for e in ev:
        if e["ph"] == "X":
            by_cat[e["cat"]] += 1
            assert e["dur"] >= 0 and e["ts"] >= 0
    assert by_cat["step"] == n["step"] and by_cat["pipe"] == n["pipe_instr"]
    assert by_cat["collective"] == n["collective"] and by_cat.get("offload", 0) == n["offload"]
    # one process per node, named by hostname; a named main track per rank inside its node's process
    hosts = dict(con.execute("SELECT rank, any_value(hostname) FROM run_start WHERE run_id = ? GROUP BY rank",
                             [run_id]).fetchall())
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs.values()) == sorted(f"node {h}" for h in set(hosts.values()))
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    for rank, host in hosts.items():
        pid = next(p for p, name in procs.items() if name == f"node {host}")
        assert threads[(pid, rank * 10 + 1)].startswith(f"rank {rank}")
    # every step slice sits on its rank's main track, and the straggler's slices say so: rank 3's
    # forward time from step 20 on exceeds the others' by the injected 150 ms (less a margin)
    fwd = defaultdict(list)
    for e in ev:
        if e["ph"] == "X" and e["cat"] == "step":
            assert threads[(e["pid"], e["tid"])].startswith("rank ")
            if e["args"]["step"] >= 21:
                fwd[int(threads[(e["pid"], e["tid"])].split()[1])].append(e["args"]["compute_ms"])
    med = {r: sorted(v)[len(v) // 2] for r, v in fwd.items()}
    others = max(v for r, v in med.items() if r != 3)
    assert med[3] - others > 150 * 0.5


def test_perfetto_slices_nest_on_each_track(trace: dict) -> None:
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] in ("step", "pipe"):
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    assert tracks
    for slices in tracks.values():
        slices.sort(key=lambda x: (x[0], -x[1]))
        stack: list[tuple[float, float]] = []
        for s, t in slices:
            while stack and stack[-1][1] <= s:
                stack.pop()
            assert not stack or t <= stack[-1][1] + 1.0, "slices overlap without nesting"
            stack.append((s, t))


def test_perfetto_applies_clock_offsets(tmp_path: Path) -> None:
    db = tmp_path / "two-nodes.duckdb"
    con = open_store(str(db))
    start = 1_700_000_000_000_000_000
    for rank, host in ((0, "a"), (1, "b")):
        con.execute("INSERT INTO run_start (run_id, rank, step, start_ns, duration_ns, hostname, stage) "
                    "VALUES ('r', ?, -1, ?, 0, ?, -1)", [rank, start, host])
        con.execute("INSERT INTO step (run_id, rank, step, start_ns, duration_ns) VALUES ('r', ?, 0, ?, 1000000)",
                    [rank, start])
    # node b's clock is 5 ms behind the collector's: its events move 5 ms later
    con.execute("INSERT INTO clock_offset (run_id, rank, step, start_ns, duration_ns, node, offset_ns, rtt_ns) "
                "VALUES ('r', -1, -1, 0, 0, 'b', 5000000, 100)")
    con.close()
    out = tmp_path / "t.json"
    r = _export(db, "--perfetto", out)
    assert r.returncode == 0, r.stderr
    ev = json.loads(out.read_text())["traceEvents"]
    procs = {e["args"]["name"]: e["pid"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    steps = {e["pid"]: e["ts"] for e in ev if e["ph"] == "X"}
    assert steps[procs["node b"]] - steps[procs["node a"]] == pytest.approx(5000.0)  # microseconds


def test_parquet_one_dataset_per_table_partitioned_by_run(tmp_path: Path) -> None:
    out = tmp_path / "pq"
    r = _export(FIXTURE, "--parquet", out)
    assert r.returncode == 0, r.stderr
    con = duckdb.connect(str(FIXTURE), read_only=True)
    tables = [t for (t,) in con.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'").fetchall()]
    assert sorted(p.name for p in out.iterdir()) == sorted(tables)
    mem = duckdb.connect()
    for t in ("step", "collective", "pipe_instr", "run_start"):
        runs = [r for (r,) in con.execute(f"SELECT DISTINCT run_id FROM {t}").fetchall()]
        assert sorted(p.name for p in (out / t).iterdir()) == sorted(f"run_id={r}" for r in runs)
        got = mem.execute(f"SELECT count(*), count(DISTINCT run_id) FROM read_parquet('{out}/{t}/**/*.parquet', "
                          "hive_partitioning = true)").fetchone()
        assert got == con.execute(f"SELECT count(*), count(DISTINCT run_id) FROM {t}").fetchone()
    assert (mem.execute(f"SELECT sum(duration_ns) FROM read_parquet('{out}/step/**/*.parquet')").fetchone()
            == con.execute("SELECT sum(duration_ns) FROM step").fetchone())


def test_parquet_refuses_a_full_folder_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "pq"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = _export(FIXTURE, "--parquet", out)
    assert r.returncode == 2 and "not an empty folder" in r.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pq"]  # no temp folder left behind


def test_bad_arguments(tmp_path: Path) -> None:
    r = _export(FIXTURE)
    assert r.returncode == 2 and "--perfetto" in r.stderr
    r = _export(tmp_path / "nope.duckdb", "--perfetto", tmp_path / "t.json")
    assert r.returncode == 2 and "no such file" in r.stderr
    r = _export(FIXTURE, "--perfetto", tmp_path / "t.json", "--run", "no-such-run")
    assert r.returncode == 2 and "no-such-run" in r.stderr and not (tmp_path / "t.json").exists()


def test_perfetto_step_window(tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    r = _export(FIXTURE, "--perfetto", out, "--steps", "20:24")
    assert r.returncode == 0, r.stderr
    t = json.loads(out.read_text())
    con = duckdb.connect(str(FIXTURE), read_only=True)
    run_id = t["otherData"]["run_id"]
    by_cat = defaultdict(int)
    for e in t["traceEvents"]:
        if e["ph"] == "X":
            by_cat[e["cat"]] += 1
            assert 20 <= e["args"]["step"] <= 24
    for cat, table in (("step", "step"), ("pipe", "pipe_instr"), ("collective", "collective")):
        assert by_cat[cat] == con.execute(f"SELECT count(*) FROM {table} WHERE run_id = ? AND step BETWEEN 20 AND 24",
                                          [run_id]).fetchone()[0]
    r = _export(FIXTURE, "--perfetto", tmp_path / "x.json", "--steps", "9:3")
    assert r.returncode == 2 and "FROM is after TO" in r.stderr
