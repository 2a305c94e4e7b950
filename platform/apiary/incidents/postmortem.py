"""Postmortem drafts in Google SRE's shape, filled from an incident's timeline, editable as Markdown.

Pure: no I/O, no clock (times come from the incident), no threads. Resolving a Sev1 or Sev2 incident
drafts one; people then edit the Markdown, and :func:`parse_action_items` reads the
action-item table back so each item stays tracked (by its ``id``) until it is ``done``.

The sections are those of the "Example Postmortem" of Google's SRE book (sre.google/sre-book/
example-postmortem): title, date, authors, status, summary, impact, root causes, trigger,
resolution, detection, action items (action, type, owner, bug), lessons learned (what went well,
what went wrong, where we got lucky) and the timeline. Sections the timeline cannot know (root
causes, where we got lucky) carry a ``TODO`` for the authors.

**What is read from the timeline** (the ``detail`` keys the writers of each event use):

(those :mod:`apiary.response` writes):

* ``open`` / ``alert``: ``alertname`` or ``alertnames``, ``reason``;
* ``notify``: ``channel`` (``email``, ``im``, ``sms``, ``phone``), ``recipient`` (or ``target``),
  the result (:func:`apiary.incidents.stats.notification_key`: ``result`` / ``outcome`` / ``ok``),
  ``attempt``, and ``error`` or ``detail`` (the failure's message);
* ``escalate``: ``tier``, ``targets``;
* ``action``: ``action`` (``cordon-node``, ``drain-node``, ``tag-jobs:<tag>``, ...), ``target``,
  ``result`` (``ok`` / ``failed`` / ``skipped``), ``message``, ``undo`` (the action that reverses
  it, for actions :data:`FOLLOW_UPS` does not know);
* ``comment``: ``text`` (or ``comment`` / ``message``); a rule's diagnosis (``diagnosis``,
  ``runbook``, ``evidence``, ``suspectedCause``);
* any entry: ``reason`` or ``message``; ``suspected_cause`` / ``suspectedCause``.

Times are UTC, ISO 8601 to the second (``2026-11-25T08:00:00Z``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Literal

from apiary.errors import ValidationError
from apiary.incidents.model import DEFAULT_SLA, Incident, SlaPolicy, TimelineEntry
from apiary.incidents.stats import episode_breaches, notification_key

__all__ = [
    "ACTION_ITEMS_HEADING",
    "FOLLOW_UPS",
    "ActionItem",
    "Lessons",
    "Postmortem",
    "TimelineRow",
    "draft",
    "format_duration",
    "iso_utc",
    "parse_action_items",
    "summarize",
    "with_items",
]

ItemType = Literal["mitigate", "prevent", "process"]
ItemStatus = Literal["open", "done"]
_TYPES: tuple[str, ...] = ("mitigate", "prevent", "process")
#: Status words a person may write in the table, and what they mean.
_STATUS_WORDS: Mapping[str, ItemStatus] = MappingProxyType({
    "": "open", "open": "open", "todo": "open", "in progress": "open", "in-progress": "open",
    "started": "open", "done": "done", "closed": "done", "fixed": "done", "complete": "done",
    "completed": "done",
})
#: The heading :func:`parse_action_items` looks for.
ACTION_ITEMS_HEADING = "## Action items"
_COLUMNS = ("ID", "Action item", "Type", "Owner", "Bug", "Status")

#: Automatic actions that need a follow-up once the cause is repaired: action name -> (the action
#: item's text, ``{target}`` filled in; the action that reverses it, whose later entry on the same
#: target marks the item done). Names are those of ``apiary/ops/default-actions.yaml`` and the
#: response rules (with and without the ``-node`` suffix).
FOLLOW_UPS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "cordon": ("Uncordon {target} after repair", "uncordon"),
    "cordon-node": ("Uncordon {target} after repair", "uncordon-node"),
    "drain": ("Return {target} to service (uncordon) after repair; check its jobs finished elsewhere",
              "uncordon"),
    "drain-node": ("Return {target} to service (uncordon) after repair; check its jobs finished elsewhere",
                   "uncordon-node"),
    "tag-job": ("Remove the incident tag from {target} once its owner is told", "untag-job"),
    "tag-jobs": ("Remove the incident tag from the jobs of {target} once their owners are told", "untag-jobs"),
    "disable-rule": ("Re-enable rule {target} once it is fixed", "enable-rule"),
    "silence": ("Remove the silence on {target} after repair", "unsilence"),
})
#: Action names that mean the same reversal (an ``uncordon-node`` reverses a ``cordon`` too).
_REVERSALS = {"uncordon": "uncordon", "uncordon-node": "uncordon"}


def iso_utc(t: float) -> str:
    """``t`` (seconds since the epoch) as UTC ISO 8601 to the second: ``2026-11-25T08:00:00Z``."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_duration(seconds: float) -> str:
    """``3725`` -> ``1h 2m 5s``; ``0`` -> ``0s``; days as ``2d 3h``. Negative values get a ``-``."""
    sign = "-" if seconds < 0 else ""
    s = round(abs(seconds))
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            parts.append(f"{s // size}{unit}")
            s %= size
    if s or not parts:
        parts.append(f"{s}s")
    return sign + " ".join(parts)


