"""FastAPI app over a :class:`~apiary.control.ControlPlane`. Routes are thin; logic lives in the plane.

OpenPAI-shaped routes (OpenPAI REST server v2): ``POST /api/v2/jobs`` (YAML body),
``GET /api/v2/jobs``, ``GET /api/v2/jobs/{user}~{name}``,
``PUT /api/v2/jobs/{user}~{name}/executionType`` (``{"value": "STOP"}``), task logs. Node agents
use ``/api/v2/nodes/{node}/...``; the Prefect bridge reads ``/api/v2/events``.
Errors answer ``{"code", "message"}`` with the status of the :mod:`apiary.errors` class.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field

from apiary.control import ControlPlane
from apiary.errors import ApiaryError, NotFoundError, ValidationError
from apiary.monitoring.platform_metrics import PlatformCollector
from apiary.ops.alerts import ActionsConfig, AlertmanagerPayload, AlertReceiver
from apiary.settings import Settings

logger = logging.getLogger(__name__)


class ExecutionType(BaseModel):
    value: str = Field(description="STOP (OpenPAI's executionType); START is not supported for a submitted job.")


class CordonRequest(BaseModel):
    value: bool = Field(description="true: no new placements on the node; false: schedulable again.")


class FlowRunRef(BaseModel):
    id: str


class RunStatus(BaseModel):
    run_id: str
    state: str
    exit_code: int | None = None
    pid: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    lost: bool = False
    stopped: bool = False


class FaultRequest(BaseModel):
    """A simulated-GPU fault, like DCGM's error injection (dcgmi test --inject)."""

    gpu: int
    eccDbe: int | None = Field(default=None, description="Add N double-bit ECC errors.")
    eccSbe: int | None = Field(default=None, description="Add N single-bit ECC errors.")
    xid: int | None = Field(default=None, description="Raise XID error CODE.")
    temp: float | None = Field(default=None, description="Force the temperature, Celsius.")
    clear: bool = Field(default=False, description="Reset the GPU's faults.")


class NodeReport(BaseModel):
    metricsUrl: str | None = None
    agentId: str
    gpus: int = 0
    simulatedGpus: bool = False
    address: str = "127.0.0.1"
    runs: list[RunStatus] = []


