"""Incidents as data: severities, states, the timeline, links, SLA targets and alert groups.

Pure: no I/O, no clock (every time is a parameter, in seconds since the epoch, UTC), no threads.
The state machine that changes an :class:`Incident` is :mod:`apiary.incidents.machine`; this
module holds what it works on and what can be read off an incident without changing it
(:func:`deadlines`, :func:`breaches`).

Vocabulary. The states and the dedup key are PagerDuty's (an incident is *triggered*,
*acknowledged*, *resolved*; events carrying the same ``dedup_key`` are one problem), with the two
steps AI-System 7.6.5.2 adds to the manual process (mitigate, e.g. cordon the server, before
repair; close once the post-incident analysis is done). Severities are PagerDuty's SEV levels
("lower numbered severities being more urgent", response.pagerduty.com/before/severity_levels),
derived from the severity label of Apiary's alert rules (``deploy/prometheus/rules/*.yml``:
info < warn < error < fatal, OpenPAI's levels).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from apiary.errors import ValidationError

__all__ = [
    "ALERT_SEVERITY_TO_SEVERITY",
    "DEFAULT_SLA",
    "EVENTS_V2_SEVERITY_TO_ALERT_SEVERITY",
    "JOB_LABELS",
    "MILESTONES",
    "NODE_LABELS",
    "USER_LABELS",
    "VC_LABELS",
    "AlertGroup",
    "AlertRef",
    "EntryKind",
    "Incident",
    "IncidentState",
    "Links",
    "Severity",
    "SlaPolicy",
    "SlaTargets",
    "TimelineEntry",
    "breaches",
    "deadlines",
    "severity_for_alert",
]

_MINUTE = 60.0
_HOUR = 3600.0
_DAY = 86400.0


class _Frozen(BaseModel):
    # dstack's CoreModel: unknown fields are an error. Frozen: a new value per change (immutable
    # style), so an incident read by one caller never changes under it.
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- severities ------------------------------------------------------------------------------


class Severity(StrEnum):
    """PagerDuty's SEV levels, ``sev1`` (most urgent) to ``sev4``. Values equal the lower-case names."""

    SEV1 = "sev1"
    SEV2 = "sev2"
    SEV3 = "sev3"
    SEV4 = "sev4"

    @property
    def rank(self) -> int:
        """1 for ``sev1`` ... 4 for ``sev4``: smaller is more urgent."""
        return int(self.value[-1])

    @property
    def is_major(self) -> bool:
        """True for ``sev1`` and ``sev2``: PagerDuty's "major incident" (coordinated response, a page)."""
        return self.rank <= 2


#: Apiary's alert severity label (``deploy/prometheus/rules/*.yml``, OpenPAI's info < warn < error <
#: fatal) -> incident severity, one level each, in order.
ALERT_SEVERITY_TO_SEVERITY: Mapping[str, Severity] = MappingProxyType({
    "fatal": Severity.SEV1,
    "error": Severity.SEV2,
    "warn": Severity.SEV3,
    "info": Severity.SEV4,
})

#: PagerDuty Events API v2 ``payload.severity`` (critical / error / warning / info) -> Apiary's alert
#: severity, level for level.
EVENTS_V2_SEVERITY_TO_ALERT_SEVERITY: Mapping[str, str] = MappingProxyType({
    "critical": "fatal",
    "error": "error",
    "warning": "warn",
    "info": "info",
})


