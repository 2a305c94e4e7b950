"""Who a process-runtime task runs as: a uid of its own, taken from a fixed range, never root.

Why one uid per running task rather than one shared "apiary-task" user: Linux lets a process
read another's ``/proc/<pid>/environ``, ``ptrace`` it and signal it when both have the same uid,
and files a task leaves with a permissive umask are readable by that uid. With a shared user,
one tenant's task could read the environment (and the secrets in it) of another tenant's task
running at the same time. With a uid per run, a task shares a uid with nothing but itself.

The uids need no ``/etc/passwd`` entry: the wrapper switches with
``setpriv --reuid U --regid U --clear-groups --nnp`` (util-linux), so the task has uid and gid
``U``, no supplementary groups, no capabilities and cannot gain privileges through set-uid
programs (``no_new_privs``). The range is ``APIARY_TASK_UIDS`` (default
``2000000000-2000099999``, above the ranges distributions and ``/etc/subuid`` hand out); it must
be mapped in the agent's user namespace (``/proc/self/uid_map``).

Leases, under ``scratch_root`` (``APIARY_TASK_SCRATCH``, default ``/var/tmp/apiary-tasks``, owned
by root, mode 0711: others may pass through it but not list it)::

    scratch_root/
      .lock          flock-ed while a uid is chosen (agents of several homes share the range)
      <uid>/         the lease: root, 0711; its existence is what reserves the uid
        owner        root, 0600: the run directory that holds the lease
        script.sh    U, 0400: the task's commands (the run directory itself is root's, 0700)
        home/        U, 0700: the task's HOME and TMPDIR, and its cwd when it names no workdir

A lease is taken when a task is launched (``os.mkdir`` of ``<uid>/``, exclusive, so two agents
can never take the same uid) and released once the run has exited: every process still running
as ``U`` (a daemon the task left behind, outside its process group) is SIGKILLed, then the lease
and the home are deleted. Put results a job must keep in its workdir or shared storage. A run's
normal end releases in the background (:class:`_Drainer`): the releases of ~0.2 s share one
``/proc`` scan, which at 20 tasks a second was a scan of every process per task, each read
handing the GIL to the agent's other threads; the lease, kept until then, keeps the uid from
being leased again meanwhile. A lease an agent left behind (it ended before it read its run's
exit) is reclaimed by a later acquire's sweep, 30 s after the run recorded its exit; an acquire
sweeps at most once a second per process, and at once when it finds no uid free.

What this does not isolate: tasks share the kernel, the network and the host's filesystem
(whatever is world-readable or world-writable is so for them), have no cgroup limits on CPU,
memory or GPUs (GPUs are assigned through ``CUDA_VISIBLE_DEVICES`` only), and a file a task
writes outside its home (``/tmp``, ``/dev/shm``) outlives it, owned by a uid that a later run may
get again (the range is walked in order, so only after every other uid in it was used).

So that a task's ``python3`` is the agent's (module :mod:`apiary.runtime.process`), the
directories above the agent's interpreter, environment and import path get search permission
for others where they lack it (:func:`grant_search`: ``/root`` 0700 becomes 0711 when Python
lives under ``/root/.pyenv``); nothing becomes listable, but a world-readable file below such a
directory becomes readable by anyone who knows its name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from apiary.errors import PlatformError
from apiary.runtime.records import open_private, read_slot, write_atomic

_LEASE_MODE = 0o711
_KILL_WAIT_S = 2.0
_SWEEP = 16  # leases looked at per sweep (stale ones are reclaimed)
#: How often one process sweeps a scratch root for stale leases (seconds); an acquire that finds
#: no free uid sweeps at once.
_SWEEP_EVERY_S = 1.0
#: How long after its run recorded its exit a lease is left to its own agent's release (seconds).
#: That agent releases it once it has read the exit, usually within a second; a lease still there
#: this long after is one an agent that ended left behind. Reclaiming it sooner cost a ``/proc``
#: scan of every process per lease (the sweep raced every live agent's release at 50 tasks/s).
_EXITED_GRACE_S = 30.0
# One lock for every pool in this process (agents of several nodes share one process); the
# flock on scratch_root/.lock covers agents in other processes.
_ALLOC_LOCK = threading.Lock()
_swept_at: dict[Path, float] = {}  # scratch root -> when this process last swept it (under _ALLOC_LOCK)


def _mapped(lo: int, hi: int, uid_map: str | None = None) -> bool:
    """True if every uid in ``lo..hi`` is mapped in this process's user namespace."""
    if uid_map is None:
        try:
            uid_map = Path("/proc/self/uid_map").read_text()
        except OSError:
            return True  # no user namespaces here: every uid is valid
    for line in uid_map.splitlines():
        parts = line.split()
        if len(parts) == 3:
            inside, _outside, count = (int(p) for p in parts)
            if inside <= lo and hi < inside + count:
                return True
    return False


