"""Runbooks and the weekly alert-quality report as Prefect flows (issue 14), served by
``flows/serve.py``: ``runbook/gpu-node-repair``, ``runbook/node-drain`` (run by hand from the UI or
the CLI, with the incident and node as parameters; an incident's diagnosis names its runbook) and
``alert-quality/weekly`` (Monday 08:00 UTC).

Thin: the logic is :mod:`apiary.response.runbooks` and :mod:`apiary.response.reports`. Each runbook
step is a task run; the flow run ends Failed when a step failed (the node then stays cordoned).
"""

from __future__ import annotations

from typing import Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed, State

from apiary.drills.common import DrillApi
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


@task(cache_policy=NO_CACHE, persist_result=False)
def _run(which: str, incident_id: str, node: str, api_url: str | None) -> list[runbooks.Step]:
    api = runbooks.RunbookApi(DrillApi.from_env(api_url))
    if which == "gpu-node-repair":
        return runbooks.gpu_node_repair(api, incident_id, node)
    return runbooks.node_drain(api, incident_id, node)


@flow(name="runbook", persist_result=False)
def runbook(incident_id: str, node: str, which: Literal["gpu-node-repair", "node-drain"] = "gpu-node-repair",
            api_url: str | None = None) -> State:
    """``gpu-node-repair``: contain (cordon, drain), reset the GPUs, verify, return the node to
    service. ``node-drain``: cordon and drain only. Each step is in the incident's timeline."""
    return _finish(f"runbook-{which}", _run.with_options(name=which)(which, incident_id, node, api_url))


#: (deployment name, which, description) served as ``runbook/<name>``.
RUNBOOKS = (
    ("gpu-node-repair", "gpu-node-repair",
     "Repair a GPU node for an incident: cordon, drain, reset the GPUs, verify, uncordon."),
    ("node-drain", "node-drain",
     "Cordon and drain a node for an incident; its jobs are re-placed as platform retries."),
)


@flow(name="alert-quality", persist_result=False)
def alert_quality(days: float = 7.0, api_url: str | None = None) -> State:
    """The alert-quality report of the last ``days`` as a markdown artifact (``alert-quality``)."""
    api = DrillApi.from_env(api_url)
    report = api._call("GET", "/api/v2/incidents/quality", params={"days": days}).json()
    create_markdown_artifact(key="alert-quality", markdown=report["markdown"],
                             description=f"Alert quality, last {days:g} days")
    noisy = [r["alertname"] for r in report["report"]["rules"] if r["verdicts"]]
    return Completed(message=f"{len(report['report']['rules'])} rules; to fix: {', '.join(noisy) or 'none'}")