def severity_for_alert(
    labels: Mapping[str, str],
    *,
    by_alertname: Mapping[str, Severity] | None = None,
    by_alert_severity: Mapping[str, Severity] | None = None,
    default: Severity = Severity.SEV3,
) -> Severity:
    """The incident severity for an alert with ``labels`` (Prometheus labels: ``alertname``, ``severity``).

    In order: ``by_alertname[labels["alertname"]]`` (an override per alert rule), then
    ``by_alert_severity`` (an override of the level mapping, same keys as
    :data:`ALERT_SEVERITY_TO_SEVERITY`), then :data:`ALERT_SEVERITY_TO_SEVERITY`, then ``default``
    for a missing or unknown ``severity`` label. The default is ``sev3`` (Apiary's choice): an alert
    nobody gave a level should reach a person (``sev4`` waits a business day) without paging anyone.
    Never raises.
    """
    name = labels.get("alertname", "")
    if by_alertname and name in by_alertname:
        return by_alertname[name]
    level = labels.get("severity", "")
    if by_alert_severity and level in by_alert_severity:
        return by_alert_severity[level]
    return ALERT_SEVERITY_TO_SEVERITY.get(level, default)


# --- states and the timeline -------------------------------------------------------------------


class IncidentState(StrEnum):
    """Where an incident is. The edges between states are :data:`apiary.incidents.machine.TRANSITIONS`.

    ``triggered``: open, nobody has taken it. ``acknowledged``: a responder owns it (PagerDuty).
    ``mitigated``: the impact is contained (e.g. the node cordoned) but the cause is not fixed
    (AI-System 7.6.5.2: mitigate, then repair). ``resolved``: fixed; it may still be reopened when
    the same problem fires again within the reopen window. ``closed``: final, after the
    post-incident review; nothing changes a closed incident.
    """

    TRIGGERED = "triggered"
    ACKNOWLEDGED = "acknowledged"
    MITIGATED = "mitigated"
    RESOLVED = "resolved"
    CLOSED = "closed"

    @classmethod
    def open_states(cls) -> frozenset[IncidentState]:
        """``{triggered, acknowledged, mitigated}``: the incident still needs work (PagerDuty's "open")."""
        return frozenset({cls.TRIGGERED, cls.ACKNOWLEDGED, cls.MITIGATED})

    @property
    def is_open(self) -> bool:
        """True for ``triggered``, ``acknowledged`` and ``mitigated``."""
        return self in IncidentState.open_states()


class EntryKind(StrEnum):
    """What a timeline entry records (see :data:`apiary.incidents.machine.ENTRY_KINDS` per event)."""

    STATE_CHANGE = "state_change"
    NOTIFICATION = "notification"
    ESCALATION = "escalation"
    ACKNOWLEDGEMENT = "acknowledgement"
    ACTION = "action"
    COMMENT = "comment"
    ALERT = "alert"


class TimelineEntry(_Frozen):
    """One entry of an incident's append-only timeline.

    ``at``: when, seconds since the epoch. ``actor``: the principal that did it: a user name,
    ``system``, or an alert or triage rule's name; set by the API layer from the authenticated
    caller, never taken from a request body. ``event``: the machine's event (``open`` for the
    first entry). ``from_state`` / ``to_state``: the state before and after (equal for events
    that change no state; ``from_state`` is None for ``open``). ``detail``: JSON-like data for
    people (a comment's text, the notified channel, the action run); treat it as read-only.
    """

    at: float
    actor: str
    kind: EntryKind
    event: str
    from_state: IncidentState | None
    to_state: IncidentState
    detail: dict[str, Any] = Field(default_factory=dict)


# --- links -------------------------------------------------------------------------------------

#: Alert label names that carry a node / a job id (the alert intake and the action pipeline read
#: these). Node rules normalise to ``node``; dcgm-exporter labels GPUs with ``Hostname``. Apiary's
#: job metrics label the job id ``job`` and are scraped with ``honor_labels`` (``exported_job``
#: without it), but ``job`` is also Prometheus' own scrape-job label (``apiary-node``) on every
#: other alert: only a value shaped like an Apiary job id links a job (:func:`job_id_of`).
NODE_LABELS = ("node", "Hostname", "hostname")
JOB_LABELS = ("job_id", "exported_job", "job")


def job_id_of(value: str) -> str | None:
    """``value`` when it is an Apiary job id (``user~name``, both parts non-empty), else None: a
    scrape job such as ``apiary-node`` is never taken for a job."""
    user, sep, name = value.partition("~")
    return value if sep and user and name and "~" not in name else None
