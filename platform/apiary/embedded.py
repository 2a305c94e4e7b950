"""The embedded platform behind ``apiary up``: one machine, no external services.

A supervisor process starts and watches these children, restarting any that dies (as systemd
would), so a ``kill -9`` of any of them is survived:

- ``control-plane``: store (SQLite in ``home``), scheduler, scheduling loop, REST API;
- ``agent``: the node agents of every node in the cluster config, in one process. With
  ``simulated_gpus=None`` (``apiary up``) this host's node reads its real GPUs through NVML when
  NVML answers and the node has no more GPUs in the config than NVML sees (:func:`choose_gpus`);
  every other node, and every node without a driver, has simulated GPUs (the config's count);
- ``prefect-server`` with its UI, ``prefect-bridge`` (mirrors every job into a flow run) and
  ``prefect-serve`` (serves the job-submission and scheduling-loop deployments).

Prefect is off the launch path: jobs are accepted, scheduled and run with the three Prefect
children dead; the bridge catches the UI up when they return.

One platform per home: :meth:`Embedded.start` holds an exclusive ``flock`` on ``home/run/lock``
for the platform's life (the file names the holder's pid and API URL); a second start on a live
home raises :class:`HomeInUseError` before it starts or writes anything else. The Prefect server
keeps its port across restarts (``home/run/prefect-port``), so the bookmarked UI and its login
stay valid.

The home holds the jobs' secrets (the store, task logs, launch records): it is made 0700 (also an
existing one), and every child runs with umask 077, so what the platform writes there is 0600
(directories 0700) (:mod:`apiary.procutil`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from apiary.auth.bootstrap import read_token, write_secret
from apiary.client import ApiaryClient
from apiary.control.config import check_cluster_config
from apiary.errors import PlatformError, PortInUseError, UnavailableError, UserError
from apiary.images.daemons import Registry
from apiary.marketplace import mlflow_server
from apiary.marketplace.mlflow_server import MlflowServer
from apiary.monitoring.gpu import NvmlProbe, probe_nvml
from apiary.procutil import (
    PRIVATE_UMASK,
    die_with_parent,
    open_private,
    port_in_use,
    private_dir,
    private_umask,
    remembered_port,
    write_private,
)
from apiary.settings import ensure_cluster_id
from apiary.tracking.prefect_server import (
    PrefectServer,
    ensure_database,
    free_port,
    new_auth_string,
    prefect_database_url,
    prefect_env,
    start_prefect_server,
)

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
FLOWS_DIR = REPO_ROOT / "flows"


class HomeInUseError(UserError):
    """Another live platform holds this home's lock (``home/run/lock``). HTTP 409.

    ``pid``: the holder's process id (its ``apiary up``) and ``api_url`` its API, as it recorded
    them; None when it has not written them yet (it is starting)."""

    status_code = 409
    code = "HomeInUseError"

    def __init__(self, home: Path, pid: int | None, api_url: str | None) -> None:
        self.home, self.pid, self.api_url = home, pid, api_url
        holder = f"pid {pid}" if pid else "a starting platform"
        super().__init__(f"APIARY_HOME {home} is in use by the running platform ({holder}, API "
                         f"{api_url or 'not answering yet'}); stop it first, or use another APIARY_HOME")


@dataclass(frozen=True)
class GpuChoice:
    """Which nodes' agents read real GPUs through NVML (``nvml_nodes``; the others simulate
    theirs), and ``note``, one line saying so and why, for the start banner."""

    nvml_nodes: tuple[str, ...]
    note: str


def choose_gpus(nodes: dict[str, int], probe: NvmlProbe | None, hostname: str) -> GpuChoice:
    """Real or simulated GPUs for an embedded platform's agents.

    ``nodes``: the cluster config's nodes (name -> GPUs); ``probe``: what NVML answered on this
    host (None: simulated GPUs were asked for); ``hostname``: this host's name. This host's node is
    the one named like the host (its name or its first label), else the only node of a one-node
    cluster. It reads NVML when NVML answers and the node has no more GPUs in the config than NVML
    sees (the scheduler must not place work on GPUs that are not there); otherwise every node is
    simulated, and the note says why."""
    if probe is None:
        return GpuChoice((), "simulated (asked with --simulated-gpus)")
    if not probe.answers:
        return GpuChoice((), f"simulated (NVML does not answer: {probe.reason})")
    short = hostname.split(".", 1)[0]
    mine = next((n for n in nodes if n in (hostname, short)), None)
    if mine is None and len(nodes) == 1:
        mine = next(iter(nodes))
    seen = f"NVML sees {probe.count} GPU{'s' if probe.count != 1 else ''} ({', '.join(dict.fromkeys(probe.names))})"
    if mine is None:
        return GpuChoice((), f"simulated ({seen}, but no node of the cluster config is this host, {hostname})")
    if nodes[mine] > probe.count:
        return GpuChoice((), f"simulated ({seen}; node {mine} has {nodes[mine]} in the cluster config)")
    others = len(nodes) - 1
    rest = f"; the other {others} node{'s' if others != 1 else ''} simulated" if others else ""
    return GpuChoice((mine,), f"NVML on node {mine} ({seen}, driver {probe.driver or '?'}){rest}")


@dataclass
class Child:
    """A supervised subprocess with umask 077 (:data:`~apiary.procutil.PRIVATE_UMASK`); output goes
    to ``log_path`` (0600, its directory 0700)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: str | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    #: A server that forks its own workers (MLflow): what is left of its process group is killed
    #: once it stopped or died, before a restart (its session is its own: nothing else is in it).
    group: bool = False

    def kill_group(self) -> None:
        if self.group and self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def start(self) -> None:
        private_dir(self.log_path.parent)
        with open_private(self.log_path) as log:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
                umask=PRIVATE_UMASK,
            )
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.kill_group()


