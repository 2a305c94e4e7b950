"""Incidents and job-failure triage, the pure core.

* :mod:`.model`: :class:`Severity` (PagerDuty's SEV levels, from Apiary's alert severities),
  :class:`IncidentState`, the append-only :class:`TimelineEntry` list, :class:`Links`,
  :class:`Incident`, SLA targets (:data:`DEFAULT_SLA`, :func:`deadlines`, :func:`breaches`) and
  :class:`AlertGroup` (an Alertmanager webhook payload or a PagerDuty Events API v2 event).
* :mod:`.machine`: the one transition table (:data:`TRANSITIONS`), :func:`open_incident`,
  :func:`apply` (a new incident per event) and :func:`correlate` (dedup: attach, reopen or open).
* :mod:`.triage`: :func:`classify_failure` (exit code + log tail -> user / platform / hardware, rules
  in ``triage-rules.yaml``), :func:`platform_failure_rate`, :func:`should_open_incident`.

No I/O, no clock, no threads: the API and control plane (later) store incidents and pass the time in.
"""

from apiary.incidents.machine import (
    ENTRY_KINDS,
    TRANSITIONS,
    Decision,
    IncidentEvent,
    IncidentTransitionError,
    allowed_events,
    apply,
    correlate,
    open_incident,
    reachable_states,
)
from apiary.incidents.model import (
    ALERT_SEVERITY_TO_SEVERITY,
    DEFAULT_SLA,
    MILESTONES,
    AlertGroup,
    AlertRef,
    EntryKind,
    Incident,
    IncidentState,
    Links,
    Severity,
    SlaPolicy,
    SlaTargets,
    TimelineEntry,
    breaches,
    deadlines,
    severity_for_alert,
)
from apiary.incidents.postmortem import ActionItem, Postmortem, draft, parse_action_items
from apiary.incidents.quality import Firing, QualityReport, RuleQuality, quality_report, report_markdown
from apiary.incidents.triage import (
    Classification,
    FailureClass,
    TriageRule,
    TriageRules,
    classify_failure,
    default_rules,
    parse_rules,
    platform_failure_rate,
    should_open_incident,
)

__all__ = [
    "ActionItem",
    "Firing",
    "Postmortem",
    "QualityReport",
    "RuleQuality",
    "draft",
    "parse_action_items",
    "quality_report",
    "report_markdown",
    "ALERT_SEVERITY_TO_SEVERITY",
    "DEFAULT_SLA",
    "ENTRY_KINDS",
    "MILESTONES",
    "TRANSITIONS",
    "AlertGroup",
    "AlertRef",
    "Classification",
    "Decision",
    "EntryKind",
    "FailureClass",
    "Incident",
    "IncidentEvent",
    "IncidentState",
    "IncidentTransitionError",
    "Links",
    "Severity",
    "SlaPolicy",
    "SlaTargets",
    "TimelineEntry",
    "TriageRule",
    "TriageRules",
    "allowed_events",
    "apply",
    "breaches",
    "classify_failure",
    "correlate",
    "deadlines",
    "default_rules",
    "open_incident",
    "parse_rules",
    "platform_failure_rate",
    "reachable_states",
    "severity_for_alert",
    "should_open_incident",
]
