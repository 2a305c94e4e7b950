"""The platform's model registry: MLflow's Model Registry read as the caller.

:class:`ModelRegistry` calls the MLflow server (:mod:`apiary.marketplace.mlflow_server`) with the
**caller's own bearer token** (an Apiary user's token; the MLflow plugin maps it to that user), so
MLflow's permissions decide what each caller sees: with ``NO_PERMISSIONS`` by default, a user reads
the models and runs they created or were granted, an Apiary admin everything. It never uses the
MLflow admin's password or any platform credential.

Shapes (JSON as the REST API answers them, camelCase):

- a model: ``{"name", "description", "createdAt", "updatedAt", "latestVersions": [version...]}``;
- a version: ``{"name", "version", "source", "runId", "status", "createdAt"}``; with lineage
  (:meth:`ModelRegistry.version`) also ``"run": {"runId", "experimentId", "status", "url",
  "metrics": {key: last value}, "tags": {apiary.* tags}}`` and ``"job": {"id", "attempt", "task"}``
  from the run's ``apiary.job``, ``apiary.attempt`` and ``apiary.task`` tags (None when the run
  is not a job's, or the caller may not read it);
- a file: ``{"path", "size"}`` (bytes), relative to the version's ``source``.

Errors: MLflow's 401 -> UnauthorizedError; 403 (MLflow refuses a user what they may not read, and
also what does not exist), 404 and ``RESOURCE_DOES_NOT_EXIST`` -> NotFoundError (404: no hint that
another user's model exists); other 4xx -> ValidationError naming the field, and
no answer or a 5xx -> UnavailableError (503). A platform without MLflow
(:class:`ModelRegistry` with ``url=None``) has no models: lists are empty and reads are 404.
"""

from __future__ import annotations

import builtins  # the registry has a method named list
import re
import tarfile
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from apiary.auth import Directory, Principal
from apiary.control.proxy import load_key
from apiary.errors import (
    ForbiddenError,
    NotFoundError,
    UnauthorizedError,
    UnavailableError,
    ValidationError,
)
from apiary.marketplace.identity import MlflowIdentity, MlflowTaskEnv, TaskTokens
from apiary.timefmt import iso

API = "/api/2.0/mlflow"
#: ``NAME`` or ``NAME/VERSION`` (a version is a positive integer).
_NAME_VERSION = re.compile(r"^(?P<name>[^/\s][^/]*?)(?:/(?P<version>[1-9][0-9]*))?$")
#: A download is refused past this many bytes in all (the tar is spooled to disk first).
MAX_DOWNLOAD_BYTES = 2 << 30


def parse_name_version(text: str, field: str = "model") -> tuple[str, str | None]:
    """``"mnist/3"`` -> ``("mnist", "3")``, ``"mnist"`` -> ``("mnist", None)``. Raises ValidationError
    naming ``field`` otherwise."""
    m = _NAME_VERSION.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValidationError(field, f"{text!r} is not NAME or NAME/VERSION (VERSION a positive integer)")
    return m.group("name"), m.group("version")


def _ms(value: Any) -> str | None:
    return iso(int(value) / 1000.0) if value not in (None, "", 0, "0") else None


def _version_json(v: dict) -> dict:
    return {"name": v.get("name"), "version": v.get("version"), "source": v.get("source"),
            "runId": v.get("run_id") or None, "status": v.get("status"), "createdAt": _ms(v.get("creation_timestamp")),
            "description": v.get("description") or ""}


def _model_json(m: dict) -> dict:
    return {"name": m.get("name"), "description": m.get("description") or "",
            "createdAt": _ms(m.get("creation_timestamp")), "updatedAt": _ms(m.get("last_updated_timestamp")),
            "latestVersions": [_version_json(v) for v in m.get("latest_versions") or []]}


