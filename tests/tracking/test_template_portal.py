"""The ``apiary-template`` runs' logic (apiary.tracking.portal) without Prefect: a run submits the
template's job through the real API on behalf of its user, attached to its flow run, follows it to
its end, and a second execution of the same run (Retry) re-runs the ended job instead of failing on
its name; and the run form flows/serve.py makes for each template."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6
from tests.support.polling import until
from tests.support.serving import serving

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.errors import NotFoundError, UserError
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory
from apiary.tracking.portal import run_template_job, template_form_schema, template_job_name

REPO = Path(__file__).resolve().parents[2]
T = "/api/v2/templates"

JOB = yaml.safe_dump({
    "protocolVersion": 2, "name": "train", "type": "job", "parameters": {"epochs": 2},
    "prerequisites": [{"protocolVersion": 2, "name": "img", "type": "dockerimage", "uri": "python:3.11"}],
    "taskRoles": {"train": {"instances": 1, "dockerImage": "img",
                            "resourcePerInstance": {"cpu": 1, "memoryMB": 512, "gpu": 1},
                            "commands": ["echo <% $parameters.epochs %>"]}},
    "defaults": {"virtualCluster": "default"}}, sort_keys=False)


@pytest.fixture
def platform(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    directory = Directory(plane.sessions)
    p = Principals(directory, ["default"])
    directory.create_group("team-a", virtual_clusters=["default"])
    tokens = {"eve": p.user("eve", groups=("team-a",)), "alice": p.user("alice"), "admin": p.admin(),
              "bridge": p.service("bridge")}
    app = create_app(plane, directory=directory)
    with serving(app) as url:
        admin = TestClient(app, base_url=url)
        r = admin.post(T, json={"name": "train", "summary": "s", "job": JOB, "visibility": {"groups": ["team-a"]}},
                       headers=bearer(tokens["admin"]))
        assert r.status_code == 201, r.text
        monkeypatch.setenv("APIARY_API_URL", url)
        monkeypatch.setenv("APIARY_TOKEN", tokens["bridge"])
        monkeypatch.setenv("PREFECT_API_AUTH_STRING", "user:password")  # the run form's user is trusted
        yield url, admin, tokens


def _in_thread(**kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["job"] = asyncio.run(run_template_job(poll_s=0.05, timeout_s=60, **kw))
        except Exception as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def _stop_when_submitted(admin: TestClient, tokens: dict[str, str], job_id: str) -> dict:
    job = until(lambda: (lambda r: r.json() if r.status_code == 200 else None)(
        admin.get(f"/api/v2/jobs/{job_id}", headers=bearer(tokens["admin"]))), 30, f"job {job_id}")
    r = admin.put(f"/api/v2/jobs/{job_id}/executionType", json={"value": "STOP"}, headers=bearer(tokens["admin"]))
    assert r.status_code == 200, r.text
    return job


def test_a_run_submits_for_its_user_follows_the_job_and_a_retry_reruns_it(platform) -> None:
    _url, admin, tokens = platform
    flow_run_id = str(uuid.uuid4())
    name = template_job_name("train", flow_run_id)
    assert name == f"train-{flow_run_id.replace('-', '')[:8]}"

    thread, out = _in_thread(flow_run_id=flow_run_id, template="train", user="eve", values={"epochs": 4})
    job = _stop_when_submitted(admin, tokens, f"eve~{name}")
    assert job["flowRunId"] == flow_run_id
    thread.join(60)
    assert "error" not in out, out
    assert out["job"]["id"] == f"eve~{name}" and out["job"]["state"] == "STOPPED"

    # The same run executed again (Retry): the name is taken by its own ended job, so it is re-run.
    thread, out = _in_thread(flow_run_id=flow_run_id, template="train", user="eve")
    again = _stop_when_submitted(admin, tokens, f"eve~{name}-retry1")
    assert again["flowRunId"] == flow_run_id
    thread.join(60)
    assert "error" not in out, out
    assert out["job"]["id"] == f"eve~{name}-retry1"


def test_a_user_who_does_not_see_the_template_gets_its_404_and_no_job(platform) -> None:
    _url, admin, tokens = platform
    with pytest.raises(NotFoundError, match="Template train not found"):
        asyncio.run(run_template_job(flow_run_id=str(uuid.uuid4()), template="train", user="alice",
                                     job_name="named"))
    assert admin.get("/api/v2/jobs", headers=bearer(tokens["admin"])).json() == []


def test_a_run_on_an_unprotected_prefect_is_refused(platform, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_API_AUTH_STRING")
    from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings

    with temporary_settings(updates={PREFECT_API_AUTH_STRING: None}), pytest.raises(UserError, match="not protected"):
        asyncio.run(run_template_job(flow_run_id=None, template="train", user="eve"))


TEMPLATE_JSON = {
    "name": "mnist", "summary": "Train mnist", "description": "# MNIST", "official": True, "tags": ["mnist"],
    "parameters": [
        {"name": "epochs", "type": "integer", "default": 5, "title": "Epochs", "minimum": 1, "maximum": 200},
        {"name": "lr", "type": "number", "default": 0.01},
        {"name": "amp", "type": "boolean", "default": False},
        {"name": "optimizer", "type": "string", "default": "adam", "enum": ["adam", "sgd"]},
        {"name": "base", "type": "model", "default": "mnist/1"},
    ],
}


def test_the_run_form_has_each_parameter_with_its_type_default_and_bounds() -> None:
    schema = template_form_schema(TEMPLATE_JSON)
    props = schema["properties"]
    assert schema["required"] == ["template", "user"]
    assert props["template"]["enum"] == ["mnist"] and props["user"]["pattern"]
    params = props["parameters"]["properties"]
    assert params["epochs"] == {"type": "integer", "title": "Epochs", "default": 5, "minimum": 1, "maximum": 200}
    assert (params["lr"]["type"], params["amp"]["type"], params["optimizer"]["enum"]) == ("number", "boolean",
                                                                                         ["adam", "sgd"])
    assert params["base"]["type"] == "string" and params["base"]["pattern"]
    assert props["parameters"]["default"] == {"epochs": 5, "lr": 0.01, "amp": False, "optimizer": "adam",
                                              "base": "mnist/1"}


def test_serve_makes_one_deployment_per_template_opened_at_its_defaults() -> None:
    spec = importlib.util.spec_from_file_location("apiary_flows_serve_templates", REPO / "flows" / "serve.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    [d] = mod.template_deployments([TEMPLATE_JSON])
    assert (d.flow_name, d.name) == ("apiary-template", "mnist")
    assert d.parameters["template"] == "mnist" and d.parameters["parameters"]["epochs"] == 5
    props = d._parameter_openapi_schema.model_dump()["properties"]
    assert set(props) == {"template", "user", "parameters", "job_name"}
    assert "api_url" not in props  # the flows reach the platform's own URL only
    import template as template_flow  # flows/, put on sys.path by serve.py

    template_flow.run_template.validate_parameters({**d.parameters, "user": "eve"})
    with pytest.raises(Exception):  # noqa: B017 - Prefect's ParameterTypeError: no run starts
        template_flow.run_template.validate_parameters({**d.parameters, "user": "eve", "api_url": "http://x"})
