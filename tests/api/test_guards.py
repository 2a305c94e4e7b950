"""``apiary.api.guards``: the request-body cap (413/400) and the per-principal rate limits (429).

A tiny FastAPI app stands in for Apiary's: its ApiaryError handler answers like app.py's
(``exc.to_dict()``, ``exc.status_code``) plus :func:`error_headers`. Bodies go through
TestClient (a generator body is sent chunked, without Content-Length); the cases about what the
middleware reads, and when, drive the ASGI callable directly with scripted messages. No test
waits on the clock: the limits are a few calls a minute and every call is well inside one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from apiary.api.guards import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware, RateLimiter, error_headers
from apiary.errors import (
    ApiaryError,
    NotFoundError,
    PayloadTooLargeError,
    TooManyRequestsError,
    error_from_response,
)

LIMIT = 1000  # bytes, the tests' body cap
TOO_LARGE = {"code": "PayloadTooLarge", "field": "body",
             "message": f"request body larger than {LIMIT} bytes (the limit, APIARY_MAX_BODY_BYTES)"}


class Spec(BaseModel):
    text: str


class Recorder:
    """What the app's handlers saw: ``entered`` (paths of handlers that ran), ``bodies`` (bytes read)."""

    def __init__(self) -> None:
        self.entered: list[str] = []
        self.bodies: list[bytes] = []


def make_app(recorder: Recorder, limiter: RateLimiter | None = None) -> FastAPI:
    app = FastAPI()
    limiter = limiter or RateLimiter("5/minute", "3/minute")

    @app.exception_handler(ApiaryError)
    async def _apiary_error(_request: Request, exc: ApiaryError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=error_headers(exc))

    @app.post("/raw")
    async def raw(request: Request) -> dict:
        recorder.entered.append("/raw")
        body = await request.body()
        recorder.bodies.append(body)
        return {"bytes": len(body)}

    @app.post("/model")
    async def model(spec: Spec) -> dict:  # FastAPI reads and parses the body before this runs
        recorder.entered.append("/model")
        return {"bytes": len(spec.text)}

    @app.get("/calls/{user}")
    async def call(user: str) -> dict:
        limiter.hit_call(user)
        return {"ok": True}

    @app.post("/submissions/{user}")
    async def submit(user: str) -> dict:
        limiter.hit_call(user)
        limiter.hit_submit(user)
        return {"ok": True}

    return app


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def client(recorder: Recorder) -> Iterator[TestClient]:
    with TestClient(BodyLimitMiddleware(make_app(recorder), max_bytes=LIMIT)) as c:
        yield c


def chunks(total: int, size: int = 300) -> Iterator[bytes]:
    """``total`` bytes of b"x" in ``size``-byte chunks: httpx sends a generator chunked."""
    while total > 0:
        yield b"x" * min(size, total)
        total -= size


def json_body(total: int) -> bytes:
    """A JSON ``Spec`` body of exactly ``total`` bytes."""
    body = json.dumps({"text": ""}).encode()
    return json.dumps({"text": "x" * (total - len(body))}).encode()


# --- the body cap, through the app -------------------------------------------------------------


