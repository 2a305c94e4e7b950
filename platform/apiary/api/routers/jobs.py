"""Job routes, shaped like OpenPAI's REST server v2, and the event log the Prefect bridge reads."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from apiary.api.auth import AdminOrBridge, Caller, Dir, People, Submitter, bearer
from apiary.api.deps import Plane
from apiary.api.guards import RateLimiter, plain_text
from apiary.api.schemas import (
    ERROR_RESPONSES,
    JOB_PROTOCOL_REF,
    MAX_INDEX,
    MAX_OFFSET,
    MAX_SEQ,
    ErrorBody,
    EventsPage,
    ExecutionType,
    FlowRunLinks,
    FlowRunRef,
    FlowRunsRecorded,
    JobDetailJson,
    JobJson,
    LogReads,
    LogTexts,
)
from apiary.auth import Directory, Principal
from apiary.control import ControlPlane
from apiary.errors import ApiaryError, ForbiddenError, NotFoundError, ValidationError
from apiary.images.namespaces import check_job_image
from apiary.spec.job import DockerImagePrerequisite, JobSpec
from apiary.storage.service import StorageService

router = APIRouter(prefix="/api/v2", tags=["jobs"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])

_JOB_BODY = {
    "requestBody": {
        "required": True,
        "description": "The job: OpenPAI job protocol v2, as YAML or as JSON.",
        "content": {"text/yaml": {"schema": JOB_PROTOCOL_REF}, "application/json": {"schema": JOB_PROTOCOL_REF}},
    }
}


def _visible(plane: ControlPlane, caller: Principal, job_id: str) -> tuple[str, str]:
    """The job's ``(user, vc)`` if ``caller`` may see it; 404 otherwise (no hint it exists)."""
    user, vc = plane.job_owner(job_id)
    if not caller.may_see(user, vc):
        raise NotFoundError(f"Job {job_id} not found.")
    return user, vc


def _owned(plane: ControlPlane, caller: Principal, job_id: str, what: str) -> None:
    user, _vc = _visible(plane, caller, job_id)
    if not caller.owns(user):
        raise ForbiddenError(f"Only {user} and admins may {what} job {job_id}; you are {caller.describe()}.")


def vc_check(who: Principal, storage: StorageService | None = None) -> Callable[[JobSpec], None]:
    """Refuse a spec whose virtual cluster ``who``'s groups do not grant (OpenPAI's message), and,
    with ``storage``, one that names a storage config that does not exist (400 naming the field)
    or that ``who``'s groups do not grant (403 naming it): :meth:`StorageService.check_submit`.
    A ``dockerimage`` prerequisite naming another user's catalogue image (``users/<other>/...``) is
    a 403 naming it (:func:`apiary.images.namespaces.check_job_image`)."""
    def check(spec: JobSpec) -> None:
        if not who.can_use(spec.virtual_cluster):
            raise ForbiddenError(f"User {who.name} has no access to virtual cluster {spec.virtual_cluster}.")
        for i, prerequisite in enumerate(spec.prerequisites or []):
            if isinstance(prerequisite, DockerImagePrerequisite):
                check_job_image(prerequisite.uri, who.name, who.admin, field=f"prerequisites[{i}].uri")
        if storage is not None:
            storage.check_submit(spec.storage_requests(), admin=who.admin, granted=who.storage_configs)
    return check


FLOW_RUN_HEADER = "X-Apiary-Flow-Run-Id"

# The parameter is named after the header (FastAPI's underscore-to-hyphen), not aliased: errors
# name it ``x-apiary-flow-run-id`` as they always have.
FlowRunHeader = Annotated[str | None, Header(max_length=64,
                                             description="The Prefect flow run to attach the job to: the "
                                                         "Prefect bridge and admins only, and a run no "
                                                         "other job holds (409).")]


def flow_run_link(caller: Principal, flow_run_id: str | None) -> str | None:
    """``flow_run_id`` if ``caller`` may attach a job to a flow run (the Prefect bridge and admins,
    as ``PUT .../flowRun``); 403 for anyone else who sends the header. Whoever attaches a job to
    a run gets that run's state, tags and log lines, and a Cancel of it stops the job too."""
    if flow_run_id is not None and not (caller.admin or caller.is_bridge):
        raise ForbiddenError(f"Only the Prefect bridge and admins may attach a job to a flow run "
                             f"({FLOW_RUN_HEADER}); you are {caller.describe()}.")
    return flow_run_id


def _limiter(request: Request) -> RateLimiter | None:
    return getattr(request.app.state, "limiter", None)


