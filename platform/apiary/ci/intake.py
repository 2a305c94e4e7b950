"""The webhook intake: record a delivery in the store first, start its pipeline in the background.

A delivery is the first part of a CI record (:class:`apiary.store.models.CiRecord`, see
:mod:`apiary.ci.records`): the pipeline run and the deployment it leads to are reported onto the
same record later. Every write goes through the store's unit of work.

1. :meth:`WebhookIntake.accept` (on the request's path, fast): classify the delivery and insert its
   record (``received``) with the SHA-256 of its body. A delivery id already there is a duplicate,
   and so is a body already there for the same event under another delivery id (GitHub's signature
   covers the body only, so a captured delivery could otherwise be replayed with a fresh id; a
   unique index on ``(event, body_sha256)`` decides, across restarts and between concurrent
   requests): nothing new is recorded or started. The row is committed before anything is
   started, so a crash after the answer loses nothing (the record stays ``received``).
2. :meth:`WebhookIntake.start_later` hands a pipeline request to one daemon thread, which calls the
   :class:`~apiary.ci.starter.PipelineStarter` and records the outcome: ``started`` with the flow
   run id, ``pending`` with the reason (no deployment yet; Prefect not reachable), or
   ``not_started`` (the start failed).

``GET /api/v2/ci/deliveries`` shows a record's delivery with the states it always had:
``accepted`` (received), ``pending``, ``failed`` (not started) and ``started`` (started, and every
state after it).

Not done yet: records left ``received`` or ``pending`` by a restart or an absent deployment are not
retried automatically (a later sweep can: the row holds everything the start needs).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from apiary.ci.records import clip
from apiary.ci.starter import Pending, PipelineStarter, StartLater
from apiary.ci.webhooks import Classified, Ping, PipelineRequest, classify
from apiary.errors import ConflictError
from apiary.store.models import CiRecord
from apiary.store.unit import Sessions, UnitOfWork, reading

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accepted:
    """The intake's answer: the delivery, what it asks for, whether it was already recorded."""

    delivery: str
    event: str
    kind: str
    duplicate: bool
    reason: str
    request: PipelineRequest | None


#: A record's state as ``GET /api/v2/ci/deliveries`` shows it (any later state: ``started``).
DELIVERY_STATE = {"received": "accepted", "pending": "pending", "not_started": "failed"}
#: The states a start outcome may replace (a pipeline that already reported is further along).
_BEFORE_START = ("received", "pending", "not_started")


