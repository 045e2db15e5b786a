"""Bad commands are refused at once with the reason, and nothing is stored or sent: a real
collector whose runs come from real RUN_START rows (in-process Tracers, world of one)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from tests.collector.control.harness import Client, wait_for
from tests.support import ROOT
from tests.support.services import start_collector
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import source_key
from trainer_hooks import Tracer


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    c = start_collector(tmp, extra_args=["--controller", "off"])
    keys = {}
    for run, zero in (("bad-zero1", 1), ("bad-zero0", 0)):
        t = Tracer(endpoint=c.addr, run_id=run, rank=0, world_size=1, wrap_collectives=False)
        t.describe(micro_batch=4, micro_batches=3, zero_stage=zero, dp=1)
        t.close()
        keys[run] = source_key(t.shipper.source_id, t.shipper.epoch)  # what its reports carry
    client = Client(c.addr)
    client.keys = keys
    wait_for(lambda: client.sql("SELECT count(*) AS n FROM run_start")[0]["n"] == 2, 60, "two runs")
    yield c, client
    client.close()
    c.stop()


def _refused(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value


def test_refused_with_the_reason_and_nothing_stored(collector):
    c, client = collector
    e = _refused(lambda: client.set_micro_batch("no-such-run", 2))
    assert e.code() == grpc.StatusCode.NOT_FOUND and "no run 'no-such-run'" in e.details()
    assert "bad-zero1" in e.details()  # it says which runs it knows
    e = _refused(lambda: client.set_micro_batch("bad-zero1", 5))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not divide the 12 samples" in e.details() and "[1, 2, 3, 4, 6, 12]" in e.details()
    e = _refused(lambda: client.offload("bad-zero0", True))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "ZeRO 0" in e.details()
    e = _refused(lambda: client.set_micro_batch("bad-zero1", 4))
    assert "already in force" in e.details()
    e = _refused(lambda: client.op(pb.APPROVE, "999"))
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert client.sql("SELECT count(*) AS n FROM actions")[0]["n"] == 0
    assert client.sql("SELECT count(*) AS n FROM action_ranks")[0]["n"] == 0


def test_a_proposal_is_approved_or_rejected_by_a_person(collector):
    c, client = collector
    r = client.control.Submit(pb.ControlRequest(run_id="bad-zero1", op=pb.PROPOSE, kind=pb.SET_MICRO_BATCH, int_value=2,
                                                by="controller", rule="bubble", reason="why", expected="what"))
    assert r.state == "proposed"
    assert client.op(pb.REJECT, r.action_id).state == "dismissed"
    e = _refused(lambda: client.op(pb.APPROVE, r.action_id))
    assert "only a proposal can be approved" in e.details()
    row = client.action(r.action_id)
    assert (row["state"], row["rule"], row["proposed_by"], row["sent_ns"]) == ("dismissed", "bubble", "controller", None)


def test_the_cli_exits_2_with_the_reason(collector):
    c, client = collector
    p = subprocess.run([sys.executable, "-m", "tracetop.cli", "control", "--collector", c.addr, "--run", "bad-zero0",
                        "offload", "on"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "refused, nothing sent" in p.stderr and "ZeRO 0" in p.stderr
    p = subprocess.run([sys.executable, "-m", "tracetop.cli", "control", "--collector", c.addr, "--run", "bad-zero1",
                        "set-micro-batch", "two"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "positive whole number" in p.stderr


def test_the_agent_relays_poll_and_report(collector, tmp_path):
    """Hooks that ship through a node agent poll and report through its relay (unix socket)."""
    from agent.relay import Relay
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc
    from tracetop.wire.shipper import MemoryTransport, Shipper

    c, client = collector
    shipper = Shipper(None, run_id="agent", rank=-1, transport=MemoryTransport())
    sock = f"unix://{tmp_path / 'agent.sock'}"
    relay = Relay(shipper, [sock], control_target=c.addr).start()
    try:
        a = client.set_micro_batch("bad-zero1", 2)
        with grpc.insecure_channel(sock) as ch:
            stub = pb_grpc.ControlStub(ch)
            got = stub.Poll(pb.SubscribeRequest(run_id="bad-zero1", rank=0), timeout=30)
            assert [(x.command_id, x.int_value) for x in got.commands] == [(a.action_id, 2)]
            stub.Report(pb.CommandStatus(command_id=a.action_id, run_id="bad-zero1", rank=0, applied=True, step=10,
                                         source_key=client.keys["bad-zero1"]), timeout=30)
        row = client.action(a.action_id)
        assert (row["state"], row["ranks_applied"], row["step"]) == ("applied", 1, 10)
    finally:
        relay.stop()
        shipper.close(1.0)