@dataclass(frozen=True)
class ActionItem:
    """One action item. ``id``: ``AI-<n>``, stable across edits (the tracking key). ``text``: what to
    do. ``type``: Google's ``mitigate`` / ``prevent`` / ``process``. ``owner``: a user name, "" for
    nobody yet. ``bug``: a tracker reference, "" for none. ``status``: ``open`` or ``done``."""

    id: str
    text: str
    type: ItemType = "prevent"
    owner: str = ""
    bug: str = ""
    status: ItemStatus = "open"


@dataclass(frozen=True)
class TimelineRow:
    """One timeline entry as a postmortem shows it: ``at`` (UTC ISO), ``actor``, ``event``, ``summary``."""

    at: str
    actor: str
    event: str
    summary: str


@dataclass(frozen=True)
class Lessons:
    """Lessons learned, one sentence each."""

    went_well: tuple[str, ...] = ()
    went_wrong: tuple[str, ...] = ()
    got_lucky: tuple[str, ...] = ()


@dataclass(frozen=True)
class Postmortem:
    """A postmortem (see the module docstring). Text sections are Markdown; lists are one item per line.
    Build it with :func:`draft`, render it with :meth:`to_markdown`."""

    incident_id: str
    title: str
    date: str
    authors: tuple[str, ...]
    status: str
    summary: str
    impact: tuple[str, ...]
    root_causes: tuple[str, ...]
    trigger: str
    resolution: tuple[str, ...]
    detection: tuple[str, ...]
    action_items: tuple[ActionItem, ...]
    lessons: Lessons = field(default_factory=Lessons)
    timeline: tuple[TimelineRow, ...] = ()

    def to_markdown(self) -> str:
        """The postmortem as Markdown; its action-item table reads back with :func:`parse_action_items`."""
        def bullets(items: Sequence[str]) -> list[str]:
            return [f"* {i}" for i in items] or ["* (none)"]

        out = [
            f"# Postmortem: {self.title}",
            "",
            f"**Incident:** {self.incident_id}  ",
            f"**Date:** {self.date}  ",
            f"**Authors:** {', '.join(self.authors) or 'TODO'}  ",
            f"**Status:** {self.status}",
            "",
            "## Summary", "", self.summary, "",
            "## Impact", "", *bullets(self.impact), "",
            "## Root causes", "", *bullets(self.root_causes), "",
            "## Trigger", "", self.trigger, "",
            "## Resolution", "", *bullets(self.resolution), "",
            "## Detection", "", *bullets(self.detection), "",
            ACTION_ITEMS_HEADING, "",
            "| " + " | ".join(_COLUMNS) + " |",
            "|" + "---|" * len(_COLUMNS),
        ]
        out += [f"| {_cell(a.id)} | {_cell(a.text)} | {a.type} | {_cell(a.owner)} | {_cell(a.bug)} | {a.status} |"
                for a in self.action_items]
        out += [
            "",
            "## Lessons learned", "",
            "### What went well", "", *bullets(self.lessons.went_well), "",
            "### What went wrong", "", *bullets(self.lessons.went_wrong), "",
            "### Where we got lucky", "", *bullets(self.lessons.got_lucky), "",
            "## Timeline", "",
            "All times UTC.", "",
            "| Time | Actor | Event | Detail |",
            "|---|---|---|---|",
        ]
        out += [f"| {r.at} | {_cell(r.actor)} | {r.event} | {_cell(r.summary)} |" for r in self.timeline]
        return "\n".join(out) + "\n"


