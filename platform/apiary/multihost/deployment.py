"""Apiary with every component on its own host.

Hosts (``apiary.hosts.netns``: network namespaces on one bridge here, machines elsewhere):

=========  ==============================================================================
``db``     PostgreSQL, TLS only (``hostssl``), clients connect with ``sslmode=verify-full``
``cpN``    a control-plane replica (``apiary control-plane``), HTTPS on :data:`API_PORT`;
           the replicas elect one leader through the store's lease
``prefect`` the Prefect server on its loopback behind nginx terminating TLS on
           :data:`PREFECT_TLS_PORT`, the Prefect bridge and the flow server (both talk to the
           Prefect server over that host's loopback and to the control plane over HTTPS)
``mon``    Prometheus and Alertmanager, both serving HTTPS with mon's certificate (the control
           plane scraped over HTTPS, alerts sent to Alertmanager over HTTPS, the webhook's
           certificate verified against the platform CA)
``nN``     one node agent each, joined with a bootstrap token (``apiary agent join``), serving
           its /metrics over HTTPS with the certificate the join had signed
=========  ==============================================================================

Components share nothing but the network: each gets its own state directory, and what one host
needs from another travels over it (the node credentials by the join). The operator (this
process, on the bridge's own address) makes the CA and the hosts' certificates, hands each host
the CA certificate (public), reads the first admin's token from the first replica's home, and
creates the service tokens of the bridge and Alertmanager through the API. Every cross-host hop is
TLS; only loopback hops inside one host (the Prefect server behind its terminator) are plain.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from apiary import pki
from apiary.client import ApiaryClient, http_verify
from apiary.errors import PlatformError, UnavailableError
from apiary.hosts.netns import Hosts
from apiary.hosts.postgres import PostgresServer, PostgresTLS
from apiary.hosts.terminator import Terminator
from apiary.monitoring import stack
from apiary.procutil import private_dir, write_private
from apiary.tracking.prefect_server import new_auth_string, prefect_env, server_command

logger = logging.getLogger(__name__)

#: The control plane's HTTPS port on each replica's host.
API_PORT = 8470
#: The Prefect server's plain port on the prefect host's loopback, and nginx's TLS port in front of it.
PREFECT_PORT = 4200
PREFECT_TLS_PORT = 4443
#: Prometheus' and Alertmanager's ports on the mon host; each agent's /metrics port on its host.
PROMETHEUS_PORT = 9090
ALERTMANAGER_PORT = 9093
METRICS_PORT = 9100
REPO_ROOT = Path(__file__).resolve().parents[3]
FLOWS_DIR = REPO_ROOT / "flows"


@dataclass
class Component:
    """One process on one host: its argv and environment, so it can be killed and started again."""

    name: str
    host: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Deployment:
    """Apiary on ``len(nodes) + replicas + 3`` hosts under ``root`` (see the module doc).

    ``cluster``: the HiveD cluster config (YAML) every replica is given; ``nodes``: the nodes of
    that config that get an agent host each (``n1``, ``n2``, ...; the agent joins as the node's
    name). ``prefect`` / ``monitoring``: start those hosts too. ``settings``: more ``APIARY_*``
    variables for the replicas (e.g. ``APIARY_NODE_LOST_AFTER_S``). Use as a context manager or
    :meth:`start` / :meth:`stop`; :meth:`start` raises PlatformError or UnavailableError naming
    the component that did not come up (its log's tail in the message).
    """

    root: Path
    cluster: Path
    nodes: list[str]
    replicas: int = 2
    prefect: bool = True
    monitoring: bool = True
    settings: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 120.0

    hosts: Hosts | None = None
    components: dict[str, Component] = field(default_factory=dict)
    postgres: PostgresServer | None = None
    terminator: Terminator | None = None
    admin_token: str = ""
    ca_hash: str = ""
    prefect_auth: str = ""

    # ------------------------------------------------------------------ names and addresses
    @property
    def replica_hosts(self) -> list[str]:
        return [f"cp{i + 1}" for i in range(self.replicas)]

    @property
    def node_hosts(self) -> dict[str, str]:
        """node name -> its host's name."""
        return {node: f"n{i + 1}" for i, node in enumerate(self.nodes)}

    def host_names(self) -> list[str]:
        names = ["db", *self.replica_hosts]
        names += ["prefect"] if self.prefect else []
        names += ["mon"] if self.monitoring else []
        return names + list(self.node_hosts.values())

    def _hosts(self) -> Hosts:
        if self.hosts is None:
            raise PlatformError("the deployment's hosts are not up")
        return self.hosts

    def address(self, host: str) -> str:
        return self._hosts().address(host)

    def dir(self, host: str) -> Path:
        return self._hosts().state_dir(host)

    @property
    def ca_dir(self) -> Path:
        return self.root / "ca"

    @property
    def ca_cert(self) -> Path:
        return self.ca_dir / "ca.crt"

    def api_urls(self, by_address: bool = False) -> list[str]:
        """Every replica's HTTPS URL: by host name (what the hosts use) or by address (what this
        process, outside the hosts' name resolution, uses; the certificates name both)."""
        return [f"https://{self.address(h) if by_address else h}:{API_PORT}" for h in self.replica_hosts]

    def client(self, token: str | None = None, timeout: float = 30.0) -> ApiaryClient:
        """A client of every replica (failing over between them) verifying the platform CA."""
        return ApiaryClient(",".join(self.api_urls(by_address=True)), timeout=timeout,
                            token=token or self.admin_token, ca_cert=self.ca_cert)

    # ------------------------------------------------------------------ start / stop
    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        # 0711: the hosts' servers run as their own OS users (PostgreSQL as postgres) and must reach
        # their directories below; what is secret here (the CA key, tokens) is 0600 or in 0700 dirs.
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)
        self.hosts = Hosts(self.host_names(), self.root / "hosts")
        self.hosts.up()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        hosts = self._hosts()
        pki.init_ca(self.ca_dir)
        self.ca_hash = pki.ca_cert_hash(self.ca_cert.read_bytes())
        for name in hosts.names:
            # The CA certificate is public: every host gets its own copy (an operator's scp).
            shutil.copyfile(self.ca_cert, self.dir(name) / "ca.crt")
        cert, key = self._issue("db")
        self.postgres = PostgresServer(hosts, "db", tls=PostgresTLS(cert, key, self.dir("db") / "ca.crt"))
        self.postgres.start()
        self.prefect_auth = new_auth_string()
        first = self.replica_hosts[0]
        for host in self.replica_hosts:
            if host != first:
                self._share_identity(first, host)
            self._start_replica(host)
            if host == first:
                self._wait_healthy(self.api_urls(by_address=True)[0], "control-plane@" + host)
                self.admin_token = (self.dir(host) / "home" / "token").read_text().strip()
        for url, host in zip(self.api_urls(by_address=True), self.replica_hosts, strict=True):
            self._wait_healthy(url, "control-plane@" + host)
        for node in self.nodes:
            self.join(node)
            self.start_agent(node)
        if self.prefect:
            self._start_prefect()
        if self.monitoring:
            self._start_monitoring()
        self.save()

    #: The deployment's description for other processes (chaos experiments): :meth:`save` writes it.
    STATE_FILE = "deployment.json"

    def save(self) -> Path:
        """Write ``root/deployment.json`` (0600: it holds the components' environments, the store's
        password among them): the hosts' root, the replicas' URLs by address, the CA, the admin
        token's file, and every component's host, argv, environment, log and pid, so a chaos
        experiment in another process can find, kill, stop, cut off and restart them
        (:func:`load_state`)."""
        token_file = self.root / "admin.token"
        write_private(token_file, self.admin_token)
        doc = {
            "hostsRoot": str(self._hosts().root), "apiUrls": self.api_urls(by_address=True),
            "caCert": str(self.ca_cert), "tokenFile": str(token_file), "replicas": self.replica_hosts,
            "nodes": self.node_hosts,
            "postgres": {"host": "db", "address": self.address("db"),
                         "port": self.postgres.port if self.postgres else 0},
            "components": {name: {"host": c.host, "argv": c.argv, "env": c.env, "log": str(c.log),
                                  "pid": c.proc.pid if c.proc else None}
                           for name, c in self.components.items()},
        }
        path = self.root / self.STATE_FILE
        write_private(path, json.dumps(doc, indent=2))
        return path

    def stop(self) -> None:
        for comp in reversed(list(self.components.values())):
            self._terminate(comp)
        if self.terminator is not None:
            self.terminator.stop()
        if self.postgres is not None:
            self.postgres.stop()
        if self.hosts is not None:
            self.hosts.down()

    # ------------------------------------------------------------------ components
    def _run(self, comp: Component) -> Component:
        log = open(comp.log, "ab")  # noqa: SIM115 - the child keeps its own copy
        try:
            comp.proc = self._hosts().run(comp.host, comp.argv, env=comp.env, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=str(REPO_ROOT))
        finally:
            log.close()
        self.components[comp.name] = comp
        return comp

    @staticmethod
    def _terminate(comp: Component, timeout_s: float = 10.0) -> None:
        proc = comp.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def _base_env(self, host: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "PREFECT_"))}
        env.update({"PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "APIARY_CA_CERT": str(self.dir(host) / "ca.crt")})
        return env

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "apiary", *args]

    def _issue(self, host: str) -> tuple[Path, Path]:
        return pki.issue(self.ca_dir, self.dir(host) / "tls", host, [host, self.address(host)])

    def replica_env(self, host: str) -> dict[str, str]:
        cert, key = self._issue(host)
        home = self.dir(host) / "home"
        private_dir(home)
        write_private(home / "cluster.yaml", self.cluster.read_text())
        assert self.postgres is not None
        env = self._base_env(host)
        env.update({
            "APIARY_HOME": str(home),
            "APIARY_DATABASE_URL": self.postgres.url(sslrootcert=self.dir(host) / "ca.crt"),
            "APIARY_TLS_CERT": str(cert), "APIARY_TLS_KEY": str(key),
            # The CA key on control-plane hosts (kubeadm keeps ca.key there): joins sign the nodes'
            # serving certificates.
            "APIARY_CA_KEY": str(self._ca_key_copy(host)),
            "APIARY_ADVERTISE_URL": f"https://{host}:{API_PORT}", "APIARY_REPLICA_ID": host,
            # Nodes join with bootstrap tokens; no agent credential is written into a replica's home.
            "APIARY_NODE_CREDENTIALS": "join",
            **self.settings,
        })
        if self.prefect:
            env.update(prefect_env(home / "prefect", f"https://prefect:{PREFECT_TLS_PORT}/api", self.prefect_auth))
            env["PREFECT_API_SSL_CERT_FILE"] = str(self.dir(host) / "ca.crt")
        if self.monitoring:
            env["APIARY_PROMETHEUS_URL"] = f"https://mon:{PROMETHEUS_PORT}"
        return env

    #: What every replica's home holds alike, copied by the operator from the first replica's (as
    #: kubeadm copies the shared certificates to a joining control-plane node): the platform's
    #: identity (clusterId in /healthz), the key that signs incident links and the key of the tasks'
    #: proxy secrets, so any replica answers as the same platform, verifies the links another one
    #: signed and proxies to the tasks another one launched.
    SHARED_HOME_FILES = ("cluster-id", "credentials/incident-links.key", "credentials/task-proxy.key")

    def _share_identity(self, source: str, host: str) -> None:
        src, dst = self.dir(source) / "home", self.dir(host) / "home"
        for rel in self.SHARED_HOME_FILES:
            if (src / rel).exists():
                private_dir((dst / rel).parent)
                write_private(dst / rel, (src / rel).read_bytes())

    def _ca_key_copy(self, host: str) -> Path:
        path = self.dir(host) / "tls" / "ca.key"
        private_dir(path.parent)
        write_private(path, (self.ca_dir / "ca.key").read_bytes())
        return path

    def _start_replica(self, host: str) -> Component:
        return self._run(Component(
            f"control-plane@{host}", host,
            self._cli("control-plane", "--host", self.address(host), "--port", str(API_PORT)),
            self.replica_env(host), self.dir(host) / "control-plane.log"))

    def restart(self, name: str) -> None:
        """Start component ``name`` again (after it was killed) with its argv and environment."""
        self._run(self.components[name])
        self.save()

    def signal(self, name: str, sig: int) -> None:
        comp = self.components[name]
        if comp.proc is None:
            raise PlatformError(f"{name} was never started")
        # ip netns exec execs the command: the Popen's pid is the component's own.
        os.kill(comp.proc.pid, sig)

    def _wait_healthy(self, url: str, name: str) -> dict:
        deadline = time.monotonic() + self.start_timeout_s
        last = ""
        with httpx.Client(verify=http_verify(self.ca_cert), timeout=5) as http:
            while time.monotonic() < deadline:
                comp = self.components.get(name)
                if comp is not None and not comp.alive():
                    raise PlatformError(f"{name} exited with {comp.proc.returncode if comp.proc else '?'}: "
                                        f"{tail(comp.log)}")
                try:
                    r = http.get(f"{url}/healthz")
                    if r.status_code == 200:
                        return r.json()
                    last = f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as e:
                    last = str(e)
                time.sleep(0.25)
        comp = self.components.get(name)
        raise UnavailableError(f"{name} at {url} not healthy within {self.start_timeout_s:g} s ({last}): "
                               f"{tail(comp.log) if comp else ''}")

    def apply_cluster_config(self, text: str) -> None:
        """A new cluster config: ``PUT /api/v2/cluster/config`` (it reaches the leader, which checks
        and applies it), then the same file in every replica's home, as an operator distributes a
        config, so a replica that leads later starts from it. Raises the API's errors (400 naming
        the field) before any home is written."""
        self.client().apply_cluster_config(text)
        for host in self.replica_hosts:
            write_private(self.dir(host) / "home" / "cluster.yaml", text)

    def leader(self) -> str | None:
        """The replica host that leads now (its /healthz says so), or None."""
        with httpx.Client(verify=http_verify(self.ca_cert), timeout=3) as http:
            for host, url in zip(self.replica_hosts, self.api_urls(by_address=True), strict=True):
                try:
                    if http.get(f"{url}/healthz").json().get("role") == "leader":
                        return host
                except (httpx.HTTPError, ValueError):
                    continue
        return None

    # ------------------------------------------------------------------ nodes
    def join(self, node: str) -> None:
        """Join ``node`` from its host, as an operator would: a bootstrap token for that node
        created by the admin, then ``apiary agent join`` on the node's host pinning the CA's hash."""
        host = self.node_hosts[node]
        token = self.client().create_bootstrap_token(ttl_s=600, node=node)["token"]
        creds = self.dir(host) / "credentials"
        r = self._hosts().exec(host, self._cli(
            "agent", "join", "--api", f"https://{self.replica_hosts[0]}:{API_PORT}", "--token", token,
            "--ca-cert-hash", self.ca_hash, "--node", node, "--credentials", str(creds),
            # the names Prometheus dials the node's /metrics by, in its serving certificate
            "--address", self.address(host), "--address", host),
            env=self._base_env(host))
        if r.returncode != 0:
            raise PlatformError(f"agent join of {node} on {host} failed ({r.returncode}): {r.stdout}{r.stderr}")

    def start_agent(self, node: str) -> Component:
        host = self.node_hosts[node]
        creds = self.dir(host) / "credentials"
        env = self._base_env(host)
        env["APIARY_HOME"] = str(self.dir(host) / "home")
        return self._run(Component(
            f"agent@{host}", host,
            self._cli("agent", "--api", ",".join(self.api_urls()), "--node", node, "--credentials", str(creds),
                      "--ca-cert", str(creds / "ca.crt"), "--simulated-gpus",
                      "--metrics-cert", str(creds / "node.crt"), "--metrics-key", str(creds / "node.key"),
                      "--state-dir", str(self.dir(host) / "agents"), "--workdir", str(REPO_ROOT),
                      "--metrics-ports", json.dumps({node: METRICS_PORT}), "--metrics-host", self.address(host)),
            env, self.dir(host) / "agent.log"))

    # ------------------------------------------------------------------ Prefect
    def _service_token(self, subject: str, path: Path) -> str:
        token = self.client().create_token(subject, kind="service", description=f"{subject} on its own host")["token"]
        write_private(path, token)
        return token

    @property
    def prefect_api_url(self) -> str:
        """The Prefect API as this process reaches it: through the terminator, HTTPS."""
        return f"https://{self.address('prefect')}:{PREFECT_TLS_PORT}/api"

    def _start_prefect(self) -> None:
        d = self.dir("prefect")
        home = d / "prefect"
        private_dir(home)
        argv, env = server_command(home, "127.0.0.1", PREFECT_PORT, auth_string=self.prefect_auth,
                                   ui_api_url=f"https://prefect:{PREFECT_TLS_PORT}/api")
        env.update({"PYTHONUNBUFFERED": "1"})
        self._run(Component("prefect-server", "prefect", argv, env, d / "prefect-server.log"))
        cert, key = self._issue("prefect")
        self.terminator = Terminator(self.address("prefect"), PREFECT_TLS_PORT, f"http://127.0.0.1:{PREFECT_PORT}",
                                     cert, key, d / "nginx", runner=lambda argv: self._hosts().run("prefect", argv))
        self.terminator.start()
        self._wait_prefect()
        bridge_token = self._service_token("bridge", d / "bridge.token")
        penv = self._base_env("prefect")
        penv.update(prefect_env(home, f"http://127.0.0.1:{PREFECT_PORT}/api", self.prefect_auth))
        penv.update({"APIARY_API_URL": ",".join(self.api_urls()), "APIARY_TOKEN": bridge_token,
                     "APIARY_HOME": str(d / "home"), "APIARY_DRILL_SCHEDULES": "0"})
        self._run(Component("prefect-bridge", "prefect", self._cli(
            "prefect-bridge", "--api", ",".join(self.api_urls()), "--prefect-api", f"http://127.0.0.1:{PREFECT_PORT}/api",
            "--state", str(d / "prefect-bridge.json"), "--concurrency", "2"), penv, d / "prefect-bridge.log"))
        self._run(Component("prefect-serve", "prefect", [sys.executable, str(FLOWS_DIR / "serve.py")], penv,
                            d / "prefect-serve.log"))

    def _wait_prefect(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        with httpx.Client(verify=http_verify(self.ca_cert), timeout=5) as http:
            while time.monotonic() < deadline:
                comp = self.components["prefect-server"]
                if not comp.alive():
                    raise PlatformError(f"prefect server exited: {tail(comp.log)}")
                try:
                    if http.get(f"{self.prefect_api_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise UnavailableError(f"the Prefect server behind nginx on prefect:{PREFECT_TLS_PORT} did not answer "
                               f"within {self.start_timeout_s:g} s: {tail(self.components['prefect-server'].log)}")

    # ------------------------------------------------------------------ monitoring
    @property
    def prometheus_url(self) -> str:
        """Prometheus as this process reaches it: HTTPS, verified against :attr:`ca_cert`."""
        return f"https://{self.address('mon')}:{PROMETHEUS_PORT}"

    @property
    def alertmanager_url(self) -> str:
        return f"https://{self.address('mon')}:{ALERTMANAGER_PORT}"

    def _start_monitoring(self, interval_s: float = 1.0, smtp_smarthost: str = "127.0.0.1:25") -> None:
        binaries = stack.find_binaries()
        if binaries is None:
            raise PlatformError("prometheus / prometheus-alertmanager not installed "
                                "(apt-get install prometheus prometheus-alertmanager)")
        d = self.dir("mon")
        out = d / "monitoring"
        ca = d / "ca.crt"
        token_file = d / "alertmanager.token"
        self._service_token("alertmanager", token_file)
        prom_cfg = stack.render_prometheus(out, control_plane=[f"{h}:{API_PORT}" for h in self.replica_hosts],
                                           alertmanager=f"mon:{ALERTMANAGER_PORT}", interval_s=interval_s, ca_file=ca,
                                           alertmanager_https=True, nodes_https=True)
        stack.write_targets(out / "targets" / "nodes.json",
                            {n: f"https://{h}:{METRICS_PORT}/metrics" for n, h in self.node_hosts.items()})
        am_cfg = stack.render_alertmanager(out, webhook_url=f"https://{self.replica_hosts[0]}:{API_PORT}/api/v2/alerts/webhook",
                                           smtp_smarthost=smtp_smarthost, token_file=token_file, ca_file=ca)
        addr = self.address("mon")
        env = self._base_env("mon")
        cert, key = self._issue("mon")
        web = stack.render_web_config(out, cert, key)  # both serve HTTPS with mon's certificate
        self._run(Component("alertmanager", "mon", stack.alertmanager_argv(
            binaries.alertmanager, am_cfg, out / "alertmanager-data", ALERTMANAGER_PORT, host=addr,
            web_config=web), env, d / "alertmanager.log"))
        self._run(Component("prometheus", "mon", stack.prometheus_argv(
            binaries.prometheus, prom_cfg, out / "prometheus-data", PROMETHEUS_PORT, host=addr,
            web_config=web), env, d / "prometheus.log"))


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""
