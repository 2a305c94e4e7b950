"""Severities from alerts, SLA deadlines and breaches at their boundaries."""

from __future__ import annotations

import pydantic
import pytest

from apiary.errors import ValidationError
from apiary.incidents import (
    DEFAULT_SLA,
    IncidentEvent,
    Severity,
    SlaPolicy,
    SlaTargets,
    apply,
    breaches,
    deadlines,
    open_incident,
    severity_for_alert,
)

E = IncidentEvent
T0 = 1_700_000_000.0
MIN, HOUR, DAY = 60.0, 3600.0, 86400.0


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"alertname": "ApiaryGpuEccDoubleBitError", "severity": "fatal"}, Severity.SEV1),
        ({"alertname": "ApiaryGpuXidError", "severity": "error"}, Severity.SEV2),
        ({"alertname": "ApiaryGpuUsedByForeignProcess", "severity": "warn"}, Severity.SEV3),
        ({"alertname": "ApiaryJobWaitingTooLong", "severity": "info"}, Severity.SEV4),
        ({"alertname": "NoLevel"}, Severity.SEV3),
        ({"alertname": "Odd", "severity": "critical"}, Severity.SEV3),
    ],
    ids=["fatal", "error", "warn", "info", "missing", "unknown"],
)
def test_alert_severity_maps_to_incident_severity(labels, expected):
    assert severity_for_alert(labels) == expected


def test_severity_overrides():
    labels = {"alertname": "ApiaryControlPlaneDown", "severity": "error"}
    assert severity_for_alert(labels, by_alertname={"ApiaryControlPlaneDown": Severity.SEV1}) == Severity.SEV1
    assert severity_for_alert(labels, by_alert_severity={"error": Severity.SEV3}) == Severity.SEV3
    # the per-rule override wins over the per-level one
    assert severity_for_alert(labels, by_alertname={"ApiaryControlPlaneDown": Severity.SEV4},
                              by_alert_severity={"error": Severity.SEV1}) == Severity.SEV4
    assert severity_for_alert({}, default=Severity.SEV4) == Severity.SEV4


def test_every_severity_of_the_rules_is_mapped():
    # deploy/prometheus/rules/*.yml use exactly these four levels
    assert [severity_for_alert({"severity": s}).rank for s in ("fatal", "error", "warn", "info")] == [1, 2, 3, 4]
    assert Severity.SEV1.is_major and Severity.SEV2.is_major and not Severity.SEV3.is_major


def incident(severity: Severity):
    return open_incident("i", "t", severity, "k", "system", T0)


@pytest.mark.parametrize(
    ("severity", "ack", "mitigate", "resolve"),
    [
        (Severity.SEV1, 5 * MIN, 30 * MIN, 4 * HOUR),
        (Severity.SEV2, 15 * MIN, 2 * HOUR, 24 * HOUR),
        (Severity.SEV3, 4 * HOUR, None, 3 * DAY),
        (Severity.SEV4, 24 * HOUR, None, 14 * DAY),
    ],
    ids=lambda v: v.value if isinstance(v, Severity) else None,
)
def test_default_deadlines(severity, ack, mitigate, resolve):
    assert deadlines(incident(severity)) == {
        "acknowledge": T0 + ack,
        "mitigate": None if mitigate is None else T0 + mitigate,
        "resolve": T0 + resolve,
    }


def test_breaches_at_the_boundaries_of_an_untouched_incident():
    inc = incident(Severity.SEV1)
    assert breaches(inc, T0) == []
    assert breaches(inc, T0 + 5 * MIN) == []  # exactly at the deadline: still in time
    assert breaches(inc, T0 + 5 * MIN + 0.001) == ["acknowledge"]
    assert breaches(inc, T0 + 30 * MIN) == ["acknowledge"]
    assert breaches(inc, T0 + 30 * MIN + 1) == ["acknowledge", "mitigate"]
    assert breaches(inc, T0 + 4 * HOUR + 1) == ["acknowledge", "mitigate", "resolve"]