def create_app(plane: ControlPlane, receiver: AlertReceiver | None = None) -> FastAPI:
    """The app over ``plane``; ``receiver`` handles Alertmanager's webhook (default: the
    packaged actions config, or ``APIARY_ALERT_ACTIONS``)."""
    if receiver is None:
        receiver = AlertReceiver(plane, ActionsConfig.load(Settings().alert_actions))
    waiters: dict[str, asyncio.Event] = {}
    started = time.time()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        # Bind the plane's change notifications to this event loop, so a placement committed by
        # the scheduling thread wakes the agents' long polls at once.
        loop = asyncio.get_running_loop()

        def notify(nodes: set[str]) -> None:
            for n in nodes:
                ev = waiters.pop(n, None)
                if ev is not None:
                    ev.set()

        plane.on_nodes_changed = lambda nodes: loop.call_soon_threadsafe(notify, set(nodes))
        yield

    app = FastAPI(title="Apiary", version="0.1.0", description="Multi-tenant GPU cluster platform", lifespan=lifespan)
    app.state.plane = plane

    @app.exception_handler(ApiaryError)
    async def _apiary_error(_request: Request, exc: ApiaryError) -> JSONResponse:
        if exc.status_code >= 500:
            logger.error("platform error: %s", exc.message)
        return JSONResponse(exc.to_dict(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _request_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        err = ValidationError(field, first.get("msg", "invalid request"))
        return JSONResponse(err.to_dict(), status_code=400)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(PlatformCollector(plane.metrics_snapshot))

    @app.get("/metrics")
    def metrics() -> Response:
        """Prometheus exposition of the platform metrics (apiary_jobs, queue, VC cells, ...)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "pid": os.getpid(), "startedAt": started}

    # ---------------------------------------------------------------- jobs
    @app.post("/api/v2/jobs", status_code=202)
    async def submit(
        request: Request,
        x_apiary_user: str | None = Header(default=None),
        x_apiary_flow_run_id: str | None = Header(default=None),
        user: str | None = Query(default=None),
    ) -> dict:
        body = await request.body()
        who = x_apiary_user or user
        if not who:
            raise ValidationError("user", "missing: send the X-Apiary-User header")
        job = await run_in_threadpool(plane.submit, body, who, flow_run_id=x_apiary_flow_run_id)
        return job

    @app.get("/api/v2/jobs")
    def list_jobs(
        username: str | None = None, virtualCluster: str | None = None, state: str | None = None
    ) -> list[dict]:
        return plane.list_jobs(user=username, virtual_cluster=virtualCluster, state=state)

    @app.get("/api/v2/jobs/{job_id}")
    def get_job(job_id: str) -> dict:
        return plane.get_job(job_id)

    @app.put("/api/v2/jobs/{job_id}/executionType")
    def execution_type(job_id: str, body: ExecutionType) -> dict:
        if body.value.upper() != "STOP":
            raise ValidationError("value", f"unsupported executionType {body.value!r}; only STOP is supported")
        return plane.stop(job_id)

    @app.put("/api/v2/jobs/{job_id}/flowRun", status_code=204)
    def flow_run(job_id: str, body: FlowRunRef) -> Response:
        plane.set_flow_run(job_id, body.id)
        return Response(status_code=204)

    @app.get("/api/v2/jobs/{job_id}/logs", response_class=PlainTextResponse)
    def logs(
        job_id: str,
        taskRole: str | None = None,
        index: int = 0,
        attempt: int | None = None,
        stream: str = "stdout",
        offset: int = 0,
    ) -> str:
        return plane.read_logs(job_id, task_role=taskRole, index=index, attempt=attempt, stream=stream, offset=offset)

    @app.get("/api/v2/events")
    def events(after: int = 0, limit: int = 500, jobId: str | None = None) -> dict:
        return {"events": plane.events(after, limit, jobId)}

    # ---------------------------------------------------------------- scheduler / cluster
    @app.post("/api/v2/scheduler/cycle")
    def cycle() -> dict:
        return plane.cycle().to_dict()

    @app.get("/api/v2/cluster/status")
    def cluster_status(vc: str | None = None) -> dict:
        """The scheduler's view: VCs (quota / used / free / opportunistic / bad cells per level),
        nodes, groups' placements, reservations; ``vc`` narrows it to one virtual cluster."""
        if vc is not None and vc not in plane.cluster.virtual_clusters:
            raise NotFoundError(f"Virtual cluster {vc} not found.")
        return plane.scheduler.status(vc)

    @app.put("/api/v2/cluster/config")
    async def cluster_config(request: Request) -> dict:
        """Apply a changed HiveD config (YAML body) with jobs running; see ControlPlane.reconfigure."""
        return await run_in_threadpool(plane.reconfigure, await request.body())

    @app.get("/api/v2/nodes")
    def nodes() -> list[dict]:
        return plane.list_nodes()

    @app.put("/api/v2/nodes/{node}/cordon")
    def cordon(node: str, body: CordonRequest) -> dict:
        """``{"value": true}`` cordons the node (no new placements), ``false`` uncordons it."""
        return plane.cordon(node, body.value)

    # ---------------------------------------------------------------- alerts
    @app.post("/api/v2/alerts/webhook")
    def alert_webhook(payload: AlertmanagerPayload, action: list[str] = Query(default=[])) -> dict:
        """Alertmanager's webhook (version 4). ``?action=cordon-node&action=email-admin`` runs those
        actions (a receiver per action, OpenPAI's style); without it the actions config decides."""
        return {"actions": receiver.receive(payload, action or None)}

    @app.get("/api/v2/alerts")
    def alerts(limit: int = 100) -> dict:
        return {"alerts": receiver.recent(limit), "actions": receiver.recent_actions(limit)}

    # ---------------------------------------------------------------- node agents
    @app.post("/api/v2/nodes/{node}/status")
    def node_status(node: str, report: NodeReport) -> dict:
        return plane.node_report(
            node,
            gpus=report.gpus,
            simulated_gpus=report.simulatedGpus,
            address=report.address,
            agent_id=report.agentId,
            runs=[r.model_dump() for r in report.runs],
            metrics_url=report.metricsUrl,
        )

    @app.post("/api/v2/nodes/{node}/faults")
    def node_fault(node: str, body: FaultRequest) -> dict:
        """Queue a fault for the node's simulated GPUs; its agent applies it on its next long poll."""
        if body.clear:
            return plane.inject_fault(node, body.gpu, clear=True)
        kinds = {"ecc_dbe": body.eccDbe, "ecc_sbe": body.eccSbe, "xid": body.xid, "temp": body.temp}
        if not any(v is not None for v in kinds.values()):
            raise ValidationError("eccDbe", "give one of eccDbe, eccSbe, xid, temp or clear")
        return plane.inject_fault(node, body.gpu, **kinds)

    @app.get("/api/v2/nodes/{node}/assignments")
    async def assignments(node: str, generation: int | None = None, wait: float = Query(default=0, le=60)) -> dict:
        """Long poll: answers when the node's generation differs from ``generation`` or after ``wait`` s."""
        if generation is not None and wait > 0 and plane.generation.get(node, 0) == generation:
            ev = waiters.get(node)
            if ev is None:
                ev = waiters[node] = asyncio.Event()
            try:
                await asyncio.wait_for(ev.wait(), wait)
            except TimeoutError:
                pass
        gen = plane.generation.get(node, 0)
        items = await run_in_threadpool(plane.assignments, node)
        return {"generation": gen, "assignments": items, "faults": plane.faults.get(node, [])}

    @app.post("/api/v2/nodes/{node}/logs")
    async def node_logs(node: str, request: Request, runId: str, stream: str, offset: int) -> dict:
        """Raw log bytes of one run's stream starting at byte ``offset`` (idempotent on resend)."""
        data = await request.body()
        return {"size": await run_in_threadpool(plane.append_log, runId, stream, offset, data)}

    return app
