"""Render Apiary's Kubernetes manifests from a values file.

:func:`render` in four steps:

1. load and check the values (:func:`load_values`: YAML, :class:`Values`; an unknown key or a bad
   value is a :class:`~apiary.errors.ValidationError` naming it, e.g. ``controlPlane.replicas``);
2. read what the manifests embed: the HiveD cluster config (checked with
   :func:`apiary.spec.cluster.load_cluster_config`), Prometheus' config and rules from
   ``deploy/prometheus`` and Alertmanager's from ``deploy/alertmanager``, with only the values their
   ``# apiary:`` markers name changed for the cluster (addresses, token file, email) and the node
   agents discovered through the Kubernetes API instead of a file;
3. render every ``templates/*.yaml.j2`` of this package (Jinja2, undefined names are errors;
   ``_*.j2`` files hold macros);
4. write one file per manifest, ``NN-<kind>-<name>.yaml`` (``NN`` orders namespaces before the
   objects in them, so ``kubectl apply -f OUT`` works), after removing the files an earlier
   render wrote there, and ``NOTES.txt``: the Secrets the manifests reference (the platform CA,
   the TLS certificates with the names they must carry, one bootstrap token per node) and the
   commands that make them (:func:`notes`).

The many-machines design: the control plane is a StatefulSet of ``controlPlane.replicas``
(default 2) that elect a leader on the store's lease, spread over nodes, with a
PodDisruptionBudget; every hop is HTTPS verified against the platform CA (the Prefect server
behind an nginx TLS terminator); agents join with a per-node bootstrap token and keep the
credential on their node. ``templates/*.yaml.j2`` say why each choice.

Relative paths in the values file are relative to the file. Paths are read, never written,
except under ``out_dir``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Literal

import jinja2
import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from apiary.errors import PlatformError, ValidationError
from apiary.spec.cluster import load_cluster_config
from apiary.spec.safeyaml import load as safe_load_yaml
from apiary.tracking.prefect_server import SERVER_TUNING, prefect_env

logger = logging.getLogger(__name__)

#: The source checkout's ``deploy/`` (Prometheus and Alertmanager configs); an installed package
#: has none, and the values must then name copies (``prometheus.configDir``, ...).
REPO_DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
TEMPLATES = "templates"
#: First line of every file :func:`render` writes; a later render removes the files that have it.
HEADER = "# Rendered by `apiary deploy render`"
NOTES_HEADER = f"{HEADER} from the values"
#: The file beside the manifests that says which Secrets to create and how.
NOTES_FILE = "NOTES.txt"
CONTROL_PLANE_PORT = 8470  # `apiary control-plane --port`
PREFECT_PORT = 4200
PROMETHEUS_PORT = 9090
ALERTMANAGER_PORT = 9093
#: The order manifests are applied in (``kubectl apply -f DIR`` reads files by name).
KIND_ORDER = {
    "Namespace": 0, "ServiceAccount": 10, "ClusterRole": 11, "ClusterRoleBinding": 12, "Role": 13,
    "RoleBinding": 14, "ConfigMap": 20, "PersistentVolumeClaim": 21, "Service": 30, "PodDisruptionBudget": 31,
    "StatefulSet": 40, "Deployment": 40, "DaemonSet": 41,
}
#: A node's bootstrap token, kubeadm's format ``[a-z0-9]{6}.[a-z0-9]{16}`` (never in a manifest).
BOOTSTRAP_TOKEN_RE = r"[a-z0-9]{6}\.[a-z0-9]{16}"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


# ---------------------------------------------------------------------- 1. values
class _Model(BaseModel):
    """Values use Kubernetes' camelCase spelling; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, frozen=True)


class SecretRef(_Model):
    """A key of a Secret in the platform namespace (created by the operator, never rendered)."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$")


Quantity = str | int | float


class Resources(_Model):
    """Container resources, Kubernetes quantities (``cpu: 500m``, ``memory: 1Gi``)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


def _resources(cpu: str, memory: str, cpu_limit: str, memory_limit: str) -> Resources:
    return Resources(requests={"cpu": cpu, "memory": memory}, limits={"cpu": cpu_limit, "memory": memory_limit})


class Storage(_Model):
    """A writable directory: a PersistentVolumeClaim (``persistent: true``) or an emptyDir (lost with the pod)."""

    persistent: bool = False
    size: str = "1Gi"
    storage_class_name: str | None = Field(default=None, description="None: the cluster's default StorageClass.")


class Image(_Model):
    """Apiary's images are ``{registry}/apiary/{control-plane,agent,prefect}:{tag}``."""

    registry: str = "localhost:5000"
    tag: str = "0.1.0"
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    pull_secrets: list[str] = Field(default_factory=list, description="imagePullSecrets of Apiary's pods.")


class SecurityContext(_Model):
    """The non-root user Apiary's containers run as (Prometheus and Alertmanager have their own)."""

    run_as_user: int = Field(default=10001, ge=1)
    run_as_group: int = Field(default=10001, ge=1)
    fs_group: int = Field(default=10001, ge=1)


PodSecurityLevel = Literal["privileged", "baseline", "restricted"]


