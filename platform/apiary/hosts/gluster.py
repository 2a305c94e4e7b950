"""GlusterFS servers for tests: Debian's glusterd, private to a test, on loopback or on hosts.

:class:`Glusterd` runs one ``glusterd`` (never the system service) with everything of its own
under its state directory: a ``glusterd.vol`` naming its working directory (``wd/``: peers,
volumes, its UUID), its run directory (``run/``: pid files) and its CLI socket
(``run/glusterd.socket``), which every ``gluster`` command here is given
(``--glusterd-sock``). :func:`create_volume` joins one or more of them into a trusted pool
(``peer probe``), creates a volume with one brick each (``<state>/bricks/<volume>``, ``replica N``
when asked) and starts it; :meth:`GlusterVolume.server_data` is the volume as an OpenPAI
``glusterfs`` storage server's ``data``.

Two placements (GlusterFS docs, "Setting up GlusterFS Server Volumes"):

- **loopback** (``hosts=None``): one glusterd in the machine's own network namespace on port
  24007, its brick named by the machine's host name: GlusterFS refuses ``localhost`` and
  ``127.0.0.1`` in a brick (the name may still resolve to a loopback address, as Debian's
  ``/etc/hosts`` makes it). Only one such glusterd can run on a machine (the port is fixed: clients
  fetch the volume file from 24007); a system glusterd holding it is reported, not stopped.
- **on hosts** (``hosts``, ``host``): one glusterd per network-namespace host of
  :mod:`apiary.hosts.netns`, each on 24007 in its own namespace. Peers and bricks are named by the
  hosts' addresses, not their names: the client mounting the volume runs in the root namespace
  (the operator's laptop), where the hosts' names do not resolve, and it connects to every brick
  named in the volume file. Two glusterds in two hosts form one pool, and a ``replica 2`` volume
  on them works (the tests mount it and find a file on both bricks).

Two details of glusterd found here: its ``glusterd.vol`` must keep the
``transport.socket.keepalive-*`` options (without them glusterd 10 fails every ``peer probe``:
``glusterd_transport_inet_options_build`` returns the failed lookup's -2 and the CLI then waits
forever); and brick processes (``glusterfsd``) and the self-heal daemon detach from glusterd, so
stopping glusterd does not stop them: :meth:`Glusterd.stop` kills every process whose command line
names the state directory. Their logs stay in ``/var/log/glusterfs`` (not configurable per daemon).

Every glusterd is registered in :data:`REGISTRY` (``/run/apiary-gluster/<id>.json``: owner pid
and start time, state directory) from before it starts until it is stopped, so
:func:`cleanup_stale` (called by :meth:`Glusterd.start`) stops what a crashed run left: the
processes naming its state directory and the GlusterFS mounts under it.

Needs root and the Debian packages glusterfs-server and glusterfs-client; raises
:class:`GlusterNotFound` without them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from apiary.hosts.netns import Hosts, HostsError
from apiary.procutil import port_in_use

__all__ = [
    "GLUSTERD_PORT",
    "REGISTRY",
    "GlusterError",
    "GlusterNotFound",
    "GlusterVolume",
    "Glusterd",
    "cleanup_stale",
    "create_volume",
    "gluster_available",
    "volume_on_loopback",
]

logger = logging.getLogger(__name__)

#: Where running glusterds are registered (tmpfs: gone after a reboot, as they are).
REGISTRY = Path("/run/apiary-gluster")
#: glusterd's management port; clients fetch volume files from it.
GLUSTERD_PORT = 24007
START_TIMEOUT_S = 30.0
CLI_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


class GlusterError(HostsError):
    """A glusterd or volume could not be started, used or stopped; the message names the command."""


class GlusterNotFound(GlusterError):
    """glusterd, the gluster CLI or the GlusterFS client (mount.glusterfs) is not installed."""


def gluster_available() -> str | None:
    """``None`` when this process can run GlusterFS servers and mount them, else why not."""
    if os.geteuid() != 0:
        return "GlusterFS servers and mounts need root"
    for tool, package in (("glusterd", "glusterfs-server"), ("gluster", "glusterfs-server"),
                          ("mount.glusterfs", "glusterfs-client")):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/sbin:/usr/sbin") is None:
            return f"`{tool}` not found (Debian: apt-get install {package})"
    return None


def _proc_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _kill_naming(state_dir: Path, grace_s: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM every process with an argument under ``state_dir`` (glusterd, bricks, self-heal
    daemon, FUSE clients), SIGKILL what is left after ``grace_s``; returns the pids signalled."""
    prefix = str(state_dir).rstrip("/") + "/"
    victims = []
    for p in psutil.process_iter(["cmdline"]):
        args = p.info.get("cmdline") or []
        if p.pid != os.getpid() and any(a.startswith(prefix) or f"={prefix}" in a for a in args):
            victims.append(p)
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(victims, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in victims]


