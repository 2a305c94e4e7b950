"""Scheduler and cluster routes: run a cycle, the scheduler's view, apply a changed cluster config, check
that the store and the scheduler agree."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool

from apiary.api.auth import Admin, AdminOrBridge, People
from apiary.api.deps import Plane
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, ClusterStatus, ConsistencyJson, CycleResultJson, ReconfigureResult

router = APIRouter(prefix="/api/v2", tags=["cluster"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])

_CONFIG_BODY = {
    "requestBody": {
        "required": True,
        "description": "A HiveD cluster config (YAML), bare or wrapped in OpenPAI's `hivedscheduler: config: |`.",
        "content": {"text/yaml": {"schema": {"type": "string"}}},
    }
}


@router.post("/scheduler/cycle", response_model=CycleResultJson)
def cycle(plane: Plane, _caller: AdminOrBridge) -> dict:
    """Run one scheduling cycle now (the scheduling loop runs them on its own too). Admins and the
    bridge (the scheduling flow) only."""
    return plane.cycle().to_dict()


@router.get("/cluster/status", response_model=ClusterStatus)
def cluster_status(plane: Plane, _caller: People, vc: str | None = Query(default=None, max_length=100)) -> dict:
    """The scheduler's view: VCs (quota / used / free / opportunistic / bad cells per level),
    nodes, groups' placements, reservations; ``vc`` narrows it to one virtual cluster (404 if unknown)."""
    return plane.cluster_status(vc)


@router.put("/cluster/config", response_model=ReconfigureResult, openapi_extra=_CONFIG_BODY)
async def cluster_config(request: Request, plane: Plane, _caller: Admin) -> dict:
    """Apply a changed HiveD config with jobs running (see ``ControlPlane.reconfigure``); an illegal
    config is a 400 naming the field (the checks of ``apiary.control.config.check_cluster_config``)
    and changes nothing. Admins only."""
    return await run_in_threadpool(plane.reconfigure, await request.body())


@router.get("/cluster/consistency", response_model=ConsistencyJson)
def consistency(plane: Plane, _caller: Admin) -> dict:
    """``ControlPlane.check_consistency``: every unreleased placement in the store against the scheduler's
    allocations, and every node's health, both ways. Read-only. Admins only (operators and chaos drills:
    ``apiary.chaos.probes.consistency_holds``)."""
    problems = plane.check_consistency()
    return {"consistent": not problems, "problems": problems}
