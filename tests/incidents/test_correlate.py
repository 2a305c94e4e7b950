"""Alert groups and correlation: one incident per dedup key, reopen within the window, else a new one."""

from __future__ import annotations

import hashlib

import pytest

from apiary.errors import ValidationError
from apiary.incidents import (
    AlertGroup,
    Decision,
    Incident,
    IncidentEvent,
    IncidentState,
    Links,
    Severity,
    apply,
    correlate,
    open_incident,
)

E = IncidentEvent
T0 = 1_700_000_000.0
WINDOW = 3600.0
GROUP_KEY = '{}/{severity="fatal"}:{alertname="ApiaryGpuEccDoubleBitError"}'


def am_payload(status: str = "firing", group_key: str | None = GROUP_KEY, node: str = "worker-1",
               fingerprint: str = "fp-ecc-w1", severity: str = "fatal") -> dict:
    """An Alertmanager webhook (v4) payload as Alertmanager sends it."""
    alert = {
        "status": status,
        "labels": {"alertname": "ApiaryGpuEccDoubleBitError", "severity": severity, "node": node, "gpu": "0"},
        "annotations": {"summary": f"GPU 0 on node {node} has 2 double-bit ECC errors"},
        "startsAt": "2024-01-01T00:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": fingerprint,
    }
    payload = {
        "version": "4",
        "status": status,
        "receiver": "apiary",
        "groupLabels": {"alertname": "ApiaryGpuEccDoubleBitError"},
        "commonLabels": {"alertname": "ApiaryGpuEccDoubleBitError", "severity": severity},
        "commonAnnotations": {"summary": "double-bit ECC errors"},
        "externalURL": "http://alertmanager",
        "alerts": [alert],
    }
    if group_key is not None:
        payload["groupKey"] = group_key
    return payload


def group(**kw) -> AlertGroup:
    return AlertGroup.from_alertmanager(am_payload(**kw))


def open_from(decision: Decision, at: float, id: str = "inc-1") -> Incident:
    assert decision.action == "open"
    return open_incident(id, decision.title, decision.severity, decision.dedup_key, "ApiaryGpuEccDoubleBitError",
                         at, links=decision.links, fingerprints=decision.fingerprints)


def test_an_alertmanager_payload_becomes_a_group():
    g = group()
    # Alertmanager's PagerDuty notifier sends the SHA-256 of the groupKey as dedup_key
    assert g.dedup_key == hashlib.sha256(GROUP_KEY.encode()).hexdigest()
    assert g.group_key == GROUP_KEY and g.action == "trigger" and g.severity == Severity.SEV1
    assert g.title == "ApiaryGpuEccDoubleBitError: double-bit ECC errors"
    assert g.fingerprints == ("fp-ecc-w1",)
    assert g.links == Links(nodes=("worker-1",))
    assert group(status="resolved").action == "resolve"


def test_without_a_group_key_the_fingerprints_are_the_key():
    assert group(group_key=None).dedup_key == "fp:fp-ecc-w1"
    payload = am_payload(group_key=None, fingerprint="")
    with pytest.raises(ValidationError) as err:
        AlertGroup.from_alertmanager(payload)
    assert err.value.field == "groupKey"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: p.update(version="3"), "version"),
        (lambda p: p.update(alerts="nope"), "alerts"),
        (lambda p: p["alerts"][0].update(status="pending"), "alerts[0].status"),
        (lambda p: p["alerts"][0].update(labels={"a": 1}), "alerts[0].labels"),
        (lambda p: p.update(groupKey=7), "groupKey"),
    ],
    ids=["version", "alerts", "status", "labels", "groupKey"],
)
def test_malformed_payloads_name_the_field(mutate, field):
    payload = am_payload()
    mutate(payload)
    with pytest.raises(ValidationError) as err:
        AlertGroup.from_alertmanager(payload)
    assert err.value.field == field


def test_the_most_urgent_alert_sets_the_severity():
    payload = am_payload(severity="warn")
    payload["alerts"].append({**payload["alerts"][0], "fingerprint": "fp2",
                              "labels": {"alertname": "X", "severity": "error", "node": "worker-2"}})
    g = AlertGroup.from_alertmanager(payload)
    assert g.severity == Severity.SEV2 and g.links.nodes == ("worker-1", "worker-2")
    overridden = AlertGroup.from_alertmanager(payload, by_alertname={"ApiaryGpuEccDoubleBitError": Severity.SEV1})
    assert overridden.severity == Severity.SEV1


def test_events_api_v2():
    g = AlertGroup.from_events_v2({"routing_key": "r", "event_action": "trigger", "dedup_key": "disk-worker-3",
                                   "payload": {"summary": "disk full", "source": "worker-3", "severity": "critical"}})
    assert (g.dedup_key, g.action, g.severity, g.title) == ("disk-worker-3", "trigger", Severity.SEV1, "disk full")
    ack = AlertGroup.from_events_v2({"event_action": "acknowledge", "dedup_key": "disk-worker-3"})
    assert ack.action == "acknowledge"
    for event, field in [
        ({"event_action": "snooze", "dedup_key": "k"}, "event_action"),
        ({"event_action": "trigger", "payload": {"severity": "info"}}, "dedup_key"),
        ({"event_action": "trigger", "dedup_key": "k" * 256, "payload": {"severity": "info"}}, "dedup_key"),
        ({"event_action": "trigger", "dedup_key": "k", "payload": {"severity": "fatal"}}, "payload.severity"),
    ]:
        with pytest.raises(ValidationError) as err:
            AlertGroup.from_events_v2(event)
        assert err.value.field == field


