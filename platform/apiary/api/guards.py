"""Request guards of the REST API: a request-body size cap and per-principal rate limits.

Bounded input: no caller can make the API read an unbounded body or serve one user's flood at
everyone else's expense.

* :class:`BodyLimitMiddleware` (pure ASGI, wraps the whole app) answers 413 to a body over
  ``max_bytes`` (default 1 MiB) and 400 to a malformed ``Content-Length``; it streams, never
  buffers.
* :func:`plain_text` (a dependency of every router) answers 400 to a NUL character in a path or
  query parameter or a header, naming it: PostgreSQL text cannot hold one (the request body's
  strings are checked by :class:`apiary.api.schemas.RequestBody`);
* :class:`RateLimiter` counts API calls and job submissions per principal (moving window, in
  memory; limits in ``limits``' notation) and raises :class:`~apiary.errors.TooManyRequestsError`
  with ``retry_after``;
  :func:`error_headers` turns that into the ``Retry-After`` header of the app's error answer. A
  call counts when it is made; a submission only once it is accepted
  (:meth:`RateLimiter.check_submit`, then :meth:`RateLimiter.count_submit`), so refused ones
  (400, 403, 404, 409) cost a user nothing of their submission budget.

Which principals are exempt (node agents, service tokens) is the caller's decision, not this
module's: it limits whatever key it is given.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NoReturn

from fastapi import Request
from limits import RateLimitItem, parse
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from apiary.api.auth import Caller
from apiary.api.schemas import check_string
from apiary.errors import ApiaryError, PayloadTooLargeError, TooManyRequestsError, ValidationError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1_048_576
"""1 MiB: nginx's default ``client_max_body_size`` (``1m``). A job spec is a few KiB; OpenPAI's
rest-server parses JSON bodies with body-parser's default limit, 100 KiB."""

DEFAULT_CALL_LIMIT = "600/minute"
"""API calls per principal: OpenPAI rest-server's ``RATE_LIMIT_API_PER_MIN`` default, 600
(``src/rest-server/src/config/rate-limit.js``; OpenPAI keys it by client IP, Apiary by principal)."""

DEFAULT_SUBMIT_LIMIT = "3600/hour"
"""Job submissions per principal: one a second sustained. Looser than OpenPAI's
``RATE_LIMIT_SUBMIT_JOB_PER_HOUR`` default (60 an hour per user, same file); set ``"60/hour"`` for
OpenPAI's behaviour."""


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's declared body size in bytes, or None when it sends no ``Content-Length``.

    Raises ValidationError (field ``Content-Length``) for a value that is not ASCII digits, or for
    several headers that disagree (RFC 9110 section 8.6: a recipient must reject those).
    """
    values = {value.strip() for name, value in headers if name.lower() == b"content-length"}
    if not values:
        return None
    if len(values) > 1:
        raise ValidationError("Content-Length", "several different values")
    (value,) = values
    # bytes.isdigit is ASCII-only ("²" or "-1" are refused); int() alone would take "+1" or "1_0".
    if not value.isdigit():
        raise ValidationError("Content-Length", f"not a byte count: {value.decode('latin-1')!r}")
    return int(value)


class _BodyState:
    """What one request's body and response have done so far (one instance per request)."""

    def __init__(self) -> None:
        self.received = 0  # body bytes handed to the app so far
        self.exceeded = False  # the body went over the limit; the app was told so by an exception
        self.app_started = False  # the app sent http.response.start before the body went over


#: Where the storage file routes live (their uploads have a limit of their own).
UPLOAD_PREFIX = "/api/v2/storages/configs/"
#: The proxy to tasks' ports (``/api/v2/jobs/<job>/proxy/...``): its bodies are the task's
#: (a notebook saved, a file uploaded to JupyterLab), under the upload limit too.
PROXY_MARK = "/proxy/"
#: An image build's upload (a build directory as a tar): its route counts it against
#: ``APIARY_IMAGE_BUILD_MAX_BYTES`` itself, as it streams it to a file.
IMAGE_BUILDS = "/api/v2/images/builds"


