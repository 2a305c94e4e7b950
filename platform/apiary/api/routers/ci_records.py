"""CI/CD record routes: the pipeline flows report their runs and deployments here (:mod:`apiary.ci.records`).

A GitHub delivery, its pipeline run and its deployment are one CI record whose ``state`` advances
(``received`` .. ``started``, ``running``, ``passed`` / ``failed``, ``deployed`` / ``rolled_back`` /
``deploy_failed``); a report naming its ``delivery`` lands on that delivery's record.

* ``POST /api/v2/ci/runs``: one pipeline run, upserted on its ``delivery`` (when given) or its
  ``flowRunId`` (the flow posts ``running`` when it starts and its result when it ends): 201 when
  the record is new, 200 when it updated one.
* ``GET /api/v2/ci/runs?limit=&repo=&result=&kind=&sha=``: ``{"runs": [...]}``, newest first;
  ``sha`` matches a prefix, in the store (the deploy gate asks for its commit's passing run).
* ``GET /api/v2/ci/records?limit=&sha=&state=&delivery=``: ``{"records": [...]}``, whole records
  (delivery, run, deployment, state), newest first.
* ``POST /api/v2/deployments``: one production deployment (201; 200 when it landed on a record
  already there: its delivery's, or the one with its ``flowRunId``).
* ``GET /api/v2/deployments?limit=&sha=&result=``: ``{"deployments": [...]}``, newest first;
  ``sha`` matches a prefix (a short sha).

Writes are for admins and the Prefect service token (the flows run with it, or with an admin's),
as ``POST /api/v2/drills/results``; reads for admins. Times are ISO 8601 (UTC when no offset is
given; unix seconds are taken too) and answered as ISO 8601 UTC. Every field is bounded and every
string must be storable (:class:`~apiary.api.schemas.RequestBody`): a bad one is a 400 naming it.
The ``apiary_ci_*`` and ``apiary_deploy_*`` metrics are computed from these records at each scrape.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from apiary.api.auth import Admin, AdminOrBridge
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, INT32_MAX, MAX_UNIX_S, RequestBody
from apiary.ci import records
from apiary.ci.records import CiRecords
from apiary.errors import ValidationError

router = APIRouter(prefix="/api/v2", tags=["ci"], responses=ERROR_RESPONSES, dependencies=[Depends(plain_text)])

RunKind = Literal["pr", "deploy"]
RunResult = Literal["running", "success", "failure", "error"]
StageState = Literal["passed", "failed", "skipped", "error", "running"]
DeployTrigger = Literal["push", "rollback", "manual"]
DeployResult = Literal["succeeded", "rolled_back", "failed"]

_SHA = r"^[0-9a-fA-F]{7,64}$"
_REPO = r"^[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}$"
_FLOW_RUN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"
_COMPONENT = r"^[a-z0-9][a-z0-9-]{0,63}$"
_DELIVERY = r"^[A-Za-z0-9-]{1,64}$"  # GitHub's X-GitHub-Delivery, as the webhook route takes it


def _utc(value: datetime) -> datetime:
    """An ISO 8601 time in UTC (no offset: UTC already), within 1970 .. 9999 (unix seconds the store keeps)."""
    value = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if not 0 <= value.timestamp() <= MAX_UNIX_S:
        raise ValueError("must be between 1970-01-01T00:00:00Z and 9999-12-31T23:59:59Z")
    return value.astimezone(UTC)


def _unix(report: dict) -> dict:
    """``report`` (a model_dump) with its times as unix seconds, as :class:`CiRecords` takes them."""
    return {**report, **{k: report[k].timestamp() for k in ("startedAt", "finishedAt") if report.get(k) is not None}}


#: In: an ISO 8601 time (or unix seconds). Out: ISO 8601 UTC.
TimeIn = Annotated[datetime, AfterValidator(_utc)]
Seconds = Annotated[float, Field(ge=0, le=MAX_UNIX_S, allow_inf_nan=False, description="Seconds.")]


class CiStage(BaseModel):
    """One stage of a pipeline run, in order (lint, typecheck, unit, build, ...)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100)
    state: StageState
    durationS: Seconds | None = None
    summary: str = Field(default="", max_length=records.MAX_SUMMARY, description="One line: what passed or failed.")


class DeployStep(BaseModel):
    """One step of a deployment: a component rolled to an image, and the gate it had to pass."""

    model_config = ConfigDict(extra="forbid")

    component: str = Field(pattern=_COMPONENT, description="control-plane, agent, prefect, ...")
    image: str = Field(default="", max_length=records.MAX_IMAGE)
    gate: str = Field(default="", max_length=200, description="The check after the rollout (healthz, smoke job).")
    ok: bool
    detail: str = Field(default="", max_length=records.MAX_SUMMARY)
    durationS: Seconds | None = None


