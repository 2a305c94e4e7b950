"""A reverse proxy to a task instance's named port: ``/api/v2/jobs/{job_id}/proxy/{role}/{index}/{port}/...``.

JupyterLab, TensorBoard or any web server a task runs on one of its named ports
(``resourcePerInstance.ports``) is reached through the control plane's API, HTTP (every method,
streamed both ways with httpx) and websockets (relayed with the ``websockets`` client), by the
job's **owner** only: a user token whose name is the job's user. Anyone else with a token gets 403
(admins and the Prefect bridge included), a user who may not see the job 404 (as the other job
routes), no token 401. ``{port}`` is one of the instance's named ports, by number or by name
(``jupyter``, ``tensorboard``); any other is 403 naming those it has, and the instance must be
RUNNING (409). Where the request goes: :class:`apiary.control.proxy.ProxyTargets`.

**The caller's token.** ``Authorization: Bearer <token>``, or the cookie :data:`COOKIE`, or
``?token=<token>``: a browser cannot add a header to every asset it loads, so a request whose
``token`` query parameter is a valid platform token is answered with a redirect to the same URL
without it, setting the cookie (HttpOnly, SameSite=Strict, ``Path=/api/v2/jobs/<job>/proxy/``: sent
to that job's proxy only). A ``token`` parameter that is no platform token is the task's own and is
forwarded. A websocket takes the same three; its ``?token=`` is stripped before forwarding.

**What the task sees.** The request's path as it came (servers run with the proxy path as their
base URL) and its query; its headers without the hop-by-hop ones, without ``Authorization``, and
without the platform's cookie (other cookies pass: the task's own, such as Jupyter's ``_xsrf``);
``Host`` as the caller sent it (Jupyter compares it with ``Origin``) and ``X-Forwarded-For`` /
``-Proto`` / ``-Host``; and ``Authorization: token <secret>``, the instance's own secret
(:data:`apiary.control.proxy.SECRET_ENV`), so a server that checks it answers the proxy only. A
websocket is opened without ``Origin``. A response's ``Set-Cookie`` for the platform's cookie name
is dropped. The platform token never reaches the task.

Proxied requests do not count against the caller's API call limit (they are the task's traffic:
JupyterLab loads a hundred assets at start); the body size cap applies as to storage uploads
(:meth:`apiary.api.guards.BodyLimitMiddleware.limit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode

import httpx
from fastapi import APIRouter, Path, Request, WebSocket
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import HTTPConnection
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.typing import Subprotocol

from apiary.api.schemas import ERROR_RESPONSES, MAX_INDEX, ErrorBody, check_string
from apiary.auth import Principal
from apiary.control import ControlPlane
from apiary.control.proxy import Upstream
from apiary.errors import ApiaryError, ForbiddenError, NotFoundError, PlatformError, UnauthorizedError

logger = logging.getLogger(__name__)

#: The cookie that carries the caller's platform token to one job's proxy path.
COOKIE = "apiary_proxy_token"
PATH = "/api/v2/jobs/{job_id}/proxy/{role}/{index}/{port}/{path:path}"
#: The methods proxied (each one operation of the OpenAPI document; HEAD comes with GET).
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
#: RFC 9110 section 7.6.1's hop-by-hop headers, and what the proxy sets itself.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "proxy-connection"})
_NOT_FORWARDED = _HOP | {"authorization", "cookie", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"}
#: Seconds: connecting to the task, and a pause in its answer or in the request body.
CONNECT_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 600.0

router = APIRouter(prefix="", tags=["proxy"], responses=ERROR_RESPONSES)


class BadGatewayError(PlatformError):
    """The task instance did not answer on its port (HTTP 502)."""

    status_code = 502
    code = "BadGatewayError"


_ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"description": "The task's own answer (any status, headers and body it sends, streamed).",
          "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}},
    303: {"description": "`?token=` was a platform token: the same URL without it, with the proxy cookie set."},
    307: {"description": "As 303, for a method other than GET or HEAD."},
    502: {"model": ErrorBody, "description": "The task does not answer on that port."},
}


# --------------------------------------------------------------------------- who is calling


def _may_proxy(plane: ControlPlane, caller: Principal, job_id: str) -> None:
    """The job's owner only: 403 for a token that is no user's, 404 for a job the caller may not
    see, 403 for anyone else who sees it (admins too)."""
    if caller.kind != "user":
        raise ForbiddenError(f"Only the job's owner may reach its tasks' ports; you are {caller.describe()}.")
    user, vc = plane.job_owner(job_id)
    if not caller.may_see(user, vc):
        raise NotFoundError(f"Job {job_id} not found.")
    if caller.name != user:
        raise ForbiddenError(f"Only {user} may reach the ports of job {job_id} (admins too are refused: the "
                             f"task's servers act as its owner); you are {caller.describe()}.")


def _authenticate(conn: HTTPConnection, token: str | None) -> Principal:
    """The principal of ``token`` (UnauthorizedError for none or a bad one); a store read at most."""
    directory = conn.app.state.directory
    principal = directory.authenticate_cached(token)
    return principal if principal is not None else directory.authenticate(token)


def _bearer(conn: HTTPConnection) -> str | None:
    scheme, _, token = (conn.headers.get("authorization") or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _query_token(conn: HTTPConnection) -> Principal | None:
    """The principal of a ``?token=`` that is a platform token, else None (the task's own parameter)."""
    token = conn.query_params.get("token")
    if not token:
        return None
    try:
        return _authenticate(conn, token)
    except UnauthorizedError:
        return None


def _resolve(conn: HTTPConnection, job_id: str, role: str, index: int, port: str,
             from_query: Principal | None) -> Upstream:
    """Authenticate (header, then cookie, unless the query's token already did), check the owner,
    and find the upstream. Blocking (store reads): run in a worker thread."""
    for name, value in (("job_id", job_id), ("role", role), ("port", port)):
        check_string(name, value)
    caller = from_query or _authenticate(conn, _bearer(conn) or conn.cookies.get(COOKIE))
    plane: ControlPlane = conn.app.state.plane
    _may_proxy(plane, caller, job_id)
    return plane.proxy.resolve(job_id, role, index, port)


# --------------------------------------------------------------------------- what is forwarded


def _raw_path(conn: HTTPConnection) -> str:
    raw = conn.scope.get("raw_path")
    return raw.decode("latin-1") if raw else conn.url.path


def _query(conn: HTTPConnection, drop_token: bool) -> str:
    query = conn.scope.get("query_string", b"").decode("latin-1")
    if not drop_token or "token" not in conn.query_params:
        return query
    return urlencode([(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "token"])


def _cookies_but_ours(header: str | None) -> str | None:
    """The ``Cookie`` header without the platform's cookie (None when nothing is left)."""
    kept = [c.strip() for c in (header or "").split(";") if c.strip() and c.split("=", 1)[0].strip() != COOKIE]
    return "; ".join(kept) or None


def _forward_headers(conn: HTTPConnection, up: Upstream, *, keep: Iterable[str] = ()) -> list[tuple[str, str]]:
    """The request's headers as the task gets them (module docstring, *What the task sees*)."""
    out = [(k, v) for k, v in conn.headers.items() if k.lower() not in _NOT_FORWARDED or k.lower() in keep]
    cookies = _cookies_but_ours(conn.headers.get("cookie"))
    if cookies:
        out.append(("cookie", cookies))
    client = conn.client.host if conn.client else ""
    prior = conn.headers.get("x-forwarded-for")
    out += [("x-forwarded-for", f"{prior}, {client}" if prior else client),
            ("x-forwarded-proto", conn.url.scheme.replace("ws", "http")),
            ("x-forwarded-host", conn.headers.get("host", ""))]
    if up.secret:
        out.append(("authorization", f"token {up.secret}"))
    return out


def _answer_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The task's response headers without the hop-by-hop ones and without a cookie of our name."""
    out = []
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name in _HOP or name == "set-cookie" and v.split(b"=", 1)[0].strip() == COOKIE.encode():
            continue
        out.append((k, v))
    return out


def _cookie_path(conn: HTTPConnection) -> str:
    """``/api/v2/jobs/<job>/proxy/`` as the caller wrote it (the browser matches cookies on that)."""
    raw = _raw_path(conn)
    return raw[: raw.index("/proxy/") + len("/proxy/")]


def _redirect_with_cookie(request: Request, token: str) -> Response:
    query = _query(request, drop_token=True)
    location = _raw_path(request) + (f"?{query}" if query else "")
    response = RedirectResponse(location, status_code=303 if request.method in ("GET", "HEAD") else 307)
    response.set_cookie(COOKIE, token, path=_cookie_path(request), httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    response.headers["Cache-Control"] = "no-store"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


# --------------------------------------------------------------------------- HTTP


async def proxy_http(request: Request, job_id: str, role: str,
                     index: Annotated[int, Path(ge=0, le=MAX_INDEX)], port: str, path: str) -> Response:
    """Forward the request to the task instance's named port ``port`` (a number or a port name) and
    stream its answer back; the job's owner only. ``?token=<platform token>`` answers a redirect
    without it that sets the proxy cookie (see the module docs)."""
    from_query = _query_token(request)
    up = await run_in_threadpool(_resolve, request, job_id, role, index, port, from_query)
    if from_query is not None:
        return _redirect_with_cookie(request, request.query_params["token"])
    query = _query(request, drop_token=False)
    url = f"http://{up.netloc}{_raw_path(request)}" + (f"?{query}" if query else "")
    has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
    client = httpx.AsyncClient(timeout=httpx.Timeout(IDLE_TIMEOUT_S, connect=CONNECT_TIMEOUT_S), trust_env=False)
    upstream = client.build_request(request.method, url, headers=_forward_headers(request, up),
                                    content=request.stream() if has_body else None)
    try:
        answer = await client.send(upstream, stream=True)
    except httpx.HTTPError as exc:
        await client.aclose()
        logger.info("proxy: no answer job=%s task=%s/%d port=%d error=%s", job_id, role, index, up.port,
                    type(exc).__name__)
        raise BadGatewayError(f"Task instance {role}/{index} of job {job_id} does not answer on port {up.port} "
                              f"({type(exc).__name__}); is its server listening on the node's address?") from exc

    async def close() -> None:
        await answer.aclose()
        await client.aclose()

    response = StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, background=BackgroundTask(close))
    response.raw_headers = _answer_headers(answer.headers.raw)
    return response


for _method in METHODS:
    router.add_api_route(
        PATH, proxy_http, methods=[_method], name=f"proxy_{_method.lower()}", response_class=Response,
        responses=_ANSWERS, summary=f"{_method} through the proxy to a task instance's named port",
    )


# --------------------------------------------------------------------------- websockets


async def _deny(websocket: WebSocket, exc: ApiaryError) -> None:
    """Refuse the handshake with the error's status and body (close 1008 where the server cannot)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse(exc.to_dict(), status_code=exc.status_code))
    else:
        await websocket.close(code=1008, reason=exc.message[:120])


def _close_code(code: int | None) -> int:
    """A close code that may be sent (1005, 1006 and 1015 only describe a close; 1011 instead)."""
    return 1000 if code is None else 1011 if code in (1005, 1006, 1015) else code


@router.websocket(PATH)
async def proxy_websocket(websocket: WebSocket, job_id: str, role: str, index: int, port: str, path: str) -> None:
    """Relay a websocket to the task instance's named port, as :func:`proxy_http` does HTTP."""
    from_query = _query_token(websocket)
    try:
        if not 0 <= index <= MAX_INDEX:
            raise NotFoundError(f"Job {job_id} has no task instance {role}/{index}.")
        up = await run_in_threadpool(_resolve, websocket, job_id, role, index, port, from_query)
    except ApiaryError as exc:
        await _deny(websocket, exc)
        return
    query = _query(websocket, drop_token=from_query is not None)
    url = f"ws://{up.netloc}{_raw_path(websocket)}" + (f"?{query}" if query else "")
    ws_own = {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol",
              "origin", "host"}
    headers = [(k, v) for k, v in _forward_headers(websocket, up) if k.lower() not in ws_own]
    offered = [Subprotocol(p) for p in websocket.scope.get("subprotocols", [])]
    try:
        upstream = await connect(url, additional_headers=headers, subprotocols=offered or None, origin=None,
                                 open_timeout=CONNECT_TIMEOUT_S, max_size=None, compression=None,
                                 user_agent_header=None)
    except (OSError, TimeoutError, InvalidStatus, WebSocketException) as exc:
        logger.info("proxy: websocket refused job=%s task=%s/%d port=%d error=%s", job_id, role, index, up.port,
                    type(exc).__name__)
        status = exc.response.status_code if isinstance(exc, InvalidStatus) else None
        await _deny(websocket, BadGatewayError(
            f"Task instance {role}/{index} of job {job_id} refused a websocket on port {up.port} "
            f"({type(exc).__name__}{f' {status}' if status else ''})."))
        return
    async with upstream:
        await websocket.accept(subprotocol=upstream.subprotocol)
        await _relay(websocket, upstream)


async def _relay(websocket: WebSocket, upstream: ClientConnection) -> None:
    """Copy messages both ways until either side closes; then close the other with its code."""

    async def from_client() -> None:
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    await upstream.close(code=_close_code(message.get("code")))
                    return
                data = message.get("text") if message.get("text") is not None else message.get("bytes")
                if data is not None:
                    await upstream.send(data)
        except ConnectionClosed:
            return

    async def from_task() -> None:
        try:
            async for data in upstream:
                if isinstance(data, str):
                    await websocket.send_text(data)
                else:
                    await websocket.send_bytes(data)
        except ConnectionClosed:
            pass
        except (WebSocketDisconnect, RuntimeError):
            return  # the client went away first
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):
            await websocket.close(code=_close_code(upstream.close_code))

    tasks = [asyncio.create_task(from_client()), asyncio.create_task(from_task())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
