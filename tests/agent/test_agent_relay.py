"""The relay end to end: real collector, real agent, real hook processes, DuckDB checked after.

- collector stopped for OUTAGE_S while 4 hooks ship through the agent -> after the restart every
  event is stored exactly once (5 s by default; the 60 s case of the issue is marked slow);
- agent killed -9 (with batches it acked only on its spool) and restarted -> nothing it acked is
  lost, nothing stored twice;
- the Prometheus endpoint serves the sampled GPU/host metrics and the relay counters.
"""

from __future__ import annotations

import signal
import time

import duckdb
import pytest

from tests.agent.hook_procs import exactly_once, start_hook, wait_hooks
from tests.support.services import start_agent, start_collector


@pytest.mark.parametrize("outage_s", [5, pytest.param(60, marks=pytest.mark.slow)])
def test_collector_outage_loses_nothing(tmp_path, outage_s):
    c = start_collector(tmp_path, listen="unix")
    sock = f"unix://{tmp_path / 'agent.sock'}"
    agent = start_agent(c.addr, sock, tmp_path / "spool", "--fake-gpus", "2", "--interval-s", "0.5")
    collector2 = None
    try:
        ship_s = outage_s + 6
        n = 200 * int(ship_s)  # 200 events/s per hook, for the whole outage and beyond
        hooks = [start_hook(sock, rank, n, ship_s) for rank in range(4)]
        time.sleep(2)
        assert c.stop() == 0  # collector down: the agent keeps acking the hooks from its spool
        time.sleep(outage_s / 2)
        during = agent.scrape()
        assert during["tracetop_agent_collector_connected"] == 0
        assert during["tracetop_agent_spool_bytes"] > 0
        time.sleep(outage_s / 2)
        collector2 = start_collector(tmp_path, listen=c.addr, db=c.db)
        outs = wait_hooks(hooks)
        assert all("dropped=0" in o for o in outs), outs
        agent.wait_drained()
        # The endpoint serves what was sampled (fake GPUs: 60 C, 300 W) and what was relayed.
        m = agent.scrape()
        assert m["tracetop_gpu_temperature_c"] == 2 * 60
        assert m["tracetop_gpu_power_mw"] == 2 * 300_000
        assert m["tracetop_host_memory_total_bytes"] > 0
        assert m["tracetop_agent_relay_rows_total"] >= 4 * n
        assert m["tracetop_agent_spool_full_events_total"] == 0
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(30) == 0
        assert collector2.stop() == 0
    finally:
        for p in [agent.proc, c.proc] + ([collector2.proc] if collector2 else []):
            if p.poll() is None:
                p.kill()
    assert exactly_once(c.db) == {r: (n, n) for r in range(4)}
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        gpu_rows = con.execute("SELECT count(*), min(temp_c), max(temp_c) FROM gpu_sample").fetchone()
        gaps = con.execute("SELECT count(*) FROM gap").fetchone()[0]
        offsets = con.execute("SELECT count(*) FROM clock_offset WHERE rtt_ns > 0").fetchone()[0]
    finally:
        con.close()
    assert gpu_rows[0] >= 2 * 2 * outage_s and gpu_rows[1:] == (60, 60)  # sampled through the outage too
    assert gaps == 0
    assert offsets >= 1


def test_agent_kill9_replays_spool_without_duplicates(tmp_path):
    sock = f"unix://{tmp_path / 'agent.sock'}"
    collector_addr = f"unix://{tmp_path / 'collector.sock'}"
    spool = tmp_path / "spool"
    # No collector yet. Two hooks ship, are acked by the agent and exit: only the agent's spool
    # holds their events now. Two more keep shipping across the kill and reconnect to the new agent.
    agent = start_agent(collector_addr, sock, spool, "--fake-gpus", "1")
    c = agent2 = None
    try:
        n_done, n_live = 3000, 4000
        done = [start_hook(sock, rank, n_done, 1.0) for rank in (0, 1)]
        live = [start_hook(sock, rank, n_live, 8.0) for rank in (2, 3)]
        wait_hooks(done, timeout_s=120)
        assert agent.scrape()["tracetop_agent_relay_rows_total"] >= 2 * n_done
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(10)
        spooled = {p.parent.name.partition("@")[0] for p in spool.glob("*/*.batch")}  # folders: source@epoch
        assert {"hook-0", "hook-1", "hook-2", "hook-3"} <= spooled  # acked data that only the spool holds
        time.sleep(1.0)  # the live hooks notice, buffer, retry
        agent2 = start_agent(collector_addr, sock, spool, "--fake-gpus", "1")
        time.sleep(1.0)
        c = start_collector(tmp_path, listen=collector_addr)
        wait_hooks(live)
        agent2.wait_drained()
        agent2.proc.send_signal(signal.SIGTERM)
        assert agent2.proc.wait(30) == 0
        assert c.stop() == 0
    finally:
        for p in [agent.proc] + ([agent2.proc] if agent2 else []) + ([c.proc] if c else []):
            if p.poll() is None:
                p.kill()
    assert not list(spool.glob("*/*.batch"))
    got = exactly_once(c.db)
    assert got == {0: (n_done, n_done), 1: (n_done, n_done), 2: (n_live, n_live), 3: (n_live, n_live)}


