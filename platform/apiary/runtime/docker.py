"""``DockerBackend``: runs each task instance as one Docker container (OpenPAI's runtime model).

A run is one container from the job's ``dockerImage`` prerequisite, started with the task's
commands under ``/bin/sh -c`` (OpenPAI runs them that way), ``docker-init`` as PID 1 so a stop's
SIGTERM reaches the shell, host networking (OpenPAI's pods use ``hostNetwork``), CPU and memory
limits from ``resourcePerInstance`` (``nano_cpus``; ``mem_limit`` = ``memswap_limit`` so a task
that outgrows its memory is OOM-killed, not swapped), the ``PAI_*`` environment plus GPU
visibility, and, on a node whose dockerd has the ``nvidia`` runtime, a ``DeviceRequest`` for the
assigned GPUs. Labels (``apiary.run-id``, ``apiary.job``, ``apiary.user``, ``apiary.vc``,
``apiary.task-role``, ``apiary.index``, ``apiary.node``) carry the run, so a restarted agent finds
its containers by label.

State directory layout (one directory per run; the directory is the launch marker, as in
:mod:`apiary.runtime.process`)::

    state_dir/<run_id>/
      launch.json   what was asked (no env values) + the resolved image, written BEFORE create
      stdout.log    the task's stdout: the container appends to it through a bind mount
      stderr.log    its stderr; Apiary's own messages (an image that cannot be pulled) too
      stop.json     written by stop() before the container is stopped
      exit.json     {exit_code, started_at, finished_at, stopped, lost}: the final status, written
                    before the container is removed (stop, forget) or when the launch failed
      forgotten     present once forget() was called

Why the logs go through a bind mount instead of ``docker logs``: the container writes its own
files (``exec >>stdout.log 2>>stderr.log`` before the commands), so nothing is lost or repeated
while the agent is down, and a re-adopted run needs no log follower.

Exit codes (OpenPAI's exit spec, ``apiary/lifecycle/k8s-job-exit-spec.yaml``): the shell's code;
``128 + signal`` when killed (143 SIGTERM, 137 SIGKILL); **-1200** ``UserContainerDockerOOMKilled``
when dockerd says ``State.OOMKilled``; **254** ``ContainerImageNotExists`` when the image cannot be
pulled (the attempt fails at once, the message naming the image is in stderr.log). A run whose
container vanished without an ``exit.json`` (removed behind Apiary's back, dockerd's state wiped)
reads back as lost.

Images: ``image_map`` maps public names to registry names (``openpai/pai.example.pytorch`` ->
``127.0.0.1:5000/apiary/mnist:latest``; a key without a tag matches every tag of that name). An
image present locally is used as it is; otherwise it is pulled, with the prerequisite's ``auth``
when given. The task's ``workdir`` is ignored: the image's ``WORKDIR`` applies.

One ``DockerBackend`` per ``state_dir`` and node at a time; thread-safe. ``launch`` blocks for a
pull of a missing image (the registry is on loopback; bounded by the client's timeout).
"""

from __future__ import annotations

import builtins
import calendar
import hashlib
import logging
import re
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from apiary.errors import PlatformError, UnavailableError, ValidationError
from apiary.runtime.base import LogStream, RuntimeBackend, TaskLaunch, TaskStatus
from apiary.runtime.env import gpu_env
from apiary.runtime.records import RUN_ID_RE
from apiary.runtime.records import read_json as _read_json
from apiary.runtime.records import write_json as _write_json

logger = logging.getLogger(__name__)

#: OpenPAI exit spec -1200 UserContainerDockerOOMKilled (USER_FAILURE, PERMANENT, NEVER_RETRY).
EXIT_OOM_KILLED = -1200
#: OpenPAI exit spec 254 ContainerImageNotExists (USER_FAILURE, PERMANENT, NEVER_RETRY).
EXIT_IMAGE_NOT_EXISTS = 254

#: Where the run directory is mounted inside the container.
RUN_MOUNT = "/apiary-run"
#: The image of a task role whose job names no ``dockerImage`` (Apiary's local base, see
#: ``apiary image build-base``).
DEFAULT_IMAGE = "apiary/base:bookworm"

