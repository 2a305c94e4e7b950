"""Incident statistics: MTTA, MTTM, MTTR by severity, SLA breaches, open incidents, notifications.

Pure: no I/O, no clock (``now`` is a parameter, seconds since the epoch), no threads. The one entry
point, :func:`snapshot`, returns a plain JSON-like dict that
:class:`apiary.monitoring.incident_metrics.IncidentCollector` renders at scrape time, so every
number comes from the stored incidents and a restarted control plane exports the same values.

Definitions (all times in seconds):

* **Episode.** An incident's timeline is cut into episodes at its ``open`` and ``reopen`` entries
  (:attr:`~apiary.incidents.model.Incident.episode_start` is the start of the last one). A
  ``retrigger`` (ack timeout) does not start an episode.
* **Milestone reached.** The same rule as :func:`apiary.incidents.model.breaches`: a milestone is
  reached by the first entry of the episode whose ``to_state`` implies it (``acknowledged``,
  ``mitigated``, ``resolved`` or ``closed`` for ``acknowledge``; ``mitigated`` and later for
  ``mitigate``; ``resolved`` and later for ``resolve``). So an incident resolved without an
  acknowledgement counts as acknowledged at its resolution.
* **MTTA / MTTM / MTTR** of a severity: the mean, over every episode of that severity's incidents
  that reached the milestone, of (time reached - episode start). A reopened incident contributes
  one sample per episode. None when no episode reached it.
* **SLA breach.** Per episode and milestone with a target: reached after its deadline, or (in the
  current episode only) not reached and ``now`` past the deadline; the deadline itself is in time.
  For the current episode this is exactly :func:`~apiary.incidents.model.breaches`; counting past
  episodes too keeps the count monotonic when an incident is reopened (a Prometheus counter).
* **Notifications**: ``notify`` entries by channel and result (:func:`notification_key`: the
  dispatcher's ``channel`` and ``outcome``, ``sent`` / ``failed`` / ``rejected`` / ``skipped``);
  **escalations**: ``escalate`` entries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from apiary.errors import ValidationError
from apiary.incidents.model import (
    DEFAULT_SLA,
    MILESTONES,
    Incident,
    IncidentState,
    Severity,
    SlaPolicy,
    TimelineEntry,
)

__all__ = [
    "KNOWN_CHANNELS",
    "NOTIFICATION_RESULTS",
    "Breach",
    "Episode",
    "episode_breaches",
    "episodes",
    "notification_key",
    "snapshot",
]

#: The channels :class:`apiary.oncall.routing.Channel` defines (copied, not imported: the incident
#: core does not depend on on-call). Their notification series exist from the start, at 0, so a
#: first failure shows in ``increase()``.
KNOWN_CHANNELS: tuple[str, ...] = ("email", "im", "phone", "sms")
#: The notification results whose series always exist (others, ``rejected`` and ``skipped``, appear
#: once seen; see :func:`notification_key`).
NOTIFICATION_RESULTS: tuple[str, ...] = ("sent", "failed")

_S = IncidentState
#: Which states mean a milestone was reached (model._REACHED's rule, restated here so that this
#: module reads no private name).
_REACHED: Mapping[str, frozenset[IncidentState]] = MappingProxyType({
    "acknowledge": frozenset({_S.ACKNOWLEDGED, _S.MITIGATED, _S.RESOLVED, _S.CLOSED}),
    "mitigate": frozenset({_S.MITIGATED, _S.RESOLVED, _S.CLOSED}),
    "resolve": frozenset({_S.RESOLVED, _S.CLOSED}),
})


@dataclass(frozen=True)
class Episode:
    """One episode of an incident: ``entries`` from its ``open`` / ``reopen`` entry (``start``, epoch
    s) up to the next one; ``current`` for the last. ``reached[milestone]``: when each milestone was
    reached in it, or None."""

    index: int
    start: float
    entries: tuple[TimelineEntry, ...]
    current: bool
    reached: Mapping[str, float | None]


@dataclass(frozen=True)
class Breach:
    """A missed SLA deadline: ``milestone`` of episode ``episode`` was due at ``deadline`` (epoch s)
    and was reached at ``reached`` (None: not yet; ``now`` was past the deadline)."""

    episode: int
    milestone: str
    deadline: float
    reached: float | None
    target_s: float


def episodes(incident: Incident) -> list[Episode]:
    """The incident's episodes, oldest first (see the module docstring). Never raises."""
    starts = [i for i, e in enumerate(incident.timeline) if e.event in ("open", "reopen")] or [0]
    if starts[0] != 0:
        starts.insert(0, 0)  # pragma: no cover - open_incident always writes an ``open`` entry first
    out: list[Episode] = []
    for n, begin in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(incident.timeline)
        entries = incident.timeline[begin:end]
        reached: dict[str, float | None] = {}
        for milestone in MILESTONES:
            reached[milestone] = next((e.at for e in entries if e.to_state in _REACHED[milestone]), None)
        out.append(Episode(index=n, start=entries[0].at, entries=entries, current=n == len(starts) - 1,
                           reached=MappingProxyType(reached)))
    return out


