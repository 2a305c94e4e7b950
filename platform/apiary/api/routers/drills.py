"""Drill routes: drills report their results here, and ``/metrics`` renders them.

``POST /api/v2/drills/results`` is for admins and the platform's service token (the drills run as
Prefect flows with it, or with the admin's); ``GET /api/v2/drills`` shows the last results.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from apiary.api.auth import AdminOrBridge, People
from apiary.api.deps import Board
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, DrillRecord, DrillReport, DrillsPage

router = APIRouter(prefix="/api/v2/drills", tags=["drills"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])


@router.post("/results", response_model=DrillRecord)
def record_result(body: DrillReport, board: Board, _caller: AdminOrBridge) -> dict:
    """Record one drill run (the inspection probe's per-VC results, a stress drill's failed nodes);
    the ``apiary_probe_*`` and ``apiary_drill_*`` metrics show it from the next scrape. Admins and
    the Prefect service token only."""
    return board.record(body.model_dump())


@router.get("", response_model=DrillsPage)
def drills(board: Board, _caller: People) -> dict:
    """The last run of each drill, the last probe of each VC and the last stress drill's failed nodes."""
    return board.latest()