#: The user and VC labels of Apiary's job metrics (``apiary_job_waiting_seconds`` and friends).
USER_LABELS = ("user",)
VC_LABELS = ("virtual_cluster",)


def _union(a: Iterable[str], b: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(set(a) | set(b)))


class Links(_Frozen):
    """What an incident touches. Names are sorted and unique.

    ``nodes``: node names. ``jobs``: Apiary job ids (``alice~mnist``). ``users``: user names.
    ``virtual_clusters``: VC names. ``gpu_hours_lost``: GPU-hours of work the incident cost (GPUs x
    hours of runs that failed or could not run because of it), >= 0.
    """

    nodes: tuple[str, ...] = ()
    jobs: tuple[str, ...] = ()
    users: tuple[str, ...] = ()
    virtual_clusters: tuple[str, ...] = ()
    gpu_hours_lost: float = Field(0.0, ge=0.0, allow_inf_nan=False)

    @field_validator("nodes", "jobs", "users", "virtual_clusters")
    @classmethod
    def _sorted_unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(value)))

    def merge(self, other: Links) -> Links:
        """The union of both link sets; ``gpu_hours_lost`` is added (each report carries the loss it adds)."""
        return Links(
            nodes=_union(self.nodes, other.nodes),
            jobs=_union(self.jobs, other.jobs),
            users=_union(self.users, other.users),
            virtual_clusters=_union(self.virtual_clusters, other.virtual_clusters),
            gpu_hours_lost=self.gpu_hours_lost + other.gpu_hours_lost,
        )

    @property
    def empty(self) -> bool:
        """True when nothing is linked and no GPU-hours are counted."""
        return not (self.nodes or self.jobs or self.users or self.virtual_clusters or self.gpu_hours_lost)

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> Links:
        """Links named by one alert's labels (:data:`NODE_LABELS`, :data:`JOB_LABELS`, ``user``,
        ``virtual_cluster``); the first label present of each group counts, empty values are skipped,
        and a job label counts only with an Apiary job id (:func:`job_id_of`)."""

        def first(names: tuple[str, ...]) -> tuple[str, ...]:
            for n in names:
                if labels.get(n):
                    return (labels[n],)
            return ()

        job = next((j for j in (job_id_of(labels.get(n, "")) for n in JOB_LABELS) if j), None)
        return cls(nodes=first(NODE_LABELS), jobs=(job,) if job else (), users=first(USER_LABELS),
                   virtual_clusters=first(VC_LABELS))


# --- the incident ------------------------------------------------------------------------------


class Incident(_Frozen):
    """One incident. Change it only through :func:`apiary.incidents.machine.apply`, which returns a
    new one; build it with :func:`apiary.incidents.machine.open_incident`.

    ``id``: the caller's identifier (the store's). ``title``: one line for people. ``severity``:
    :class:`Severity`. ``dedup_key``: the key that makes repeated alerts one incident (see
    :class:`AlertGroup`). ``state``: the current state, always the last entry's ``to_state``.
    ``opened_at``: seconds since the epoch, the first entry's time. ``links``: :class:`Links`.
    ``fingerprints``: the Alertmanager fingerprints of the alerts attached so far (sorted, unique).
    ``timeline``: every entry, oldest first, never rewritten.
    """

    id: str = Field(min_length=1)
    title: str
    severity: Severity
    dedup_key: str
    state: IncidentState
    opened_at: float
    links: Links = Links()
    fingerprints: tuple[str, ...] = ()
    timeline: tuple[TimelineEntry, ...] = Field(min_length=1)

    @field_validator("fingerprints")
    @classmethod
    def _sorted_unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(value)))

    @model_validator(mode="after")
    def _consistent(self) -> Incident:
        if self.timeline[-1].to_state != self.state:
            raise ValueError(f"state {self.state} is not the last timeline entry's ({self.timeline[-1].to_state})")
        if self.timeline[0].at != self.opened_at:
            raise ValueError("opened_at must be the first timeline entry's time")
        return self

    @property
    def last_at(self) -> float:
        """The time of the newest timeline entry (seconds since the epoch)."""
        return self.timeline[-1].at

    @property
    def episode_start(self) -> int:
        """Index of the entry that started the current episode: the opening, or the latest reopen.

        The SLA clocks (:func:`deadlines`) run from that entry's time. A retrigger (ack timeout)
        does not start an episode: the acknowledgement already happened.
        """
        for i in range(len(self.timeline) - 1, -1, -1):
            if self.timeline[i].event in ("open", "reopen"):
                return i
        return 0

    @property
    def resolved_at(self) -> float | None:
        """When the incident was resolved, for a ``resolved`` or ``closed`` one; else None."""
        if self.state not in (IncidentState.RESOLVED, IncidentState.CLOSED):
            return None
        for entry in reversed(self.timeline):
            if entry.to_state == IncidentState.RESOLVED and entry.from_state != IncidentState.RESOLVED:
                return entry.at
        return None  # pragma: no cover - a resolved incident always has its resolve entry