LABEL = "apiary.run-id"


def container_name(run_id: str) -> str:
    """A Docker container name for ``run_id``: ``apiary-<run id with ~ as .>-<8 hex of its sha1>``
    (Docker allows ``[a-zA-Z0-9][a-zA-Z0-9_.-]``; the hash keeps two run ids that differ only in
    ``~`` / ``.`` apart)."""
    digest = hashlib.sha1(run_id.encode()).hexdigest()[:8]
    return f"apiary-{run_id.replace('~', '.')}-{digest}"


def resolve_image(image: str, image_map: dict[str, str]) -> str:
    """``image`` through ``image_map``: an exact key first, then the key without the tag
    (``openpai/standard`` matches ``openpai/standard:python_3.6-pytorch_1.2.0-gpu``; a value without
    a tag then keeps the asked tag), then the longest key ending in ``/`` that ``image`` starts
    with, whose value replaces that prefix (``apiary/`` -> ``<registry>/apiary/``: the image
    catalogue's names)."""
    if image in image_map:
        return image_map[image]
    tagged = ":" in image.rsplit("/", 1)[-1]
    name, _, tag = image.rpartition(":") if tagged else (image, "", "")
    if name in image_map:
        value = image_map[name]
        return f"{value}:{tag}" if tag and ":" not in value.rsplit("/", 1)[-1] and "@" not in value else value
    prefixes = [k for k in image_map if k.endswith("/") and image.startswith(k)]
    if prefixes:
        key = max(prefixes, key=len)
        return image_map[key] + image[len(key):]
    return image


def _parse_time(text: str | None) -> float | None:
    """Docker's RFC 3339 nanosecond timestamps (``2026-11-25T19:40:01.123456789Z``) as unix seconds;
    ``None`` for Docker's zero time or nothing."""
    if not text or text.startswith("0001-"):
        return None
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z$", text)
    if not m:
        return None
    whole = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))
    return whole + (float(m.group(2)[:10]) if m.group(2) else 0.0)


