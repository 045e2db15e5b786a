"""Rank 0 polls Control when the collector's Push replies say commands wait (a real collector, a
plain Tracer): with nothing waiting it does not poll at all for many seconds (it used to every 5 s),
and a command submitted then still reaches rank 0 within about a shipment interval."""

from __future__ import annotations

import time

from tests.collector.control.harness import Client
from tests.support.services import start_collector
from tracetop.wire import tracetop_pb2 as pb
from trainer_hooks import control_link

RUN = "poll-on-push-1"


def test_rank_0_polls_only_when_a_push_reply_says_commands_wait(tmp_path, monkeypatch):
    from trainer_hooks import Tracer

    monkeypatch.delenv("TRACETOP_COMMAND_POLL_S", raising=False)  # the default: replies decide
    monkeypatch.setenv("TRACETOP_COMMAND_EVERY_STEPS", "2")
    monkeypatch.setenv("TRACETOP_PROFILE", "1")  # no handler: the boundary runs for profiling alone
    monkeypatch.setenv("TRACETOP_FLUSH_S", "1")  # a Push (and its reply) every second
    c = start_collector(tmp_path, extra_args=["--controller", "off"])
    client = Client(c.addr)
    tracer = Tracer(endpoint=c.addr, run_id=RUN, rank=0, world_size=1, wrap_collectives=False)
    stats = tracer.commands.stats  # type: ignore[union-attr]
    link = tracer.commands.link  # type: ignore[union-attr]
    step = 0

    def run_for(seconds: float, until=lambda: False) -> None:
        nonlocal step
        end = time.monotonic() + seconds
        while time.monotonic() < end and not until():
            with tracer.step(step):
                time.sleep(0.02)
            step += 1

    try:
        run_for(60, until=lambda: link.told_at is not None)  # the subscriber started, a reply said
        assert link.told_at is not None, "no Push reply said whether commands wait"
        run_for(12)  # nothing waits: 12 s without a poll (before: one every 5 s)
        quiet_polls = stats["polls"]
        submitted = time.monotonic()
        client.control.Submit(pb.ControlRequest(run_id=RUN, op=pb.PROPOSE, kind=pb.PROFILE, int_value=2, values=[0],
                                                approve=True, by="person:test"), timeout=30)
        run_for(60, until=lambda: stats["received"] > 0)
        delay_s = time.monotonic() - submitted
    finally:
        tracer.close()
        client.close()
        c.stop()
    assert quiet_polls == 0, f"rank 0 polled {quiet_polls} times with nothing waiting"
    assert stats["received"] == 1, stats
    # a Push every 1 s says so, then the poll: well inside the 60 s idle poll (a few s at load 4)
    assert delay_s < 15, f"the command took {delay_s:.1f} s to reach rank 0"
    assert stats["polls"] <= 3, stats


def test_when_rank_0_polls():
    due = control_link.poll_due
    idle = control_link.IDLE_POLL_S
    # a receiver that never said: every poll_s, as before
    assert not due(104.9, 100.0, 5.0, False, None, False) and due(105.0, 100.0, 5.0, False, None, False)
    # one that says nothing waits: only after the idle poll
    assert not due(150.0, 100.0, 5.0, False, 149.0, False) and due(100.0 + idle, 100.0, 5.0, False, 159.0, False)
    # ... and at once when a reply says something waits
    assert due(101.0, 100.0, 5.0, True, 101.0, False)
    # a reply not heard for TOLD_FRESH_S (the collector unreachable, a stream receiver): every poll_s again
    assert due(140.0, 130.0, 5.0, False, 100.0, False)
    # an explicit TRACETOP_COMMAND_POLL_S is kept whatever replies say
    assert due(100.5, 100.0, 0.5, False, 100.4, True)
    # a failure's backoff (wait_s 20) holds the regular poll back
    assert not due(110.0, 100.0, 20.0, False, None, False) and due(120.0, 100.0, 20.0, False, None, False)
