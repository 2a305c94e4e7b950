"""A tiny MLflow client over MLflow's documented REST API (2.0), standard library only.

The tasks' Python has no ``mlflow`` package, so :mod:`main` logs through this module when
``MLFLOW_TRACKING_URI`` is set. It reads the variables MLflow's own clients read:
``MLFLOW_TRACKING_URI`` (the server), ``MLFLOW_TRACKING_TOKEN`` (sent as ``Authorization: Bearer``)
and ``MLFLOW_EXPERIMENT_NAME``. Calls used: ``experiments/get-by-name`` and ``create``,
``runs/create``, ``runs/log-batch``, ``runs/update``, ``registered-models/get`` and ``create``,
``model-versions/create``, and artifact uploads through the server's ``--serve-artifacts`` proxy
(``PUT /api/2.0/mlflow-artifacts/artifacts/<experiment id>/<run id>/artifacts/<path>``).

Errors: :class:`MlflowError` with the HTTP status and MLflow's ``error_code`` (e.g.
``RESOURCE_DOES_NOT_EXIST``); a server that does not answer (or answers 503) is retried after 1,
2, 4 and 8 s, then raises ``OSError`` (or :class:`MlflowError`).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

API = "/api/2.0/mlflow"
ARTIFACTS = "/api/2.0/mlflow-artifacts/artifacts"


class MlflowError(Exception):
    """MLflow refused a call: ``status`` (HTTP), ``code`` (MLflow's ``error_code`` or ``""``)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"MLflow answered {status} {code}: {message}")
        self.status, self.code = status, code


class Client:
    """Calls to one tracking server. ``uri``: ``http(s)://host:port``; ``token``: the bearer token
    (None: no Authorization header); ``timeout_s`` per call."""

    def __init__(self, uri: str, token: str | None = None, timeout_s: float = 60.0,
                 retry_delays_s: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)) -> None:
        self.uri = uri.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        #: Waits before the retries of a call the server did not answer, or answered 503.
        self.retry_delays_s = retry_delays_s

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Client | None:
        """A client of ``MLFLOW_TRACKING_URI`` with ``MLFLOW_TRACKING_TOKEN``, or None when the URI
        is unset or not HTTP(S)."""
        env = dict(os.environ) if env is None else env
        uri = env.get("MLFLOW_TRACKING_URI", "")
        if not uri.startswith(("http://", "https://")):
            return None
        return cls(uri, env.get("MLFLOW_TRACKING_TOKEN") or None)

    def _request(self, method: str, path: str, body: bytes | None, content_type: str) -> bytes:
        headers = {"Content-Type": content_type}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.uri + path, data=body, method=method, headers=headers)
        for delay in (*self.retry_delays_s, None):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return resp.read()
            except urllib.error.HTTPError as e:
                if e.code != 503 or delay is None:
                    self._raise(e)
            except urllib.error.URLError:  # not answering (yet): the server may be restarting
                if delay is None:
                    raise
            time.sleep(delay)
        raise AssertionError("unreachable")

    @staticmethod
    def _raise(e: urllib.error.HTTPError) -> None:
        try:
            text = e.read().decode(errors="replace")
        except OSError:
            text = ""
        try:
            doc = json.loads(text)
            code, message = doc.get("error_code", ""), doc.get("message", text)
        except (ValueError, AttributeError):
            code, message = "", text.strip()
        raise MlflowError(e.code, code, message) from None

    def call(self, method: str, endpoint: str, body: dict | None = None, query: dict | None = None) -> dict:
        """One JSON call of ``/api/2.0/mlflow/<endpoint>``; returns the decoded answer."""
        path = f"{API}/{endpoint}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        raw = self._request(method, path, data, "application/json")
        return json.loads(raw) if raw else {}

    # ------------------------------------------------------------------ tracking
    def experiment_id(self, name: str) -> str:
        """The id of experiment ``name``, created if missing."""
        try:
            return self.call("GET", "experiments/get-by-name", query={"experiment_name": name})["experiment"][
                "experiment_id"]
        except MlflowError as e:
            if e.code != "RESOURCE_DOES_NOT_EXIST":
                raise
        try:
            return self.call("POST", "experiments/create", {"name": name})["experiment_id"]
        except MlflowError as e:  # created by a peer meanwhile
            if e.code != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.call("GET", "experiments/get-by-name", query={"experiment_name": name})["experiment"][
                "experiment_id"]

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str]) -> dict:
        """A new RUNNING run; returns its ``info`` (``run_id``, ``artifact_uri``, ...)."""
        body = {"experiment_id": experiment_id, "run_name": name, "start_time": int(time.time() * 1000),
                "tags": [{"key": k, "value": str(v)} for k, v in tags.items()]}
        return self.call("POST", "runs/create", body)["run"]["info"]

    def log_batch(self, run_id: str, metrics: dict[str, float] | None = None, params: dict[str, object] | None = None,
                  step: int = 0) -> None:
        """Log ``metrics`` at ``step`` (now) and ``params`` (as strings) in one call."""
        now = int(time.time() * 1000)
        self.call("POST", "runs/log-batch", {
            "run_id": run_id,
            "metrics": [{"key": k, "value": float(v), "timestamp": now, "step": step}
                        for k, v in (metrics or {}).items()],
            "params": [{"key": k, "value": str(v)} for k, v in (params or {}).items()],
        })

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Set the run's status (FINISHED, FAILED, KILLED) and end time."""
        self.call("POST", "runs/update", {"run_id": run_id, "status": status, "end_time": int(time.time() * 1000)})

    def upload_artifact(self, info: dict, local: Path, artifact_path: str) -> None:
        """Upload file ``local`` as ``<artifact_path>/<its name>`` of the run (``info`` from
        :meth:`create_run`), through the server's artifact proxy. The run's ``artifact_uri`` must be
        ``mlflow-artifacts:/...`` (a server started with ``--serve-artifacts``)."""
        uri = info["artifact_uri"]
        prefix = "mlflow-artifacts:"
        if not uri.startswith(prefix):
            raise MlflowError(0, "", f"artifact URI {uri!r} is not served by the tracking server")
        rel = urllib.parse.urlparse(uri).path.lstrip("/")
        target = "/".join(p for p in (rel, artifact_path.strip("/"), local.name) if p)
        self._request("PUT", f"{ARTIFACTS}/{urllib.parse.quote(target)}", local.read_bytes(),
                      "application/octet-stream")

    # ------------------------------------------------------------------ registry
    def register_version(self, name: str, source: str, run_id: str) -> dict:
        """A new version of registered model ``name`` (created if missing) from ``source`` (an
        artifact URI) of run ``run_id``; returns the ``model_version`` (``version``, ``status``)."""
        try:
            self.call("POST", "registered-models/create", {"name": name})
        except MlflowError as e:
            if e.code != "RESOURCE_ALREADY_EXISTS":
                raise
        return self.call("POST", "model-versions/create", {"name": name, "source": source, "run_id": run_id})[
            "model_version"]


    def download_model_file(self, uri: str, filename: str, dest: Path) -> Path:
        """Download file ``filename`` of registered model version ``uri`` (``models:/NAME/VERSION``,
        as the platform resolves a template's model parameter) into directory ``dest``; returns its
        path. Asks the registry where the version's files are (``model-versions/get-download-uri``)
        and reads them through the server's artifact proxy. Raises ValueError for a URI of another
        form, MlflowError for the registry's refusal (no such version, no permission)."""
        match = re.fullmatch(r"models:/([^/]+)/([0-9]+)", uri)
        if match is None:
            raise ValueError(f"{uri!r} is not a registered model version models:/NAME/VERSION")
        name, version = urllib.parse.unquote(match[1]), match[2]
        source = self.call("GET", "model-versions/get-download-uri", query={"name": name, "version": version})[
            "artifact_uri"]
        if not source.startswith("mlflow-artifacts:"):
            raise MlflowError(0, "", f"model {name}/{version} is at {source!r}, not served by the tracking server")
        rel = urllib.parse.urlparse(source).path.strip("/")
        data = self._request("GET", f"{ARTIFACTS}/{urllib.parse.quote(rel + '/' + filename)}", None,
                             "application/octet-stream")
        path = dest / filename
        path.write_bytes(data)
        return path


def task_tags(env: dict[str, str], source: str) -> dict[str, str]:
    """The tags of a run started by an Apiary task: ``apiary.job``, ``apiary.attempt``,
    ``apiary.task`` (``<role>/<index>``) from the task's environment when there, and
    ``mlflow.user`` / ``mlflow.source.name`` as MLflow's own clients set them."""
    tags = {"mlflow.source.name": source, "mlflow.source.type": "JOB",
            "mlflow.user": env.get("PAI_USER_NAME") or env.get("USER") or "unknown"}
    if env.get("APIARY_JOB_ID"):
        tags["apiary.job"] = env["APIARY_JOB_ID"]
    if env.get("PAI_JOB_ATTEMPT_ID"):
        tags["apiary.attempt"] = env["PAI_JOB_ATTEMPT_ID"]
    role = env.get("PAI_CURRENT_TASK_ROLE_NAME")
    if role:
        tags["apiary.task"] = f"{role}/{env.get('PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX', '0')}"
    return tags