class BodyLimitMiddleware:
    """Pure ASGI middleware: request bodies over ``max_bytes`` are answered 413.

    1. ``Content-Length`` malformed: 400 (``ValidationError``, field ``Content-Length``) at once.
    2. ``Content-Length`` over the limit: 413 at once; the app is not called, the body not read.
    3. Otherwise (a truthful length, or chunked with none) the bytes are counted as the app reads
       them. The ``http.request`` message that takes the count over the limit is not handed on:
       the app's ``receive`` raises :class:`~apiary.errors.PayloadTooLargeError` instead, and
       whatever the app answers to that (FastAPI turns any failure while reading a body into its
       own 400) is dropped and replaced with the 413. If the app had already started its response
       the status cannot change: the app gets the exception and its response goes out as it is.

    The error bodies have the app's error shape, ``ApiaryError.to_dict()``: for the 413
    ``{"code": "PayloadTooLarge", "message": ..., "field": "body"}``. Nothing is buffered: each
    chunk passes through as it arrives. Scopes other than ``http`` (websocket, lifespan) pass
    through untouched. Raises ValueError for a negative ``max_bytes``.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES, *,
                 upload_max_bytes: int | None = None) -> None:
        if max_bytes < 0 or (upload_max_bytes is not None and upload_max_bytes < 0):
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}, {upload_max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.upload_max_bytes = max_bytes if upload_max_bytes is None else upload_max_bytes

    def limit(self, scope: Scope) -> int:
        """The limit of this request: ``upload_max_bytes`` for a storage file upload (``PUT
        /api/v2/storages/configs/<name>/files``, whose route streams the body to disk), an image
        build's upload (``POST /api/v2/images/builds``, which has its own limit) and for a
        request to a task through the proxy (``/api/v2/jobs/<job>/proxy/...``, streamed to the
        task), else ``max_bytes``."""
        path = scope.get("path", "")
        if scope.get("method") == "PUT" and path.startswith(UPLOAD_PREFIX) and path.endswith("/files"):
            return self.upload_max_bytes
        if path.startswith("/api/v2/jobs/") and PROXY_MARK in path:
            return self.upload_max_bytes
        if scope.get("method") == "POST" and path == IMAGE_BUILDS:
            return self.upload_max_bytes
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.limit(scope)
        try:
            declared = _content_length(scope["headers"])
        except ValidationError as exc:
            await _answer(exc, scope, receive, send)
            return
        if declared is not None and declared > max_bytes:
            logger.info("body too large: declared_bytes=%d limit_bytes=%d path=%s",
                        declared, max_bytes, scope.get("path", ""))
            await _answer(PayloadTooLargeError(max_bytes), scope, receive, send)
            return

        state = _BodyState()

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state.received += len(message.get("body", b""))
                if state.received > max_bytes:
                    state.exceeded = True
                    raise PayloadTooLargeError(max_bytes)
            return message

        async def guarded_send(message: Message) -> None:
            if state.exceeded and not state.app_started:
                return  # the app's answer to a body cut short: the 413 below replaces it
            if message["type"] == "http.response.start":
                state.app_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not state.exceeded or state.app_started:
                raise
            # The app failed because its receive raised (or on the body it got cut short): the
            # request's answer is the 413, not the app's error.
            logger.debug("app failed on a body over the limit", exc_info=True)
        if state.exceeded and not state.app_started:
            logger.info("body too large: received_bytes>=%d limit_bytes=%d path=%s",
                        state.received, max_bytes, scope.get("path", ""))
            await _answer(PayloadTooLargeError(max_bytes), scope, receive, send)


async def _answer(exc: ApiaryError, scope: Scope, receive: Receive, send: Send) -> None:
    """Send ``exc`` as the app's error handler would: ``exc.to_dict()`` with ``exc.status_code``."""
    await JSONResponse(exc.to_dict(), status_code=exc.status_code)(scope, receive, send)