class PodSecurity(_Model):
    """Pod Security Standards enforced on the namespaces (``pod-security.kubernetes.io/enforce``)."""

    platform: PodSecurityLevel = "restricted"
    #: The tasks' pods share their node's network (hostNetwork, as OpenPAI's), which "baseline" refuses.
    jobs: PodSecurityLevel = "privileged"
    #: The agents keep their joined credential in a hostPath directory, which "baseline" refuses
    #: (Pod Security Standards: "HostPath volumes must be forbidden" from baseline up).
    agents: PodSecurityLevel = "privileged"


class Namespaces(_Model):
    platform: str = Field(default="apiary", pattern=_DNS_LABEL, max_length=63,
                          description="Control plane, agents, Prefect, monitoring.")
    jobs: str = Field(default="apiary-jobs", pattern=_DNS_LABEL, max_length=63,
                      description="Where the agents run the tasks' pods (and their registry secrets).")
    agents: str = Field(default="apiary-agents", pattern=_DNS_LABEL, max_length=63,
                        description="The agents' DaemonSet and its Secrets (a hostPath needs Pod Security privileged).")
    create: bool = Field(default=True, description="Render the three Namespace objects.")
    pod_security: PodSecurity = Field(default_factory=PodSecurity)

    @model_validator(mode="after")
    def _distinct(self) -> Namespaces:
        if len({self.platform, self.jobs, self.agents}) < 3:
            raise ValueError("platform, jobs and agents must be three different namespaces")
        return self


class ClusterConfigSource(_Model):
    """The HiveD cluster config: exactly one of ``file`` (a path) or ``inline`` (YAML text)."""

    file: Path | None = None
    inline: str | None = None

    @model_validator(mode="after")
    def _one(self) -> ClusterConfigSource:
        if (self.file is None) == (self.inline is None):
            raise ValueError("set exactly one of file and inline")
        return self


class LeaderElection(_Model):
    """The leader lease's timings, client-go leader election's parameters (settings
    ``lease_duration_s``, ``renew_deadline_s``, ``retry_period_s``). client-go's
    ``NewLeaderElector`` requires ``leaseDuration > renewDeadline > 1.2 * retryPeriod`` (its
    JitterFactor); Kubernetes' components default to 15 s / 10 s / 2 s, Apiary to 6 / 4 / 1 so a
    killed leader is replaced within 10 s."""

    lease_duration_s: float = Field(default=6.0, gt=0, le=300)
    renew_deadline_s: float = Field(default=4.0, gt=0, le=300)
    retry_period_s: float = Field(default=1.0, gt=0, le=60)

    @model_validator(mode="after")
    def _ordered(self) -> LeaderElection:
        if not self.lease_duration_s > self.renew_deadline_s:
            raise ValueError("leaseDurationS must be greater than renewDeadlineS")
        if not self.renew_deadline_s > 1.2 * self.retry_period_s:
            raise ValueError("renewDeadlineS must be greater than 1.2 x retryPeriodS (client-go's JitterFactor)")
        return self


#: Environment the manifests set on the control plane; ``controlPlane.env`` may not.
CONTROL_PLANE_MANAGED_ENV = frozenset({
    "APIARY_HOME", "APIARY_DATABASE_URL", "HOME", "APIARY_LEADER_ELECT", "APIARY_LEASE_DURATION_S",
    "APIARY_RENEW_DEADLINE_S", "APIARY_RETRY_PERIOD_S", "APIARY_ADVERTISE_URL", "APIARY_REPLICA_ID",
    "APIARY_CA_CERT", "APIARY_TLS_CERT", "APIARY_TLS_KEY", "PGSSLMODE", "PGSSLROOTCERT",
})


class ControlPlane(_Model):
    replicas: int = Field(default=2, ge=1, le=9,
                          description="Replicas; one leader at a time, elected by the lease in PostgreSQL.")
    leader_election: LeaderElection = Field(default_factory=LeaderElection)
    anti_affinity: Literal["required", "preferred"] = Field(
        default="required", description="Replicas on different nodes: always (required) or when there is room.")
    home: Storage = Field(default_factory=lambda: Storage(persistent=True),
                          description="APIARY_HOME of each replica (its own claim): cluster id, task logs.")
    database: SecretRef = Field(default_factory=lambda: SecretRef(name="apiary-database", key="url"),
                                description="APIARY_DATABASE_URL (postgresql+psycopg://...).")
    env: dict[str, str] = Field(default_factory=dict, description="More APIARY_* settings (apiary.settings).")
    resources: Resources = Field(default_factory=lambda: _resources("250m", "512Mi", "2", "2Gi"))

    @field_validator("env")
    @classmethod
    def _not_managed(cls, env: dict[str, str]) -> dict[str, str]:
        managed = sorted(set(env) & CONTROL_PLANE_MANAGED_ENV)
        if managed:
            raise ValueError(f"{', '.join(managed)} is set by the manifests (controlPlane.*, tls)")
        return env


class Tls(_Model):
    """The platform CA and the serving certificates: Secrets the operator creates from
    ``apiary ca init`` / ``apiary ca issue`` output (never rendered; NOTES.txt of a render gives
    the commands). Only the CA's certificate is ever mounted, never its key."""

    ca: SecretRef = Field(default_factory=lambda: SecretRef(name="apiary-ca", key="ca.crt"),
                          description="The platform CA's certificate, in the platform and agents namespaces.")
    control_plane_secret: str = Field(
        default="apiary-control-plane-tls", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="kubernetes.io/tls Secret (tls.crt, tls.key) of the control plane's HTTPS.")
    prefect_secret: str = Field(
        default="apiary-prefect-tls", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="kubernetes.io/tls Secret of the Prefect server's TLS terminator.")


