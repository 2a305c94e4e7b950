"""The incident state machine: one transition table, :func:`apply`, and alert correlation.

Pure: no I/O, no clock, no threads. Every change is ``apply(incident, event, actor, at) -> Incident``:
a new incident with the next state (from :data:`TRANSITIONS`, the only place that says what may
follow what) and one more timeline entry. The old incident is not touched.

The table, state by state (events not listed raise :class:`IncidentTransitionError`)::

    triggered     acknowledge -> acknowledged   mitigate -> mitigated   resolve -> resolved
                  escalate, notify, action, comment, alert -> triggered
    acknowledged  mitigate -> mitigated   resolve -> resolved   retrigger -> triggered
                  escalate, notify, action, comment, alert -> acknowledged
    mitigated     resolve -> resolved
                  escalate, notify, action, comment, alert -> mitigated
    resolved      close -> closed   reopen -> triggered
                  notify, action, comment, alert -> resolved
    closed        (final: nothing)

Correlation (:func:`correlate`) is PagerDuty's dedup rule for alert groups: a trigger with the
dedup key of an open incident is appended to it; one whose incident was resolved within the
reopen window reopens it; anything else opens a new incident.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal

from apiary.errors import ConflictError, ValidationError
from apiary.incidents.model import (
    AlertGroup,
    EntryKind,
    Incident,
    IncidentState,
    Links,
    Severity,
    TimelineEntry,
)

__all__ = [
    "ENTRY_KINDS",
    "TRANSITIONS",
    "Decision",
    "IncidentEvent",
    "IncidentTransitionError",
    "allowed_events",
    "apply",
    "correlate",
    "open_incident",
    "reachable_states",
]


class IncidentEvent(StrEnum):
    """What can happen to an incident. Values equal the lower-case names.

    State changes: ``acknowledge``, ``mitigate``, ``resolve``, ``close``, ``reopen`` (the same
    problem fired again within the reopen window), ``retrigger`` (nobody acted within the ack
    timeout: the incident goes back to ``triggered`` to be paged again, PagerDuty's acknowledgement
    timeout). Timeline only (the state stays): ``escalate`` (handed to the next on-call tier,
    AI-System 7.6.5.1's second and third lines), ``notify`` (a person or channel was told),
    ``action`` (an automatic or manual action ran: cordon a node, stop a job), ``comment``,
    ``alert`` (another alert of the problem arrived, firing or resolved).
    """

    ACKNOWLEDGE = "acknowledge"
    MITIGATE = "mitigate"
    RESOLVE = "resolve"
    CLOSE = "close"
    REOPEN = "reopen"
    RETRIGGER = "retrigger"
    ESCALATE = "escalate"
    NOTIFY = "notify"
    ACTION = "action"
    COMMENT = "comment"
    ALERT = "alert"


S = IncidentState
E = IncidentEvent

#: (state, event) -> next state. Every pair not here is refused. Each edge says when it happens.
TRANSITIONS: Mapping[tuple[IncidentState, IncidentEvent], IncidentState] = MappingProxyType({
    # A responder takes the page.
    (S.TRIGGERED, E.ACKNOWLEDGE): S.ACKNOWLEDGED,
    # An automatic action (cordon, drain) contains the impact before anyone acknowledged.
    (S.TRIGGERED, E.MITIGATE): S.MITIGATED,
    # The alert resolved by itself (Alertmanager's resolved notification) or someone resolved it at once.
    (S.TRIGGERED, E.RESOLVE): S.RESOLVED,
    # Nobody acknowledged within the escalation timeout: page the next tier; still triggered.
    (S.TRIGGERED, E.ESCALATE): S.TRIGGERED,
    (S.TRIGGERED, E.NOTIFY): S.TRIGGERED,
    (S.TRIGGERED, E.ACTION): S.TRIGGERED,
    (S.TRIGGERED, E.COMMENT): S.TRIGGERED,
    (S.TRIGGERED, E.ALERT): S.TRIGGERED,
    # The owner contained the impact (node cordoned, jobs moved); the cause is still there.
    (S.ACKNOWLEDGED, E.MITIGATE): S.MITIGATED,
    # The owner fixed it, or the alert resolved while acknowledged.
    (S.ACKNOWLEDGED, E.RESOLVE): S.RESOLVED,
    # Acknowledged but nothing done within the ack timeout: back to triggered, paged again.
    (S.ACKNOWLEDGED, E.RETRIGGER): S.TRIGGERED,
    # The owner hands it to a higher tier (7.6.5.1: second line, then the team's lead or a vendor).
    (S.ACKNOWLEDGED, E.ESCALATE): S.ACKNOWLEDGED,
    (S.ACKNOWLEDGED, E.NOTIFY): S.ACKNOWLEDGED,
    (S.ACKNOWLEDGED, E.ACTION): S.ACKNOWLEDGED,
    (S.ACKNOWLEDGED, E.COMMENT): S.ACKNOWLEDGED,
    (S.ACKNOWLEDGED, E.ALERT): S.ACKNOWLEDGED,
    # The repair is done (GPU reset, node back), or the alert resolved after mitigation.
    (S.MITIGATED, E.RESOLVE): S.RESOLVED,
    # The repair needs a higher tier (hardware vendor, platform developers).
    (S.MITIGATED, E.ESCALATE): S.MITIGATED,
    (S.MITIGATED, E.NOTIFY): S.MITIGATED,
    (S.MITIGATED, E.ACTION): S.MITIGATED,
    (S.MITIGATED, E.COMMENT): S.MITIGATED,
    (S.MITIGATED, E.ALERT): S.MITIGATED,
    # The post-incident review is done, or the reopen window passed.
    (S.RESOLVED, E.CLOSE): S.CLOSED,
    # The same problem fired again within the reopen window (see correlate), or a person reopened it.
    (S.RESOLVED, E.REOPEN): S.TRIGGERED,
    # Still on the record after resolution: the resolution is announced, follow-up actions, the
    # review's notes, the alerts' own resolved notifications.
    (S.RESOLVED, E.NOTIFY): S.RESOLVED,
    (S.RESOLVED, E.ACTION): S.RESOLVED,
    (S.RESOLVED, E.COMMENT): S.RESOLVED,
    (S.RESOLVED, E.ALERT): S.RESOLVED,
    # CLOSED is final: no edge leaves it.
})

#: The kind of timeline entry each event writes.
ENTRY_KINDS: Mapping[IncidentEvent, EntryKind] = MappingProxyType({
    E.ACKNOWLEDGE: EntryKind.ACKNOWLEDGEMENT,
    E.MITIGATE: EntryKind.STATE_CHANGE,
    E.RESOLVE: EntryKind.STATE_CHANGE,
    E.CLOSE: EntryKind.STATE_CHANGE,
    E.REOPEN: EntryKind.STATE_CHANGE,
    E.RETRIGGER: EntryKind.STATE_CHANGE,
    E.ESCALATE: EntryKind.ESCALATION,
    E.NOTIFY: EntryKind.NOTIFICATION,
    E.ACTION: EntryKind.ACTION,
    E.COMMENT: EntryKind.COMMENT,
    E.ALERT: EntryKind.ALERT,
})


class IncidentTransitionError(ConflictError):
    """An event the incident's state does not allow (not in :data:`TRANSITIONS`). HTTP 409.

    ``field`` is ``"state"``; ``state`` and ``event`` are the refused pair. The message names both
    and the events the state allows: ``"state: cannot acknowledge an incident that is closed
    (allowed: none, closed is final)"``. A user error (the caller asked for something the
    incident's current state rules out), unlike the job lifecycle's InvalidTransitionError, which
    is a platform bug.
    """

    code = "InvalidIncidentTransition"
    field = "state"

    def __init__(self, state: IncidentState, event: IncidentEvent) -> None:
        self.state = state
        self.event = event
        allowed = allowed_events(state)
        hint = ", ".join(e.value for e in allowed) if allowed else f"none, {state.value} is final"
        super().__init__(f"state: cannot {event.value} an incident that is {state.value} (allowed: {hint})")

    def to_dict(self) -> dict[str, str]:
        """``{"code", "message", "field": "state"}``: the error body plus the field, like a ValidationError's."""
        return {"code": self.code, "message": self.message, "field": self.field}


def allowed_events(state: IncidentState) -> tuple[IncidentEvent, ...]:
    """The events :data:`TRANSITIONS` accepts in ``state``, in :class:`IncidentEvent` order."""
    return tuple(e for e in IncidentEvent if (state, e) in TRANSITIONS)


def reachable_states(start: IncidentState = IncidentState.TRIGGERED) -> frozenset[IncidentState]:
    """Every state reachable from ``start`` through :data:`TRANSITIONS` (``start`` included)."""
    seen = {start}
    frontier = [start]
    while frontier:
        state = frontier.pop()
        for (src, _event), dst in TRANSITIONS.items():
            if src == state and dst not in seen:
                seen.add(dst)
                frontier.append(dst)
    return frozenset(seen)


def _check_actor(actor: str) -> None:
    if not isinstance(actor, str) or not actor.strip():
        raise ValidationError("actor", "must name a principal (a user, 'system' or a rule)")


def _check_time(at: float, field: str = "at") -> None:
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        raise ValidationError(field, f"must be a finite time in seconds since the epoch, not {at!r}")


def open_incident(
    id: str,
    title: str,
    severity: Severity,
    dedup_key: str,
    actor: str,
    at: float,
    *,
    links: Links | None = None,
    fingerprints: Iterable[str] = (),
    **detail: Any,
) -> Incident:
    """A new ``triggered`` incident whose timeline is one ``open`` entry (kind ``state_change``).

    ``id``: the caller's identifier (non-empty). ``severity``: a :class:`Severity`. ``dedup_key``:
    see :class:`~apiary.incidents.model.AlertGroup`. ``actor``: the principal opening it (``system``,
    an alert rule's name, a user). ``at``: seconds since the epoch. ``links``, ``fingerprints``: what
    it touches and the alerts it came from. ``detail``: JSON-like data recorded in the entry. Raises
    ValidationError naming the field for an empty ``id`` or ``actor``, a non-finite ``at`` or a
    severity that is not one.
    """
    _check_actor(actor)
    _check_time(at)
    if not id:
        raise ValidationError("id", "must not be empty")
    try:
        sev = Severity(severity)
    except ValueError as e:
        raise ValidationError("severity", f"must be one of {', '.join(s.value for s in Severity)}") from e
    entry_detail = copy.deepcopy(detail)
    if links is not None and not links.empty:
        entry_detail["links"] = links.model_dump(mode="json")
    entry = TimelineEntry(at=float(at), actor=actor, kind=EntryKind.STATE_CHANGE, event="open", from_state=None,
                          to_state=IncidentState.TRIGGERED, detail=entry_detail)
    return Incident(id=id, title=title, severity=sev, dedup_key=dedup_key, state=IncidentState.TRIGGERED,
                    opened_at=float(at), links=links or Links(), fingerprints=tuple(fingerprints), timeline=(entry,))


def apply(
    incident: Incident,
    event: IncidentEvent | str,
    actor: str,
    at: float,
    *,
    links: Links | None = None,
    fingerprints: Iterable[str] = (),
    **detail: Any,
) -> Incident:
    """A new incident: ``incident`` after ``event``, with one more timeline entry; ``incident`` is unchanged.

    The next state is ``TRANSITIONS[(incident.state, event)]``; the entry records ``at`` (seconds
    since the epoch), ``actor`` (the principal: set by the caller from who is authenticated, never
    from a request body), the kind from :data:`ENTRY_KINDS`, both states and ``detail`` (deep-copied
    JSON-like data). ``links`` are merged into the incident's (:meth:`Links.merge`: GPU-hours added)
    and ``fingerprints`` added to its alert fingerprints; both are also written in the entry's
    detail.

    Raises :class:`IncidentTransitionError` (409, field ``state``) for a pair outside the table, and
    ValidationError naming the field for an unknown ``event``, an empty ``actor``, or an ``at`` that is
    not finite or is earlier than the newest entry (the timeline is in time order).
    """
    try:
        ev = IncidentEvent(event)
    except ValueError as e:
        raise ValidationError("event", f"unknown event {event!r}; known: {', '.join(x.value for x in E)}") from e
    _check_actor(actor)
    _check_time(at)
    if at < incident.last_at:
        raise ValidationError("at", f"{at} is earlier than the incident's newest entry ({incident.last_at})")
    nxt = TRANSITIONS.get((incident.state, ev))
    if nxt is None:
        raise IncidentTransitionError(incident.state, ev)
    entry_detail = copy.deepcopy(detail)
    new_links = incident.links
    if links is not None and not links.empty:
        entry_detail["links"] = links.model_dump(mode="json")
        new_links = incident.links.merge(links)
    fps = tuple(fingerprints)
    if fps:
        entry_detail["fingerprints"] = sorted(set(fps))
    entry = TimelineEntry(at=float(at), actor=actor, kind=ENTRY_KINDS[ev], event=ev.value,
                          from_state=incident.state, to_state=nxt, detail=entry_detail)
    return incident.model_copy(update={
        "state": nxt,
        "links": new_links,
        "fingerprints": tuple(sorted(set(incident.fingerprints) | set(fps))),
        "timeline": (*incident.timeline, entry),
    })


# --- correlation -------------------------------------------------------------------------------

DecisionAction = Literal["open", "attach", "reopen", "resolve", "acknowledge", "ignore"]


@dataclass(frozen=True)
class Decision:
    """What to do with an alert group (:func:`correlate`); the caller applies it.

    ``action``:

    * ``open``: open a new incident (:func:`open_incident` with ``dedup_key``, ``severity``,
      ``title``, ``links``, ``fingerprints``);
    * ``attach``: :func:`apply` ``alert`` to ``incident_id``;
    * ``reopen``: :func:`apply` ``reopen`` (then ``alert``) to ``incident_id``;
    * ``resolve`` / ``acknowledge``: :func:`apply` that event to ``incident_id`` (the source says
      the problem is gone / someone took it);
    * ``ignore``: nothing to do (a resolve or acknowledge for no open incident).

    ``incident_id``: None for ``open`` and ``ignore``. ``reason``: one sentence for the timeline.
    """

    action: DecisionAction
    incident_id: str | None
    dedup_key: str
    severity: Severity
    title: str
    links: Links
    fingerprints: tuple[str, ...]
    reason: str


def _matches(incident: Incident, group: AlertGroup) -> bool:
    # Same dedup key, or (when Alertmanager's grouping changed, e.g. a new group_by) one of the
    # group's firing alerts is already attached to the incident.
    return incident.dedup_key == group.dedup_key or bool(group.firing_fingerprints & set(incident.fingerprints))


def correlate(
    open_incidents: Iterable[Incident],
    alert_group: AlertGroup,
    now: float,
    reopen_window_s: float,
) -> Decision:
    """Decide whether ``alert_group`` belongs to one of ``open_incidents`` (the caller's candidates:
    open ones and recently resolved ones; closed ones never match).

    An incident matches when it has the group's ``dedup_key``, or holds the fingerprint of one of the
    group's firing alerts. Then, for a ``trigger``:

    1. a matching open incident (the most recently opened if several): ``attach``;
    2. else a matching ``resolved`` incident resolved at most ``reopen_window_s`` seconds before ``now``
       (the most recently resolved): ``reopen``; the window's end is inclusive;
    3. else ``open`` (a resolved incident past the window stays resolved: a new incident is opened).

    A ``resolve`` resolves the matching open incident (``resolve``) or is ``ignore``d; an
    ``acknowledge`` acknowledges a matching ``triggered`` incident, is ``attach``ed to one already
    acknowledged or mitigated, and is ``ignore``d without one. ``now`` is seconds since the epoch.
    Raises ValidationError naming the field for a non-finite ``now`` or a negative or non-finite
    ``reopen_window_s``.
    """
    _check_time(now, "now")
    if isinstance(reopen_window_s, bool) or not math.isfinite(reopen_window_s) or reopen_window_s < 0:
        raise ValidationError("reopen_window_s", f"must be a finite number of seconds >= 0, not {reopen_window_s!r}")
    candidates = [i for i in open_incidents if _matches(i, alert_group)]
    open_ones = sorted((i for i in candidates if i.state.is_open), key=lambda i: i.opened_at, reverse=True)
    resolved = sorted(
        ((i, i.resolved_at) for i in candidates if i.state == IncidentState.RESOLVED and i.resolved_at is not None),
        key=lambda pair: pair[1], reverse=True,
    )

    def decide(action: DecisionAction, incident: Incident | None, reason: str) -> Decision:
        return Decision(action=action, incident_id=incident.id if incident else None,
                        dedup_key=alert_group.dedup_key, severity=alert_group.severity, title=alert_group.title,
                        links=alert_group.links, fingerprints=alert_group.fingerprints, reason=reason)

    if alert_group.action == "resolve":
        if open_ones:
            return decide("resolve", open_ones[0], "the source reported the problem resolved")
        return decide("ignore", None, "a resolve for no open incident")
    if alert_group.action == "acknowledge":
        if not open_ones:
            return decide("ignore", None, "an acknowledge for no open incident")
        target = open_ones[0]
        if target.state == IncidentState.TRIGGERED:
            return decide("acknowledge", target, "the source acknowledged the problem")
        return decide("attach", target, f"an acknowledge for an incident already {target.state.value}")
    if open_ones:
        return decide("attach", open_ones[0], "same problem as an open incident (dedup key or alert fingerprint)")
    for incident, resolved_at in resolved:
        if now - resolved_at <= reopen_window_s:
            return decide("reopen", incident,
                          f"fired again {now - resolved_at:g} s after it was resolved (window {reopen_window_s:g} s)")
    if resolved:
        return decide("open", None, f"the last matching incident was resolved more than {reopen_window_s:g} s ago")
    return decide("open", None, "no open or recently resolved incident has this dedup key")
