"""The node runtime: how a node starts, watches and stops its tasks.

:class:`RuntimeBackend` (``base``) is the interface, :class:`ProcessBackend` (``process``) the
embedded default, :func:`build_task_env` (``env``) the OpenPAI environment a task sees.

``BACKENDS`` is the explicit registry of backend classes by name. Every backend listed here is
imported unconditionally, so a backend that fails to import fails the import of
``apiary.runtime`` loudly instead of silently disappearing from the registry. The container
backends, :mod:`apiary.runtime.docker` and :mod:`apiary.runtime.kubernetes`, are not listed: their
client libraries take about a second to import (the kubernetes client: 1.2 s here), which every
CLI call would pay. :func:`apiary.runtime.agent.make_backend` builds any of the three by name.
"""

from __future__ import annotations

from apiary.errors import ValidationError
from apiary.runtime.base import RuntimeBackend, TaskLaunch, TaskStatus
from apiary.runtime.env import build_task_env, gpu_env
from apiary.runtime.process import ProcessBackend

BACKENDS: dict[str, type[RuntimeBackend]] = {"process": ProcessBackend}


def backend_class(name: str) -> type[RuntimeBackend]:
    """The backend class registered as ``name``; :class:`ValidationError` naming the known ones."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValidationError(
            "runtime.backend", f"unknown backend {name!r}; known: {sorted(BACKENDS)}"
        ) from None


__all__ = [
    "BACKENDS",
    "ProcessBackend",
    "RuntimeBackend",
    "TaskLaunch",
    "TaskStatus",
    "backend_class",
    "build_task_env",
    "gpu_env",
]
