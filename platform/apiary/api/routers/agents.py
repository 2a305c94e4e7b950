"""Node-agent routes: heartbeats with run statuses, the assignments long poll, log upload, and
simulated-GPU faults queued for an agent.

The answers to an agent's report and to its assignments poll carry the node-lost grace in the
:data:`~apiary.runtime.link.GRACE_HEADER` header, so the agent fences itself on the control
plane's own number (:mod:`apiary.runtime.link`)."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from anyio import CapacityLimiter, to_thread
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from apiary.api.auth import Admin, NodeAgent
from apiary.api.deps import Plane, Waiters
from apiary.api.guards import plain_text
from apiary.api.heartbeat import grace_header_value, take_bare_heartbeat
from apiary.api.schemas import (
    ERROR_RESPONSES,
    MAX_OFFSET,
    MAX_SEQ,
    Assignments,
    Fault,
    FaultRequest,
    LogAppended,
    NodeReport,
    NodeReportAck,
)
from apiary.control import ControlPlane
from apiary.errors import ValidationError
from apiary.runtime.link import GRACE_HEADER

router = APIRouter(prefix="/api/v2/nodes/{node}", tags=["node agents"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])

#: The grace header as OpenAPI documents a 200 answer's headers.
_GRACE_DOC: dict[int | str, dict[str, Any]] = {200: {"headers": {GRACE_HEADER: {
    "description": "The node-lost grace in seconds (APIARY_NODE_LOST_AFTER_S): the agent stops its runs "
                   "before this long without an answered report.",
    "schema": {"type": "string", "example": "30.0"},
}}}}


def _tell_grace(response: Response, plane: ControlPlane) -> None:
    response.headers[GRACE_HEADER] = grace_header_value(plane)


_LOG_BODY = {
    "requestBody": {
        "required": True,
        "description": "Raw bytes of the stream from byte `offset` on.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post("/status", response_model=NodeReportAck, response_model_exclude_unset=True, responses=_GRACE_DOC)
async def node_status(node: str, report: NodeReport, plane: Plane, _agent: NodeAgent, response: Response) -> dict:
    """The agent's heartbeat, its runs' statuses and up to 64 KiB of their new output, stored first
    (idempotent). The node's own agent only; a run placed on another node is acknowledged and
    ignored, its output left out (logged), and so is a run the node was already lost for (its task
    is final). The answer's ``Apiary-Node-Lost-After-S`` header names the node-lost grace."""
    _tell_grace(response, plane)
    # A bare heartbeat that changes nothing stored is answered here in the event loop; the rest
    # (runs, logs, new facts) in a worker thread, as it waits for the plane's lock and the store.
    if take_bare_heartbeat(plane, node, report):
        return {"ack": []}
    plane.hear(node)  # on arrival: the node is alive even while its report waits for a worker thread
    return await to_thread.run_sync(_report, node, report, plane, limiter=_report_threads())


#: Worker threads that reports may hold at once. Reports share commits (group commit,
#: :meth:`~apiary.control.node_service.NodeService.node_report`), so a few threads keep the batches
#: full; the rest of the pool (40 threads) stays free for submissions and every other route while
#: a fleet registers at once. A report over the limit waits in the event loop.
REPORT_THREADS = 16

_report_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CapacityLimiter] = (
    weakref.WeakKeyDictionary())


def _report_threads() -> CapacityLimiter:
    """The report limiter of the running event loop (an AnyIO limiter belongs to one loop)."""
    loop = asyncio.get_running_loop()
    limiter = _report_limiters.get(loop)
    if limiter is None:
        limiter = _report_limiters[loop] = CapacityLimiter(REPORT_THREADS)
    return limiter


def _report(node: str, report: NodeReport, plane: ControlPlane) -> dict:
    # The output rides in the report's transaction: stored before the runs' exits are committed.
    return plane.node_report(
        node,
        gpus=report.gpus,
        simulated_gpus=report.simulatedGpus,
        address=report.address,
        agent_id=report.agentId,
        runs=[r.model_dump() for r in report.runs],
        metrics_url=report.metricsUrl,
        faults_applied=report.faultsApplied,
        cannot_record=report.cannotRecord,
        logs=[(c.runId, c.stream, c.offset, c.raw()) for c in report.logs],
    )


# Fault and assignment dicts carry only the fault kinds that were given; exclude_unset keeps it so
# (the agent passes every other key of a fault to the GPU simulator).
@router.post("/faults", response_model=Fault, response_model_exclude_unset=True)
def node_fault(node: str, body: FaultRequest, plane: Plane, _caller: Admin) -> dict:
    """Queue a fault for the node's simulated GPUs; its agent applies it on its next long poll. Admins only."""
    if body.clear:
        return plane.inject_fault(node, body.gpu, clear=True)
    kinds = {"ecc_dbe": body.eccDbe, "ecc_sbe": body.eccSbe, "xid": body.xid, "temp": body.temp,
             "degraded": body.degraded, "row_remap_failure": body.rowRemapFailure,
             "row_remap_pending": body.rowRemapPending, "retired_pages": body.retiredPages,
             "throttle": body.throttle, "pcie_gen": body.pcieGen, "pcie_width": body.pcieWidth}
    if not any(v is not None for v in kinds.values()):
        raise ValidationError("eccDbe", "give one of eccDbe, eccSbe, xid, temp, degraded, rowRemapFailure, "
                                        "rowRemapPending, retiredPages, throttle, pcieGen, pcieWidth or clear")
    return plane.inject_fault(node, body.gpu, **kinds)


@router.get("/faults")
def queued_faults(node: str, plane: Plane, _caller: Admin) -> dict:
    """``{"faults": [...]}``: the faults queued for the node that its agent has not applied yet
    (a runbook waits for its reset to be applied). Admins only."""
    return {"faults": plane.node_faults(node)}


@router.get("/assignments", response_model=Assignments, response_model_exclude_unset=True, responses=_GRACE_DOC)
async def assignments(
    node: str, plane: Plane, waiters: Waiters, _agent: NodeAgent, response: Response,
    generation: int | None = Query(default=None, ge=-MAX_SEQ, le=MAX_SEQ), wait: float = Query(default=0, ge=0, le=60),
) -> dict:
    """Long poll: answers when the node's generation differs from ``generation`` or after ``wait`` s.
    The node's own agent only: the launches carry the jobs' secrets. The answer's
    ``Apiary-Node-Lost-After-S`` header names the node-lost grace."""
    _tell_grace(response, plane)
    if generation is not None and wait > 0 and plane.node_generation(node) == generation:
        await waiters.wait(node, wait)
    kept = plane.kept_assignments(node)  # an idle node's answer, kept in memory: no thread
    if kept is not None:
        return kept
    # In a worker thread: a generation not read yet is a store read.
    return await run_in_threadpool(plane.assignments_answer, node)


@router.post("/logs", response_model=LogAppended, openapi_extra=_LOG_BODY)
async def node_logs(
    node: str, request: Request, plane: Plane, _agent: NodeAgent, runId: str = Query(max_length=400),
    stream: str = Query(max_length=8), offset: int = Query(ge=0, le=MAX_OFFSET),
) -> dict:
    """Raw log bytes of one run's stream starting at byte ``offset`` (idempotent on resend). The
    node's own agent only, for runs placed on the node."""
    data = await request.body()
    return {"size": await run_in_threadpool(plane.append_log, runId, stream, offset, data, node=node)}