# --- timeline summaries --------------------------------------------------------------------------


def _text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(_text(v) for v in value)
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_text(v)}" for k, v in value.items())
    return str(value)


def summarize(entry: TimelineEntry) -> str:
    """One line for people describing ``entry`` (see the module docstring for the detail keys read)."""
    d = entry.detail
    note = d.get("reason") or (d.get("message") if entry.event != "action" else None)
    reason = f" ({_text(note)})" if note else ""
    if entry.event == "notify":
        channel, result = notification_key(entry)
        who = d.get("target") or d.get("recipient")
        whom = f" {_text(who)}" if who else ""
        error = d.get("error") or d.get("detail")
        tail = "" if result == "sent" else f": {result}" + (f" ({_text(error)})" if error else "")
        attempt = f" (attempt {d['attempt']})" if isinstance(d.get("attempt"), int) and d["attempt"] > 1 else ""
        return f"notified{whom} by {channel}{attempt}{tail}{reason}"
    if entry.event == "escalate":
        targets = f" ({_text(d['targets'])})" if d.get("targets") else ""
        tier = f" to tier {d['tier']}" if d.get("tier") is not None else ""
        return f"escalated{tier}{targets}{reason}"
    if entry.event == "action":
        name = d.get("action") or "an action"
        on = f" on {_text(d['target'])}" if d.get("target") else ""
        result = f": {_text(d['result'])}" if d.get("result") else ""
        message = f" ({_text(d['message'])})" if d.get("message") else ""
        return f"ran {name}{on}{result}{message}{reason}"
    if entry.event == "comment":
        text = d.get("text") or d.get("comment") or d.get("message")
        if text or not d.get("diagnosis"):
            return _text(text or "")
        parts = ["diagnosis"]
        if _cause(d):
            parts.append(f"suspected cause {_cause(d)}")
        if d.get("runbook"):
            parts.append(f"runbook {_text(d['runbook'])}")
        if isinstance(d.get("evidence"), Mapping) and d["evidence"]:
            parts.append(f"evidence: {', '.join(map(str, d['evidence']))}")
        return "; ".join(parts)
    if entry.event == "alert":
        names = _text(d.get("alertname") or d.get("alertnames") or "an alert")
        status = f" {d['status']}" if d.get("status") else ""
        return f"alert {names}{status}{reason}"
    change = (f"{entry.from_state.value} -> {entry.to_state.value}" if entry.from_state is not None
              else f"opened as {entry.to_state.value}")
    extra = []
    if entry.event == "open" and (d.get("alertname") or d.get("alertnames")):
        extra.append(f"alert {_text(d.get('alertname') or d.get('alertnames'))}")
    if d.get("verdict"):
        extra.append(f"verdict {d['verdict']}")
    return change + reason + "".join(f"; {x}" for x in extra)


def _cause(d: Mapping[str, Any]) -> str:
    cause = d.get("suspected_cause") or d.get("suspectedCause")
    return _text(cause) if cause else ""


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


# --- drafting ------------------------------------------------------------------------------------


def _first(incident: Incident, event: str) -> TimelineEntry | None:
    return next((e for e in incident.timeline if e.event == event), None)


