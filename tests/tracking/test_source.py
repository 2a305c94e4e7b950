"""HttpEventSource against the REST contract (httpx.MockTransport, no server)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from apiary.errors import NotFoundError, UnavailableError
from apiary.tracking.source import HttpEventSource, JobEventSource, MemoryEventSource


def make_source(seen: list[httpx.Request]) -> HttpEventSource:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        path = request.url.path
        if path == "/api/v2/events":
            after = int(request.url.params["after"])
            return httpx.Response(200, json={"events": [
                {"seq": after + 1, "time": 1.0, "jobId": "a~b", "type": "job.submitted", "data": {}}]})
        if path == "/api/v2/jobs/a~b":
            return httpx.Response(200, json={"id": "a~b", "state": "RUNNING"})
        if path == "/api/v2/jobs/a~b/logs":
            return httpx.Response(200, text="hello\n"[int(request.url.params["offset"]):])
        if path == "/api/v2/jobs/a~b/flowRun":
            return httpx.Response(204)
        if path == "/api/v2/jobs/boom":
            return httpx.Response(503, json={"code": "UnavailableError", "message": "db down"})
        return httpx.Response(404, json={"code": "NoJobError", "message": "no such job"})

    return HttpEventSource("http://apiary.test/api/v2", transport=httpx.MockTransport(handler))


def test_http_source_speaks_the_contract():
    seen: list[httpx.Request] = []
    src = make_source(seen)
    assert isinstance(src, JobEventSource) and isinstance(MemoryEventSource(), JobEventSource)

    async def go():
        events = await src.events(after=7, limit=3)
        assert events[0]["seq"] == 8
        assert (await src.job("a~b"))["state"] == "RUNNING"
        assert await src.logs("a~b", "train", 0, 1, "stdout", offset=2) == "llo\n"
        await src.set_flow_run("a~b", "f1")
        with pytest.raises(NotFoundError):
            await src.job("x~y")
        with pytest.raises(UnavailableError):
            await src.job("boom")
        await src.aclose()

    asyncio.run(go())
    assert seen[0].url.params["limit"] == "3"
    assert seen[2].url.params["taskRole"] == "train" and seen[2].url.params["attempt"] == "1"
    assert seen[3].method == "PUT" and json.loads(seen[3].content) == {"id": "f1"}


def test_unreachable_apiary_is_unavailable():
    src = HttpEventSource("http://127.0.0.1:9", timeout_s=1)
    with pytest.raises(UnavailableError):
        asyncio.run(src.events(0))
