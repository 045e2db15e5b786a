"""One process with a plain ``Tracer`` (no handler registered) shipping to a real collector: a
second profiling window asked while the first still runs is refused by the rank, saying so; the
tracer's close ends the running window early and still stores its trace, with the steps it had."""

from __future__ import annotations

import time

import pytest

from tests.collector.control.harness import Client
from tests.support.services import start_collector
from tracetop.wire import tracetop_pb2 as pb

RUN = "profile-close-1"


def test_a_second_window_is_refused_and_close_ends_the_first(tmp_path, monkeypatch):
    from trainer_hooks import Tracer

    monkeypatch.setenv("TRACETOP_COMMAND_POLL_S", "0.2")
    monkeypatch.setenv("TRACETOP_COMMAND_EVERY_STEPS", "2")
    monkeypatch.setenv("TRACETOP_PROFILE", "1")  # no handler: the boundary runs for profiling alone
    monkeypatch.setenv("TRACETOP_FLUSH_S", "0.2")
    c = start_collector(tmp_path, extra_args=["--controller", "off"])
    client = Client(c.addr)
    tracer = Tracer(endpoint=c.addr, run_id=RUN, rank=0, world_size=1, wrap_collectives=False)
    asked: dict[str, str] = {}
    states: dict[str, dict] = {}

    def submit(steps: int) -> str:
        return client.control.Submit(pb.ControlRequest(run_id=RUN, op=pb.PROPOSE, kind=pb.PROFILE, int_value=steps,
                                                       values=[0], approve=True, by="person:test"), timeout=30).action_id

    try:
        deadline = time.monotonic() + 240
        step = 0
        while time.monotonic() < deadline and "B" not in states:
            with tracer.step(step):
                time.sleep(0.03)
            step += 1
            if step % 10:
                continue
            if "A" not in asked:
                if client.sql(f"SELECT count(*) AS n FROM run_start WHERE run_id = '{RUN}'")[0]["n"]:
                    asked["A"] = submit(100)  # 100 steps of 30 ms: still running when B comes
            elif "B" not in asked:
                if client.action(asked["A"]).get("state") == "applied":
                    asked["B"] = submit(3)
            else:
                b = client.action(asked["B"])
                if b.get("state") in ("rejected", "applied", "lost"):
                    states["B"] = b
        assert "B" in states, (asked, step)
        tracer.close()  # the window of A is still running: closed with the steps it had
        a_step = client.action(asked["A"])["step"]
        rows = wait_rows(client, asked["A"])
    finally:
        tracer.close()
        client.close()
        c.stop()
    b = states["B"]
    assert b["state"] == "rejected" and f"a profiling window (action {asked['A']}) is still running" in b["outcome"], b
    (w,) = rows
    assert w["state"] == "stored" and w["first_step"] == a_step and 0 < w["steps"] < 100, w
    assert "the run ended after" in w["note"] and w["bytes"] > 0, w


def wait_rows(client: Client, action_id: str) -> list[dict]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = client.sql(f"SELECT * FROM profile_traces WHERE action_id = '{action_id}'")
        if rows:
            return rows
        time.sleep(0.2)
    pytest.fail(f"no profile_traces row for action {action_id}")
