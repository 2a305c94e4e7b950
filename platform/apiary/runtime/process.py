"""``ProcessBackend``: runs each task as a plain process tree on this machine (the embedded default).

State directory layout (``state_dir`` and every run directory are root's, mode 0700; every
file is mode 0600 whatever the umask: they hold the job's commands with its secrets)::

    state_dir/
      <run_id>/
        launch.json   what was asked (no env values) and the task's uid, written BEFORE spawning
        env           the task's environment, NUL-separated ``NAME=value`` (read by the wrapper)
        script.sh     the task's commands under ``set -e`` (the record; the task runs a copy)
        wrapper.sh    the wrapper that runs the commands and records their exit code
        started       slot: "<wrapper pid> <unix time>", written by the wrapper before the task
        exit_code     slot: "<int>", written by the wrapper when the task ends
        stdout.log    the task's stdout (and the wrapper's), appended
        stderr.log    the task's stderr
        meta.json     {pid, pgid, create_time, started_at, gpus}, written right after spawning
        stop.json     {signal: "TERM"|"KILL", requested_at}, written by stop() before signalling
        forgotten     present once forget() was called

Who the task runs as (:mod:`apiary.runtime.isolation`): when the agent is root, every task gets
a uid of its own (never root), a home directory outside ``state_dir`` and no way into the
agent's files; the wrapper stays root, so only it can write the run's records and the task can
neither read nor forge them. When the agent is not root it cannot switch uids, and launches are
refused (:class:`PlatformError`) unless ``APIARY_ALLOW_UNISOLATED_TASKS`` is set, a development
setting under which tasks run as the agent's own user, as they all did before.

How a run is tracked:

* ``launch`` creates ``<run_id>/`` with ``os.mkdir`` (atomic: a second launch of the same
  ``run_id`` finds it and returns the existing status), leases the task's uid, writes the
  records and preallocates the ``started`` and ``exit_code`` slots, then spawns
  ``bash wrapper.sh ...`` with ``start_new_session=True``: the wrapper is the leader of a new
  session and process group (``pgid == pid``), so the task survives the agent being killed with
  ``kill -9`` and can be signalled as a group. If any of this fails, what was written is removed
  and :class:`PlatformError` raised: nothing started, and a retry may launch.
* The wrapper first fills the ``started`` slot, then runs the commands (as the task's uid) in
  the foreground, so the exit code is recorded from inside the task's session, not by the
  agent's ``waitpid``: a new agent (a new ``ProcessBackend`` on the same ``state_dir``)
  re-adopts a still-running run and later reads its real exit code. When the commands end, the
  wrapper SIGTERMs whatever is left in its group (a finished task leaves nothing running, as a
  container would), then fills the ``exit_code`` slot and exits with the same code.
* Slots are overwritten in place (:mod:`apiary.runtime.records`), so a task that ends while the
  disk is full still records its exit code and is never reported lost (and run again).
* A run is *running* while its wrapper process exists, is not a zombie and has the
  ``create_time`` recorded in ``meta.json`` (guards against pid reuse). If ``meta.json`` is
  missing (the agent died between spawn and write), the wrapper is looked up by its command line.
* A run whose directory exists but whose wrapper never started (no ``meta.json``, a blank
  ``started`` slot, no wrapper process: the agent died mid-launch) reads as *not launched*:
  :meth:`status` answers ``None``, :meth:`list` leaves it out and :meth:`launch` launches it.
  A run that did start always reads back with its ``started_at``.
* A run that is not running and has no exit code is *stopped* if ``stop.json`` exists (exit
  code ``128 + signal``: 143 / 137, recorded then) and *lost* otherwise.
* Once a run reads exited, its uid's lease is released: what still runs as that uid is killed
  and the task's home deleted.

Reaping: every wrapper this instance spawns gets a daemon thread (``apiary-reap-<run_id>``)
that blocks in ``Popen.wait()``, so no zombie outlives its task; no SIGCHLD handler is
installed. Wrappers adopted from an earlier agent process are not our children (they were
re-parented to init or a subreaper), so nothing here reaps them. Threads: only the reapers;
``stop`` polls in the calling thread.

Environment rule: the task sees ``task.env`` on top of a minimal inherited environment --
``PATH HOME LANG LC_ALL LC_CTYPE TZ TMPDIR USER LOGNAME SHELL`` and the agent's Python
variables ``VIRTUAL_ENV PYTHONPATH PYTHONHOME CONDA_PREFIX`` when set. When the agent runs in
a virtual environment, its ``bin`` directory is put first on the inherited ``PATH`` (and
``VIRTUAL_ENV`` set) so a task's ``python3`` has the agent's packages. A task with its own uid
gets ``HOME`` and ``TMPDIR`` set to its home and ``USER``/``LOGNAME`` to ``apiary-<uid>``.
``task.env`` wins over all of these; ``CUDA_VISIBLE_DEVICES``/``NVIDIA_VISIBLE_DEVICES`` from
``task.gpus`` win over ``task.env``. The wrapper itself (root) runs with ``PATH`` only: nothing
from the job reaches it.

One ``ProcessBackend`` per ``state_dir`` at a time (one agent per node); it is thread-safe.
"""