@dataclass
class Embedded:
    """Start with :meth:`start`, keep alive with :meth:`supervise` (blocks) or the background
    :meth:`start_supervisor`, end with :meth:`stop`. ``prefect=False`` runs without Prefect;
    ``prefect_api_url`` reuses an existing Prefect server instead of starting one."""

    home: Path
    cluster: Path | None = None
    api_port: int | None = None
    prefect: bool = True
    prefect_api_url: str | None = None
    #: Basic auth of the Prefect server at ``prefect_api_url`` (``user:password``); for the server
    #: it starts itself, Embedded makes one and keeps it in ``home/credentials/prefect-auth``.
    prefect_auth_string: str | None = None
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: Restart a dead Prefect server. Tests turn it off for a while to prove jobs run without Prefect.
    restart_prefect: bool = True
    #: Also run Prometheus and Alertmanager (Debian's binaries) with deploy/'s configs, if installed.
    monitoring: bool = False
    monitoring_interval_s: float = 15.0
    smtp_smarthost: str = "127.0.0.1:2525"
    prometheus_url: str | None = None
    alertmanager_url: str | None = None
    children: dict[str, Child] = field(default_factory=dict)
    prefect_server: PrefectServer | None = None
    #: Task runtime of the agents: ``process``, or ``docker`` (dockerd is started if it does not
    #: answer, a registry on loopback is supervised like the other children, and the image map
    #: is ``home/image-map.yaml``, copied from the shipped defaults on the first start).
    runtime: str = "process"
    #: Run the drills on their schedules (inspection every 5 minutes, ...; flows/serve.py). Off by
    #: default so tests and demos see only their own jobs; ``apiary up`` turns it on.
    drill_schedules: bool = False
    registry: Registry | None = None
    dockerd: subprocess.Popen | None = None
    #: Simulated GPUs on every node (True, the default for tests and demos), or None: this host's
    #: node reads NVML when it can (:func:`choose_gpus`; ``apiary up`` without --simulated-gpus).
    simulated_gpus: bool | None = True
    #: What the agents use, one line (:attr:`GpuChoice.note`), once started.
    gpu_note: str = ""
    #: The Prefect server's port; None: the one this home used before (``home/run/prefect-port``)
    #: while it is free, else a new free port, remembered.
    prefect_port: int | None = None
    #: Run MLflow, the model registry (``mlflow`` child), when its venv exists: ``apiary up`` does.
    mlflow: bool = False
    mlflow_server: MlflowServer | None = None

    def __post_init__(self) -> None:
        self.home = Path(self.home).expanduser().resolve()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ports: set[int] = set()
        self._monitoring_ports: tuple[int, int] | None = None  # Prometheus, Alertmanager
        self._lock_fd: int | None = None

    def _port(self) -> int:
        """A free port this platform has not handed to another of its children (the OS may
        give a released port out twice)."""
        port = free_port(avoid=self._ports | ({self.api_port} if self.api_port else set()))
        self._ports.add(port)
        return port

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def client(self, timeout: float = 30.0) -> ApiaryClient:
        """A client of this platform with its first admin's token (``home/token``)."""
        return ApiaryClient(self.api_url, timeout=timeout, token=read_token(self.home / "token"))

    @property
    def ui_url(self) -> str | None:
        if self.prefect_server:
            return self.prefect_server.ui_url
        return self.prefect_api_url[: -len("/api")] if self.prefect_api_url else None

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update({"APIARY_HOME": str(self.home), "PYTHONUNBUFFERED": "1"})
        env.update(self.env)
        return env

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "apiary", *args]

    def start(self) -> None:
        """Start every child and wait until the API answers. Raises ValidationError for a bad
        cluster config (before anything is written), HomeInUseError when a live platform holds the
        home's lock, PortInUseError for a taken ``api_port`` or ``prefect_port`` (these two before
        anything starts or is written but the lock file), and PlatformError/UnavailableError if a
        child cannot start or the API that answers is not this home's (its ``clusterId``,
        :func:`~apiary.settings.ensure_cluster_id`). The lock is held until :meth:`stop` (released
        at once when the start fails before any child started).

        The home is made 0700 and what this process writes in it 0600 (umask 077 while it starts,
        the caller's umask again after)."""
        with private_umask():
            try:
                self._start()
            except BaseException:
                if not self.children:  # refused before any child: the home is free again at once
                    self._unlock_home()
                raise

    def _start(self) -> None:
        target = self.home / "cluster.yaml"
        source = Path(self.cluster) if self.cluster is not None else target
        if self.cluster is None and not target.exists():
            raise PlatformError(f"no cluster config: pass --cluster (nothing at {target})")
        # The checks of PUT /api/v2/cluster/config, here: a bad config fails with its field named
        # (400), not as a control plane that exits with the field in its log.
        check_cluster_config(source)
        try:
            private_dir(self.home)
        except OSError as e:
            raise PlatformError(f"cannot make the home {self.home} private (mode 0700): {e.strerror or e}") from e
        run = self.home / "run"
        private_dir(run)
        # One platform per home: a second one would adopt and kill the first one's tasks.
        self._lock_home(run / "lock")
        # A second platform on this machine must not start on the first one's port: its control
        # plane would fail to bind while the first one answered its health checks.
        for port in (self.api_port, self.prefect_port if self.prefect and not self.prefect_api_url else None):
            if port and port_in_use(port):
                raise PortInUseError(port)
        cluster_id = ensure_cluster_id(self.home)
        if self.cluster is not None and (not target.exists() or source.resolve() != target):
            write_private(target, source.read_bytes())
        self.api_port = self.api_port or self._port()
        logs = self.home / "logs"
        base = self._base_env()
        cp_env = base
        if self.mlflow:  # its URL first: the control plane gives it to every task
            self.mlflow_server = mlflow_server.for_home(
                self.home, api_url=self.api_url, choose_port=self._port, taken=self._ports | {self.api_port},
                apiary_database_url=base.get("APIARY_DATABASE_URL"))
            if self.mlflow_server is not None:
                self._ports.add(self.mlflow_server.port)
                cp_env = {**cp_env, "APIARY_MLFLOW_URL": self.mlflow_server.url}
        if self.prefect:
            # The Prefect server first: the control plane's webhook intake starts the CI/CD flow
            # runs there (PREFECT_API_URL), which it could not do with a server started after it.
            api = self._start_prefect_server(base)
            cp_env = {**base, **prefect_env(self.home / "prefect", api, self.prefect_auth_string)}
        if self.monitoring:
            # Ports fixed before the control plane starts: incidents query Prometheus for evidence.
            self._monitoring_ports = (self._port(), self._port())
            cp_env = {**cp_env, "APIARY_PROMETHEUS_URL": f"http://127.0.0.1:{self._monitoring_ports[0]}"}
        self.children["control-plane"] = Child(
            "control-plane", self._cli("control-plane", "--port", str(self.api_port)), cp_env,
            logs / "control-plane.log",
        )
        self.children["control-plane"].start()
        answered = self.wait_api().get("clusterId")
        if answered != cluster_id:
            raise PlatformError(f"{self.api_url} answers as cluster {answered}, not this platform's {cluster_id} "
                                f"(another platform took port {self.api_port}?)")
        write_private(run / "api_url", self.api_url)
        self._record_holder()
        if self.mlflow_server is not None:  # after the control plane: its plugin asks the identity route
            self.mlflow_server.prepare()
            self.children["mlflow"] = Child("mlflow", self.mlflow_server.argv(), self.mlflow_server.env(base),
                                            logs / "mlflow.log", group=True)
            self.children["mlflow"].start()
            self.mlflow_server.wait(alive=self.children["mlflow"].alive)
        # Every node agent serves /metrics on a port fixed here, so a restarted agent keeps its
        # Prometheus target.
        inventory = {n["name"]: int(n["gpus"]) for n in self.client().nodes()}
        nodes = list(inventory)
        self.metrics_ports = {n: self._port() for n in nodes}
        runtime_args = ["--runtime", self.runtime]
        if self.runtime == "docker":
            runtime_args += self._start_docker(base, logs)
        gpus = choose_gpus(inventory, None if self.simulated_gpus else probe_nvml(), socket.gethostname())
        self.gpu_note = gpus.note
        logger.info("GPUs: %s", gpus.note)
        nvml_args = [arg for n in gpus.nvml_nodes for arg in ("--nvml-node", n)]
        self.children["agent"] = Child(
            "agent",
            self._cli("agent", "--api", self.api_url, "--all-nodes", "--simulated-gpus", *nvml_args,
                      "--state-dir", str(self.home / "agents"), "--workdir", self.workdir or os.getcwd(),
                      "--metrics-ports", json.dumps(self.metrics_ports), *runtime_args),
            base, logs / "agent.log",
        )
        self.children["agent"].start()
        if self.monitoring:
            self._start_monitoring(base, logs)
        if self.prefect:
            self._start_prefect(base, logs)
        write_private(run / "urls.json", json.dumps({
            "api": self.api_url, "ui": self.ui_url, "prometheus": self.prometheus_url,
            "alertmanager": self.alertmanager_url, "registry": self.registry.url if self.registry else None,
            "mlflow": self.mlflow_server.url if self.mlflow_server else None,
        }))
        write_private(run / "supervisor.pid", str(os.getpid()))

    def _lock_home(self, path: Path) -> None:
        """Take the home's lock (``flock`` LOCK_EX on ``path``, held until :meth:`stop`); raises
        HomeInUseError naming the holder (from the file) when a live platform holds it. A lock
        left by a dead platform is free: the kernel drops it with the process."""
        if self._lock_fd is not None:
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder: dict = {}
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                pass
            os.close(fd)
            raise HomeInUseError(self.home, holder.get("pid"), holder.get("api")) from None
        self._lock_fd = fd

    def _record_holder(self) -> None:
        """Write this platform's pid and API URL into the lock file (for a second start's message)."""
        if self._lock_fd is None:
            return
        doc = json.dumps({"pid": os.getpid(), "api": self.api_url}).encode()
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, doc, 0)

    def _unlock_home(self) -> None:
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _prefect_port_for_home(self) -> int:
        """The Prefect server's port: ``prefect_port`` when given, else the one remembered in
        ``home/run/prefect-port`` while it is free, else a new free port. Remembered either way,
        so the UI's address (and the browser's login, kept per address) survives restarts."""
        path = self.home / "run" / "prefect-port"
        if self.prefect_port:
            port = self.prefect_port
            write_private(path, str(port))
        else:
            taken = self._ports | ({self.api_port} if self.api_port else set())
            port = remembered_port(path, self._port, taken, what="prefect")
        self._ports.add(port)
        return port

    def _start_docker(self, base: dict[str, str], logs: Path) -> list[str]:
        """dockerd (unless it answers), the registry (a supervised child, storage in
        ``home/registry``, its port kept in ``home/run/registry-port`` so a restart keeps the
        images' names), and ``home/image-map.yaml``; returns the agent's extra arguments."""
        from apiary.images import imagemap
        from apiary.images.daemons import Registry, ensure_dockerd

        self.dockerd = ensure_dockerd(logs / "dockerd.log")
        port_file = self.home / "run" / "registry-port"
        kept = int(port_file.read_text()) if port_file.exists() else 0
        port = kept if kept and not port_in_use(kept) else self._port()
        write_private(port_file, str(port))
        self.registry = Registry(self.home / "registry", port)
        self.children["registry"] = Child("registry", self.registry.argv(), base, logs / "registry.log")
        self.children["registry"].start()
        self.registry.wait()
        map_path = self.home / "image-map.yaml"
        if not map_path.exists():
            write_private(map_path, imagemap.default_text())
        imagemap.load(map_path, self.registry.address)  # a broken map fails here, not in the agent
        return ["--image-map", str(map_path), "--registry", self.registry.address]

    def _start_monitoring(self, base: dict[str, str], logs: Path) -> None:
        from apiary.monitoring import stack

        binaries = stack.find_binaries()
        if binaries is None:
            logger.warning("monitoring: prometheus / prometheus-alertmanager not installed "
                           "(apt-get install prometheus prometheus-alertmanager); running without them")
            return
        out = self.home / "monitoring"
        prom_port, am_port = self._monitoring_ports or (self._port(), self._port())
        prom_cfg = stack.render_prometheus(out, control_plane=f"127.0.0.1:{self.api_port}",
                                           alertmanager=f"127.0.0.1:{am_port}", interval_s=self.monitoring_interval_s)
        stack.write_targets(out / "targets" / "nodes.json",
                            {n: f"http://127.0.0.1:{p}/metrics" for n, p in self.metrics_ports.items()})
        am_cfg = stack.render_alertmanager(out, webhook_url=f"{self.api_url}/api/v2/alerts/webhook",
                                           smtp_smarthost=self.smtp_smarthost,
                                           token_file=self.home / "credentials" / "alertmanager.token")
        self.children["prometheus"] = Child(
            "prometheus", stack.prometheus_argv(binaries.prometheus, prom_cfg, out / "prometheus-data", prom_port),
            base, logs / "prometheus.log")
        self.children["alertmanager"] = Child(
            "alertmanager", stack.alertmanager_argv(binaries.alertmanager, am_cfg, out / "alertmanager-data", am_port),
            base, logs / "alertmanager.log")
        self.children["alertmanager"].start()
        self.children["prometheus"].start()
        self.prometheus_url = f"http://127.0.0.1:{prom_port}"
        self.alertmanager_url = f"http://127.0.0.1:{am_port}"

    def _prefect_auth(self) -> str:
        """The Prefect server's ``user:password``: kept in ``home/credentials/prefect-auth``
        (mode 0600) so a restart keeps the UI's login; made on the first start."""
        path = self.home / "credentials" / "prefect-auth"
        current = read_token(path)
        if current is None:
            current = new_auth_string()
            write_secret(path, current)
        return current

    def _start_prefect_server(self, base: dict[str, str]) -> str:
        """Start the Prefect server (unless ``prefect_api_url`` names one); returns its API URL.

        When Apiary's store is PostgreSQL (``APIARY_DATABASE_URL`` in the children's
        environment), the server runs on PostgreSQL too: database ``<apiary db>_prefect`` on the
        same server, created if missing (a SQLite-backed server answers 503 under concurrent
        writes). Otherwise it keeps its zero-setup SQLite file in ``home/prefect``.
        """
        if self.prefect_api_url is not None:
            return self.prefect_api_url
        if self.prefect_server is None:
            # Protected: the run form submits as the user it names, which is only safe when the
            # people who reach the UI are the ones who hold this password (README, trust model).
            self.prefect_auth_string = self._prefect_auth()
            self.prefect_server = start_prefect_server(
                self.home / "prefect", database_url=self._prefect_database(base.get("APIARY_DATABASE_URL")),
                auth_string=self.prefect_auth_string, port=self._prefect_port_for_home(),
            )
        return self.prefect_server.api_url

    def _start_prefect(self, base: dict[str, str], logs: Path) -> None:
        """Start the bridge and flows/serve.py against the Prefect server (started first by
        :meth:`_start_prefect_server`)."""
        api = self._start_prefect_server(base)
        penv = {**base, **prefect_env(self.home / "prefect", api, self.prefect_auth_string),
                "APIARY_API_URL": self.api_url, "APIARY_DRILL_SCHEDULES": "1" if self.drill_schedules else "0"}
        # The bridge and the flows call Apiary with the bridge's service token (the control plane
        # wrote it before its port opened), never with the admin's.
        penv["APIARY_TOKEN"] = read_token(self.home / "credentials" / "bridge.token") or ""
        # A SQLite-backed server answers 503 to more than ~2 concurrent writers. PostgreSQL takes
        # 8, and the bridge then catches up with bursts it would trail at 2; keeping up with a
        # steady stream, 4 at once trails less than 8 (bench/README.md).
        on_pg = bool(self.prefect_server and (self.prefect_server.database_url or "").startswith("postgresql"))
        concurrency = ["--concurrency", "4", "--catch-up-concurrency", "8"] if on_pg else ["--concurrency", "2"]
        self.children["prefect-bridge"] = Child(
            "prefect-bridge",
            self._cli("prefect-bridge", "--api", self.api_url, "--prefect-api", api,
                      "--state", str(self.home / "prefect-bridge.json"), *concurrency),
            penv, logs / "prefect-bridge.log",
        )
        self.children["prefect-serve"] = Child(
            "prefect-serve", [sys.executable, str(FLOWS_DIR / "serve.py")], penv, logs / "prefect-serve.log",
            cwd=str(REPO_ROOT),
        )
        for name in ("prefect-bridge", "prefect-serve"):
            self.children[name].start()

    @staticmethod
    def _prefect_database(apiary_database_url: str | None) -> str | None:
        """Prefect's database URL for Apiary's (None: SQLite), created on the server if missing."""
        url = prefect_database_url(apiary_database_url)
        if url is not None:
            from sqlalchemy.engine import make_url

            ensure_database(str(apiary_database_url), str(make_url(url).database))
        return url

    def wait_api(self, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            cp = self.children.get("control-plane")
            if cp is not None and cp.proc is not None and cp.proc.poll() is not None and not self._thread:
                raise PlatformError(f"control plane exited with {cp.proc.returncode}; see {cp.log_path}")
            try:
                r = httpx.get(f"{self.api_url}/healthz", timeout=1.0)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise UnavailableError(f"control plane not answering at {self.api_url} after {timeout_s} s")

    # ------------------------------------------------------------------ supervision
    def supervise_once(self) -> None:
        """Restart any child that died (and a dead Prefect server, on its old port)."""
        for child in self.children.values():
            if child.proc is not None and child.proc.poll() is not None and not self._stop.is_set():
                code = child.proc.returncode
                child.restarts += 1
                logger.warning("child=%s exited code=%s; restarting (restart %d)", child.name, code, child.restarts)
                time.sleep(min(0.2 * child.restarts, 2.0))
                child.kill_group()
                child.start()
        if (
            self.restart_prefect
            and self.prefect_server is not None
            and not self.prefect_server.alive()
            and not self._stop.is_set()
        ):
            logger.warning("prefect server died; restarting on port %d", self.prefect_server.port)
            try:
                self.prefect_server = start_prefect_server(
                    self.home / "prefect", port=self.prefect_server.port, database_url=self.prefect_server.database_url,
                    auth_string=self.prefect_server.auth_string,
                )
            except (PlatformError, UnavailableError):
                logger.exception("prefect server restart failed; jobs keep running without it")

    def start_supervisor(self, period_s: float = 0.5) -> None:
        def loop() -> None:
            while not self._stop.wait(period_s):
                self.supervise_once()

        self._thread = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._thread.start()

    def supervise(self, period_s: float = 0.5) -> None:
        while not self._stop.wait(period_s):
            self.supervise_once()

    def stop(self) -> None:
        """Stop children in reverse order (agents stop their tasks). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for name in ("prefect-serve", "prefect-bridge", "prometheus", "alertmanager", "agent", "registry", "mlflow",
                     "control-plane"):
            child = self.children.get(name)
            if child is not None:
                child.stop()
        if self.prefect_server is not None:
            self.prefect_server.stop()
        if self.dockerd is not None and self.dockerd.poll() is None:  # only a dockerd this platform started
            self.dockerd.terminate()
            try:
                self.dockerd.wait(20)
            except subprocess.TimeoutExpired:
                self.dockerd.kill()
        if not self.children:
            self._unlock_home()
            return  # start() refused before starting anything: the run files may be another platform's
        for f in ("api_url", "urls.json", "supervisor.pid"):
            (self.home / "run" / f).unlink(missing_ok=True)
        self._unlock_home()

    def __enter__(self) -> Embedded:
        self.start()
        self.start_supervisor()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
