"""The ``apiary-job`` flow's logic (:mod:`apiary.tracking.submit`) on Apiary's error answers
(httpx.MockTransport, no server): 409 is "already exists", every 5xx is waited out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from apiary.errors import ConflictError, NotFoundError, PlatformError, UnavailableError, ValidationError
from apiary.tracking.submit import run_scheduler_cycle, submit_job, wait_for_job

JOB = "protocolVersion: 2\nname: x\n"


def run(handler: Callable[[httpx.Request], httpx.Response], call):
    async def go():
        async with httpx.AsyncClient(base_url="http://apiary.test", transport=httpx.MockTransport(handler)) as c:
            return await call(c)

    return asyncio.run(go())


def answer(status: int, message: str, **extra) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, json={"code": "X", "message": message, **extra})


@pytest.mark.parametrize(("status", "cls"), [(400, ValidationError), (404, NotFoundError), (409, ConflictError),
                                             (500, PlatformError), (503, UnavailableError)])
def test_submit_raises_the_shared_class(status: int, cls: type) -> None:
    with pytest.raises(cls) as caught:
        run(answer(status, "taskRoles: required"), lambda c: submit_job(c, JOB, "alice"))
    assert type(caught.value) is cls
    assert caught.value.message == f"submit: HTTP {status}: taskRoles: required"


def test_a_job_that_exists_is_a_conflict() -> None:
    with pytest.raises(ConflictError, match="already exists"):
        run(answer(409, "Job name x already exists for user alice."), lambda c: submit_job(c, JOB, "alice"))


def test_wait_waits_out_every_5xx_and_transport_errors() -> None:
    answers = [500, 502, 503, "drop", 200]
    seen: list[int | str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        what = answers[len(seen)]
        seen.append(what)
        if what == "drop":
            raise httpx.ReadError("reset", request=request)
        if what == 200:
            return httpx.Response(200, json={"id": "alice~x", "state": "SUCCEEDED"})
        return httpx.Response(what, text="busy")

    job = run(handler, lambda c: wait_for_job(c, "alice~x", poll_s=0))
    assert job["state"] == "SUCCEEDED" and seen == answers


@pytest.mark.parametrize(("status", "cls"), [(404, NotFoundError), (400, ValidationError)])
def test_wait_stops_on_a_4xx(status: int, cls: type) -> None:
    with pytest.raises(cls):
        run(answer(status, "nope"), lambda c: wait_for_job(c, "alice~x", poll_s=0))


def test_scheduler_cycle_5xx_is_a_platform_error() -> None:
    # flows/scheduling.py skips the cycle on any PlatformError.
    with pytest.raises(PlatformError):
        run(lambda r: httpx.Response(500, text="Internal Server Error"), run_scheduler_cycle)
