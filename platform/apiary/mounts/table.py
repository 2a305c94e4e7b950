"""The mounts of one node: each storage server mounted once, shared by every holder.

A node agent keeps one :class:`MountTable`; a task that needs storage is a *holder*
(its run id). :meth:`MountTable.acquire` mounts the server the first time anybody needs it and
answers the host directory that is the server's root; :meth:`MountTable.release` drops a holder
and unmounts every server nobody holds any more; :meth:`MountTable.reconcile` does that for every
holder the agent no longer runs (after a restart, or a task that vanished). The control plane keeps
one too, to reach storage for the files API.

On disk, under ``root``::

    root/                          0700: tasks see their storage only through the runtime's binds
        <name>-<hash>/             a mount point (the server's root once mounted)
        .private/                  0700
            holders/<name>-<hash>.json   0600: {"name", "type", "target", "holders": [...]}
            locks/<name>-<hash>.lock     flock(2): one acquire/release of a server at a time,
                                         across threads and processes
            <name>-<hash>/               0700: sshfs's key and known_hosts (mounts.servers)

``<hash>`` is a short hash of the server's type and data (:attr:`ServerSpec.key`), so a server
redefined under its old name is mounted afresh beside the old mount, which is unmounted when its
last holder goes. Whether something is mounted is read from ``/proc/self/mountinfo`` (proc(5)),
never assumed from the records: a restarted agent finds its mounts, and a mount that vanished
(reboot, ``umount`` by hand) is made again. A FUSE mount whose daemon died answers ENOTCONN; it
is lazily unmounted and made again.

Every mount command runs under a hard timeout (``timeout_s``): a GlusterFS or sshfs server that
is down or silent fails the acquire with :class:`MountError` within it, never hangs it. What a
timed-out command leaves is removed: its process group is killed, and so is any process whose
command line names the mount point (the FUSE daemons ``glusterfs`` and ``sshfs`` detach from the
group), then the mount point is lazily unmounted (``umount -l``) if it got mounted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from apiary import procutil
from apiary.errors import PlatformError, ValidationError
from apiary.mounts import files
from apiary.mounts.servers import ServerSpec, check_server, mount_argv, mount_log, redacted, scrub

__all__ = ["MountError", "MountTable", "is_mounted", "mount_points"]

logger = logging.getLogger(__name__)

#: Seconds an ``umount`` gets before the table falls back to a lazy one.
UMOUNT_TIMEOUT_S = 10.0
_STDERR_MAX = 2000  # characters of a failed command's stderr quoted in a MountError
_OCTAL = re.compile(r"\\([0-7]{3})")


class MountError(PlatformError):
    """A storage server could not be mounted (or unmounted) on this node: the server is down or
    refuses us, or the node lacks the client. HTTP 500; the task may succeed later or elsewhere.

    The message names the server, its type and the command's stderr (secrets scrubbed);
    ``server`` and ``server_type`` carry the first two."""

    code = "MountError"

    def __init__(self, server: str, server_type: str, reason: str) -> None:
        self.server = server
        self.server_type = server_type
        super().__init__(f"storage server {server!r} ({server_type}): {reason}")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo (proc(5), show_mountinfo)
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_points() -> dict[str, str]:
    """Every mount point in this process's mount namespace -> its file system type (the last
    mount on a point wins), from ``/proc/self/mountinfo``."""
    points: dict[str, str] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) >= 5 and right:
            points[_unescape(fields[4])] = right.split()[0]
    return points


def is_mounted(path: Path | str) -> bool:
    """Whether ``path`` (made absolute and free of symlinks) is a mount point now."""
    return os.path.realpath(path) in mount_points()


class MountTable:
    """The storage mounts of one node (module doc). Thread-safe, and safe across processes that
    share ``root`` (per-server ``flock``). Needs root (``mount``, FUSE's ``allow_other``).

    ``root`` is created (0700) if missing. ``timeout_s`` bounds each mount command (seconds).
    """

    def __init__(self, root: Path | str, *, timeout_s: float = 20.0) -> None:
        if timeout_s <= 0:
            raise ValidationError("timeout_s", f"must be > 0, got {timeout_s}")
        base = Path(root)
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(base, 0o700)
        self.root = Path(os.path.realpath(base))  # mountinfo lists real paths
        self.timeout_s = timeout_s
        self.private = procutil.private_dir(self.root / ".private")
        self._records = procutil.private_dir(self.private / "holders")
        self._locks_dir = procutil.private_dir(self.private / "locks")
        self._guard = threading.Lock()
        self._thread_locks: dict[str, threading.Lock] = {}

    # --- public -------------------------------------------------------------------------------

    def target(self, server: ServerSpec) -> Path:
        """Where ``server`` is (or would be) mounted: ``root/<name>-<hash>``; for a local server
        its ``rootPath``."""
        if server.type == "local":
            return Path(server.data["rootPath"])
        return self.root / server.key

    def acquire(self, server: ServerSpec, holder: str) -> Path:
        """Make ``server`` available to ``holder`` (a task's run id) and return the host
        directory that is the server's root.

        A local server answers its ``rootPath`` (which must be a directory; nothing is mounted or
        recorded). Any other is mounted on :meth:`target` unless it is mounted already (the
        mount table is read, so this holds after an agent restart too), and ``holder`` is recorded
        durably before the answer. Idempotent per ``(server, holder)``.

        Raises ValidationError for a bad spec or holder, :class:`MountError` when the mount
        command fails or passes ``timeout_s`` (nothing is left mounted then, and the holder is
        not recorded).
        """
        check_server(server)
        if not isinstance(holder, str) or not holder or "\0" in holder:
            raise ValidationError("holder", f"{holder!r} is not a holder name")
        if server.type == "local":
            path = Path(server.data["rootPath"])
            if not path.is_dir():
                raise MountError(server.name, server.type, f"rootPath {str(path)!r} is not a directory on this node")
            return path
        key = server.key
        target = self.root / key
        with self._locked(key):
            record = self._read(key) or {"name": server.name, "type": server.type, "target": str(target),
                                         "server": redacted(server), "holders": []}
            if not self._healthy_mount(target):
                self._mount(server, target)
            if holder not in record["holders"]:
                record["holders"].append(holder)
                self._write(key, record)
            logger.info("storage acquired server=%s type=%s holder=%s holders=%d",
                        server.name, server.type, holder, len(record["holders"]))
        return target

    def release(self, holder: str) -> list[str]:
        """Drop ``holder`` from every server and unmount each server nobody holds any more
        (``umount``; ``umount -l`` when busy or stuck, so the mount goes once its last user closes
        it). Returns the mount directories' names (``<name>-<hash>``) unmounted. Idempotent; an
        unmount that fails even lazily raises :class:`MountError` after the other servers are
        handled (the record stays, so a later release retries)."""
        unmounted, errors = [], []
        for key in self._keys():
            with self._locked(key):
                record = self._read(key)
                if record is None or holder not in record["holders"]:
                    continue
                record["holders"].remove(holder)
                if record["holders"]:
                    self._write(key, record)
                    continue
                try:
                    self._unmount(record)
                except MountError as e:
                    errors.append(e)
                    self._write(key, record)
                    continue
                unmounted.append(key)
        if errors:
            raise errors[0]
        return unmounted

    def reconcile(self, live: set[str]) -> list[str]:
        """Release every recorded holder not in ``live`` (the run ids the agent still runs), and
        unmount servers recorded with no holder (a crash between the two steps of a release).
        Returns the mount directories unmounted."""
        unmounted = []
        for holder in sorted(self.holders() - set(live)):
            unmounted += self.release(holder)
        for key in self._keys():
            with self._locked(key):
                record = self._read(key)
                if record is not None and not record["holders"]:
                    self._unmount(record)
                    unmounted.append(key)
        return unmounted

    def holders(self, server: ServerSpec | None = None) -> set[str]:
        """The recorded holders of ``server``, or of every server."""
        keys = [server.key] if server is not None else self._keys()
        out: set[str] = set()
        for key in keys:
            record = self._read(key)
            if record is not None:
                out.update(record["holders"])
        return out

    def subdir(self, server_root: Path | str, path: str, *, create: bool, mode: int = files.DIR_MODE) -> Path:
        """``server_root`` joined with ``path`` (OpenPAI's mountInfo ``path``: relative,
        ``/``-separated; ``""`` is the root), resolved by the kernel beneath ``server_root`` so
        that a symlink a task planted cannot lead outside; the answer has no symlinks in it.

        With ``create`` missing directories are made with ``mode`` (default
        :data:`~apiary.mounts.files.DIR_MODE`, 1777: every task uid may create entries, only
        their owner may remove them; see there). Raises ValidationError (``path``) for an
        absolute path, ``..``, NUL or an escaping symlink, NotFoundError when it does not exist
        and ``create`` is false.

        The answer is checked when made: a task could still swap a component for a symlink
        before the caller bind-mounts it. Bind-mount it at once.
        """
        if create:
            files.make_dirs(server_root, path, mode=mode)
        return files.real_path(server_root, path)

    # --- records ------------------------------------------------------------------------------

    def _keys(self) -> list[str]:
        return sorted(p.stem for p in self._records.glob("*.json"))

    def _read(self, key: str) -> dict[str, Any] | None:
        try:
            record = json.loads((self._records / f"{key}.json").read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            logger.warning("unreadable mount record key=%s: treated as held by nobody", key)
            return {"name": key, "type": "?", "target": str(self.root / key), "holders": []}
        return record if isinstance(record, dict) else None

    def _write(self, key: str, record: dict[str, Any]) -> None:
        """Replace the record atomically (temp file, fsync, rename), 0600."""
        procutil.replace_file(self._records / f"{key}.json", json.dumps(record, sort_keys=True))

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        with self._guard:
            lock = self._thread_locks.setdefault(key, threading.Lock())
        with lock, open(self._locks_dir / f"{key}.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # --- mounting -----------------------------------------------------------------------------

    def _healthy_mount(self, target: Path) -> bool:
        """Whether ``target`` is mounted and answers; a dead FUSE mount (ENOTCONN, EIO) is lazily
        unmounted (False)."""
        if not is_mounted(target):
            return False
        try:
            os.stat(target)
        except OSError as e:
            if e.errno not in (errno.ENOTCONN, errno.EIO, errno.ESTALE, errno.ECONNABORTED):
                raise
            logger.warning("dead mount target=%s (%s): unmounting it lazily to mount again", target, e.strerror)
            _run(["umount", "-l", str(target)], UMOUNT_TIMEOUT_S)
            return False
        return True

    def _mount(self, server: ServerSpec, target: Path) -> None:
        target.mkdir(mode=0o755, exist_ok=True)
        argv = mount_argv(server, target, self.private)
        t0 = time.monotonic()
        try:
            rc, err = _run(argv, self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_leftovers(target)
            if is_mounted(target):
                _run(["umount", "-l", str(target)], UMOUNT_TIMEOUT_S)
            reason = f"`{argv[0]}` did not finish within {self.timeout_s:g} s (server down or silent?)"
            raise MountError(server.name, server.type, reason) from None
        except FileNotFoundError as e:
            raise MountError(server.name, server.type, f"`{argv[0]}` not found: install the client") from e
        if rc != 0 or not is_mounted(target):
            _kill_leftovers(target)
            if is_mounted(target):
                _run(["umount", "-l", str(target)], UMOUNT_TIMEOUT_S)
            said = "\n".join(t.strip() for t in (mount_log(server, self.private), err) if t.strip())
            text = scrub(said, server)[-_STDERR_MAX:] or "(no output)"
            raise MountError(server.name, server.type,
                             f"`{argv[0]}` failed ({'exit ' + str(rc) if rc else 'nothing mounted'}): {text}")
        logger.info("storage mounted server=%s type=%s target=%s seconds=%.2f",
                    server.name, server.type, target, time.monotonic() - t0)

    def _unmount(self, record: dict[str, Any]) -> None:
        """Unmount a record's target (``umount``, then ``umount -l``), then remove its mount
        point, key files and record. Raises MountError when even the lazy unmount fails."""
        target = Path(record["target"])
        key = target.name
        if is_mounted(target):
            try:
                rc, err = _run(["umount", str(target)], UMOUNT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                rc, err = -1, "timed out"
            if rc != 0 and is_mounted(target):
                logger.warning("umount failed target=%s (%s): unmounting lazily", target, err.strip())
                rc, err = _run(["umount", "-l", str(target)], UMOUNT_TIMEOUT_S)
                if rc != 0 and is_mounted(target):
                    raise MountError(record.get("name", key), record.get("type", "?"),
                                     f"umount -l {target} failed: {err.strip()[-_STDERR_MAX:]}")
        with contextlib.suppress(OSError):
            target.rmdir()  # only when empty: never delete what a failed unmount left visible
        shutil.rmtree(self.private / key, ignore_errors=True)
        (self._records / f"{key}.json").unlink(missing_ok=True)
        logger.info("storage unmounted server=%s type=%s target=%s", record.get("name"), record.get("type"), target)


def _run(argv: list[str], timeout_s: float) -> tuple[int, str]:
    """Run ``argv`` in its own process group with stderr to a file (a FUSE daemon that forks off
    may hold a pipe open long after the command ends); returns ``(exit status, stderr)``. Past
    ``timeout_s`` the whole group is killed and TimeoutExpired raised."""
    env = {**os.environ, "LC_ALL": "C"}  # error texts in English, as the messages quote them
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                             start_new_session=True, env=env)
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
        err.seek(0)
        return rc, err.read().decode("utf-8", errors="replace")


def _kill_leftovers(target: Path) -> None:
    """SIGKILL every process with ``target`` as a command-line argument (a FUSE daemon of a mount
    that failed or timed out) and reap what it can, within a few seconds."""
    needle = str(target)
    victims = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info.get("cmdline") or []
        if p.pid != os.getpid() and needle in cmdline:
            with contextlib.suppress(psutil.Error):
                p.kill()
                victims.append(p)
    if victims:
        logger.warning("killed leftovers of a failed mount target=%s pids=%s", target, [p.pid for p in victims])
        psutil.wait_procs(victims, timeout=3)
