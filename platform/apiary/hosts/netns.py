"""Hosts as Linux network namespaces on one bridge: many machines on one, for tests and drills.

A harness (:class:`Hosts`) makes N hosts. Each host is a network namespace ``apy<k>-<name>``
joined to the harness's bridge ``apy<k>-br`` by a veth pair (``apy<k>-v<i>`` on the bridge,
``eth0`` inside), with

- the address ``198.18.<k>.<i>/24`` (RFC 2544's benchmarking range 198.18.0.0/15: never routed on
  the internet, so nothing outside can be reached by mistake). ``k`` (1..254) is the harness's
  index, claimed atomically, so two harnesses at once never share a subnet; ``i`` (1..253) is the
  host's position in ``names``. ``198.18.255.0/24`` is never given out: a harness's hosts cannot
  reach it, nor any other address off their /24;
- loopback up inside (its own ``127.0.0.1``: a server on the machine's loopback is not reachable
  from a host), and **no default route**: a host reaches the other hosts of its harness and
  ``198.18.<k>.254``, nothing else. No forwarding or NAT is set up;
- name resolution by host name: ``/etc/netns/<namespace>/hosts`` lists every host of the harness
  (and ``operator``), and ``ip netns exec`` bind-mounts it over ``/etc/hosts`` (ip-netns(8)), so a
  component reaches another as ``db`` or ``cp1``, the names its certificates carry;
- its own state directory ``<root>/<name>`` (mode 0711: traversable, not listable, so a server
  running as another OS user, e.g. PostgreSQL's ``postgres``, can own a directory inside it).

``198.18.<k>.254`` is the root namespace's address on the bridge: the process that made the
harness (a test, a chaos experiment, ``apiary hosts``) is the **operator's laptop**, reaching
every host by address. Hosts resolve it as ``operator``; the machine's ``/etc/hosts`` is not
changed, so from the root namespace use :meth:`Hosts.address`. What the root namespace serves on
``0.0.0.0`` is reachable from the hosts at that address, as a laptop's would be.

Processes run inside a host with :meth:`Hosts.run` (``ip netns exec``); the hostname, the mount
table and the file system stay the machine's (only the network is per host), so components must
be given their host name explicitly and must not share files: a file a host needs is copied into
its state directory (certificates, credentials).

Teardown (:meth:`Hosts.down`, the context manager's exit, or a finalizer at interpreter exit)
stops the processes it started (SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`) and every other
process left in the namespaces (``ip netns pids``), then deletes the namespaces, veths, bridge and
``/etc/netns`` entries; it is idempotent. State directories are kept (logs for a post-mortem).
A harness whose owner died (SIGKILL, a crash) is removed by :func:`cleanup_stale`, which
:meth:`Hosts.up` also calls first. Every harness is registered in :data:`REGISTRY`
(``/run/apiary-hosts/apy<k>.json``: owner pid and start time, root, hosts), created before any
network object and removed after the last, so the cleanup can tell a live harness from a dead one.

Needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN`` for ``ip netns``) and iproute2; raises
:class:`HostsError` otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from apiary.errors import PlatformError

__all__ = [
    "Host",
    "Hosts",
    "HostsError",
    "NET_PREFIX",
    "OPERATOR",
    "REGISTRY",
    "STATE_FILE",
    "cleanup_stale",
    "hosts",
    "netns_available",
]

logger = logging.getLogger(__name__)

#: Where harnesses are registered (tmpfs, like ``/run/netns``: gone after a reboot, as they are).
REGISTRY = Path("/run/apiary-hosts")
#: Where ``ip netns exec`` finds per-namespace files to bind-mount over ``/etc`` (ip-netns(8)).
ETC_NETNS = Path("/etc/netns")
#: The first two octets of every harness address: 198.18.0.0/15 is RFC 2544's benchmarking range.
NET_PREFIX = "198.18"
#: The last octet of the root namespace's (the operator's) address on a harness's bridge.
OPERATOR_OCTET = 254
#: The name hosts resolve the operator's address by.
OPERATOR = "operator"
#: The file in a harness's root directory that describes it (read by :meth:`Hosts.attach`).
STATE_FILE = "hosts.json"
#: Seconds a process gets between SIGTERM and SIGKILL at teardown.
STOP_GRACE_S = 5.0
#: Harness indexes ``k``: 198.18.<k>.0/24. 0 and 255 are never given out.
_INDEXES = range(1, 255)
_MAX_HOSTS = 253
# A host name is one DNS label (RFC 1123): it goes into /etc/hosts and certificates.
_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_PREFIX = re.compile(r"apy(\d{1,3})-")
_RESERVED = frozenset({OPERATOR, "localhost"})


class HostsError(PlatformError):
    """The harness could not be made, used or removed (not root, iproute2 missing, a command of
    ``ip``/``tc`` failed, an unknown host name). The message names the command or the field."""


@dataclass(frozen=True)
class Host:
    """One host of a harness."""

    name: str  #: its host name (a DNS label), resolvable on every host of the harness
    namespace: str  #: the network namespace, ``apy<k>-<name>``
    address: str  #: ``198.18.<k>.<i>``
    veth: str  #: the bridge side of its veth pair, ``apy<k>-v<i>`` (inside it is ``eth0``)
    state_dir: Path  #: ``<root>/<name>``, mode 0711


def netns_available() -> str | None:
    """``None`` when this process can make hosts (root, ``ip`` and ``tc`` on PATH), else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian: apt-get install iproute2)"
    return None


