"""Serving an ASGI app on loopback from a thread, for tests that need a real HTTP server (the CLI
builds its own client from a URL). ``with serving(app) as url:`` waits, with a deadline, until the
server listens, and stops it on exit."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from tests.support.polling import until

from apiary.tracking.prefect_server import free_port


@contextmanager
def serving(app: Any, port: int | None = None) -> Iterator[str]:
    """``http://127.0.0.1:<port>`` while ``app`` is served there (``port`` default: a free one)."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        until(lambda: server.started, 30, f"the test server on port {port}")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
