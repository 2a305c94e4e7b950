"""The portal's pure parts and its run logic against a fake Apiary (no Prefect server)."""

from __future__ import annotations

import asyncio

import pytest
from tests.support.fake_apiary import FakeApiary

from apiary.errors import ConflictError, UserError
from apiary.spec.job import JobSpec
from apiary.tracking.portal import TaskRoleForm, form_schema, job_from_form, run_job


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    """A fake Apiary, behind a (notionally) protected Prefect server: the form's user is trusted."""
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "apiary:test")
    with FakeApiary() as f:
        monkeypatch.setenv("APIARY_API_URL", f.url)
        yield f


def test_an_unprotected_prefect_server_cannot_submit_for_a_user(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    with FakeApiary() as f, pytest.raises(UserError, match="not protected"):
        monkeypatch.setenv("APIARY_API_URL", f.url)
        run(flow_run_id="run-0", job={"name": "x", "taskRoles": {}}, user="alice")
    assert f.submissions == []


def run(**kw):
    return asyncio.run(run_job(poll_s=0.01, **kw))


def test_form_becomes_a_valid_openpai_job_with_constants_filled_in():
    roles = [TaskRoleForm(name="worker", instances=2, gpus=2, cpu=4, memory_mb=8192, image="img:a",
                          commands=["python train.py"]),
             TaskRoleForm(name="ps", instances=1, gpus=0, image="img:b", commands=["python ps.py"])]
    wire = job_from_form("dist", "vc1", roles, priority_class="prod", retries=2)
    spec = JobSpec.model_validate(wire)
    assert (spec.name, spec.virtual_cluster, spec.priority_class, spec.job_retry_count) == ("dist", "vc1", "prod", 2)
    assert wire["protocolVersion"] == 2 and wire["type"] == "job"
    assert [p["uri"] for p in wire["prerequisites"]] == ["img:a", "img:b"]
    assert wire["taskRoles"]["ps"]["dockerImage"] == "image-1"
    assert wire["taskRoles"]["worker"]["resourcePerInstance"] == {"gpu": 2, "cpu": 4, "memoryMB": 8192}


def test_task_role_fields_reject_what_a_person_can_get_wrong():
    with pytest.raises(ValueError, match="instances"):
        TaskRoleForm(instances=0, commands=["x"])
    with pytest.raises(ValueError, match="commands"):
        TaskRoleForm(commands=[])
    with pytest.raises(ValueError, match="name"):
        TaskRoleForm(name="has space", commands=["x"])


def test_form_schema_titles_fields_and_offers_the_clusters_vcs():
    schema = {"properties": {"name": {"title": "name", "type": "string"},
                             "virtual_cluster": {"title": "virtual_cluster", "type": "string"},
                             "task_roles": {"title": "task_roles", "type": "array"}}}
    out = form_schema(schema, ["vc2", "vc1"])
    props = out["properties"]
    assert props["name"]["title"] == "Job name" and props["name"]["pattern"]
    assert props["virtual_cluster"]["enum"] == ["vc1", "vc2"] and "default" not in props["virtual_cluster"]
    assert props["task_roles"]["minItems"] == 1
    assert schema["properties"]["name"]["title"] == "name"  # the input is not changed
    assert form_schema(schema, ["only"])["properties"]["virtual_cluster"]["default"] == "only"


def test_run_submits_then_a_second_run_of_the_same_flow_run_re_runs_the_ended_job(fake):
    job = job_from_form("train", "vc1", [TaskRoleForm(commands=["true"])])
    first = run(flow_run_id="run-1", job=job, user="alice")
    assert first["id"] == "alice~train" and first["state"] == "SUCCEEDED"
    again = run(flow_run_id="run-1", job=job, user="alice")
    assert again["id"] == "alice~train-retry1"
    third = run(flow_run_id="run-1", job_id="alice~train-retry1")
    assert third["id"] == "alice~train-retry2"  # a chain of retries stays flat
    assert [s["flowRunId"] for s in fake.submissions] == ["run-1"] * 3


def test_a_job_still_running_is_followed_not_cloned(fake):
    job = job_from_form("long", "vc1", [TaskRoleForm(commands=["sleep 1"])])
    run(flow_run_id="run-2", job=job, user="bob")
    fake.jobs["bob~long"]["state"] = "RUNNING"  # as if the flow process restarted mid-job
    fake.gets["bob~long"] = 1
    out = run(flow_run_id="run-2", job_id="bob~long")
    assert out["id"] == "bob~long" and len(fake.submissions) == 1


def test_name_taken_by_another_run_is_a_conflict_and_bad_input_a_user_error(fake):
    job = job_from_form("mine", "vc1", [TaskRoleForm(commands=["true"])])
    run(flow_run_id="run-3", job=job, user="carol")
    with pytest.raises(ConflictError, match="already exists"):
        run(flow_run_id="other-run", job=job, user="carol")
    with pytest.raises(UserError, match="taskRoles"):
        run(flow_run_id="r", job={"name": "x"}, user="carol")
    with pytest.raises(UserError, match="either"):
        run(flow_run_id="r")
