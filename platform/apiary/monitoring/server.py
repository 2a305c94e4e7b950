"""Serving a registry: ``/metrics`` (Prometheus text or OpenMetrics, per ``Accept``) and ``/healthz``.

``/healthz`` semantics (all three entry points): ``GET /healthz`` answers ``200 {"status": "ok"}``
while the process serves and ``health()`` (optional) returns a truthy value; ``503 {"status":
"unhealthy", "reason": ...}`` when ``health()`` returns a falsy value or ``(False, reason)``, or
raises. It is a *liveness* check of the exporter/service process: GPU, NVML or collector problems
are *not* reported there (restarting the process would not fix them) but as metrics
(``apiary_nvml_available``, ``apiary_exporter_collector_up``) for the alert rules.

* :func:`add_routes` -- add ``/metrics`` and ``/healthz`` to an existing FastAPI/Starlette app (the
  control-plane API, a node agent's app).
* :func:`make_app` -- a stand-alone ASGI app with just those two routes (run it with uvicorn).
* :func:`serve_metrics` -- a stand-alone threaded HTTP server (no event loop needed).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

Health = Callable[[], Any]


def check_health(health: Health | None) -> tuple[int, dict[str, str]]:
    """``(http status, json body)`` for ``/healthz``."""
    if health is None:
        return 200, {"status": "ok"}
    try:
        result = health()
    except Exception as exc:
        return 503, {"status": "unhealthy", "reason": f"{type(exc).__name__}: {exc}"}
    ok, reason = (result if isinstance(result, tuple) else (result, ""))
    if ok:
        return 200, {"status": "ok"}
    return 503, {"status": "unhealthy", "reason": str(reason or "health check failed")}


def _render(registry: Collector, accept: str) -> tuple[bytes, str]:
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def add_routes(app: Any, registry: Collector, health: Health | None = None, *, path: str = "/metrics") -> None:
    """Add ``GET {path}`` and ``GET /healthz`` to a Starlette/FastAPI ``app``. The scrape runs in the
    thread pool so slow collectors never block the event loop."""
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    async def metrics(request: Request) -> Response:
        body, content_type = await run_in_threadpool(_render, registry, request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    async def healthz(request: Request) -> Response:
        status, body = await run_in_threadpool(check_health, health)
        return JSONResponse(body, status_code=status)

    app.add_route(path, metrics, methods=["GET"], include_in_schema=False)
    app.add_route("/healthz", healthz, methods=["GET"], include_in_schema=False)


def make_app(registry: Collector, health: Health | None = None) -> Any:
    """A Starlette ASGI app serving ``/metrics`` and ``/healthz``."""
    from starlette.applications import Starlette

    app = Starlette()
    add_routes(app, registry, health)
    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


def serve_metrics(
    registry: Collector, host: str = "0.0.0.0", port: int = 0, health: Health | None = None
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``/metrics`` and ``/healthz`` on ``host:port`` from a daemon thread; ``port=0`` picks a
    free port (``server.server_port``). Stop with ``server.shutdown(); server.server_close()``."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Any:
        if environ.get("PATH_INFO") == "/healthz":
            status, body = check_health(health)
            start_response(f"{status} {'OK' if status == 200 else 'Service Unavailable'}",
                           [("Content-Type", "application/json")])
            return [json.dumps(body).encode()]
        return metrics(environ, start_response)

    server = make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True)
    thread.start()
    return server, thread
