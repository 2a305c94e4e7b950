"""The platform an experiment addresses, from its chaostoolkit configuration, and what the
experiment's activities share within one ``chaos run`` (the jobs it got accepted, its state files).

Configuration keys (each falls back to the environment, then to the platform home or the
cluster the API describes):

===================== ======================== ==================================================
key                   environment              meaning
===================== ======================== ==================================================
``apiary_url``        ``APIARY_API_URL``       the control plane: one URL or the replicas' URLs,
                                               comma-separated (default: ``home/run/api_url``,
                                               else the deployment's ``apiUrls``)
``apiary_token``      ``APIARY_TOKEN``         an admin's token (default: the file ``home/token``,
                                               else the deployment's ``tokenFile``)
``apiary_home``       ``APIARY_HOME``          the platform home: run files, pids, the store's disk
``apiary_ca_cert``    ``APIARY_CA_CERT``       the platform CA HTTPS is verified against (default:
                                               the deployment's ``caCert``; none: the system's)
``apiary_deployment`` ``APIARY_DEPLOYMENT``    a many-hosts deployment's root, holding
                                               ``deployment.json`` (:data:`DEPLOYMENT_FILE`)
``apiary_probe_vc``   ``APIARY_CHAOS_VC``      virtual cluster of probe jobs
``apiary_probe_slo``  ``APIARY_CHAOS_SLO_S``   seconds a probe job may take, submit to SUCCEEDED (60)
``apiary_load_vc``    ``APIARY_CHAOS_LOAD_VC`` virtual cluster of the jobs a method keeps in flight
``apiary_fault_node`` ``APIARY_CHAOS_NODE``    the node that gets GPU faults and a cordon
===================== ======================== ==================================================

The last three default to names of the target cluster (:func:`pick_defaults`, read once per run
through the API: ``GET /api/v2/cluster/status`` for the VCs in config order, ``GET
/api/v2/nodes``, and the home's ``cluster.yaml`` for which nodes serve which VC), never to the
names of one example cluster. An empty value (the experiments' default) means "the default".

A deployment (:mod:`apiary.multihost.deployment` writes ``<root>/deployment.json``: the hosts'
root, the replicas' URLs, the CA, the admin token's file, every component's host, argv,
environment, log and pid) is read by :func:`load_deployment`; the actions of
:mod:`apiary.chaos.multihost` need it, the other probes only the URLs, CA and token it gives.

The token is never written to the journal: experiments declare it as ``{"type": "env", "key":
"APIARY_TOKEN"}`` and chaostoolkit keeps only that declaration.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from collections.abc import Mapping
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from apiary.auth.bootstrap import read_token
from apiary.client import ApiaryClient, http_verify, split_api_urls
from apiary.errors import ValidationError
from apiary.scheduler.cells import build_topology
from apiary.spec.cluster import ClusterConfig, load_cluster_config

logger = logging.getLogger(__name__)

DEFAULT_SLO_S = 60.0
#: The environment variable naming a file where the runner wants the accepted jobs written (one id a line).
LEDGER_ENV = "APIARY_CHAOS_LEDGER"
#: The description a many-hosts deployment writes into its root (``Deployment.save``).
DEPLOYMENT_FILE = "deployment.json"


def load_deployment(root: Path) -> dict[str, Any]:
    """``root/deployment.json`` as a dict (keys ``hostsRoot``, ``apiUrls``, ``caCert``,
    ``tokenFile``, ``replicas``, ``nodes``, ``postgres``, ``components``). Raises ValidationError
    (field ``apiary_deployment``) when it is missing or unreadable."""
    path = Path(root) / DEPLOYMENT_FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValidationError("apiary_deployment", f"no deployment described in {path}: {e}") from e
    if not isinstance(doc, dict) or not doc.get("apiUrls"):
        raise ValidationError("apiary_deployment", f"{path} names no control-plane URL (apiUrls)")
    return doc


@dataclass(frozen=True)
class ClusterDefaults:
    """Names an experiment uses when its configuration gives none: ``probe_vc`` (probe jobs),
    ``load_vc`` (the jobs a method keeps in flight) and ``fault_node`` (GPU faults, cordon)."""

    probe_vc: str
    load_vc: str
    fault_node: str


def pick_defaults(vcs: list[str], nodes: list[str], vc_nodes: Mapping[str, list[str]] | None = None) -> ClusterDefaults:
    """The defaults for a cluster of virtual clusters ``vcs`` (config order) and ``nodes`` (the
    API's order); ``vc_nodes``: VC -> the nodes its cells may be bound to (None: unknown, every node).

    The probe VC is the first VC. The fault node is chosen so that cordoning it leaves the probe VC
    a node to run probe jobs on: a node the probe VC cannot use, else the probe VC's last node when
    it has two or more, else its only node (then the gpu-faults experiment's "probe job elsewhere"
    cannot pass, and says so). The load VC is the first VC that can use the fault node, so faults
    meet the load. On Lab 6's two-VC cluster this gives ``default``, ``vc1`` and ``hostname-dan``.
    Raises ValidationError when the cluster has no VC or no node."""
    if not vcs:
        raise ValidationError("apiary_probe_vc", "the target cluster has no virtual cluster")
    if not nodes:
        raise ValidationError("apiary_fault_node", "the target cluster has no node")

    def usable(vc: str) -> list[str]:
        if vc_nodes is None:
            return list(nodes)
        return [n for n in nodes if n in set(vc_nodes.get(vc, ()))]

    probe_vc = vcs[0]
    probe_nodes = usable(probe_vc)
    outside = [n for n in nodes if n not in probe_nodes]
    if outside:
        fault = outside[0]
    elif probe_nodes:
        fault = probe_nodes[-1]
    else:
        fault = nodes[0]
    load_vc = next((vc for vc in vcs if fault in usable(vc)), probe_vc)
    return ClusterDefaults(probe_vc=probe_vc, load_vc=load_vc, fault_node=fault)


def nodes_by_vc(config: ClusterConfig) -> dict[str, list[str]]:
    """VC -> the nodes of the chains its virtual cells and pinned cells are in (the nodes HiveD may
    bind its cells to), in the config's node order."""
    topo = build_topology(config)
    chain_nodes: dict[str, list[str]] = {}
    for name, cells in topo.nodes.items():
        for cell in cells:
            chain_nodes.setdefault(cell.chain, [])
            if name not in chain_nodes[cell.chain]:
                chain_nodes[cell.chain].append(name)
    out: dict[str, list[str]] = {}
    for vc, spec in config.virtual_clusters.items():
        chains = [c.chain for c in spec.virtual_cells]
        chains += [topo.pinned[p.pinned_cell_id].chain for p in spec.pinned_cells if p.pinned_cell_id in topo.pinned]
        out[vc] = [n for chain in dict.fromkeys(chains) for n in chain_nodes.get(chain, [])]
    return out


#: api_url -> the defaults read once per process (one ``chaos run``): a later change of the
#: cluster (an experiment attaching a node) does not move them in the middle of a run.
_defaults: dict[str, ClusterDefaults] = {}


@dataclass(frozen=True)
class Target:
    """Where the platform is. ``home`` is None when neither configuration nor environment names one
    (the actions that need pids or files then refuse, naming ``apiary_home``). ``vc``, ``load``,
    ``node``: the configured probe VC, load VC and fault node (None: the cluster's defaults, read
    from the API when first needed: :attr:`probe_vc`, :attr:`load_vc`, :attr:`fault_node`)."""

    api_url: str
    token: str | None
    home: Path | None
    vc: str | None = None
    probe_slo_s: float = DEFAULT_SLO_S
    load: str | None = None
    node: str | None = None
    ca_cert: Path | None = None
    deployment: Path | None = None

    @property
    def api_urls(self) -> list[str]:
        """Every control-plane URL of :attr:`api_url` (comma-separated replicas)."""
        return split_api_urls(self.api_url)

    @property
    def cluster_file(self) -> Path | None:
        """The cluster config the platform runs: ``home/cluster.yaml``, else (a deployment) the
        first replica's home's; None when neither is known."""
        if self.home is not None:
            return self.home / "cluster.yaml"
        if self.deployment is not None:
            doc = load_deployment(self.deployment)
            for comp in (doc.get("components") or {}).values():
                home = (comp.get("env") or {}).get("APIARY_HOME")
                if comp.get("host") in (doc.get("replicas") or []) and home:
                    return Path(home) / "cluster.yaml"
        return None

    @property
    def probe_vc(self) -> str:
        return self.vc or self.defaults().probe_vc

    @property
    def load_vc(self) -> str:
        return self.load or self.defaults().load_vc

    @property
    def fault_node(self) -> str:
        return self.node or self.defaults().fault_node

    def defaults(self) -> ClusterDefaults:
        """The target cluster's defaults (:func:`pick_defaults`), read through the API on first use
        in this process; which nodes serve which VC from ``home/cluster.yaml`` when the home is
        known (without it every node counts for every VC)."""
        with _lock:
            known = _defaults.get(self.api_url)
        if known is not None:
            return known
        with closing(self.client()) as c:
            vcs = list(c.cluster_status()["virtualClusters"])
            nodes = [n["name"] for n in c.nodes()]
        config = self.cluster_file
        vc_nodes = nodes_by_vc(load_cluster_config(config)) if config is not None and config.exists() else None
        picked = pick_defaults(vcs, nodes, vc_nodes)
        logger.info("chaos defaults for %s: probe VC %s, load VC %s, fault node %s", self.api_url, picked.probe_vc,
                    picked.load_vc, picked.fault_node)
        with _lock:
            return _defaults.setdefault(self.api_url, picked)

    @classmethod
    def of(cls, configuration: Mapping[str, Any] | None) -> Target:
        """The target of an activity's ``configuration`` (chaostoolkit passes it resolved)."""
        c = dict(configuration or {})

        def pick(key: str, env: str) -> str | None:
            value = c.get(key)
            if value in (None, ""):
                value = os.environ.get(env) or None
            return None if value is None else str(value)

        home_s = pick("apiary_home", "APIARY_HOME")
        home = Path(home_s).expanduser().resolve() if home_s else None
        deployment_s = pick("apiary_deployment", "APIARY_DEPLOYMENT")
        deployment = Path(deployment_s).expanduser().resolve() if deployment_s else None
        described = load_deployment(deployment) if deployment is not None else {}
        url = pick("apiary_url", "APIARY_API_URL")
        if url is None and home is not None and (home / "run" / "api_url").exists():
            url = (home / "run" / "api_url").read_text().strip()
        if url is None and described:
            url = ",".join(described["apiUrls"])
        if not url:
            raise ValidationError("apiary_url", "no platform: set APIARY_API_URL, or APIARY_HOME of a running one, "
                                                "or APIARY_DEPLOYMENT of a deployment")
        token = pick("apiary_token", "APIARY_TOKEN")
        if token is None and home is not None:
            token = read_token(home / "token")
        if token is None and described.get("tokenFile"):
            token = read_token(Path(described["tokenFile"]))
        ca = pick("apiary_ca_cert", "APIARY_CA_CERT") or described.get("caCert")
        slo = pick("apiary_probe_slo", "APIARY_CHAOS_SLO_S")
        return cls(api_url=",".join(split_api_urls(url)), token=token, home=home,
                   vc=pick("apiary_probe_vc", "APIARY_CHAOS_VC"), probe_slo_s=float(slo) if slo else DEFAULT_SLO_S,
                   load=pick("apiary_load_vc", "APIARY_CHAOS_LOAD_VC"),
                   node=pick("apiary_fault_node", "APIARY_CHAOS_NODE"),
                   ca_cert=Path(ca).expanduser() if ca else None, deployment=deployment)

    def client(self, timeout: float = 30.0) -> ApiaryClient:
        """A client of every replica of :attr:`api_url` (it fails over between them), verifying
        HTTPS against :attr:`ca_cert`."""
        return ApiaryClient(self.api_url, timeout=timeout, token=self.token, ca_cert=self.ca_cert)

    def request(self, method: str, path: str, *, json_body: Any = None, timeout: float = 30.0) -> httpx.Response:
        """``method path`` (with the admin token) on the first replica that can be reached, in
        :attr:`api_urls` order, verifying HTTPS against :attr:`ca_cert`; a connection that cannot
        be made moves on to the next replica (a follower forwards what it does not serve).
        Returns the answer, whatever its status; raises httpx.HTTPError when no replica answers."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        last: httpx.TransportError | None = None
        with httpx.Client(verify=http_verify(self.ca_cert), timeout=timeout, headers=headers) as http:
            for url in self.api_urls:
                try:
                    return http.request(method, url + path, json=json_body)
                except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                    last = e
                except httpx.TransportError as e:
                    if method.upper() != "GET":
                        raise
                    last = e
        assert last is not None
        raise last

    def need_home(self) -> Path:
        if self.home is None:
            raise ValidationError("apiary_home", "this activity needs the platform home: set APIARY_HOME")
        return self.home

    def state_dir(self) -> Path:
        """``home/run/chaos`` (a deployment without a home: ``<deployment>/chaos``): what an action
        leaves for its undo (frozen pids, fill files, netns resources, a cut route), so an
        operator can finish a rollback by hand after a crash."""
        if self.home is None and self.deployment is not None:
            d = self.deployment / "chaos"
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            return d
        d = self.need_home() / "run" / "chaos"
        d.mkdir(parents=True, exist_ok=True)
        return d


# ------------------------------------------------------------------------------ shared state
_lock = threading.Lock()
_accepted: list[str] = []


def record_accepted(job_id: str) -> None:
    """Remember a job the platform accepted (202) during this run, for ``no_accepted_job_lost`` and
    ``no_task_ran_twice``; also appended to the runner's ledger file when it asked for one."""
    with _lock:
        _accepted.append(job_id)
    path = os.environ.get(LEDGER_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(job_id + "\n")


def accepted_jobs() -> list[str]:
    with _lock:
        return list(_accepted)


def save_state(target: Target, name: str, doc: dict) -> Path:
    path = target.state_dir() / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def load_state(target: Target, name: str) -> dict | None:
    path = target.state_dir() / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def drop_state(target: Target, name: str) -> None:
    (target.state_dir() / f"{name}.json").unlink(missing_ok=True)


# ------------------------------------------------------------------------------ jobs
def unique_name(prefix: str) -> str:
    """``<prefix>-<8 hex>``: job names never repeat across runs on one platform."""
    return f"{prefix}-{secrets.token_hex(4)}"


def job_text(name: str, vc: str, commands: list[str], *, priority: str = "prod", gpu: int = 1,
             retries: int = 0, role: str = "probe") -> str:
    """A one-instance OpenPAI v2 job (YAML) for the process runtime."""
    doc = {
        "protocolVersion": 2,
        "name": name,
        "type": "job",
        "jobRetryCount": retries,
        "prerequisites": [{"protocolVersion": 2, "name": "image-0", "type": "dockerimage", "uri": "python:3.11"}],
        "taskRoles": {role: {
            "instances": 1,
            "dockerImage": "image-0",
            "resourcePerInstance": {"gpu": gpu, "cpu": 1, "memoryMB": 512},
            "commands": list(commands),
        }},
        "defaults": {"virtualCluster": vc},
        "extras": {"hivedScheduler": {"jobPriorityClass": priority}},
    }
    return yaml.safe_dump(doc, sort_keys=False)
