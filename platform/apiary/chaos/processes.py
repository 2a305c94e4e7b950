"""Finding the platform's processes by name, for kill -9 and freeze.

Where the pids come from:

* The supervised children of ``apiary up`` (:mod:`apiary.embedded`): the supervisor writes its pid
  to ``APIARY_HOME/run/supervisor.pid``; a child is the supervisor's direct child whose command line
  matches :data:`CHILDREN` (``-m apiary control-plane``, ``-m apiary agent``, ``-m prefect server
  start``, ...). Without that file (a platform not started by ``apiary up``), any process whose
  environment has ``APIARY_HOME=<home>`` and whose command line matches (reading another process's
  environment needs the same user or root).
* PostgreSQL, when the store is on it: the postmaster is the process listening on the port of
  ``APIARY_DATABASE_URL`` (the configuration's ``apiary_database_url``, else the control plane's
  own environment). Apiary does not supervise PostgreSQL (systemd or the operator does), so
  :func:`restart_postmaster` starts it again with its own command line, user and working directory.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from apiary.errors import NotFoundError, PlatformError, ValidationError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChildKind:
    """How to recognise one child. ``tree``: a kill -9 takes its descendants too (the Prefect server
    runs its web server as a child that would keep the port); never for the agent, whose tasks
    must outlive it to be re-adopted."""

    matches: Callable[[list[str]], bool]
    tree: bool = False


def _has(*words: str) -> Callable[[list[str]], bool]:
    def check(argv: list[str]) -> bool:
        n = len(words)
        return any(argv[i:i + n] == list(words) for i in range(len(argv) - n + 1))
    return check


CHILDREN: dict[str, ChildKind] = {
    "control-plane": ChildKind(_has("-m", "apiary", "control-plane")),
    "agent": ChildKind(_has("-m", "apiary", "agent")),
    "prefect-server": ChildKind(_has("-m", "prefect", "server", "start"), tree=True),
    "prefect-bridge": ChildKind(_has("-m", "apiary", "prefect-bridge")),
    "prefect-serve": ChildKind(lambda argv: any(a.endswith("flows/serve.py") for a in argv)),
}
POSTGRES = "postgres"


def supervisor(home: Path) -> psutil.Process | None:
    path = home / "run" / "supervisor.pid"
    try:
        return psutil.Process(int(path.read_text().strip()))
    except (OSError, ValueError, psutil.Error):
        return None


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def find_child(home: Path, name: str) -> psutil.Process:
    """The running process of child ``name`` of the platform in ``home``. Raises ValidationError for
    an unknown name and NotFoundError when no such process runs (a platform without Prefect)."""
    kind = CHILDREN.get(name)
    if kind is None:
        raise ValidationError("name", f"unknown platform process {name!r}; one of {sorted([*CHILDREN, POSTGRES])}")
    sup = supervisor(home)
    if sup is not None:
        try:
            candidates = sup.children()
        except psutil.Error:
            candidates = []
    else:
        candidates = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("APIARY_HOME") and Path(p.environ()["APIARY_HOME"]).resolve() == home:
                    candidates.append(p)
            except (psutil.Error, OSError):
                continue
    found = [p for p in candidates if kind.matches(_cmdline(p)) and _running(p)]
    if not found:
        raise NotFoundError(f"no {name} process of the platform in {home} is running")
    return found[0]


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill9(p: psutil.Process, tree: bool = False) -> list[int]:
    """SIGKILL ``p`` (and its descendants with ``tree``); the pids signalled."""
    targets = [p]
    if tree:
        try:
            targets += p.children(recursive=True)
        except psutil.Error:
            pass
    killed = []
    for t in targets:
        try:
            t.send_signal(signal.SIGKILL)
            killed.append(t.pid)
        except psutil.NoSuchProcess:
            continue
    return killed


def wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        try:
            psutil.Process(pid).wait(max(0.0, deadline - time.monotonic()))
        except psutil.NoSuchProcess:
            continue
        except psutil.TimeoutExpired as e:
            raise PlatformError(f"process {pid} still alive {timeout_s:.0f} s after SIGKILL") from e


# ------------------------------------------------------------------------------ PostgreSQL
@dataclass(frozen=True)
class Postmaster:
    """What is needed to start the postmaster again as it was."""

    pid: int
    argv: list[str]
    cwd: str
    uid: int
    gid: int
    env: dict[str, str]
    log: str | None
    data_dir: str
    port: int


def database_url(home: Path, configured: str | None) -> str:
    if configured:
        return configured
    try:
        cp = find_child(home, "control-plane")
        url = cp.environ().get("APIARY_DATABASE_URL")
    except (psutil.Error, NotFoundError):
        url = None
    if not url or not url.startswith("postgresql"):
        raise NotFoundError("the platform's store is not PostgreSQL (no APIARY_DATABASE_URL=postgresql... in "
                            "the control plane's environment, none configured as apiary_database_url)")
    return url


def find_postmaster(url: str) -> Postmaster:
    from sqlalchemy.engine import make_url

    port = make_url(url).port or 5432
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            p = psutil.Process(conn.pid)
            argv = p.cmdline()
            data_dir = argv[argv.index("-D") + 1] if "-D" in argv else p.cwd()
            try:
                log = os.readlink(f"/proc/{p.pid}/fd/1")
            except OSError:
                log = None
            uids, gids = p.uids(), p.gids()
            return Postmaster(pid=p.pid, argv=argv, cwd=p.cwd(), uid=uids.real, gid=gids.real, env=p.environ(),
                              log=log if log and log.startswith("/") else None, data_dir=data_dir, port=port)
    raise NotFoundError(f"no process listens on port {port} (the PostgreSQL of the platform's store)")


def restart_postmaster(pm: Postmaster, timeout_s: float = 60.0) -> int:
    """Start the postmaster ``pm`` described, once its old backends have exited; its new pid.
    It runs in its own session, as its own user, appending to its old log."""
    deadline = time.monotonic() + timeout_s
    # Backends notice the postmaster's death and exit; a new postmaster refuses to start while one
    # of them still holds the old shared memory.
    while time.monotonic() < deadline:
        left = []
        for p in psutil.process_iter():
            try:
                if p.cwd() == pm.data_dir:
                    left.append(p.pid)
            except psutil.Error:
                continue
        if not left:
            break
        time.sleep(0.2)
    while True:
        log = open(pm.log, "ab") if pm.log else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(pm.argv, cwd=pm.cwd, env=pm.env, user=pm.uid, group=pm.gid,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]
        while time.monotonic() < deadline and proc.poll() is None:
            if _accepts(pm.port):
                return proc.pid
            time.sleep(0.2)
        if proc.poll() is None:
            raise PlatformError(f"PostgreSQL restarted (pid {proc.pid}) but not accepting on {pm.port} after "
                                f"{timeout_s:.0f} s")
        if time.monotonic() >= deadline:
            raise PlatformError(f"PostgreSQL exited with {proc.returncode} on restart; see {pm.log}")
        time.sleep(0.5)  # e.g. the old shared memory was still attached: try again


def _accepts(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0
