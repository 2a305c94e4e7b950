"""FastAPI app over a :class:`~apiary.control.ControlPlane`. Routes are thin; logic lives in the plane.

The routes are in :mod:`apiary.api.routers`, one module per resource: ``jobs`` (OpenPAI REST
server v2: ``POST /api/v2/jobs`` with a YAML or JSON body, ``GET /api/v2/jobs``,
``GET /api/v2/jobs/{user}~{name}``, ``PUT .../executionType`` with ``{"value": "STOP"}``, task
logs, and ``/api/v2/events`` for the Prefect bridge), ``cluster`` (scheduler cycle, status,
config), ``nodes``, ``alerts``, ``agents`` (``/api/v2/nodes/{node}/...`` for node agents),
``identity`` (users, groups, tokens, ``/api/v2/me``), ``drills`` (drill results, shown in
``/metrics``), ``ci`` (GitHub's webhook, :mod:`apiary.ci`) and ``join`` (bootstrap tokens, the
public ``/api/v2/cluster-info``, a node's join). Every route but ``/healthz``, ``/metrics``, the
OpenAPI pages, ``/api/v2/cluster-info``, GitHub's webhook (signed with its secret instead) and a
node's join (a bootstrap token instead) needs
``Authorization: Bearer <token>`` (:mod:`apiary.api.auth`); who may call each route is the one
table :data:`apiary.api.access.ACCESS`, which the OpenAPI document publishes per operation
(``x-apiary-principals``). Bodies are capped (413) and users'
calls rate-limited (429 with ``Retry-After``; :mod:`apiary.api.guards`). Bodies are the models
of :mod:`apiary.api.schemas`. Errors answer ``{"code", "message"}`` (plus ``"field"`` for a
ValidationError) with the status of the :mod:`apiary.errors` class; a
malformed request (FastAPI's RequestValidationError, a JSON body that does not parse) is a 400
naming the field, after a 401 for a caller without a valid token. Starlette's own answers have the
same shape: an unknown route is a 404 ``NoApiError`` (OpenPAI's code), a method the path does not
have a 405 whose ``Allow`` lists the path's methods, an unexpected exception a 500 ``PlatformError``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.routing import Match

from apiary.api import routers
from apiary.api.access import ACCESS
from apiary.api.auth import bearer
from apiary.api.guards import BodyLimitMiddleware, RateLimiter, error_response
from apiary.api.heartbeat import HeartbeatFastPath
from apiary.api.longpoll import NodeWaiters
from apiary.api.routers import join
from apiary.api.routers.jobs import submit_text
from apiary.api.schemas import ERROR_RESPONSES, Health, job_protocol_components
from apiary.api.submit_path import SubmitFastPath
from apiary.auth import Directory
from apiary.auth.bootstrap_tokens import BootstrapTokens
from apiary.ci.intake import WebhookIntake
from apiary.ci.records import CiRecords
from apiary.ci.starter import PrefectStarter
from apiary.control import ControlPlane
from apiary.control.health import HealthCheck
from apiary.control.proxy import InstanceSecrets
from apiary.drills.board import DrillBoard
from apiary.errors import (
    ApiaryError,
    ForbiddenError,
    NotFoundError,
    PlatformError,
    UnauthorizedError,
    UserError,
    ValidationError,
)
from apiary.images.service import ImageService
from apiary.marketplace.identity import MlflowIdentity, TaskTokens
from apiary.marketplace.models import ModelRegistry
from apiary.marketplace.templates import TemplateService
from apiary.monitoring.ci_metrics import CiCollector
from apiary.monitoring.incident_metrics import IncidentCollector
from apiary.monitoring.platform_metrics import PlatformCollector
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.response.config import ResponseConfig
from apiary.response.links import LinkSigner
from apiary.response.reports import metrics_snapshot
from apiary.response.service import IncidentService
from apiary.response.store import IncidentStore
from apiary.settings import Settings
from apiary.storage.files import StorageFiles
from apiary.storage.service import MountPlanner, StorageService

logger = logging.getLogger(__name__)


def create_app(
    plane: ControlPlane, receiver: AlertReceiver | None = None, *, cluster_id: str | None = None,
    directory: Directory | None = None, settings: Settings | None = None, drills: DrillBoard | None = None,
    ci: WebhookIntake | None = None, incidents: IncidentService | None = None, link_secret: str | None = None,
    bootstrap_tokens: BootstrapTokens | None = None, storage: StorageService | None = None,
    storage_files: StorageFiles | None = None, templates: TemplateService | None = None,
    images: ImageService | None = None, models: ModelRegistry | None = None,
    mlflow_identity: MlflowIdentity | None = None,
) -> FastAPI:
    """The app over ``plane``; ``receiver`` handles Alertmanager's webhook (default: the
    packaged actions config, or ``APIARY_ALERT_ACTIONS``); ``cluster_id`` is the platform's identity
    that ``/healthz`` answers (:func:`apiary.settings.ensure_cluster_id`); ``directory`` verifies
    tokens (default: over the plane's store); ``settings`` gives the body cap, rate limits and
    whether ``/metrics`` is public (default: the environment's); ``drills`` records the drills'
    results (default: in memory only; ``apiary up`` keeps them in ``home/drills.json``); ``ci`` is the
    GitHub webhook intake (default: over the plane's store, starting Prefect deployments, with
    ``APIARY_GITHUB_WEBHOOK_SECRET``); ``incidents`` is incident response (default: a service over
    the plane's store with no escalation worker, whose signed links use ``link_secret``; without one
    its link routes answer 403); ``bootstrap_tokens`` are the tokens nodes join with (default: over
    the plane's store, issuing agent tokens through ``directory``); ``storage`` the storage servers
    and configs (default: over the plane's store) and ``storage_files`` their files (default: none,
    the files routes answer 503); ``templates`` the job templates (default: over the plane's store,
    no model registry); their runs submit through the path of ``POST /api/v2/jobs``; ``images`` the
    image catalogue (default: over ``settings``' registry, building nothing: builds answer 503).
    ``models`` the model registry (MLflow, read as the caller; default: none, no models) and
    ``mlflow_identity`` who a token is for MLflow's plugin (default: users only, with a key of its own).
    The control-plane process passes every piece (:func:`apiary.wiring.app_of`); the defaults serve
    in-process apps (tests, tools)."""
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
    app.state.settings = settings
    app.state.cluster_id = cluster_id
    app.state.storage = storage = storage or StorageService(plane.sessions)
    app.state.storage_files = storage_files
    app.state.images = images or ImageService(settings.resolved_registry)
    app.state.models = models or ModelRegistry(None)
    app.state.mlflow_identity = mlflow_identity or MlflowIdentity(plane.sessions, directory,
                                                                  TaskTokens(secrets.token_bytes(32)))
    app.state.templates = templates = templates or TemplateService(plane.sessions)
    if templates.submit is None:  # a template's run is a submission as POST /api/v2/jobs makes it
        templates.submit = functools.partial(submit_text, app.state)
    if plane.agents.plan_mounts is None:  # an in-process app: tasks mount what the directory grants
        plane.agents.plan_mounts = MountPlanner(storage, directory.storage_grants).plan
    if plane.agents.instance_secrets is None:
        # An in-process app holds both ends (the launches and the proxy), so a key of its own works;
        # the control-plane process keeps one in its home (wiring), which outlives a restart.
        plane.agents.instance_secrets = InstanceSecrets(secrets.token_bytes(32))
    app.state.bootstrap_tokens = bootstrap_tokens or BootstrapTokens(plane.sessions, directory)
    app.state.drills = drills = drills if drills is not None else DrillBoard()
    app.state.ci = ci or WebhookIntake(
        plane.sessions, PrefectStarter(settings.ci_pr_deployment, settings.ci_deploy_deployment),
        settings.github_webhook_secret.get_secret_value() if settings.github_webhook_secret else None)
    if incidents is None:  # no escalation worker: incidents are recorded and mitigated, nobody is paged
        incidents = default_incidents(plane, settings, link_secret)
    app.state.incidents = incidents
    receiver.use_incidents(incidents)  # one alert pipeline: the intake's groups open incidents
    if incidents.drill_results is None:  # a diagnosis attaches the node's drill results
        incidents.drill_results = drills.latest
    app.state.limiter = RateLimiter(settings.rate_calls, settings.rate_submits)
    # Innermost: a bare heartbeat and a user's submission pass the body limit and the replica router
    # before they are answered.
    app.add_middleware(HeartbeatFastPath)
    app.add_middleware(SubmitFastPath)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes,
                       upload_max_bytes=settings.storage_max_upload_bytes)

    @app.exception_handler(ApiaryError)
    async def _apiary_error(_request: Request, exc: ApiaryError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        unauthorized = _unknown_caller(request, directory)
        if unauthorized is not None:
            return await _apiary_error(request, unauthorized)
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # loc is ("body", <character offset>)
            err = ValidationError("body", f"not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))} "
                                          f"at character {first['loc'][-1]}")
        else:
            err = ValidationError(_field_path(tuple(first.get("loc", ()))), first.get("msg", "invalid request"))
        return JSONResponse(err.to_dict(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's and FastAPI's own answers (no such route, a method the path does not
        # have, a JSON body that does not parse) in the API's error shape, not {"detail": ...}.
        err = _from_http_exception(request, exc, directory)
        response = await _apiary_error(request, err)
        if err.status_code == 405:
            response.headers["Allow"] = ", ".join(_allowed_methods(request))
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug. Answered in the error shape instead of Starlette's plain text; Starlette re-raises
        # the exception after this answer, so the server logs its traceback.
        logger.error("unhandled error: error=%s method=%s path=%s", type(exc).__name__, request.method,
                     request.url.path)
        return JSONResponse(PlatformError("Apiary failed; the request may succeed later.").to_dict(), status_code=500)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(PlatformCollector(lambda: {**plane.metrics_snapshot(), **drills.snapshot()}))
    registry.register(CiCollector(CiRecords(plane.sessions).metrics_snapshot))  # CI runs, deployments: the store's
    registry.register(IncidentCollector(lambda: metrics_snapshot(incidents)))  # incidents: the store's

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

    health = HealthCheck(plane.sessions, plane.recording_problems)

    @app.get("/healthz", response_model=Health, responses={503: {"description": "Unhealthy: `reason` says why."}})
    def healthz() -> Any:
        """The serving process, when it started, and which platform it is; 503 with ``reason`` (and
        ``problems``) when the store cannot take a write or a node's agent says it cannot record its
        runs (:mod:`apiary.control.health`)."""
        body = {"status": "ok", "pid": os.getpid(), "startedAt": started, "clusterId": cluster_id}
        problems = health.problems()
        if problems:
            reason = "; ".join(problems)
            # code and message as every error answer has them: a client that raises on 503 says why.
            return JSONResponse({**body, "status": "unhealthy", "reason": reason, "problems": problems,
                                 "code": "UnavailableError", "message": f"unhealthy: {reason}"}, status_code=503)
        return body

    for router in routers.ALL:
        app.include_router(router)
    app.include_router(join.router)
    # FastAPI builds an included router's routes (their parameter and answer models) when the first
    # request reaches it; build them now, so no caller's first request pays it (about 100 ms for
    # these routers on a 2-core machine, bench/README.md "api").
    for route in app.router.routes:
        if hasattr(route, "effective_route_contexts"):
            for _ in route.effective_route_contexts():
                pass

    def openapi() -> dict[str, Any]:
        # FastAPI's document plus the component schemas the job body refers to (it is read from
        # the raw body, so FastAPI does not know its model).
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = FastAPI.openapi(app)  # builds and caches app.openapi_schema (this dict)
        document.setdefault("components", {}).setdefault("schemas", {}).update(job_protocol_components())
        # Who may call each operation, from the one table (apiary.api.access); an operation the
        # table lacks has no x-apiary-principals (tests/api/test_authz.py fails on it).
        for path, operations in document.get("paths", {}).items():
            for method, operation in operations.items():
                row = ACCESS.get((method.upper(), path))
                if row is not None and isinstance(operation, dict):
                    operation["x-apiary-principals"] = row.principals()
        return document

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the document
    return app


def default_incidents(plane: ControlPlane, settings: Settings, link_secret: str | None = None) -> IncidentService:
    """An incident service over ``plane``'s store with ``settings``' on-call file and no escalation
    worker. Its links are signed with ``link_secret``; without one no link is made or accepted
    (:class:`NoLinkSecret`): a secret is never invented, so no link outlives the process that
    signed it or differs from the control plane's (:func:`apiary.wiring.wire` keeps the real one
    in ``home/credentials/incident-links.key``)."""
    service = IncidentService(IncidentStore(plane.sessions), ResponseConfig.load(settings.oncall), plane=plane,
                              prometheus_url=settings.prometheus_url)
    public_url = settings.public_url or "http://127.0.0.1:8470"
    service.signer = NoLinkSecret() if link_secret is None else LinkSigner(link_secret, public_url)
    return service


class NoLinkSecret:
    """The signer of an app built without a link secret: makes no link and refuses every link (403)."""

    def url(self, incident_id: str, action: str, recipient: str) -> str:
        raise RuntimeError("this app has no incident link secret: pass link_secret or incidents to create_app")

    def verify(self, incident_id: str, action: str, token: str) -> str:
        raise ForbiddenError("Signed incident links are not enabled on this server (no link secret).")


def _field_path(loc: tuple[int | str, ...]) -> str:
    """The dotted path of a pydantic error's ``loc`` as the spec writes it (``runs[0].pid``), without
    FastAPI's leading ``body`` / ``query`` / ``path`` / ``header``; ``body`` for the body as a whole."""
    path = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path", "header", "cookie") else loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or ("body" if loc == ("body",) else "")


class MethodNotAllowedError(UserError):
    """The path exists but not with this method (HTTP 405; ``Allow`` lists the methods it has)."""

    status_code = 405
    code = "MethodNotAllowedError"


def _from_http_exception(request: Request, exc: HTTPException, directory: Directory) -> ApiaryError:
    """The :class:`ApiaryError` to answer for one of Starlette's or FastAPI's HTTPExceptions."""
    if exc.status_code == 404:
        # OpenPAI's REST server answers an unknown route with NoApiError ("Can not GET /x").
        err: ApiaryError = NotFoundError(f"Can not {request.method} {request.url.path}")
        err.code = "NoApiError"
        return err
    if exc.status_code == 405:
        return MethodNotAllowedError(f"{request.method} is not allowed on {request.url.path}; "
                                     f"allowed: {', '.join(_allowed_methods(request))}")
    if exc.status_code == 400:
        # The one 400 FastAPI raises itself: a JSON body that is not even text.
        return _unknown_caller(request, directory) or ValidationError("body", f"not valid JSON ({exc.detail})")
    if exc.status_code >= 500:
        return PlatformError(str(exc.detail))
    err = UserError(str(exc.detail))
    err.status_code = exc.status_code
    return err


def _unknown_caller(request: Request, directory: Directory) -> UnauthorizedError | None:
    """The 401 to answer instead of a malformed request's 400, if the caller has no valid token.

    FastAPI parses a JSON body before it solves the route's dependencies (where the token is
    checked), so an unparseable body would tell a caller without a token 400. Who the caller is
    comes first, on every route under /api/ (/healthz, /metrics and the OpenAPI pages are public).
    """
    if not request.url.path.startswith("/api/"):
        return None
    try:
        directory.authenticate(bearer(request))
    except UnauthorizedError as exc:
        return exc
    return None


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path (Starlette's 405 names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)  # PARTIAL: the path matches, the method does not
        route_methods = getattr(route, "methods", None)
        if match is not Match.NONE and route_methods:
            methods |= route_methods
    return sorted(methods)