@pytest.mark.parametrize("size", [0, LIMIT - 1, LIMIT], ids=["empty", "just-under", "at-the-limit"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_within_the_limit_reaches_the_handler_whole(
    client: TestClient, recorder: Recorder, size: int, chunked: bool
) -> None:
    content = chunks(size) if chunked else b"x" * size
    r = client.post("/raw", content=content)
    assert r.status_code == 200 and r.json() == {"bytes": size}
    assert recorder.bodies == [b"x" * size]


def test_a_json_body_at_the_limit_is_parsed(client: TestClient, recorder: Recorder) -> None:
    r = client.post("/model", content=json_body(LIMIT), headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and recorder.entered == ["/model"]


@pytest.mark.parametrize("path", ["/raw", "/model"])
def test_a_declared_length_over_the_limit_is_413_before_the_handler(
    client: TestClient, recorder: Recorder, path: str
) -> None:
    r = client.post(path, content=b"x" * (LIMIT + 1), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json() == TOO_LARGE
    assert recorder.entered == [] and recorder.bodies == []


def test_a_chunked_body_over_the_limit_is_413(client: TestClient, recorder: Recorder) -> None:
    r = client.post("/raw", content=chunks(LIMIT + 1))
    assert r.status_code == 413 and r.json() == TOO_LARGE
    assert recorder.bodies == []  # the handler started reading but never got the body


def test_a_chunked_body_over_the_limit_is_413_not_fastapis_400(client: TestClient, recorder: Recorder) -> None:
    # FastAPI answers any failure while reading a model's body with its own 400 ("There was an
    # error parsing the body"); the middleware replaces that answer with the 413.
    body = json_body(LIMIT + 1)
    r = client.post("/model", content=iter([body[:600], body[600:]]), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json() == TOO_LARGE
    assert recorder.entered == []


def test_the_413_reads_back_as_an_error_of_its_status(client: TestClient) -> None:
    r = client.post("/raw", content=b"x" * (LIMIT + 1))
    err = error_from_response(r.status_code, r.content)
    assert err.status_code == 413 and err.code == "PayloadTooLarge"
    assert PayloadTooLargeError(LIMIT).to_dict() == TOO_LARGE


def test_the_default_limit_is_one_mebibyte() -> None:
    assert BodyLimitMiddleware(FastAPI()).max_bytes == DEFAULT_MAX_BODY_BYTES == 1_048_576
    assert PayloadTooLargeError(DEFAULT_MAX_BODY_BYTES).message == (
        "request body larger than 1048576 bytes (the limit, APIARY_MAX_BODY_BYTES)")
    with pytest.raises(ValueError, match="max_bytes"):
        BodyLimitMiddleware(FastAPI(), max_bytes=-1)


# --- the body cap, at the ASGI level -----------------------------------------------------------


class Exchange:
    """Runs one http request through an ASGI app with scripted body messages and records the answer.

    ``pulled`` counts the body messages the app (through the middleware) took from ``receive``.
    """

    def __init__(self, headers: list[tuple[bytes, bytes]], parts: list[bytes]) -> None:
        self.scope: Scope = {"type": "http", "method": "POST", "path": "/", "headers": headers,
                             "query_string": b""}
        self.parts = parts
        self.pulled = 0
        self.sent: list[Message] = []

    def run(self, app: ASGIApp) -> Exchange:
        async def main() -> None:
            await app(self.scope, self.receive, self.send)

        asyncio.run(main())
        return self

    async def receive(self) -> Message:
        if self.pulled >= len(self.parts):
            return {"type": "http.disconnect"}
        self.pulled += 1
        return {"type": "http.request", "body": self.parts[self.pulled - 1],
                "more_body": self.pulled < len(self.parts)}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")

    @property
    def body(self) -> dict:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body"))


async def read_all(scope: Scope, receive: Receive, send: Send) -> None:
    """A bare ASGI app: reads the whole body, then answers 200 with its length."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": json.dumps({"bytes": size}).encode()})


def test_the_middleware_stops_reading_at_the_chunk_that_crosses_the_limit() -> None:
    ex = Exchange([], [b"x" * 400] * 10)  # 4000 bytes, chunked, no Content-Length
    ex.run(BodyLimitMiddleware(read_all, max_bytes=LIMIT))
    assert ex.pulled == 3  # 400, 800, 1200 > 1000: the rest is never read
    assert (ex.status, ex.body) == (413, TOO_LARGE)


def test_a_declared_length_over_the_limit_reads_nothing() -> None:
    ex = Exchange([(b"content-length", str(LIMIT + 1).encode())], [b"x" * (LIMIT + 1)])
    ex.run(BodyLimitMiddleware(read_all, max_bytes=LIMIT))
    assert ex.pulled == 0 and (ex.status, ex.body) == (413, TOO_LARGE)


def test_a_body_longer_than_its_declared_length_is_counted_too() -> None:
    ex = Exchange([(b"content-length", b"10")], [b"x" * 600, b"x" * 600])  # the header lies
    ex.run(BodyLimitMiddleware(read_all, max_bytes=LIMIT))
    assert (ex.status, ex.body) == (413, TOO_LARGE)


@pytest.mark.parametrize(
    "values",
    [[b"abc"], [b"-1"], [b"+5"], [b"1_0"], [b"1e3"], ["²".encode()], [b""], [b"5", b"6"]],
    ids=["letters", "negative", "plus-sign", "underscore", "exponent", "unicode-digit", "empty", "two-values"],
)
def test_a_malformed_content_length_is_400(values: list[bytes]) -> None:
    ex = Exchange([(b"content-length", v) for v in values], [b"xxxxx"])
    ex.run(BodyLimitMiddleware(read_all, max_bytes=LIMIT))
    assert ex.pulled == 0 and ex.status == 400
    assert ex.body["code"] == "InvalidParametersError" and ex.body["field"] == "Content-Length"


def test_repeated_equal_content_lengths_are_one_length() -> None:
    ex = Exchange([(b"content-length", b"5"), (b"Content-Length", b"5")], [b"xxxxx"])
    ex.run(BodyLimitMiddleware(read_all, max_bytes=LIMIT))
    assert (ex.status, ex.body) == (200, {"bytes": 5})


def test_after_the_response_started_the_app_gets_the_error() -> None:
    # An app that answers before reading cannot have its status changed: it sees the exception.
    async def answers_first(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while (await receive()).get("more_body", False):
            pass

    ex = Exchange([], [b"x" * 600] * 3)
    with pytest.raises(PayloadTooLargeError):
        ex.run(BodyLimitMiddleware(answers_first, max_bytes=LIMIT))
    assert ex.status == 200 and ex.pulled == 2


def test_other_scopes_pass_through() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    ex = Exchange([], [])
    ex.scope = {"type": "lifespan"}
    ex.run(BodyLimitMiddleware(app, max_bytes=0))
    assert seen == ["lifespan"]


# --- the rate limits ---------------------------------------------------------------------------


def test_n_calls_pass_and_the_next_is_429_with_retry_after(client: TestClient) -> None:
    assert [client.get("/calls/alice").status_code for _ in range(5)] == [200] * 5
    r = client.get("/calls/alice")
    assert r.status_code == 429 and r.json()["code"] == "TooManyRequestsError"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert "5 per 1 minute" in r.json()["message"]


def test_each_key_has_its_own_budget(client: TestClient) -> None:
    for _ in range(5):
        client.get("/calls/alice")
    assert client.get("/calls/alice").status_code == 429
    assert [client.get("/calls/bob").status_code for _ in range(5)] == [200] * 5


def test_submissions_have_a_budget_apart_from_calls() -> None:
    limiter = RateLimiter(call_limit="5/minute", submit_limit="2/minute")
    limiter.hit_submit("alice")
    limiter.hit_submit("alice")
    with pytest.raises(TooManyRequestsError) as caught:
        limiter.hit_submit("alice")
    assert caught.value.retry_after is not None and caught.value.retry_after >= 1
    for _ in range(5):
        limiter.hit_call("alice")  # the spent submissions took nothing from the calls
    with pytest.raises(TooManyRequestsError):
        limiter.hit_call("alice")
    limiter.hit_submit("bob")  # nor from anyone else's submissions


def test_equal_limit_strings_still_count_apart() -> None:
    # limits keys its counters by the limit and the identifiers: the same string must not share one.
    limiter = RateLimiter(call_limit="1/minute", submit_limit="1/minute")
    limiter.hit_call("alice")
    limiter.hit_submit("alice")
    with pytest.raises(TooManyRequestsError):
        limiter.hit_call("alice")


def test_a_refused_hit_does_not_count(client: TestClient) -> None:
    for _ in range(3):
        assert client.post("/submissions/carol").status_code == 200
    assert client.post("/submissions/carol").status_code == 429  # a call counted, a submission refused
    assert client.get("/calls/carol").status_code == 200  # 5th call: 4 counted so far
    assert client.get("/calls/carol").status_code == 429


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_window_moves_and_retry_after_is_when_the_oldest_hit_ages_out() -> None:
    clock = FakeClock()
    limiter = RateLimiter(call_limit="3/minute", submit_limit="2/minute", clock=clock)
    for dt in (0.0, 10.0, 20.0):  # hits at 1000, 1010, 1020
        clock.now += dt
        limiter.hit_call("alice")
    clock.now = 1030.0
    with pytest.raises(TooManyRequestsError) as caught:
        limiter.hit_call("alice")
    assert caught.value.retry_after == 30  # the hit of 1000 leaves the window at 1060
    clock.now = 1060.5  # 1000 is out; 1010 and 1020 are in: one more fits, then none
    limiter.hit_call("alice")
    with pytest.raises(TooManyRequestsError) as caught:
        limiter.hit_call("alice")
    assert caught.value.retry_after == 10  # 1010 leaves at 1070
    clock.now = 1200.0  # every hit aged out: the whole budget again
    for _ in range(3):
        limiter.hit_call("alice")


def test_check_submit_counts_nothing_and_count_submit_always_counts() -> None:
    clock = FakeClock()
    limiter = RateLimiter(call_limit="5/minute", submit_limit="2/minute", clock=clock)
    for _ in range(5):
        limiter.check_submit("alice")  # a check is free
    limiter.count_submit("alice")
    limiter.count_submit("alice")
    with pytest.raises(TooManyRequestsError) as caught:
        limiter.check_submit("alice")
    assert caught.value.retry_after == 60
    limiter.count_submit("alice")  # accepted already: counted even over the limit, never raises
    clock.now += 61
    limiter.check_submit("alice")


def test_a_window_that_emptied_is_forgotten() -> None:
    clock = FakeClock()
    limiter = RateLimiter(call_limit="5/second", submit_limit="2/minute", clock=clock)
    for user in ("alice", "bob"):
        limiter.hit_call(user)
    windows = limiter._windows
    assert set(windows._hits) == {("call", "alice"), ("call", "bob")}
    clock.now += 2
    assert windows.test(limiter.call_limit, "call", "alice") is None  # its only hit aged out
    assert set(windows._hits) == {("call", "bob")}


@pytest.mark.parametrize("text", ["", "abc", "5/fortnight", "per minute"])
def test_a_limit_that_does_not_parse_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="submit_limit"):
        RateLimiter(submit_limit=text)


def test_the_defaults_are_openpais_call_limit_and_an_hourly_submit_limit() -> None:
    limiter = RateLimiter()
    assert (limiter.call_limit.amount, limiter.call_limit.get_expiry()) == (600, 60)
    assert (limiter.submit_limit.amount, limiter.submit_limit.get_expiry()) == (3600, 3600)


@pytest.mark.parametrize(
    ("exc", "headers"),
    [
        (TooManyRequestsError("slow down", retry_after=7), {"Retry-After": "7"}),
        (TooManyRequestsError("queue full"), {}),
        (NotFoundError("no job"), {}),
        (ValueError("not an ApiaryError"), {}),
    ],
    ids=["retry-after", "429-without-retry-after", "other-error", "not-apiary"],
)
def test_error_headers(exc: Exception, headers: dict[str, str]) -> None:
    assert error_headers(exc) == headers
