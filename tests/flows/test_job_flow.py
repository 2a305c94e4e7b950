"""The ``apiary-job`` flows against a real Prefect server and a fake Apiary (tests/support/fake_apiary.py).

The end-to-end tests through ``apiary up`` live in tests/e2e (test_prefect_e2e.py, test_portal_browser.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
from tests.support.fake_apiary import FakeApiary

from apiary.tracking.portal import TaskRoleForm

pytestmark = pytest.mark.prefect

ROLE = TaskRoleForm(name="train", instances=1, gpus=1, cpu=1, memory_mb=1024, image="python:3.11",
                    commands=["python -c 'print(1)'"])


@pytest.fixture
def fake_apiary(monkeypatch):
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    monkeypatch.setattr("apiary.tracking.submit.asyncio.sleep", _fast_sleep)
    with FakeApiary() as fake:
        monkeypatch.setenv("APIARY_API_URL", fake.url)  # the platform's URL: the flows take none
        yield fake


_real_sleep = asyncio.sleep


async def _fast_sleep(_s: float) -> None:
    await _real_sleep(0.01)


async def _flow_run(flow_run_id):
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return await client.read_flow_run(flow_run_id)


def test_form_run_submits_the_job_with_its_flow_run_id_and_ends_completed(prefect_api, fake_apiary):
    from flows.job import submit_form

    state = asyncio.run(submit_form(name="mnist", user="alice", virtual_cluster="vc2", task_roles=[ROLE],
                                    priority_class="prod", return_state=True))
    assert state.type.value == "COMPLETED" and state.name == "Completed"
    assert "alice~mnist: job SUCCEEDED" in state.message
    [sub] = fake_apiary.submissions
    spec = sub["spec"]
    assert (spec["protocolVersion"], spec["type"], spec["name"]) == (2, "job", "mnist")
    assert spec["defaults"]["virtualCluster"] == "vc2"
    assert spec["extras"]["hivedScheduler"]["jobPriorityClass"] == "prod"
    assert spec["taskRoles"]["train"]["resourcePerInstance"] == {"gpu": 1, "cpu": 1, "memoryMB": 1024}
    assert sub["user"] == "alice" and sub["flowRunId"] == str(state.state_details.flow_run_id)
    assert asyncio.run(_flow_run(state.state_details.flow_run_id)).name == "alice~mnist"


def test_failed_job_ends_failed_with_exit_code_meaning_and_url_from_env(prefect_api, fake_apiary, monkeypatch):
    from flows.job import submit_yaml

    monkeypatch.setenv("APIARY_API_URL", fake_apiary.url)
    text = ("protocolVersion: 2\nname: will-fail\ntype: job\ntaskRoles:\n  train:\n    instances: 1\n"
            "    commands: [exit 1]\n")
    state = asyncio.run(submit_yaml(job_yaml=text, user="bob", return_state=True))
    assert state.type.value == "FAILED"
    assert "exit code 1: PAIRuntimeExitAbnormally" in state.message
    assert fake_apiary.submissions[0]["user"] == "bob"


def test_rerun_of_a_finished_job_submits_a_clone_attached_to_the_same_run(prefect_api, fake_apiary):
    """What Retry does: the run executes again, finds its job ended, and follows a copy."""
    from flows.job import rerun_job, submit_form

    first = asyncio.run(submit_form(name="again", user="carol", virtual_cluster="vc1", task_roles=[ROLE],
                                    return_state=True))
    assert first.is_completed()
    state = asyncio.run(rerun_job(job_id="carol~again", return_state=True))
    assert state.is_completed() and "carol~again-retry1" in state.message
    assert [s["spec"]["name"] for s in fake_apiary.submissions] == ["again", "again-retry1"]
    assert fake_apiary.submissions[1]["flowRunId"] == str(state.state_details.flow_run_id)


def test_taken_name_of_another_run_is_the_apis_conflict(prefect_api, fake_apiary):
    from flows.job import submit_form

    kw = {"name": "dup", "user": "dan", "virtual_cluster": "vc1", "task_roles": [ROLE]}
    assert asyncio.run(submit_form(**kw, return_state=True)).is_completed()
    state = asyncio.run(submit_form(**kw, return_state=True))
    assert state.is_failed() and "already exists" in state.message


def test_scheduling_flow_records_decisions(prefect_api, monkeypatch):
    from fastapi import FastAPI
    from flows.scheduling import scheduling_loop

    fake = FakeApiary()
    calls = []

    @fake.app.post("/api/v2/scheduler/cycle")
    async def cycle():
        calls.append(1)
        return {"placed": ["a~x"] if len(calls) == 1 else [], "preempted": [], "waiting": {"b~y": "no gpus"},
                "durationMs": 1.5}

    assert isinstance(fake.app, FastAPI)
    with fake:
        monkeypatch.setenv("APIARY_API_URL", fake.url)
        rows = asyncio.run(scheduling_loop(cycles=3, interval_s=0.01))
    assert len(calls) == 3
    assert rows[0]["placed"] == "a~x" and rows[1]["waiting"] == "b~y: no gpus"


def _serve_module():
    path = Path(__file__).resolve().parents[2] / "flows" / "serve.py"
    spec = importlib.util.spec_from_file_location("apiary_flows_serve", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_serve_builds_the_deployments_with_a_form_and_no_schedule(monkeypatch):
    with FakeApiary(virtual_clusters=("vc1", "vc2")) as fake:
        monkeypatch.setenv("APIARY_API_URL", fake.url)
        submit, yaml_submit, job, loop, whatif = _serve_module().deployments()
    assert [(d.flow_name, d.name) for d in (submit, yaml_submit, job, loop, whatif)] == [
        ("apiary-job", "submit"), ("apiary-job", "submit-yaml"), ("apiary-job", "job"),
        ("scheduling-loop", "loop"), ("what-if-replay", "whatif")]
    assert not loop.schedules  # no flow run per minute in the runs list
    props = submit._parameter_openapi_schema.model_dump()["properties"]
    assert props["virtual_cluster"]["enum"] == ["vc1", "vc2"] and props["virtual_cluster"]["title"] == "Virtual cluster"
    assert "protocolVersion" not in props and "type" not in props  # constants are filled in, not asked
    assert props["priority_class"]["enum"] == ["crit", "prod", "test", "oppo"]
    assert "api_url" not in submit.parameters and submit.parameters["task_roles"][0]["gpus"] == 1
    assert set(job._parameter_openapi_schema.model_dump()["properties"]) == {"job_id"}
    assert "api_url" not in props  # the flows reach the platform's own URL; no run names one


def test_drill_schedules_are_paused_unless_the_platform_asks_for_them(monkeypatch):
    """A platform started by a test or the demo must not get probe jobs every 5 minutes; `apiary up`
    sets APIARY_DRILL_SCHEDULES=1."""
    serve = _serve_module()
    monkeypatch.delenv("APIARY_DRILL_SCHEDULES", raising=False)
    paused = serve.drill_deployments()
    assert [d.name for d in paused] == ["inspection", "nightly", "weekly", "weekly"]
    assert all(d.paused and d.schedules for d in paused)
    monkeypatch.setenv("APIARY_DRILL_SCHEDULES", "1")
    assert not any(d.paused for d in serve.drill_deployments())


def test_runbooks_and_the_alert_quality_report_are_served(monkeypatch):
    """The response rules name runbook/<name>: those deployments exist, with the runbook chosen by
    parameter; the weekly report is paused like the drills unless the platform asks for schedules."""
    serve = _serve_module()
    monkeypatch.delenv("APIARY_DRILL_SCHEDULES", raising=False)
    ops = serve.ops_deployments()
    assert [(d.flow_name, d.name) for d in ops] == [("runbook", "gpu-node-repair"), ("runbook", "node-drain"),
                                                    ("alert-quality", "weekly")]
    assert [d.parameters for d in ops[:2]] == [{"which": "gpu-node-repair"}, {"which": "node-drain"}]
    assert ops[2].paused and ops[2].schedules
    from apiary.incidents.rules import default_response_rules

    named = {r.runbook for r in default_response_rules().rules if r.runbook}
    assert named <= {f"{d.flow_name}/{d.name}" for d in ops}