def test_same_group_key_is_one_incident():
    first = correlate([], group(), T0, WINDOW)
    assert first.action == "open" and first.incident_id is None
    inc = open_from(first, T0)
    # Alertmanager resends the group every repeat_interval, and adds alerts to it
    for i, (node, fp) in enumerate([("worker-1", "fp-ecc-w1"), ("worker-2", "fp-ecc-w2")], start=1):
        d = correlate([inc], group(node=node, fingerprint=fp), T0 + 60 * i, WINDOW)
        assert (d.action, d.incident_id) == ("attach", "inc-1")
        inc = apply(inc, E.ALERT, "alertmanager", T0 + 60 * i, links=d.links, fingerprints=d.fingerprints)
    assert inc.links.nodes == ("worker-1", "worker-2") and inc.fingerprints == ("fp-ecc-w1", "fp-ecc-w2")


def test_a_shared_firing_fingerprint_matches_across_group_keys():
    inc = open_from(correlate([], group(), T0, WINDOW), T0)
    d = correlate([inc], group(group_key="{}:{node=\"worker-1\"}"), T0 + 5, WINDOW)
    assert (d.action, d.incident_id) == ("attach", "inc-1")


def test_other_group_keys_open_their_own_incident():
    inc = open_from(correlate([], group(), T0, WINDOW), T0)
    d = correlate([inc], group(group_key="{}:{alertname=\"ApiaryNodeDown\"}", fingerprint="other"), T0 + 5, WINDOW)
    assert d.action == "open"


def test_resolved_notification_resolves_the_open_incident_and_is_ignored_otherwise():
    inc = open_from(correlate([], group(), T0, WINDOW), T0)
    d = correlate([inc], group(status="resolved"), T0 + 60, WINDOW)
    assert (d.action, d.incident_id) == ("resolve", "inc-1")
    inc = apply(inc, E.RESOLVE, "alertmanager", T0 + 60)
    assert correlate([inc], group(status="resolved"), T0 + 61, WINDOW).action == "ignore"
    assert correlate([], group(status="resolved"), T0, WINDOW).action == "ignore"


@pytest.mark.parametrize(
    ("after_resolve", "action"),
    [(1.0, "reopen"), (WINDOW, "reopen"), (WINDOW + 0.001, "open"), (10 * WINDOW, "open")],
    ids=["just-after", "window-end", "just-past", "long-after"],
)
def test_refiring_within_the_window_reopens_after_it_opens_anew(after_resolve, action):
    inc = open_from(correlate([], group(), T0, WINDOW), T0)
    inc = apply(inc, E.RESOLVE, "alertmanager", T0 + 100)
    d = correlate([inc], group(), T0 + 100 + after_resolve, WINDOW)
    assert d.action == action
    assert d.incident_id == ("inc-1" if action == "reopen" else None)
    if action == "reopen":
        reopened = apply(inc, E.REOPEN, "alertmanager", T0 + 100 + after_resolve, reason=d.reason)
        assert reopened.state == IncidentState.TRIGGERED


def test_a_closed_incident_is_never_reopened():
    inc = open_from(correlate([], group(), T0, WINDOW), T0)
    inc = apply(apply(inc, E.RESOLVE, "alertmanager", T0 + 10), E.CLOSE, "alice", T0 + 20)
    assert correlate([inc], group(), T0 + 30, WINDOW).action == "open"


def test_open_incidents_win_over_resolved_ones_and_the_newest_wins():
    old = open_from(correlate([], group(), T0, WINDOW), T0, id="old")
    old = apply(old, E.RESOLVE, "alertmanager", T0 + 10)
    new = open_from(correlate([], group(), T0 + 20, WINDOW), T0 + 20, id="new")
    newer = open_from(correlate([], group(), T0 + 30, WINDOW), T0 + 30, id="newer")
    d = correlate([old, new, newer], group(), T0 + 40, WINDOW)
    assert (d.action, d.incident_id) == ("attach", "newer")
    r1 = apply(open_from(correlate([], group(), T0, WINDOW), T0, id="r1"), E.RESOLVE, "am", T0 + 50)
    r2 = apply(open_from(correlate([], group(), T0, WINDOW), T0, id="r2"), E.RESOLVE, "am", T0 + 70)
    d = correlate([r1, r2], group(), T0 + 80, WINDOW)
    assert (d.action, d.incident_id) == ("reopen", "r2")


def test_events_v2_acknowledge():
    trigger = AlertGroup.from_events_v2({"event_action": "trigger", "dedup_key": "k",
                                         "payload": {"summary": "s", "severity": "error"}})
    ack = AlertGroup.from_events_v2({"event_action": "acknowledge", "dedup_key": "k"})
    assert correlate([], ack, T0, WINDOW).action == "ignore"
    inc = open_incident("i", "s", trigger.severity, trigger.dedup_key, "system", T0)
    assert correlate([inc], ack, T0 + 1, WINDOW).action == "acknowledge"
    inc = apply(inc, E.ACKNOWLEDGE, "alice", T0 + 2)
    assert correlate([inc], ack, T0 + 3, WINDOW).action == "attach"


@pytest.mark.parametrize(("now", "window", "field"), [(float("nan"), 1.0, "now"), (T0, -1.0, "reopen_window_s"),
                                                      (T0, float("inf"), "reopen_window_s")])
def test_correlate_checks_its_arguments(now, window, field):
    with pytest.raises(ValidationError) as err:
        correlate([], group(), now, window)
    assert err.value.field == field
