"""How the Prefect bridge reads Apiary: the :class:`JobEventSource` interface and two implementations.

* :class:`HttpEventSource` talks to Apiary's REST API (``/api/v2``) with ``httpx``;
* :class:`MemoryEventSource` is an in-memory test double (tests and demos feed it events).

Event shape (the REST contract, ``GET /api/v2/events``): ``{"seq": int, "time": float unix
seconds, "jobId": "user~name", "type": str, "data": dict}``, ordered by ``seq``. Types:
``job.submitted``, ``job.waiting``, ``job.placed``, ``task.started``, ``task.exited``,
``job.preempted``, ``job.retry``, ``job.stop_requested``, ``job.completed`` (see
:mod:`apiary.tracking.events` for their typed form and :mod:`apiary.tracking.recorder` for what
each becomes in Prefect).

Errors: implementations raise :class:`~apiary.errors.UnavailableError` when Apiary cannot be
reached, and for an error answer the class :func:`~apiary.errors.error_from_response` gives
(the one mapping the CLI and the ``apiary-job`` flow use too): a
:class:`~apiary.errors.PlatformError` for 5xx (:class:`~apiary.errors.UnavailableError` for
503; the bridge retries every PlatformError later), :class:`~apiary.errors.NotFoundError` for
an unknown job and another :class:`~apiary.errors.UserError` for other 4xx answers.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx

from apiary.client import check_token_transport, http_verify, split_api_urls
from apiary.errors import NotFoundError, UnavailableError, error_from_response

#: Links per ``PUT /api/v2/flowRuns``: the API takes at most 1,000 (apiary.api.schemas.MAX_FLOW_RUN_LINKS).
LINKS_PER_REQUEST = 1000
#: Reads per ``POST /api/v2/logs/query``: the API takes at most 200 (apiary.api.schemas.MAX_LOG_READS).
LOG_READS_PER_REQUEST = 200

logger = logging.getLogger(__name__)

__all__ = ["HttpEventSource", "JobEventSource", "MemoryEventSource"]

API_PREFIX = "/api/v2"
FLOW_RUN_HEADER = "X-Apiary-Flow-Run-Id"
#: The Prefect bridge's delegation: only its service token may name the user a job is for.
ON_BEHALF_HEADER = "X-Apiary-On-Behalf-Of"


def service_headers(token: str | None = None) -> dict[str, str]:
    """``Authorization`` for the bridge's and the flows' calls: ``token``, else ``APIARY_TOKEN`` /
    ``APIARY_HOME/token`` (``apiary up`` hands the Prefect children the bridge's service token)."""
    if token is None:
        from apiary.settings import Settings

        token = Settings().resolved_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


@runtime_checkable
class JobEventSource(Protocol):
    """What the bridge needs from Apiary. All methods are coroutines."""

    async def events(self, after: int, limit: int = 500) -> list[dict]:
        """Events with ``seq > after``, ordered by ``seq``, at most ``limit``."""
        ...

    async def job(self, job_id: str) -> dict:
        """The job JSON of ``GET /api/v2/jobs/{id}``."""
        ...

    async def logs(
        self, job_id: str, task_role: str, index: int, attempt: int, stream: str, offset: int = 0
    ) -> str:
        """Text of one task instance's ``stream`` ("stdout" | "stderr") from byte ``offset`` on."""
        ...

    async def logs_many(self, reads: list[tuple[str, str, int, int, str, int]]) -> list[str]:
        """:meth:`logs` for each ``(job id, task role, index, attempt, stream, offset)``, in order,
        ``""`` where there is nothing (``POST /api/v2/logs/query``, one request per 200 reads).
        Idempotent; blocking; raises UnavailableError to mean "try again"."""
        ...

    async def set_flow_run(self, job_id: str, flow_run_id: str) -> None:
        """Record the Prefect flow run id of a job (``PUT /api/v2/jobs/{id}/flowRun``)."""
        ...

    async def set_flow_runs(self, links: dict[str, str]) -> list[str]:
        """Record several jobs' flow run ids, job id -> flow run id (``PUT /api/v2/flowRuns``, one
        request per 1,000). Idempotent; blocking; returns the job ids Apiary does not know (left
        out); raises UnavailableError to mean "try again"."""
        ...

    async def stop(self, job_id: str) -> None:
        """Ask Apiary to stop a job (``PUT /api/v2/jobs/{id}/executionType`` STOP): the Cancel
        button of its flow run. Idempotent (stopping a finished job changes nothing); not
        blocking (the job ends STOPPED later); raises UnavailableError to mean "try again"."""
        ...


def _raise_for(resp: httpx.Response, what: str) -> None:
    if resp.status_code >= 400:
        raise error_from_response(resp.status_code, resp.content, what)


class HttpEventSource:
    """:class:`JobEventSource` over Apiary's REST API at ``api_url`` (``http://host:port``; several
    control-plane replicas comma-separated: a call that cannot reach one moves the next call to the
    next). HTTPS is verified against ``ca_cert`` (default ``APIARY_CA_CERT``); a token is never sent
    over plain HTTP off loopback (:class:`~apiary.errors.PlaintextTokenError`).

    ``api_url`` may or may not end in ``/api/v2``. One ``httpx.AsyncClient`` per instance,
    created lazily in the running event loop; call :meth:`aclose` when done.
    """

    def __init__(
        self,
        api_url: str,
        timeout_s: float = 10.0,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        ca_cert: Path | None = None,
    ) -> None:
        self.base_urls = []
        for url in split_api_urls(api_url):
            base = url.rstrip("/")
            if base.endswith(API_PREFIX):
                base = base[: -len(API_PREFIX)]
            self.base_urls.append(base)
        self.base_url = self.base_urls[0]
        self.timeout_s = timeout_s
        self._headers = service_headers(token)
        self._transport = transport  # tests pass httpx.MockTransport
        if transport is None:  # a fake transport sends nothing anywhere
            for base in self.base_urls:
                check_token_transport(base, self._headers.get("Authorization", "").removeprefix("Bearer ") or None)
        if ca_cert is None and transport is None:
            from apiary.settings import Settings

            ca_cert = Settings().ca_cert
        self._verify = http_verify(ca_cert)
        self._client: httpx.AsyncClient | None = None
        self._loop: Any = None

    def _http(self) -> httpx.AsyncClient:
        import asyncio

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            # A client is bound to the loop it was made in; tests run several loops.
            self._client = httpx.AsyncClient(
                base_url=self.base_url + API_PREFIX,
                timeout=self.timeout_s,
                headers=self._headers,
                transport=self._transport,
                verify=self._verify,
            )
            self._loop = loop
        return self._client

    async def _request(self, method: str, path: str, what: str, **kw: Any) -> httpx.Response:
        try:
            resp = await self._http().request(method, path, **kw)
        except httpx.HTTPError as exc:
            # The next call goes to the next control-plane replica: the bridge retries every call,
            # and the writes here (a flow-run link, a stop) are idempotent.
            if len(self.base_urls) > 1:
                i = self.base_urls.index(self.base_url)
                self.base_url = self.base_urls[(i + 1) % len(self.base_urls)]
                old, self._client = self._client, None
                if old is not None:
                    await old.aclose()
            raise UnavailableError(f"{what}: apiary unreachable at {self.base_url}: {exc!r}") from exc
        _raise_for(resp, what)
        return resp

    async def events(self, after: int, limit: int = 500) -> list[dict]:
        resp = await self._request(
            "GET", "/events", f"events after={after}", params={"after": after, "limit": limit}
        )
        return list(resp.json().get("events", []))

    async def job(self, job_id: str) -> dict:
        resp = await self._request("GET", f"/jobs/{job_id}", f"job id={job_id}")
        return resp.json()

    async def logs(
        self, job_id: str, task_role: str, index: int, attempt: int, stream: str, offset: int = 0
    ) -> str:
        params = {"taskRole": task_role, "index": index, "attempt": attempt, "stream": stream, "offset": offset}
        try:
            resp = await self._request(
                "GET", f"/jobs/{job_id}/logs", f"logs job={job_id} {task_role}/{index}", params=params
            )
        except NotFoundError:
            return ""  # no output (yet) for this instance
        return resp.text

    async def logs_many(self, reads: list[tuple[str, str, int, int, str, int]]) -> list[str]:
        texts: list[str] = []
        for i in range(0, len(reads), LOG_READS_PER_REQUEST):
            chunk = reads[i:i + LOG_READS_PER_REQUEST]
            body = {"reads": [{"jobId": j, "taskRole": r, "index": x, "attempt": a, "stream": st, "offset": off}
                              for j, r, x, a, st, off in chunk]}
            resp = await self._request("POST", "/logs/query", f"logs of {len(chunk)} instance streams", json=body)
            texts += [t or "" for t in resp.json()["texts"]]
        return texts

    async def set_flow_run(self, job_id: str, flow_run_id: str) -> None:
        await self._request("PUT", f"/jobs/{job_id}/flowRun", f"flowRun job={job_id}", json={"id": flow_run_id})

    async def set_flow_runs(self, links: dict[str, str]) -> list[str]:
        items = [{"jobId": j, "flowRunId": f} for j, f in links.items()]
        unknown: list[str] = []
        for i in range(0, len(items), LINKS_PER_REQUEST):
            resp = await self._request("PUT", "/flowRuns", f"flowRuns ({len(items)} jobs)",
                                       json={"links": items[i:i + LINKS_PER_REQUEST]})
            unknown += resp.json().get("unknown", [])
        return unknown

    async def stop(self, job_id: str) -> None:
        await self._request("PUT", f"/jobs/{job_id}/executionType", f"stop job={job_id}", json={"value": "STOP"})

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class MemoryEventSource:
    """In-memory :class:`JobEventSource`: a TEST DOUBLE, not a store.

    Feed it with :meth:`emit` (events get the next ``seq``), :meth:`set_job` and
    :meth:`write_log`; it records flow run ids in ``flow_runs`` (each :meth:`set_flow_runs`
    call's links also in ``link_batches``) and :meth:`stop`
    calls in ``stops``. Set
    ``fail`` to an exception to make every call raise it (Apiary down).
    """

    def __init__(self) -> None:
        self._events: list[dict] = []
        self._jobs: dict[str, dict] = {}
        self._logs: dict[tuple[str, str, int, int, str], bytes] = {}
        self.flow_runs: dict[str, str] = {}
        self.link_batches: list[dict[str, str]] = []  # each set_flow_runs call's links
        self.log_batches = 0  # logs_many calls
        self.stops: list[str] = []
        self.fail: Exception | None = None

    def emit(self, job_id: str, type: str, data: dict | None = None, time_s: float | None = None) -> dict:
        """Append an event and return it (``seq`` starts at 1)."""
        event = {
            "seq": len(self._events) + 1,
            "time": time.time() if time_s is None else time_s,
            "jobId": job_id,
            "type": type,
            "data": dict(data or {}),
        }
        self._events.append(event)
        return event

    def set_job(self, job: dict) -> None:
        self._jobs[job["id"]] = dict(job)

    def write_log(self, job_id: str, task_role: str, index: int, attempt: int, stream: str, text: str) -> None:
        """Append ``text`` to an instance's stream (as UTF-8 bytes, like a log file)."""
        key = (job_id, task_role, index, attempt, stream)
        self._logs[key] = self._logs.get(key, b"") + text.encode()

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def events(self, after: int, limit: int = 500) -> list[dict]:
        self._check()
        return [dict(e) for e in self._events if e["seq"] > after][:limit]

    async def job(self, job_id: str) -> dict:
        self._check()
        if job_id not in self._jobs:
            raise NotFoundError(f"job id={job_id} not found")
        return dict(self._jobs[job_id])

    async def logs(
        self, job_id: str, task_role: str, index: int, attempt: int, stream: str, offset: int = 0
    ) -> str:
        self._check()
        data = self._logs.get((job_id, task_role, index, attempt, stream), b"")
        return data[offset:].decode(errors="replace")

    async def set_flow_run(self, job_id: str, flow_run_id: str) -> None:
        self._check()
        self.flow_runs[job_id] = flow_run_id
        if job_id in self._jobs:
            self._jobs[job_id]["flowRunId"] = flow_run_id

    async def logs_many(self, reads: list[tuple[str, str, int, int, str, int]]) -> list[str]:
        self.log_batches += 1
        return [await self.logs(j, r, x, a, st, off) for j, r, x, a, st, off in reads]

    async def set_flow_runs(self, links: dict[str, str]) -> list[str]:
        self._check()
        self.link_batches.append(dict(links))
        for job_id, flow_run_id in links.items():
            await self.set_flow_run(job_id, flow_run_id)
        return []

    async def stop(self, job_id: str) -> None:
        self._check()
        self.stops.append(job_id)
