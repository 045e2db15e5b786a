"""Read-only SQL, through a running collector (Query service and `tracetop query --collector`) and
on its file after it stopped (`tracetop query FILE`); the views' formulas on controlled rows."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

from tests.collector.util import Feeder, batch, scalar, sql
from tests.support import ROOT
from tests.support.services import start_collector
from tracetop.events import Kind
from tracetop.wire.codec import encode_batch

TT = [sys.executable, "-m", "tracetop.cli", "query"]


def _probes(tmp) -> list[str]:
    return [
        "INSERT INTO step SELECT * FROM step",
        "CREATE TABLE u (x INT)",
        "UPDATE sources SET hwm = 0",
        "DELETE FROM ingest_log",
        f"COPY step TO '{tmp}/leak.csv'",
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/hostname')",
        f"ATTACH '{tmp}/other.duckdb' AS o",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "SELECT 1; DROP TABLE step",
        "CHECKPOINT",
        # functions with a side effect even in a rolled-back transaction, SQL as a string, the file's path
        "SELECT * FROM checkpoint()",
        "SELECT * FROM force_checkpoint()",
        "SELECT * FROM truncate_duckdb_logs()",
        "SELECT setseed(0.5)",
        'SELECT "setseed"(0.5)',
        "SELECT path FROM duckdb_databases()",
        "FROM duckdb_databases",
        "SELECT * FROM pragma_database_list",
        "SELECT current_setting('temp_directory')",
        "SELECT * FROM query('SELECT * FROM checkpoint()')",
        "SELECT * FROM step WHERE step IN (SELECT 1 FROM checkpoint())",
    ]


def _collectives():
    # Three controlled calls: bytes = duration_ns = 1e9 -> algbw 1 GB/s each.
    ops = ["all_reduce", "all_gather_into_tensor", "send"]
    n = len(ops)
    cols = {
        "rank": np.zeros(n), "step": np.zeros(n), "start_ns": np.zeros(n),
        "duration_ns": np.full(n, 10**9), "op": ops, "role": ["dp", "tp", "p2p:pp"],
        "group_size": [4, 4, 2], "bytes": np.full(n, 10**9), "peer": [-1, -1, 1],
        "dtype": ["float32"] * n, "is_async": np.zeros(n),
    }
    return encode_batch(Kind.COLLECTIVE, cols, source_id="views", seq=2, run_id="run-v")


def _steps():
    n = 3
    cols = {c: np.zeros(n) for c in ("step", "start_ns", "data_wait_ns", "forward_ns", "backward_ns",
                                      "optimizer_ns", "comm_exposed_ns", "tokens", "samples", "loss",
                                      "micro_batch", "micro_batches")}
    cols.update(rank=np.zeros(n), duration_ns=[10e6, 20e6, 30e6], compute_ns=[5e6, 7e6, 100e6])
    return encode_batch(Kind.STEP, cols, source_id="views", seq=1, run_id="run-v")


def _run_start():
    # Two ranks of one run: world_size 2, tp 2; the runs view folds them into one row.
    from tests.collector.util import columns

    cols = columns(Kind.RUN_START, 2)
    cols.update(rank=[0, 1], start_ns=[2000, 1000], world_size=[2, 2], tp=[2, 2], pp=[1, 1], dp=[1, 1],
                model_name=["gpt-tiny", "gpt-tiny"], hostname=["h0", "h1"])
    return encode_batch(Kind.RUN_START, cols, source_id="views", seq=3, run_id="run-v")


def _offloads():
    # rank 0 copies 2 GB d2h in 1 s then 2 GB in 3 s: 4 GB over 4 s = 1 GB/s.
    cols = {"rank": [0, 0], "step": [1, 1], "start_ns": [0, 0], "duration_ns": [10**9, 3 * 10**9],
            "direction": ["d2h", "d2h"], "what": ["grads", "grads"], "bytes": [2 * 10**9, 2 * 10**9]}
    return encode_batch(Kind.OFFLOAD, cols, source_id="views", seq=4, run_id="run-v")


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("query")
    c = start_collector(tmp, extra_args=["--flush-interval-s", "0.1"])
    f = Feeder(c.addr)
    f.send(_steps())
    f.send(_collectives())
    f.send(_run_start())
    f.send(_offloads())
    for seq in range(1, 4):
        f.send(batch("q", seq, 50))
    f.wait_ack("q", 3)
    f.wait_ack("views", 4)
    f.close()
    assert f.wait_end() is None
    c.tmp = tmp
    yield c
    c.stop()


def _tt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TT, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_views_follow_the_formulas(collector):
    t = sql(collector.addr, "SELECT op, algbw_gbps, busbw_gbps, calls FROM collective_stats WHERE run_id = 'run-v'")
    got = {r["op"]: (r["calls"], r["algbw_gbps"], r["busbw_gbps"]) for r in t.to_pylist()}
    assert got == {
        "all_reduce": (1, 1.0, pytest.approx(2 * 3 / 4)),  # 2(n-1)/n, n = 4
        "all_gather_into_tensor": (1, 1.0, pytest.approx(3 / 4)),  # (n-1)/n
        "send": (1, 1.0, pytest.approx(1.0)),
    }
    s = sql(collector.addr, "SELECT steps, step_ms_p50, compute_ms_p50 FROM step_summary WHERE run_id = 'run-v'")
    assert s.to_pylist() == [{"steps": 3, "step_ms_p50": pytest.approx(20.0), "compute_ms_p50": pytest.approx(7.0)}]
    o = sql(collector.addr, "SELECT transfers, total_bytes, gbps FROM offload_bandwidth WHERE run_id = 'run-v'")
    assert o.to_pylist() == [{"transfers": 2, "total_bytes": 4 * 10**9, "gbps": pytest.approx(1.0)}]


def test_runs_view(collector):
    t = sql(collector.addr, "SELECT run_id, started_ns, world_size, tp, model_name, ranks_started, hostnames FROM runs")
    assert t.to_pylist() == [
        {"run_id": "run-v", "started_ns": 1000, "world_size": 2, "tp": 2, "model_name": "gpt-tiny",
         "ranks_started": 2, "hostnames": ["h0", "h1"]}
    ]


def test_clock_watch_and_control_not_yet_built(collector):
    import time

    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc

    with grpc.insecure_channel(collector.addr) as ch:
        sent = time.time_ns()
        reply = pb_grpc.IngestStub(ch).Clock(pb.ClockRequest(client_send_ns=sent), timeout=30)
        back = time.time_ns()
        assert reply.client_send_ns == sent
        assert sent <= reply.server_recv_ns <= reply.server_send_ns <= back  # same host, same clock
        # Query.Watch (the TUI issue): a snapshot of the run; an unknown run is NOT_FOUND, naming the runs
        from collector.query import snapshot as snapmod

        first = next(iter(pb_grpc.QueryStub(ch).Watch(pb.WatchRequest(run_id="run-v", interval_s=0.1), timeout=30)))
        assert snapmod.decode(first.arrow_ipc).header["run_id"] == "run-v"
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.QueryStub(ch).Watch(pb.WatchRequest(run_id="no-such-run"), timeout=30))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "run-v" in e.value.details()
        # Control is built (collector/control/): a status for an action it never sent is ignored
        assert pb_grpc.ControlStub(ch).Report(pb.CommandStatus(command_id="c"), timeout=30) == pb.StatusAck()


def test_query_service_refuses_every_probe_and_keeps_ingesting(collector):
    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc

    rows_before = scalar(collector.addr, "SELECT count(*) FROM step")
    with grpc.insecure_channel(collector.addr) as ch:
        stub = pb_grpc.QueryStub(ch)
        for probe in _probes(collector.tmp):
            with pytest.raises(grpc.RpcError) as e:
                stub.Sql(pb.QueryRequest(sql=probe), timeout=60)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (probe, e.value.details())
            assert "read-only" in e.value.details() or "disabled" in e.value.details(), probe
    assert not (collector.tmp / "leak.csv").exists()
    assert scalar(collector.addr, "SELECT count(*) FROM step") == rows_before
    # The writer still writes.
    f = Feeder(collector.addr)
    f.send(batch("q", 4, 50))
    f.wait_ack("q", 4)
    f.close()
    f.wait_end()
    assert scalar(collector.addr, "SELECT count(*) FROM step") == rows_before + 50


def test_cli_through_collector_and_locked_file(collector):
    r = _tt("--collector", collector.addr, "--json", "SELECT source_id, hwm FROM sources ORDER BY source_id")
    assert r.returncode == 0, r.stderr
    assert {"source_id": "views", "hwm": 4} in json.loads(r.stdout)
    r = _tt("--collector", collector.addr, "INSERT INTO step SELECT * FROM step")
    assert r.returncode == 2 and "read-only: INSERT is not allowed" in r.stderr
    r = _tt("--collector", collector.addr, "SELECT * FROM read_csv('/etc/passwd')")
    assert r.returncode == 2 and "/etc/passwd" in r.stderr and "disabled" in r.stderr
    # The file itself is held by the collector: say so, and point at --collector.
    r = _tt(str(collector.db), "SELECT 1")
    assert r.returncode != 0 and "--collector" in r.stderr, r.stderr


def test_cli_on_file_after_stop(collector, tmp_path):
    assert collector.stop() == 0
    db = str(collector.db)
    r = _tt(db, "SELECT count(*) AS n FROM ingest_log WHERE source_id = 'q'")
    assert r.returncode == 0 and r.stdout.split()[2] == "4", r.stdout
    r = _tt("--csv", db, "SELECT source_id, rows FROM sources ORDER BY source_id")
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "source_id,rows"
    for probe in _probes(tmp_path):
        r = _tt(db, probe)
        assert r.returncode == 2, (probe, r.stdout, r.stderr)
        assert "read-only" in r.stderr, (probe, r.stderr)
    assert not (tmp_path / "leak.csv").exists()


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_a_wide_result_is_refused_by_its_bytes_not_built(tmp_path):
    """Rows are bounded, and bytes too: 100 rows of 4 MB each (400 MB) once took the collector from
    ~200 MB to 2.1 GB; now it stops at --max-query-mb, says so, and lives on."""
    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc

    c = start_collector(tmp_path)  # the default --max-query-mb (64)
    try:
        with grpc.insecure_channel(c.addr) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.QueryStub(ch).Sql(pb.QueryRequest(sql="SELECT repeat('x', 4000000) FROM range(100)"), timeout=120)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert "--max-query-mb" in e.value.details() and "MiB" in e.value.details()
        peak = _peak_rss_mb(c.proc.pid)
        assert peak < 1200, f"the collector peaked at {peak:.0f} MB building a refused result"
        assert scalar(c.addr, "SELECT 7") == 7
        assert len(sql(c.addr, "SELECT repeat('x', 1000) AS s FROM range(1000)")) == 1000  # 1 MB: fine
    finally:
        assert c.stop() == 0


HOSTILE = "chr(27) || '[2J' || chr(27) || ']52;c;aGk=' || chr(7) || 'node' || chr(10) || chr(155) || '1'"


def test_what_a_rank_sent_never_reaches_the_terminal_as_escapes(collector):
    """A screen clear, an OSC 52 clipboard write, a newline and a C1 CSI in a value: the table
    shows each as U+FFFD; JSON escapes them; CSV into a pipe keeps the data exact, on a terminal
    it replaces them too."""
    import os
    import pty

    collector.stop()  # (the module's collector may be stopped already) the file, as after a run
    sql_text = f"SELECT {HOSTILE} AS hostname, 1 AS n"
    table = _tt(str(collector.db), sql_text)
    assert table.returncode == 0, table.stderr
    assert not any(ch in table.stdout for ch in "\x1b\x07\x9b") and "\ufffd[2J\ufffd]52;c;aGk=\ufffdnode\ufffd\ufffd1" in table.stdout
    js = _tt("--json", str(collector.db), sql_text)
    assert "\x1b" not in js.stdout and json.loads(js.stdout)[0]["hostname"].startswith("\x1b[2J")  # escaped, exact
    exact = _tt("--csv", str(collector.db), sql_text)
    assert "\x1b]52;c;aGk=\x07node" in exact.stdout  # a file or a pipe gets the data as it is
    main, sub = pty.openpty()
    try:
        r = subprocess.run([*TT, "--csv", str(collector.db), sql_text], cwd=ROOT, stdout=sub,
                           stderr=subprocess.PIPE, timeout=120)
        os.close(sub)
        sub = -1
        out = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the pty's other end closed
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(main)
        if sub >= 0:
            os.close(sub)
    assert r.returncode == 0, r.stderr
    assert b"\x1b" not in out and "\ufffd]52;c;aGk=\ufffdnode".encode() in out
