"""A small synchronous client of Apiary's REST API, used by the CLI, the demo and tests."""

from __future__ import annotations

import builtins  # the client has a method named list
import time
from pathlib import Path

import httpx

from apiary.errors import UnavailableError, error_from_response


class ApiaryClient:
    """Calls ``api_url`` (``http://127.0.0.1:PORT``). Error answers come back as the
    :mod:`apiary.errors` class of :func:`~apiary.errors.error_from_response`, carrying the server's
    message and status; an unreachable server raises UnavailableError."""

    def __init__(self, api_url: str, timeout: float = 30.0, transport: httpx.BaseTransport | None = None) -> None:
        self.api_url = api_url.rstrip("/")
        # transport: tests pass httpx.MockTransport.
        self._http = httpx.Client(base_url=self.api_url, timeout=timeout, transport=transport)

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
        return self._call("GET", "/healthz").json()

    def submit(self, job: str | Path, user: str, flow_run_id: str | None = None) -> dict:
        text = Path(job).read_text() if isinstance(job, Path) else job
        headers = {"Content-Type": "text/yaml", "X-Apiary-User": user}
        if flow_run_id:
            headers["X-Apiary-Flow-Run-Id"] = flow_run_id
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

    def cordon(self, node: str, value: bool = True) -> dict:
        return self._call("PUT", f"/api/v2/nodes/{node}/cordon", json={"value": value}).json()

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
