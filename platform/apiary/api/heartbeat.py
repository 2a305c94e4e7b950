"""The node agents' bare heartbeats, answered in front of the router.

A fleet's steady load is heartbeats: 5,000 nodes beating every 10 s are 500 requests a second that
change nothing stored (:meth:`~apiary.control.node_service.NodeService.bare_heartbeat`). Through
FastAPI each cost the leader's one interpreter about 0.65 ms of routing, dependency solving, model
validation and response serialisation (py-spy on the leader under 5,000 hollow nodes: 42% of its
time, while the heartbeat itself took under 1%). :class:`HeartbeatFastPath` answers such a beat
itself, judging it exactly as the route does, with the same parts:

* ``POST /api/v2/nodes/{node}/status`` with ``Content-Type: application/json``, no query string,
  no NUL in a header (the :func:`~apiary.api.guards.plain_text` guard) and a body of at most
  :data:`MAX_BODY_BYTES`;
* a bearer token already in the directory's verified-token cache
  (:meth:`~apiary.auth.Directory.authenticate_cached`) that is ``node``'s own agent's
  (:meth:`~apiary.auth.Principal.is_agent_of`);
* a body that :class:`~apiary.api.schemas.NodeReport` validates, with no runs, no logs and no
  ``cannotRecord``, which the plane takes as a bare heartbeat (True from ``bare_heartbeat``).

Then the answer is the route's: 200 ``{"ack":[]}`` with the node-lost grace header. Anything else
(another route, a token to look up in the store, a wrong token, a body the model refuses, a report
with runs, an unknown node) goes on to the route unchanged, the body replayed, and gets the route's
answer (401, 403, 404, 400 naming the field, the full report path). On a follower the replica middleware forwards
agents' requests to the leader before they get here.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError as ModelError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from apiary.api.schemas import NodeReport
from apiary.errors import ApiaryError
from apiary.runtime.link import GRACE_HEADER

#: The largest body judged here: a bare heartbeat is about 200 bytes.
MAX_BODY_BYTES = 4096

_STATUS_PATH = re.compile(r"^/api/v2/nodes/([^/\x00]{1,253})/status$")
_ANSWER = b'{"ack":[]}'


class HeartbeatFastPath:
    """ASGI middleware (module doc). ``app.state`` must hold ``plane`` and ``directory``, as
    :func:`apiary.api.create_app` sets them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _STATUS_PATH.match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if match is None or scope.get("query_string"):
            await self.app(scope, receive, send)
            return
        node = match.group(1)
        token, json_body = None, False
        for key, value in scope["headers"]:
            if b"\x00" in value:
                await self.app(scope, receive, send)
                return
            if key == b"authorization":
                scheme, _, rest = value.decode("latin-1").partition(" ")
                token = rest.strip() if scheme.lower() == "bearer" else None
            elif key == b"content-type":
                json_body = value.split(b";")[0].strip().lower() == b"application/json"
        state = scope["app"].state
        try:
            caller = state.directory.authenticate_cached(token) if token and json_body else None
        except ApiaryError:  # a wrong or expired token: the route answers 401
            caller = None
        if caller is None or not caller.is_agent_of(node):
            await self.app(scope, receive, send)
            return
        body, messages, complete = await _read_body(receive, MAX_BODY_BYTES)
        if complete and self._beat(state.plane, node, body):
            grace = grace_header_value(state.plane).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-length", str(len(_ANSWER)).encode()), (b"content-type", b"application/json"),
                (GRACE_HEADER.lower().encode(), grace)]})
            await send({"type": "http.response.body", "body": _ANSWER})
            return
        await self.app(scope, _replay(messages, receive), send)

    @staticmethod
    def _beat(plane: Any, node: str, body: bytes) -> bool:
        try:
            report = NodeReport.model_validate_json(body)
        except (ModelError, ApiaryError):  # the route answers 400 naming the field
            return False
        try:
            return take_bare_heartbeat(plane, node, report)
        except ApiaryError:  # an undeclared node: the route answers 404
            return False


def take_bare_heartbeat(plane: Any, node: str, report: NodeReport) -> bool:
    """Whether ``report`` is a bare heartbeat (no runs, no logs, no ``cannotRecord``) that the
    plane took in memory (:meth:`~apiary.control.node_service.NodeService.bare_heartbeat`); the
    route and :class:`HeartbeatFastPath` both ask this. Raises NotFoundError for an undeclared node."""
    if report.runs or report.logs or report.cannotRecord is not None:
        return False
    return bool(plane.bare_heartbeat(
        node, gpus=report.gpus, simulated_gpus=report.simulatedGpus, address=report.address,
        agent_id=report.agentId, metrics_url=report.metricsUrl, faults_applied=report.faultsApplied))


def grace_header_value(plane: Any) -> str:
    """The :data:`~apiary.runtime.link.GRACE_HEADER` value: the plane's node-lost grace in seconds."""
    return f"{plane.nodes.node_lost_after_s:g}"


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, list[Message], bool]:
    """The request's body messages until the body ends or passes ``limit`` bytes. Returns the body
    read, the messages as received (to replay) and whether the body ended within the limit."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":  # the client went away
            return b"", messages, False
        size += len(message.get("body", b""))
        if size > limit:
            return b"", messages, False
        if not message.get("more_body", False):
            return b"".join(m.get("body", b"") for m in messages), messages, True


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that hands out ``messages`` first, then the rest from the client."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