def test_idle_streams_of_one_process_do_not_keep_hooks_out(tmp_path):
    """Every call slot of the relay held by streams that never send (one local process): they are
    ended after idle_stream_s, and a hook's batches get through to the collector."""
    import grpc

    from agent.relay import Relay
    from tests.support.services import start_collector
    from tracetop.events import SCHEMAS, Kind
    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire.shipper import Shipper

    c = start_collector(tmp_path)
    agent = Shipper(c.addr, run_id="slots", spool_dir=tmp_path / "spool", flush_interval_s=60)
    sock = f"unix://{tmp_path / 'relay.sock'}"
    import inspect

    idle = {"idle_stream_s": 2.0} if "idle_stream_s" in inspect.signature(Relay).parameters else {}
    relay = Relay(agent, [sock], max_workers=8, **idle).start()  # 6 call slots
    idle_calls = []
    ch = grpc.insecure_channel(sock)
    try:
        import queue as _queue

        for _ in range(6):  # hold every slot, send nothing
            q: _queue.Queue = _queue.Queue()
            call = ch.stream_stream("/tracetop.v1.Ingest/Stream", request_serializer=pb.ColumnBatch.SerializeToString,
                                    response_deserializer=pb.Ack.FromString)(iter(q.get, None))
            idle_calls.append((q, call))
        time.sleep(0.5)
        hook = Shipper(sock, run_id="slots", rank=3, flush_interval_s=60)
        names = [col.name for col in SCHEMAS[Kind.STEP]]
        for st in range(20):
            row = dict.fromkeys(names, 0)
            row.update(rank=3, step=st)
            hook.record(Kind.STEP, *(row[n] for n in names))
        assert hook.flush(30), hook.stats()
        hook.close()
        assert agent.flush(30)
    finally:
        for q, call in idle_calls:
            q.put(None)
            call.cancel()
        ch.close()
        relay.stop()
        agent.close(5)
        assert c.stop() == 0
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        assert con.execute("SELECT count(DISTINCT step) FROM step WHERE run_id = 'slots'").fetchone()[0] == 20
    finally:
        con.close()


def test_the_relay_keeps_marks_for_a_bounded_number_of_sources(tmp_path):
    """Many sources (hooks restarting, or one process inventing ids) cost the relay a bounded map;
    every row still arrives once at a real collector (its own marks answer a resend)."""
    import inspect

    import grpc

    from agent.relay import Relay
    from tests.collector.util import batch
    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc
    from tracetop.wire.shipper import Shipper

    c = start_collector(tmp_path)
    agent = Shipper(c.addr, run_id="many", spool_dir=tmp_path / "spool", flush_interval_s=60)
    sock = f"unix://{tmp_path / 'relay.sock'}"
    bound = {"max_sources": 16} if "max_sources" in inspect.signature(Relay).parameters else {}
    relay = Relay(agent, [sock], **bound).start()
    try:
        with grpc.insecure_channel(sock) as ch:
            push = pb_grpc.IngestStub(ch).Push
            for i in range(100):
                reply = push(pb.PushRequest(batches=[batch(f"hook-{i}", 1, 5, run_id="many").SerializeToString()]), timeout=30)
                assert not reply.end_code and reply.acks[0].seq == 1
            # a resend of a forgotten source: spooled again, stored once
            reply = push(pb.PushRequest(batches=[batch("hook-0", 1, 5, run_id="many").SerializeToString()]), timeout=30)
            assert not reply.end_code
        assert len(relay._high) <= 16 and len(relay._source_locks) <= 32, (len(relay._high), len(relay._source_locks))
        assert agent.flush(60)
    finally:
        relay.stop()
        agent.close(5)
        assert c.stop() == 0
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM step WHERE run_id = 'many'").fetchone()[0] == 100 * 5
    finally:
        con.close()


@pytest.mark.parametrize("prepared", ["other-user", "symlink", "world-writable"])
def test_a_spool_folder_another_user_prepared_is_refused(tmp_path, prepared):
    """The agent replays its spool's files to the collector as data: a folder pre-created (or linked)
    by someone else is refused at start, naming the fault and the fix."""
    import os
    import subprocess
    import sys

    from tests.support import ROOT

    spool = tmp_path / "spool"
    if prepared == "symlink":
        (tmp_path / "elsewhere").mkdir()
        spool.symlink_to(tmp_path / "elsewhere")
    else:
        spool.mkdir()
        if prepared == "other-user":
            if os.geteuid() != 0:
                pytest.skip("needs root to give the folder to another user")
            os.chown(spool, 65534, 65534)
        else:
            spool.chmod(0o777)
    r = subprocess.run([sys.executable, "-m", "agent", "--collector", f"unix://{tmp_path / 'c.sock'}", "--listen",
                        f"unix://{tmp_path / 'a.sock'}", "--spool-dir", str(spool), "--fake-gpus", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, r.stdout[-500:]
    assert "spool folder" in r.stderr and "--spool-dir" in r.stderr, r.stderr[-800:]