Images = Annotated[
    dict[Annotated[str, Field(pattern=_COMPONENT)], Annotated[str, Field(min_length=1, max_length=records.MAX_IMAGE)]],
    Field(min_length=1, max_length=records.MAX_IMAGES, description='{"control-plane": image, "agent": ..., '
                                                                    '"prefect": ...}')]


class _Timed(RequestBody):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _ends_after_start(self) -> _Timed:
        finished = getattr(self, "finishedAt", None)
        if finished is not None and finished < self.startedAt:  # type: ignore[attr-defined]
            raise ValidationError("finishedAt", "before startedAt")
        return self


class CiRunReport(_Timed):
    """One pipeline run as its flow reports it (``POST /api/v2/ci/runs``)."""

    flowRunId: str = Field(pattern=_FLOW_RUN, description="The Prefect flow run id: the run's key (upsert).")
    repo: str = Field(pattern=_REPO, description="owner/name on GitHub.")
    prNumber: int | None = Field(default=None, ge=1, le=INT32_MAX, description="The pull request (kind pr).")
    sha: str = Field(pattern=_SHA, description="The commit tested.")
    ref: str = Field(min_length=1, max_length=300, description="refs/heads/main, refs/pull/7/head, ...")
    kind: RunKind = Field(description="pr: a pull request's pipeline; deploy: the default branch's.")
    result: RunResult
    failedStage: str | None = Field(default=None, max_length=100)
    reason: str | None = Field(default=None, max_length=records.MAX_REASON)
    startedAt: TimeIn
    finishedAt: TimeIn | None = None
    durationS: Seconds | None = Field(default=None, description="Default: finishedAt - startedAt.")
    stages: list[CiStage] = Field(default=[], max_length=records.MAX_STAGES)
    targetUrl: str | None = Field(default=None, max_length=records.MAX_URL, pattern=r"^https?://\S+$",
                                  description="Where the run is shown (the Prefect UI's flow run page).")
    delivery: str | None = Field(default=None, pattern=_DELIVERY,
                                 description="The GitHub delivery that started the run: its record is updated.")


class DeploymentReport(_Timed):
    """One production deployment as the deploy flow reports it (``POST /api/v2/deployments``)."""

    sha: str = Field(pattern=_SHA)
    images: Images
    previousImages: Images | None = Field(default=None, description="What ran before; None on the first deployment.")
    actor: str = Field(min_length=1, max_length=200, description="Who or what started it (a GitHub login, prefect).")
    trigger: DeployTrigger
    startedAt: TimeIn
    finishedAt: TimeIn
    durationS: Seconds | None = Field(default=None, description="Default: finishedAt - startedAt.")
    result: DeployResult
    reason: str | None = Field(default=None, max_length=records.MAX_REASON)
    steps: list[DeployStep] = Field(default=[], max_length=records.MAX_STEPS)
    flowRunId: str | None = Field(default=None, pattern=_FLOW_RUN,
                                  description="The deploy flow run; a second report of it updates the first.")
    delivery: str | None = Field(default=None, pattern=_DELIVERY,
                                 description="The GitHub delivery that started the deploy: its record is updated.")


class CiRunJson(BaseModel):
    """A recorded pipeline run; times ISO 8601 UTC."""

    id: int
    flowRunId: str
    repo: str
    prNumber: int | None
    sha: str
    ref: str
    kind: RunKind
    result: RunResult
    failedStage: str | None
    reason: str | None
    startedAt: datetime
    finishedAt: datetime | None
    durationS: float | None
    stages: list[CiStage]
    targetUrl: str | None


class CiRunsPage(BaseModel):
    runs: list[CiRunJson] = Field(description="Newest first.")


class DeploymentJson(BaseModel):
    """A recorded deployment; times ISO 8601 UTC."""

    id: int
    sha: str
    images: dict[str, str]
    previousImages: dict[str, str] | None
    actor: str
    trigger: DeployTrigger
    startedAt: datetime
    finishedAt: datetime
    durationS: float
    result: DeployResult
    reason: str | None
    steps: list[DeployStep]
    flowRunId: str | None


class DeploymentsPage(BaseModel):
    deployments: list[DeploymentJson] = Field(description="Newest first.")


#: :data:`apiary.ci.records.STATES`, in the order a record advances.
RecordState = Literal["received", "pending", "not_started", "started", "running", "passed", "failed", "deployed",
                      "rolled_back", "deploy_failed"]


