"""Job submissions from users, answered in front of the router.

``POST /api/v2/jobs`` is the hottest write route. Through FastAPI a submission cost the control
plane about 0.6 ms of routing, middleware and dependency solving, a quarter of its CPU per job
(py-spy on the ``api`` bench, bench/README.md), as much as parsing and committing the job.
:class:`SubmitFastPath` answers the common case itself, with the route's own parts:

* ``POST /api/v2/jobs``, no query string, no NUL in a header (the
  :func:`~apiary.api.guards.plain_text` guard), neither ``X-Apiary-On-Behalf-Of`` nor
  ``X-Apiary-Flow-Run-Id`` (the Prefect bridge's and admins' headers);
* a bearer token already in the directory's verified-token cache
  (:meth:`~apiary.auth.Directory.authenticate_cached`) of a user (admin or not): the submitter is
  the caller, as :func:`~apiary.api.auth.submitter` decides for a user without the header;
* then exactly the route's steps: the caller's call limit (:func:`~apiary.api.auth.get_principal`),
  and :func:`~apiary.api.routers.jobs.accept_submission` (submission limit, body, the plane's
  group commit with the VC grant check). The answer is the route's: 202 with the job's JSON, or
  the API's error answer (:func:`~apiary.api.guards.error_response`) for what they raise.

Anything else (another route, a token to look up in the store, a wrong token, an agent's or a
service's token, the bridge's headers) goes on to the route unchanged and gets the route's answer.
The route stays in the OpenAPI document and in the access table (:mod:`apiary.api.access`); the
tests of the route run against this path for every cached user token. On a follower the replica
middleware forwards writes to the leader before they get here.
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from apiary.api.auth import ON_BEHALF_HEADER, bearer
from apiary.api.guards import error_response
from apiary.api.routers.jobs import FLOW_RUN_HEADER, accept_submission
from apiary.errors import ApiaryError

_JOBS_PATH = "/api/v2/jobs"
#: Headers that only the route judges (the bridge's and admins' submissions).
_ROUTE_HEADERS = frozenset({ON_BEHALF_HEADER.lower().encode(), FLOW_RUN_HEADER.lower().encode()})


class SubmitFastPath:
    """ASGI middleware (module doc). ``app.state`` must hold ``plane``, ``directory`` and
    ``limiter``, as :func:`apiary.api.create_app` sets them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != _JOBS_PATH
                or scope.get("query_string")):
            await self.app(scope, receive, send)
            return
        if any(b"\x00" in key or b"\x00" in value or key in _ROUTE_HEADERS for key, value in scope["headers"]):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        state = request.app.state
        token = bearer(request)
        try:
            caller = state.directory.authenticate_cached(token) if token else None
        except ApiaryError:  # a wrong or expired token: the route answers 401
            caller = None
        if caller is None or caller.kind != "user":
            await self.app(scope, receive, send)
            return
        try:
            limiter = getattr(state, "limiter", None)
            if limiter is not None and not caller.admin:
                limiter.hit_call(caller.name)  # as get_principal: admins are not limited
            job = await accept_submission(state, caller, request.body, None)
        except ApiaryError as exc:
            await error_response(exc)(scope, receive, send)
            return
        except ClientDisconnect:  # gone before its body arrived: nothing was submitted, nobody to answer
            return
        await JSONResponse(job, status_code=202)(scope, receive, send)
