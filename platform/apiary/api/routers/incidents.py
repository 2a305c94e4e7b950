"""Incident routes (:mod:`apiary.response`).

* ``POST /api/v2/incidents``: open one by hand (admins, the Alertmanager token and whoever is on
  call now: :func:`responders`; the opener is the caller). Opening one pages people, so ordinary
  users and the bridge may not.
* ``GET /api/v2/incidents?state=&limit=``: newest first (admins; a user sees the incidents that
  name them or their jobs). ``GET /api/v2/incidents/{id}``: one, with its timeline, SLA deadlines
  and breaches, and its escalation.
* ``POST /api/v2/incidents/{id}/{event}`` with ``{"message", "verdict"}``: ``acknowledge``,
  ``mitigate``, ``resolve``, ``close``, ``reopen``, ``comment`` (admins: operators on call).
* ``POST /api/v2/incidents/{id}/actions`` with ``{"action", "node"}``: run a mitigation or its undo.
* ``GET|POST /api/v2/incidents/{id}/link/{action}?token=``: the signed link of a notification
  (no bearer token: the signature is the credential; GET only shows a confirmation page).
* ``GET|PUT /api/v2/incidents/{id}/postmortem``: the Markdown draft; PUT stores an edit and
  re-reads its action items. ``GET /api/v2/incidents/action-items?status=open``.
* ``POST /api/v2/incidents/events``: PagerDuty Events API v2 (drills, AIOps; admins and the
  Prefect service token).
* ``GET /api/v2/oncall?at=``: who is on call in each schedule, and each policy's tiers.
* ``GET /api/v2/incidents/quality?days=7``: the alert-quality report.

The actor of every change is the authenticated caller, never a field of the body.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse
from pydantic import ConfigDict, Field

from apiary.api.auth import Admin, AdminOrBridge, Caller, People
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, RequestBody
from apiary.auth import Principal
from apiary.errors import ForbiddenError, UnavailableError, ValidationError
from apiary.incidents import Incident, Links
from apiary.oncall import OncallConfig, on_call, resolve_targets
from apiary.response.service import IncidentService
from apiary.timefmt import iso

router = APIRouter(prefix="/api/v2", tags=["incidents"], responses=ERROR_RESPONSES)
_checked = [Depends(plain_text)]

Event = Literal["acknowledge", "mitigate", "resolve", "close", "reopen", "comment"]


async def get_incidents(request: Request) -> IncidentService:
    service = getattr(request.app.state, "incidents", None)
    if service is None:
        raise UnavailableError("Incident response is not running on this control plane.")
    return service


Incidents = Annotated[IncidentService, Depends(get_incidents)]


class OpenIncident(RequestBody):
    model_config = ConfigDict(extra="forbid")
    title: str = Field(min_length=1, max_length=500)
    severity: Literal["sev1", "sev2", "sev3", "sev4"] = "sev3"
    description: str = Field(default="", max_length=10_000)
    nodes: list[Annotated[str, Field(max_length=200)]] = Field(default=[], max_length=100)
    jobs: list[Annotated[str, Field(max_length=300)]] = Field(default=[], max_length=100)


class Act(RequestBody):
    model_config = ConfigDict(extra="forbid")
    message: str | None = Field(default=None, max_length=10_000)
    verdict: Literal["actionable", "noise"] | None = None


class Mitigation(RequestBody):
    model_config = ConfigDict(extra="forbid")
    action: str = Field(
        pattern=r"^(cordon-node|uncordon-node|drain-node|notify-owners|(un)?tag-jobs(:[A-Za-z0-9_.-]{1,50})?)$")
    node: str = Field(min_length=1, max_length=200)


class Postmortem(RequestBody):
    model_config = ConfigDict(extra="forbid")
    markdown: str = Field(min_length=1, max_length=200_000)


def _visible(incident: Incident, caller: Principal) -> bool:
    if caller.admin or caller.is_bridge:
        return True
    return caller.name in incident.links.users or any(j.startswith(f"{caller.name}~") for j in incident.links.jobs) \
        or incident.timeline[0].actor == caller.name


def responders(config: OncallConfig, at: datetime) -> set[str]:
    """The users on call at ``at`` (aware): whoever a schedule has on call, and every user a tier
    of an escalation policy would page (its user targets, and its schedules' on-call)."""
    schedules = config.schedule_map()
    users = {u for s in config.schedules if (u := on_call(s, at)) is not None}
    for policy in config.policies:
        for tier in policy.tiers:
            users.update(resolve_targets(tier, schedules, at))
    return users


async def require_responder(caller: Caller, service: Incidents) -> Principal:
    """Admins, the Alertmanager token, and users on call now (:func:`responders`, over the on-call
    file ``APIARY_ONCALL``); 403 for everyone else, the bridge and agents included."""
    if caller.admin or caller.is_alertmanager:
        return caller
    if caller.kind == "user" and caller.name in responders(service.config.oncall, datetime.now(UTC)):
        return caller
    raise ForbiddenError(f"Only admins, Alertmanager and whoever is on call may open incidents; "
                         f"you are {caller.describe()}.")


Responder = Annotated[Principal, Depends(require_responder)]


@router.post("/incidents", status_code=201, dependencies=_checked)
def open_incident(body: OpenIncident, service: Incidents, caller: Responder) -> dict:
    """Open an incident by hand (``apiary incident open``); it pages the on-call like any other.
    Admins, Alertmanager and whoever is on call now only."""
    users = tuple(j.split("~", 1)[0] for j in body.jobs if "~" in j)
    incident = service.open(body.title, body.severity, caller.name,
                            links=Links(nodes=tuple(body.nodes), jobs=tuple(body.jobs), users=users),
                            description=body.description)
    return service.view(incident)


@router.get("/incidents")
def list_incidents(service: Incidents, caller: People, state: str | None = Query(default=None, max_length=16),
                   limit: int = Query(default=50, ge=1, le=1000)) -> dict:
    """The newest incidents (a user sees only theirs)."""
    rows = [i for i in service.store.recent(limit=limit, state=state) if _visible(i, caller)]
    return {"incidents": [_summary(service, i) for i in rows]}


@router.get("/incidents/quality")
def quality(service: Incidents, _caller: Admin, days: float = Query(default=7.0, gt=0, le=366)) -> dict:
    """The alert-quality report over the last ``days`` (see :mod:`apiary.response.reports`)."""
    from apiary.response.reports import quality_report

    return quality_report(service, days)


@router.get("/incidents/action-items")
def action_items(service: Incidents, _caller: Admin, status: str | None = Query(default=None, max_length=16)) -> dict:
    """Postmortem action items of every incident, tracked until done."""
    return {"actionItems": service.store.action_items(status=status)}


@router.post("/incidents/events", status_code=202, dependencies=_checked)
async def events_v2(request: Request, service: Incidents, caller: AdminOrBridge) -> dict:
    """PagerDuty Events API v2 (``event_action``, ``dedup_key``, ``payload``); a trigger opens or
    joins an incident, like an alert."""
    try:
        body = await request.json()
    except ValueError as e:
        raise ValidationError("body", f"not valid JSON: {e}") from e
    result = service.ingest_event(body, actor=caller.name)
    return {"status": "success", "dedup_key": body.get("dedup_key"), **result}


@router.get("/incidents/{incident_id}")
def get_incident(incident_id: str, service: Incidents, caller: People) -> dict:
    incident = service.store.get(incident_id)
    if not _visible(incident, caller):
        raise ForbiddenError(f"Incident {incident_id} does not concern you; you are {caller.describe()}.")
    return {**service.view(incident), "notifications": service.store.notifications(incident_id)}


@router.post("/incidents/{incident_id}/actions", dependencies=_checked)
def run_action(incident_id: str, body: Mitigation, service: Incidents, caller: Admin) -> dict:
    """Run a mitigation or its undo by hand (recorded like the rules' own)."""
    service.store.get(incident_id)
    return service.mitigate(incident_id, body.action, body.node, actor=caller.name)


@router.get("/incidents/{incident_id}/postmortem")
def get_postmortem(incident_id: str, service: Incidents, _caller: Admin) -> dict:
    """``{"markdown", "actionItems"}``: the postmortem (404 before a Sev1/Sev2 resolves)."""
    markdown = service.store.row(incident_id)["postmortem"]
    if markdown is None:
        from apiary.errors import NotFoundError

        raise NotFoundError(f"Incident {incident_id} has no postmortem (drafted when a Sev1 or Sev2 resolves).")
    return {"markdown": markdown, "actionItems": service.store.action_items(incident_id)}


@router.put("/incidents/{incident_id}/postmortem", dependencies=_checked)
def put_postmortem(incident_id: str, body: Postmortem, service: Incidents, _caller: Admin) -> dict:
    return {"actionItems": service.set_postmortem(incident_id, body.markdown)}


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>{verb} incident {id}</title></head>
<body><h1>{verb} incident {id}</h1><p>{title}</p><p>State: {state}</p>
<form method="post" action="?token={token}"><button type="submit">{verb}</button></form>
</body></html>"""


# The signed links are pages for people's browsers, not API calls: left out of the OpenAPI document.
@router.get("/incidents/{incident_id}/link/{action}", response_class=HTMLResponse, include_in_schema=False)
def link_page(incident_id: str, action: Literal["acknowledge", "resolve"], service: Incidents,
              token: str = Query(max_length=2000)) -> str:
    """The page a signed link opens: nothing changes until its button is pressed."""
    service.signer.verify(incident_id, action, token)
    incident = service.store.get(incident_id)
    return _PAGE.format(verb=action.capitalize(), id=html.escape(incident.id), title=html.escape(incident.title),
                        state=incident.state.value, token=html.escape(token, quote=True))


@router.post("/incidents/{incident_id}/link/{action}", response_class=HTMLResponse, include_in_schema=False)
def link_act(incident_id: str, action: Literal["acknowledge", "resolve"], service: Incidents,
             token: str = Query(max_length=2000)) -> str:
    """Acknowledge or resolve as the recipient the link was signed for."""
    who = service.signer.verify(incident_id, action, token)
    incident = service.act(incident_id, action, f"{who} (signed link)")
    return f"<!doctype html><p>Incident {html.escape(incident.id)} is now {incident.state.value}.</p>"


@router.post("/incidents/{incident_id}/{event}", dependencies=_checked)
def act(incident_id: str, event: Event, service: Incidents, caller: Admin, body: Act | None = None) -> dict:
    """Acknowledge, mitigate, resolve, close, reopen or comment, as the caller."""
    body = body or Act()
    if event == "comment" and not body.message:
        raise ValidationError("message", "a comment needs a message")
    return service.view(service.act(incident_id, event, caller.name, message=body.message, verdict=body.verdict))


@router.get("/oncall")
def who_is_on_call(service: Incidents, _caller: People, at: datetime | None = None) -> dict:
    """Who is on call in each schedule at ``at`` (default now), and whom each policy's tiers page."""
    when = at or datetime.now(UTC)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    cfg = service.config.oncall
    return {
        "at": when.astimezone(UTC).isoformat(),
        "schedules": {s.name: on_call(s, when) for s in cfg.schedules},
        "policies": {p.name: [{"level": t.level, "users": resolve_targets(t, cfg.schedule_map(), when),
                               "delayS": t.delay.total_seconds()} for t in p.tiers] for p in cfg.policies},
        "defaultPolicy": service.config.incidents.policy,
    }


def _summary(service: IncidentService, i: Incident) -> dict[str, Any]:
    return {"id": i.id, "title": i.title, "severity": i.severity.value, "state": i.state.value,
            "openedAt": iso(i.opened_at), "updatedAt": iso(i.last_at), "nodes": list(i.links.nodes),
            "jobs": list(i.links.jobs)}