class CiDeliveryPart(BaseModel):
    """The GitHub delivery a CI record began with; ``flowRunId``: the flow run it started."""

    delivery: str
    event: str | None
    action: str | None
    receivedAt: datetime | None
    flowRunId: str | None
    reason: str


class CiRecordJson(BaseModel):
    """One CI record: a delivery, its pipeline run and its deployment, with the state it reached."""

    id: int
    state: RecordState
    kind: str = Field(description="pr, deploy, ping or ignored.")
    repo: str | None
    prNumber: int | None
    sha: str | None
    ref: str | None
    delivery: CiDeliveryPart | None = Field(description="None: the run or deployment was reported directly.")
    run: CiRunJson | None = Field(description="None: no pipeline run reported yet.")
    deployment: DeploymentJson | None = Field(description="None: not deployed.")


class CiRecordsPage(BaseModel):
    records: list[CiRecordJson] = Field(description="Newest first.")


async def get_records(request: Request) -> CiRecords:
    return CiRecords(request.app.state.plane.sessions)


Records = Annotated[CiRecords, Depends(get_records)]
Limit = Annotated[int, Query(ge=1, le=1000, description="At most this many, newest first.")]


@router.post("/ci/runs", status_code=201, response_model=CiRunJson,
             responses={200: {"model": CiRunJson, "description": "The run was recorded already: updated."}})
def record_run(body: CiRunReport, response: Response, ci: Records, _caller: AdminOrBridge) -> dict:
    """Record one pipeline run on its CI record (its ``delivery``'s, or the one with its
    ``flowRunId``): 201 when the record is new, 200 when updated. Admins and the Prefect service
    token only."""
    record, created = ci.record_run(_unix(body.model_dump()))
    response.status_code = 201 if created else 200
    return record


@router.get("/ci/runs", response_model=CiRunsPage)
def runs(
    ci: Records, _caller: AdminOrBridge, limit: Limit = 50,
    repo: Annotated[str | None, Query(max_length=200, description="Only this repository (owner/name).")] = None,
    result: Annotated[RunResult | None, Query(description="Only runs with this result.")] = None,
    kind: Annotated[RunKind | None, Query(description="pr or deploy (the default branch's).")] = None,
    sha: Annotated[str | None, Query(pattern=r"^[0-9a-fA-F]{0,64}$",
                                     description="Only commits starting with this (a short sha).")] = None,
) -> dict:
    """The newest pipeline runs, newest first. Admins, and the Prefect service token (the deploy
    gate asks for a passing run of the commit it deploys: ``?sha=<sha>&result=success&limit=1``)."""
    return {"runs": ci.runs(limit, repo=repo, result=result, kind=kind, sha=sha)}


@router.get("/ci/records", response_model=CiRecordsPage)
def ci_records(
    ci: Records, _caller: AdminOrBridge, limit: Limit = 50,
    sha: Annotated[str | None, Query(pattern=r"^[0-9a-fA-F]{0,64}$",
                                     description="Only commits starting with this (a short sha).")] = None,
    state: Annotated[RecordState | None, Query(description="Only records in this state.")] = None,
    delivery: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9-]{0,64}$",
                                          description="Only the record of this GitHub delivery.")] = None,
) -> dict:
    """The newest CI records, newest first: each delivery with its pipeline run and deployment
    and the state it reached (received, pending, not_started, started, running, passed, failed,
    deployed, rolled_back, deploy_failed). Admins and the Prefect service token."""
    return {"records": ci.records(limit, sha=sha, state=state, delivery=delivery)}


@router.post("/deployments", status_code=201, response_model=DeploymentJson,
             responses={200: {"model": DeploymentJson, "description": "Its flowRunId was recorded already: updated."}})
def record_deployment(body: DeploymentReport, response: Response, ci: Records, _caller: AdminOrBridge) -> dict:
    """Record one production deployment on its CI record (its ``delivery``'s, or the one with its
    ``flowRunId``: 200) or a new one (201); a second report of the same ``flowRunId`` updates it
    (200). Admins and the Prefect service token only."""
    record, created = ci.record_deployment(_unix(body.model_dump()))
    response.status_code = 201 if created else 200
    return record


@router.get("/deployments", response_model=DeploymentsPage)
def deployments(
    ci: Records, _caller: Admin, limit: Limit = 50,
    sha: Annotated[str | None, Query(pattern=r"^[0-9a-fA-F]{0,64}$",
                                     description="Only commits starting with this (a short sha).")] = None,
    result: Annotated[DeployResult | None, Query(description="Only deployments with this result.")] = None,
) -> dict:
    """The newest production deployments, newest first. Admins only."""
    return {"deployments": ci.deployments(limit, sha=sha, result=result)}
