"""``ProcessBackend``: runs each task as a plain process tree on this machine (the embedded default).

State directory layout (one directory per run; the directory itself is the launch marker)::

    state_dir/
      <run_id>/
        launch.json   what was asked (no env values), written BEFORE spawning
        script.sh     the task's commands under ``set -e``
        wrapper.sh    the wrapper that runs script.sh and records its exit code
        stdout.log    the task's stdout (and the wrapper's), appended
        stderr.log    the task's stderr
        meta.json     {pid, pgid, create_time, started_at, gpus}, written right after spawning
        exit_code     "<int>\\n", written atomically (tmp + rename) when the task ends
        stop.json     {signal: "TERM"|"KILL", requested_at}, written by stop() before signalling
        forgotten     present once forget() was called

How a run is tracked:

* ``launch`` creates ``<run_id>/`` with ``os.mkdir`` (atomic: a second launch of the same
  ``run_id`` finds it and returns the existing status), writes ``launch.json``, then spawns
  ``bash wrapper.sh <run_dir>`` with ``start_new_session=True``: the wrapper is the leader of a
  new session and process group (``pgid == pid``), so the task survives the agent being killed
  with ``kill -9`` and can be signalled as a group.
* The wrapper runs ``bash script.sh`` in the foreground, so the exit code is recorded from
  inside the task's session, not by the agent's ``waitpid``: a new agent (a new
  ``ProcessBackend`` on the same ``state_dir``) re-adopts a still-running run and later reads
  its real exit code. When script.sh ends, the wrapper SIGTERMs whatever is left in its group
  (background children: a finished task leaves nothing running, as a container would), then
  writes ``exit_code`` and exits with the same code.
* A run is *running* while its wrapper process exists, is not a zombie and has the
  ``create_time`` recorded in ``meta.json`` (guards against pid reuse). If ``meta.json`` is missing
  (the agent died between spawn and write), the wrapper is looked up by its command line.
* A run that is not running and has no ``exit_code`` is *stopped* if ``stop.json`` exists
  (exit code ``128 + signal``: 143 / 137, recorded then) and *lost* otherwise -- including a
  run whose directory exists but whose process was never spawned.

Reaping: every wrapper this instance spawns gets a daemon thread (``apiary-reap-<run_id>``)
that blocks in ``Popen.wait()``, so no zombie outlives its task; no SIGCHLD handler is
installed. Wrappers adopted from an earlier agent process are not our children (they were
re-parented to init or a subreaper), so nothing here reaps them. Threads: only the reapers;
``stop`` polls in the calling thread.

Environment rule: the task sees ``task.env`` on top of a minimal inherited environment --
``PATH HOME LANG LC_ALL LC_CTYPE TZ TMPDIR USER LOGNAME SHELL`` and the agent's Python
variables ``VIRTUAL_ENV PYTHONPATH PYTHONHOME CONDA_PREFIX`` when set. When the agent runs in
a virtual environment, its ``bin`` directory is put first on the inherited ``PATH`` (and
``VIRTUAL_ENV`` set) so a task's ``python3`` has the agent's packages. ``task.env`` wins over
all of these; ``CUDA_VISIBLE_DEVICES``/``NVIDIA_VISIBLE_DEVICES`` from ``task.gpus`` win over
``task.env``.

One ``ProcessBackend`` per ``state_dir`` at a time (one agent per node); it is thread-safe.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from apiary.errors import PlatformError, ValidationError
from apiary.runtime.base import LogStream, RuntimeBackend, TaskLaunch, TaskStatus
from apiary.runtime.env import gpu_env
from apiary.runtime.records import read_json as _read_json
from apiary.runtime.records import valid_run_id as _valid_run_id
from apiary.runtime.records import write_atomic as _write_atomic

INHERITED_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "USER",
    "LOGNAME",
    "SHELL",
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "PYTHONHOME",
    "CONDA_PREFIX",
)
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CREATE_TIME_TOLERANCE_S = 0.05
_POLL_S = 0.02
_AFTER_KILL_WAIT_S = 1.0

# The wrapper: traps TERM/INT/HUP so it outlives a stop()'s SIGTERM long enough to record the
# task's code (a trapped signal waits for the foreground child); SIGKILL takes it down too, and
# stop.json then supplies the code. Trap dispositions are reset in children, so script.sh sees
# the default handlers.
_WRAPPER = r"""# Apiary task wrapper (generated; see apiary.runtime.process).
run_dir="$1"
trap ':' TERM INT HUP
bash "$run_dir/script.sh" </dev/null
rc=$?
trap '' TERM
kill -TERM 0 2>/dev/null
printf '%s\n' "$rc" >"$run_dir/exit_code.tmp" && mv -f "$run_dir/exit_code.tmp" "$run_dir/exit_code"
exit "$rc"
"""

_SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL}




def _read_exit_code(path: Path) -> tuple[int, float] | None:
    """``(code, mtime)`` of an ``exit_code`` file, or ``None`` if absent or unreadable."""
    try:
        text = path.read_text(encoding="utf-8").strip()
        mtime = path.stat().st_mtime
        return int(text), mtime
    except (OSError, ValueError):
        return None


def _base_env() -> dict[str, str]:
    env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
    env.setdefault("PATH", _DEFAULT_PATH)
    if sys.prefix != sys.base_prefix:  # the agent runs in a virtual environment
        venv_bin = str(Path(sys.executable).parent)
        parts = [p for p in env["PATH"].split(os.pathsep) if p and p != venv_bin]
        env["PATH"] = os.pathsep.join([venv_bin, *parts])
        env["VIRTUAL_ENV"] = sys.prefix
    return env


def _group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


class ProcessBackend(RuntimeBackend):
    """Runs tasks as local process trees, with all state under ``state_dir`` (see module doc).

    ``state_dir`` is created if missing. Nothing is started by the constructor; runs left by an
    earlier agent process are found lazily by :meth:`status` and :meth:`list`.
    """

    name = "process"

    def __init__(self, state_dir: Path | str) -> None:
        self.state_dir = Path(state_dir).absolute()
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PlatformError(f"cannot create runtime state dir {self.state_dir}: {exc}") from exc
        self._lock = threading.RLock()
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        # Forgotten runs, read once from their markers: the agent calls list() several times a
        # second, and stat-ing every run a node ever had would grow without bound.
        self._forgotten: set[str] | None = None

    # -- paths -------------------------------------------------------------------------------

    def _run_dir(self, run_id: str) -> Path | None:
        """The run's directory if ``run_id`` is well-formed and was launched here, else None."""
        if not _valid_run_id(run_id):
            return None
        run_dir = self.state_dir / run_id
        return run_dir if run_dir.is_dir() else None

    # -- launch ------------------------------------------------------------------------------

    def launch(self, task: TaskLaunch) -> TaskStatus:
        """Spawn ``task`` as ``bash wrapper.sh`` in a new session; see :meth:`RuntimeBackend.launch`.

        Idempotent: if ``state_dir/<run_id>/`` exists, that run's status is returned and nothing
        is started. Otherwise the prerequisites are checked (bash on PATH, ``workdir`` exists,
        valid ``gpus``) -- failing them raises and leaves no record, so a retry may launch.
        Then the directory (``os.mkdir``, exclusive) and ``launch.json`` are written BEFORE
        spawning, so a crash or a spawn failure from here on leaves a record that reads back as
        lost and is never started. Raises :class:`ValidationError` for a bad ``run_id``,
        ``commands`` or ``gpus`` and :class:`PlatformError` when bash is missing, ``workdir`` is
        not a directory, or writing the record or spawning fails.
        """
        if not _valid_run_id(task.run_id):
            raise ValidationError(
                "run_id",
                f"{task.run_id!r} must be 1-200 characters of letters, digits and ~ . - _, "
                "not starting with '.'",
            )
        if isinstance(task.commands, str) or not all(isinstance(c, str) for c in task.commands):
            raise ValidationError("commands", "must be a list of strings")
        with self._lock:
            run_dir = self.state_dir / task.run_id
            existing = self.status(task.run_id)
            if existing is not None:
                return existing
            # Prerequisites first: failing here starts nothing and leaves no record.
            bash = shutil.which("bash")
            if bash is None:
                raise PlatformError(f"cannot launch {task.run_id}: bash is not on the agent's PATH")
            cwd = task.workdir or os.getcwd()
            if not os.path.isdir(cwd):
                raise PlatformError(f"cannot launch {task.run_id}: workdir {cwd} is not a directory")
            env = _base_env()
            env.update(task.env)
            env.update(gpu_env(task.gpus))
            try:
                run_dir.mkdir()
            except FileExistsError:
                raise PlatformError(f"{run_dir} exists but is not a run directory") from None
            except OSError as exc:
                raise PlatformError(f"cannot create run directory {run_dir}: {exc}") from exc
            return self._spawn(task, run_dir, bash, cwd, env)

    def _spawn(self, task: TaskLaunch, run_dir: Path, bash: str, cwd: str, env: dict[str, str]) -> TaskStatus:
        launch_record = {k: v for k, v in asdict(task).items() if k != "env"}
        launch_record["env_keys"] = sorted(task.env)
        launch_record["created_at"] = time.time()
        try:
            _write_atomic(run_dir / "launch.json", json.dumps(launch_record, indent=2) + "\n")
            script = "# Apiary task commands (generated).\nset -e\n" + "".join(
                f"{cmd}\n" for cmd in task.commands
            )
            _write_atomic(run_dir / "script.sh", script)
            _write_atomic(run_dir / "wrapper.sh", _WRAPPER)
        except OSError as exc:
            raise PlatformError(f"cannot write the launch record of {task.run_id}: {exc}") from exc

        try:
            with (
                open(run_dir / "stdout.log", "ab") as out,
                open(run_dir / "stderr.log", "ab") as err,
            ):
                proc = subprocess.Popen(
                    [bash, str(run_dir / "wrapper.sh"), str(run_dir)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
        except OSError as exc:
            raise PlatformError(f"cannot launch {task.run_id}: {exc}") from exc
        started_at = time.time()
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:  # not reaped yet, so it exists (maybe as a zombie); be defensive
            create_time = started_at
        self._children[task.run_id] = proc
        threading.Thread(
            target=self._reap, args=(task.run_id, proc), name=f"apiary-reap-{task.run_id}", daemon=True
        ).start()
        meta = {
            "pid": proc.pid,
            "pgid": proc.pid,
            "create_time": create_time,
            "started_at": started_at,
            "gpus": list(task.gpus),
        }
        try:
            _write_atomic(run_dir / "meta.json", json.dumps(meta) + "\n")
        except OSError:
            pass  # the task runs; status() finds its wrapper by command line and rewrites meta.json
        return TaskStatus(
            run_id=task.run_id,
            state="running",
            exit_code=None,
            pid=proc.pid,
            started_at=started_at,
            finished_at=None,
        )

    def _reap(self, run_id: str, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        with self._lock:
            if self._children.get(run_id) is proc:
                del self._children[run_id]

    # -- status ------------------------------------------------------------------------------

    def _live_wrapper(self, run_dir: Path, meta: dict[str, Any] | None) -> psutil.Process | None:
        """The run's wrapper process if it is alive (not a zombie, same create_time), else None."""
        if meta is not None and isinstance(meta.get("pid"), int):
            try:
                proc = psutil.Process(meta["pid"])
                if proc.status() == psutil.STATUS_ZOMBIE:
                    return None
                if abs(proc.create_time() - float(meta.get("create_time", 0))) > _CREATE_TIME_TOLERANCE_S:
                    return None  # the pid was reused
                return proc
            except psutil.Error:
                return None
        # No meta.json: the agent died between spawn and recording it. Find the wrapper by its
        # command line (which names the run directory) and record what we find.
        wrapper = str(run_dir / "wrapper.sh")
        for proc in psutil.process_iter(["cmdline", "create_time"]):
            try:
                cmdline = proc.info.get("cmdline") or []
                if wrapper in cmdline and proc.status() != psutil.STATUS_ZOMBIE:
                    recovered = {
                        "pid": proc.pid,
                        "pgid": os.getpgid(proc.pid),
                        "create_time": proc.info["create_time"],
                        "started_at": proc.info["create_time"],
                        "gpus": None,
                        "recovered": True,
                    }
                    _write_atomic(run_dir / "meta.json", json.dumps(recovered) + "\n")
                    return proc
            except (ProcessLookupError, psutil.Error, OSError):
                continue
        return None

    def _status_of(self, run_dir: Path) -> TaskStatus:
        run_id = run_dir.name
        meta = _read_json(run_dir / "meta.json")
        pid = meta.get("pid") if meta else None
        started_at = meta.get("started_at") if meta else None
        stop = _read_json(run_dir / "stop.json")

        def exited(code: int | None, finished_at: float | None, lost: bool = False) -> TaskStatus:
            return TaskStatus(
                run_id=run_id,
                state="exited",
                exit_code=code,
                pid=pid,
                started_at=started_at,
                finished_at=finished_at,
                lost=lost,
                stopped=stop is not None,
            )

        recorded = _read_exit_code(run_dir / "exit_code")
        if recorded is not None:
            return exited(*recorded)
        proc = self._live_wrapper(run_dir, meta)
        if proc is not None:
            if meta is None:  # recovered just now
                meta = _read_json(run_dir / "meta.json")
                pid = proc.pid
                started_at = meta.get("started_at") if meta else None
            return TaskStatus(
                run_id=run_id,
                state="running",
                exit_code=None,
                pid=pid,
                started_at=started_at,
                finished_at=None,
            )
        # Not running: the wrapper may have written its code just before exiting.
        recorded = _read_exit_code(run_dir / "exit_code")
        if recorded is not None:
            return exited(*recorded)
        if stop is not None:
            # The wrapper died with the task (SIGKILL): the code is the signal that stop() sent.
            sig = _SIGNALS.get(str(stop.get("signal")), signal.SIGKILL)
            code = 128 + int(sig)
            try:
                _write_atomic(run_dir / "exit_code", f"{code}\n")
                finished = _read_exit_code(run_dir / "exit_code")
            except OSError:
                finished = None
            return exited(code, finished[1] if finished else time.time())
        return exited(None, None, lost=True)

    def status(self, run_id: str) -> TaskStatus | None:
        """See :meth:`RuntimeBackend.status`. Reads files under ``state_dir/<run_id>/`` and /proc."""
        with self._lock:
            run_dir = self._run_dir(run_id)
            return None if run_dir is None else self._status_of(run_dir)

    def list(self) -> list[TaskStatus]:
        """See :meth:`RuntimeBackend.list`: every ``state_dir/<run_id>/`` not marked forgotten."""
        with self._lock:
            if self._forgotten is None:
                self._forgotten = {p.parent.name for p in self.state_dir.glob("*/forgotten")}
            out = []
            for run_dir in sorted(self.state_dir.iterdir()):
                if run_dir.name in self._forgotten or not _valid_run_id(run_dir.name) or not run_dir.is_dir():
                    continue
                out.append(self._status_of(run_dir))
            return out

    def log_path(self, run_id: str, stream: LogStream) -> Path | None:
        """``state_dir/<run_id>/stdout.log`` or ``stderr.log``; ``None`` for an unknown run.

        The file exists once the run has been spawned and is appended to while it runs.
        Raises :class:`ValidationError` for a stream other than ``stdout``/``stderr``.
        """
        if stream not in ("stdout", "stderr"):
            raise ValidationError("stream", f"must be 'stdout' or 'stderr', got {stream!r}")
        run_dir = self._run_dir(run_id)
        return None if run_dir is None else run_dir / f"{stream}.log"

    # -- stop / forget -----------------------------------------------------------------------

    def stop(self, run_id: str, grace_s: float = 5.0) -> None:
        """SIGTERM the run's process group, SIGKILL it if anything is left after ``grace_s``.

        Writes ``stop.json`` before each signal, so the status reads ``stopped=True`` with 143
        (TERM) or 137 (KILL) even if the wrapper died. Polls in the calling thread: returns as
        soon as the group is empty, at the latest about ``grace_s + 1`` seconds after the call.
        Unknown, malformed or finished ``run_id``: returns silently.
        """
        with self._lock:
            run_dir = self._run_dir(run_id)
            if run_dir is None:
                return
            current = self._status_of(run_dir)
            if current.state != "running":
                return
            meta = _read_json(run_dir / "meta.json") or {}
            pgid = int(meta.get("pgid") or current.pid or 0)
            if pgid <= 1:
                return
            self._signal(run_dir, pgid, "TERM")
        deadline = time.monotonic() + max(0.0, grace_s)
        while time.monotonic() < deadline:
            if not _group_members(pgid):
                return
            time.sleep(_POLL_S)
        if not _group_members(pgid):
            return
        with self._lock:
            if (run_dir / "exit_code").exists() and not _group_members(pgid):
                return
            self._signal(run_dir, pgid, "KILL")
        deadline = time.monotonic() + _AFTER_KILL_WAIT_S
        while time.monotonic() < deadline and _group_members(pgid):
            time.sleep(_POLL_S)

    def _signal(self, run_dir: Path, pgid: int, name: str) -> None:
        record = {"signal": name, "requested_at": time.time()}
        _write_atomic(run_dir / "stop.json", json.dumps(record) + "\n")
        try:
            os.killpg(pgid, _SIGNALS[name])
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            raise PlatformError(f"cannot signal process group {pgid} of {run_dir.name}: {exc}") from exc

    def forget(self, run_id: str) -> None:
        """Drop a finished run from :meth:`list`; see :meth:`RuntimeBackend.forget`.

        Writes ``state_dir/<run_id>/forgotten`` and keeps everything else: the logs (still at
        :meth:`log_path`) and the idempotency record (:meth:`status` still answers and a repeated
        :meth:`launch` returns the final status). Deleting the directory frees the disk space but
        also the guarantee that this ``run_id`` is never started again. Raises
        :class:`PlatformError` if the run is still running.
        """
        with self._lock:
            run_dir = self._run_dir(run_id)
            if run_dir is None:
                return
            if self._status_of(run_dir).state == "running":
                raise PlatformError(f"cannot forget {run_id}: it is still running (stop it first)")
            (run_dir / "forgotten").touch()
            if self._forgotten is not None:
                self._forgotten.add(run_id)
