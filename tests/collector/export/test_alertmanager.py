"""The Alertmanager sink against a real Alertmanager (Debian's prometheus-alertmanager 0.25).

Alertmanager routes every alert at once to a webhook this test serves (send_resolved: true), so the
resolution is observed positively, not only as the alert vanishing from GET /api/v2/alerts."""

from __future__ import annotations

import calendar
import time
from dataclasses import replace

from collector.export._sender import SendError
from collector.export.alertmanager import AlertmanagerSink, am_alert, label_name, rfc3339
from collector.live.model import FIRING

from .records import grad_sync, pending_bubble, resolved, straggler
from .tools import Alertmanager, Receiver, wait_until


def ns_of(rfc: str) -> int:
    """Go's RFC3339Nano (UTC, 'Z') -> ns since the epoch."""
    assert rfc.endswith("Z"), rfc
    main, _, frac = rfc[:-1].partition(".")
    s = calendar.timegm(time.strptime(main, "%Y-%m-%dT%H:%M:%S"))
    return s * 1_000_000_000 + int((frac or "0").ljust(9, "0")[:9])


def ms(ns: int) -> int:
    """Alertmanager's API keeps times to the millisecond."""
    return ns // 1_000_000


def hook_alerts(rx: Receiver, status: str) -> list[dict]:
    return [a for body in rx.bodies for a in body["alerts"] if a["status"] == status]


def test_firing_resent_then_resolved_in_a_real_alertmanager(tmp_path):
    rx = Receiver()
    am = Alertmanager(tmp_path, rx.url)
    sink = AlertmanagerSink(am.url, resend_s=0.3)
    try:
        a = straggler()
        sink.publish([a, pending_bubble()], [a])

        got = wait_until(lambda: am.alerts(), 20, "the firing alert in GET /api/v2/alerts")
        assert len(got) == 1, got  # the pending alert is not sent
        item = got[0]
        assert item["labels"] == {"alertname": "straggler", "run_id": "run-7", "severity": "critical",
                                  "scope": "rank", "kind": "fault", "rank": "3", "stage": "1"}
        assert item["annotations"]["summary"] == a.message
        assert item["annotations"]["description"] == a.message
        assert float(item["annotations"]["value"]) == a.value
        assert float(item["annotations"]["threshold"]) == a.threshold
        assert item["status"]["state"] == "active"
        assert ms(ns_of(item["startsAt"])) == ms(a.first_ns)
        # endsAt lies ahead (4 x resend): Alertmanager keeps it only while we keep re-sending
        assert ns_of(item["endsAt"]) > time.time_ns()

        fired = wait_until(lambda: hook_alerts(rx, "firing"), 20, "Alertmanager's 'firing' notification")
        assert fired[0]["labels"]["alertname"] == "straggler" and fired[0]["labels"]["rank"] == "3"

        # re-sent while firing: Alertmanager counts every alert it receives
        wait_until(lambda: am.metric('alertmanager_alerts_received_total{status="firing",version="v2"}') >= 4,
                   20, "four receipts of the firing alert (re-sent every 0.3 s)")

        r = resolved(a)
        sink.publish([r], [])
        wait_until(lambda: am.alerts() == [], 20, "the alert to leave GET /api/v2/alerts on resolve")
        done = wait_until(lambda: hook_alerts(rx, "resolved"), 20, "Alertmanager's 'resolved' notification")
        assert done[0]["labels"]["rank"] == "3"
        assert ms(ns_of(done[0]["endsAt"])) == ms(r.last_ns)
        assert am.metric('alertmanager_alerts_received_total{status="resolved",version="v2"}') >= 1
        assert sink.stats()["failures"] == 0 and sink.stats()["dropped"] == 0

        # no more re-sends once nothing fires
        n = am.metric('alertmanager_alerts_received_total{status="firing",version="v2"}')
        time.sleep(1.0)
        assert am.metric('alertmanager_alerts_received_total{status="firing",version="v2"}') == n
    finally:
        sink.close()
        am.close()
        rx.close()


def test_a_lost_resolution_is_recovered_from_the_next_firing_set(tmp_path):
    """The call carrying the RESOLVED record was dropped (full queue): the next call's firing set no
    longer holds the alert, and that alone resolves it in Alertmanager."""
    rx = Receiver()
    am = Alertmanager(tmp_path, rx.url)
    sink = AlertmanagerSink(am.url, resend_s=30)
    try:
        a, b = straggler(rank=3), straggler(rank=2)
        sink.publish([a, b], [a, b])
        wait_until(lambda: len(am.alerts()) == 2, 20, "two firing alerts")
        # Alertmanager tells a resolution only to a receiver it told the firing to (its dedup stage):
        # resolved before its group's first flush, rank 3 would vanish with no notification at all
        wait_until(lambda: sorted(x["labels"]["rank"] for x in hook_alerts(rx, "firing")) == ["2", "3"], 20,
                   "'firing' notifications for ranks 2 and 3")
        sink.publish([], [b])  # a's RESOLVED record never arrives
        wait_until(lambda: [x["labels"]["rank"] for x in am.alerts()] == ["2"], 20, "rank 3 resolved")
        wait_until(lambda: [x["labels"]["rank"] for x in hook_alerts(rx, "resolved")] == ["3"], 20,
                   "a 'resolved' notification for rank 3 only")
    finally:
        sink.close()
        am.close()
        rx.close()


