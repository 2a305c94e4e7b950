"""A real MLflow server for tests, from MLflow's own venv (``.venv-mlflow``, ``make setup``), with
Apiary's authorization plugin, and a stand-in for Apiary's identity route.

:func:`mlflow_server` runs ``mlflow server`` as :mod:`apiary.marketplace.mlflow_server` builds it
(loopback, basic-auth app, NO_PERMISSIONS) until the block ends; :class:`IdentityStub` answers
``GET /api/v2/mlflow/identity`` from a token -> identity table, as the control plane would.
:data:`needs_mlflow` skips a test when the venv is missing (not under CI=true).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from apiary.marketplace.mlflow_server import MlflowServer, plan, venv_python
from apiary.tracking.prefect_server import free_port

MLFLOW_PYTHON = venv_python()
#: Skips without MLflow's venv, except under CI=true (``make setup`` made it there: a missing one fails).
needs_mlflow = pytest.mark.skipif(
    MLFLOW_PYTHON is None and os.environ.get("CI", "").strip().lower() not in ("true", "1", "yes"),
    reason="MLflow's venv .venv-mlflow is missing (make setup makes it)")


class IdentityStub:
    """Apiary's identity route on loopback: ``tokens`` maps a bearer token to ``{"user", "admin",
    "groups"}``; any other token is a 401. ``calls`` counts the requests."""

    def __init__(self, tokens: dict[str, dict]) -> None:
        self.tokens = tokens
        self.calls = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                stub.calls += 1
                token = self.headers.get("Authorization", "").partition(" ")[2]
                who = stub.tokens.get(token) if self.path == "/api/v2/mlflow/identity" else None
                body = json.dumps(who or {"code": "UnauthorizedUserError", "message": "no"}).encode()
                self.send_response(200 if who else 401)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def mlflow_server(home: Path, api_url: str, apiary_database_url: str | None = None) -> Iterator[MlflowServer]:
    """A started MLflow server for ``home`` whose plugin asks ``api_url`` (its stores beside
    ``apiary_database_url`` when that is PostgreSQL); stopped at the end. Its log is
    ``home/logs/mlflow.log``."""
    assert MLFLOW_PYTHON is not None
    server = plan(home, api_url=api_url, port=free_port(), python=MLFLOW_PYTHON,
                  apiary_database_url=apiary_database_url)
    server.prepare()
    (home / "logs").mkdir(parents=True, exist_ok=True)
    with open(home / "logs" / "mlflow.log", "wb") as log:
        proc = subprocess.Popen(server.argv(), env=server.env(dict(os.environ)), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        server.wait(timeout_s=180, alive=lambda: proc.poll() is None)
        yield server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its workers
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def fake_mlflow(readers: set[str]) -> httpx.MockTransport:
    """An MLflow stand-in for routing tests (httpx transport, no server): one registered model
    ``mnist`` with version 1 (file ``model.npz``), which only bearer tokens in ``readers`` may read;
    MLflow answers others 403 and lists them nothing, as the real one does with NO_PERMISSIONS."""
    run = {"info": {"run_id": "r1", "experiment_id": "1", "status": "FINISHED",
                    "artifact_uri": "mlflow-artifacts:/1/r1/artifacts"},
           "data": {"tags": [{"key": "apiary.job", "value": "alice~x"}], "metrics": []}}
    version = {"name": "mnist", "version": "1", "source": "mlflow-artifacts:/1/r1/artifacts/model", "run_id": "r1",
               "status": "READY"}
    model = {"name": "mnist", "latest_versions": [version]}

    def handle(request: httpx.Request) -> httpx.Response:
        reader = request.headers.get("authorization", "").partition(" ")[2] in readers
        path = request.url.path.removeprefix("/api/2.0/mlflow/")
        if path == "registered-models/search":
            return httpx.Response(200, json={"registered_models": [model]} if reader else {})
        if path == "experiments/search":
            return httpx.Response(200, json={})
        answers = {"registered-models/get": {"registered_model": model},
                   "model-versions/search": {"model_versions": [version]},
                   "model-versions/get": {"model_version": version}, "runs/get": {"run": run},
                   "artifacts/list": {"files": [{"path": "model/model.npz", "is_dir": False, "file_size": 3}]}}
        if not reader:
            return httpx.Response(403, json={"error_code": "PERMISSION_DENIED", "message": "Permission denied"})
        if path in answers and request.url.params.get("name", "mnist") == "mnist":
            return httpx.Response(200, json=answers[path])
        if request.url.path == "/model-versions/get-artifact":
            return httpx.Response(200, content=b"npz")
        return httpx.Response(404, json={"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no"})

    return httpx.MockTransport(handle)
