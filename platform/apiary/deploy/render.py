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
   render wrote there.

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
CONTROL_PLANE_PORT = 8470  # `apiary control-plane --port`
PREFECT_PORT = 4200
PROMETHEUS_PORT = 9090
ALERTMANAGER_PORT = 9093
#: The order manifests are applied in (``kubectl apply -f DIR`` reads files by name).
KIND_ORDER = {
    "Namespace": 0, "ServiceAccount": 10, "ClusterRole": 11, "ClusterRoleBinding": 12, "Role": 13,
    "RoleBinding": 14, "ConfigMap": 20, "PersistentVolumeClaim": 21, "Service": 30, "Deployment": 40,
    "DaemonSet": 41,
}
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


class Namespaces(_Model):
    platform: str = Field(default="apiary", pattern=_DNS_LABEL, max_length=63,
                          description="Control plane, agents, Prefect, monitoring.")
    jobs: str = Field(default="apiary-jobs", pattern=_DNS_LABEL, max_length=63,
                      description="Where the agents run the tasks' pods (and their registry secrets).")
    create: bool = Field(default=True, description="Render the two Namespace objects.")
    pod_security: PodSecurity = Field(default_factory=PodSecurity)


class ClusterConfigSource(_Model):
    """The HiveD cluster config: exactly one of ``file`` (a path) or ``inline`` (YAML text)."""

    file: Path | None = None
    inline: str | None = None

    @model_validator(mode="after")
    def _one(self) -> ClusterConfigSource:
        if (self.file is None) == (self.inline is None):
            raise ValueError("set exactly one of file and inline")
        return self


class ControlPlane(_Model):
    home: Storage = Field(default_factory=lambda: Storage(persistent=True),
                          description="APIARY_HOME: token files, cluster id, task logs.")
    database: SecretRef = Field(default_factory=lambda: SecretRef(name="apiary-database", key="url"),
                                description="APIARY_DATABASE_URL (postgresql+psycopg://...).")
    env: dict[str, str] = Field(default_factory=dict, description="More APIARY_* settings (apiary.settings).")
    resources: Resources = Field(default_factory=lambda: _resources("250m", "512Mi", "2", "2Gi"))

    @field_validator("env")
    @classmethod
    def _not_managed(cls, env: dict[str, str]) -> dict[str, str]:
        managed = sorted(set(env) & {"APIARY_HOME", "APIARY_DATABASE_URL", "HOME"})
        if managed:
            raise ValueError(f"{', '.join(managed)} is set by the manifests (controlPlane.home, controlPlane.database)")
        return env


class Agent(_Model):
    node_selector: dict[str, str] = Field(default_factory=lambda: {"nvidia.com/gpu.present": "true"})
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    )
    tokens_secret: str = Field(default="apiary-agent-tokens", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                               description="Secret with one key agent-<node>.token per node.")
    metrics_port: int = Field(default=9470, ge=1, le=65535)
    metrics_host: str | None = Field(
        default=None, description="Passed as --metrics-host (needs that option of apiary agent); None: not passed.")
    simulated_gpus: bool = Field(default=False, description="--simulated-gpus: advertise the config's GPUs.")
    runtime_class_name: str | None = Field(default=None, description="e.g. nvidia, where that is not the default.")
    resources: Resources = Field(default_factory=lambda: _resources("100m", "256Mi", "1", "1Gi"))


class Prefect(_Model):
    enabled: bool = Field(default=True, description="The Prefect server and the bridge.")
    auth: SecretRef = Field(default_factory=lambda: SecretRef(name="apiary-prefect-auth", key="auth"),
                            description="Basic auth user:password of the server's API and UI.")
    database: SecretRef | None = Field(default=None,
                                       description="postgresql+asyncpg://... URL; None: SQLite in home.")
    home: Storage = Field(default_factory=Storage)
    ui_api_url: str = Field(default="http://localhost:4200/api",
                            description="The API URL the browser calls (default: kubectl port-forward).")
    resources: Resources = Field(default_factory=lambda: _resources("250m", "512Mi", "2", "2Gi"))


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
    }


