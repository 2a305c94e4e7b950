"""Runbooks and the weekly alert-quality report as Prefect flows, served by
``flows/serve.py``: ``runbook/gpu-node-repair``, ``runbook/node-drain`` (run by hand from the UI or
the CLI, with the incident and node as parameters; an incident's diagnosis names its runbook) and
``alert-quality/weekly`` (Monday 08:00 UTC).

Thin: the logic is :mod:`apiary.response.runbooks` and :mod:`apiary.response.reports`. Each runbook
step is a task run; the flow run ends Failed when a step failed (the node then stays cordoned).

Who they act as, and what a run from the UI may do. The runbooks act as the admin
(:func:`apiary.drills.common.drill_token`: cordon, drain, GPU reset), with that token sent only to
the platform's configured URL (``APIARY_API_URL``): no parameter names a URL. Whoever holds the
Prefect password may press Run, so a runbook acts only for an incident that is open (triggered,
acknowledged or mitigated) and names ``node`` (its ``nodes``, from the alert's labels or the
admin who opened it): it repairs what an incident already calls for, never a node of the
starter's choosing. Anything else fails the run before a step runs, saying why.
``alert-quality`` only reads the report.
"""

from __future__ import annotations

from contextlib import closing
from typing import Annotated, Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed, State
from pydantic import Field

from apiary.drills.common import DrillApi
from apiary.errors import ApiaryError
from apiary.response import runbooks


def _finish(name: str, steps: list[runbooks.Step]) -> State:
    create_table_artifact(key=name, table=[s.to_dict() for s in steps] or [{"name": "-", "ok": False, "detail": ""}],
                          description=f"{name}: {'done' if all(s.ok for s in steps) else 'stopped'}")
    for s in steps:
        get_run_logger().info("%s: %s (%s)", s.name, "ok" if s.ok else "FAILED", s.detail)
    if steps and all(s.ok for s in steps):
        return Completed(message=f"{len(steps)} steps done")
    failed = next((s for s in steps if not s.ok), None)
    return Failed(message=f"stopped at {failed.name}: {failed.detail}" if failed else "no step ran")


#: Incident states a runbook may act in (:class:`apiary.incidents.model.IncidentState`).
OPEN_STATES = ("triggered", "acknowledged", "mitigated")


def incident_allows(api: DrillApi, incident_id: str, node: str) -> str | None:
    """Why a runbook may not act on ``node`` for ``incident_id`` (None: it may): the incident must
    exist (``GET /api/v2/incidents/{id}``), be open (:data:`OPEN_STATES`) and name ``node`` in its
    ``links.nodes``."""
    from urllib.parse import quote

    try:
        incident = api._call("GET", f"/api/v2/incidents/{quote(incident_id, safe='')}").json()
    except ApiaryError as e:
        return f"incident {incident_id!r}: {e.message}"
    if incident.get("state") not in OPEN_STATES:
        return f"incident {incident_id} is {incident.get('state')}: a runbook acts only for an open incident"
    nodes = (incident.get("links") or {}).get("nodes") or []
    if node not in nodes:
        return f"node {node!r} is not one of incident {incident_id}'s nodes ({', '.join(nodes) or 'none'})"
    return None


@task(cache_policy=NO_CACHE, persist_result=False)
def _run(which: str, incident_id: str, node: str) -> list[runbooks.Step]:
    with closing(DrillApi.from_env()) as client:
        refused = incident_allows(client, incident_id, node)
        if refused:
            return [runbooks.Step("check-incident", False, refused)]
        api = runbooks.RunbookApi(client)
        if which == "gpu-node-repair":
            return runbooks.gpu_node_repair(api, incident_id, node)
        return runbooks.node_drain(api, incident_id, node)


@flow(name="runbook", persist_result=False)
def runbook(incident_id: str, node: str,
            which: Literal["gpu-node-repair", "node-drain"] = "gpu-node-repair") -> State:
    """``gpu-node-repair``: contain (cordon, drain), reset the GPUs, verify, return the node to
    service. ``node-drain``: cordon and drain only. Each step is in the incident's timeline. Only
    for an open incident that names ``node`` (:func:`incident_allows`)."""
    return _finish(f"runbook-{which}", _run.with_options(name=which)(which, incident_id, node))


#: (deployment name, which, description) served as ``runbook/<name>``.
RUNBOOKS = (
    ("gpu-node-repair", "gpu-node-repair",
     "Repair a GPU node for an incident: cordon, drain, reset the GPUs, verify, uncordon."),
    ("node-drain", "node-drain",
     "Cordon and drain a node for an incident; its jobs are re-placed as platform retries."),
)


@flow(name="alert-quality", persist_result=False)
def alert_quality(days: Annotated[float, Field(gt=0, le=366, description="The report's window, days.")] = 7.0) -> State:
    """The alert-quality report of the last ``days`` as a markdown artifact (``alert-quality``)."""
    with closing(DrillApi.from_env()) as api:
        report = api._call("GET", "/api/v2/incidents/quality", params={"days": days}).json()
    create_markdown_artifact(key="alert-quality", markdown=report["markdown"],
                             description=f"Alert quality, last {days:g} days")
    noisy = [r["alertname"] for r in report["report"]["rules"] if r["verdicts"]]
    return Completed(message=f"{len(report['report']['rules'])} rules; to fix: {', '.join(noisy) or 'none'}")
