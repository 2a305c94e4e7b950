"""Serve the Apiary flows as Prefect deployments: ``python flows/serve.py``.

* ``apiary-job/submit``: the job form (name, user, virtual cluster, priority, task roles);
* ``apiary-job/submit-yaml``: a complete OpenPAI job YAML;
* ``apiary-job/job``: the runs the bridge makes for CLI/REST jobs (Retry re-runs the job);
* ``what-if-replay/whatif``: a trace replay from the UI (see flows/whatif.py);
* ``scheduling-loop/loop``: on demand only (no schedule): Apiary's control plane runs the
  scheduler itself, and a run per minute would bury the jobs in the runs list;
* ``platform-ci/pr`` and ``platform-deploy/main``: Apiary's own CI/CD (flows/ci.py), started by
  the GitHub webhook intake and by Jenkins (ci/run-pipeline, ci/deploy); configured by the
  ``APIARY_CI_*`` variables (:mod:`apiary.ci.config`);
* ``apiary-template/<name>``: one per job template of the marketplace (flows/template.py), its run
  form made from the template's parameters; templates published later are added while serving
  (:func:`watch_templates`, every ``APIARY_TEMPLATE_WATCH_S`` seconds);
* the drills on cron schedules (flows/drills.py, :data:`DRILL_SCHEDULES`): ``inspection/inspection``,
  ``stress-drill/nightly``, ``chaos-drill/weekly``, ``load-drill/weekly``.

All reach Apiary at ``APIARY_API_URL`` of this process only (``apiary up`` sets it) and need
``PREFECT_API_URL`` pointing at the Prefect server. The form's virtual-cluster drop-down lists
the cluster's VCs as Apiary reports them when serving starts.

What the Prefect password starts. Every deployment here can be run from the UI by whoever holds
the Prefect server's password, so none takes a URL, a token or anything that names where a token
goes (a run with such a parameter is refused), and each acts with only what it needs:

* ``apiary-job/*`` and ``scheduling-loop/loop`` use the bridge's service token (submit on behalf of
  an existing user, stop, clone, scheduling cycles);
* the drills, ``runbook/*`` and ``alert-quality/weekly`` use the admin's token inside this process,
  with bounded parameters (flows/drills.py, flows/runbooks.py): a drill no wider than its schedule
  runs it; a runbook only for an open incident that names the node;
* ``what-if-replay/whatif`` calls no API;
* ``platform-ci/pr`` and ``platform-deploy/main`` take the webhook's pipeline request (flows/ci.py)
  and send no token to its URLs; they clone ``APIARY_CI_REPO_URL`` when it is set, else the
  request's ``clone_url``, whose tests then run on this host.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

# flows/ is not a package: make its siblings importable when run as a script.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from apiary.client import split_api_urls  # noqa: E402
from apiary.tracking.portal import TEMPLATE_FLOW, form_schema, template_form_schema  # noqa: E402
from apiary.tracking.source import service_headers  # noqa: E402
from apiary.tracking.submit import platform_verify, reachable_replica  # noqa: E402
from ci import platform_ci, platform_deploy  # noqa: E402
from drills import chaos_drill, inspection, load_drill, stress_drill  # noqa: E402
from job import rerun_job, submit_form, submit_yaml  # noqa: E402
from runbooks import RUNBOOKS, alert_quality, runbook  # noqa: E402
from scheduling import scheduling_loop  # noqa: E402
from template import run_template  # noqa: E402
from whatif import what_if_replay  # noqa: E402

EXAMPLE_ROLE = {"name": "train", "instances": 1, "gpus": 1, "cpu": 2, "memory_mb": 4096, "image": "python:3.11",
                "commands": ["python3 -c \"import os; print('GPUs:', os.environ.get('CUDA_VISIBLE_DEVICES'))\""]}


def virtual_clusters(api_url: str | None) -> list[str]:
    """The cluster's VC names from ``GET /api/v2/cluster/status``; [] when Apiary cannot say."""
    if not api_url:
        return []
    try:
        base = reachable_replica(split_api_urls(api_url))
        resp = httpx.get(f"{base}/api/v2/cluster/status", timeout=10, headers=service_headers(),
                         verify=platform_verify())
        resp.raise_for_status()
        return sorted(resp.json().get("virtualClusters", {}))
    except (httpx.HTTPError, ValueError) as exc:
        logging.getLogger(__name__).warning("no VC list for the form (free text instead): %r", exc)
        return []