def _svc(name: str, v: Values, port: int) -> str:
    return f"{name}.{v.namespaces.platform}.svc:{port}"


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
    agent pods with ``kubernetes_sd_configs`` (platform namespace only) instead of a targets file,
    taking ``node`` from the pod's node name."""
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
    jobs["apiary-control-plane"]["static_configs"] = [
        {"targets": [_svc(names["controlPlane"], v, CONTROL_PLANE_PORT)]}
    ]
    node_job = jobs["apiary-node"]
    discovery = [{
        "role": "pod",
        "namespaces": {"names": [v.namespaces.platform]},
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
    with the token Secret as bearer; SMTP, sender and on-call address from the values when set."""
    a = v.alertmanager
    path = _source_dir(a.config_file, base, REPO_DEPLOY / "alertmanager" / "alertmanager.yml",
                       "alertmanager.configFile")
    cfg = yaml.safe_load(_read_text(path, "alertmanager.configFile"))
    glob = cfg.setdefault("global", {})
    if a.smtp_smarthost:
        glob["smtp_smarthost"] = a.smtp_smarthost
    if a.smtp_from:
        glob["smtp_from"] = a.smtp_from
    webhook = f"http://{_svc(names['controlPlane'], v, CONTROL_PLANE_PORT)}/api/v2/alerts/webhook"
    for receiver in cfg.get("receivers") or []:
        for hook in receiver.get("webhook_configs") or []:
            hook["url"] = webhook
            auth = hook.setdefault("http_config", {}).setdefault("authorization", {"type": "Bearer"})
            auth["credentials_file"] = f"{ALERTMANAGER_TOKEN_DIR}/{a.token.key}"
        for mail in receiver.get("email_configs") or []:
            if a.oncall_email:
                mail["to"] = a.oncall_email
    return _generated("deploy/alertmanager/alertmanager.yml") + yaml.safe_dump(cfg, sort_keys=False)


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


def context(v: Values, base: Path) -> dict[str, Any]:
    """What the templates see: ``v`` (the values, camelCase), names, images, URLs and embedded configs."""
    names = _names(v)
    apiary_image = f"{v.image.registry.rstrip('/')}/apiary/{{}}:{v.image.tag}"
    cluster = cluster_config_text(v, base)
    prometheus = prometheus_files(v, base, names) if v.prometheus.enabled else {}
    alertmanager = alertmanager_config(v, base, names) if v.alertmanager.enabled else ""
    prefect_home = "/var/lib/prefect"
    return {
        "v": v.model_dump(by_alias=True, mode="json"),
        "instance": v.instance,
        "ns": v.namespaces.platform,
        "jobs_ns": v.namespaces.jobs,
        "names": names,
        "pull_secrets": [{"name": s} for s in v.image.pull_secrets],
        "images": {
            "controlPlane": apiary_image.format("control-plane"), "agent": apiary_image.format("agent"),
            "prefect": apiary_image.format("prefect"), "prometheus": v.prometheus.image,
            "alertmanager": v.alertmanager.image,
        },
        "ports": {"controlPlane": CONTROL_PLANE_PORT, "prefect": PREFECT_PORT, "prometheus": PROMETHEUS_PORT,
                  "alertmanager": ALERTMANAGER_PORT},
        "urls": {
            "controlPlane": f"http://{_svc(names['controlPlane'], v, CONTROL_PLANE_PORT)}",
            "prefectApi": f"http://{_svc(names['prefectServer'], v, PREFECT_PORT)}/api",
        },
        "cluster_config": cluster,
        "prometheus_files": prometheus,
        "alertmanager_config": alertmanager,
        "alertmanager_token_dir": ALERTMANAGER_TOKEN_DIR,
        "prefect_home": prefect_home,
        # Apiary's Prefect settings (apiary up's): telemetry off, the server's batch tuning.
        "prefect_env": {k: val for k, val in prefect_env(Path(prefect_home)).items() if k != "PREFECT_HOME"},
        "prefect_server_tuning": SERVER_TUNING,
        "checksums": {
            "cluster": _sha256(cluster),
            "prometheus": _sha256(*(f"{k}\0{t}" for k, t in sorted(prometheus.items()))),
            "alertmanager": _sha256(alertmanager),
        },
    }


def render_manifests(values_path: Path) -> list[tuple[str, dict[str, Any], str]]:
    """``(template, manifest, text)`` for every manifest the values give, in template order."""
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
    return out


# ---------------------------------------------------------------------- 4. files
def manifest_filename(manifest: dict[str, Any]) -> str:
    kind = str(manifest["kind"])
    return f"{KIND_ORDER.get(kind, 50):02d}-{kind.lower()}-{manifest['metadata']['name']}.yaml"


def render(values_path: Path, out_dir: Path) -> list[Path]:
    """Render the manifests the values in ``values_path`` give into ``out_dir`` (created), one file
    per manifest, and return their paths in apply order. Files an earlier render wrote in
    ``out_dir`` (they start with :data:`HEADER`) are removed first; other files are left alone.

    Raises ValidationError (bad values, unreadable or invalid cluster config, missing deploy/
    files; ``field`` names the value) and PlatformError (a template that renders invalid YAML, two
    manifests with one file name).
    """
    manifests = render_manifests(values_path)
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
    logger.info("rendered manifests=%d out=%s", len(paths), out_dir)
    return paths