from __future__ import annotations

import builtins
import json
import logging
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
from apiary.runtime import sshd
from apiary.runtime.base import LogStream, RuntimeBackend, TaskLaunch, TaskStatus
from apiary.runtime.env import gpu_env
from apiary.runtime.isolation import TaskIdentity, UidPool, grant_search
from apiary.runtime.records import open_private as _open_private
from apiary.runtime.records import preallocate_slot as _preallocate_slot
from apiary.runtime.records import private_dir as _private_dir
from apiary.runtime.records import read_json as _read_json
from apiary.runtime.records import read_slot as _read_slot
from apiary.runtime.records import valid_run_id as _valid_run_id
from apiary.runtime.records import write_atomic as _write_atomic
from apiary.runtime.records import write_slot as _write_slot
from apiary.settings import parse_uid_range

logger = logging.getLogger(__name__)

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
#: Slot sizes in bytes: "<pid> <unix time with microseconds>" and an exit code.
STARTED_SLOT = 64
EXIT_SLOT = 32

# The wrapper (root): records its start, then runs the commands -- through the uid switch when
# it is given -- in a bash that takes the task's environment from fd 3 (the root-only ``env``
# record; never on a command line, which any user may read). It traps TERM/INT/HUP so it
# outlives a stop()'s SIGTERM long enough to record the task's code (a trapped signal waits for
# the foreground child); SIGKILL takes it down too, and stop.json then supplies the code. Trap
# dispositions are reset in children, so the commands see the default handlers. Both records
# are slots overwritten in place (``1<>``), which needs no disk space.
_WRAPPER = r"""# Apiary task wrapper (generated; see apiary.runtime.process).
# $1 run directory, $2 the commands, $3 bash, then the command that switches to the task's uid.
run_dir="$1"; script="$2"; bash="$3"; shift 3
printf '%s %s' "$$" "${EPOCHREALTIME:-$(date +%s)}" 1<>"$run_dir/started"
trap ':' TERM INT HUP
"$@" "$bash" -c 'while IFS= read -r -d "" kv; do export "$kv" 2>/dev/null; done <&3; exec 3<&-; exec "$0" "$1"' \
  "$bash" "$script" 3<"$run_dir/env" </dev/null
rc=$?
trap '' TERM
kill -TERM 0 2>/dev/null
printf '%s' "$rc" 1<>"$run_dir/exit_code"
exit "$rc"
"""

_SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL}

# A task's storage (TaskLaunch.mounts) and, with the ssh plugin, its private /etc/passwd and
# /etc/group (apiary.runtime.sshd): the wrapper runs the uid switch under
# ``unshare --mount --propagation private``, and this script (root, in the task's new mount
# namespace) binds each source at its target, read-only where asked, then execs the rest of the
# command line. The binds exist only in the task's namespace: nothing else on the node sees them,
# and they go when its last process does. A missing target directory is created on the node's file
# system (the namespace shares it) for a directory's bind; a file is bound over an existing file.
# spec.storage keeps storage targets off the system's directories.
# $1 the mounts record (NUL-separated "source" "target" "ro|rw" triples), then the command.
_MOUNTS = r"""# Apiary task storage (generated; see apiary.runtime.process).
set -eu
record="$1"; shift
while IFS= read -r -d "" src && IFS= read -r -d "" dst && IFS= read -r -d "" mode; do
  if [ -d "$src" ]; then mkdir -p -- "$dst"; fi
  mount --bind -- "$src" "$dst"
  if [ "$mode" = ro ]; then mount -o remount,bind,ro -- "$dst"; fi
done <"$record"
exec "$@"
"""