class WebhookIntake:
    """Records GitHub deliveries in ``sessions``' store and starts their pipelines with ``starter``.

    ``secret`` is the webhook secret (``APIARY_GITHUB_WEBHOOK_SECRET``); None or empty: the intake
    is not configured and the route accepts nothing. ``clock`` gives unix seconds."""

    def __init__(self, sessions: Sessions, starter: PipelineStarter, secret: str | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.sessions = sessions
        self.starter = starter
        self.secret = secret.encode("utf-8") if secret else b""
        self.clock = clock
        self._queue: queue.Queue[tuple[str, PipelineRequest]] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def configured(self) -> bool:
        return bool(self.secret)

    def accept(self, event: str, delivery: str, payload: dict[str, Any], body_sha256: str) -> Accepted:
        """Classify and record one delivery (commits); ``body_sha256`` is
        :func:`~apiary.ci.webhooks.body_sha256` of its raw body. ``duplicate`` (nothing recorded,
        ``request`` None) when ``delivery`` is already recorded, or a delivery of the same
        ``event`` with the same body is (its reason names that delivery)."""
        what: Classified = classify(event, payload)
        request = what if isinstance(what, PipelineRequest) else None
        reason = getattr(what, "reason", "") if not isinstance(what, Ping) else "pong"
        row = CiRecord(
            delivery=delivery, event=event, action=clip(payload.get("action"), 64), repo=clip(what.repo, 200),
            pr_number=request.pr_number if request else None, sha=clip(request.sha, 64) if request else None,
            ref=clip(request.ref, 300) if request else None, kind=what.kind, state="received",
            delivery_reason=clip(reason, 2000) or "", received_at=self.clock(), body_sha256=body_sha256, stages=[],
        )
        try:
            with UnitOfWork(self.sessions, "record the GitHub delivery") as uow:
                uow.s.add(row)
        except ConflictError:
            with reading(self.sessions, "read the GitHub deliveries") as s:
                if s.scalars(select(CiRecord.id).where(CiRecord.delivery == delivery)).first() is not None:
                    logger.info("ci delivery duplicate: delivery=%s event=%s", delivery, event)
                    return Accepted(delivery, event, what.kind, True, "already received", None)
                first = s.scalars(select(CiRecord.delivery).where(
                    CiRecord.event == event, CiRecord.body_sha256 == body_sha256).limit(1)).first()
            if first is None:
                raise  # neither the delivery id nor the body: a real failure
            logger.warning("ci delivery replayed: delivery=%s event=%s has the body of delivery=%s",
                           delivery, event, first)
            return Accepted(delivery, event, what.kind, True, f"already received: the same body as delivery {first}",
                            None)
        logger.info("ci delivery accepted: delivery=%s event=%s kind=%s repo=%s", delivery, event, what.kind, what.repo)
        return Accepted(delivery, event, what.kind, False, reason, request)

    def start_later(self, delivery: str, request: PipelineRequest) -> None:
        """Queue the start of ``request``'s pipeline; returns at once."""
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name="apiary-ci-starter", daemon=True)
                self._worker.start()
        self._queue.put((delivery, request))

    def _run(self) -> None:
        while True:
            delivery, request = self._queue.get()
            try:
                self.start(delivery, request)
            except Exception:  # the worker must outlive one bad start; start() records what it can
                logger.exception("ci start failed unrecorded: delivery=%s", delivery)

    def start(self, delivery: str, request: PipelineRequest) -> None:
        """Start ``request``'s pipeline now (blocking) and record the outcome on its record: the
        started flow run always, the state only while the pipeline has not reported yet."""
        try:
            outcome = self.starter.start(delivery, request)
        except StartLater as exc:
            state, flow_run_id, reason = "pending", None, exc.message
        except Exception as exc:
            state, flow_run_id, reason = "not_started", None, f"{type(exc).__name__}: {exc}"
        else:
            if isinstance(outcome, Pending):
                state, flow_run_id, reason = "pending", None, outcome.reason
            else:
                state, flow_run_id, reason = "started", outcome.flow_run_id, ""
        logger.info("ci start: delivery=%s kind=%s state=%s flow_run=%s reason=%s",
                    delivery, request.kind, state, flow_run_id, reason)
        with UnitOfWork(self.sessions, "record the pipeline start") as uow:
            row = uow.s.scalars(select(CiRecord).where(CiRecord.delivery == delivery)).first()
            if row is not None:
                row.started_flow_run_id, row.delivery_reason = flow_run_id, clip(reason, 2000) or ""
                if row.state in _BEFORE_START:
                    row.state = state

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest ``limit`` deliveries, newest first (``state``: :data:`DELIVERY_STATE`;
        ``record``: the CI record's own state)."""
        with reading(self.sessions, "read the GitHub deliveries") as s:
            rows = s.scalars(select(CiRecord).where(CiRecord.delivery.is_not(None))
                             .order_by(CiRecord.received_at.desc(), CiRecord.id.desc()).limit(limit)).all()
            return [
                {"delivery": r.delivery, "event": r.event or "", "action": r.action, "repo": r.repo,
                 "prNumber": r.pr_number, "sha": r.sha, "ref": r.ref, "kind": r.kind,
                 "state": DELIVERY_STATE.get(r.state, "started"), "record": r.state,
                 "flowRunId": r.started_flow_run_id, "reason": r.delivery_reason,
                 "receivedAt": r.received_at or 0.0}
                for r in rows
            ]
