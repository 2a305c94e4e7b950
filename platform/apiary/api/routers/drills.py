"""Drill routes: drills report their results here, and ``/metrics`` renders them.

``POST /api/v2/drills/results`` is for admins and the platform's service token (the drills run as
Prefect flows with it, or with the admin's); ``GET /api/v2/drills`` shows the last results.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from apiary.api.auth import AdminOrBridge, People
from apiary.api.deps import Board
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, DrillRecord, DrillReport, DrillsPage

router = APIRouter(prefix="/api/v2/drills", tags=["drills"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])


@router.post("/results", response_model=DrillRecord)
def record_result(body: DrillReport, board: Board, caller: AdminOrBridge, request: Request) -> dict:
    """Record one drill run (the inspection probe's per-VC results, a stress drill's failed nodes);
    the ``apiary_probe_*`` and ``apiary_drill_*`` metrics show it from the next scrape. A failed or
    aborted drill opens (or joins) a Sev3 incident, one per drill (dedup key ``drill:<name>``); a
    passed one resolves it. Admins and the Prefect service token only."""
    record = board.record(body.model_dump())
    incidents = getattr(request.app.state, "incidents", None)
    if incidents is not None:
        incidents.ingest_event(drill_event(body), actor=f"drill:{body.drill}")
    return record


def drill_event(report: DrillReport) -> dict:
    """The PagerDuty Events API v2 event of a drill's result (``warning``: Sev3, the DRI's working day)."""
    nodes = sorted({f.node for f in report.nodeFailures or []})
    return {"event_action": "resolve" if report.result == "passed" else "trigger",
            "dedup_key": f"drill:{report.drill}",
            "payload": {"summary": f"drill {report.drill} {report.result}: {report.summary}"[:1024],
                        "severity": "warning", "class": f"drill:{report.drill}", "component": "drill",
                        "custom_details": {"drill": report.drill, "result": report.result, "nodes": nodes,
                                           "summary": report.summary[:2000]}}}


@router.get("", response_model=DrillsPage)
def drills(board: Board, _caller: People) -> dict:
    """The last run of each drill, the last probe of each VC and the last stress drill's failed nodes."""
    return board.latest()
