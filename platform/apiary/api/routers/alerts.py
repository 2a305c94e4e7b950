"""Alert routes: Alertmanager's webhook in, stored alerts and the actions they ran out."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from apiary.api.auth import Admin, Caller
from apiary.api.deps import Receiver
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, AlertsPage, RequestBody, WebhookResult
from apiary.errors import ForbiddenError
from apiary.ops.alerts import AlertmanagerPayload

router = APIRouter(prefix="/api/v2/alerts", tags=["alerts"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])


class AlertmanagerWebhook(AlertmanagerPayload, RequestBody):
    """Alertmanager's payload (version 4) whose strings are all storable text (labels included)."""


@router.post("/webhook", response_model=WebhookResult)
def alert_webhook(
    payload: AlertmanagerWebhook, receiver: Receiver, caller: Caller,
    action: list[str] = Query(default=[], max_length=20),
) -> dict:
    """Alertmanager's webhook (version 4), with the Alertmanager service token (or an admin's).
    The group goes through the one intake: stored, handed to incidents (open, join, resolve) and
    its actions run once each. ``?action=cordon-node&action=email-admin`` selects those actions
    (a receiver per action, OpenPAI's style; admins only); without it the actions config decides."""
    if not (caller.is_alertmanager or caller.admin):
        raise ForbiddenError(f"Only Alertmanager and admins may post alerts; you are {caller.describe()}.")
    if action and not caller.admin:
        raise ForbiddenError("Only admins may choose the actions (?action=); Alertmanager's run the actions config.")
    return {"actions": receiver.receive(payload, action or None)}


@router.get("", response_model=AlertsPage)
def alerts(receiver: Receiver, _caller: Admin, limit: int = Query(default=100, ge=1, le=5000)) -> dict:
    """The newest ``limit`` stored alerts and action runs. Admins only."""
    return {"alerts": receiver.recent(limit), "actions": receiver.recent_actions(limit)}
