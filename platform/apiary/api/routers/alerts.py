"""Alert routes: Alertmanager's webhook in, stored alerts and the actions they ran out."""

from __future__ import annotations

from fastapi import APIRouter, Query

from apiary.api.deps import Receiver
from apiary.api.schemas import ERROR_RESPONSES, AlertsPage, WebhookResult
from apiary.ops.alerts import AlertmanagerPayload

router = APIRouter(prefix="/api/v2/alerts", tags=["alerts"], responses=ERROR_RESPONSES)


@router.post("/webhook", response_model=WebhookResult)
def alert_webhook(payload: AlertmanagerPayload, receiver: Receiver, action: list[str] = Query(default=[])) -> dict:
    """Alertmanager's webhook (version 4). ``?action=cordon-node&action=email-admin`` runs those
    actions (a receiver per action, OpenPAI's style); without it the actions config decides."""
    return {"actions": receiver.receive(payload, action or None)}


@router.get("", response_model=AlertsPage)
def alerts(receiver: Receiver, limit: int = 100) -> dict:
    """The newest ``limit`` stored alerts and action runs."""
    return {"alerts": receiver.recent(limit), "actions": receiver.recent_actions(limit)}