class Agent(_Model):
    node_selector: dict[str, str] = Field(default_factory=lambda: {"nvidia.com/gpu.present": "true"})
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    )
    bootstrap_tokens_secret: str = Field(
        default="apiary-bootstrap-tokens", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Secret in the agents namespace, one key per node (the node's name): its bootstrap token.")
    ca_cert_hash: str | None = Field(
        default=None, pattern=r"^sha256:[0-9a-f]{64}$",
        description="The platform CA's pin for `apiary agent join --ca-cert-hash`; required.")
    credentials_host_path: str | None = Field(
        default=None, pattern=r"^/[-._a-zA-Z0-9/]*[-._a-zA-Z0-9]$",
        description="The node's directory for the joined credential; None: /var/lib/<instance>/credentials.")
    metrics_port: int = Field(default=9470, ge=1, le=65535)
    metrics_host: str | None = Field(
        default=None, description="Passed as --metrics-host (needs that option of apiary agent); None: not passed.")
    simulated_gpus: bool = Field(default=False, description="--simulated-gpus: advertise the config's GPUs.")
    runtime_class_name: str | None = Field(default=None, description="e.g. nvidia, where that is not the default.")
    resources: Resources = Field(default_factory=lambda: _resources("100m", "256Mi", "1", "1Gi"))


class TlsProxy(_Model):
    """The TLS terminator in front of the Prefect server, which serves plain HTTP only: nginx
    (the upstream image is Debian-based) in the server's pod, the server on loopback behind it."""

    image: str = "nginx:1.27-bookworm"
    run_as_user: int = Field(default=101, ge=1, description="The image's nginx user.")
    resources: Resources = Field(default_factory=lambda: _resources("50m", "32Mi", "500m", "128Mi"))


class Prefect(_Model):
    enabled: bool = Field(default=True, description="The Prefect server and the bridge.")
    auth: SecretRef = Field(default_factory=lambda: SecretRef(name="apiary-prefect-auth", key="auth"),
                            description="Basic auth user:password of the server's API and UI.")
    database: SecretRef | None = Field(default=None,
                                       description="postgresql+asyncpg://... URL; None: SQLite in home.")
    home: Storage = Field(default_factory=Storage)
    ui_api_url: str = Field(default="https://localhost:4200/api",
                            description="The API URL the browser calls (default: kubectl port-forward).")
    resources: Resources = Field(default_factory=lambda: _resources("250m", "512Mi", "2", "2Gi"))
    tls_proxy: TlsProxy = Field(default_factory=lambda: TlsProxy())


class Bridge(_Model):
    token: SecretRef = Field(default_factory=lambda: SecretRef(name="apiary-bridge-token", key="token"))
    concurrency: int = Field(default=2, ge=1, le=64, description="8 with a PostgreSQL-backed Prefect server.")
    resources: Resources = Field(default_factory=lambda: _resources("100m", "256Mi", "1", "1Gi"))


class Prometheus(_Model):
    enabled: bool = True
    image: str = "prom/prometheus:v2.42.0"
    config_dir: Path | None = Field(default=None, description="A copy of deploy/prometheus; None: the checkout's.")
    scrape_interval: str | None = Field(default=None, description="None: deploy/prometheus' value.")
    evaluation_interval: str | None = None
    cluster_label: str | None = Field(default=None, description="external_labels.cluster; None: deploy's.")
    retention: str = "15d"
    storage: Storage = Field(default_factory=Storage)
    run_as_user: int = Field(default=65534, ge=1, description="The image's user (nobody).")
    resources: Resources = Field(default_factory=lambda: _resources("250m", "512Mi", "2", "4Gi"))


class Alertmanager(_Model):
    enabled: bool = True
    image: str = "prom/alertmanager:v0.25.0"
    config_file: Path | None = Field(default=None, description="deploy/alertmanager/alertmanager.yml or a copy.")
    token: SecretRef = Field(default_factory=lambda: SecretRef(name="apiary-alertmanager-token", key="token"),
                             description="Apiary's alertmanager service token (the webhook's bearer).")
    smtp_smarthost: str | None = Field(default=None, description="host:port; None: deploy's value.")
    smtp_from: str | None = None
    oncall_email: str | None = None
    run_as_user: int = Field(default=65534, ge=1)
    resources: Resources = Field(default_factory=lambda: _resources("50m", "64Mi", "500m", "256Mi"))


class Values(_Model):
    """The values file (``deploy/kubernetes/values.yaml`` documents each key)."""

    kubernetes_version: str = Field(default="1.30.0", pattern=r"^\d+\.\d+\.\d+$",
                                    description="The version the manifests are validated against.")
    instance: str = Field(default="apiary", pattern=_DNS_LABEL, max_length=30,
                          description="Prefix of every name; app.kubernetes.io/instance.")
    namespaces: Namespaces = Field(default_factory=Namespaces)
    image: Image = Field(default_factory=Image)
    security_context: SecurityContext = Field(default_factory=SecurityContext)
    cluster_config: ClusterConfigSource
    tls: Tls = Field(default_factory=Tls)
    control_plane: ControlPlane = Field(default_factory=ControlPlane)
    agent: Agent = Field(default_factory=Agent)
    prefect: Prefect = Field(default_factory=Prefect)
    bridge: Bridge = Field(default_factory=Bridge)
    prometheus: Prometheus = Field(default_factory=Prometheus)
    alertmanager: Alertmanager = Field(default_factory=Alertmanager)


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def load_values(path: Path) -> Values:
    """The values in ``path``. Raises ValidationError naming the field (``values`` for the file itself)."""
    try:
        text = Path(path).read_bytes()
    except OSError as e:
        raise ValidationError("values", f"cannot read {path}: {e}") from e
    data = safe_load_yaml(text, field="values", what="values file")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValidationError("values", "the values file must be a mapping")
    try:
        return Values.model_validate(data)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        field = _field_path(tuple(first["loc"]))
        reason = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        more = len(e.errors()) - 1
        raise ValidationError(field, reason + (f" (and {more} more errors)" if more else "")) from e


# ---------------------------------------------------------------------- 2. embedded configs
def _resolve(base: Path, p: Path) -> Path:
    return p if p.is_absolute() else base / p


def _read_text(path: Path, field: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValidationError(field, f"cannot read {path}: {e}") from e


def _names(v: Values) -> dict[str, str]:
    i = v.instance
    return {
        "controlPlane": f"{i}-control-plane", "agent": f"{i}-agent", "prefectServer": f"{i}-prefect-server",
        "bridge": f"{i}-prefect-bridge", "prometheus": f"{i}-prometheus", "alertmanager": f"{i}-alertmanager",
        "clusterConfig": f"{i}-cluster-config", "agentNodes": f"{i}-{v.namespaces.platform}-agent-read-nodes",
        "controlPlanePeers": f"{i}-control-plane-peers", "prefectTlsProxy": f"{i}-prefect-tls-proxy",
    }


def _svc(name: str, v: Values, port: int) -> str:
    return f"{name}.{v.namespaces.platform}.svc:{port}"


#: How an admin computes the CA pin from ca.crt, as kubeadm documents for its
#: --discovery-token-ca-cert-hash (the SHA-256 of the DER SubjectPublicKeyInfo; apiary.pki.ca_cert_hash).
CA_HASH_COMMAND = ("openssl x509 -in {ca_crt} -noout -pubkey | openssl pkey -pubin -outform der | sha256sum "
                   "| sed 's/^/sha256:/; s/ .*//'")
#: Where every pod that verifies the control plane (or Prefect) mounts the platform CA's certificate.
CA_DIR = "/etc/apiary/ca"
#: Where the control plane and the Prefect TLS terminator mount their kubernetes.io/tls Secret.
TLS_DIR = "/etc/apiary/tls"


def ca_file(v: Values) -> str:
    """The path of the platform CA's certificate in the pods (its Secret key under :data:`CA_DIR`)."""
    return f"{CA_DIR}/{v.tls.ca.key}"


def replica_hosts(v: Values) -> list[str]:
    """The control-plane replicas' stable DNS names (StatefulSet pod ``<name>-<ordinal>`` under
    the headless peers Service): what each advertises and the followers forward writes to."""
    names = _names(v)
    return [f"{names['controlPlane']}-{n}.{names['controlPlanePeers']}.{v.namespaces.platform}.svc"
            for n in range(v.control_plane.replicas)]


def control_plane_hosts(v: Values) -> list[str]:
    """The names the control plane's serving certificate must carry (its SANs): the Service's
    short, namespaced and ``.svc`` names, then every replica's peer name."""
    name, ns = _names(v)["controlPlane"], v.namespaces.platform
    return [name, f"{name}.{ns}", f"{name}.{ns}.svc", *replica_hosts(v)]


def prefect_hosts(v: Values) -> list[str]:
    """The Prefect server's certificate's names: its Service's, and localhost for
    ``kubectl port-forward`` (the default ``prefect.uiApiUrl``)."""
    name, ns = _names(v)["prefectServer"], v.namespaces.platform
    return [name, f"{name}.{ns}", f"{name}.{ns}.svc", "localhost"]


def cluster_config_text(v: Values, base: Path) -> str:
    """The cluster config's YAML, checked as the control plane will check it."""
    src = v.cluster_config
    if src.file is not None:
        text = _read_text(_resolve(base, src.file), "clusterConfig.file")
        field = "clusterConfig.file"
    else:
        text, field = src.inline or "", "clusterConfig.inline"
    try:
        load_cluster_config(text)
    except ValidationError as e:
        raise ValidationError(field, f"not a valid HiveD cluster config: {e.message}") from e
    return text


def _source_dir(configured: Path | None, base: Path, default: Path, field: str) -> Path:
    path = _resolve(base, configured) if configured is not None else default
    if not path.exists():
        raise ValidationError(field, f"{path} does not exist (point it at a copy of the checkout's deploy/ files)")
    return path


def _generated(what: str) -> str:
    return (f"# Generated by `apiary deploy render` from {what}:\n"
            "# the values its `# apiary:` markers name are set for this Kubernetes cluster, see\n"
            "# deploy/kubernetes/README.md; everything else is as shipped.\n")


def prometheus_files(v: Values, base: Path, names: dict[str, str]) -> dict[str, str]:
    """The Prometheus ConfigMap's data: ``prometheus.yml`` and each rule file (key = its file name,
    mounted at ``rules/<name>``, the path ``rule_files`` names). The rule files are copied byte for
    byte; in ``prometheus.yml`` only the marked values change, and the ``apiary-node`` job finds the
    agent pods with ``kubernetes_sd_configs`` (agents namespace only) instead of a targets file,
    taking ``node`` from the pod's node name. The control plane is scraped over HTTPS, verified
    against the platform CA (:func:`ca_file`)."""
    src = _source_dir(v.prometheus.config_dir, base, REPO_DEPLOY / "prometheus", "prometheus.configDir")
    text = _read_text(src / "prometheus.yml", "prometheus.configDir")
    cfg = yaml.safe_load(text)
    p = v.prometheus
    glob = cfg.setdefault("global", {})
    if p.scrape_interval:
        glob["scrape_interval"] = p.scrape_interval
    if p.evaluation_interval:
        glob["evaluation_interval"] = p.evaluation_interval
    if p.cluster_label:
        glob.setdefault("external_labels", {})["cluster"] = p.cluster_label
    rules: dict[str, str] = {}
    rule_files = []
    for entry in cfg.get("rule_files") or []:
        for path in sorted(src.glob(entry)) if any(c in entry for c in "*?[") else [src / entry]:
            if path.name in rules or path.name == "prometheus.yml":
                raise ValidationError("prometheus.configDir", f"two rule files are named {path.name}")
            rules[path.name] = _read_text(path, "prometheus.configDir")
            rule_files.append(f"rules/{path.name}")
    cfg["rule_files"] = rule_files
    if v.alertmanager.enabled:
        target = _svc(names["alertmanager"], v, ALERTMANAGER_PORT)
        cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [target]}]}]}
    else:
        cfg.pop("alerting", None)
    jobs = {job.get("job_name"): job for job in cfg.get("scrape_configs") or []}
    for needed in ("apiary-control-plane", "apiary-node"):
        if needed not in jobs:
            raise ValidationError("prometheus.configDir", f"prometheus.yml has no scrape job {needed}")
    control_plane_job = jobs["apiary-control-plane"]
    control_plane_job["static_configs"] = [
        {"targets": [_svc(names["controlPlane"], v, CONTROL_PLANE_PORT)]}
    ]
    # The control plane serves HTTPS only; Prometheus verifies it against the platform CA, as it
    # does any other job deploy/ gives a CA file (the pods mount the CA at ca_file(v)).
    control_plane_job["scheme"] = "https"
    control_plane_job.setdefault("tls_config", {})["ca_file"] = ca_file(v)
    for job in jobs.values():
        if isinstance(job.get("tls_config"), dict) and "ca_file" in job["tls_config"]:
            job["tls_config"]["ca_file"] = ca_file(v)
    node_job = jobs["apiary-node"]
    discovery = [{
        "role": "pod",
        "namespaces": {"names": [v.namespaces.agents]},
        "selectors": [{"role": "pod", "label": f"app.kubernetes.io/instance={v.instance},"
                                                "app.kubernetes.io/component=agent"}],
    }]
    from_pods = [
        # One target per agent pod: its metrics port, not the other ports it may declare.
        {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics", "action": "keep"},
        # The node's name as the control plane knows it (the agent's --node is spec.nodeName).
        {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"},
    ]
    rebuilt: dict[str, Any] = {}
    for key, value in node_job.items():
        if key in ("file_sd_configs", "static_configs"):
            rebuilt["kubernetes_sd_configs"] = discovery
        elif key == "relabel_configs":
            rebuilt[key] = from_pods + list(value or [])
        else:
            rebuilt[key] = value
    rebuilt.setdefault("kubernetes_sd_configs", discovery)
    rebuilt.setdefault("relabel_configs", from_pods)
    node_job.clear()
    node_job.update(rebuilt)
    out = {"prometheus.yml": _generated("deploy/prometheus/prometheus.yml") + yaml.safe_dump(cfg, sort_keys=False)}
    out.update(rules)
    return out


#: Where the Alertmanager pod mounts its token Secret.
ALERTMANAGER_TOKEN_DIR = "/etc/alertmanager/token"


def alertmanager_config(v: Values, base: Path, names: dict[str, str]) -> str:
    """``alertmanager.yml`` from deploy/alertmanager: the webhook goes to the control-plane Service
    over HTTPS (``tls_config.ca_file``: the platform CA) with the token Secret as bearer; SMTP,
    sender and on-call address from the values when set."""
    a = v.alertmanager
    path = _source_dir(a.config_file, base, REPO_DEPLOY / "alertmanager" / "alertmanager.yml",
                       "alertmanager.configFile")
    cfg = yaml.safe_load(_read_text(path, "alertmanager.configFile"))
    glob = cfg.setdefault("global", {})
    if a.smtp_smarthost:
        glob["smtp_smarthost"] = a.smtp_smarthost
    if a.smtp_from:
        glob["smtp_from"] = a.smtp_from
    webhook = f"https://{_svc(names['controlPlane'], v, CONTROL_PLANE_PORT)}/api/v2/alerts/webhook"
    for receiver in cfg.get("receivers") or []:
        for hook in receiver.get("webhook_configs") or []:
            hook["url"] = webhook
            http_config = hook.setdefault("http_config", {})
            auth = http_config.setdefault("authorization", {"type": "Bearer"})
            auth["credentials_file"] = f"{ALERTMANAGER_TOKEN_DIR}/{a.token.key}"
            http_config.setdefault("tls_config", {})["ca_file"] = ca_file(v)
        for mail in receiver.get("email_configs") or []:
            if a.oncall_email:
                mail["to"] = a.oncall_email
    return _generated("deploy/alertmanager/alertmanager.yml") + yaml.safe_dump(cfg, sort_keys=False)


#: The Prefect server listens here, on loopback only; its TLS terminator forwards to it.
PREFECT_LOOPBACK_PORT = 4201


def prefect_tls_proxy_config(v: Values) -> str:
    """``nginx.conf`` of the Prefect server's TLS terminator: HTTPS on :data:`PREFECT_PORT` with
    the ``tls.prefectSecret`` certificate, proxied to the server on 127.0.0.1 (websockets too:
    Prefect's clients stream events over them). nginx runs as a non-root user with a read-only
    root filesystem, so its pid file and temporary files go to ``/tmp`` (an emptyDir)."""
    tls = f"{TLS_DIR}/prefect"
    return f"""# Generated by `apiary deploy render`: the Prefect server's TLS terminator.
worker_processes 1;
pid /tmp/nginx.pid;
error_log stderr notice;

events {{
    worker_connections 1024;
}}

http {{
    access_log off;
    client_body_temp_path /tmp/client_body;
    proxy_temp_path /tmp/proxy;
    fastcgi_temp_path /tmp/fastcgi;
    uwsgi_temp_path /tmp/uwsgi;
    scgi_temp_path /tmp/scgi;
    server_tokens off;
    client_max_body_size 64m;

    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ''      close;
    }}

    server {{
        listen {PREFECT_PORT} ssl;
        ssl_certificate {tls}/tls.crt;
        ssl_certificate_key {tls}/tls.key;
        ssl_protocols TLSv1.2 TLSv1.3;

        location / {{
            proxy_pass http://127.0.0.1:{PREFECT_LOOPBACK_PORT};
            proxy_http_version 1.1;
            proxy_set_header Host $host;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto https;
            proxy_read_timeout 3600s;
            proxy_buffering off;
        }}
    }}
}}
"""


# ---------------------------------------------------------------------- 3. templates
def _json(value: Any) -> str:
    """A scalar (or a small object) as JSON, which is YAML: ``"text"``, ``8470``, ``true``."""
    return json.dumps(value)


def _to_yaml(value: Any, indent: int) -> str:
    """A mapping or list for ``key:{{ value | to_yaml(N) }}``: ``" {}"``/``" []"`` when empty, else
    a newline and the block, every line indented by ``N`` spaces."""
    if not value:
        return " {}" if isinstance(value, dict) else " []"
    block = yaml.safe_dump(value, sort_keys=False, default_flow_style=False).rstrip("\n")
    return "\n" + "\n".join(" " * indent + line for line in block.split("\n"))


def _block(text: str, indent: int) -> str:
    """``text`` for ``key: {{ text | block(N) }}``: a literal block scalar (``|``, lines indented by
    ``N``) that loads back as exactly ``text``, or a JSON string where no block scalar does."""
    if text.endswith("\n\n"):
        chomp = "+"
    elif text.endswith("\n"):
        chomp = ""
    else:
        chomp = "-"
    body = "\n".join((" " * indent + line) if line else "" for line in text.rstrip("\n").split("\n"))
    candidate = f"|{chomp}\n{body}"
    if chomp == "+":
        candidate += "\n" * (len(text) - len(text.rstrip("\n")) - 1)
    try:
        if yaml.safe_load(f"k: {candidate}\n") == {"k": text}:
            return candidate
    except yaml.YAMLError:
        pass
    return json.dumps(text)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("apiary.deploy", TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # YAML, not HTML: values are quoted with the json filter
    )
    env.filters.update({"json": _json, "to_yaml": _to_yaml, "block": _block})
    return env


def _sha256(*texts: str) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
    return h.hexdigest()


def credentials_host_path(v: Values) -> str:
    """The node directory (hostPath) an agent's joined credential is kept in."""
    return v.agent.credentials_host_path or f"/var/lib/{v.instance}/credentials"


def context(v: Values, base: Path) -> dict[str, Any]:
    """What the templates see: ``v`` (the values, camelCase), names, images, URLs and embedded
    configs. Raises ValidationError for ``agent.caCertHash`` when it is not set (the agents cannot
    join without it)."""
    if v.agent.ca_cert_hash is None:
        raise ValidationError("agent.caCertHash", "required: the platform CA's pin for `apiary agent join "
                                                  "--ca-cert-hash`, sha256:<hex> (`apiary ca hash --cert ca.crt`; "
                                                  "`apiary ca init` prints it too)")
    names = _names(v)
    apiary_image = f"{v.image.registry.rstrip('/')}/apiary/{{}}:{v.image.tag}"
    cluster = cluster_config_text(v, base)
    prometheus = prometheus_files(v, base, names) if v.prometheus.enabled else {}
    alertmanager = alertmanager_config(v, base, names) if v.alertmanager.enabled else ""
    tls_proxy = prefect_tls_proxy_config(v) if v.prefect.enabled else ""
    prefect_home = "/var/lib/prefect"
    return {
        "v": v.model_dump(by_alias=True, mode="json"),
        "instance": v.instance,
        "ns": v.namespaces.platform,
        "jobs_ns": v.namespaces.jobs,
        "agents_ns": v.namespaces.agents,
        "names": names,
        "pull_secrets": [{"name": s} for s in v.image.pull_secrets],
        "images": {
            "controlPlane": apiary_image.format("control-plane"), "agent": apiary_image.format("agent"),
            "prefect": apiary_image.format("prefect"), "prometheus": v.prometheus.image,
            "alertmanager": v.alertmanager.image, "tlsProxy": v.prefect.tls_proxy.image,
        },
        "ports": {"controlPlane": CONTROL_PLANE_PORT, "prefect": PREFECT_PORT, "prometheus": PROMETHEUS_PORT,
                  "alertmanager": ALERTMANAGER_PORT, "prefectLoopback": PREFECT_LOOPBACK_PORT},
        "urls": {
            "controlPlane": f"https://{_svc(names['controlPlane'], v, CONTROL_PLANE_PORT)}",
            "prefectApi": f"https://{_svc(names['prefectServer'], v, PREFECT_PORT)}/api",
        },
        "tls": {"caDir": CA_DIR, "caFile": ca_file(v), "dir": TLS_DIR},
        "credentials_host_path": credentials_host_path(v),
        "cluster_config": cluster,
        "prometheus_files": prometheus,
        "alertmanager_config": alertmanager,
        "alertmanager_token_dir": ALERTMANAGER_TOKEN_DIR,
        "prefect_tls_proxy_config": tls_proxy,
        "prefect_home": prefect_home,
        # Apiary's Prefect settings (apiary up's): telemetry off, the server's batch tuning.
        "prefect_env": {k: val for k, val in prefect_env(Path(prefect_home)).items() if k != "PREFECT_HOME"},
        "prefect_server_tuning": SERVER_TUNING,
        "checksums": {
            "cluster": _sha256(cluster),
            "prometheus": _sha256(*(f"{k}\0{t}" for k, t in sorted(prometheus.items()))),
            "alertmanager": _sha256(alertmanager),
            "prefectTlsProxy": _sha256(tls_proxy),
        },
    }


def _render(values_path: Path) -> tuple[Values, str, list[tuple[str, dict[str, Any], str]]]:
    values_path = Path(values_path)
    v = load_values(values_path)
    ctx = context(v, values_path.resolve().parent)
    env = _environment()
    out: list[tuple[str, dict[str, Any], str]] = []
    for name in env.list_templates(filter_func=lambda n: n.endswith(".yaml.j2") and "/" not in n):
        try:
            rendered = env.get_template(name).render(ctx)
        except jinja2.TemplateError as e:
            raise PlatformError(f"template {name}: {e}") from e
        for doc in re.split(r"^---[ \t]*$", rendered, flags=re.MULTILINE):
            try:
                manifest = yaml.safe_load(doc)
            except yaml.YAMLError as e:
                raise PlatformError(f"template {name} rendered invalid YAML: {e}") from e
            if manifest is None:
                continue  # a document the values switched off
            if not isinstance(manifest, dict) or "kind" not in manifest:
                raise PlatformError(f"template {name} rendered a document that is not a Kubernetes object")
            out.append((name, manifest, doc.strip("\n") + "\n"))
    return v, ctx["cluster_config"], out


def render_manifests(values_path: Path) -> list[tuple[str, dict[str, Any], str]]:
    """``(template, manifest, text)`` for every manifest the values give, in template order."""
    return _render(values_path)[2]


def cluster_node_names(cluster_yaml: str) -> list[str]:
    """The node names of a HiveD cluster config (its node-level cells' ``cellAddress``), sorted."""
    cfg = load_cluster_config(cluster_yaml)
    types = cfg.physical_cluster.cell_types
    found: set[str] = set()

    def walk(cell: Any, expected: str | None) -> None:
        cell_type = types.get(cell.cell_type or expected or "")
        if cell_type is None:
            return  # a leaf cell
        if cell_type.is_node_level:
            found.add(str(cell.cell_address))
            return
        for child in cell.cell_children:
            walk(child, cell_type.child_cell_type)

    for top in cfg.physical_cluster.physical_cells:
        walk(top, None)
    return sorted(found)


def notes(v: Values, nodes: list[str]) -> str:
    """NOTES.txt of a render: the Secrets the manifests reference, and the commands that make
    them, in order (certificates with the names these manifests connect to, the CA pin, one
    bootstrap token per node of the cluster config). ``kubectl apply -f DIR`` skips it (not YAML)."""
    names, ns, agents_ns = _names(v), v.namespaces.platform, v.namespaces.agents
    cp_hosts = " ".join(f"--host {h}" for h in control_plane_hosts(v))
    pf_hosts = " ".join(f"--host {h}" for h in prefect_hosts(v))
    ca = v.tls.ca
    token_lines = "\n".join(
        f"    --from-literal={n}=\"$(apiary node bootstrap-token create --ttl 1h --node {n})\" \\" for n in nodes)
    return f"""{NOTES_HEADER}; change the values, not this file.

Apply order: the Secrets of steps 1-3, then `kubectl apply -f .`, then steps 4-5.
The manifests reference these Secrets and never contain them.

1. The platform CA, on an admin's machine (its key never enters the cluster; only ca.crt does):

  apiary ca init --dir ./ca
  # its pin, values agent.caCertHash (kubeadm's --discovery-token-ca-cert-hash), printed by
  # `apiary ca init` and by `apiary ca hash --cert ./ca/ca.crt`; without apiary:
  {CA_HASH_COMMAND.format(ca_crt="./ca/ca.crt")}
  # this render pins {v.agent.ca_cert_hash}

2. Serving certificates signed by it, with the names the clients connect to (the Service, and
   each control-plane replica's peer name, which the followers forward writes to):

  apiary ca issue control-plane --dir ./ca --out ./certs {cp_hosts}
  apiary ca issue prefect --dir ./ca --out ./certs {pf_hosts}

3. Secrets (kubernetes.io/tls for the serving certificates; the CA's certificate in both namespaces):

  kubectl -n {ns} create secret generic {ca.name} --from-file={ca.key}=./ca/ca.crt
  kubectl -n {agents_ns} create secret generic {ca.name} --from-file={ca.key}=./ca/ca.crt
  kubectl -n {ns} create secret tls {v.tls.control_plane_secret} \\
    --cert=./certs/control-plane.crt --key=./certs/control-plane.key
  kubectl -n {ns} create secret tls {v.tls.prefect_secret} --cert=./certs/prefect.crt --key=./certs/prefect.key
  # PostgreSQL over TLS, verified against the platform CA (PGSSLMODE=verify-full and PGSSLROOTCERT
  # are set in the pods as well; parameters in the URL win):
  kubectl -n {ns} create secret generic {v.control_plane.database.name} \\
    --from-literal={v.control_plane.database.key}='postgresql+psycopg://apiary:PASSWORD@HOST:5432/apiary?sslmode=verify-full&sslrootcert={ca_file(v)}'
  kubectl -n {ns} create secret generic {v.prefect.auth.name} \\
    --from-literal={v.prefect.auth.key}="apiary:$(openssl rand -hex 16)"

4. When {names["controlPlane"]} is ready: one bootstrap token per node (a token joins once;
   key = the node's name). Each agent pod's init container joins with its node's token within
   the TTL and keeps the credential in {credentials_host_path(v)} on the node (0700), so a
   restarted or upgraded agent pod does not join again; the Secret may be deleted afterwards.

  kubectl -n {agents_ns} create secret generic {v.agent.bootstrap_tokens_secret} \\
{token_lines}
    --dry-run=client -o yaml | kubectl apply -f -

5. The bridge's and Alertmanager's service tokens (APIARY_HOME/credentials of a replica):

  kubectl -n {ns} cp {names["controlPlane"]}-0:/var/lib/apiary/credentials ./credentials
  kubectl -n {ns} create secret generic {v.bridge.token.name} \\
    --from-file={v.bridge.token.key}=./credentials/bridge.token
  kubectl -n {ns} create secret generic {v.alertmanager.token.name} \\
    --from-file={v.alertmanager.token.key}=./credentials/alertmanager.token
"""


# ---------------------------------------------------------------------- 4. files
def manifest_filename(manifest: dict[str, Any]) -> str:
    kind = str(manifest["kind"])
    return f"{KIND_ORDER.get(kind, 50):02d}-{kind.lower()}-{manifest['metadata']['name']}.yaml"


def render(values_path: Path, out_dir: Path) -> list[Path]:
    """Render the manifests the values in ``values_path`` give into ``out_dir`` (created), one file
    per manifest, and return their paths in apply order; :data:`NOTES_FILE` beside them says
    which Secrets to create (:func:`notes`). Files an earlier render wrote in ``out_dir`` (they
    start with :data:`HEADER`) are removed first; other files are left alone.

    Raises ValidationError (bad values, unreadable or invalid cluster config, missing deploy/
    files; ``field`` names the value) and PlatformError (a template that renders invalid YAML, two
    manifests with one file name).
    """
    v, cluster, manifests = _render(values_path)
    files: dict[str, str] = {}
    for template, manifest, text in manifests:
        filename = manifest_filename(manifest)
        if filename in files:
            raise PlatformError(f"two manifests would be written to {filename} (template {template})")
        files[filename] = f"{HEADER} from {template}; change the values, not this file.\n{text}"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.yaml"):
        with old.open(encoding="utf-8", errors="replace") as f:
            if f.readline().startswith(HEADER):
                old.unlink()
    paths = []
    for filename in sorted(files):
        path = out_dir / filename
        path.write_text(files[filename], encoding="utf-8")
        paths.append(path)
    (out_dir / NOTES_FILE).write_text(notes(v, cluster_node_names(cluster)), encoding="utf-8")
    logger.info("rendered manifests=%d out=%s", len(paths), out_dir)
    return paths