def _read_exit_code(path: Path) -> tuple[int, float] | None:
    """``(code, mtime)`` of an ``exit_code`` slot (or whole file), or ``None`` if absent, blank
    or unreadable."""
    text = _read_slot(path)
    if text is None:
        return None
    try:
        return int(text), path.stat().st_mtime
    except (OSError, ValueError):
        return None


#: /proc/stat's ``btime`` (the boot time, seconds since the epoch) as last read: psutil's
#: ``create_time()`` adds it to a process's start in clock ticks, re-reading /proc/stat each call.
_boot_time: float | None = None
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _alive_since(pid: int, create_time: float) -> bool:
    """Whether process ``pid`` exists, is not a zombie, and is the one psutil gave ``create_time``
    (seconds since the epoch) within ``_CREATE_TIME_TOLERANCE_S``; one read of ``/proc/<pid>/stat``
    where psutil takes three and a read of /proc/stat. Linux only, as this runtime is."""
    global _boot_time
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:  # no such process (or /proc unreadable: nothing is known to run)
        return False
    fields = data[data.rindex(b")") + 2:].split()  # after "pid (comm) ": comm may hold spaces and ")"
    if fields[0] in (b"Z", b"X"):
        return False
    since_boot = int(fields[19]) / _CLOCK_TICKS  # field 22, starttime
    if _boot_time is not None and abs(_boot_time + since_boot - create_time) <= _CREATE_TIME_TOLERANCE_S:
        return True
    # First call, or a pid reused, or the wall clock was set since btime was read (btime moves
    # with it, as psutil's create_time does): decide on btime as it reads now.
    _boot_time = psutil.boot_time()
    return abs(_boot_time + since_boot - create_time) <= _CREATE_TIME_TOLERANCE_S


def _read_started(path: Path) -> tuple[int, float] | None:
    """``(wrapper pid, unix time)`` from a ``started`` slot, or ``None`` while it is blank."""
    text = _read_slot(path)
    try:
        pid, at = (text or "").split()
        return int(pid), float(at.replace(",", "."))
    except ValueError:
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


_python_access_granted = False


