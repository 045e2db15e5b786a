"""The JSON webhook sink against a real HTTP receiver served by the test."""

from __future__ import annotations

from dataclasses import replace

from collector.export._sender import AlertTracker
from collector.export.webhook import WebhookSink

from .records import pending_bubble, resolved, straggler
from .tools import Receiver, wait_until


def test_transitions_posted_as_plain_json_and_retried_after_a_failure():
    rx = Receiver(fail_first=1)  # the first POST gets HTTP 500: it is retried, not lost
    sink = WebhookSink(rx.url, retry_s=0.05)
    try:
        a = replace(straggler(), threshold=float("nan"))
        sink.publish([a, pending_bubble()], [a])
        wait_until(lambda: rx.bodies, 10, "the firing payload")
        body = rx.bodies[0]
        assert body["source"] == "tracetop" and body["version"] == 1 and body["firing"] == 1
        (got,) = body["alerts"]  # the pending alert is not news
        assert got["state"] == "firing" and got["rule"] == "straggler" and got["labels"] == {"rank": "3", "stage": "1"}
        assert got["message"] == a.message and got["value"] == a.value and got["threshold"] is None
        assert got["first_step"] == 20 and got["run_id"] == "run-7" and got["severity"] == "critical"
        assert sink.stats()["failures"] == 1

        # a value update of a firing alert is not a transition: nothing sent
        b = replace(a, value=9.7, last_step=23)
        sink.publish([b], [b])
        r = resolved(b)
        sink.publish([r], [])
        wait_until(lambda: len(rx.bodies) == 2, 10, "the resolved payload")
        (got,) = rx.bodies[1]["alerts"]
        assert got["state"] == "resolved" and got["last_step"] == 25 and got["value"] == 9.7
        assert rx.bodies[1]["firing"] == 0
        assert rx.requests == 3  # 500, firing, resolved
    finally:
        sink.close()
        rx.close()


def test_tracker_transitions():
    t = AlertTracker()
    a, b = straggler(rank=3), straggler(rank=2)
    x = t.update([a, b], [a, b], now_ns=1)
    assert {k.labels["rank"] for k in x.fired} == {"3", "2"} and x.resolved == []
    x = t.update([replace(a, value=1.0)], [a, b], now_ns=2)
    assert x.fired == [] and x.resolved == []
    x = t.update([], [b], now_ns=a.last_ns + 5)  # a's RESOLVED record was lost: inferred
    assert [r.labels["rank"] for r in x.resolved] == ["3"] and x.resolved[0].state == "resolved"
    assert x.resolved[0].last_ns == a.last_ns + 5
    r = resolved(b)
    x = t.update([r], [], now_ns=3)
    assert x.resolved == [r]
    assert t.update([pending_bubble()], [pending_bubble()], now_ns=4).fired == []  # pending never fires out


def test_what_was_published_before_close_is_delivered():
    rx = Receiver()
    sink = WebhookSink(rx.url)
    try:
        a = straggler()
        sink.publish([a], [a])
        sink.publish([resolved(a)], [])
        sink.close(timeout_s=10)  # the receiver answers: close returns once both went out
        assert [b["alerts"][0]["state"] for b in rx.bodies] == ["firing", "resolved"]
        sink.publish([a], [a])  # after close: ignored, never raises
        assert sink.stats()["requests"] == 2
    finally:
        rx.close()
