"""What a node agent settles before it hands a launch to its runtime, and how a failure there ends
the run: the task's named ports must be free on the node (:mod:`apiary.runtime.ports`), its
storage mounted (:mod:`apiary.runtime.storage`), and the runtime must run what the launch asks
for (the ssh runtime plugin). Each refusal maps to the exit code OpenPAI's exit spec gives it."""

from __future__ import annotations

from typing import Any

from apiary.errors import PlatformError
from apiary.lifecycle import EXIT_LAUNCH_FAILED, EXIT_MOUNT_FAILED
from apiary.runtime.base import RuntimeBackend
from apiary.runtime.ports import EXIT_PORT_CONFLICT, own_ports, taken
from apiary.runtime.storage import MountFailed, TaskMounts


class PortConflict(PlatformError):
    """A task's named port is held by another process on the node."""


def settle(run_id: str, spec: dict[str, Any], env: dict[str, str], *, backend: RuntimeBackend,
           mounts: TaskMounts | None, node: str) -> dict[str, Any]:
    """``spec`` (an assignment's ``launch``, a copy the caller owns) made ready for
    :class:`~apiary.runtime.base.TaskLaunch`: ``mounts`` and ``mountError`` taken out and the
    task's storage mounted as bind mounts. Raises PlatformError (the runtime does not run the ssh
    plugin), PortConflict (a named port is taken here: the process and Docker runtimes share the
    node's network) and MountFailed."""
    if spec.get("ssh") and not getattr(backend, "runs_ssh", False):
        raise PlatformError(f"the {backend.name} runtime does not run the ssh runtime plugin")
    busy = taken(own_ports(env)) if backend.name in ("process", "docker") else []
    if busy:
        raise PortConflict(f"port(s) {', '.join(busy)} of {run_id} are taken on node {node}")
    planned, error = spec.pop("mounts", None) or [], spec.pop("mountError", None)
    if error:
        raise MountFailed(str(error))
    if planned and mounts is None:
        raise MountFailed("this node agent mounts no storage (it was started without a mount table)")
    spec["mounts"] = mounts.prepare(run_id, planned) if planned and mounts is not None else []
    return spec


def exit_code_of(exc: BaseException) -> int:
    """The exit code a launch that failed with ``exc`` reports: -1006 for storage that could not be
    mounted, 253 for a taken port, -1203 (EXIT_LAUNCH_FAILED) for anything else."""
    if isinstance(exc, MountFailed):
        return EXIT_MOUNT_FAILED
    if isinstance(exc, PortConflict):
        return EXIT_PORT_CONFLICT
    return EXIT_LAUNCH_FAILED