def _proc_uids() -> list[tuple[int, tuple[int, int, int], bool]]:
    """Every process on the machine as ``(pid, (real, effective, saved uid), zombie)``, read from
    ``/proc/<pid>/status`` directly: psutil's ``process_iter(["uids"])`` gave the same at several
    times the CPU (a Process object and its caches per pid), and a lease is taken and released
    for every task launched. Processes that end while they are read are skipped."""
    out: list[tuple[int, tuple[int, int, int], bool]] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        parsed = _status_uids(int(name))
        if parsed is not None:
            out.append((int(name), *parsed))
    return out


def _status_uids(pid: int) -> tuple[tuple[int, int, int], bool] | None:
    """``((real, effective, saved uid), zombie)`` of ``pid``, or None if it is gone."""
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 2048)  # Name, Umask, State ... Uid come first (proc(5))
    except OSError:
        return None
    finally:
        os.close(fd)
    state = data.find(b"\nState:\t")
    uid = data.find(b"\nUid:\t")
    if uid < 0:
        return None
    fields = data[uid + 6:data.find(b"\n", uid + 6)].split()
    try:
        uids = (int(fields[0]), int(fields[1]), int(fields[2]))
    except (IndexError, ValueError):
        return None
    return uids, state >= 0 and data[state + 8:state + 9] == b"Z"


_IN_USE_TTL_S = 1.0
_in_use: tuple[float, set[int]] = (float("-inf"), set())


def _uids_in_use() -> set[int]:
    """The uids some process runs as, read at most once a second (under ``_ALLOC_LOCK``). A
    second-old answer is enough: a uid of the range gets a process only through a lease, which
    this check does not replace; it is the guard against a process a lease did not account for
    (one that outlived a lost lease directory), and such a process does not appear by itself."""
    global _in_use
    now = time.monotonic()
    if now - _in_use[0] > _IN_USE_TTL_S:
        used: set[int] = set()
        for _pid, uids, _zombie in _proc_uids():
            used.update(uids)
        _in_use = (now, used)
    return _in_use[1]