@pytest.mark.parametrize(
    ("ack_at", "breached"),
    [(5 * MIN, []), (5 * MIN + 1, ["acknowledge"])],
    ids=["ack-at-deadline", "ack-one-second-late"],
)
def test_an_acknowledgement_meets_the_deadline_at_its_time(ack_at, breached):
    inc = apply(incident(Severity.SEV1), E.ACKNOWLEDGE, "alice", T0 + ack_at)
    # long after: the ack is judged by when it happened, not by now
    assert breaches(inc, T0 + 10 * MIN) == breached


def test_mitigation_and_resolution_imply_the_earlier_milestones():
    inc = apply(incident(Severity.SEV2), E.MITIGATE, "system", T0 + 10 * MIN)  # no ack, cordoned at once
    assert breaches(inc, T0 + 23 * HOUR) == []
    inc = apply(inc, E.RESOLVE, "alice", T0 + 24 * HOUR)
    assert breaches(inc, T0 + 30 * DAY) == []
    late = apply(incident(Severity.SEV2), E.RESOLVE, "alice", T0 + 24 * HOUR + 1)
    assert breaches(late, T0 + 30 * DAY) == ["acknowledge", "mitigate", "resolve"]


def test_no_mitigation_target_never_breaches_it():
    inc = incident(Severity.SEV3)
    assert breaches(inc, T0 + 4 * HOUR + 1) == ["acknowledge"]
    assert breaches(inc, T0 + 3 * DAY + 1) == ["acknowledge", "resolve"]


def test_a_retrigger_keeps_the_acknowledgement_a_reopen_restarts_the_clocks():
    inc = apply(incident(Severity.SEV1), E.ACKNOWLEDGE, "alice", T0 + MIN)
    inc = apply(inc, E.RETRIGGER, "system", T0 + 20 * MIN)
    assert breaches(inc, T0 + 25 * MIN) == []
    inc = apply(inc, E.RESOLVE, "alice", T0 + 25 * MIN)
    inc = apply(inc, E.REOPEN, "alertmanager", T0 + 2 * HOUR)
    reopened = T0 + 2 * HOUR
    assert deadlines(inc)["acknowledge"] == reopened + 5 * MIN
    assert breaches(inc, reopened + 5 * MIN) == []
    assert breaches(inc, reopened + 6 * MIN) == ["acknowledge"]


def test_a_custom_policy():
    policy = SlaPolicy(targets={s: SlaTargets(ack_s=10, mitigate_s=None, resolve_s=20) for s in Severity})
    inc = incident(Severity.SEV1)
    assert deadlines(inc, policy) == {"acknowledge": T0 + 10, "mitigate": None, "resolve": T0 + 20}
    assert breaches(inc, T0 + 15, policy) == ["acknowledge"]


def test_policies_are_validated():
    with pytest.raises(pydantic.ValidationError, match="no SLA for sev4"):
        SlaPolicy(targets={s: DEFAULT_SLA.targets[s] for s in (Severity.SEV1, Severity.SEV2, Severity.SEV3)})
    with pytest.raises(pydantic.ValidationError, match="ack_s <= mitigate_s <= resolve_s"):
        SlaTargets(ack_s=100, mitigate_s=50, resolve_s=200)
    with pytest.raises(pydantic.ValidationError, match="ack_s"):
        SlaTargets(ack_s=0, resolve_s=200)
    # from configuration: keys are the severity values
    policy = SlaPolicy.model_validate({"targets": {s.value: {"ack_s": 1, "resolve_s": 2} for s in Severity}})
    assert policy.targets[Severity.SEV4].resolve_s == 2


def test_breaches_needs_a_finite_now():
    with pytest.raises(ValidationError) as err:
        breaches(incident(Severity.SEV1), float("nan"))
    assert err.value.field == "now"