def _since(incident: Incident, t: float) -> str:
    return format_duration(t - incident.opened_at)


def _impact(incident: Incident, metrics: Mapping[str, Any] | None) -> list[str]:
    links = incident.links
    out = []
    for label, names in (("Nodes", links.nodes), ("Jobs", links.jobs), ("Users", links.users),
                         ("Virtual clusters", links.virtual_clusters)):
        if names:
            out.append(f"{label} affected ({len(names)}): {', '.join(names)}")
    if links.gpu_hours_lost:
        out.append(f"GPU-hours lost: {links.gpu_hours_lost:g}")
    for key in sorted(metrics or {}):
        out.append(f"{key}: {_text((metrics or {})[key])}")
    return out or ["TODO: no nodes, jobs, users or VCs were linked to the incident; describe the impact"]


def _detection(incident: Incident, sla: SlaPolicy) -> list[str]:
    opened = incident.timeline[0]
    alert = opened.detail.get("alertname") or opened.detail.get("alertnames")
    first_alert = _first(incident, "alert")
    if alert:
        out = [f"Detected by alert {_text(alert)} at {iso_utc(opened.at)} (opened by {opened.actor})"]
    elif first_alert is not None:
        out = [f"Opened by {opened.actor} at {iso_utc(opened.at)}; first alert "
               f"{_text(first_alert.detail.get('alertname') or first_alert.detail.get('alertnames') or '?')} "
               f"at {iso_utc(first_alert.at)}"]
    else:
        out = [f"Opened by {opened.actor} at {iso_utc(opened.at)}"]
    for e in incident.timeline:
        if e.event == "notify":
            out.append(f"{iso_utc(e.at)} (+{_since(incident, e.at)}): {summarize(e)}")
        elif e.event == "escalate":
            out.append(f"{iso_utc(e.at)} (+{_since(incident, e.at)}): {summarize(e)}")
    ack = _first(incident, "acknowledge")
    target = sla.targets[incident.severity].ack_s
    if ack is None:
        out.append(f"Never acknowledged (SLA: {format_duration(target)})")
    else:
        took = ack.at - incident.opened_at
        verdict = "met" if took <= target else f"missed by {format_duration(took - target)}"
        out.append(f"Acknowledged by {ack.actor} at {iso_utc(ack.at)}, {format_duration(took)} after opening "
                   f"(SLA {format_duration(target)}: {verdict})")
    return out


def _resolution(incident: Incident, sla: SlaPolicy) -> list[str]:
    targets = sla.targets[incident.severity]
    out = []
    for e in incident.timeline:
        if e.event in ("mitigate", "resolve", "reopen", "close") or e.event == "action":
            line = f"{iso_utc(e.at)} (+{_since(incident, e.at)}): {e.actor}: {e.event}"
            if e.event == "action":
                line = f"{iso_utc(e.at)} (+{_since(incident, e.at)}): {e.actor}: {summarize(e)}"
            elif e.detail.get("reason"):
                line += f" ({e.detail['reason']})"
            out.append(line)
    mitigated = _first(incident, "mitigate")
    if mitigated is not None and targets.mitigate_s is not None:
        took = mitigated.at - incident.opened_at
        verdict = "met" if took <= targets.mitigate_s else "missed"
        out.append(f"Mitigated {format_duration(took)} after opening (SLA {format_duration(targets.mitigate_s)}: "
                   f"{verdict})")
    if incident.resolved_at is not None:
        took = incident.resolved_at - incident.opened_at
        verdict = "met" if took <= targets.resolve_s else "missed"
        out.append(f"Resolved {format_duration(took)} after opening (SLA {format_duration(targets.resolve_s)}: "
                   f"{verdict})")
    else:
        out.append(f"Not resolved yet (state {incident.state.value})")
    return out


_INEFFECTIVE = ("failed", "skipped", "rejected")


def _action_name(entry: TimelineEntry) -> str:
    return str(entry.detail.get("action") or "")