def _ip(*args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raises :class:`HostsError` with its stderr when ``check`` and it fails."""
    return _cmd(["ip", *args], check=check, timeout=timeout)


def _cmd(argv: list[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as e:
        raise HostsError(f"{argv[0]!r} not found: install iproute2") from e
    except subprocess.TimeoutExpired as e:
        raise HostsError(f"`{' '.join(argv)}` took over {timeout:.0f} s") from e
    if check and r.returncode != 0:
        raise HostsError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def _proc_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (proc(5), stat field 22), or
    None when there is no such process: with the pid it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _owner_alive(record: Mapping[str, Any]) -> bool:
    """Whether the harness ``record`` (a registry entry) still has an owner: its process is
    running (same pid and start time), or, for a detached harness (``apiary hosts up``), its
    state file still names it."""
    if record.get("detached"):
        try:
            state = json.loads((Path(record["root"]) / STATE_FILE).read_text())
        except (OSError, ValueError, KeyError):
            return False
        return bool(state.get("prefix") == record.get("prefix"))
    pid, start = record.get("pid"), record.get("start_time")
    return isinstance(pid, int) and start is not None and _proc_start_time(pid) == start


@contextlib.contextmanager
def _registry_lock() -> Iterator[None]:
    """Serialises claiming an index and removing stale harnesses, across processes."""
    REGISTRY.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(REGISTRY / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _namespace_pids(namespace: str) -> list[int]:
    r = _ip("netns", "pids", namespace, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _kill_namespace_processes(namespaces: Sequence[str], grace_s: float) -> None:
    """SIGTERM every process in ``namespaces``, SIGKILL what is left after ``grace_s``, and wait
    (bounded) until none is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        pids = [p for ns in namespaces for p in _namespace_pids(ns)]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_namespace_pids(ns) for ns in namespaces):
            time.sleep(0.05)
    left = [p for ns in namespaces for p in _namespace_pids(ns)]
    if left:
        logger.warning("processes still in namespaces after SIGKILL pids=%s", left)


def _remove_objects(prefix: str, namespaces: Sequence[str], links: Sequence[str]) -> None:
    """Remove a harness's processes, namespaces, links and ``/etc/netns`` entries; errors of
    objects already gone are ignored."""
    _kill_namespace_processes(namespaces, STOP_GRACE_S)
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    for link in links:  # the veths die with their namespaces' ends; the bridge does not
        _ip("link", "del", link, check=False)
    (REGISTRY / f"{prefix.rstrip('-')}.json").unlink(missing_ok=True)


