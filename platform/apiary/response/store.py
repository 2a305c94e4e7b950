"""Incidents in the store: the truth for :mod:`apiary.response` (nothing is cached in memory).

An incident is a row of ``incidents`` plus its append-only ``incident_entries``; the pure
:class:`apiary.incidents.Incident` is rebuilt from them on every read, and a change is written as
the entries the pure machine appended (never an update of an old entry) plus the row's new
state, links and fingerprints, in one transaction. ``escalations`` holds each incident's
durable escalation deadline; ``incident_notifications`` every delivery attempt;
``incident_action_items`` the postmortems' action items.

Every method is one short transaction and blocks: writes go through the store's
:class:`~apiary.store.unit.UnitOfWork`, reads through :func:`~apiary.store.unit.reading`, so a
store failure is a 503 (:class:`~apiary.errors.UnavailableError`) or a 409 (a unique-key clash),
never half a change. :meth:`IncidentStore.change` serialises read-modify-write cycles of one
process with a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from apiary.errors import NoIncidentError
from apiary.incidents import Incident, IncidentState, Links, TimelineEntry
from apiary.store.models import ActionItem, Escalation, IncidentEntry, IncidentRow, Notification
from apiary.store.unit import Sessions, UnitOfWork, reading
from apiary.timefmt import iso

#: Longest title and actor stored (the columns' sizes).
MAX_TITLE = 500
MAX_ACTOR = 200


def _links_json(links: Links) -> dict[str, Any]:
    return {"nodes": list(links.nodes), "jobs": list(links.jobs), "users": list(links.users),
            "virtualClusters": list(links.virtual_clusters), "gpuHoursLost": links.gpu_hours_lost}


def _links(data: dict[str, Any] | None) -> Links:
    data = data or {}
    return Links(nodes=tuple(data.get("nodes", ())), jobs=tuple(data.get("jobs", ())),
                 users=tuple(data.get("users", ())), virtual_clusters=tuple(data.get("virtualClusters", ())),
                 gpu_hours_lost=float(data.get("gpuHoursLost", 0.0)))


def _entry(e: IncidentEntry) -> TimelineEntry:
    return TimelineEntry.model_validate({"at": e.at, "actor": e.actor, "kind": e.kind, "event": e.event,
                                         "from_state": e.from_state, "to_state": e.to_state,
                                         "detail": dict(e.detail or {})})


def entry_json(e: TimelineEntry) -> dict[str, Any]:
    """One timeline entry in the wire shape (``at`` ISO 8601 UTC)."""
    return {"at": iso(e.at), "actor": e.actor, "kind": e.kind.value, "event": e.event,
            "fromState": e.from_state.value if e.from_state else None, "toState": e.to_state.value,
            "detail": e.detail}


class IncidentStore:
    """Incidents, escalations, notifications and action items in ``sessions``' store."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self.lock = threading.RLock()

    @contextmanager
    def _unit(self, what: str) -> Iterator[UnitOfWork]:
        """The lock, then one unit of work; the store's failures (its reads included) raised as
        ConflictError (409) / UnavailableError (503) naming ``what``."""
        what = f"incident store: {what}"
        with self.lock, UnitOfWork(self.sessions, what) as uow:
            yield uow

    # ------------------------------------------------------------------ incidents
    def _load(self, s: Session, row: IncidentRow, entries: list[IncidentEntry] | None = None) -> Incident:
        if entries is None:
            entries = list(s.scalars(select(IncidentEntry).where(IncidentEntry.incident_id == row.id)
                                     .order_by(IncidentEntry.seq)).all())
        return Incident(id=str(row.id), title=row.title, severity=row.severity,
                        dedup_key=row.dedup_key, state=row.state, opened_at=row.opened_at,
                        links=_links(row.links), fingerprints=tuple(row.fingerprints or ()),
                        timeline=tuple(_entry(e) for e in entries))

    def get(self, incident_id: str | int) -> Incident:
        """The incident; raises NoIncidentError (a NotFoundError, 404)."""
        with reading(self.sessions, "incident store: get") as s:
            row = s.get(IncidentRow, _id(incident_id))
            if row is None:
                raise NoIncidentError(f"Incident {incident_id} not found.")
            return self._load(s, row)

    def row(self, incident_id: str | int) -> dict[str, Any]:
        """``{"policy", "verdict", "postmortem"}`` of the incident (what the pure model does not hold)."""
        with reading(self.sessions, "incident store: row") as s:
            row = s.get(IncidentRow, _id(incident_id))
            if row is None:
                raise NoIncidentError(f"Incident {incident_id} not found.")
            return {"policy": row.policy, "verdict": row.verdict, "postmortem": row.postmortem}

    def create(self, build: Callable[[str], Incident], policy: str | None) -> Incident:
        """Insert the incident ``build(id)`` returns (the id is the new row's); returns it."""
        with self._unit("create") as uow:
            s = uow.s
            row = IncidentRow(title="", severity="sev4", dedup_key="", state="triggered", opened_at=0.0,
                              updated_at=0.0, policy=policy, links={}, fingerprints=[])
            s.add(row)
            uow.flush()
            incident = build(str(row.id))
            self._write(s, row, incident, 0)
            return incident

    @contextmanager
    def change(self, incident_id: str | int) -> Iterator[list[Incident]]:
        """Read-modify-write: yields ``[incident]``; put the changed incident back in the list (the
        machine's :func:`~apiary.incidents.apply` result). Its new entries and state are committed
        when the block ends without an exception; old entries are never rewritten."""
        with self._unit("change") as uow:
            s = uow.s
            row = s.get(IncidentRow, _id(incident_id))
            if row is None:
                raise NoIncidentError(f"Incident {incident_id} not found.")
            before = self._load(s, row)
            box = [before]
            yield box
            after = box[0]
            if after.timeline[:len(before.timeline)] != before.timeline:
                raise AssertionError("an incident's timeline is append-only")
            self._write(s, row, after, len(before.timeline))

    def _write(self, s: Session, row: IncidentRow, incident: Incident, known: int) -> None:
        row.title = incident.title[:MAX_TITLE]
        row.severity = incident.severity.value
        row.dedup_key = incident.dedup_key
        row.state = incident.state.value
        row.opened_at = incident.opened_at
        row.updated_at = incident.last_at
        row.links = _links_json(incident.links)
        row.fingerprints = list(incident.fingerprints)
        for seq, e in enumerate(incident.timeline[known:], start=known):
            s.add(IncidentEntry(incident_id=row.id, seq=seq, at=e.at, actor=e.actor[:MAX_ACTOR], kind=e.kind.value,
                                event=e.event, from_state=e.from_state.value if e.from_state else None,
                                to_state=e.to_state.value, detail=e.detail))

    def set_fields(self, incident_id: str | int, **fields: Any) -> None:
        """Set ``verdict``, ``postmortem`` or ``policy`` of the incident's row."""
        with self._unit("set fields") as uow:
            s = uow.s
            row = s.get(IncidentRow, _id(incident_id))
            if row is None:
                raise NoIncidentError(f"Incident {incident_id} not found.")
            for name, value in fields.items():
                setattr(row, name, value)

    def _load_many(self, s: Session, rows: Iterable[IncidentRow]) -> list[Incident]:
        """The incidents of ``rows``, their entries read in a few queries (not one per incident)."""
        rows = list(rows)
        by_id: dict[int, list[IncidentEntry]] = {r.id: [] for r in rows}
        ids = list(by_id)
        for i in range(0, len(ids), 500):  # well under any database's bound-parameter limit
            for e in s.scalars(select(IncidentEntry).where(IncidentEntry.incident_id.in_(ids[i:i + 500]))
                               .order_by(IncidentEntry.incident_id, IncidentEntry.seq)):
                by_id[e.incident_id].append(e)
        return [self._load(s, r, by_id[r.id]) for r in rows]

    def candidates(self, since: float) -> list[Incident]:
        """Open incidents, and those resolved since ``since`` (the reopen window's start)."""
        open_states = [s.value for s in IncidentState.open_states()]
        with reading(self.sessions, "incident store: candidates") as s:
            rows = s.scalars(select(IncidentRow).where(
                (IncidentRow.state.in_(open_states))
                | ((IncidentRow.state == IncidentState.RESOLVED.value) & (IncidentRow.updated_at >= since)))).all()
            return self._load_many(s, rows)

    def recent(self, limit: int = 50, state: str | None = None, since: float | None = None) -> list[Incident]:
        """The newest ``limit`` incidents (by id), optionally in ``state`` / opened since ``since``."""
        query = select(IncidentRow)
        if state:
            query = query.where(IncidentRow.state == state)
        if since is not None:
            query = query.where(IncidentRow.opened_at >= since)
        with reading(self.sessions, "incident store: recent") as s:
            rows = s.scalars(query.order_by(IncidentRow.id.desc()).limit(limit)).all()
            return self._load_many(s, rows)

    def verdicts(self, ids: Iterable[str]) -> dict[str, str | None]:
        with reading(self.sessions, "incident store: verdicts") as s:
            rows = s.execute(select(IncidentRow.id, IncidentRow.verdict)
                             .where(IncidentRow.id.in_([_id(i) for i in ids]))).all()
            return {str(i): v for i, v in rows}

    # ------------------------------------------------------------------ escalations
    def set_escalation(self, incident_id: str | int, *, policy: str, started_at: float,
                       acknowledged_at: float | None, next_at: float | None) -> None:
        """Create or replace the incident's escalation (a reopen or retrigger starts a new plan)."""
        with self._unit("set escalation") as uow:
            s = uow.s
            row = s.get(Escalation, _id(incident_id))
            if row is None:
                row = Escalation(incident_id=_id(incident_id), pages_sent=0)
                s.add(row)
            row.policy, row.started_at, row.acknowledged_at, row.next_at = policy, started_at, acknowledged_at, next_at

    def escalation(self, incident_id: str | int) -> dict[str, Any] | None:
        with reading(self.sessions, "incident store: escalation") as s:
            row = s.get(Escalation, _id(incident_id))
            if row is None:
                return None
            return {"policy": row.policy, "startedAt": row.started_at, "acknowledgedAt": row.acknowledged_at,
                    "nextAt": row.next_at, "pagesSent": row.pages_sent}

    def due(self, now: float, limit: int = 100) -> list[tuple[str, float]]:
        """``(incident_id, next_at)`` of the escalations due at ``now``, oldest deadline first."""
        with reading(self.sessions, "incident store: due") as s:
            rows = s.execute(select(Escalation.incident_id, Escalation.next_at)
                             .where(Escalation.next_at.is_not(None), Escalation.next_at <= now)
                             .order_by(Escalation.next_at).limit(limit)).all()
            return [(str(i), float(t)) for i, t in rows]

    def next_deadline(self) -> float | None:
        with reading(self.sessions, "incident store: next deadline") as s:
            return s.scalar(select(func.min(Escalation.next_at)).where(Escalation.next_at.is_not(None)))

    def advance(self, incident_id: str | int, sent_at: float, next_at: float | None) -> None:
        """Record a page sent for the deadline ``sent_at`` and store the next one (None: done).
        Only if the stored deadline is still ``sent_at`` (an acknowledgement in between wins)."""
        with self._unit("advance") as uow:
            s = uow.s
            row = s.get(Escalation, _id(incident_id))
            if row is None or row.next_at is None or abs(row.next_at - sent_at) > 1e-6:
                return
            row.next_at = next_at
            row.pages_sent = (row.pages_sent or 0) + 1

    # ------------------------------------------------------------------ notifications
    def record_notification(self, incident_id: str | int, *, at: float, channel: str, recipient: str,
                            attempt: int, ok: bool, detail: str) -> None:
        with self._unit("record notification") as uow:
            s = uow.s
            s.add(Notification(incident_id=_id(incident_id), at=at, channel=channel[:32], recipient=recipient[:200],
                               attempt=attempt, ok=ok, detail=detail[:4000]))

    def notifications(self, incident_id: str | int) -> list[dict[str, Any]]:
        with reading(self.sessions, "incident store: notifications") as s:
            rows = s.scalars(select(Notification).where(Notification.incident_id == _id(incident_id))
                             .order_by(Notification.id)).all()
            return [{"at": iso(n.at), "channel": n.channel, "recipient": n.recipient, "attempt": n.attempt,
                     "ok": n.ok, "detail": n.detail} for n in rows]

    def notification_counts(self) -> dict[tuple[str, str], int]:
        """``{(channel, "ok" | "failed"): attempts}`` over all incidents (for ``/metrics``)."""
        with reading(self.sessions, "incident store: notification counts") as s:
            rows = s.execute(select(Notification.channel, Notification.ok, func.count())
                             .group_by(Notification.channel, Notification.ok)).all()
            return {(c, "ok" if ok else "failed"): int(n) for c, ok, n in rows}

    # ------------------------------------------------------------------ action items
    def set_action_items(self, incident_id: str | int, items: Iterable[dict[str, Any]]) -> None:
        """Replace the incident's action items with ``items`` (``{"key", "text", "owner", "status"}``)."""
        with self._unit("set action items") as uow:
            s = uow.s
            for old in s.scalars(select(ActionItem).where(ActionItem.incident_id == _id(incident_id))).all():
                s.delete(old)
            uow.flush()
            for item in items:
                s.add(ActionItem(incident_id=_id(incident_id), key=str(item["key"])[:32], text=str(item["text"]),
                                 owner=item.get("owner"), status=str(item.get("status") or "open")[:16]))

    def action_items(self, incident_id: str | int | None = None, status: str | None = None) -> list[dict[str, Any]]:
        query = select(ActionItem)
        if incident_id is not None:
            query = query.where(ActionItem.incident_id == _id(incident_id))
        if status:
            query = query.where(ActionItem.status == status)
        with reading(self.sessions, "incident store: action items") as s:
            return [{"incident": str(a.incident_id), "key": a.key, "text": a.text, "owner": a.owner,
                     "status": a.status} for a in s.scalars(query.order_by(ActionItem.id)).all()]


def _id(incident_id: str | int) -> int:
    try:
        return int(str(incident_id).removeprefix("INC-").removeprefix("inc-"))
    except ValueError:
        raise NoIncidentError(f"Incident {incident_id} not found.") from None