def _reversal(name: str) -> str:
    base = name.partition(":")[0]
    return _REVERSALS.get(base, base)


def _follow_ups(incident: Incident) -> list[tuple[str, ItemType, ItemStatus]]:
    # An action that took effect (result not failed / skipped) and needs undoing after repair: from
    # FOLLOW_UPS by its name (``tag-jobs:<tag>`` is ``tag-jobs``), else from its ``undo`` detail. Done
    # when a later effective action on the same target is its reversal.
    out: list[tuple[str, ItemType, ItemStatus]] = []
    actions = [e for e in incident.timeline if e.event == "action"]
    for i, e in enumerate(actions):
        name = _action_name(e)
        if e.detail.get("result") in _INEFFECTIVE:
            continue
        target = _text(e.detail.get("target") or "the target")
        base = name.partition(":")[0]
        if base in FOLLOW_UPS:
            template, undo = FOLLOW_UPS[base]
            text = template.format(target=target)
        elif isinstance(e.detail.get("undo"), str) and e.detail["undo"]:
            undo = e.detail["undo"]
            text = f"Reverse {name} on {target} after repair ({undo})"
        else:
            continue
        done = any(_reversal(_action_name(later)) == _reversal(undo)
                   and _text(later.detail.get("target") or "the target") == target
                   and later.detail.get("result") not in _INEFFECTIVE
                   for later in actions[i + 1:])
        out.append((text, "mitigate", "done" if done else "open"))
    return out