def deployments() -> list:
    """The deployments (``submit``, ``submit-yaml``, ``job``, ``loop``, ``whatif``). The form's VC
    drop-down is read from ``APIARY_API_URL``, the only Apiary the flows talk to."""
    api_url = os.environ.get("APIARY_API_URL")
    vcs = virtual_clusters(api_url)
    submit = submit_form.to_deployment(
        name="submit",
        parameters={"task_roles": [EXAMPLE_ROLE], **({"virtual_cluster": vcs[0]} if vcs else {})},
        description="Submit a job to Apiary: fill in the form (Run -> Custom run). The run follows the job "
                    "and ends with its state.",
        tags=["apiary"],
    )
    submit._parameter_openapi_schema = _schema(submit, vcs)
    yaml_submit = submit_yaml.to_deployment(
        name="submit-yaml", tags=["apiary"],
        description="Submit a complete OpenPAI job YAML to Apiary and follow it.",
    )
    yaml_submit._parameter_openapi_schema = _schema(yaml_submit, None)
    job = rerun_job.to_deployment(
        name="job", tags=["apiary"],
        description="Apiary jobs submitted by the CLI or REST API (runs are made by Apiary's bridge). "
                    "Retry on a finished run re-runs its job as a new job.",
    )
    job._parameter_openapi_schema = _schema(job, None)
    loop = scheduling_loop.to_deployment(
        name="loop",
        parameters={"cycles": 10, "interval_s": 1.0},
        description="On demand: drive Apiary's scheduler for a few cycles and record its decisions "
                    "(Apiary schedules on its own; this is for looking, not needed to run jobs).",
        tags=["apiary"],
    )
    whatif = what_if_replay.to_deployment(
        name="whatif",
        description="Replay a job trace on a cluster under hived, quota and fifo; summary table and plots.",
        tags=["apiary", "simulator"],
    )
    return [submit, yaml_submit, job, loop, whatif]


#: (flow, deployment name, cron in UTC, what it does). Inspection every 5 minutes; the stress drill
#: nightly when the cluster is quiet; the chaos drill on a weekday morning, when people are there to
#: respond (Netflix runs Chaos Monkey in business hours); the load drill weekly, off-peak (Sunday
#: night). Edit the crons here, or pause a schedule in the Prefect UI.
DRILL_SCHEDULES = (
    (inspection, "inspection", "*/5 * * * *",
     "Every 5 minutes: a tiny opportunistic job per virtual cluster, submit -> running -> succeeded "
     "against the SLO (apiary_probe_* metrics, alert ApiaryInspectionProbeFailing)."),
    (stress_drill, "nightly", "0 2 * * *",
     "Nightly: a benchmark job on every node, diagnosed by apiary/drills/rules.yaml; failing nodes are "
     "reported (apiary_drill_node_failed) and cordoned."),
    (chaos_drill, "weekly", "0 10 * * 2",
     "Weekly (Tuesday 10:00 UTC): the chaos experiments tagged for drills, aborted and rolled back when "
     "the inspection probe fails beyond the error budget."),
    (load_drill, "weekly", "0 3 * * 0",
     "Weekly, off-peak (Sunday 03:00 UTC): the smoke load profile, under the same guard."),
)


def drill_deployments(active: bool | None = None) -> list:
    """The drills' deployments (:data:`DRILL_SCHEDULES`), one run at a time each. Their schedules
    are active only with ``active`` (default: ``APIARY_DRILL_SCHEDULES=1``, which ``apiary up``
    sets): a platform started by a test or ``apiary demo`` keeps them paused, so no probe job
    lands among the jobs it checks. Paused or not, each can be run by hand from the UI, with
    bounded parameters (flows/drills.py)."""
    if active is None:
        active = os.environ.get("APIARY_DRILL_SCHEDULES") == "1"
    return [
        fl.to_deployment(name=name, cron=cron, description=text, tags=["apiary", "drill"],
                         concurrency_limit=1, paused=not active)
        for fl, name, cron, text in DRILL_SCHEDULES
    ]


def ci_deployments() -> list:
    """``platform-ci/pr`` (one run per commit) and ``platform-deploy/main`` (one at a time: two
    rollouts of the same production platform must not interleave)."""
    return [
        platform_ci.to_deployment(
            name="pr", tags=["ci"],
            description="Apiary's CI pipeline for one commit: checkout, unit, image, staging, integration, load, "
                        "chaos, regression, report. Started by the GitHub webhook intake or ci/run-pipeline."),
        platform_deploy.to_deployment(
            name="main", tags=["ci", "deploy"], concurrency_limit=1,
            description="Roll the production platform forward to a default-branch commit after its pipeline "
                        "passed, one component at a time, gated on health, rolled back on a failed gate."),
    ]


def _schema(deployment, vcs: list[str] | None) -> object:
    from prefect.utilities.callables import ParameterSchema

    raw = deployment._parameter_openapi_schema
    raw = raw.model_dump() if hasattr(raw, "model_dump") else dict(raw)
    return ParameterSchema(**form_schema(raw, vcs))