def test_failed_deliveries_are_retried_until_they_go_through():
    """Through the sink's post seam: the first three POSTs fail (as a receiver that is down would);
    the firing alert and then its resolution still arrive, once each after the failures."""
    sent: list[list[dict]] = []
    fails = {"left": 3}

    def post(url, payload, timeout_s):
        if fails["left"] > 0:
            fails["left"] -= 1
            raise SendError(f"POST {url}: [Errno 111] Connection refused")
        sent.append(payload)
        return 200

    sink = AlertmanagerSink("http://am.invalid:9093", resend_s=60, retry_s=0.05, post=post)
    try:
        a = straggler()
        sink.publish([a], [a])
        wait_until(lambda: sent, 10, "the firing alert after 3 failures")
        assert sink.stats()["failures"] == 3
        assert [x["labels"]["rank"] for x in sent[0]] == ["3"]
        r = resolved(a)
        sink.publish([r], [])
        wait_until(lambda: len(sent) == 2, 10, "the resolution")
        assert ns_of(sent[1][0]["endsAt"]) == r.last_ns
        assert sink.stats()["firing"] == 0
    finally:
        sink.close()


def test_payload_shape_and_label_names():
    a = replace(straggler(), labels={"rank": "3", "gpu-uuid": "GPU-1", "0bad": "x", "severity": "mine",
                                     "empty": ""})
    body = am_alert(a, a.last_ns)
    assert body["labels"] == {"alertname": "straggler", "run_id": "run-7", "severity": "critical", "scope": "rank",
                              "kind": "fault", "rank": "3", "gpu_uuid": "GPU-1", "_0bad": "x",
                              "exported_severity": "mine"}
    assert body["startsAt"] == rfc3339(a.first_ns) and ns_of(body["endsAt"]) == a.last_ns
    assert label_name("a.b") == "a_b"
    assert body["annotations"]["first_step"] == "20" and body["annotations"]["signal"] == "straggler"
    assert a.state == FIRING


#: the inhibit rule docs/alerts.md gives: a consequence is silent while its cause fires
INHIBIT = ("inhibit_rules:\n"
           "  - source_matchers: ['incident_role=\"cause\"']\n"
           "    target_matchers: ['incident_role=\"consequence\"']\n"
           "    equal: ['incident']\n")


def test_incident_consequences_group_with_their_cause_and_are_inhibited(tmp_path):
    """A real Alertmanager routed by incident, with the documented inhibit rule: the cause is
    notified, its consequence (an SLA breach it explains) is suppressed by it, in one group; an SLA
    breach that fired before its cause and joined it later leaves its old label set resolved."""
    rx = Receiver()
    # group_wait as Alertmanager's own default means it (30 s there): a group's first notification
    # waits for the alerts posted with it, so the cause is in before its consequence is notified
    am = Alertmanager(tmp_path, rx.url, group_by="['run_id', 'incident']", extra=INHIBIT, group_wait="2s")
    sink = AlertmanagerSink(am.url, resend_s=0.5)
    try:
        cause = straggler()
        cause = replace(cause, incident_id=cause.id)
        early = grad_sync()  # fired standalone before the straggler did
        sink.publish([early], [early])
        wait_until(lambda: [x["labels"]["alertname"] for x in am.alerts()] == ["grad_sync"], 20, "the SLA breach")
        assert "incident" not in am.alerts()[0]["labels"] and am.alerts()[0]["labels"]["kind"] == "sla"
        # the cause fires, then the breach joins it (the book does both in one publish; Alertmanager's
        # inhibitor sees an alert a moment after it is posted, which group_wait covers in production)
        sink.publish([cause], [cause, early])
        wait_until(lambda: any(x["labels"]["alertname"] == "straggler" for x in am.alerts()), 20, "the cause")
        time.sleep(0.5)
        joined = replace(early, incident_id=cause.id)
        sink.publish([joined], [cause, joined])

        def settled():
            got = {(x["labels"]["alertname"], x["labels"].get("incident_role", "")): x for x in am.alerts()}
            return got if set(got) == {("straggler", "cause"), ("grad_sync", "consequence")} else None

        got = wait_until(settled, 20, "cause and consequence, the standalone label set gone")
        cons = got[("grad_sync", "consequence")]
        assert cons["labels"]["incident"] == cause.id == got[("straggler", "cause")]["labels"]["incident"]
        assert cons["labels"]["kind"] == "sla"
        wait_until(lambda: next(x for x in am.alerts() if x["labels"]["alertname"] == "grad_sync")["status"]["state"]
                   == "suppressed", 20, "the consequence inhibited by its cause")
        inhibited = next(x for x in am.alerts() if x["labels"]["alertname"] == "grad_sync")
        assert inhibited["status"]["inhibitedBy"], inhibited["status"]
        # notifications: the incident's group carries the cause, never the suppressed consequence
        fired = wait_until(lambda: [a for a in hook_alerts(rx, "firing") if a["labels"].get("incident") == cause.id],
                           20, "the incident's notification")
        assert {a["labels"]["alertname"] for a in fired} == {"straggler"}
        # the standalone label set (fired before the cause) was resolved, not left to lapse
        wait_until(lambda: [a for a in hook_alerts(rx, "resolved") if a["labels"]["alertname"] == "grad_sync"
                            and "incident" not in a["labels"]], 20, "the old label set's resolution")
    finally:
        sink.close()
        am.close()
        rx.close()