# --- SLA ---------------------------------------------------------------------------------------

#: The SLA milestones, in the order they are reached.
MILESTONES: tuple[str, ...] = ("acknowledge", "mitigate", "resolve")
Milestone = Literal["acknowledge", "mitigate", "resolve"]

#: The states that mean a milestone has been reached (a later milestone implies the earlier ones:
#: an incident resolved without an acknowledgement has been responded to).
_REACHED: Mapping[str, frozenset[IncidentState]] = MappingProxyType({
    "acknowledge": frozenset({IncidentState.ACKNOWLEDGED, IncidentState.MITIGATED, IncidentState.RESOLVED,
                              IncidentState.CLOSED}),
    "mitigate": frozenset({IncidentState.MITIGATED, IncidentState.RESOLVED, IncidentState.CLOSED}),
    "resolve": frozenset({IncidentState.RESOLVED, IncidentState.CLOSED}),
})


class SlaTargets(_Frozen):
    """How long, in seconds from the start of the episode, each milestone may take.

    ``ack_s``: to acknowledge (time to respond). ``mitigate_s``: to contain the impact, or None for
    no mitigation target. ``resolve_s``: to resolve. All > 0, and ack <= mitigate <= resolve.
    """

    ack_s: float = Field(gt=0, allow_inf_nan=False)
    mitigate_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    resolve_s: float = Field(gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> SlaTargets:
        steps = [self.ack_s] + ([self.mitigate_s] if self.mitigate_s is not None else []) + [self.resolve_s]
        if steps != sorted(steps):
            raise ValueError("targets must satisfy ack_s <= mitigate_s <= resolve_s")
        return self

    def target(self, milestone: str) -> float | None:
        """The target of ``acknowledge`` / ``mitigate`` / ``resolve`` in seconds (None: no target)."""
        return {"acknowledge": self.ack_s, "mitigate": self.mitigate_s, "resolve": self.resolve_s}[milestone]


class SlaPolicy(_Frozen):
    """SLA targets for every severity: ``targets[severity] -> SlaTargets``; all four must be present.

    Build one from configuration with ``SlaPolicy.model_validate(data)`` (a pydantic error names the
    field) or use :data:`DEFAULT_SLA`.
    """

    targets: dict[Severity, SlaTargets]

    @model_validator(mode="after")
    def _complete(self) -> SlaPolicy:
        missing = [s.value for s in Severity if s not in self.targets]
        if missing:
            raise ValueError(f"targets: no SLA for {', '.join(missing)}")
        return self


#: Apiary's default targets. AI-System 7.6.5.1 asks for an SLA per alert level, with a response and a
#: mitigation time, and escalation when nobody responds; it leaves the numbers to the team. These are
#: Apiary's choice, in the spirit of PagerDuty's levels:
#:
#: ========  ===========  ===========  ===========  ===============================================
#: severity  acknowledge  mitigate     resolve      why
#: ========  ===========  ===========  ===========  ===============================================
#: sev1      5 min        30 min       4 h          a fatal alert (double-bit ECC, a node down): jobs
#:                                                  compute on corrupt memory or die; page at once
#: sev2      15 min       2 h          24 h         an error alert (XID, control plane or scheduling
#:                                                  stuck): a page, and mitigation the same shift
#: sev3      4 h          none         3 days       a warn alert: the on-call DRI during working hours
#: sev4      24 h         none         14 days      an info alert: "next business day", simplified to
#:                                                  24 h (a calendar needs the on-call schedule)
#: ========  ===========  ===========  ===========  ===============================================
DEFAULT_SLA = SlaPolicy(targets={
    Severity.SEV1: SlaTargets(ack_s=5 * _MINUTE, mitigate_s=30 * _MINUTE, resolve_s=4 * _HOUR),
    Severity.SEV2: SlaTargets(ack_s=15 * _MINUTE, mitigate_s=2 * _HOUR, resolve_s=24 * _HOUR),
    Severity.SEV3: SlaTargets(ack_s=4 * _HOUR, mitigate_s=None, resolve_s=3 * _DAY),
    Severity.SEV4: SlaTargets(ack_s=24 * _HOUR, mitigate_s=None, resolve_s=14 * _DAY),
})


def _reached_at(incident: Incident, milestone: str) -> float | None:
    reached = _REACHED[milestone]
    for entry in incident.timeline[incident.episode_start:]:
        if entry.to_state in reached:
            return entry.at
    return None


def deadlines(incident: Incident, policy: SlaPolicy = DEFAULT_SLA) -> dict[str, float | None]:
    """The current episode's deadlines: ``{"acknowledge": t, "mitigate": t | None, "resolve": t}``.

    Each ``t`` is seconds since the epoch: the episode's start (the opening, or the latest reopen:
    :attr:`Incident.episode_start`) plus ``policy``'s target for the incident's severity; None where
    the severity has no target. Never raises.
    """
    start = incident.timeline[incident.episode_start].at
    targets = policy.targets[incident.severity]
    out: dict[str, float | None] = {}
    for milestone in MILESTONES:
        target = targets.target(milestone)
        out[milestone] = None if target is None else start + target
    return out


def breaches(incident: Incident, now: float, policy: SlaPolicy = DEFAULT_SLA) -> list[str]:
    """The milestones of the current episode that missed their deadline, in :data:`MILESTONES` order.

    A milestone is breached when it was reached after its deadline, or is still not reached and
    ``now`` (seconds since the epoch) is past it. The deadline itself is still in time: reached (or
    ``now``) exactly at the deadline is not a breach. A milestone is reached by the first entry of
    the episode whose state implies it (``mitigated`` implies acknowledged; ``resolved`` implies
    both). Raises ValidationError (field ``now``) for a non-finite ``now``.
    """
    if not math.isfinite(now):
        raise ValidationError("now", f"must be a finite time in seconds, not {now!r}")
    out: list[str] = []
    for milestone, deadline in deadlines(incident, policy).items():
        if deadline is None:
            continue
        reached = _reached_at(incident, milestone)
        if (reached if reached is not None else now) > deadline:
            out.append(milestone)
    return out


# --- alert groups ------------------------------------------------------------------------------


class AlertRef(_Frozen):
    """One alert of a group: its Alertmanager ``fingerprint`` (may be ""), ``status`` (``firing`` /
    ``resolved``) and ``labels``."""

    fingerprint: str = ""
    status: Literal["firing", "resolved"]
    labels: dict[str, str] = Field(default_factory=dict)


def _dedup_from_group_key(group_key: str) -> str:
    # Alertmanager's own PagerDuty notifier sends ``key.Hash()`` (SHA-256 of the groupKey, hex) as
    # the dedup_key: a groupKey can exceed the Events API's 255 characters. Same rule here.
    return hashlib.sha256(group_key.encode("utf-8")).hexdigest()


def _require_mapping(data: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValidationError(field, "must be an object")
    return data


def _str_map(data: Any, field: str) -> dict[str, str]:
    if data is None:
        return {}
    mapping = _require_mapping(data, field)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise ValidationError(field, "must map strings to strings")
    return dict(mapping)


class AlertGroup(_Frozen):
    """A notification about one problem, in the one shape :func:`apiary.incidents.machine.correlate` reads.

    ``dedup_key``: incidents with the same key are the same problem (PagerDuty: "if there's already
    an open incident with a matching key, this event will be appended to that incident's log").
    ``action``: ``trigger`` (firing), ``resolve`` or ``acknowledge``. ``severity``: the incident
    severity the group asks for. ``title``: one line. ``alerts``: its alerts (empty for an Events
    API event). ``group_key``: Alertmanager's raw groupKey ("" otherwise). Build it with
    :meth:`from_alertmanager` or :meth:`from_events_v2`.
    """

    dedup_key: str = Field(min_length=1, max_length=255)
    action: Literal["trigger", "resolve", "acknowledge"]
    severity: Severity
    title: str = ""
    alerts: tuple[AlertRef, ...] = ()
    group_key: str = ""

    @property
    def fingerprints(self) -> tuple[str, ...]:
        """The non-empty fingerprints of the group's alerts, sorted and unique."""
        return tuple(sorted({a.fingerprint for a in self.alerts if a.fingerprint}))

    @property
    def firing_fingerprints(self) -> frozenset[str]:
        """The non-empty fingerprints of the alerts still firing."""
        return frozenset(a.fingerprint for a in self.alerts if a.fingerprint and a.status == "firing")

    @property
    def links(self) -> Links:
        """The union of the links named by every alert's labels (:meth:`Links.from_labels`)."""
        out = Links()
        for a in self.alerts:
            out = out.merge(Links.from_labels(a.labels))
        return out

    @classmethod
    def from_alertmanager(
        cls,
        payload: Mapping[str, Any],
        *,
        by_alertname: Mapping[str, Severity] | None = None,
        by_alert_severity: Mapping[str, Severity] | None = None,
    ) -> AlertGroup:
        """The group of one Alertmanager webhook payload (version 4, the shape
        :class:`apiary.ops.alerts.AlertmanagerPayload` reads: ``groupKey``, ``status``,
        ``commonLabels``, ``alerts[].{status, labels, fingerprint}``; other fields are ignored).

        ``dedup_key``: the SHA-256 (hex) of ``groupKey``, as Alertmanager's PagerDuty integration sends
        it; without a groupKey, ``fp:`` and the sorted fingerprints joined by commas (hashed too when
        that is longer than 255 characters). ``action``: ``trigger`` while any alert fires
        (Alertmanager's ``status`` is ``firing``), else ``resolve``. ``severity``: the most urgent of
        :func:`severity_for_alert` over the alerts (with the overrides given). ``title``: the
        ``alertname`` label common to the group, or the first alert's, with the first
        ``commonAnnotations.summary``. Raises ValidationError naming the field (``groupKey``,
        ``alerts[2].status``, ...) for a payload of another shape, or one with neither a groupKey
        nor any fingerprint.
        """
        payload = _require_mapping(payload, "body")
        version = payload.get("version", "4")
        if version != "4":
            raise ValidationError("version", f"unsupported Alertmanager webhook version {version!r}")
        raw_alerts = payload.get("alerts")
        if not isinstance(raw_alerts, list):
            raise ValidationError("alerts", "must be a list")
        alerts: list[AlertRef] = []
        for i, raw in enumerate(raw_alerts):
            a = _require_mapping(raw, f"alerts[{i}]")
            status = a.get("status")
            if status not in ("firing", "resolved"):
                raise ValidationError(f"alerts[{i}].status", f"must be 'firing' or 'resolved', not {status!r}")
            fingerprint = a.get("fingerprint", "") or ""
            if not isinstance(fingerprint, str):
                raise ValidationError(f"alerts[{i}].fingerprint", "must be a string")
            alerts.append(AlertRef(fingerprint=fingerprint, status=status,
                                   labels=_str_map(a.get("labels"), f"alerts[{i}].labels")))
        group_key = payload.get("groupKey") or ""
        if not isinstance(group_key, str):
            raise ValidationError("groupKey", "must be a string")
        common = _str_map(payload.get("commonLabels"), "commonLabels")
        annotations = _str_map(payload.get("commonAnnotations"), "commonAnnotations")
        if group_key:
            dedup_key = _dedup_from_group_key(group_key)
        else:
            fps = sorted({a.fingerprint for a in alerts if a.fingerprint})
            if not fps:
                raise ValidationError("groupKey", "a payload without a groupKey needs alert fingerprints")
            dedup_key = "fp:" + ",".join(fps)
            if len(dedup_key) > 255:
                dedup_key = _dedup_from_group_key(dedup_key)
        firing = any(a.status == "firing" for a in alerts) or payload.get("status") == "firing"
        label_sets = [a.labels for a in alerts] or [common]
        severity = min((severity_for_alert(labels, by_alertname=by_alertname, by_alert_severity=by_alert_severity)
                        for labels in label_sets), key=lambda s: s.rank)
        name = common.get("alertname") or label_sets[0].get("alertname", "")
        summary = annotations.get("summary", "")
        title = f"{name}: {summary}" if name and summary else (name or summary)
        return cls(dedup_key=dedup_key, action="trigger" if firing else "resolve", severity=severity,
                   title=title, alerts=tuple(alerts), group_key=group_key)

    @classmethod
    def from_events_v2(cls, event: Mapping[str, Any]) -> AlertGroup:
        """The group of one PagerDuty Events API v2 event: ``{"event_action": "trigger" | "acknowledge"
        | "resolve", "dedup_key": str, "payload": {"summary": str, "severity": "critical" | "error" |
        "warning" | "info", ...}}`` (``routing_key`` and the rest are ignored).

        ``payload.severity`` maps through :data:`EVENTS_V2_SEVERITY_TO_ALERT_SEVERITY` and
        :data:`ALERT_SEVERITY_TO_SEVERITY` (``critical`` -> ``sev1``). The Events API requires a
        dedup_key only for acknowledge and resolve (PagerDuty generates one for a trigger); this
        layer cannot, so it is required for every action. Raises ValidationError naming the field
        (``event_action``, ``dedup_key``, ``payload.severity``) for anything else.
        """
        event = _require_mapping(event, "body")
        action = event.get("event_action")
        if action not in ("trigger", "acknowledge", "resolve"):
            raise ValidationError("event_action", f"must be trigger, acknowledge or resolve, not {action!r}")
        dedup_key = event.get("dedup_key")
        if not isinstance(dedup_key, str) or not 0 < len(dedup_key) <= 255:
            raise ValidationError("dedup_key", "must be a string of 1 to 255 characters")
        body = _require_mapping(event.get("payload") or {}, "payload")
        level = body.get("severity", "info" if action != "trigger" else None)
        if level not in EVENTS_V2_SEVERITY_TO_ALERT_SEVERITY:
            raise ValidationError("payload.severity", f"must be critical, error, warning or info, not {level!r}")
        summary = body.get("summary", "")
        if not isinstance(summary, str):
            raise ValidationError("payload.summary", "must be a string")
        severity = ALERT_SEVERITY_TO_SEVERITY[EVENTS_V2_SEVERITY_TO_ALERT_SEVERITY[level]]
        return cls(dedup_key=dedup_key, action=action, severity=severity, title=summary)