def ops_deployments() -> list:
    """The runbooks (``runbook/gpu-node-repair``, ``runbook/node-drain``: started by hand, with the
    incident and the node; they act only for an open incident that names the node) and
    ``alert-quality/weekly`` (Monday 08:00 UTC; active with the drills' schedules)."""
    active = os.environ.get("APIARY_DRILL_SCHEDULES") == "1"
    return [
        *(runbook.to_deployment(name=name, parameters={"which": which}, description=text, tags=["apiary", "runbook"])
          for name, which, text in RUNBOOKS),
        alert_quality.to_deployment(name="weekly", cron="0 8 * * 1", paused=not active, tags=["apiary", "ops"],
                                    description="Weekly: each alert rule's firings, time to acknowledge, noise "
                                                "ratio and flapping (the alert-quality artifact)."),
    ]


def served_templates(api_url: str | None) -> list[dict]:
    """The job templates of the marketplace (``GET /api/v2/templates`` with the bridge's token,
    which sees them all); [] when Apiary cannot say."""
    if not api_url:
        return []
    try:
        base = reachable_replica(split_api_urls(api_url))
        resp = httpx.get(f"{base}/api/v2/templates", timeout=10, headers=service_headers(), verify=platform_verify())
        resp.raise_for_status()
        return list(resp.json())
    except (httpx.HTTPError, ValueError) as exc:
        logging.getLogger(__name__).warning("no job templates to serve: %r", exc)
        return []


def template_deployments(templates: list[dict] | None = None) -> list:
    """One ``apiary-template/<name>`` deployment per job template (default: those Apiary lists at
    ``APIARY_API_URL`` now), its run form made from the template's parameters
    (:func:`apiary.tracking.portal.template_form_schema`) and opened at their defaults. A run acts
    for the user named in its form, with the bridge's token (flows/template.py)."""
    from prefect.utilities.callables import ParameterSchema

    if templates is None:
        templates = served_templates(os.environ.get("APIARY_API_URL"))
    out = []
    for t in templates:
        d = run_template.to_deployment(
            name=t["name"], tags=["apiary", "template", *(["official"] if t.get("official") else [])],
            parameters={"template": t["name"], "parameters": {p["name"]: p["default"] for p in t["parameters"]}},
            description=f"**{t.get('summary') or t['name']}** (job template; Run -> Custom run to set its "
                        f"parameters and the user it runs as)\n\n{t.get('description') or ''}",
        )
        d._parameter_openapi_schema = ParameterSchema(**template_form_schema(t))
        out.append(d)
    return out


#: How often the serving process looks for templates published (or changed) since it started, in
#: seconds (``APIARY_TEMPLATE_WATCH_S``; 0: never).
TEMPLATE_WATCH_S = float(os.environ.get("APIARY_TEMPLATE_WATCH_S", "15"))


async def watch_templates(runner, served: dict[str, float], period_s: float) -> None:
    """Every ``period_s``: serve a deployment for each template Apiary lists that ``served`` (name
    -> its ``updated`` time) lacks or that changed since, so a template published after serving
    started gets its run form without a restart. A deleted template's deployment stays (its runs
    get Apiary's 404). Never raises: Apiary or Prefect being away is retried at the next period."""
    log = logging.getLogger(__name__)
    while True:
        await asyncio.sleep(period_s)
        try:
            listed = await asyncio.to_thread(served_templates, os.environ.get("APIARY_API_URL"))
            for t in listed:
                if served.get(t["name"]) == t.get("updated"):
                    continue
                # In a thread: inside an event loop Prefect's to_deployment answers a coroutine.
                [deployment] = await asyncio.to_thread(template_deployments, [t])
                await runner.aadd_deployment(deployment)
                served[t["name"]] = t.get("updated")
                log.info("serving template deployment %s/%s", TEMPLATE_FLOW, t["name"])
        except Exception as exc:  # the watcher must outlive any one failure
            log.warning("template watch failed (retried in %.0f s): %r", period_s, exc)


def serve(*served: object, templates: list[dict] | None = None, watch_s: float = TEMPLATE_WATCH_S) -> None:
    """Serve ``served`` as Prefect's ``serve`` does (one Runner, schedules paused on shutdown), and
    with ``watch_s`` > 0 also :func:`watch_templates` beside it, starting from ``templates`` (the
    ones ``served`` already holds deployments for)."""
    from prefect.exceptions import TerminationSignal
    from prefect.runner import Runner

    runner = Runner(pause_on_shutdown=True)
    for deployment in served:
        runner.add_deployment(deployment)
    known = {t["name"]: t.get("updated") for t in templates or []}

    async def run() -> None:
        watcher = asyncio.create_task(watch_templates(runner, known, watch_s)) if watch_s > 0 else None
        try:
            await runner.start()
        finally:
            if watcher is not None:
                watcher.cancel()

    try:
        asyncio.run(run())
    except (KeyboardInterrupt, TerminationSignal) as exc:
        logging.getLogger(__name__).info("received %s, shutting down", type(exc).__name__)


def main() -> None:
    templates = served_templates(os.environ.get("APIARY_API_URL"))
    serve(*deployments(), *template_deployments(templates), *drill_deployments(), *ci_deployments(),
          *ops_deployments(), templates=templates)


if __name__ == "__main__":
    main()