class DockerBackend(RuntimeBackend):
    """Runs tasks as Docker containers on this node's dockerd (see the module doc).

    ``state_dir``: per-run records and logs (created if missing; must be a path dockerd can bind
    mount, i.e. on the same machine). ``node``: this node's name (the ``apiary.node`` label).
    ``client``: a ``docker.DockerClient`` (default: ``docker.from_env()``, i.e. ``DOCKER_HOST``
    or the local socket). ``image_map``: public image name -> registry name. ``gpu_runtime``:
    request the GPUs from the NVIDIA runtime (default: when dockerd lists a ``nvidia`` runtime).
    ``cluster``: the platform's cluster id (label ``apiary.cluster``): with it, only this
    platform's containers are re-adopted, so two platforms on one dockerd with the same node
    names never take each other's containers.

    Raises :class:`UnavailableError` from the constructor when dockerd does not answer.
    """

    name = "docker"

    def __init__(
        self,
        state_dir: Path | str,
        *,
        node: str,
        client: Any = None,
        image_map: dict[str, str] | None = None,
        gpu_runtime: bool | None = None,
        cluster: str | None = None,
    ) -> None:
        import docker

        self.state_dir = Path(state_dir).absolute()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.node = node
        self.cluster = cluster
        self.image_map = dict(image_map or {})
        try:
            self.client = client or docker.from_env(timeout=120)
            info = self.client.info()
        except docker.errors.DockerException as exc:
            raise UnavailableError(f"dockerd does not answer: {exc}") from exc
        self.gpu_runtime = "nvidia" in (info.get("Runtimes") or {}) if gpu_runtime is None else gpu_runtime
        self._lock = threading.RLock()
        self._forgotten: set[str] | None = None

    # -- launch ------------------------------------------------------------------------------

    def launch(self, task: TaskLaunch) -> TaskStatus:
        """Create and start the run's container; see :meth:`RuntimeBackend.launch`.

        Idempotent: ``state_dir/<run_id>/`` is created exclusively before anything else, so a
        second launch (or a restarted agent) returns the recorded status and never creates a
        second container. An image that cannot be pulled ends the run at once with exit code 254
        (not an exception: it is the user's image). Raises :class:`ValidationError` for a bad
        ``run_id`` or ``commands``, :class:`PlatformError` when dockerd refuses to create or
        start the container (the agent reports a launch failure).
        """
        import docker

        if not RUN_ID_RE.fullmatch(task.run_id or "") or task.run_id.startswith("."):
            raise ValidationError("run_id", f"{task.run_id!r} must be 1-200 characters of letters, digits and ~ . - _")
        if isinstance(task.commands, str) or not all(isinstance(c, str) for c in task.commands):
            raise ValidationError("commands", "must be a list of strings")
        with self._lock:
            existing = self.status(task.run_id)
            if existing is not None:
                return existing
            run_dir = self.state_dir / task.run_id
            try:
                run_dir.mkdir()
            except OSError as exc:
                raise PlatformError(f"cannot create run directory {run_dir}: {exc}") from exc
            image = resolve_image(task.image or DEFAULT_IMAGE, self.image_map)
            record = {k: v for k, v in asdict(task).items() if k not in ("env", "image_auth")}
            record.update(env_keys=sorted(task.env), resolved_image=image, created_at=time.time())
            _write_json(run_dir / "launch.json", record)
            for stream in ("stdout", "stderr"):
                (run_dir / f"{stream}.log").touch()
            try:
                self._ensure_image(image, task)
            except docker.errors.DockerException as exc:
                return self._image_failed(run_dir, task, image, exc)
            try:
                container = self.client.containers.create(image, **self._container_args(task, run_dir))
                container.start()
            except docker.errors.DockerException as exc:
                raise PlatformError(f"cannot start the container of {task.run_id} from {image}: {exc}") from exc
            logger.info("node=%s run=%s container=%s image=%s", self.node, task.run_id, container.short_id, image)
            return self._status(task.run_id, run_dir)  # type: ignore[return-value]

    def _ensure_image(self, image: str, task: TaskLaunch) -> None:
        import docker

        try:
            self.client.images.get(image)
            return
        except docker.errors.ImageNotFound:
            pass
        auth = None
        if task.image_auth and task.image_auth.get("username"):
            auth = {"username": task.image_auth["username"], "password": task.image_auth.get("password", "")}
        repo, tag = (image.rsplit(":", 1) if ":" in image.rsplit("/", 1)[-1] else (image, "latest"))
        self.client.images.pull(repo, tag=tag, auth_config=auth)

    def _image_failed(self, run_dir: Path, task: TaskLaunch, image: str, exc: Exception) -> TaskStatus:
        asked = task.image or DEFAULT_IMAGE
        via = f" (mapped from {asked})" if asked != image else ""
        message = f"apiary: image {image}{via} cannot be pulled: {exc}\n"
        with open(run_dir / "stderr.log", "a") as err:
            err.write(message)
        now = time.time()
        _write_json(run_dir / "exit.json", {"exit_code": EXIT_IMAGE_NOT_EXISTS, "started_at": now,
                                            "finished_at": now, "stopped": False, "lost": False})
        logger.warning("node=%s run=%s %s", self.node, task.run_id, message.strip())
        return self._status(task.run_id, run_dir)  # type: ignore[return-value]

    def _container_args(self, task: TaskLaunch, run_dir: Path) -> dict[str, Any]:
        import docker

        env = dict(task.env)
        env.update(gpu_env(task.gpus))
        script = "\n".join([f"exec >>{RUN_MOUNT}/stdout.log 2>>{RUN_MOUNT}/stderr.log", "set -e", *task.commands])
        labels = {
            LABEL: task.run_id, "apiary.job": task.job_id, "apiary.user": task.user,
            "apiary.vc": task.virtual_cluster, "apiary.task-role": task.task_role,
            "apiary.index": str(task.index), "apiary.node": self.node,
        }
        if self.cluster:
            labels["apiary.cluster"] = self.cluster
        args: dict[str, Any] = {
            "command": ["/bin/sh", "-c", script],
            "name": container_name(task.run_id),
            "environment": env,
            "labels": labels,
            "network_mode": "host",
            "init": True,
            "detach": True,
            "volumes": {str(run_dir): {"bind": RUN_MOUNT, "mode": "rw"}},
        }
        if task.mounts:  # the task's storage (apiary.runtime.storage): bind mounts, ro where asked
            args["mounts"] = [docker.types.Mount(m["target"], m["source"], type="bind", read_only=bool(m["readOnly"]))
                              for m in task.mounts]
        if task.cpu:
            args["nano_cpus"] = int(task.cpu * 1e9)
        if task.memory_mb:
            args["mem_limit"] = args["memswap_limit"] = f"{int(task.memory_mb)}m"
        if task.gpus and self.gpu_runtime:
            args["device_requests"] = [
                docker.types.DeviceRequest(device_ids=[str(g) for g in task.gpus], capabilities=[["gpu"]])
            ]
        return args

    # -- status ------------------------------------------------------------------------------

    def _container(self, run_id: str) -> Any:
        import docker

        try:
            return self.client.containers.get(container_name(run_id))
        except docker.errors.NotFound:
            return None
        except docker.errors.DockerException as exc:
            raise UnavailableError(f"dockerd does not answer: {exc}") from exc

    def _status(self, run_id: str, run_dir: Path) -> TaskStatus | None:
        final = _read_json(run_dir / "exit.json")
        if final is not None:
            return TaskStatus(run_id=run_id, state="exited", exit_code=final.get("exit_code"), pid=None,
                              started_at=final.get("started_at"), finished_at=final.get("finished_at"),
                              lost=bool(final.get("lost")), stopped=bool(final.get("stopped")))
        container = self._container(run_id)
        stopped = (run_dir / "stop.json").exists()
        if container is None:
            # Launch marker but no container and no final record: never created (the agent died
            # between mkdir and create) or removed behind our back. Either way it never runs again.
            return TaskStatus(run_id=run_id, state="exited", exit_code=None, pid=None, started_at=None,
                              finished_at=None, lost=True, stopped=stopped)
        return self._from_state(run_id, container.attrs.get("State") or {}, stopped)

    @staticmethod
    def _from_state(run_id: str, state: dict[str, Any], stopped: bool) -> TaskStatus:
        started = _parse_time(state.get("StartedAt"))
        if state.get("Status") in ("created", "running", "paused", "restarting"):
            return TaskStatus(run_id=run_id, state="running", exit_code=None, pid=state.get("Pid") or None,
                              started_at=started or time.time(), finished_at=None)
        code = EXIT_OOM_KILLED if state.get("OOMKilled") else int(state.get("ExitCode", 0))
        finished = _parse_time(state.get("FinishedAt")) or time.time()
        # dockerd stamps a container that exits at once with a FinishedAt a little before its
        # StartedAt (seen: 0.4 ms): a duration is never negative.
        return TaskStatus(run_id=run_id, state="exited", exit_code=code, pid=None, started_at=started,
                          finished_at=max(finished, started or finished), stopped=stopped)

    def status(self, run_id: str) -> TaskStatus | None:
        """The run's status from its final record or ``docker inspect``; ``None`` if never launched
        here. Raises :class:`UnavailableError` when dockerd does not answer (try again)."""
        if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id) or run_id.startswith("."):
            return None
        run_dir = self.state_dir / run_id
        if not run_dir.is_dir():
            return None
        return self._status(run_id, run_dir)

    def list(self) -> list[TaskStatus]:
        """Every run not forgotten: the run directories, plus containers of this node (by label)
        whose directory is gone (the state directory was lost): those are re-adopted with a new
        directory, so they are reported, stopped and forgotten like the others."""
        with self._lock:
            if self._forgotten is None:
                self._forgotten = {p.parent.name for p in self.state_dir.glob("*/forgotten")}
            dirs = {p.name for p in self.state_dir.iterdir() if p.is_dir()} - self._forgotten
            try:
                wanted = [f"apiary.node={self.node}"] + ([f"apiary.cluster={self.cluster}"] if self.cluster else [])
                labelled = self.client.containers.list(all=True, filters={"label": wanted})
            except Exception as exc:  # docker.errors.DockerException, requests' connection errors
                raise UnavailableError(f"dockerd does not answer: {exc}") from exc
            for c in labelled:
                run_id = c.labels.get(LABEL, "")
                if run_id and run_id not in dirs and run_id not in self._forgotten and RUN_ID_RE.fullmatch(run_id):
                    (self.state_dir / run_id).mkdir(exist_ok=True)
                    dirs.add(run_id)
                    logger.warning("node=%s re-adopted container %s of run %s without a record",
                                   self.node, c.short_id, run_id)
            out = [s for r in sorted(dirs) if (s := self._status(r, self.state_dir / r)) is not None]
            return out

    def log_path(self, run_id: str, stream: LogStream) -> Path | None:
        """``state_dir/<run_id>/<stream>.log``, written by the container itself. Reads only the
        state directory: the agent asks from its event loop, where a slow dockerd must not stall
        every node of the process."""
        if stream not in ("stdout", "stderr") or not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id) \
                or run_id.startswith(".") or not (self.state_dir / run_id).is_dir():
            return None
        return self.state_dir / run_id / f"{stream}.log"

    # -- stop / forget -----------------------------------------------------------------------

    def stop(self, run_id: str, grace_s: float = 5.0) -> None:
        """SIGTERM the container (through docker-init to the shell), SIGKILL after ``grace_s``,
        record the final status, remove the container. Idempotent; blocks at most ``grace_s``
        plus dockerd's answer time."""
        import docker

        with self._lock:
            st = self.status(run_id)
            if st is None:
                return
            run_dir = self.state_dir / run_id
            if (run_dir / "exit.json").exists():
                return
            if st.running:
                _write_json(run_dir / "stop.json", {"requested_at": time.time()})
        # The grace period is waited outside the lock: launches and other stops go on meanwhile.
        container = self._container(run_id)
        if container is not None:
            try:
                container.stop(timeout=max(0, int(round(grace_s))))
                container.reload()
            except docker.errors.NotFound:
                container = None
        with self._lock:
            if not (run_dir / "exit.json").exists():
                self._finish(run_id, run_dir, container, stopped=st.running)

    def _finish(self, run_id: str, run_dir: Path, container: Any, *, stopped: bool) -> None:
        """Write ``exit.json`` from the container's state, then remove the container."""
        import docker

        if container is None:
            _write_json(run_dir / "exit.json", {"exit_code": None, "started_at": None, "finished_at": time.time(),
                                                "stopped": stopped, "lost": not stopped})
            return
        st = self._from_state(run_id, container.attrs.get("State") or {}, stopped)
        _write_json(run_dir / "exit.json", {"exit_code": st.exit_code, "started_at": st.started_at,
                                            "finished_at": st.finished_at or time.time(),
                                            "stopped": stopped, "lost": False})
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.DockerException as exc:
            logger.warning("node=%s run=%s container not removed: %s", self.node, run_id, exc)

    def exec_prefix(self, run_id: str) -> builtins.list[str]:
        """``docker exec <the run's container>``: a job's exec probe runs inside its container, as
        the task does, never on the host. Raises :class:`PlatformError` for a bad ``run_id`` or
        when the ``docker`` CLI is not on PATH."""
        docker_cli = shutil.which("docker")
        if not RUN_ID_RE.fullmatch(run_id or "") or docker_cli is None:
            raise PlatformError(f"cannot run {run_id}'s commands in its container: no docker CLI (or a bad run id)")
        return [docker_cli, "exec", container_name(run_id)]

    def forget(self, run_id: str) -> None:
        """Drop a finished run from :meth:`list`: its final status is recorded, its container
        removed; the directory (logs, record) stays, so ``run_id`` is never launched again.
        Raises :class:`PlatformError` for a running run."""
        with self._lock:
            st = self.status(run_id)
            if st is None:
                return
            if st.running:
                raise PlatformError(f"cannot forget {run_id}: it is running (stop it first)")
            run_dir = self.state_dir / run_id
            if not (run_dir / "exit.json").exists():
                self._finish(run_id, run_dir, self._container(run_id), stopped=st.stopped)
            (run_dir / "forgotten").touch()
            if self._forgotten is not None:
                self._forgotten.add(run_id)