class ModelRegistry:
    """Reads of MLflow's Model Registry as the caller (see the module doc). ``url``: the MLflow
    server (None: the platform runs none); ``ui_url``: its UI as people reach it (default ``url``),
    for run links; ``transport``: httpx's, for tests."""

    def __init__(self, url: str | None, ui_url: str | None = None, timeout_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/") if url else None
        self.ui_url = (ui_url or url or "").rstrip("/") or None
        self._http = httpx.Client(timeout=timeout_s, transport=transport) if url else None

    @property
    def enabled(self) -> bool:
        return self._http is not None

    def close(self) -> None:
        if self._http is not None:
            self._http.close()

    # ------------------------------------------------------------------ calls
    def _send(self, token: str | None, method: str, path: str, params: dict | None = None,
              stream: bool = False) -> httpx.Response:
        if self._http is None or self.url is None:
            raise NotFoundError("This platform runs no MLflow server (make setup installs it): there are no models.")
        if not token:
            raise UnauthorizedError("A bearer token is required.")
        req = self._http.build_request(method, self.url + path, params=params,
                                       headers={"Authorization": f"Bearer {token}"})
        try:
            resp = self._http.send(req, stream=stream)
        except httpx.HTTPError as e:
            raise UnavailableError(f"MLflow does not answer at {self.url}: {e}") from e
        if resp.status_code >= 400:
            if stream:
                resp.read()
                resp.close()
            self._raise(resp)
        return resp

    @staticmethod
    def _raise(resp: httpx.Response) -> None:
        try:
            doc = resp.json()
            code, message = str(doc.get("error_code", "")), str(doc.get("message", ""))
        except ValueError:
            code, message = "", resp.text.strip()
        status = resp.status_code
        text = f"MLflow: {message or resp.reason_phrase}"
        if status == 401:
            raise UnauthorizedError(text)
        if status in (403, 404) or code == "RESOURCE_DOES_NOT_EXIST":
            # As for another user's job: no hint that a model the caller may not read exists.
            raise NotFoundError(f"{text}: no such model or version, or MLflow does not let you read it "
                                f"(you read what you created or were granted)")
        if 400 <= status < 500:
            raise ValidationError("model", text)
        raise UnavailableError(f"MLflow answered {status}: {message}")

    def _get(self, token: str | None, endpoint: str, params: dict | None = None) -> dict:
        return self._send(token, "GET", f"{API}/{endpoint}", params).json()

    # ------------------------------------------------------------------ reads
    def list(self, token: str | None) -> builtins.list[dict]:
        """The registered models the caller may read, by name: ``[model]``."""
        if not self.enabled:
            return []
        out: builtins.list[dict] = []
        page: str | None = None
        while True:
            doc = self._get(token, "registered-models/search",
                            {"max_results": 100, **({"page_token": page} if page else {})})
            out += [_model_json(m) for m in doc.get("registered_models") or []]
            page = doc.get("next_page_token")
            if not page:
                return sorted(out, key=lambda m: m["name"])

    def get(self, token: str | None, name: str) -> dict:
        """Model ``name`` with all its versions (``"versions"``, newest first)."""
        model = _model_json(self._get(token, "registered-models/get", {"name": name})["registered_model"])
        quoted = name.replace("'", "\\'")
        doc = self._get(token, "model-versions/search", {"filter": f"name='{quoted}'", "max_results": 1000})
        model["versions"] = sorted((_version_json(v) for v in doc.get("model_versions") or []),
                                   key=lambda v: -int(v["version"] or 0))
        return model

    def version(self, token: str | None, name: str, version: str) -> dict:
        """Version ``version`` of ``name`` with its lineage (``run``, ``job``: see the module doc)."""
        v = _version_json(self._get(token, "model-versions/get", {"name": name, "version": version})["model_version"])
        v["run"], v["job"] = None, None
        if v["runId"]:
            try:
                run = self._get(token, "runs/get", {"run_id": v["runId"]})["run"]
            except NotFoundError:
                return v  # the model is shared with the caller, its run is not
            v["run"] = self._run_json(run)
            tags = v["run"]["tags"]
            if "apiary.job" in tags:
                v["job"] = {"id": tags["apiary.job"], "attempt": tags.get("apiary.attempt"),
                            "task": tags.get("apiary.task")}
        return v

    def _run_json(self, run: dict) -> dict:
        info, data = run.get("info") or {}, run.get("data") or {}
        tags = {t["key"]: t["value"] for t in data.get("tags") or [] if t["key"].startswith(("apiary.", "mlflow.user"))}
        metrics = {m["key"]: m["value"] for m in data.get("metrics") or []}
        eid, rid = info.get("experiment_id"), info.get("run_id")
        return {"runId": rid, "experimentId": eid, "status": info.get("status"), "metrics": metrics, "tags": tags,
                "startedAt": _ms(info.get("start_time")), "endedAt": _ms(info.get("end_time")),
                "url": f"{self.ui_url}/#/experiments/{eid}/runs/{rid}" if self.ui_url else None}

    def files(self, token: str | None, name: str, version: str) -> builtins.list[dict]:
        """The files of the version (``[{"path", "size"}]``, paths relative to its ``source``).
        Listing reads the version's run (the caller needs read on its experiment)."""
        v = self._get(token, "model-versions/get", {"name": name, "version": version})["model_version"]
        run_id, source = v.get("run_id"), v.get("source") or ""
        if not run_id:
            raise NotFoundError(f"Model {name} version {version} has no run to list its files from.")
        root = self._get(token, "runs/get", {"run_id": run_id})["run"]["info"]["artifact_uri"].rstrip("/")
        if not source.startswith(root):
            raise NotFoundError(f"Model {name} version {version}: its source {source} is outside its run's artifacts.")
        base = source[len(root):].strip("/")
        out: builtins.list[dict] = []
        pending = [base]
        while pending:
            path = pending.pop()
            doc = self._get(token, "artifacts/list", {"run_id": run_id, **({"path": path} if path else {})})
            for f in doc.get("files") or []:
                if f.get("is_dir"):
                    pending.append(f["path"])
                else:
                    rel = f["path"][len(base):].lstrip("/") if base else f["path"]
                    out.append({"path": rel, "size": int(f.get("file_size") or 0)})
        return sorted(out, key=lambda f: f["path"])

    def read_file(self, token: str | None, name: str, version: str, path: str) -> Iterator[bytes]:
        """The bytes of file ``path`` (relative to the version's source) in chunks, through
        MLflow's ``model-versions/get-artifact`` (read permission on the model)."""
        resp = self._send(token, "GET", "/model-versions/get-artifact",
                          {"name": name, "version": version, "path": path}, stream=True)
        try:
            yield from resp.iter_bytes()
        finally:
            resp.close()

    def tar(self, token: str | None, name: str, version: str) -> IO[bytes]:
        """The version's files as one uncompressed tar, in a spooled temporary file rewound to its
        start (the caller closes it). Raises ValidationError past :data:`MAX_DOWNLOAD_BYTES`."""
        files = self.files(token, name, version)
        if sum(f["size"] for f in files) > MAX_DOWNLOAD_BYTES:
            raise ValidationError("version", f"model {name}/{version} is larger than {MAX_DOWNLOAD_BYTES} bytes")
        out = tempfile.SpooledTemporaryFile(max_size=64 << 20)
        with tarfile.open(fileobj=out, mode="w") as tar:
            for f in files:
                with tempfile.TemporaryFile() as part:
                    for chunk in self.read_file(token, name, version, f["path"]):
                        part.write(chunk)
                    info = tarfile.TarInfo(f["path"])
                    info.size, info.mtime, info.mode = part.tell(), int(time.time()), 0o644
                    part.seek(0)
                    tar.addfile(info, part)
        out.seek(0)
        return out

    def resolve(self, name_version: str, token: str | None) -> str:
        """``models:/NAME/VERSION`` for a version the caller (``token``) may read; ``NAME`` alone
        is its latest version. Raises ValidationError for bad text, NotFoundError for a version that
        does not exist or the caller may not read."""
        name, version = parse_name_version(name_version)
        if version is None:
            versions = self.get(token, name)["versions"]
            if not versions:
                raise NotFoundError(f"Model {name} has no version.")
            version = versions[0]["version"]
        else:
            self._get(token, "model-versions/get", {"name": name, "version": version})
        return f"models:/{urllib.parse.quote(name)}/{version}"

    def job_runs(self, token: str | None, job_id: str) -> builtins.list[dict]:
        """The MLflow runs of job ``job_id`` (tag ``apiary.job``) the caller may read, newest
        first, as the lineage's ``run`` objects; [] without MLflow or when MLflow does not answer."""
        if not self.enabled or not token:
            return []
        try:
            experiments = [e["experiment_id"] for e in
                           self._get(token, "experiments/search", {"max_results": 1000}).get("experiments") or []]
            if not experiments:
                return []
            quoted = job_id.replace("'", "\\'")
            doc = self._post(
                token, "runs/search", {"experiment_ids": experiments, "filter": f"tags.`apiary.job` = '{quoted}'",
                                       "max_results": 100, "order_by": ["attributes.start_time DESC"]})
        except (UnavailableError, UnauthorizedError, ForbiddenError, NotFoundError, ValidationError):
            return []
        return [self._run_json(r) for r in doc.get("runs") or []]

    def _post(self, token: str | None, endpoint: str, body: dict) -> dict:
        if self._http is None or self.url is None:
            raise NotFoundError("This platform runs no MLflow server.")
        try:
            resp = self._http.post(f"{self.url}{API}/{endpoint}", json=body,
                                   headers={"Authorization": f"Bearer {token}"})
        except httpx.HTTPError as e:
            raise UnavailableError(f"MLflow does not answer at {self.url}: {e}") from e
        if resp.status_code >= 400:
            self._raise(resp)
        return resp.json()


@dataclass
class ModelRegistryParts:
    """What the control-plane process needs of the model registry (:func:`build`): the registry
    read as callers, who a token is for MLflow's plugin, what each launch gets (None without
    MLflow) and the templates' :data:`~apiary.marketplace.templates.ModelResolver`."""

    registry: ModelRegistry
    identity: MlflowIdentity
    task_env: MlflowTaskEnv | None
    resolve: Callable[[str, Principal], str]


def build(sessions: sessionmaker[Session], directory: Directory, key_path: Path, *, mlflow_url: str | None,
          ui_url: str | None = None, clock: Callable[[], float] = time.time) -> ModelRegistryParts:
    """The model registry's parts for one control plane. ``key_path``: the tasks' MLflow key
    (``home/credentials/mlflow-task.key``, made 0600 if missing); ``mlflow_url``: the tracking
    server as the control plane and the tasks reach it (None: the platform runs no MLflow)."""
    tokens = TaskTokens(load_key(key_path))
    registry = ModelRegistry(mlflow_url, ui_url)

    def resolve(name_version: str, principal: Principal) -> str:
        # Asked as the principal: a credential of theirs for a minute, verified by the identity route.
        return registry.resolve(name_version, tokens.issue_user(principal.name, clock()))

    return ModelRegistryParts(registry, MlflowIdentity(sessions, directory, tokens, clock),
                              MlflowTaskEnv(mlflow_url, tokens) if mlflow_url else None, resolve)
