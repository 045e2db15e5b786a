"""The JSON webhook sink against a real HTTP receiver served by the test."""

from __future__ import annotations

from dataclasses import replace

from collector.export._sender import AlertTracker
from collector.export.webhook import WebhookSink

from .records import grad_sync, pending_bubble, resolved, straggler
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


def test_incident_webhook_payload_names_the_incident_and_pages_once():
    """A real receiver: the cause and its consequence arrive with kind, incident_id and role, and an
    incidents list (culprit, cause, consequences); a payload of consequences only does not page."""
    rx = Receiver()
    sink = WebhookSink(rx.url, retry_s=0.05)
    try:
        cause = straggler()
        cause = replace(cause, incident_id=cause.id)
        cons = grad_sync(incident_id=cause.id)
        sink.publish([cause, cons], [cause, cons])
        wait_until(lambda: rx.bodies, 10, "the incident's payload")
        body = rx.bodies[0]
        got = {a["rule"]: a for a in body["alerts"]}
        assert got["straggler"]["kind"] == "fault" and got["straggler"]["role"] == "cause"
        assert got["grad_sync"]["kind"] == "sla" and got["grad_sync"]["role"] == "consequence"
        assert got["grad_sync"]["incident_id"] == got["straggler"]["incident_id"] == cause.id
        assert body["incidents"] == [{"incident_id": cause.id, "rule": "straggler", "cause": "compute",
                                      "culprit": "rank 3, stage 1", "run_id": "run-7", "state": "firing",
                                      "consequences": ["grad_sync"]}]
        assert body["page"] is True
        # a second consequence of the same incident: news, but no page
        late = grad_sync(incident_id=cause.id, labels={"rank": "1"}, scope="rank")
        sink.publish([late], [cause, cons, late])
        wait_until(lambda: len(rx.bodies) == 2, 10, "the consequence's payload")
        body = rx.bodies[1]
        assert body["page"] is False and [a["role"] for a in body["alerts"]] == ["consequence"]
        assert body["incidents"][0]["culprit"] == "rank 3, stage 1"  # described from the cause it knows
        # an SLA breach that fired standalone and then joined an incident is news again, with it
        solo = grad_sync(run_id="run-8")
        sink.publish([solo], [cause, cons, late, solo])
        wait_until(lambda: len(rx.bodies) == 3, 10, "the standalone breach")
        assert rx.bodies[2]["page"] is True and rx.bodies[2]["incidents"] == []
        assert [(a["run_id"], a["role"]) for a in rx.bodies[2]["alerts"]] == [("run-8", "")]
        c8 = straggler(run_id="run-8")
        c8 = replace(c8, incident_id=c8.id)
        sink.publish([c8], [cause, cons, late, c8, replace(solo, incident_id=c8.id)])
        wait_until(lambda: len(rx.bodies) == 4, 10, "the cause and the attachment")
        roles = sorted((a["rule"], a["role"]) for a in rx.bodies[3]["alerts"])
        assert roles == [("grad_sync", "consequence"), ("straggler", "cause")]
    finally:
        sink.close()
        rx.close()
