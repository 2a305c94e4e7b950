"""A node's storage mounts for its tasks: what the control plane planned, made into bind mounts.

The control plane sends each launch the mounts it plans (:meth:`apiary.storage.service.StorageService.plan`):
``[{"config", "server": {name, type, data}, "path", "mountPoint", "readOnly"}]``. The node mounts
each server once (:class:`apiary.mounts.table.MountTable`: shared by every task of the node that
uses it, unmounted when the last of them is gone) and hands the runtime bind mounts,
``[{"source": <directory on this node>, "target": <mountPoint>, "readOnly": bool}]``
(:attr:`apiary.runtime.base.TaskLaunch.mounts`): the process runtime binds them in the task's own
mount namespace, Docker as bind mounts, Kubernetes as ``hostPath`` volumes.

A mount that fails (the server is down or refuses) raises :class:`MountFailed` within the mount
table's timeout: the agent fails the run with :data:`apiary.lifecycle.exitspec.EXIT_MOUNT_FAILED`
(a platform failure, retried) and the reason in the task's stderr.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from apiary.errors import PlatformError
from apiary.mounts.servers import ServerSpec
from apiary.mounts.table import MountTable

logger = logging.getLogger(__name__)


class MountFailed(PlatformError):
    """A task's storage could not be mounted on this node; the message says which and why."""


class TaskMounts:
    """The storage mounts of one node's tasks, held per run id. Thread-safe."""

    def __init__(self, root: Path, *, timeout_s: float = 20.0) -> None:
        self.table = MountTable(root, timeout_s=timeout_s)
        self._lock = threading.Lock()
        self._held: set[str] = set()
        # False until the first reconcile: an earlier agent process may have left holders on disk.
        self._reconciled = False

    def prepare(self, run_id: str, planned: list[dict]) -> list[dict]:
        """Mount what ``planned`` needs for ``run_id`` (held until :meth:`release`) and return the
        bind mounts for the runtime. Raises :class:`MountFailed` (what was mounted for the run is
        released first) for a mount that fails or a malformed plan."""
        binds: list[dict] = []
        try:
            for m in planned:
                server = m["server"]
                spec = ServerSpec(server["name"], server["type"], dict(server["data"]))
                with self._lock:
                    self._held.add(run_id)
                try:
                    root = self.table.acquire(spec, run_id)
                    source = self.table.subdir(root, m.get("path") or "", create=not m.get("readOnly"))
                except Exception as exc:
                    if not m.get("optional"):
                        raise
                    # failurePolicy: ignore (OpenPAI's plugins): the task runs without this mount.
                    logger.warning("run=%s storage config %r left out (failurePolicy: ignore): %s", run_id,
                                   m.get("config"), exc)
                    continue
                binds.append({"source": str(source), "target": m["mountPoint"],
                              "readOnly": bool(m.get("readOnly"))})
        except (KeyError, TypeError) as exc:
            self.release(run_id)
            raise MountFailed(f"malformed storage mount in the assignment: {exc!r}") from None
        except Exception as exc:
            self.release(run_id)
            what = f"storage config {m.get('config')!r} (server {m['server'].get('name')!r})" \
                if isinstance(m, dict) and isinstance(m.get("server"), dict) else "storage"
            raise MountFailed(f"cannot mount {what} for {run_id}: {exc}") from None
        return binds

    def release(self, run_id: str) -> None:
        """The run no longer needs its mounts: servers nobody else holds are unmounted."""
        with self._lock:
            if run_id not in self._held:
                return
            self._held.discard(run_id)
        self.table.release(run_id)

    def reconcile(self, live: set[str]) -> None:
        """Release every holder that is not in ``live`` (runs still running), including those an
        earlier agent process left (the table keeps its holders on disk)."""
        with self._lock:
            if self._reconciled and not self._held - live:
                return  # nothing held by a run that ended: the table's files need not be read
            self._held &= live
            self._reconciled = True
        self.table.reconcile(live)