def _kill_if_uid(pid: int, uid: int) -> None:
    """SIGKILL ``pid`` if it still runs as ``uid``. Through a pidfd opened before the check, so a
    pid that was reused by another process between the scan and the signal is never hit: the
    check reads the process the pidfd holds, or the signal finds it gone."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfds here (an old kernel, a seccomp filter): check, then signal by pid
        now = _status_uids(pid)
        if now is not None and uid in now[0] and not now[1]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return
    try:
        now = _status_uids(pid)
        if now is not None and uid in now[0] and not now[1]:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def kill_uid(uid: int, timeout_s: float = _KILL_WAIT_S) -> bool:
    """SIGKILL every process whose real, effective or saved uid is ``uid`` (repeatedly, so a
    process forking in a loop is caught too) until none is left; False if some were still
    there after ``timeout_s``. Zombies do not count: they run nothing, cannot be killed and go
    when their parent (often init, which may reap slowly in a container) reaps them. Never
    called with uid 0."""
    return not kill_uids({uid}, timeout_s)


def kill_uids(targets: set[int], timeout_s: float = _KILL_WAIT_S) -> set[int]:
    """:func:`kill_uid` for every uid of ``targets`` at once, one ``/proc`` scan a round;
    returns the uids some process still ran as after ``timeout_s`` (empty: all gone). Raises
    ValueError for uid 0 or below."""
    if any(uid <= 0 for uid in targets):
        raise ValueError("refusing to kill the processes of uid 0")
    deadline = time.monotonic() + timeout_s
    while True:
        left: set[int] = set()
        for pid, uids, zombie in _proc_uids():
            hit = targets.intersection(uids)
            if hit and not zombie:
                uid = min(hit)
                left.add(uid)
                _kill_if_uid(pid, uid)
        if not left:
            return left
        if time.monotonic() > deadline:
            return left
        time.sleep(0.02)


class _Drainer:
    """Releases leases in the background, ``delay_s`` of releases at a time: one :func:`kill_uids`
    for all of them, then their lease directories (and homes) are deleted. A lease waiting here
    still exists, so its uid is not leased again; :meth:`UidPool.acquire` neither reclaims it
    meanwhile (that would scan ``/proc`` for it alone). One per process, started on first use."""

    def __init__(self, delay_s: float = 0.2) -> None:
        self.delay_s = delay_s
        self._cond = threading.Condition()
        self._pending: dict[Path, tuple[int, str]] = {}  # lease -> (uid, owner it was released by)
        self._busy: dict[Path, tuple[int, str]] = {}  # being drained now
        self._thread: threading.Thread | None = None

    def put(self, uid: int, lease: Path, owner: str) -> None:
        with self._cond:
            self._pending[lease] = (uid, owner)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="apiary-uid-drain", daemon=True)
                self._thread.start()
            self._cond.notify()

    def waiting(self, lease: Path) -> bool:
        """True while ``lease`` is queued or being drained."""
        with self._cond:
            return lease in self._pending or lease in self._busy

    def flush(self) -> None:
        """Drain everything queued now, in the calling thread."""
        with self._cond:
            batch, self._pending = self._pending, {}
            self._busy.update(batch)
        self._drain(batch)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
            time.sleep(self.delay_s)  # let the releases of the next moments join this scan
            self.flush()

    def _drain(self, batch: dict[Path, tuple[int, str]]) -> None:
        try:
            # An agent in another process may have reclaimed a queued lease (its run had recorded
            # its exit) and leased the uid again: that one is not ours to kill or delete any more.
            ours = {lease: uid for lease, (uid, owner) in batch.items() if UidPool._owner(lease) == owner}
            if ours:
                kill_uids(set(ours.values()))
                for lease in ours:
                    shutil.rmtree(lease, ignore_errors=True)
        finally:
            with self._cond:
                for lease in batch:
                    self._busy.pop(lease, None)


_DRAINER = _Drainer()


def drain_released() -> None:
    """Finish the background releases now (an agent's shutdown, a test)."""
    _DRAINER.flush()


def grant_search(paths: list[Path]) -> list[Path]:
    """Add search permission for others (``o+x``, never read: nothing becomes listable) to
    every directory above and at each of ``paths`` that lacks it, so a task's uid can reach the
    agent's Python (an interpreter under ``/root/.pyenv`` sits below ``/root``, mode 0700).
    Returns the directories changed; missing paths and failures to chmod are skipped."""
    changed: list[Path] = []
    seen: set[Path] = set()
    for path in paths:
        try:
            target = Path(os.path.realpath(path))
        except OSError:
            continue
        if not target.is_dir():
            target = target.parent
        for directory in [*reversed(target.parents), target]:
            if directory in seen:
                continue
            seen.add(directory)
            try:
                st = os.stat(directory)
                if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
                    os.chmod(directory, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
                    changed.append(directory)
            except OSError:
                continue
    return changed


@dataclass(frozen=True)
class TaskIdentity:
    """A held lease: the task runs as ``uid``/``uid`` with ``home`` and the commands in ``script``."""

    uid: int
    lease: Path

    @property
    def gid(self) -> int:
        return self.uid

    @property
    def home(self) -> Path:
        return self.lease / "home"

    @property
    def script(self) -> Path:
        return self.lease / "script.sh"

    def drop_argv(self, setpriv: str) -> list[str]:
        """The command prefix that runs the rest of a command line as this identity."""
        return [setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--nnp",
                "--inh-caps=-all", "--"]


class UidPool:
    """Hands out task uids from ``first..last`` as leases under ``scratch_root`` (module doc).

    Thread-safe and safe across processes. Only root can use it (it chowns and kills).
    """

    def __init__(self, scratch_root: Path, first: int, last: int) -> None:
        self.root = Path(scratch_root).absolute()
        self.first, self.last = first, last

    # -- the scratch root --------------------------------------------------------------------

    def _ensure_root(self) -> None:
        """Create ``scratch_root`` (root, 0711) and refuse one that someone else could control."""
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.root.mkdir(mode=_LEASE_MODE)
            except FileExistsError:
                pass
            st = os.lstat(self.root)
        except OSError as exc:
            raise PlatformError(f"cannot create the task scratch directory {self.root}: {exc}") from exc
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
            raise PlatformError(
                f"task scratch directory {self.root} must be a directory owned by root (not a link); "
                "remove it or set APIARY_TASK_SCRATCH"
            )
        if stat.S_IMODE(st.st_mode) != _LEASE_MODE:
            os.chmod(self.root, _LEASE_MODE)

    # -- acquire / release -------------------------------------------------------------------

    def acquire(self, owner: Path) -> TaskIdentity:
        """Lease a free uid for the run whose directory is ``owner``; make its home and script
        slot. Raises :class:`PlatformError` when the range is not mapped in this user
        namespace, every uid is leased or running something, or the lease cannot be written."""
        if not _mapped(self.first, self.last):
            raise PlatformError(
                f"task uids {self.first}-{self.last} are not mapped in this user namespace "
                "(/proc/self/uid_map); set APIARY_TASK_UIDS to a mapped range"
            )
        self._ensure_root()
        with _ALLOC_LOCK, open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            now = time.monotonic()
            if now - _swept_at.get(self.root, float("-inf")) >= _SWEEP_EVERY_S:
                self._sweep()
                _swept_at[self.root] = now
            ident = self._lease_free(owner, _EXITED_GRACE_S)
            if ident is None:
                # Every uid taken: reclaim the leases of every run that recorded its exit, without
                # waiting for their agents, then look again.
                self._sweep(most=self.last - self.first + 1, grace_s=0.0)
                _swept_at[self.root] = now
                ident = self._lease_free(owner, 0.0)
            if ident is not None:
                return ident
        raise PlatformError(f"no free task uid in {self.first}-{self.last}: every one runs a task")

    def _lease_free(self, owner: Path, grace_s: float) -> TaskIdentity | None:
        """Lease the first free uid from the hint on (both locks held), reclaiming stale leases on
        the way (``grace_s``: :meth:`_stale`); None if there is none."""
        count = self.last - self.first + 1
        start = self._next_hint()
        in_use = _uids_in_use()
        for i in range(count):
            uid = self.first + (start - self.first + i) % count
            lease = self.root / str(uid)
            if _DRAINER.waiting(lease) or (lease.exists() and not self._reclaim_stale(uid, grace_s)):
                continue
            if uid in in_use:
                continue
            try:
                lease.mkdir(mode=_LEASE_MODE)
            except FileExistsError:
                continue
            except OSError as exc:
                raise PlatformError(f"cannot lease task uid {uid} in {self.root}: {exc}") from exc
            ident = TaskIdentity(uid=uid, lease=lease)
            try:
                os.chmod(lease, _LEASE_MODE)
                write_atomic(lease / "owner", f"{owner}\n", durable=False)
                ident.home.mkdir(mode=0o700)
                os.chown(ident.home, uid, uid)
                os.chmod(ident.home, 0o700)
                self._write_hint(uid + 1 if uid < self.last else self.first)
            except OSError as exc:
                shutil.rmtree(lease, ignore_errors=True)
                raise PlatformError(f"cannot lease task uid {uid} in {self.root}: {exc}") from exc
            return ident
        return None

    def write_script(self, ident: TaskIdentity, text: str) -> None:
        """Write the task's commands where only its uid can read them (mode 0400). Raises OSError."""
        fd = os.open(ident.script, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
        try:
            os.fchmod(fd, 0o400)
            os.fchown(fd, ident.uid, ident.gid)
            with open(fd, "w", encoding="utf-8", closefd=False) as f:
                f.write(text)
        finally:
            os.close(fd)

    def release(self, uid: int, owner: Path, wait: bool = True) -> bool:
        """End ``owner``'s lease of ``uid``: SIGKILL what still runs as ``uid``, delete the lease
        and the home; with ``wait=False`` in the background, within ~0.2 s (:class:`_Drainer`).
        False (nothing done) if the lease is not ``owner``'s (released already, or leased again
        to another run)."""
        lease = self.root / str(uid)
        if not (self.first <= uid <= self.last) or self._owner(lease) != str(owner):
            return False
        if not wait:
            _DRAINER.put(uid, lease, str(owner))
            return True
        kill_uid(uid)
        shutil.rmtree(lease, ignore_errors=True)
        return True

    def release_owned_by(self, owner: Path) -> None:
        """Release every lease ``owner`` holds (a launch that died before recording its uid)."""
        try:
            leases = [p for p in self.root.iterdir() if p.name.isdigit()]
        except OSError:
            return
        for lease in leases:
            if self._owner(lease) == str(owner):
                self.release(int(lease.name), owner)

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _owner(lease: Path) -> str | None:
        try:
            return (lease / "owner").read_text(encoding="utf-8").strip()
        except OSError:
            return None

    def _stale(self, uid: int, grace_s: float) -> bool:
        """Whether the lease of ``uid`` is left behind: its run directory is gone, or its run
        recorded its exit more than ``grace_s`` seconds ago (its agent never came back to release
        it), or it names no owner a minute after it was made."""
        lease = self.root / str(uid)
        owner = self._owner(lease)
        if owner is None:
            try:  # a lease being written right now by another process is younger than a minute
                return time.time() - lease.stat().st_mtime >= 60
            except OSError:
                return not lease.exists()
        run_dir = Path(owner)
        if not run_dir.is_dir():
            return True
        try:
            exited = (run_dir / "exit_code").stat().st_mtime
        except OSError:
            return False  # still running
        return read_slot(run_dir / "exit_code") is not None and time.time() - exited >= grace_s

    def _reclaim_stale(self, uid: int, grace_s: float) -> bool:
        """Delete the lease of ``uid`` if it is stale (:meth:`_stale`), killing what still runs
        as ``uid``; True if the uid is free now."""
        if not self._stale(uid, grace_s):
            return False
        lease = self.root / str(uid)
        kill_uid(uid)
        shutil.rmtree(lease, ignore_errors=True)
        return not lease.exists()

    def _sweep(self, most: int = _SWEEP, grace_s: float = _EXITED_GRACE_S) -> None:
        """Reclaim the stale ones (:meth:`_stale`) of up to ``most`` leases, with one
        :func:`kill_uids` for all of them: runs whose agent ended before it read their exit, or
        whose records were deleted, would otherwise keep theirs."""
        try:
            leases = [int(p.name) for p in self.root.iterdir() if p.name.isdigit()]
        except OSError:
            return
        random.shuffle(leases)  # live leases first in the listing must not hide stale ones forever
        stale = {uid for uid in leases[:most]
                 if self.first <= uid <= self.last and not _DRAINER.waiting(self.root / str(uid))
                 and self._stale(uid, grace_s)}
        if stale:
            kill_uids(stale)
            for uid in stale:
                shutil.rmtree(self.root / str(uid), ignore_errors=True)

    def _next_hint(self) -> int:
        try:
            value = int((self.root / ".next").read_text().strip())
        except (OSError, ValueError):
            return self.first
        return value if self.first <= value <= self.last else self.first

    def _write_hint(self, uid: int) -> None:
        """Overwrite ``.next`` in place (the flock serialises its readers and writers), at a fixed
        width so no stale digits remain: not a new file and a rename per lease, whose replaced
        inode on an ext4 without a journal is one more recently deleted inode that every later
        file creation in its block group steps over for a minute (``recently_deleted()``)."""
        try:
            fd = open_private(self.root / ".next", os.O_WRONLY)
        except OSError:
            return  # only a hint: the walk starts at the range's first uid instead
        try:
            os.pwrite(fd, f"{uid:>20}\n".encode(), 0)
        except OSError:
            pass
        finally:
            os.close(fd)