def _objects_by_prefix() -> dict[str, tuple[set[str], set[str]]]:
    """Every harness object on the machine: prefix -> (namespaces, links), also for harnesses
    whose registry entry is gone."""
    found: dict[str, tuple[set[str], set[str]]] = {}

    def slot(name: str) -> tuple[set[str], set[str]] | None:
        m = _PREFIX.match(name)
        return found.setdefault(m.group(0), (set(), set())) if m else None

    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if (s := slot(name)) is not None:
            s[0].add(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if (s := slot(name)) is not None:
                s[1].add(name)
    if ETC_NETNS.is_dir():
        for d in ETC_NETNS.iterdir():
            if (s := slot(d.name)) is not None:
                s[0].add(d.name)
    if REGISTRY.is_dir():
        for f in REGISTRY.glob("apy*.json"):
            slot(f.stem + "-")
    return found


def cleanup_stale(prefix: str | None = None, *, force: bool = False) -> list[str]:
    """Remove what harnesses whose owner is gone left behind: processes in their namespaces
    (SIGTERM, then SIGKILL), namespaces, veths, bridges, ``/etc/netns`` entries and registry
    entries. Returns the prefixes removed (``["apy3-"]``).

    ``prefix`` (``"apy3-"``) limits it to one harness; ``force=True`` removes that harness even if
    its owner is alive (``apiary hosts cleanup --force``). A harness counts as live while its owner
    process runs (pid and start time match) or, when detached (``apiary hosts up``), while its
    state file names it; objects with no registry entry are always stale (the entry is made
    before the first object and removed after the last). Idempotent.
    """
    if prefix is not None and not _PREFIX.fullmatch(prefix):
        raise HostsError(f"prefix: {prefix!r} is not a harness prefix (apy<k>-)")
    if force and prefix is None:
        raise HostsError("force: give the prefix of the one harness to remove")
    removed = []
    with _registry_lock():
        for pfx, (namespaces, links) in sorted(_objects_by_prefix().items()):
            if prefix is not None and pfx != prefix:
                continue
            entry = REGISTRY / f"{pfx.rstrip('-')}.json"
            try:
                record = json.loads(entry.read_text())
            except FileNotFoundError:
                record = None
            except ValueError:
                record = {}  # torn write of a crashed owner: stale
            if record is not None and not force and _owner_alive(record):
                continue
            logger.info("removing stale harness prefix=%s namespaces=%d links=%d", pfx, len(namespaces), len(links))
            _remove_objects(pfx, sorted(namespaces), sorted(links))
            removed.append(pfx)
    return removed


@dataclass
class _Harness:
    """What teardown needs, apart from the :class:`Hosts` object (its finalizer must not hold it)."""

    prefix: str = ""
    bridge: str = ""
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)
    registered: bool = False

    def teardown(self) -> None:
        procs, self.processes = self.processes, []
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
        if not self.registered:
            return
        self.registered = False
        namespaces = [h.namespace for h in self.hosts.values()]
        links = [h.veth for h in self.hosts.values()] + [self.bridge]
        # No registry lock: a cleanup leaves this harness alone while its owner lives, and the
        # registry entry (which keeps its index claimed) goes last.
        _remove_objects(self.prefix, namespaces, links)
        logger.info("hosts down prefix=%s hosts=%s", self.prefix, ",".join(self.hosts))


def _teardown_in(harness: _Harness, pid: int) -> None:
    """``harness.teardown()`` when run by process ``pid``: a forked child inherits the finalizer
    and must not tear down its parent's hosts when it exits."""
    if os.getpid() == pid:
        harness.teardown()


