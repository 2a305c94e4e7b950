"""HttpEventSource against the REST contract (httpx.MockTransport, no server)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from apiary.errors import ConflictError, NotFoundError, PlatformError, UnavailableError, ValidationError
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
        if path == "/api/v2/logs/query":
            reads = json.loads(request.content)["reads"]
            return httpx.Response(200, json={"texts": [
                "hello\n"[r["offset"]:] if r["jobId"] == "a~b" else None for r in reads]})
        if path == "/api/v2/flowRuns":
            links = json.loads(request.content)["links"]
            unknown = [x["jobId"] for x in links if x["jobId"] != "a~b"]
            return httpx.Response(200, json={"recorded": len(links) - len(unknown), "unknown": unknown})
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


def test_http_source_batches_log_reads_and_flow_run_links():
    seen: list[httpx.Request] = []
    src = make_source(seen)
    reads = [("a~b", "train", 0, 1, "stdout", 2), ("x~y", "train", 0, 0, "stderr", 0)]

    async def go():
        assert await src.logs_many(reads * 150) == ["llo\n", ""] * 150  # 300 reads: two requests
        assert await src.set_flow_runs({"a~b": "f1", "x~y": "f2"}) == ["x~y"]
        await src.aclose()

    asyncio.run(go())
    assert [(r.method, r.url.path) for r in seen] == [
        ("POST", "/api/v2/logs/query"), ("POST", "/api/v2/logs/query"), ("PUT", "/api/v2/flowRuns")]
    assert len(json.loads(seen[0].content)["reads"]) == 200 and len(json.loads(seen[1].content)["reads"]) == 100
    assert json.loads(seen[0].content)["reads"][0] == {
        "jobId": "a~b", "taskRole": "train", "index": 0, "attempt": 1, "stream": "stdout", "offset": 2}
    assert json.loads(seen[2].content) == {"links": [{"jobId": "a~b", "flowRunId": "f1"},
                                                     {"jobId": "x~y", "flowRunId": "f2"}]}


def test_unreachable_apiary_is_unavailable():
    src = HttpEventSource("http://127.0.0.1:9", timeout_s=1)
    with pytest.raises(UnavailableError):
        asyncio.run(src.events(0))


@pytest.mark.parametrize(("status", "cls", "transient"), [
    pytest.param(500, PlatformError, True, id="500"),
    pytest.param(502, PlatformError, True, id="502"),
    pytest.param(503, UnavailableError, True, id="503"),
    pytest.param(409, ConflictError, False, id="409"),
    pytest.param(400, ValidationError, False, id="400"),
    pytest.param(404, NotFoundError, False, id="404"),
])
def test_error_answers_use_the_shared_mapping_and_the_bridge_retries_every_5xx(status, cls, transient):
    from apiary.tracking.transient import is_transient

    src = HttpEventSource("http://apiary.test", transport=httpx.MockTransport(
        lambda request: httpx.Response(status, json={"code": "X", "message": "no"})))
    with pytest.raises(cls) as caught:
        asyncio.run(src.events(0))
    assert type(caught.value) is cls and caught.value.status_code == status
    assert caught.value.message == f"events after=0: HTTP {status}: no"
    assert is_transient(caught.value) is transient