def episode_breaches(incident: Incident, now: float, policy: SlaPolicy = DEFAULT_SLA) -> list[Breach]:
    """Every missed deadline of every episode, oldest first (see the module docstring).

    For the current episode the milestones are those of
    :func:`apiary.incidents.model.breaches`. Raises ValidationError (field ``now``) for a
    non-finite ``now``.
    """
    _check_now(now)
    targets = policy.targets[incident.severity]
    out: list[Breach] = []
    for ep in episodes(incident):
        for milestone in MILESTONES:
            target = targets.target(milestone)
            if target is None:
                continue
            deadline = ep.start + target
            reached = ep.reached[milestone]
            if reached is None and not ep.current:
                continue  # pragma: no cover - a past episode ended resolved, so it reached everything
            if (reached if reached is not None else now) > deadline:
                out.append(Breach(episode=ep.index, milestone=milestone, deadline=deadline, reached=reached,
                                  target_s=target))
    return out


def notification_key(entry: TimelineEntry) -> tuple[str, str]:
    """``(channel, result)`` of a ``notify`` entry.

    ``channel``: ``detail["channel"]``, ``unknown`` when absent (e.g. a user with no contact).
    ``result``: ``detail["result"]``, else ``detail["outcome"]`` (the dispatcher's ``sent`` /
    ``failed`` / ``rejected`` / ``skipped``), else ``failed`` when ``detail["ok"]`` is False, else
    ``sent``.
    """
    d = entry.detail
    channel = d.get("channel") or "unknown"
    result = d.get("result") or d.get("outcome") or ("failed" if d.get("ok") is False else "sent")
    return str(channel), str(result)


def _check_now(now: float) -> None:
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise ValidationError("now", f"must be a finite time in seconds, not {now!r}")


def snapshot(incidents: Iterable[Incident], now: float, policy: SlaPolicy = DEFAULT_SLA) -> dict[str, Any]:
    """Statistics over ``incidents`` at ``now`` (seconds since the epoch), as plain data.

    Keys (severities and states are their string values; every severity is present):

    * ``total``: ``{severity: incidents}`` (every incident given, whatever its state);
    * ``open``: ``{severity: {state: n}}`` for the open states (``triggered``, ``acknowledged``,
      ``mitigated``), zeros included;
    * ``mtta`` / ``mttm`` / ``mttr``: ``{severity: mean seconds | None}``; ``samples``:
      ``{"acknowledge" | "mitigate" | "resolve": {severity: episodes averaged}}``;
    * ``sla_breaches``: ``{severity: {milestone: n}}``, all three milestones (0 where the severity
      has no target);
    * ``notifications``: ``{channel: {result: n}}``, :data:`KNOWN_CHANNELS` x
      :data:`NOTIFICATION_RESULTS` always present, plus any other pair seen;
    * ``escalations``: ``escalate`` entries;
    * ``now``: the ``now`` given.

    Raises ValidationError (field ``now``) for a non-finite ``now``.
    """
    _check_now(now)
    sevs = [s.value for s in Severity]
    total = dict.fromkeys(sevs, 0)
    open_ = {s: {st.value: 0 for st in sorted(IncidentState.open_states(), key=list(IncidentState).index)}
             for s in sevs}
    sums = {m: dict.fromkeys(sevs, 0.0) for m in MILESTONES}
    counts = {m: dict.fromkeys(sevs, 0) for m in MILESTONES}
    breaches = {s: dict.fromkeys(MILESTONES, 0) for s in sevs}
    notifications: dict[str, dict[str, int]] = {c: dict.fromkeys(NOTIFICATION_RESULTS, 0) for c in KNOWN_CHANNELS}
    escalations = 0

    for incident in incidents:
        sev = incident.severity.value
        total[sev] += 1
        if incident.state.is_open:
            open_[sev][incident.state.value] += 1
        for ep in episodes(incident):
            for milestone in MILESTONES:
                reached = ep.reached[milestone]
                if reached is not None:
                    sums[milestone][sev] += reached - ep.start
                    counts[milestone][sev] += 1
        for b in episode_breaches(incident, now, policy):
            breaches[sev][b.milestone] += 1
        for entry in incident.timeline:
            if entry.event == "notify":
                channel, result = notification_key(entry)
                per_channel = notifications.setdefault(channel, dict.fromkeys(NOTIFICATION_RESULTS, 0))
                per_channel[result] = per_channel.get(result, 0) + 1
            elif entry.event == "escalate":
                escalations += 1

    def means(milestone: str) -> dict[str, float | None]:
        return {s: (sums[milestone][s] / counts[milestone][s] if counts[milestone][s] else None) for s in sevs}

    return {
        "now": float(now),
        "total": total,
        "open": open_,
        "mtta": means("acknowledge"),
        "mttm": means("mitigate"),
        "mttr": means("resolve"),
        "samples": counts,
        "sla_breaches": breaches,
        "notifications": notifications,
        "escalations": escalations,
    }
