"""The node runtime's backend interface.

A :class:`RuntimeBackend` starts, watches and stops the tasks the node agent is told to run.
The embedded default is :class:`apiary.runtime.process.ProcessBackend` (plain processes);
Docker and Kubernetes backends implement the same six methods.

Contract shared by every backend:

* ``run_id`` is the idempotency key. It names one attempt of one task instance and is never
  reused by the control plane; a backend starts a given ``run_id`` at most once, ever, even
  across restarts of the agent process.
* Nothing here blocks on the task: ``launch`` returns once the task is spawned, ``status`` and
  ``list`` only read state, ``stop`` waits at most its grace period (plus a little).
* Exit codes follow OpenPAI: the task's own exit code, or ``128 + signal`` when it was killed
  by a signal (143 for SIGTERM, 137 for SIGKILL).
* A task that ended without a recorded exit code (its wrapper was ``kill -9``-ed with it, the
  machine rebooted) reads back as ``lost``: a platform failure, not the user's.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from apiary.errors import PlatformError

RunState = Literal["running", "exited"]
LogStream = Literal["stdout", "stderr"]


@dataclass(frozen=True)
class TaskLaunch:
    """Everything a backend needs to start one task instance on this node.

    ``run_id``: unique per task attempt, e.g. ``"alice~mnist.a0.train.0.t0"``; the idempotency
    key. Only ASCII letters, digits and ``~ . - _`` are allowed, and it must not start with ``.``.
    ``commands``: already templated shell commands, run in order by ``bash`` with ``set -e``
    semantics (the first failing command fails the task with its exit code).
    ``env``: the full OpenPAI environment from :func:`apiary.runtime.env.build_task_env`; the
    backend adds only what it must (GPU visibility, the minimal host variables it documents).
    ``gpus``: GPU indices on this node; the backend derives ``CUDA_VISIBLE_DEVICES`` and
    ``NVIDIA_VISIBLE_DEVICES`` from it (``""`` and ``"void"`` when empty).
    ``image``: docker image URI; ignored by the process backend.
    ``cpu`` (cores) and ``memory_mb`` (MiB): the task's resource request; ``0`` means unset.
    ``workdir``: the task's working directory; ``None`` means the backend's default.
    ``virtual_cluster``: the job's VC (labels only). ``leaf_cells``: the placement's HiveD leaf
    cell indices within the node (0-based, :class:`apiary.scheduler.TaskPlacement`), for HiveD's
    bind-info annotation.
    ``image_auth``: registry credentials of the job's ``dockerImage`` prerequisite (``username``,
    ``password`` with secrets resolved, ``registryuri``), or ``None``. ``ports``: the role's
    ``resourcePerInstance.ports`` (label -> count). ``probes``: the role's probes as
    :func:`apiary.spec.probes.probes_to_wire` gives them (``{}``: none); backends that run probes
    themselves (Kubernetes) use them, the others leave probing to the node agent.
    ``mounts``: the task's storage as bind mounts, ``[{"source": <directory on this node>,
    "target": <absolute path in the task>, "readOnly": bool}]`` (:mod:`apiary.runtime.storage`
    mounted the servers); every backend makes ``source`` appear at ``target``, read-only when asked.
    ``ssh``: OpenPAI's ssh runtime plugin for this task (:mod:`apiary.control.jobssh` gives its
    shape: port, login, keys, peers, barrier), or ``None``; only a backend with ``runs_ssh`` runs it.
    """

    run_id: str
    job_id: str
    user: str
    job_name: str
    task_role: str
    index: int
    commands: list[str]
    env: dict[str, str] = field(default_factory=dict)
    gpus: list[int] = field(default_factory=list)
    image: str | None = None
    cpu: float = 0
    memory_mb: int = 0
    workdir: str | None = None
    virtual_cluster: str = ""
    leaf_cells: list[int] = field(default_factory=list)
    image_auth: dict[str, str] | None = None
    ports: dict[str, int] = field(default_factory=dict)
    probes: dict = field(default_factory=dict)
    mounts: list[dict] = field(default_factory=list)
    ssh: dict | None = None


@dataclass(frozen=True)
class TaskStatus:
    """What a backend knows about one run.

    ``state``: ``"running"`` while the task's process exists, then ``"exited"`` for good.
    ``exit_code``: ``None`` while running; afterwards the task's exit code (``128 + signal``
    for a signal), or ``None`` with ``lost=True`` when no exit code was recorded.
    ``pid``: the task's top process (the backend's wrapper) or ``None`` if it never spawned.
    ``started_at`` / ``finished_at``: unix seconds; ``None`` when unknown (never spawned, lost).
    ``lost``: exited without a recorded exit code -- a platform failure.
    ``stopped``: ended because :meth:`RuntimeBackend.stop` was called.
    """

    run_id: str
    state: RunState
    exit_code: int | None
    pid: int | None
    started_at: float | None
    finished_at: float | None
    lost: bool = False
    stopped: bool = False

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def succeeded(self) -> bool:
        """True once the run exited with code 0 (and was neither lost nor stopped)."""
        return self.state == "exited" and self.exit_code == 0 and not self.lost and not self.stopped


class RuntimeBackend(ABC):
    """Starts and tracks task processes on one node. Thread-safe; one instance per state."""

    name: str = "abstract"
    #: True when the backend hands the task role's probes to its own runtime (Kubernetes'
    #: kubelet); the node agent then does not probe the task a second time.
    runs_probes: bool = False
    #: True when the backend runs a task's sshd (:attr:`TaskLaunch.ssh`); the node agent refuses an
    #: ssh launch on the others rather than run the task without it.
    runs_ssh: bool = False

    @abstractmethod
    def launch(self, task: TaskLaunch) -> TaskStatus:
        """Start ``task`` and return its status as soon as it is spawned (non-blocking).

        Idempotent: if ``task.run_id`` was ever launched on this backend -- even by an earlier
        agent process on the same state -- return that run's current status and never start it
        again. A launch that failed, or whose agent died before the task started, either leaves
        nothing (a retry launches it, once: the process backend) or a record that reads back as
        lost. Safe to retry after a timeout.

        Raises :class:`apiary.errors.ValidationError` for a malformed ``run_id`` and
        :class:`apiary.errors.PlatformError` if the task cannot be started (no ``bash``, a
        missing working directory, ``fork`` failed); the caller reports a launch failure.
        """

    @abstractmethod
    def stop(self, run_id: str, grace_s: float = 5.0) -> None:
        """Kill the run's whole process tree: SIGTERM, then SIGKILL after ``grace_s`` seconds.

        Idempotent: an unknown or already finished ``run_id`` returns silently. Returns as soon
        as the tree is gone, and never blocks longer than ``grace_s`` plus about a second.
        Afterwards :meth:`status` reports ``stopped=True`` with the exit code (143 / 137 when
        the signal killed the task).
        """

    @abstractmethod
    def status(self, run_id: str) -> TaskStatus | None:
        """The run's current status, or ``None`` if this backend never launched ``run_id`` (or
        its launch died before the task started; a ``launch`` then starts it). A run that
        started always has its ``started_at``.

        Reads state only; never raises for an unknown or malformed ``run_id``. Should return ASAP.
        """

    @abstractmethod
    def list(self) -> list[TaskStatus]:
        """Every run this backend knows and has not forgotten, running or exited.

        Includes runs re-adopted from an earlier agent process on the same state, so a restarted
        agent can reconcile with the control plane. Ordered by ``run_id``.
        """

    @abstractmethod
    def log_path(self, run_id: str, stream: LogStream) -> Path | None:
        """Path of the run's captured ``stdout`` or ``stderr`` (a growing file), or ``None``
        if the run is unknown or the backend keeps no local file for it."""

    def exec_prefix(self, run_id: str) -> builtins.list[str]:
        """The argv prefix that runs a command the job defines but the agent starts (an exec
        probe) where and as the run's task runs: ``[*prefix, *command]``. Fast (reads a record).
        This default raises :class:`apiary.errors.PlatformError`: a backend that cannot say
        refuses, rather than let a job's command run as the agent's user."""
        raise PlatformError(f"the {self.name} runtime cannot run {run_id}'s commands as its task")

    @abstractmethod
    def forget(self, run_id: str) -> None:
        """Drop a finished run from :meth:`list` once the control plane has its final state.

        Unknown ``run_id``: returns silently. A running run raises
        :class:`apiary.errors.PlatformError` (stop it first). What stays behind (logs, the
        idempotency record) is backend-specific and documented by each backend.
        """