@router.post("/jobs", status_code=202, response_model=JobJson, openapi_extra=_JOB_BODY)
async def submit(request: Request, caller: Caller, who: Submitter,
                 x_apiary_flow_run_id: FlowRunHeader = None) -> Response:
    """Accept a job for the calling user; 202 once it is durable. Only the Prefect bridge may name
    another (existing, non-admin) user, with ``X-Apiary-On-Behalf-Of``, and only the bridge and
    admins may attach the job to a flow run (``X-Apiary-Flow-Run-Id``). A non-admin user's
    submission counts against their submission limit once it is accepted (a refused one costs
    nothing).

    The answer is the plane's job JSON as it is, already of :class:`JobJson`'s shape
    (tests/api/test_schemas.py checks the round trip), so FastAPI's second validation and
    serialization of it through the model is skipped: this is the hottest write route."""
    flow_run_id = flow_run_link(caller, x_apiary_flow_run_id)
    job = await accept_submission(request.app.state, who, request.body, flow_run_id)
    return JSONResponse(job, status_code=202)


async def accept_submission(state: Any, who: Principal, body: Callable[[], Awaitable[bytes]],
                            flow_run_id: str | None) -> dict:
    """The submission itself, after the caller and ``who`` are settled: ``who``'s submission limit
    (not an admin's), the body (read by ``body``), the plane's group commit off the event loop with
    ``who``'s VC grants checked, then the limit counted. ``state`` is the app's state (``plane``,
    ``limiter``). Returns the job's JSON; raises what :meth:`ControlPlane.submit` and the limiter
    raise (ValidationError, ConflictError, TooManyRequestsError, ...). The route and
    :class:`apiary.api.submit_path.SubmitFastPath` both submit through it."""
    limiter: RateLimiter | None = getattr(state, "limiter", None) if not who.admin else None
    if limiter is not None:
        limiter.check_submit(who.name)
    text = await body()
    # The loop's default executor, not run_in_threadpool: anyio's hand-off (its capacity limiter,
    # cancel scope and run-vars) cost the event loop more than asyncio's for the busiest write.
    check = vc_check(who, getattr(state, "storage", None))
    submit = functools.partial(state.plane.submit, text, who.name, flow_run_id=flow_run_id, authorize=check)
    job: dict = await asyncio.get_running_loop().run_in_executor(None, submit)
    if limiter is not None:
        limiter.count_submit(who.name)
    return job


def submit_text(state: Any, text: str, who: Principal, flow_run_id: str | None) -> dict:
    """:func:`accept_submission` for job text already in hand, blocking: call it off the event loop.
    The same checks in the same order (``who``'s submission limit unless an admin, the plane's
    group commit with ``who``'s VC and storage grants checked, then the limit counted). The
    template runs (:mod:`apiary.marketplace.templates`) submit through it."""
    limiter: RateLimiter | None = getattr(state, "limiter", None) if not who.admin else None
    if limiter is not None:
        limiter.check_submit(who.name)
    job: dict = state.plane.submit(text, who.name, flow_run_id=flow_run_id,
                                   authorize=vc_check(who, getattr(state, "storage", None)))
    if limiter is not None:
        limiter.count_submit(who.name)
    return job


@router.post("/jobs/{job_id}/clone", status_code=202, response_model=JobJson)
async def clone(job_id: str, request: Request, plane: Plane, directory: Dir, caller: People,
                x_apiary_flow_run_id: FlowRunHeader = None) -> dict:
    """Submit a copy of the job as ``<name>-retry<N>`` (the Retry button of its Prefect flow run);
    ``X-Apiary-Flow-Run-Id`` (the bridge and admins only) attaches the copy to that flow run: a
    free one or the source job's own. 202: the new job. The job's owner, admins and the bridge
    only; the copy still needs a VC its owner may use. A copy is a submission of the job's owner:
    it counts against their limit (not an admin's) once accepted."""
    _owned(plane, caller, job_id, "clone")  # first: a job the caller may not see is a 404 whatever they send
    flow_run_id = flow_run_link(caller, x_apiary_flow_run_id)
    # Whose budget: the owner's. A user may clone only their own jobs; the bridge acts for the
    # owner, who may be an admin (not limited).
    owner = None if caller.admin else caller.name if caller.kind == "user" else plane.job_owner(job_id)[0]
    if owner is not None and caller.is_bridge and await run_in_threadpool(_is_admin, directory, owner):
        owner = None
    limiter = _limiter(request) if owner is not None else None
    if limiter is not None and owner is not None:
        limiter.check_submit(owner)
    # An owner's copy needs a VC they may still use; admins and the bridge act for the owner.
    check = vc_check(caller, getattr(request.app.state, "storage", None)) \
        if caller.kind == "user" and not caller.admin else None
    job = await run_in_threadpool(plane.clone, job_id, flow_run_id=flow_run_id, authorize=check)
    if limiter is not None and owner is not None:
        limiter.count_submit(owner)
    return job


def _is_admin(directory: Directory, user: str) -> bool:
    """Whether ``user`` is an admin now (False for a user deleted since: their jobs stay)."""
    try:
        return directory.user_principal(user).admin
    except NotFoundError:
        return False


@router.get("/jobs", response_model=list[JobJson])
def list_jobs(
    plane: Plane, caller: People, username: str | None = Query(default=None, max_length=64),
    virtualCluster: str | None = Query(default=None, max_length=100),
    state: str | None = Query(default=None, max_length=16),
) -> list[dict]:
    """Jobs in submission order, filtered by user, VC and state (any case): the caller's own jobs
    and those of the virtual clusters their groups grant (admins and the bridge: all)."""
    visible = None if caller.sees_all_jobs() else (caller.name, caller.virtual_clusters)
    return plane.list_jobs(user=username, virtual_cluster=virtualCluster, state=state, visible_to=visible)