def _unmount_under(state_dir: Path) -> None:
    """Lazily unmount every mount point under ``state_dir`` (deepest first)."""
    prefix = os.path.realpath(state_dir).rstrip("/") + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")[0].split()
        if len(fields) >= 5 and fields[4].startswith(prefix):
            points.append(fields[4])
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30, check=False)


def cleanup_stale() -> list[str]:
    """Stop what glusterds whose owner died left behind (registry entries whose owner process is
    gone): their processes and the mounts under their state directories. Returns the state
    directories cleaned. Idempotent."""
    cleaned: list[str] = []
    if not REGISTRY.is_dir():
        return cleaned
    for entry in sorted(REGISTRY.glob("*.json")):
        try:
            record = json.loads(entry.read_text())
        except FileNotFoundError:
            continue
        except ValueError:
            record = {}
        pid, start = record.get("pid"), record.get("start_time")
        if isinstance(pid, int) and start is not None and _proc_start_time(pid) == start:
            continue  # its owner is alive
        state = record.get("state_dir")
        if state:
            logger.info("removing a stale glusterd state_dir=%s", state)
            _unmount_under(Path(state))
            _kill_naming(Path(state))
            cleaned.append(state)
        entry.unlink(missing_ok=True)
    return cleaned


def _volfile(state: Path) -> str:
    # The keepalive options are load-bearing (module doc); ping-timeout 0 and one event thread are
    # Debian's defaults for glusterd.
    return "\n".join([
        "volume management",
        "    type mgmt/glusterd",
        f"    option working-directory {state}/wd",
        f"    option run-directory {state}/run",
        f"    option glusterd-sockfile {state}/run/glusterd.socket",
        "    option transport-type socket",
        f"    option transport.socket.listen-port {GLUSTERD_PORT}",
        "    option transport.socket.keepalive-time 10",
        "    option transport.socket.keepalive-interval 2",
        "    option transport.tcp-user-timeout 30",
        "    option ping-timeout 0",
        "    option event-threads 1",
        "    option max-port 60999",
        "end-volume",
        "",
    ])


