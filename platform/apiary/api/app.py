"""FastAPI app over a :class:`~apiary.control.ControlPlane`. Routes are thin; logic lives in the plane.

The routes are in :mod:`apiary.api.routers`, one module per resource: ``jobs`` (OpenPAI REST
server v2: ``POST /api/v2/jobs`` with a YAML or JSON body, ``GET /api/v2/jobs``,
``GET /api/v2/jobs/{user}~{name}``, ``PUT .../executionType`` with ``{"value": "STOP"}``, task
logs, and ``/api/v2/events`` for the Prefect bridge), ``cluster`` (scheduler cycle, status,
config), ``nodes``, ``alerts``, ``agents`` (``/api/v2/nodes/{node}/...`` for node agents) and
``identity`` (users, groups, tokens, ``/api/v2/me``). Every route but ``/healthz``, ``/metrics``
and the OpenAPI pages needs ``Authorization: Bearer <token>`` (:mod:`apiary.api.auth`). Bodies
are capped (413) and users' calls rate-limited (429 with ``Retry-After``; :mod:`apiary.api.guards`).
Bodies are the models of :mod:`apiary.api.schemas`. Errors answer ``{"code", "message"}`` (plus
``"field"`` for a ValidationError) with the status of the :mod:`apiary.errors` class; a
malformed request (FastAPI's RequestValidationError) is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from apiary.api import routers
from apiary.api.auth import bearer
from apiary.api.guards import BodyLimitMiddleware, RateLimiter, error_headers
from apiary.api.longpoll import NodeWaiters
from apiary.api.schemas import ERROR_RESPONSES, Health
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.errors import ApiaryError, ValidationError
from apiary.monitoring.platform_metrics import PlatformCollector
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.settings import Settings

logger = logging.getLogger(__name__)


def create_app(
    plane: ControlPlane, receiver: AlertReceiver | None = None, *, cluster_id: str | None = None,
    directory: Directory | None = None, settings: Settings | None = None,
) -> FastAPI:
    """The app over ``plane``; ``receiver`` handles Alertmanager's webhook (default: the
    packaged actions config, or ``APIARY_ALERT_ACTIONS``); ``cluster_id`` is the platform's identity
    that ``/healthz`` answers (:func:`apiary.settings.ensure_cluster_id`); ``directory`` verifies
    tokens (default: over the plane's store); ``settings`` gives the body cap, rate limits and
    whether ``/metrics`` is public (default: the environment's)."""
    settings = settings or Settings()
    if receiver is None:
        receiver = AlertReceiver(plane, ActionsConfig.load(settings.alert_actions))
    directory = directory or Directory(plane.sessions)
    waiters = NodeWaiters()
    started = time.time()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Bind the plane's change notifications to this event loop, so a placement committed by
        # the scheduling thread wakes the agents' long polls at once.
        plane.on_nodes_changed = waiters.notifier(asyncio.get_running_loop())
        yield

    app = FastAPI(title="Apiary", version="0.1.0", description="Multi-tenant GPU cluster platform", lifespan=lifespan)
    app.state.plane = plane
    app.state.receiver = receiver
    app.state.waiters = waiters
    app.state.directory = directory
    app.state.limiter = RateLimiter(settings.rate_calls, settings.rate_submits)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)

    @app.exception_handler(ApiaryError)
    async def _apiary_error(_request: Request, exc: ApiaryError) -> JSONResponse:
        if exc.status_code >= 500:
            logger.error("platform error: %s", exc.message)
        headers = error_headers(exc)
        if exc.status_code == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="apiary"'  # RFC 6750
        return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _request_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        err = ValidationError(field, first.get("msg", "invalid request"))
        return JSONResponse(err.to_dict(), status_code=400)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(PlatformCollector(plane.metrics_snapshot))

    @app.get(
        "/metrics",
        response_class=Response,
        responses={401: ERROR_RESPONSES[401], 200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                         "description": "Prometheus text exposition format."}},
    )
    def metrics(request: Request) -> Response:
        """Prometheus exposition of the platform metrics (apiary_jobs, queue, VC cells, ...); public
        unless ``APIARY_METRICS_PUBLIC=false`` (then any valid token)."""
        if not settings.metrics_public:
            directory.authenticate(bearer(request))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", response_model=Health)
    def healthz() -> dict:
        """Liveness: the serving process, when it started, and which platform it is."""
        return {"status": "ok", "pid": os.getpid(), "startedAt": started, "clusterId": cluster_id}

    for router in routers.ALL:
        app.include_router(router)
    return app
