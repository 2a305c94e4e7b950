"""The alert log: received Alertmanager alerts and the runs of their actions, in the store.

Two tables (:class:`~apiary.store.models.Alert`, :class:`~apiary.store.models.AlertAction`),
written only through :class:`~apiary.store.unit.UnitOfWork`. An action run is unique per
(alert fingerprint, startsAt, action, target): :meth:`AlertLog.claim_alert_action` commits the
claim before the action runs, so an Alertmanager resend (or a second replica of the receiver)
finds it and runs nothing; a run that failed may be claimed again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from apiary.errors import ConflictError
from apiary.store.models import Alert, AlertAction
from apiary.store.unit import Sessions, UnitOfWork, reading


class AlertLog:
    """Stores alerts and alert-action runs. ``sessions``: the store's session factory; ``clock``:
    seconds since the epoch (``time.time``), the ``received`` / ``time`` columns.

    Store failures raise :class:`~apiary.errors.UnavailableError` (503) as the unit of work does.
    Thread-safe: claims are serialised in-process, and the table's unique key settles a race
    between processes (the loser's claim returns False).
    """

    def __init__(self, sessions: Sessions, clock: Callable[[], float] = time.time) -> None:
        self._sessions = sessions
        self._clock = clock
        self._lock = threading.Lock()

    def record_alert(self, **fields: Any) -> Alert:
        """Store one received alert (the :class:`~apiary.store.models.Alert` columns as keywords);
        returns the committed row (detached, its columns loaded)."""
        with UnitOfWork(self._sessions, "record alert") as uow:
            row = Alert(**fields)
            uow.s.add(row)
        return row

    def claim_alert_action(self, *, fingerprint: str, starts_at: str, alertname: str, action: str,
                           target: str) -> bool:
        """Claim the run of ``action`` on ``target`` for one firing alert: True if the caller should
        run it (first time, or the earlier run failed; the claim is committed as ``running``),
        False if it already ran or is running."""
        key = {"fingerprint": fingerprint, "starts_at": starts_at, "action": action, "target": target}
        with self._lock:
            try:
                with UnitOfWork(self._sessions, "claim alert action") as uow:
                    existing = uow.s.scalars(select(AlertAction).filter_by(**key)).first()
                    if existing is not None:
                        if existing.status != "failed":
                            return False
                        existing.status, existing.time = "running", self._clock()
                    else:
                        uow.s.add(AlertAction(alertname=alertname, status="running", detail="",
                                              time=self._clock(), **key))
            except ConflictError:  # another process claimed it between our read and our insert
                return False
        return True

    def finish_alert_action(self, *, fingerprint: str, starts_at: str, action: str, target: str, status: str,
                            detail: str) -> None:
        """Record the outcome (``ok`` / ``failed``) of a claimed alert action. Raises
        sqlalchemy's NoResultFound when it was never claimed (a programming error)."""
        with self._lock, UnitOfWork(self._sessions, "finish alert action") as uow:
            row = uow.s.scalars(select(AlertAction).filter_by(
                fingerprint=fingerprint, starts_at=starts_at, action=action, target=target)).one()
            row.status, row.detail, row.time = status, detail, self._clock()

    def recent_alerts(self, limit: int = 100) -> list[dict]:
        """Newest stored alerts first: ``{alertname, status, severity, labels, annotations,
        startsAt, fingerprint}``."""
        with reading(self._sessions, "read alerts") as s:
            rows = s.scalars(select(Alert).order_by(Alert.id.desc()).limit(limit))
            return [{"alertname": r.alertname, "status": r.status, "severity": r.severity, "labels": r.labels,
                     "annotations": r.annotations, "startsAt": r.starts_at, "fingerprint": r.fingerprint}
                    for r in rows]

    def recent_alert_actions(self, limit: int = 100) -> list[dict]:
        """Newest alert action runs first: ``{alertname, action, target, status, detail, time}``
        (``time`` in epoch seconds)."""
        with reading(self._sessions, "read alert actions") as s:
            rows = s.scalars(select(AlertAction).order_by(AlertAction.id.desc()).limit(limit))
            return [{"alertname": r.alertname, "action": r.action, "target": r.target, "status": r.status,
                     "detail": r.detail, "time": r.time} for r in rows]
