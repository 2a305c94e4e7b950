"""A follower's side of the replicated control plane: serve reads, forward the rest to the leader.

:class:`ReplicaRouter` is an ASGI middleware around the app of :func:`apiary.api.create_app`
(:func:`apiary.wiring.app_of` adds it). On the leader (and on the one SQLite replica) it passes every
request through. On a follower:

* reads whose answer the store holds (:func:`served_by_followers`: jobs, events, identity,
  incidents, alerts, CI records, the OpenAPI pages) are served here, from the store;
* every other request is forwarded to the leader's advertised URL, read from the lease: writes, the
  node agents' long polls, reports and log uploads (they need the leader's memory: assignment
  generations, heartbeats), and reads of the leader's memory or disk (``/api/v2/nodes``, the
  cluster status, task logs, drills, ``/metrics``). Request and answer are streamed through an
  ``httpx.AsyncClient`` verifying the leader's certificate against the platform CA; headers pass
  unchanged (``Authorization`` included) but the hop-by-hop ones (RFC 9110 section 7.6.1);
* while no leader is known (an empty or expired lease) the answer is 503 ``NotLeaderError``
  "no leader elected yet" with ``Retry-After: 1``; a leader that cannot be reached is a 503 too.

A forwarded request carries ``X-Apiary-Forwarded-By: <replica>``; a replica that receives one while
it does not lead answers 503 instead of forwarding it again (no loops between replicas whose views
of the lease disagree for a moment). ``GET /healthz`` is always answered here, with the replica's
role added (:class:`~apiary.control.health.ReplicaRole`).
"""

from __future__ import annotations

import json
import logging
import re
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from apiary.control.health import ReplicaRole

logger = logging.getLogger(__name__)

FORWARDED_BY = "x-apiary-forwarded-by"

#: Hop-by-hop headers (RFC 9110 section 7.6.1) and the ones httpx sets for the new connection.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "host",
})

#: GET paths a follower answers from the store (everything else goes to the leader).
_FOLLOWER_READS = re.compile(
    r"^/(?:docs|redoc|openapi\.json"
    r"|api/v2/(?:jobs|jobs/[^/]+|events|me|users|users/[^/]+|groups|tokens|alerts|oncall"
    r"|incidents(?:/[^/]+(?:/postmortem)?)?|incidents/quality|incidents/action-items"
    r"|ci/runs|ci/records|ci/deliveries|deployments))/?$"
)

#: Seconds to wait for the leader's answer: longer than the longest agent long poll (60 s).
FORWARD_READ_TIMEOUT_S = 90.0


def served_by_followers(method: str, path: str) -> bool:
    """Whether a follower answers ``method path`` itself (a read the store answers)."""
    return method in ("GET", "HEAD") and _FOLLOWER_READS.match(path) is not None


class ReplicaRouter:
    """The middleware; see the module docstring. ``role`` says this replica's role now (cheap,
    thread-safe); ``verify`` is httpx's ``verify=`` for the leader's HTTPS
    (:func:`apiary.client.http_verify`); ``transport`` lets tests forward in-process."""

    def __init__(self, app: ASGIApp, role: Callable[[], ReplicaRole], *, verify: ssl.SSLContext | bool = True,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.app = app
        self.role = role
        self._verify = verify
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        # Made on first use, inside the server's event loop.
        if self._client is None:
            self._client = httpx.AsyncClient(
                verify=self._verify, transport=self._transport, follow_redirects=False,
                timeout=httpx.Timeout(10.0, read=FORWARD_READ_TIMEOUT_S), limits=httpx.Limits(max_connections=1000),
            )
        return self._client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        role = self.role()
        if path == "/healthz":
            await self.app(scope, receive, _with_role(send, role))
            return
        if role.leading or served_by_followers(scope["method"], path):
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]
        if any(k == FORWARDED_BY for k, _ in headers):
            await _unavailable(send, f"replica {role.replica} received a forwarded request but does not lead "
                                     f"(the lease names {role.leader_url or 'no leader'}); retry")
            return
        if not role.leader_url:
            await _unavailable(send, "no leader elected yet (the leader lease is empty or expired); retry in a second")
            return
        await self._forward(scope, receive, send, role, headers)

    async def _forward(self, scope: Scope, receive: Receive, send: Send, role: ReplicaRole,
                       headers: list[tuple[str, str]]) -> None:
        url = role.leader_url.rstrip("/") + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        out = [(k, v) for k, v in headers if k not in _HOP_BY_HOP]
        out.append((FORWARDED_BY, role.replica))
        client = scope.get("client")
        if client:
            out.append(("x-forwarded-for", str(client[0])))
        has_body = any(k in ("content-length", "transfer-encoding") for k, _ in headers)
        request = self._http().build_request(scope["method"], url, headers=out,
                                             content=_body(receive) if has_body else None)
        try:
            response = await self._http().send(request, stream=True)
        except httpx.HTTPError as e:
            logger.warning("forwarding %s %s to the leader %s failed: %s", scope["method"], scope["path"],
                           role.leader_url, e)
            await _unavailable(send, f"the leader {role.leader_url} is not reachable from replica {role.replica} "
                                     f"({type(e).__name__}); retry")
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                                    for k, v in response.headers.multi_items() if k.lower() not in _HOP_BY_HOP]})
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as e:  # the leader went away mid-answer: end it (the client sees it short)
                logger.warning("the leader %s broke off an answer: %s", role.leader_url, e)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


async def _unavailable(send: Send, message: str) -> None:
    body = json.dumps({"code": "NotLeaderError", "message": message}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})


def _with_role(send: Send, role: ReplicaRole) -> Send:
    """A ``send`` that adds ``role``'s fields to a JSON answer (``/healthz``)."""
    start: dict[str, Any] | None = None
    parts: list[bytes] = []

    async def wrapped(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = dict(message)
            return
        if message["type"] != "http.response.body" or start is None:
            await send(message)
            return
        parts.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(parts)
        try:
            data = json.loads(body)
            if isinstance(data, dict):
                body = json.dumps({**data, **role.fields()}).encode()
        except ValueError:
            pass
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return wrapped
