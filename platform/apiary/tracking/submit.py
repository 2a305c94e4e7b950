"""Submit a job to Apiary's REST API and wait for it to finish (used by :mod:`apiary.tracking.portal`).

Contract (Apiary REST, ``/api/v2``): ``POST /jobs`` with the job as JSON, header
``X-Apiary-User`` and optionally ``X-Apiary-Flow-Run-Id`` (the bridge then attaches the job's
task runs, logs and artifacts to that flow run and leaves its state to the flow engine)
-> 202 ``{"id": "user~name"}``; ``GET /jobs/{id}`` -> job JSON with ``state`` in
WAITING | RUNNING | SUCCEEDED | FAILED | STOPPED.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from typing import Any

import httpx

from apiary.client import http_verify, split_api_urls
from apiary.errors import ApiaryError, PlatformError, UnavailableError, UserError, error_from_response
from apiary.tracking.source import API_PREFIX, FLOW_RUN_HEADER, ON_BEHALF_HEADER

logger = logging.getLogger(__name__)

__all__ = [
    "FINAL_STATES",
    "platform_api_url",
    "resolve_api_url",
    "run_scheduler_cycle",
    "submit_job",
    "wait_for_job",
]

FINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


def resolve_api_url(api_url: str | None = None) -> str:
    """The control plane's base URL (no ``/api/v2``): ``api_url`` when a trusted caller names one
    (the CLI's ``--api``), else the platform's configured one (:func:`platform_api_url`).

    Flows and deployments never pass ``api_url``: a run parameter is chosen by whoever starts the
    run in the Prefect UI, and every call made with the result carries a token.

    Raises :class:`~apiary.errors.UserError` when none is known.
    """
    if not api_url:
        return platform_api_url()
    url = api_url.rstrip("/")
    return url[: -len(API_PREFIX)] if url.endswith(API_PREFIX) else url


def platform_api_url() -> str:
    """The platform's own API URL, from the serving process's configuration only:
    ``APIARY_API_URL`` (``apiary up`` sets it for its Prefect children), else the URL a running
    ``apiary up`` recorded in ``APIARY_HOME/run/api_url`` (:meth:`apiary.settings.Settings.resolved_api_url`).
    The only URL the flows send tokens to; without a trailing ``/`` or ``/api/v2``.

    Raises :class:`~apiary.errors.UserError` when neither is set.
    """
    url = os.environ.get("APIARY_API_URL")
    if not url:
        try:
            from apiary.settings import Settings

            url = Settings().resolved_api_url()
        except Exception:  # settings are optional here; the error below says what to set
            url = None
    if not url:
        raise UserError("APIARY_API_URL: not set in the environment of the process that runs the flows")
    url = reachable_replica(split_api_urls(url))
    return url[: -len(API_PREFIX)] if url.endswith(API_PREFIX) else url


def reachable_replica(urls: list[str], timeout_s: float = 2.0) -> str:
    """The first of the control-plane replicas ``urls`` that accepts a TCP connection within
    ``timeout_s`` (any replica serves: followers forward to the leader), else the first one, so the
    caller's request fails with its own error. One URL is returned as it is, untried."""
    if len(urls) == 1:
        return urls[0]
    import socket
    from urllib.parse import urlsplit

    for url in urls:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
            return url
        except OSError:
            continue
    return urls[0]


def platform_verify() -> ssl.SSLContext | bool:
    """What the flows verify the platform's HTTPS against: the platform CA (``APIARY_CA_CERT``),
    else the system's CAs."""
    from apiary.settings import Settings

    return http_verify(Settings().ca_cert)


def _job_body(job: Any) -> tuple[bytes, str]:
    """(body, content type) of a JobSpec, a dict (wire keys) or YAML text."""
    if isinstance(job, str | bytes):
        return (job.encode() if isinstance(job, str) else job), "text/yaml"
    if hasattr(job, "to_wire"):
        job = job.to_wire()
    import json

    return json.dumps(job).encode(), "application/json"


def _error(resp: httpx.Response, what: str) -> ApiaryError:
    """The shared mapping (:func:`~apiary.errors.error_from_response`): 409 is a ConflictError
    (the job already exists), every 5xx a PlatformError (try again later)."""
    return error_from_response(resp.status_code, resp.content, what)


async def submit_job(
    client: httpx.AsyncClient, job: Any, user: str, flow_run_id: str | None = None
) -> str:
    """POST the job for ``user`` (the client carries the bridge's service token, which alone may
    name the user); return its id (``user~name``).

    Raises :class:`~apiary.errors.UserError` (or a subclass: ConflictError when the job already
    exists) for a 4xx answer (the message is Apiary's), :class:`~apiary.errors.PlatformError` for
    5xx (UnavailableError for 503) and :class:`~apiary.errors.UnavailableError` for no answer.
    """
    body, ctype = _job_body(job)
    headers = {ON_BEHALF_HEADER: user, "Content-Type": ctype}
    if flow_run_id:
        headers[FLOW_RUN_HEADER] = str(flow_run_id)
    try:
        resp = await client.post(f"{API_PREFIX}/jobs", content=body, headers=headers)
    except httpx.HTTPError as exc:
        raise UnavailableError(f"submit: apiary unreachable: {exc!r}") from exc
    if resp.status_code >= 400:
        raise _error(resp, "submit")
    job_id = resp.json()["id"]
    logger.info("job submitted id=%s user=%s flow_run=%s", job_id, user, flow_run_id)
    return job_id


async def wait_for_job(
    client: httpx.AsyncClient, job_id: str, poll_s: float = 1.0, timeout_s: float | None = None
) -> dict:
    """Poll ``GET /jobs/{id}`` every ``poll_s`` s until a final state; return the job JSON.

    Unreachable/5xx answers are retried (Apiary may restart while the job runs); a 404
    raises :class:`~apiary.errors.NotFoundError` (another 4xx its UserError); ``timeout_s``
    (None: no limit) raises :class:`~apiary.errors.UnavailableError`.
    """
    t0 = time.monotonic()
    last_state = None
    while True:
        try:
            resp = await client.get(f"{API_PREFIX}/jobs/{job_id}")
            if resp.status_code >= 400:
                err = _error(resp, f"job id={job_id}")
                if not isinstance(err, PlatformError):  # 4xx: waiting longer will not help
                    raise err
                logger.warning("apiary answered status=%s; still waiting id=%s", resp.status_code, job_id)
            else:
                job = resp.json()
                if job.get("state") != last_state:
                    last_state = job.get("state")
                    logger.info("job id=%s state=%s attempt=%s", job_id, last_state, job.get("attempt"))
                if last_state in FINAL_STATES:
                    return job
        except httpx.HTTPError as exc:
            logger.warning("apiary unreachable; still waiting id=%s error=%r", job_id, exc)
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise UnavailableError(f"job id={job_id} not final after timeout_s={timeout_s} state={last_state}")
        await asyncio.sleep(poll_s)


async def run_scheduler_cycle(client: httpx.AsyncClient) -> dict:
    """``POST /api/v2/scheduler/cycle`` -> ``{"placed", "preempted", "waiting", "durationMs"}``.

    Raises :class:`~apiary.errors.UnavailableError` for no answer and :func:`_error`'s class for an
    error answer (a PlatformError for 5xx)."""
    try:
        resp = await client.post(f"{API_PREFIX}/scheduler/cycle")
    except httpx.HTTPError as exc:
        raise UnavailableError(f"scheduler cycle: apiary unreachable: {exc!r}") from exc
    if resp.status_code >= 400:
        raise _error(resp, "scheduler cycle")
    return resp.json()