class Glusterd:
    """One private glusterd (module doc). ``state_dir`` holds its files (created); ``hosts`` and
    ``host`` place it inside a host of a :class:`~apiary.hosts.netns.Hosts` harness (give both),
    else it runs on this machine's loopback. Use as a context manager or call :meth:`start` and
    :meth:`stop`."""

    def __init__(self, state_dir: Path | str, *, hosts: Hosts | None = None, host: str | None = None) -> None:
        if (hosts is None) != (host is None):
            raise GlusterError("host: give both hosts and host, or neither (loopback)")
        self.state_dir = Path(os.path.realpath(state_dir))
        self.hosts = hosts
        self.host = host
        self._process: subprocess.Popen[bytes] | None = None
        self._registered: Path | None = None

    @property
    def address(self) -> str:
        """The address peers, bricks and clients name this server by: the host's IPv4 address,
        or on loopback this machine's host name (GlusterFS refuses 127.0.0.1 in a brick)."""
        if self.hosts is not None and self.host is not None:
            return self.hosts.address(self.host)
        return socket.gethostname()

    @property
    def socket_path(self) -> Path:
        """The CLI socket (``gluster --glusterd-sock``)."""
        return self.state_dir / "run" / "glusterd.socket"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Glusterd:
        """Start glusterd and wait (at most ``timeout_s``) until its CLI answers. Raises
        :class:`GlusterNotFound`, or :class:`GlusterError` when port 24007 is taken (loopback) or
        it does not come up (the message quotes its log)."""
        why = gluster_available()
        if why is not None:
            raise GlusterNotFound(why)
        cleanup_stale()
        if self.hosts is None:
            name = self.address
            try:
                socket.getaddrinfo(name, GLUSTERD_PORT)
            except OSError as e:
                raise GlusterError(f"this machine's host name {name!r} does not resolve ({e}): bricks need it") from e
            if port_in_use(GLUSTERD_PORT, "0.0.0.0"):
                raise GlusterError(f"port {GLUSTERD_PORT} is taken (a system glusterd? `systemctl stop glusterd`)")
        for sub in ("wd", "run", "bricks"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        (self.state_dir / "glusterd.vol").write_text(_volfile(self.state_dir))
        self._register()
        s = self.state_dir
        argv = ["glusterd", "-N", "-f", str(s / "glusterd.vol"), "-p", str(s / "glusterd.pid"),
                "-l", str(s / "glusterd.log")]
        if self.hosts is not None and self.host is not None:
            self._process = self.hosts.run(self.host, argv)
        else:
            self._process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                self.stop()
                raise GlusterError(f"glusterd exited ({self._process.returncode}): {self._log_tail()}")
            if self.socket_path.exists() and self._cli_rc("pool", "list") == 0:
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise GlusterError(f"glusterd did not answer within {timeout_s:g} s: {self._log_tail()}")
            time.sleep(0.1)

    def cli(self, *args: str, timeout_s: float = CLI_TIMEOUT_S, check: bool = True) -> str:
        """Run ``gluster --mode=script ARGS`` against this glusterd (inside its host, if any) and
        return its stdout. Raises :class:`GlusterError` when it fails (``check``) or passes
        ``timeout_s``."""
        argv = ["gluster", f"--glusterd-sock={self.socket_path}", "--mode=script", *args]
        try:
            if self.hosts is not None and self.host is not None:
                r = self.hosts.exec(self.host, argv, timeout=timeout_s)
            else:
                r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        except (subprocess.TimeoutExpired, HostsError) as e:
            raise GlusterError(f"`gluster {' '.join(args)}` took over {timeout_s:g} s") from e
        if check and r.returncode != 0:
            raise GlusterError(f"`gluster {' '.join(args)}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
        return r.stdout

    def _cli_rc(self, *args: str) -> int:
        try:
            self.cli(*args, timeout_s=10)
        except GlusterError:
            return 1
        return 0

    def stop(self) -> None:
        """Stop glusterd, its bricks and self-heal daemon (every process naming the state
        directory) and unregister. Volumes stay defined in its working directory; stop them first
        (:meth:`GlusterVolume.delete`) for a clean shutdown. Idempotent."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(timeout=10)
        if self.hosts is not None and self._process is not None:
            with contextlib.suppress(HostsError, subprocess.TimeoutExpired):
                self.hosts.stop(self._process, grace_s=0.1)
        _kill_naming(self.state_dir)
        if self._registered is not None:
            self._registered.unlink(missing_ok=True)
            self._registered = None

    def _register(self) -> None:
        REGISTRY.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = REGISTRY / f"{uuid.uuid4().hex}.json"
        path.write_text(json.dumps({"pid": os.getpid(), "start_time": _proc_start_time(os.getpid()),
                                    "state_dir": str(self.state_dir)}))
        self._registered = path

    def _log_tail(self) -> str:
        try:
            return (self.state_dir / "glusterd.log").read_text(errors="replace")[-1500:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> Glusterd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class GlusterVolume:
    """A started volume on one or more :class:`Glusterd`; ``bricks`` are ``address:/path``."""

    name: str
    servers: list[Glusterd]
    bricks: list[str] = field(default_factory=list)

    def brick_dirs(self) -> list[Path]:
        """The bricks' directories on this machine (every host shares its file system)."""
        return [Path(b.split(":", 1)[1]) for b in self.bricks]

    def server_data(self) -> dict[str, Any]:
        """The volume as an OpenPAI ``glusterfs`` storage server's ``data``: the first server's
        address, the volume, the others as ``backupAddresses``."""
        data: dict[str, Any] = {"address": self.servers[0].address, "volume": self.name}
        if len(self.servers) > 1:
            data["backupAddresses"] = [s.address for s in self.servers[1:]]
        return data

    def delete(self) -> None:
        """Stop and delete the volume (its brick directories stay). Errors are logged, not raised:
        this runs at teardown, where the servers may be gone already."""
        for args in (("volume", "stop", self.name, "force"), ("volume", "delete", self.name)):
            try:
                self.servers[0].cli(*args)
            except GlusterError as e:
                logger.warning("gluster teardown: %s", e)


def create_volume(servers: Sequence[Glusterd], name: str, *, replica: int | None = None,
                  timeout_s: float = START_TIMEOUT_S) -> GlusterVolume:
    """Join ``servers`` (started) into one pool from the first (``peer probe``), create volume
    ``name`` with one brick per server (``<state>/bricks/<name>``, ``force``: bricks on the root
    file system) and start it; waits (at most ``timeout_s`` per step) until every peer is connected
    and every brick online. ``replica``: ``replica N`` (N = the number of servers for a mirror).
    Raises :class:`GlusterError`."""
    if not servers:
        raise GlusterError("servers: give at least one glusterd")
    first = servers[0]
    for other in servers[1:]:
        first.cli("peer", "probe", other.address)
    _wait(lambda: first.cli("pool", "list").count("\tConnected") >= len(servers), timeout_s,
          f"peers of {first.address} not all connected")
    bricks = []
    for s in servers:
        brick = s.state_dir / "bricks" / name
        brick.mkdir(parents=True, exist_ok=True)
        bricks.append(f"{s.address}:{brick}")
    extra = ["replica", str(replica)] if replica else []
    first.cli("volume", "create", name, *extra, *bricks, "force")
    volume = GlusterVolume(name, list(servers), bricks)
    try:
        first.cli("volume", "start", name)
        _wait(lambda: _bricks_online(first, name) >= len(bricks), timeout_s, f"bricks of volume {name} not online")
    except BaseException:
        volume.delete()
        raise
    return volume


def _bricks_online(server: Glusterd, volume: str) -> int:
    """How many bricks of ``volume`` ``volume status`` lists as online."""
    text = server.cli("volume", "status", volume, "detail", check=False)
    # "Online               : Y", one per brick
    rows = [line.split(":", 1) for line in text.splitlines() if ":" in line]
    return sum(1 for key, value in rows if key.strip() == "Online" and value.strip() == "Y")


def _wait(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise GlusterError(f"{what} within {timeout_s:g} s")
        time.sleep(0.2)


@contextlib.contextmanager
def volume_on_loopback(state_dir: Path | str, name: str = "apiary") -> Iterator[GlusterVolume]:
    """``with volume_on_loopback(dir) as vol:`` a glusterd on this machine with one started
    volume, both gone at exit (also on an exception)."""
    with Glusterd(state_dir) as g:
        volume = create_volume([g], name)
        try:
            yield volume
        finally:
            volume.delete()