def draft(
    incident: Incident,
    *,
    metrics: Mapping[str, Any] | None = None,
    sla: SlaPolicy = DEFAULT_SLA,
    authors: Sequence[str] | None = None,
) -> Postmortem:
    """A postmortem draft of ``incident`` (see the module docstring for what is read).

    ``metrics``: figures the caller measured for the impact (``{"jobs_failed": 12, ...}``), listed
    as ``key: value`` lines in key order. ``sla``: the targets to compare against. ``authors``: by
    default the actors of the incident's ``acknowledge``, ``mitigate``, ``resolve`` and ``comment``
    entries other than ``system``, in order of appearance.

    The action items, numbered ``AI-1``...: a follow-up for each automatic action that needs
    reversing (:data:`FOLLOW_UPS`, or an action's ``detail["undo"]``; ``done`` when a later entry
    already reversed it), one per SLA breach and per failing notification channel (``process``),
    and one ``prevent`` item for the root cause. The date is the opening's (UTC). The breaches are
    counted at the newest entry's time. Never raises for a valid incident.
    """
    opened, last = incident.opened_at, incident.last_at
    end = incident.resolved_at if incident.resolved_at is not None else last
    duration = format_duration(end - opened)
    if authors is None:
        people: list[str] = []
        for e in incident.timeline:
            if e.event in ("acknowledge", "mitigate", "resolve", "comment") and e.actor != "system" \
                    and e.actor not in people:
                people.append(e.actor)
        authors = people
    sev = incident.severity.value.upper()
    resolved = (f"resolved at {iso_utc(incident.resolved_at)}" if incident.resolved_at is not None
                else f"still {incident.state.value} at {iso_utc(last)}")
    summary = f"{sev} incident \"{incident.title}\": opened at {iso_utc(opened)}, {resolved}; lasted {duration}."
    reopens = sum(1 for e in incident.timeline if e.event == "reopen")
    if reopens:
        summary += f" Reopened {reopens} time(s)."

    causes = [_cause(e.detail) for e in incident.timeline if _cause(e.detail)]
    root_causes = [f"Suspected (from the response rules): {c}" for c in dict.fromkeys(causes)]
    root_causes.append("TODO: the root cause, and why the defences did not stop it")

    first_alert = next((e for e in incident.timeline
                        if e.detail.get("alertname") or e.detail.get("alertnames")), None)
    if first_alert is not None:
        trigger = (f"Alert {_text(first_alert.detail.get('alertname') or first_alert.detail.get('alertnames'))} "
                   f"fired at {iso_utc(first_alert.at)}. TODO: what change or event set it off?")
    else:
        trigger = f"Opened by {incident.timeline[0].actor} at {iso_utc(opened)}. TODO: what set it off?"

    # Action items: 1. follow-ups of automatic actions, 2. SLA breaches, 3. failing channels, 4. the cause.
    seeds: list[tuple[str, ItemType, ItemStatus]] = []
    for text, kind, status in _follow_ups(incident):
        if text not in [s[0] for s in seeds]:
            seeds.append((text, kind, status))
    breaches = episode_breaches(incident, end, sla)
    for b in breaches:
        late = "not reached" if b.reached is None else f"took {format_duration(b.reached - (b.deadline - b.target_s))}"
        seeds.append((f"SLA missed: {b.milestone} {late} (target {format_duration(b.target_s)}); find why "
                      "(paging, routing, runbook) and fix it", "process", "open"))
    failed = sorted({(notification_key(e)[0], _text(e.detail.get("target") or e.detail.get("recipient") or "?"))
                     for e in incident.timeline
                     if e.event == "notify" and notification_key(e)[1] in ("failed", "rejected")})
    for channel, target in failed:
        seeds.append((f"Fix notifications by {channel} to {target}: delivery failed", "process", "open"))
    seeds.append(("Prevent a recurrence: fix the root cause (see Root causes)", "prevent", "open"))
    items = tuple(ActionItem(id=f"AI-{n}", text=text, type=kind, status=status)
                  for n, (text, kind, status) in enumerate(seeds, 1))

    went_well, went_wrong = [], []
    targets = sla.targets[incident.severity]
    ack = _first(incident, "acknowledge")
    if ack is not None and ack.at - opened <= targets.ack_s:
        went_well.append(f"Acknowledged within the SLA ({format_duration(ack.at - opened)})")
    auto = [e for e in incident.timeline if e.event == "action" and e.actor == "system"]
    if auto:
        went_well.append(f"Automatic response: {summarize(auto[0])}, {_since(incident, auto[0].at)} after opening")
    for b in breaches:
        went_wrong.append(f"The {b.milestone} SLA ({format_duration(b.target_s)}) was missed")
    escalations = [e for e in incident.timeline if e.event == "escalate"]
    if escalations:
        went_wrong.append(f"Escalated {len(escalations)} time(s): nobody acknowledged within a tier's delay")
    for channel, target in failed:
        went_wrong.append(f"Notifications by {channel} to {target} failed")
    for e in incident.timeline:
        if e.event == "action" and e.detail.get("result") == "failed":
            went_wrong.append(f"{summarize(e)}")
    if reopens:
        went_wrong.append(f"Reopened {reopens} time(s): the first resolution did not hold")

    return Postmortem(
        incident_id=incident.id,
        title=incident.title,
        date=iso_utc(opened)[:10],
        authors=tuple(authors),
        status=f"Draft (incident {incident.state.value}); action items open",
        summary=summary,
        impact=tuple(_impact(incident, metrics)),
        root_causes=tuple(root_causes),
        trigger=trigger,
        resolution=tuple(_resolution(incident, sla)),
        detection=tuple(_detection(incident, sla)),
        action_items=items,
        lessons=Lessons(went_well=tuple(went_well), went_wrong=tuple(went_wrong),
                        got_lucky=("TODO",)),
        timeline=tuple(TimelineRow(at=iso_utc(e.at), actor=e.actor, event=e.event, summary=summarize(e))
                       for e in incident.timeline),
    )


# --- reading the edited Markdown back ---------------------------------------------------------------

_SPLIT = re.compile(r"(?<!\\)\|")
_SEPARATOR = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?$")
_ID = re.compile(r"^AI-(\d+)$")


def _cells(line: str) -> list[str]:
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    if body.endswith("|") and not body.endswith("\\|"):
        body = body[:-1]
    return [c.strip().replace("\\|", "|").replace("\\\\", "\\") for c in _SPLIT.split(body)]


