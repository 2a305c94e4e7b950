"""A small synchronous client of Apiary's REST API, used by the CLI, the demo and tests."""

from __future__ import annotations

import builtins  # the client has a method named list
import time
from pathlib import Path
from typing import Any

import httpx

from apiary.errors import UnavailableError, error_from_response


class ApiaryClient:
    """Calls ``api_url`` (``http://127.0.0.1:PORT``) with ``token`` (``Authorization: Bearer``;
    the caller's identity: a user, a node agent or a service). Error answers come back as the
    :mod:`apiary.errors` class of :func:`~apiary.errors.error_from_response`, carrying the server's
    message and status; an unreachable server raises UnavailableError."""

    def __init__(self, api_url: str, timeout: float = 30.0, transport: httpx.BaseTransport | None = None,
                 token: str | None = None) -> None:
        self.api_url = api_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # transport: tests pass httpx.MockTransport.
        self._http = httpx.Client(base_url=self.api_url, timeout=timeout, transport=transport, headers=headers)

    def as_token(self, token: str) -> ApiaryClient:
        """Another client of the same API with another identity."""
        return ApiaryClient(self.api_url, timeout=self._http.timeout.read or 30.0, token=token)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise UnavailableError(f"Apiary API at {self.api_url} is not reachable: {e}") from e
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content)
        return r

    def health(self) -> dict:
        """``GET /healthz``'s body: ``status`` ``ok`` or ``unhealthy`` (with ``reason``), and
        ``clusterId``. An unhealthy platform (503 with a body) is answered, not raised: it is still
        the platform a home names. Raises :class:`UnavailableError` when unreachable."""
        try:
            r = self._http.request("GET", "/healthz")
        except httpx.TransportError as e:
            raise UnavailableError(f"Apiary API at {self.api_url} is not reachable: {e}") from e
        if r.status_code == 503:
            try:
                body = r.json()
            except ValueError:
                body = None
            if isinstance(body, dict) and "clusterId" in body:
                return body
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content)
        return r.json()

    def submit(self, job: str | Path, flow_run_id: str | None = None, on_behalf_of: str | None = None) -> dict:
        """Submit a job as the token's user (``on_behalf_of``: the bridge's token only)."""
        text = Path(job).read_text() if isinstance(job, Path) else job
        headers = {"Content-Type": "text/yaml"}
        if flow_run_id:
            headers["X-Apiary-Flow-Run-Id"] = flow_run_id
        if on_behalf_of:
            headers["X-Apiary-On-Behalf-Of"] = on_behalf_of
        return self._call("POST", "/api/v2/jobs", content=text.encode(), headers=headers).json()

    def get(self, job_id: str) -> dict:
        return self._call("GET", f"/api/v2/jobs/{job_id}").json()

    def list(self, **filters) -> builtins.list[dict]:
        return self._call("GET", "/api/v2/jobs", params={k: v for k, v in filters.items() if v}).json()

    def stop(self, job_id: str) -> dict:
        return self._call("PUT", f"/api/v2/jobs/{job_id}/executionType", json={"value": "STOP"}).json()

    def logs(self, job_id: str, task_role: str | None = None, index: int = 0, stream: str = "stdout",
             attempt: int | None = None) -> str:
        params: dict[str, str | int] = {"index": index, "stream": stream}
        if task_role:
            params["taskRole"] = task_role
        if attempt is not None:
            params["attempt"] = attempt
        return self._call("GET", f"/api/v2/jobs/{job_id}/logs", params=params).text

    def nodes(self) -> builtins.list[dict]:
        return self._call("GET", "/api/v2/nodes").json()

    def node(self, node: str) -> dict:
        """``GET /api/v2/nodes/{node}``: the node with its cordons."""
        return self._call("GET", f"/api/v2/nodes/{node}").json()

    def cordon(self, node: str, value: bool = True, *, reason: str | None = None, source: str | None = None,
               all: bool = False) -> dict:
        """Set (``value``) or remove ``source``'s cordon (None: the server's default, ``admin``) with
        ``reason``; ``all`` with ``value=False`` removes every cordon. Returns the node."""
        body: dict[str, object] = {"value": value}
        if reason is not None:
            body["reason"] = reason
        if source is not None:
            body["source"] = source
        if all:
            body["all"] = True
        return self._call("PUT", f"/api/v2/nodes/{node}/cordon", json=body).json()

    def events(self, after: int = 0, job_id: str | None = None, limit: int = 1000) -> builtins.list[dict]:
        params: dict[str, str | int] = {"after": after, "limit": limit}
        if job_id:
            params["jobId"] = job_id
        return self._call("GET", "/api/v2/events", params=params).json()["events"]

    def cluster_status(self, vc: str | None = None) -> dict:
        return self._call("GET", "/api/v2/cluster/status", params={"vc": vc} if vc else None).json()

    def apply_cluster_config(self, text: str) -> dict:
        return self._call("PUT", "/api/v2/cluster/config", content=text.encode(),
                          headers={"Content-Type": "text/yaml"}).json()

    # ------------------------------------------------------------------ identity
    def me(self) -> dict:
        return self._call("GET", "/api/v2/me").json()

    def users(self) -> builtins.list[dict]:
        return self._call("GET", "/api/v2/users").json()

    def create_user(self, name: str, groups: builtins.list[str] | None = None, email: str | None = None) -> dict:
        return self._call("POST", "/api/v2/users", json={"username": name, "groups": groups, "email": email}).json()

    def delete_user(self, name: str) -> None:
        self._call("DELETE", f"/api/v2/users/{name}")

    def groups(self) -> builtins.list[dict]:
        return self._call("GET", "/api/v2/groups").json()

    def create_group(self, name: str, virtual_clusters: builtins.list[str] = (),  # type: ignore[assignment]
                     admin: bool = False, description: str = "") -> dict:
        return self._call("POST", "/api/v2/groups", json={
            "groupname": name, "virtualClusters": list(virtual_clusters), "admin": admin,
            "description": description}).json()

    def delete_group(self, name: str) -> None:
        self._call("DELETE", f"/api/v2/groups/{name}")

    def set_member(self, group: str, user: str, member: bool = True) -> dict:
        return self._call("PUT" if member else "DELETE", f"/api/v2/groups/{group}/members/{user}").json()

    def set_grant(self, group: str, virtual_cluster: str, granted: bool = True) -> dict:
        path = f"/api/v2/groups/{group}/virtualClusters/{virtual_cluster}"
        return self._call("PUT" if granted else "DELETE", path).json()

    def create_token(self, subject: str | None = None, kind: str = "user", description: str = "",
                     expires_in_s: float | None = 90 * 86400.0) -> dict:
        """A new token (``{"token", "id", ...}``; the token is shown once)."""
        return self._call("POST", "/api/v2/tokens", json={
            "kind": kind, "subject": subject, "description": description, "expiresInS": expires_in_s}).json()

    def tokens(self) -> builtins.list[dict]:
        return self._call("GET", "/api/v2/tokens").json()

    def revoke_token(self, token_id: str) -> dict:
        return self._call("DELETE", f"/api/v2/tokens/{token_id}").json()

    def wait(self, job_id: str, timeout: float | None = None, poll_s: float = 0.5,
             states: tuple[str, ...] = ("SUCCEEDED", "FAILED", "STOPPED")) -> dict:
        """Poll until the job reaches one of ``states``; raises TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job["state"] in states:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout} s")
            time.sleep(poll_s)

    # ------------------------------------------------------------------ CI/CD records
    def record_ci_run(self, run: dict) -> dict:
        """Record (or update, same ``flowRunId``) one pipeline run (``POST /api/v2/ci/runs``; the
        wire shape, times ISO 8601); the stored record, with its ``id``."""
        return self._call("POST", "/api/v2/ci/runs", json=run).json()

    def ci_runs(self, limit: int = 50, **filters: str | None) -> builtins.list[dict]:
        """The newest pipeline runs, newest first; ``filters``: ``repo``, ``result``, ``kind``, ``sha``
        (a prefix) (None or empty: any)."""
        params = {"limit": limit, **{k: v for k, v in filters.items() if v}}
        return self._call("GET", "/api/v2/ci/runs", params=params).json()["runs"]

    def ci_records(self, limit: int = 50, **filters: str | None) -> builtins.list[dict]:
        """The newest CI records (a delivery, its pipeline run and its deployment), newest first;
        ``filters``: ``sha``, ``state``, ``delivery`` (None or empty: any)."""
        params = {"limit": limit, **{k: v for k, v in filters.items() if v}}
        return self._call("GET", "/api/v2/ci/records", params=params).json()["records"]

    def record_deployment(self, d: dict) -> dict:
        """Record one production deployment (``POST /api/v2/deployments``); the stored record, with its ``id``."""
        return self._call("POST", "/api/v2/deployments", json=d).json()

    def deployments(self, limit: int = 50, **filters: str | None) -> builtins.list[dict]:
        """The newest deployments, newest first; ``filters``: ``sha`` (a prefix), ``result``."""
        params = {"limit": limit, **{k: v for k, v in filters.items() if v}}
        return self._call("GET", "/api/v2/deployments", params=params).json()["deployments"]


class Tenants:
    """Several users on one platform, for the demo, tests and benchmarks: the admin's client
    (``apiary up`` writes its token in the home) for everything, and ``submit(text, user=...)``
    through that user's own token; the admin creates each user (in the ``default`` group: every
    VC) and a one-hour token on first use."""

    def __init__(self, admin: ApiaryClient) -> None:
        self.admin = admin
        self._users: dict[str, ApiaryClient] = {}

    def submit(self, text: str, user: str) -> dict:
        if user not in self._users:
            if user not in {u["name"] for u in self.admin.users()}:
                self.admin.create_user(user)
            token = self.admin.create_token(user, description="apiary.client.Tenants", expires_in_s=3600)["token"]
            self._users[user] = self.admin.as_token(token)
        return self._users[user].submit(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.admin, name)