class Hosts:
    """N hosts as network namespaces on one bridge (see the module docstring for the layout).

    ``Hosts(["db", "cp1", "node1"], root)`` describes them; :meth:`up` (or ``with``) makes them,
    :meth:`down` removes them. ``root`` is the parent of the hosts' state directories (created
    0711 if missing). ``detached=True`` (``apiary hosts up``) makes a harness that outlives this
    process: no finalizer tears it down, and :func:`cleanup_stale` keeps it while ``root``'s
    state file names it. Raises :class:`HostsError` for a bad name (not a DNS label, reserved,
    repeated, over 253 hosts) or when the machine cannot make namespaces.
    """

    def __init__(self, names: Sequence[str], root: Path | str, *, detached: bool = False) -> None:
        names = list(names)
        if not names or len(names) > _MAX_HOSTS:
            raise HostsError(f"names: give 1..{_MAX_HOSTS} host names, got {len(names)}")
        for n in names:
            if not _HOST_NAME.fullmatch(n) or n in _RESERVED:
                raise HostsError(f"names: {n!r} is not a host name (a lower-case DNS label, not {sorted(_RESERVED)})")
        if len(set(names)) != len(names):
            raise HostsError(f"names: repeated host name in {names}")
        self.names = names
        self.root = Path(root).absolute()
        self.detached = detached
        self._h = _Harness()
        self._finalizer: weakref.finalize | None = None

    # --- making and removing -------------------------------------------------------------------

    def up(self) -> Hosts:
        """Make the hosts; returns ``self``. Removes stale harnesses first. On failure, removes
        what it made and raises :class:`HostsError`."""
        if self._h.registered:
            return self
        why = netns_available()
        if why is not None:
            raise HostsError(why)
        cleanup_stale()
        if not self.root.is_dir():
            self.root.mkdir(parents=True)
            os.chmod(self.root, 0o711)  # explicit: the platform's umask (077) would make it 0700
        k = self._claim_index()
        prefix = self._h.prefix
        self._h.bridge = f"{prefix}br"
        self._h.registered = True
        if not self.detached:
            self._finalizer = weakref.finalize(self, _teardown_in, self._h, os.getpid())
        try:
            for i, name in enumerate(self.names, start=1):
                state = self.root / name
                state.mkdir(mode=0o711, exist_ok=True)
                os.chmod(state, 0o711)
                self._h.hosts[name] = Host(name=name, namespace=f"{prefix}{name}", address=f"{NET_PREFIX}.{k}.{i}",
                                           veth=f"{prefix}v{i}", state_dir=state)
            self._write_records()
            bridge = self._h.bridge
            _ip("link", "add", bridge, "type", "bridge")
            _ip("addr", "add", f"{self.operator_address}/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
            hosts_file = self._hosts_file()
            for h in self._h.hosts.values():
                _ip("netns", "add", h.namespace)
                etc = ETC_NETNS / h.namespace
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts_file)
                _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.namespace)
                _ip("link", "set", h.veth, "master", bridge, "up")
                _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.namespace, "link", "set", "lo", "up")
                _ip("-n", h.namespace, "link", "set", "eth0", "up")
        except BaseException:
            self.down()
            raise
        logger.info("hosts up prefix=%s hosts=%s", prefix,
                    " ".join(f"{h.name}={h.address}" for h in self._h.hosts.values()))
        return self

    def down(self) -> None:
        """Stop the processes started here and every process left in the hosts, then remove the
        namespaces, veths, bridge and registry entry (the state directories stay). Idempotent."""
        if self._finalizer is not None:
            self._finalizer()  # runs teardown at most once, and not again at exit
        else:
            self._h.teardown()
        if self.detached:
            (self.root / STATE_FILE).unlink(missing_ok=True)

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    @classmethod
    def attach(cls, root: Path | str) -> Hosts:
        """The harness described by ``root``'s state file (made by another process, e.g.
        ``apiary hosts up``), to run commands in or bring down. Raises :class:`HostsError` when
        ``root`` holds no harness. Processes started through it are not stopped when this
        object goes away; :meth:`down` stops every process in the hosts."""
        path = Path(root).absolute() / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise HostsError(f"root: no harness recorded in {path} ({e})") from e
        self = cls(list(state["hosts"]), root, detached=bool(state.get("detached")))
        self._h.prefix = state["prefix"]
        self._h.bridge = f"{state['prefix']}br"
        self._h.hosts = {n: Host(name=n, namespace=h["namespace"], address=h["address"], veth=h["veth"],
                                 state_dir=Path(h["state_dir"])) for n, h in state["hosts"].items()}
        self._h.registered = True
        return self

    def _claim_index(self) -> int:
        """The lowest free harness index, claimed by creating its registry entry exclusively and
        writing this harness's record into it (and into ``root``'s state file) under the registry
        lock, so no cleanup ever sees the claim without its owner."""
        with _registry_lock():
            for k in _INDEXES:
                try:
                    fd = os.open(REGISTRY / f"apy{k}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:
                    continue
                os.close(fd)
                self._h.prefix = f"apy{k}-"
                self._write_records()
                return k
        raise HostsError(f"no free harness index in {REGISTRY} (all {len(_INDEXES)} in use)")

    def _record(self) -> dict[str, Any]:
        return {
            "prefix": self._h.prefix,
            "pid": None if self.detached else os.getpid(),
            "start_time": None if self.detached else _proc_start_time(os.getpid()),
            "detached": self.detached,
            "root": str(self.root),
            "hosts": {h.name: {"namespace": h.namespace, "address": h.address, "veth": h.veth,
                               "state_dir": str(h.state_dir)} for h in self._h.hosts.values()},
        }

    def _write_records(self) -> None:
        text = json.dumps(self._record(), indent=2) + "\n"
        for path in (REGISTRY / f"{self._h.prefix.rstrip('-')}.json", self.root / STATE_FILE):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)

    def _hosts_file(self) -> str:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{self.operator_address}\t{OPERATOR}"]
        lines += [f"{h.address}\t{h.name}" for h in self._h.hosts.values()]
        return "# apiary hosts harness " + self._h.prefix + "\n" + "\n".join(lines) + "\n"

    # --- looking up ----------------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        """``apy<k>-``: every namespace and link of this harness starts with it."""
        self._require_up()
        return self._h.prefix

    @property
    def operator_address(self) -> str:
        """The root namespace's address on the bridge, ``198.18.<k>.254`` (hosts call it ``operator``)."""
        return f"{NET_PREFIX}.{self.prefix.removeprefix('apy').rstrip('-')}.{OPERATOR_OCTET}"

    def host(self, name: str) -> Host:
        """The :class:`Host` called ``name``; raises :class:`HostsError` for an unknown name."""
        self._require_up()
        try:
            return self._h.hosts[name]
        except KeyError:
            raise HostsError(f"host: no host {name!r} in this harness ({', '.join(self._h.hosts)})") from None

    def address(self, name: str) -> str:
        """The IPv4 address of host ``name`` (``198.18.<k>.<i>``)."""
        return self.host(name).address

    def state_dir(self, name: str) -> Path:
        """The state directory of host ``name`` (``<root>/<name>``)."""
        return self.host(name).state_dir

    def all(self) -> list[Host]:
        """Every host, in the order of ``names``."""
        self._require_up()
        return list(self._h.hosts.values())

    def _require_up(self) -> None:
        if not self._h.registered:
            raise HostsError("the hosts are not up: call up() first (or use `with Hosts(...)`)")

    # --- running -------------------------------------------------------------------------------

    def argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` inside host ``name``: ``ip netns exec <ns> ...``."""
        return ["ip", "netns", "exec", self.host(name).namespace, *argv]

    def run(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            stdout: int | IO[Any] | None = None, stderr: int | IO[Any] | None = None,
            cwd: Path | str | None = None, stdin: int | IO[Any] | None = subprocess.DEVNULL,
            ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside host ``name`` (its own session and process group); returns the
        process. ``env`` replaces the environment (default: this process's); ``cwd`` defaults to
        the host's state directory. The process is stopped at :meth:`down` (SIGTERM to its group,
        SIGKILL after :data:`STOP_GRACE_S`) unless it ended before; stop it earlier with
        :meth:`stop`."""
        p = subprocess.Popen(self.argv(name, argv), env=dict(env) if env is not None else None,
                             stdout=stdout, stderr=stderr, stdin=stdin,
                             cwd=str(cwd) if cwd is not None else str(self.state_dir(name)),
                             start_new_session=True)
        self._h.processes.append(p)
        return p

    def stop(self, process: subprocess.Popen[Any], *, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM ``process``'s group, SIGKILL it after ``grace_s``; returns its exit status."""
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        with contextlib.suppress(ValueError):
            self._h.processes.remove(process)
        return process.returncode

    def exec(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
             cwd: Path | str | None = None, input: str | None = None, timeout: float = 60.0,
             check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside host ``name`` to completion, capturing its output as text. Raises
        :class:`HostsError` past ``timeout`` seconds, or when ``check`` and it exits non-zero."""
        full = self.argv(name, argv)
        try:
            r = subprocess.run(full, env=dict(env) if env is not None else None, input=input,
                               cwd=str(cwd) if cwd is not None else str(self.state_dir(name)),
                               capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            raise HostsError(f"on host {name}: `{' '.join(argv)}` took over {timeout:.0f} s") from e
        if check and r.returncode != 0:
            raise HostsError(f"on host {name}: `{' '.join(argv)}` failed ({r.returncode}): "
                             f"{(r.stderr or r.stdout).strip()[-2000:]}")
        return r

    def pids(self, name: str) -> list[int]:
        """The processes running inside host ``name`` (``ip netns pids``)."""
        return _namespace_pids(self.host(name).namespace)

    # --- faults --------------------------------------------------------------------------------

    def partition(self, name: str) -> None:
        """Cut host ``name`` off from every other host and the operator: its veth goes down on the
        bridge side and inside (``eth0``), so packets in flight are dropped and new ones to or from
        it fail. Processes inside keep running. Undo with :meth:`heal`."""
        h = self.host(name)
        _ip("link", "set", h.veth, "down")
        _ip("-n", h.namespace, "link", "set", "eth0", "down")
        logger.info("partitioned host=%s", name)

    def heal(self, name: str) -> None:
        """Bring host ``name``'s links back up (both ends); its address and on-link route come
        back with the link (IPv4 re-adds the connected route of an address when its link is up)."""
        h = self.host(name)
        _ip("-n", h.namespace, "link", "set", "eth0", "up")
        _ip("link", "set", h.veth, "up")
        logger.info("healed host=%s", name)

    def netem(self, name: str, *, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Delay and/or drop packets to and from host ``name`` with tc-netem(8), on both ends of
        its veth: ``delay_ms`` each way (a round trip gains twice that), ``loss_pct`` (0..100) each
        way. All zero removes it. Raises :class:`HostsError` when the kernel has no netem qdisc
        (``CONFIG_NET_SCH_NETEM``) or for out-of-range values."""
        if delay_ms < 0:
            raise HostsError(f"delay_ms: must be >= 0, got {delay_ms}")
        if not 0 <= loss_pct <= 100:
            raise HostsError(f"loss_pct: must be in 0..100, got {loss_pct}")
        h = self.host(name)
        ends = (["tc"], ["tc", "-n", h.namespace])
        devs = (h.veth, "eth0")
        if delay_ms == 0 and loss_pct == 0:
            for tc, dev in zip(ends, devs, strict=True):
                _cmd([*tc, "qdisc", "del", "dev", dev, "root"], check=False)
            return
        spec = ["delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
        for tc, dev in zip(ends, devs, strict=True):
            r = _cmd([*tc, "qdisc", "replace", "dev", dev, "root", "netem", *spec], check=False)
            if r.returncode != 0:
                if "unknown" in r.stderr.lower():
                    raise HostsError("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM is not set)")
                raise HostsError(f"tc netem on {dev} of host {name} failed: {r.stderr.strip()}")


@contextlib.contextmanager
def hosts(names: Sequence[str], root: Path | str) -> Iterator[Hosts]:
    """``with hosts(["db", "cp1"], root) as h:`` — :class:`Hosts` made on entry and removed on
    exit (also on an exception), for tests, chaos experiments and benches alike."""
    h = Hosts(names, root)
    with h:
        yield h

