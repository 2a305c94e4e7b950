"""The ``apiary-job`` flow against a tiny fake Apiary (FastAPI + uvicorn on loopback).

The end-to-end test through ``apiary up`` lives with the control plane; here the fake
implements only ``POST /api/v2/jobs`` and ``GET /api/v2/jobs/{id}`` and records headers.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from apiary.tracking.prefect_server import free_port, start_prefect_server

pytestmark = pytest.mark.prefect

JOB = {
    "protocolVersion": 2,
    "name": "mnist",
    "type": "job",
    "prerequisites": [{"type": "dockerimage", "name": "img", "uri": "python:3.11"}],
    "taskRoles": {
        "train": {
            "instances": 1,
            "dockerImage": "img",
            "resourcePerInstance": {"cpu": 1, "memoryMB": 1024, "gpu": 1},
            "commands": ["python -c 'print(1)'"],
        }
    },
}


class FakeApiary:
    """Jobs go WAITING -> RUNNING -> final on successive GETs; a name containing "fail" FAILs."""

    def __init__(self) -> None:
        self.app = FastAPI()
        self.submissions: list[dict] = []
        self.jobs: dict[str, dict] = {}
        self.gets: dict[str, int] = {}

        @self.app.post("/api/v2/jobs")
        async def submit(request: Request):
            raw = await request.body()
            spec = json.loads(raw) if "json" in request.headers.get("content-type", "") else yaml.safe_load(raw)
            user = request.headers.get("x-apiary-user")
            if not spec.get("taskRoles"):
                return JSONResponse({"code": "InvalidParametersError", "message": "taskRoles: required"}, 400)
            job_id = f"{user}~{spec['name']}"
            self.submissions.append({"spec": spec, "user": user,
                                     "flowRunId": request.headers.get("x-apiary-flow-run-id")})
            self.jobs[job_id] = {"id": job_id, "name": spec["name"], "user": user, "state": "WAITING",
                                 "flowRunId": request.headers.get("x-apiary-flow-run-id"),
                                 "retries": 0, "exitCode": None, "attempt": 0, "tasks": []}
            return JSONResponse({"id": job_id}, 202)

        @self.app.get("/api/v2/jobs/{job_id}")
        async def get(job_id: str):
            if job_id not in self.jobs:
                return JSONResponse({"code": "NoJobError", "message": f"{job_id} not found"}, 404)
            n = self.gets[job_id] = self.gets.get(job_id, 0) + 1
            job = self.jobs[job_id]
            if n == 2:
                job["state"] = "RUNNING"
            elif n >= 3:
                failed = "fail" in job["name"]
                job.update(state="FAILED" if failed else "SUCCEEDED", exitCode=1 if failed else 0)
            return job

    def __enter__(self) -> FakeApiary:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "fake apiary did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    srv = start_prefect_server(tmp_path_factory.mktemp("prefect-server"))
    client_home = tmp_path_factory.mktemp("prefect-client")
    try:
        with temporary_settings(updates={PREFECT_API_URL: srv.api_url, PREFECT_HOME: str(client_home)}):
            yield srv.api_url
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)  # ship queued flow logs before the server goes away
    finally:
        srv.stop()


@pytest.fixture
def fake_apiary(monkeypatch):
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    with FakeApiary() as fake:
        yield fake


def _flow():
    from flows.job import apiary_job

    return apiary_job


def test_flow_submits_with_its_flow_run_id_and_returns_the_job(prefect_api, fake_apiary, monkeypatch):
    from apiary.spec.job import JobSpec

    monkeypatch.setattr("apiary.tracking.submit.asyncio.sleep", _fast_sleep)
    state = asyncio.run(_flow()(job=JobSpec.model_validate(JOB), user="alice", api_url=fake_apiary.url,
                                return_state=True))
    assert state.is_completed()
    job = state.result()
    assert job["id"] == "alice~mnist" and job["state"] == "SUCCEEDED"
    [sub] = fake_apiary.submissions
    assert sub["user"] == "alice"
    assert sub["spec"]["taskRoles"]["train"]["resourcePerInstance"]["memoryMB"] == 1024
    assert sub["flowRunId"] == str(state.state_details.flow_run_id)
    assert asyncio.run(_flow_run_name(state.state_details.flow_run_id)) == "alice~mnist"


def test_flow_fails_when_the_job_fails_and_reads_api_url_from_env(prefect_api, fake_apiary, monkeypatch):
    monkeypatch.setattr("apiary.tracking.submit.asyncio.sleep", _fast_sleep)
    monkeypatch.setenv("APIARY_API_URL", fake_apiary.url)
    spec = {**JOB, "name": "will-fail"}
    state = asyncio.run(_flow()(job=spec, return_state=True))  # a dict is validated into JobSpec
    assert state.is_failed()
    assert "state=FAILED" in state.message
    assert fake_apiary.submissions[0]["user"] == "prefect"


def test_run_form_is_the_job_spec():
    schema = _flow().parameters.model_dump()
    assert schema["required"] == ["job"]
    assert set(schema["properties"]) == {"job", "user", "api_url"}
    spec = schema["definitions"]["JobSpec"]
    assert {"protocolVersion", "name", "taskRoles", "prerequisites", "jobRetryCount"} <= set(spec["properties"])
    role = schema["definitions"]["TaskRole"]
    assert {"instances", "dockerImage", "resourcePerInstance", "commands"} <= set(role["properties"])


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
        rows = asyncio.run(scheduling_loop(api_url=fake.url, cycles=3, interval_s=0.01))
    assert len(calls) == 3
    assert rows[0]["placed"] == "a~x" and rows[1]["waiting"] == "b~y: no gpus"


async def _flow_run_name(flow_run_id) -> str:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return (await client.read_flow_run(flow_run_id)).name


_real_sleep = asyncio.sleep


async def _fast_sleep(_s: float) -> None:
    await _real_sleep(0.01)


def test_serve_builds_both_deployments(monkeypatch):
    import importlib.util
    from pathlib import Path

    monkeypatch.setenv("APIARY_API_URL", "http://127.0.0.1:1")
    path = Path(__file__).resolve().parents[2] / "flows" / "serve.py"
    spec = importlib.util.spec_from_file_location("apiary_flows_serve", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    submit, loop, whatif = mod.deployments()
    assert (submit.name, submit.flow_name) == ("submit", "apiary-job")
    assert (loop.name, loop.flow_name) == ("loop", "scheduling-loop")
    assert (whatif.name, whatif.flow_name) == ("whatif", "what-if-replay")
    assert submit.parameters == {"api_url": "http://127.0.0.1:1"}
    assert loop.schedules[0].schedule.interval.total_seconds() == 60
