"""Request tracing for the Prefect server, used only by ``bench/run.py --only prefect --prefect-profile``.

bench/prefect_lag.py puts this directory on ``PYTHONPATH`` and sets
``APIARY_BENCH_PREFECT_TRACE`` to a directory. Python imports ``sitecustomize`` at start-up in
every process of the platform, but this one does something only in ``python -m prefect server
start``: it wraps ``prefect.server.api.server.create_app`` so the app gets an outermost ASGI
middleware that appends one JSON line per HTTP request to ``<dir>/requests-<pid>.jsonl``:
``[unix start time, method, path with UUIDs replaced by {id}, status, seconds in the app]``.
The time is from the request entering the app to its last response byte being handed to
uvicorn (server-side latency; the client's connection and parse time are not in it).
"""

from __future__ import annotations

import os
import sys

_DIR = os.environ.get("APIARY_BENCH_PREFECT_TRACE")
_ARGV = list(getattr(sys, "orig_argv", []))


def _is_prefect_server() -> bool:
    try:
        i = _ARGV.index("-m")
    except ValueError:
        return False
    return _ARGV[i + 1 : i + 4] == ["prefect", "server", "start"]


if _DIR and _is_prefect_server():
    import importlib.abc
    import importlib.machinery
    import json
    import re
    import time

    _UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)
    _TARGET = "prefect.server.api.server"

    class _Trace:
        def __init__(self, app) -> None:
            self.app = app
            # Line-buffered: one write per request, nothing lost when the server is killed.
            self.out = open(os.path.join(_DIR, f"requests-{os.getpid()}.jsonl"), "a", buffering=1)

        async def __call__(self, scope, receive, send):
            if scope.get("type") != "http":
                return await self.app(scope, receive, send)
            t_wall, t0 = time.time(), time.perf_counter()
            status = [0]

            async def send2(message):
                if message.get("type") == "http.response.start":
                    status[0] = int(message.get("status", 0))
                await send(message)

            try:
                await self.app(scope, receive, send2)
            finally:
                dt = time.perf_counter() - t0
                path = _UUID.sub("{id}", scope.get("path", ""))
                row = [round(t_wall, 4), scope.get("method"), path, status[0], round(dt, 5)]
                self.out.write(json.dumps(row) + "\n")

    def _patch(module) -> None:
        original = module.create_app

        def create_app(*args, **kwargs):
            app = original(*args, **kwargs)
            if not getattr(app, "_apiary_bench_traced", False):
                app.add_middleware(_Trace)
                app._apiary_bench_traced = True
            return app

        module.create_app = create_app

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner) -> None:
            self.inner = inner

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module) -> None:
            self.inner.exec_module(module)
            _patch(module)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _TARGET:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
            return spec

    sys.meta_path.insert(0, _Finder())
