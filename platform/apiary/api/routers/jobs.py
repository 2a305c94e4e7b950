"""Job routes, shaped like OpenPAI's REST server v2, and the event log the Prefect bridge reads."""

from __future__ import annotations

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, Response

from apiary.api.deps import Plane
from apiary.api.schemas import ERROR_RESPONSES, ErrorBody, EventsPage, ExecutionType, FlowRunRef, JobJson
from apiary.errors import ValidationError

router = APIRouter(prefix="/api/v2", tags=["jobs"], responses=ERROR_RESPONSES)

_JOB_BODY = {
    "requestBody": {
        "required": True,
        "description": "The job: OpenPAI job protocol v2, as YAML or as JSON.",
        "content": {"text/yaml": {"schema": {"type": "string"}}, "application/json": {"schema": {"type": "object"}}},
    }
}


@router.post("/jobs", status_code=202, response_model=JobJson, openapi_extra=_JOB_BODY)
async def submit(
    request: Request,
    plane: Plane,
    x_apiary_user: str | None = Header(default=None),
    x_apiary_flow_run_id: str | None = Header(default=None),
    user: str | None = Query(default=None),
) -> dict:
    """Accept a job; 202 once it is durable. The user comes from ``X-Apiary-User`` (or ``?user=``)."""
    body = await request.body()
    who = x_apiary_user or user
    if not who:
        raise ValidationError("user", "missing: send the X-Apiary-User header")
    return await run_in_threadpool(plane.submit, body, who, flow_run_id=x_apiary_flow_run_id)


@router.post("/jobs/{job_id}/clone", status_code=202, response_model=JobJson)
async def clone(job_id: str, plane: Plane, x_apiary_flow_run_id: str | None = Header(default=None)) -> dict:
    """Submit a copy of the job as ``<name>-retry<N>`` (the Retry button of its Prefect flow run);
    ``X-Apiary-Flow-Run-Id`` attaches the copy to that flow run. 202: the new job."""
    return await run_in_threadpool(plane.clone, job_id, flow_run_id=x_apiary_flow_run_id)


@router.get("/jobs", response_model=list[JobJson])
def list_jobs(
    plane: Plane, username: str | None = None, virtualCluster: str | None = None, state: str | None = None
) -> list[dict]:
    """Jobs in submission order, filtered by user, VC and state (any case)."""
    return plane.list_jobs(user=username, virtual_cluster=virtualCluster, state=state)


@router.get("/jobs/{job_id}", response_model=JobJson)
def get_job(job_id: str, plane: Plane) -> dict:
    return plane.get_job(job_id)


@router.put("/jobs/{job_id}/executionType", response_model=JobJson)
def execution_type(job_id: str, body: ExecutionType, plane: Plane) -> dict:
    """``{"value": "STOP"}`` stops the job (idempotent); the job as it is after the request."""
    if body.value.upper() != "STOP":
        raise ValidationError("value", f"unsupported executionType {body.value!r}; only STOP is supported")
    return plane.stop(job_id)


@router.put("/jobs/{job_id}/flowRun", status_code=204, response_class=Response)
def flow_run(job_id: str, body: FlowRunRef, plane: Plane) -> Response:
    """Record the Prefect flow run the job is mirrored into (the bridge calls it)."""
    plane.set_flow_run(job_id, body.id)
    return Response(status_code=204)


# The answer is text, its errors JSON: FastAPI would document the errors under text/plain too.
_JSON_ERRORS = {
    status: {"description": r["description"],
             "content": {"application/json": {"schema": ErrorBody.model_json_schema()}}}
    for status, r in ERROR_RESPONSES.items()
}


@router.get(
    "/jobs/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Log text."},
               **_JSON_ERRORS},
)
def logs(
    job_id: str,
    plane: Plane,
    taskRole: str | None = None,
    index: int = 0,
    attempt: int | None = None,
    stream: str = "stdout",
    offset: int = 0,
) -> str:
    """A task instance's ``stream`` (stdout | stderr | all) from byte ``offset``, every run of the
    attempt (default: all attempts) oldest first; ``taskRole`` defaults to the first role."""
    return plane.read_logs(job_id, task_role=taskRole, index=index, attempt=attempt, stream=stream, offset=offset)


@router.get("/events", response_model=EventsPage)
def events(plane: Plane, after: int = 0, limit: int = 500, jobId: str | None = None) -> dict:
    """The job event log after ``after`` (a seq), at most ``limit`` (1..5000) events, optionally one job's."""
    return {"events": plane.events(after, limit, jobId)}