@router.get("/jobs/{job_id}", response_model=JobDetailJson, response_model_exclude_unset=True)
def get_job(job_id: str, plane: Plane, caller: People, request: Request) -> dict:
    """One job (404 also for a job the caller may not see), with what its tasks mount (``storage``:
    the configs' files are where a job's outputs go) or why they cannot now (``storageError``), and
    for a user its MLflow runs that user may read (``mlflowRuns``: runs tagged ``apiary.job``)."""
    _visible(plane, caller, job_id)
    job = plane.get_job(job_id)
    models = getattr(request.app.state, "models", None)
    if models is not None and models.enabled and caller.kind == "user":
        runs = models.job_runs(bearer(request), job_id)  # as the caller: MLflow's permissions decide
        if runs:
            job["mlflowRuns"] = runs
    plan = plane.agents.plan_mounts
    if plan is not None:
        try:
            mounts = plan(job["user"], plane.jobs.storage_requests(job_id))
        except ApiaryError as e:
            job["storageError"] = e.message
        else:
            if mounts:
                job["storage"] = [{"config": m["config"], "mountPoint": m["mountPoint"], "server": m["server"]["name"],
                                   "path": m["path"], "permission": "ro" if m["readOnly"] else "rw"}
                                  for m in mounts]
    return job


@router.put("/jobs/{job_id}/executionType", response_model=JobJson)
def execution_type(job_id: str, body: ExecutionType, plane: Plane, caller: People) -> dict:
    """``{"value": "STOP"}`` stops the job (idempotent); the job as it is after the request. The
    job's owner, admins and the bridge (Cancel in the Prefect UI) only."""
    if body.value.upper() != "STOP":
        raise ValidationError("value", f"unsupported executionType {body.value!r}; only STOP is supported")
    _owned(plane, caller, job_id, "stop")
    return plane.stop(job_id)


@router.put("/jobs/{job_id}/flowRun", status_code=204, response_class=Response)
def flow_run(job_id: str, body: FlowRunRef, plane: Plane, _caller: AdminOrBridge) -> Response:
    """Record the Prefect flow run the job is mirrored into (the bridge calls it); 409 for a run
    another job holds."""
    plane.set_flow_run(job_id, body.id)
    return Response(status_code=204)


@router.put("/flowRuns", response_model=FlowRunsRecorded)
def flow_runs(body: FlowRunLinks, plane: Plane, _caller: AdminOrBridge) -> dict:
    """Record the Prefect flow runs of several jobs in one transaction (the bridge, once per batch
    of new flow runs). Idempotent. Unknown job ids are left out and named in ``unknown``; a run
    another job holds (or two links naming one run) is a 409 and nothing is recorded."""
    links = {link.jobId: link.flowRunId for link in body.links}
    unknown = plane.set_flow_runs(links)
    return {"recorded": len(links) - len(unknown), "unknown": unknown}


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
    caller: People,
    taskRole: str | None = Query(default=None, max_length=100),
    index: int = Query(default=0, ge=0, le=MAX_INDEX),
    attempt: int | None = Query(default=None, ge=0, le=MAX_INDEX),
    stream: str = Query(default="stdout", max_length=8),
    offset: int = Query(default=0, ge=0, le=MAX_OFFSET),
) -> str:
    """A task instance's ``stream`` (stdout | stderr | all) from byte ``offset``, every run of the
    attempt (default: all attempts) oldest first; ``taskRole`` defaults to the first role. The
    job's owner, admins and the bridge only."""
    _owned(plane, caller, job_id, "read the logs of")
    return plane.read_logs(job_id, task_role=taskRole, index=index, attempt=attempt, stream=stream, offset=offset)


@router.post("/logs/query", response_model=LogTexts)
def logs_query(body: LogReads, plane: Plane, _caller: AdminOrBridge) -> dict:
    """Several instances' output at once, each read as ``GET /jobs/{id}/logs`` reads it (the
    bridge, once per batch of finished instances, instead of a request per stream). Admins and the
    bridge only: a person reads their own jobs' logs one instance at a time."""
    return {"texts": plane.read_logs_many(
        [(r.jobId, r.taskRole, r.index, r.attempt, r.stream, r.offset) for r in body.reads])}


@router.get("/events", response_model=EventsPage)
def events(
    plane: Plane, caller: People, after: int = Query(default=0, ge=0, le=MAX_SEQ),
    limit: int = Query(default=500, ge=1, le=5000), jobId: str | None = Query(default=None, max_length=300),
) -> dict:
    """The job event log after ``after`` (a seq), at most ``limit`` (1..5000) events, optionally one
    job's. Users see the events of their own jobs; admins and the bridge all."""
    user = None if caller.sees_all_jobs() else caller.name
    return {"events": plane.events(after, limit, jobId, user=user)}