def _grant_python_access() -> None:
    """Let task uids run the agent's Python (:func:`apiary.runtime.isolation.grant_search`), once."""
    global _python_access_granted
    if _python_access_granted:
        return
    _python_access_granted = True
    paths = [Path(sys.executable), Path(sys.prefix), Path(sys.base_prefix)]
    paths += [Path(p) for p in sys.path if p and os.path.isdir(p)]
    for directory in grant_search(paths):
        logger.warning("made %s searchable by others (o+x) so tasks can run the agent's Python", directory)


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new mode-0600 file (not fsync-ed: a launch record, see
    :mod:`apiary.runtime.records`). Raises OSError."""
    fd = _open_private(path, os.O_WRONLY | os.O_TRUNC)
    with open(fd, "wb") as f:
        f.write(data)


class ProcessBackend(RuntimeBackend):
    """Runs tasks as local process trees, with all state under ``state_dir`` (see module doc).

    ``state_dir`` is created (mode 0700) if missing. Nothing is started by the constructor;
    runs left by an earlier agent process are found lazily by :meth:`status` and :meth:`list`.

    ``allow_unisolated``: run tasks as the agent's own user when it is not root; ``None`` reads
    ``APIARY_ALLOW_UNISOLATED_TASKS``. ``task_uids`` (``"first-last"``) and ``scratch_root``:
    the task uid range and the leases' directory (:mod:`apiary.runtime.isolation`); ``None``
    reads ``APIARY_TASK_UIDS`` and ``APIARY_TASK_SCRATCH``. Raises :class:`PlatformError` if
    ``state_dir`` cannot be created and :class:`ValidationError` (field ``task_uids``) for a
    malformed range.
    """

    name = "process"
    runs_ssh = True

    def __init__(
        self,
        state_dir: Path | str,
        *,
        allow_unisolated: bool | None = None,
        task_uids: str | None = None,
        scratch_root: Path | str | None = None,
    ) -> None:
        self.state_dir = Path(state_dir).absolute()
        try:
            _private_dir(self.state_dir, parents=True)
        except OSError as exc:
            raise PlatformError(f"cannot create runtime state dir {self.state_dir}: {exc}") from exc
        if allow_unisolated is None or task_uids is None or scratch_root is None:
            from apiary.settings import Settings

            settings = Settings()
            allow_unisolated = settings.allow_unisolated_tasks if allow_unisolated is None else allow_unisolated
            task_uids = task_uids or settings.task_uids
            scratch_root = scratch_root or settings.task_scratch
        try:
            first, last = parse_uid_range(task_uids)
        except ValueError as exc:
            raise ValidationError("task_uids", str(exc)) from None
        self.allow_unisolated = allow_unisolated
        self.uids = UidPool(Path(scratch_root).expanduser(), first, last)
        if self.isolated():
            _grant_python_access()
        self._lock = threading.RLock()
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        # The run ids list() reads: every run directory on disk not marked forgotten, read from
        # disk on the first list() and kept up to date by launch() and forget(), so a list costs
        # the runs not yet forgotten, not every run this state_dir ever held.
        self._listed: set[str] | None = None
        # Exited runs whose uid lease this instance has released (or found released).
        self._released: set[str] = set()

    # -- paths -------------------------------------------------------------------------------

    def _run_dir(self, run_id: str) -> Path | None:
        """The run's directory if ``run_id`` is well-formed and was launched here, else None."""
        if not _valid_run_id(run_id):
            return None
        run_dir = self.state_dir / run_id
        return run_dir if run_dir.is_dir() else None

    # -- launch ------------------------------------------------------------------------------

    def isolated(self) -> bool:
        """True when tasks get uids of their own (the agent is root)."""
        return os.geteuid() == 0

    def launch(self, task: TaskLaunch) -> TaskStatus:
        """Spawn ``task`` as ``bash wrapper.sh`` in a new session; see :meth:`RuntimeBackend.launch`.

        Idempotent: if ``state_dir/<run_id>/`` holds a run that started, that run's status is
        returned and nothing is started. Otherwise the prerequisites are checked (bash on PATH,
        ``setpriv`` when isolating, ``workdir`` exists, valid ``gpus``), the directory is made
        (``os.mkdir``, exclusive), a task uid leased and every record written BEFORE spawning.
        Any failure removes what was written and raises, so nothing started and a retry may
        launch; a crash leaves a directory that reads as not launched (module doc). Raises
        :class:`ValidationError` for a bad ``run_id``, ``commands`` or ``gpus`` and
        :class:`PlatformError` when the agent is not root and unisolated tasks are not allowed,
        bash or setpriv is missing, ``workdir`` is not a directory, no task uid is free, or
        writing the records (a full disk) or spawning fails.
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
            isolated = self.isolated()
            if not isolated and not self.allow_unisolated:
                raise PlatformError(
                    f"cannot launch {task.run_id}: the process runtime runs each task as an unprivileged uid "
                    f"and needs root to switch to it (the agent runs as uid {os.geteuid()}); run the agent as "
                    "root, use the docker or kubernetes runtime, or for development only set "
                    "APIARY_ALLOW_UNISOLATED_TASKS=1 (tasks then run as the agent's user and can read its files)"
                )
            bash = shutil.which("bash")
            if bash is None:
                raise PlatformError(f"cannot launch {task.run_id}: bash is not on the agent's PATH")
            setpriv = shutil.which("setpriv", path=_DEFAULT_PATH) if isolated else None
            if isolated and setpriv is None:
                raise PlatformError(f"cannot launch {task.run_id}: setpriv (util-linux) is not installed")
            if task.workdir is not None and not os.path.isdir(task.workdir):
                raise PlatformError(f"cannot launch {task.run_id}: workdir {task.workdir} is not a directory")
            if task.ssh is not None and not isolated:
                raise PlatformError(f"cannot launch {task.run_id}: the ssh runtime plugin runs the task's sshd as "
                                    "its own uid, which needs the agent to run as root")
            if task.ssh is not None and not (os.access(sshd.SSHD, os.X_OK) and os.access(sshd.SSH, os.X_OK)):
                raise PlatformError(f"cannot launch {task.run_id}: the ssh runtime plugin needs OpenSSH's "
                                    f"{sshd.SSHD} and {sshd.SSH} on the node (Debian: openssh-server, openssh-client)")
            env = _base_env()
            env.update(task.env)
            env.update(gpu_env(task.gpus))
            if run_dir.is_dir():  # a launch that died before its wrapper started: start afresh
                self.uids.release_owned_by(run_dir)
                shutil.rmtree(run_dir, ignore_errors=True)
            try:
                _private_dir(run_dir, exist_ok=False)
                if self._listed is not None:
                    self._listed.add(task.run_id)
            except FileExistsError:
                raise PlatformError(f"{run_dir} exists but is not a run directory") from None
            except OSError as exc:
                raise PlatformError(f"cannot create run directory {run_dir}: {exc}") from exc
            ident: TaskIdentity | None = None
            try:
                if isolated:
                    ident = self.uids.acquire(run_dir)
                return self._spawn(task, run_dir, bash, env, ident, setpriv)
            except (PlatformError, OSError):
                if ident is not None:
                    self.uids.release(ident.uid, run_dir)
                shutil.rmtree(run_dir, ignore_errors=True)
                raise

    def _write_records(self, task: TaskLaunch, run_dir: Path, env: dict[str, str],
                       ident: TaskIdentity | None) -> Path:
        """Write every record of a launch (module doc); the script the wrapper runs. Raises OSError."""
        launch_record: dict[str, Any] = {k: v for k, v in asdict(task).items() if k not in ("env", "ssh")}
        if task.ssh is not None:  # its keys stay out of the record: sshd.prepare writes them for the task
            launch_record["ssh"] = {k: v for k, v in task.ssh.items() if k not in ("hostKey", "jobKey")}
        launch_record["env_keys"] = sorted(task.env)
        launch_record["created_at"] = time.time()
        launch_record["task_uid"] = ident.uid if ident else os.geteuid()
        _write_atomic(run_dir / "launch.json", json.dumps(launch_record, indent=2) + "\n", durable=False)
        prelude = sshd.prelude(task.ssh) if task.ssh is not None else ""
        script = ("# Apiary task commands (generated).\nset -e\n" + prelude
                  + "".join(f"{cmd}\n" for cmd in task.commands))
        _write_atomic(run_dir / "script.sh", script, durable=False)
        _write_atomic(run_dir / "wrapper.sh", _WRAPPER, durable=False)
        if ident is not None:
            env = {**env, "HOME": str(ident.home), "TMPDIR": str(ident.home),
                   "USER": f"apiary-{ident.uid}", "LOGNAME": f"apiary-{ident.uid}"}
            env.update(task.env)
            env.update(gpu_env(task.gpus))
        binds = list(task.mounts)
        if task.ssh is not None and ident is not None:
            try:
                binds += sshd.prepare(task.ssh, uid=ident.uid, home=ident.home, run_dir=run_dir, env=env)
            except ValueError as exc:
                raise OSError(f"malformed ssh launch: {exc}") from None
        if binds:
            _write_atomic(run_dir / "mounts.sh", _MOUNTS, durable=False)
            _write_private(run_dir / "mounts", b"".join(
                f"{m['source']}\0{m['target']}\0{'ro' if m['readOnly'] else 'rw'}\0".encode() for m in binds))
        _write_private(run_dir / "env", b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
        _preallocate_slot(run_dir / "started", STARTED_SLOT, durable=False)
        _preallocate_slot(run_dir / "exit_code", EXIT_SLOT, durable=False)
        if ident is None:
            return run_dir / "script.sh"
        self.uids.write_script(ident, script)
        return ident.script

    def _spawn(self, task: TaskLaunch, run_dir: Path, bash: str, env: dict[str, str],
               ident: TaskIdentity | None, setpriv: str | None) -> TaskStatus:
        try:
            script = self._write_records(task, run_dir, env, ident)
            out = _open_private(run_dir / "stdout.log", os.O_WRONLY | os.O_APPEND)
            try:
                err = _open_private(run_dir / "stderr.log", os.O_WRONLY | os.O_APPEND)
            except OSError:
                os.close(out)
                raise
        except OSError as exc:
            raise PlatformError(f"cannot write the launch record of {task.run_id}: {exc}") from exc
        cwd = task.workdir or (str(ident.home) if ident else os.getcwd())
        drop = ident.drop_argv(setpriv) if ident is not None and setpriv else []
        if task.mounts or task.ssh is not None:
            drop = [*self._mount_argv(task, bash, run_dir), *drop]
        try:
            proc = subprocess.Popen(
                [bash, str(run_dir / "wrapper.sh"), str(run_dir), str(script), bash, *drop],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env={"PATH": _DEFAULT_PATH},
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise PlatformError(f"cannot launch {task.run_id}: {exc}") from exc
        finally:
            os.close(out)
            os.close(err)
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
            _write_atomic(run_dir / "meta.json", json.dumps(meta) + "\n", durable=False)
        except OSError:
            pass  # the task runs; the wrapper's started slot and command line still find it
        return TaskStatus(
            run_id=task.run_id,
            state="running",
            exit_code=None,
            pid=proc.pid,
            started_at=started_at,
            finished_at=None,
        )

    def _mount_argv(self, task: TaskLaunch, bash: str, run_dir: Path) -> builtins.list[str]:
        """The prefix that gives the task its own mount namespace with its storage bound in
        (``_MOUNTS``). Raises PlatformError where binding is impossible: the agent is not root, or
        util-linux's unshare is missing."""
        unshare = shutil.which("unshare", path=_DEFAULT_PATH)
        if os.geteuid() != 0 or unshare is None:
            raise PlatformError(f"cannot launch {task.run_id}: its storage is bound in a mount namespace of its "
                                "own, which needs the agent to run as root with util-linux's unshare")
        return [unshare, "--mount", "--propagation", "private", "--", bash, str(run_dir / "mounts.sh"),
                str(run_dir / "mounts")]

    def _reap(self, run_id: str, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        with self._lock:
            if self._children.get(run_id) is proc:
                del self._children[run_id]

    # -- status ------------------------------------------------------------------------------

    def _live_wrapper(self, run_dir: Path, meta: dict[str, Any] | None) -> psutil.Process | bool:
        """Whether the run's wrapper process is alive (not a zombie, same create_time); when
        ``meta`` names no pid, the wrapper found by its command line (recorded into meta.json), or
        False."""
        if meta is not None and isinstance(meta.get("pid"), int):
            try:
                return _alive_since(meta["pid"], float(meta.get("create_time", 0)))
            except (TypeError, ValueError):
                return False
        # No meta.json: the agent died between spawn and recording it. Find the wrapper by its
        # command line (which names the run directory) and record what we find.
        wrapper = str(run_dir / "wrapper.sh")
        started = _read_started(run_dir / "started")
        for proc in psutil.process_iter(["cmdline", "create_time"]):
            try:
                cmdline = proc.info.get("cmdline") or []
                if wrapper not in cmdline or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
            except (ProcessLookupError, psutil.Error):
                continue
            recovered = {
                "pid": proc.pid,
                "pgid": proc.pid,
                "create_time": proc.info["create_time"],
                "started_at": started[1] if started else proc.info["create_time"],
                "gpus": None,
                "recovered": True,
            }
            try:
                _write_atomic(run_dir / "meta.json", json.dumps(recovered) + "\n")
            except OSError:
                pass  # a full disk: found again by the next status()
            return proc
        return False

    def _status_of(self, run_dir: Path) -> TaskStatus | None:
        """The run's status; ``None`` when it never started (module doc: not launched)."""
        run_id = run_dir.name
        meta = _read_json(run_dir / "meta.json")
        # The started slot is read only when meta.json is missing (the agent died before it): one
        # file fewer per run on every list(), which the agent calls several times a second.
        started = None if meta else _read_started(run_dir / "started")
        pid = meta.get("pid") if meta else (started[0] if started else None)
        started_at = meta.get("started_at") if meta else (started[1] if started else None)
        stop = _read_json(run_dir / "stop.json")

        def exited(code: int | None, finished_at: float | None, lost: bool = False) -> TaskStatus:
            self._release(run_dir)
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
        if proc:
            if meta is None and isinstance(proc, psutil.Process):  # recovered just now
                pid = proc.pid
                started_at = started[1] if started else proc.create_time()
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
        if meta is None and started is None and stop is None:
            launched = _read_json(run_dir / "launch.json")
            # Its wrapper never ran: not launched. A run recorded by a version without the started
            # slot (its launch.json has no task_uid) reads as lost below, as it did then.
            if launched is None or "task_uid" in launched:
                return None
        if stop is not None:
            # The wrapper died with the task (SIGKILL): the code is the signal that stop() sent.
            sig = _SIGNALS.get(str(stop.get("signal")), signal.SIGKILL)
            code = 128 + int(sig)
            try:
                if (run_dir / "exit_code").exists():
                    _write_slot(run_dir / "exit_code", str(code))
                else:  # a run launched by an older version
                    _write_atomic(run_dir / "exit_code", f"{code}\n")
                finished = _read_exit_code(run_dir / "exit_code")
            except OSError:
                finished = None
            return exited(code, finished[1] if finished else time.time())
        return exited(None, None, lost=True)

    def _release(self, run_dir: Path) -> None:
        """Release the exited run's task uid (kill what still runs as it, delete its home, in the
        background: :meth:`UidPool.release <apiary.runtime.isolation.UidPool.release>`), once."""
        if run_dir.name in self._released:
            return
        launched = _read_json(run_dir / "launch.json") or {}
        uid = launched.get("task_uid")
        if isinstance(uid, int) and uid > 0 and os.geteuid() == 0:
            self.uids.release(uid, run_dir, wait=False)
        self._released.add(run_dir.name)

    def status(self, run_id: str) -> TaskStatus | None:
        """See :meth:`RuntimeBackend.status`. Reads files under ``state_dir/<run_id>/`` and /proc;
        ``None`` also for a run whose launch died before its wrapper started."""
        with self._lock:
            run_dir = self._run_dir(run_id)
            return None if run_dir is None else self._status_of(run_dir)

    def list(self) -> list[TaskStatus]:
        """See :meth:`RuntimeBackend.list`: every ``state_dir/<run_id>/`` that started and is not
        marked forgotten."""
        with self._lock:
            if self._listed is None:
                forgotten = {p.parent.name for p in self.state_dir.glob("*/forgotten")}
                self._listed = {n for n in os.listdir(self.state_dir) if n not in forgotten and _valid_run_id(n)}
            out = []
            for name in sorted(self._listed):
                run_dir = self.state_dir / name
                if not run_dir.is_dir():
                    self._listed.discard(name)
                    continue
                st = self._status_of(run_dir)
                if st is not None:
                    out.append(st)
            return out

    def exec_prefix(self, run_id: str) -> builtins.list[str]:
        """The argv prefix that runs a command as ``run_id``'s task does (its uid, no groups, no
        privileges), for commands the job defines but the agent starts, such as exec probes:
        ``[*prefix, "sh", "-c", ...]``. ``[]`` when tasks run as the agent's user. Raises
        :class:`PlatformError` for an unknown run or one whose uid is not recorded, never
        answering with a prefix that would leave the command running as root."""
        run_dir = self._run_dir(run_id)
        launched = _read_json(run_dir / "launch.json") if run_dir is not None else None
        if launched is None:
            raise PlatformError(f"no launch record for {run_id}: cannot tell which uid runs its commands")
        if not self.isolated():
            return []
        uid = launched.get("task_uid")
        setpriv = shutil.which("setpriv", path=_DEFAULT_PATH)
        if not isinstance(uid, int) or isinstance(uid, bool) or uid <= 0 or setpriv is None:
            raise PlatformError(f"{run_id} has no task uid recorded (or setpriv is missing): refusing to run as root")
        return TaskIdentity(uid=uid, lease=self.uids.root / str(uid)).drop_argv(setpriv)

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
            if current is None or current.state != "running":
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
            if _read_exit_code(run_dir / "exit_code") is not None and not _group_members(pgid):
                return
            self._signal(run_dir, pgid, "KILL")
        deadline = time.monotonic() + _AFTER_KILL_WAIT_S
        while time.monotonic() < deadline and _group_members(pgid):
            time.sleep(_POLL_S)

    def _signal(self, run_dir: Path, pgid: int, name: str) -> None:
        record = {"signal": name, "requested_at": time.time()}
        try:
            _write_atomic(run_dir / "stop.json", json.dumps(record) + "\n")
        except OSError:
            pass  # a full disk: the wrapper still records the code the signal gives
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
            current = self._status_of(run_dir)
            if current is not None and current.state == "running":
                raise PlatformError(f"cannot forget {run_id}: it is still running (stop it first)")
            os.close(_open_private(run_dir / "forgotten", os.O_WRONLY))
            if self._listed is not None:
                self._listed.discard(run_id)
