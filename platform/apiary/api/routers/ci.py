"""CI routes: GitHub's webhook deliveries in (:mod:`apiary.ci`), the recorded deliveries out.

``POST /api/v2/ci/webhooks/github`` carries no bearer token (GitHub cannot send one): the HMAC
signature is its credential. In order: 401 when the intake has no secret
(``APIARY_GITHUB_WEBHOOK_SECRET`` unset: no delivery is ever accepted unsigned), 401 for a missing
or wrong ``X-Hub-Signature-256``; only then 400 for a missing or malformed ``X-GitHub-Event`` or
``X-GitHub-Delivery``, a body that is not a JSON object (the webhook's content type must be
``application/json``) or nests deeper than :data:`~apiary.ci.webhooks.MAX_JSON_DEPTH` levels, and
a ``push``, ``pull_request`` or ``ping`` body without that event's fields (the signature does not
cover the event header: :func:`~apiary.ci.webhooks.shape_mismatch`). A signed delivery is recorded
and answered 202 at once; its pipeline is started in the intake's background thread. A delivery
id already recorded, or a body already recorded for the same event under another delivery id (a
replay: GitHub's redeliveries keep their id), answers 202 ``duplicate`` and starts nothing.
Bodies are capped at ``APIARY_MAX_BODY_BYTES`` (1 MiB by default, 413 above) like every route's:
GitHub caps payloads at 25 MB, but pull-request and push payloads are tens of KiB (a push lists
at most 20 commits); raise the cap if a repository needs it.
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from starlette.concurrency import run_in_threadpool

from apiary.api.auth import Admin
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, CiDeliveriesPage, CiWebhookAccepted
from apiary.ci.intake import WebhookIntake
from apiary.ci.webhooks import PayloadError, body_sha256, parse_payload, shape_mismatch, verify_signature
from apiary.errors import UnauthorizedError, ValidationError

router = APIRouter(prefix="/api/v2/ci", tags=["ci"], responses=ERROR_RESPONSES)

_EVENT = re.compile(r"[a-z_]{1,64}")
_DELIVERY = re.compile(r"[A-Za-z0-9-]{1,64}")  # GitHub's is a GUID
_JSON_BODY = {"requestBody": {
    "required": True, "description": "GitHub's webhook payload (content type application/json).",
    "content": {"application/json": {"schema": {"type": "object"}}},
}}


async def get_intake(request: Request) -> WebhookIntake:
    return request.app.state.ci


Intake = Annotated[WebhookIntake, Depends(get_intake)]


@router.post("/webhooks/github", status_code=202, response_model=CiWebhookAccepted, openapi_extra=_JSON_BODY)
async def github_webhook(
    request: Request, intake: Intake,
    x_hub_signature_256: Annotated[str | None, Header(description="sha256=<HMAC-SHA256 hex of the body>")] = None,
    x_github_event: Annotated[str | None, Header(description="The event: pull_request, push, ping, ...")] = None,
    x_github_delivery: Annotated[str | None, Header(description="The delivery's GUID.")] = None,
) -> dict:
    """GitHub's webhook, authenticated by its ``X-Hub-Signature-256`` (no bearer token). A pull
    request opened, synchronized, reopened or ready for review asks for a CI run, a push to the
    default branch for a deploy, ``ping`` is answered; anything else is recorded as ignored. A
    delivery id already received, or a body already received for the same event, answers
    ``duplicate`` and starts nothing. Answers 202 before the pipeline starts."""
    if not intake.configured:
        raise UnauthorizedError("The GitHub webhook intake is not configured (APIARY_GITHUB_WEBHOOK_SECRET is "
                                "unset): it accepts no deliveries.")
    body = await request.body()
    if not x_hub_signature_256:
        raise UnauthorizedError("X-Hub-Signature-256: missing; set the webhook's secret on GitHub.")
    if not verify_signature(intake.secret, body, x_hub_signature_256):
        raise UnauthorizedError("X-Hub-Signature-256: not the HMAC-SHA256 of this body with the webhook secret.")
    if not x_github_event or not _EVENT.fullmatch(x_github_event):
        raise ValidationError("X-GitHub-Event", "missing or not an event name")
    if not x_github_delivery or not _DELIVERY.fullmatch(x_github_delivery):
        raise ValidationError("X-GitHub-Delivery", "missing or not a delivery id (letters, digits, '-'; at most 64)")
    try:
        payload = parse_payload(body)
    except PayloadError as exc:
        raise ValidationError(exc.field, exc.reason) from exc
    wrong = shape_mismatch(x_github_event, payload)
    if wrong is not None:
        raise ValidationError("X-GitHub-Event", f"{x_github_event!r}, but the body is not a {x_github_event} "
                                                f"payload: {wrong} missing or of another type")
    accepted = await run_in_threadpool(intake.accept, x_github_event, x_github_delivery, payload, body_sha256(body))
    if accepted.request is not None and not accepted.duplicate:
        intake.start_later(accepted.delivery, accepted.request)
    return {"delivery": accepted.delivery, "event": accepted.event, "kind": accepted.kind, "accepted": True,
            "duplicate": accepted.duplicate, "reason": accepted.reason}


@router.get("/deliveries", response_model=CiDeliveriesPage, dependencies=[Depends(plain_text)])
def deliveries(intake: Intake, _caller: Admin, limit: int = Query(default=100, ge=1, le=1000)) -> dict:
    """The newest ``limit`` GitHub deliveries and how far their pipelines got. Admins only."""
    return {"deliveries": intake.recent(limit)}
