"""Every job is a Prefect flow run, on a real Prefect server started by the embedded platform.

- a flow run of the ``apiary-job/submit`` deployment, created through the Prefect API exactly as
  the UI's run form does, runs the job and reaches Completed;
- a job submitted through the API gets its own flow run with the lifecycle's task runs and logs;
- with the Prefect server killed, jobs are still accepted and run, and the UI catches up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import yaml
from tests.support.builders import LAB6, job_text
from tests.support.polling import nodes_ready, until

from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded

pytestmark = [pytest.mark.e2e, pytest.mark.prefect]


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    home = tmp_path_factory.mktemp("apiary")
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME", "DO_NOT_TRACK")}
    p = Embedded(home=home, cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=True, workdir=str(REPO_ROOT))
    p.start()
    p.start_supervisor(period_s=0.2)
    os.environ.update({"PREFECT_API_URL": p.prefect_server.api_url, "PREFECT_HOME": str(home / "prefect"),
                       "DO_NOT_TRACK": "1"})
    PREFECT_API["url"] = p.prefect_server.api_url  # a restarted server keeps its port
    PREFECT_API["auth"] = p.prefect_auth_string  # apiary up protects its Prefect server
    c = Tenants(p.client())
    c.create_user("dave")  # the run form submits as the user it names, who must exist
    until(lambda: nodes_ready(c, 2), 60, "node agents")
    yield p, c
    p.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


PREFECT_API: dict[str, str | None] = {}


def prefect(coro_fn):
    """Run ``coro_fn(client)`` with a fresh client of the platform's Prefect server. The URL is
    passed explicitly: Prefect caches settings per process, and an earlier test module may have
    pointed them elsewhere (a client without a URL would start a temporary server)."""
    from prefect.client.orchestration import PrefectClient

    async def main():
        async with PrefectClient(PREFECT_API["url"], auth_string=PREFECT_API["auth"]) as client:
            return await coro_fn(client)

    return asyncio.run(main())


def flow_run_named(name: str):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async def q(client):
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        return runs[0] if runs else None

    return prefect(q)


def task_run_names(flow_run_id) -> set[str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def q(client):
        runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return {r.name for r in runs if r.state and r.state.is_final()}

    return prefect(q)


def flow_logs(flow_run_id) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def q(client):
        logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return "\n".join(log.message for log in logs)

    return prefect(q)


def completed(name: str):
    run = flow_run_named(name)
    return run if run is not None and run.state_name == "Completed" else None


def _run_deployment(name: str, parameters: dict):
    async def create(client):
        deployment = await client.read_deployment_by_name(name)
        return await client.create_flow_run_from_deployment(deployment.id, parameters=parameters)

    return until(lambda: _try(lambda: prefect(create)), 60, f"the {name} deployment")


def _final_run(run_id):
    return until(lambda: (r := prefect(lambda cl: cl.read_flow_run(run_id))).state.is_final() and r, 120,
                 "the flow run to finish")


def test_run_form_submission_from_the_job_deployment(platform):
    """What the form sends: typed fields, no protocolVersion/type, no JSON typing."""
    p, c = platform
    role = {"name": "train", "instances": 1, "gpus": 1, "cpu": 2, "memory_mb": 4096, "image": "python:3.11",
            "commands": ["python3 -c 'print(\"hello from the form\")'"]}
    run = _run_deployment("apiary-job/submit", {"name": "from-prefect-ui", "user": "dave", "virtual_cluster": "vc1",
                                                "priority_class": "prod", "task_roles": [role]})
    job = until(lambda: _try(lambda: c.get("dave~from-prefect-ui")), 120, "the job submitted by the flow run")
    job = c.wait(job["id"], timeout=120)
    assert job["state"] == "SUCCEEDED" and job["virtualCluster"] == "vc1" and job["priorityClass"] == "prod"
    assert job["flowRunId"] == str(run.id)
    final = _final_run(run.id)
    assert final.state_name == "Completed" and final.name == "dave~from-prefect-ui"
    assert {"user:dave", "vc:vc1", "priority:prod"} <= set(final.tags)  # added by the bridge
    # The bridge attached the job's lifecycle to the deployment's own flow run.
    names = until(lambda: {"queue", "run-train"} <= (n := task_run_names(run.id)) and n, 60, "task runs")
    assert names


def test_yaml_submission_and_a_bad_job_fails_the_run_with_the_apis_message(platform):
    p, c = platform
    run = _run_deployment("apiary-job/submit-yaml", {"job_yaml": job_text(0, 1, name="from-yaml"), "user": "dave"})
    assert _final_run(run.id).state_name == "Completed"
    bad = yaml.safe_load(job_text(0, 1, name="too-big"))
    bad["taskRoles"]["train"]["resourcePerInstance"]["gpu"] = 64
    run = _run_deployment("apiary-job/submit-yaml", {"job_yaml": yaml.safe_dump(bad), "user": "dave"})
    final = _final_run(run.id)
    assert final.state_name == "Failed"
    with pytest.raises(Exception) as api_error:
        c.submit(yaml.safe_dump(bad), "dave")
    assert str(api_error.value.message) in final.state.message  # the same words as the API
    # the form cannot name a user Apiary does not know
    run = _run_deployment("apiary-job/submit-yaml", {"job_yaml": job_text(0, 1, name="ghost"), "user": "nobody"})
    final = _final_run(run.id)
    assert final.state_name == "Failed" and "User nobody not found." in final.state.message


def test_cancel_stops_the_job_and_retry_re_runs_it(platform):
    """The UI's Cancel (state Cancelling) and Retry (state AwaitingRetry) on a CLI job's run."""
    from prefect.states import AwaitingRetry, Cancelling

    p, c = platform
    job_id = c.submit(job_text(2, 600, name="cancel-me"), user="erin")["id"]
    until(lambda: c.get(job_id)["state"] == "RUNNING", 120, "the job running")
    run = until(lambda: (r := flow_run_named(job_id)) and r.state_name == "Running" and r, 60, "its run Running")
    assert run.deployment_id is not None
    prefect(lambda cl: cl.set_flow_run_state(run.id, Cancelling(message="Cancel from the UI")))
    assert c.wait(job_id, timeout=120)["state"] == "STOPPED"
    run = until(lambda: (r := flow_run_named(job_id)) and r.state_name == "Cancelled" and r, 60, "its run Cancelled")
    assert "Cancel in the Prefect UI" in run.state.message

    prefect(lambda cl: cl.set_flow_run_state(run.id, AwaitingRetry(message="Retry from the UI"), force=True))
    clone = until(lambda: _try(lambda: c.get("erin~cancel-me-retry1")), 120, "the re-run job")
    assert clone["flowRunId"] == str(run.id)
    until(lambda: c.get(clone["id"])["state"] == "RUNNING", 120, "the re-run job running")
    c.stop(clone["id"])
    final = _final_run(run.id)
    assert final.state_name == "Cancelled" and "cancel-me-retry1" in final.state.message


def test_cli_job_is_a_flow_run_with_lifecycle_task_runs_and_logs(platform):
    p, c = platform
    job_id = c.submit(job_text(0, 1, name="watched"), user="erin")["id"]
    assert c.wait(job_id, timeout=120)["state"] == "SUCCEEDED"
    run = until(lambda: completed(job_id), 120, "the job's flow run Completed")
    names = until(lambda: {"queue", "run-train"} <= (n := task_run_names(run.id))
                  and n, 60, "lifecycle task runs")
    assert names
    assert "epoch 1/1" in until(lambda: flow_logs(run.id), 60, "job logs in Prefect")

    async def artifacts(client):
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        return await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run.id])))

    summary = until(lambda: [a for a in prefect(artifacts) if a.type == "markdown"], 60, "the summary artifact")
    assert "SUCCEEDED" in summary[0].data


def test_jobs_run_while_prefect_is_down_and_the_ui_catches_up(platform):
    p, c = platform
    server = p.prefect_server
    p.restart_prefect = False
    os.killpg(server.pid, signal.SIGKILL)
    until(lambda: not server.alive(), 10, "prefect server dead")
    t0 = time.monotonic()
    job_id = c.submit(job_text(0, 1, name="while-prefect-down"), user="frank")["id"]
    job = c.wait(job_id, timeout=120)
    assert job["state"] == "SUCCEEDED"
    ran_in = time.monotonic() - t0
    assert _try(lambda: flow_run_named(job_id)) is None, "Prefect answered while it should be down"
    p.restart_prefect = True
    until(lambda: p.prefect_server is not server and p.prefect_server.alive(), 120, "prefect server restarted")
    run = until(lambda: _try(lambda: completed(job_id)), 180, "the flow run after Prefect returned")
    assert run.name == job_id
    assert ran_in < 60


def _try(fn):
    try:
        return fn()
    except Exception:
        time.sleep(0.5)
        return None


def test_what_if_replay_from_its_deployment(platform, tmp_path):
    trace = tmp_path / "trace.csv"
    # Generic trace format (apiary.sim): a few jobs on Lab 6's one-VC cluster.
    trace.write_text("submit_s,duration_s,gpus,vc\n0,100,1,default\n10,50,2,default\n20,30,1,default\n")
    params = {"trace": str(trace), "cluster": str(LAB6 / "hived-config-one-vc.yaml"), "policies": ["hived", "quota"],
              "out_dir": str(tmp_path / "out")}

    async def create(client):
        deployment = await client.read_deployment_by_name("what-if-replay/whatif")
        return await client.create_flow_run_from_deployment(deployment.id, parameters=params)

    run = until(lambda: _try(lambda: prefect(create)), 60, "the what-if-replay/whatif deployment")
    final = until(lambda: (r := prefect(lambda cl: cl.read_flow_run(run.id))).state.is_final() and r, 180,
                  "the what-if flow run to finish")
    assert final.state_name == "Completed", final.state.message

    async def artifacts(client):
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        return await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run.id])))

    found = {a.key: a for a in prefect(artifacts)}
    assert found["what-if-summary"].type == "table"
    assert any(k.startswith("what-if-plot") and "data:image/png;base64," in a.data for k, a in found.items())
