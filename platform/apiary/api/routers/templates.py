"""Job template routes (the marketplace, :mod:`apiary.marketplace.templates`), under ``/api/v2/templates``.

* ``GET /templates?q=&tag=``: the templates the caller sees (users: by visibility; the bridge: all);
  ``q`` searches name, summary and tags, ``tag`` is one tag exactly;
* ``POST /templates``: publish (any user; ``official`` admins only); ``GET /templates/{name}``;
  ``PUT /templates/{name}``, ``DELETE /templates/{name}``: its owner and admins;
* ``POST /templates/{name}/runs``: render it with ``{"parameters": {...}, "name": ..., "virtualCluster": ...}``
  and submit the job as the caller, exactly as ``POST /api/v2/jobs`` would (the bridge with
  ``X-Apiary-On-Behalf-Of`` and ``X-Apiary-Flow-Run-Id``, as there): 202 and the job's JSON.

A template the caller may not see is a 404, as one that does not exist.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from apiary.api.auth import Caller, People, Submitter, Users
from apiary.api.guards import plain_text
from apiary.api.routers.jobs import FlowRunHeader, flow_run_link
from apiary.api.schemas import ERROR_RESPONSES, JobJson, RequestBody
from apiary.marketplace.templates import TemplateService

router = APIRouter(prefix="/api/v2/templates", tags=["templates"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])


async def get_templates(request: Request) -> TemplateService:
    return request.app.state.templates


Templates = Annotated[TemplateService, Depends(get_templates)]


def TemplateName() -> Any:  # noqa: N802 - reads as a type in signatures; one FieldInfo per parameter
    return Path(pattern=r"^[A-Za-z0-9_-]{1,100}$", max_length=100)


class VisibilityJson(BaseModel):
    model_config = ConfigDict(extra="forbid")
    virtualClusters: list[str] = Field(default_factory=list, max_length=100)
    groups: list[str] = Field(default_factory=list, max_length=100)


class TemplateBody(RequestBody):
    """A template document (apiary.spec.template): the job is OpenPAI job protocol v2 YAML text whose
    top-level ``parameters`` are the defaults; ``parameterSchema`` refines them."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, max_length=100, description="Required to publish; on PUT the path's name.")
    summary: str = Field("", max_length=300)
    description: str = Field("", max_length=100_000, description="Markdown.")
    author: str = Field("", max_length=200)
    tags: list[str] = Field(default_factory=list, max_length=20)
    visibility: VisibilityJson | None = Field(None, description="Who sees it besides its owner and admins: users "
                                                                "granted one of the VCs or in one of the groups; "
                                                                "empty: everyone.")
    parameterSchema: dict[str, dict[str, Any]] = Field(default_factory=dict, description=(
        "By parameter: {type: number|model, title, description, minimum, maximum, enum}."))
    job: str = Field(max_length=1_000_000, description="OpenPAI job protocol v2 YAML (text).")
    official: bool | None = Field(None, description="Admins only: a curated template of the platform.")


class ParameterJson(BaseModel):
    name: str
    type: str
    default: Any
    title: str | None = None
    description: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    enum: list[Any] | None = None


class TemplateJson(BaseModel):
    name: str
    owner: str
    official: bool
    summary: str
    description: str
    author: str
    tags: list[str]
    visibility: VisibilityJson
    jobName: str
    parameters: list[ParameterJson]
    parameterSchema: dict[str, dict[str, Any]]
    job: str
    created: float
    updated: float


class RunBody(RequestBody):
    model_config = ConfigDict(extra="forbid")
    parameters: dict[str, Any] = Field(default_factory=dict, max_length=200,
                                       description="Values by parameter name; the rest keep their defaults. "
                                                   "Text is read as the parameter's type.")
    name: str | None = Field(None, max_length=200, description="The job's name (default: the template job's "
                                                               "name and a short random suffix).")
    virtualCluster: str | None = Field(None, max_length=100, description="Run in this VC instead of the "
                                                                          "template's.")


def _doc(body: TemplateBody) -> dict[str, Any]:
    doc = body.model_dump(exclude_unset=True, exclude_none=True)
    if body.visibility is not None:
        doc["visibility"] = body.visibility.model_dump()
    return doc


@router.get("", response_model=list[TemplateJson])
def list_templates(templates: Templates, caller: People,
                   q: Annotated[str | None, Query(max_length=200, description="Text in name, summary or tags.")] = None,
                   tag: Annotated[str | None, Query(max_length=50, description="One tag, exactly.")] = None
                   ) -> list[dict]:
    """The templates the caller sees, official ones first."""
    return templates.list(caller, q=q, tag=tag)


@router.post("", status_code=201, response_model=TemplateJson)
def publish(body: TemplateBody, templates: Templates, caller: Users) -> dict:
    """Publish a template owned by the caller (409 when the name is taken; 400 naming the field of a
    bad document, ``job.<field>`` for the job's own)."""
    return templates.publish(_doc(body), caller)


@router.get("/{name}", response_model=TemplateJson)
def get_template(templates: Templates, caller: People, name: str = TemplateName()) -> dict:
    return templates.get(name, caller)


@router.put("/{name}", response_model=TemplateJson)
def update(body: TemplateBody, templates: Templates, caller: Users, name: str = TemplateName()) -> dict:
    """Replace a template: its owner and admins; ``official`` changed by admins only."""
    return templates.update(name, _doc(body), caller)


@router.delete("/{name}", status_code=204)
def delete(templates: Templates, caller: Users, name: str = TemplateName()) -> Response:
    templates.delete(name, caller)
    return Response(status_code=204)


@router.post("/{name}/runs", status_code=202, response_model=JobJson)
async def run(body: RunBody, templates: Templates, caller: Caller, who: Submitter, name: str = TemplateName(),
              x_apiary_flow_run_id: FlowRunHeader = None) -> Response:
    """Render the template with the body's values and submit the job for the calling user (the
    bridge: for the user ``X-Apiary-On-Behalf-Of`` names), as ``POST /api/v2/jobs`` does: 202 with
    the job once it is durable."""
    flow_run_id = flow_run_link(caller, x_apiary_flow_run_id)
    job = await run_in_threadpool(templates.run, name, body.parameters, who, body.name,
                                  virtual_cluster=body.virtualCluster, flow_run_id=flow_run_id)
    return JSONResponse(job, status_code=202)
