"""A tiny fake of Apiary's job API (FastAPI + uvicorn on loopback) for the flow and portal tests.

Implements ``POST /api/v2/jobs`` (409 for a taken name), ``GET /api/v2/jobs/{id}``,
``POST /api/v2/jobs/{id}/clone`` and ``GET /api/v2/cluster/status`` (the user of a submission is
``X-Apiary-On-Behalf-Of``, as the bridge sends it; tokens are not checked), and records what it was
sent. Jobs go WAITING -> RUNNING -> final on successive GETs; a name containing "fail" ends
FAILED with exit code 1. The real control plane is exercised by tests/e2e.
"""

from __future__ import annotations

import json
import re
import threading
import time

import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from apiary.tracking.prefect_server import free_port


class FakeApiary:
    """Use as a context manager; ``url`` is its base URL, ``submissions`` what was POSTed."""

    def __init__(self, virtual_clusters: tuple[str, ...] = ("vc1", "vc2")) -> None:
        self.app = FastAPI()
        self.submissions: list[dict] = []
        self.jobs: dict[str, dict] = {}
        self.specs: dict[str, dict] = {}
        self.gets: dict[str, int] = {}

        def accept(spec: dict, user: str | None, flow_run_id: str | None) -> JSONResponse:
            job_id = f"{user}~{spec['name']}"
            if job_id in self.jobs:
                return JSONResponse({"code": "ConflictError",
                                     "message": f"Job name {spec['name']} already exists for user {user}."}, 409)
            self.submissions.append({"spec": spec, "user": user, "flowRunId": flow_run_id})
            self.specs[job_id] = spec
            self.jobs[job_id] = {"id": job_id, "name": spec["name"], "user": user, "state": "WAITING",
                                 "flowRunId": flow_run_id, "retries": 0, "exitCode": None, "attempt": 0,
                                 "tasks": []}
            return JSONResponse(self.jobs[job_id], 202)

        @self.app.post("/api/v2/jobs")
        async def submit(request: Request):
            raw = await request.body()
            spec = json.loads(raw) if "json" in request.headers.get("content-type", "") else yaml.safe_load(raw)
            if not spec.get("taskRoles"):
                return JSONResponse({"code": "InvalidParametersError", "message": "taskRoles: required"}, 400)
            return accept(spec, request.headers.get("x-apiary-on-behalf-of"),
                          request.headers.get("x-apiary-flow-run-id"))

        @self.app.post("/api/v2/jobs/{job_id}/clone")
        async def clone(job_id: str, request: Request):
            if job_id not in self.jobs:
                return JSONResponse({"code": "NoJobError", "message": f"{job_id} not found"}, 404)
            base = re.sub(r"-retry\d+$", "", self.jobs[job_id]["name"])
            n = 1
            while f"{self.jobs[job_id]['user']}~{base}-retry{n}" in self.jobs:
                n += 1
            spec = {**self.specs[job_id], "name": f"{base}-retry{n}"}
            return accept(spec, self.jobs[job_id]["user"], request.headers.get("x-apiary-flow-run-id"))

        @self.app.get("/api/v2/jobs/{job_id}")
        async def get(job_id: str):
            if job_id not in self.jobs:
                return JSONResponse({"code": "NoJobError", "message": f"{job_id} not found"}, 404)
            n = self.gets[job_id] = self.gets.get(job_id, 0) + 1
            job = self.jobs[job_id]
            if job["state"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                return job
            if n == 2:
                job["state"] = "RUNNING"
            elif n >= 3:
                failed = "fail" in job["name"]
                job.update(state="FAILED" if failed else "SUCCEEDED", exitCode=1 if failed else 0)
            return job

        @self.app.get("/api/v2/cluster/status")
        async def status():
            return {"virtualClusters": {vc: {"quota": 1} for vc in virtual_clusters}}

    def __enter__(self) -> FakeApiary:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:  # startup of an in-process server: nothing else to poll
            assert time.monotonic() < deadline, "fake apiary did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