def parse_action_items(markdown: str) -> list[ActionItem]:
    """The action items of a postmortem's Markdown, as a person left them, in table order.

    Reads the first table after the ``## Action items`` heading (case-insensitive). Columns are found
    by their header (``ID``, ``Action item`` (or ``Action``), ``Type``, ``Owner``, ``Bug``,
    ``Status``; order free; only the action column is required). A row without an ID gets the next
    free ``AI-<n>``. Status words: ``open`` / ``todo`` / ``in progress`` / empty are ``open``;
    ``done`` / ``closed`` / ``fixed`` / ``complete`` are ``done``. An empty type is ``prevent``.

    Raises ValidationError naming the field: ``action_items`` without the heading or the table,
    ``action_items[2].type`` / ``.status`` for an unknown word, ``action_items[2].id`` for a
    duplicate or malformed id, ``action_items[2].text`` for an empty action.
    """
    lines = markdown.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().lower() == ACTION_ITEMS_HEADING.lower()), None)
    if start is None:
        raise ValidationError("action_items", f"no {ACTION_ITEMS_HEADING!r} heading")
    rows: list[str] = []
    for ln in lines[start + 1:]:
        s = ln.strip()
        if s.startswith("#"):
            break
        if s.startswith("|"):
            rows.append(s)
        elif rows:
            break  # the table ended
    if len(rows) < 2 or not _SEPARATOR.match(rows[1]):
        raise ValidationError("action_items", "no table under the heading")
    header = [h.lower() for h in _cells(rows[0])]
    aliases = {"id": "id", "action item": "text", "action": "text", "type": "type", "owner": "owner",
               "bug": "bug", "status": "status"}
    columns = {aliases[h]: i for i, h in reversed(list(enumerate(header))) if h in aliases}
    if "text" not in columns:
        raise ValidationError("action_items", "the table has no 'Action item' column")

    parsed: list[dict[str, str]] = []
    for row in rows[2:]:
        cells = _cells(row)
        parsed.append({k: (cells[i] if i < len(cells) else "") for k, i in columns.items()})
    used = [int(m.group(1)) for r in parsed if (m := _ID.fullmatch(r.get("id", "")))]
    next_id = max(used, default=0) + 1
    seen: set[str] = set()
    out: list[ActionItem] = []
    for n, r in enumerate(parsed):
        where = f"action_items[{n}]"
        item_id = r.get("id", "")
        if not item_id:
            item_id, next_id = f"AI-{next_id}", next_id + 1
        elif not _ID.fullmatch(item_id):
            raise ValidationError(f"{where}.id", f"must look like AI-<n>, not {item_id!r}")
        if item_id in seen:
            raise ValidationError(f"{where}.id", f"{item_id} appears twice")
        seen.add(item_id)
        if not r["text"]:
            raise ValidationError(f"{where}.text", "must not be empty")
        kind = r.get("type", "").lower() or "prevent"
        if kind not in _TYPES:
            raise ValidationError(f"{where}.type", f"must be one of {', '.join(_TYPES)}, not {kind!r}")
        word = r.get("status", "").lower()
        if word not in _STATUS_WORDS:
            raise ValidationError(f"{where}.status", f"must be open or done (or {', '.join(sorted(_STATUS_WORDS))}), "
                                                     f"not {word!r}")
        out.append(ActionItem(id=item_id, text=r["text"], type=_item_type(kind), owner=r.get("owner", ""),
                              bug=r.get("bug", ""), status=_STATUS_WORDS[word]))
    return out


def _item_type(kind: str) -> ItemType:
    if kind == "mitigate":
        return "mitigate"
    if kind == "process":
        return "process"
    return "prevent"


def with_items(postmortem: Postmortem, items: Sequence[ActionItem]) -> Postmortem:
    """``postmortem`` with its action items replaced (e.g. by those :func:`parse_action_items` read)."""
    return replace(postmortem, action_items=tuple(items))