async def plain_text(request: Request, _caller: Caller) -> None:
    """Refuse a request whose path parameters, query parameters or headers hold a NUL character
    (ValidationError naming the parameter or header; nothing else is checked: percent-decoding
    replaces invalid UTF-8, so they hold no lone surrogates). A NUL reached the store's queries
    (``GET /api/v2/jobs?username=a%00``) and PostgreSQL failed the statement: a 500.

    It depends on the caller, so a request without a valid token is a 401 first, as everywhere.
    """
    for params in (request.path_params.items(), request.query_params.multi_items(), request.headers.items()):
        for name, value in params:
            check_string(name, value)


class RateLimiter:
    """Per-principal rate limits on API calls and on job submissions, in this process's memory.

    ``call_limit`` and ``submit_limit`` are strings in the ``limits`` notation (``"600/minute"``,
    ``"5 per second"``, ``"3600/hour"``); ValueError (naming the limit) for one that does not parse.

    Strategy: moving window, as ``limits``' MovingWindowRateLimiter counts it: a hit is admitted
    when fewer than the limit's amount of hits of its key fall in the window-long span ending now.
    A fixed window lets a caller send twice the limit within a second across a window boundary;
    the moving window never admits more than the limit in any window-long span, and its reset time
    (when the oldest hit in the window ages out) gives an exact ``Retry-After``. Its cost is one
    timestamp per hit in the window per key (at the defaults, at most 600 + 3600 per active
    principal). The windows are kept here (:class:`MovingWindows`) rather than in ``limits``'
    MemoryStorage, whose expiry starts a new timer thread 10 ms after the previous one ended, so
    under a stream of requests it starts up to a hundred threads a second. (Fixed-window-elastic,
    which pushes the window on with every hit, is deprecated in ``limits`` 4.1 and gone in 5.)

    Counts live in memory: they start at zero when the process starts and are not shared between
    API processes (one control plane serves the API). Thread-safe.
    """

    def __init__(self, call_limit: str = DEFAULT_CALL_LIMIT, submit_limit: str = DEFAULT_SUBMIT_LIMIT,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.call_limit = _parse_limit("call_limit", call_limit)
        self.submit_limit = _parse_limit("submit_limit", submit_limit)
        self._windows = MovingWindows(clock)

    def hit_call(self, key: str) -> None:
        """Count one API call by principal ``key`` (a user name: it is logged, so never a secret).

        Raises TooManyRequestsError (``retry_after`` in seconds, >= 1) when ``key`` has used up
        its calls; a refused call does not count.
        """
        self._hit(self.call_limit, "call", "API calls", key)

    def hit_submit(self, key: str) -> None:
        """Count one job submission by principal ``key``; a separate budget from :meth:`hit_call`
        (a submission is usually also a call: the caller counts both).

        Raises TooManyRequestsError (``retry_after`` in seconds, >= 1) when ``key`` has used up
        its submissions; a refused submission does not count.
        """
        self._hit(self.submit_limit, "submit", "job submissions", key)

    def check_submit(self, key: str) -> None:
        """Raise TooManyRequestsError (``retry_after`` in seconds, >= 1) when ``key`` has no job
        submission left, without counting one: the API checks before a submission and counts
        with :meth:`count_submit` once it is accepted, so a refused submission (a 400 spec, a 403
        VC, a 404 user, a 409 name) costs nothing of the budget.

        Concurrent submissions of one key that all pass the check may each be accepted: the
        budget can be overrun by at most the number of that key's submissions in flight at once
        (one per API worker thread), never more."""
        wait = self._windows.test(self.submit_limit, "submit", key)
        if wait is not None:
            self._refuse(self.submit_limit, "submit", "job submissions", key, wait)

    def count_submit(self, key: str) -> None:
        """Count one accepted job submission of ``key``. Never raises: the job was accepted
        already (a full window just stays full)."""
        self._windows.hit(self.submit_limit, "submit", key, force=True)

    def _hit(self, item: RateLimitItem, namespace: str, what: str, key: str) -> None:
        # The namespace keeps the two budgets apart even when both limits are the same string.
        wait = self._windows.hit(item, namespace, key)
        if wait is not None:
            self._refuse(item, namespace, what, key, wait)

    def _refuse(self, item: RateLimitItem, namespace: str, what: str, key: str, wait_s: float) -> NoReturn:
        retry_after = max(1, math.ceil(wait_s))
        logger.info("rate limited: key=%s limit=%s kind=%s retry_after_s=%d", key, item, namespace, retry_after)
        raise TooManyRequestsError(f"too many {what}: the limit is {item}; retry in {retry_after} s",
                                   retry_after=retry_after)


class MovingWindows:
    """Moving-window hit counts per ``(namespace, key)``: the times of the hits still in their
    window, oldest first, on ``clock`` (seconds; monotonic by default, so a stepped wall clock
    neither frees nor blocks a budget). Expired hits are dropped when their key is next counted
    or tested, and a key whose window is empty is forgotten then. Thread-safe (one lock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._hits: dict[tuple[str, str], deque[float]] = {}
        self._lock = threading.Lock()

    def _window(self, item: RateLimitItem, slot: tuple[str, str], now: float) -> deque[float] | None:
        """``slot``'s hits inside the window ending at ``now`` (lock held); None when there are none."""
        hits = self._hits.get(slot)
        if hits is None:
            return None
        start = now - item.get_expiry()
        while hits and hits[0] <= start:
            hits.popleft()
        if not hits:
            del self._hits[slot]
            return None
        return hits

    def test(self, item: RateLimitItem, namespace: str, key: str) -> float | None:
        """None when one more hit of ``key`` fits ``item``; else the seconds until one does."""
        with self._lock:
            now = self._clock()
            hits = self._window(item, (namespace, key), now)
            if hits is None or len(hits) < item.amount:
                return None
            return hits[-item.amount] + item.get_expiry() - now

    def hit(self, item: RateLimitItem, namespace: str, key: str, *, force: bool = False) -> float | None:
        """Count one hit of ``key`` and return None when it fits ``item`` (or ``force``: counted
        anyway); else count nothing and return the seconds until one fits."""
        with self._lock:
            now = self._clock()
            slot = (namespace, key)
            hits = self._window(item, slot, now)
            if hits is None:
                hits = self._hits[slot] = deque()
            elif len(hits) >= item.amount and not force:
                return hits[-item.amount] + item.get_expiry() - now
            hits.append(now)
            return None


def _parse_limit(name: str, text: str) -> RateLimitItem:
    """``text`` in the ``limits`` notation as a RateLimitItem; ValueError naming ``name`` if it is not."""
    try:
        return parse(text)
    except ValueError as e:
        raise ValueError(f"{name}: not a rate limit {text!r} (want e.g. '600/minute')") from e


def error_headers(exc: Exception) -> dict[str, str]:
    """Headers the app's error answer to ``exc`` carries: ``{"Retry-After": "<seconds>"}`` for a
    TooManyRequestsError with ``retry_after`` set, else ``{}``."""
    if isinstance(exc, TooManyRequestsError) and exc.retry_after is not None:
        return {"Retry-After": str(exc.retry_after)}
    return {}


def error_response(exc: ApiaryError) -> JSONResponse:
    """The API's answer to ``exc`` (the app's ApiaryError handler): its status, ``exc.to_dict()`` as
    the body, :func:`error_headers`, and ``WWW-Authenticate`` for a 401 (RFC 6750). A 5xx is logged."""
    if exc.status_code >= 500:
        logger.error("platform error: %s", exc.message)
    headers = error_headers(exc)
    if exc.status_code == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="apiary"'  # RFC 6750
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=headers)
