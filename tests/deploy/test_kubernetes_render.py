"""``apiary deploy render``: the Kubernetes manifests of deploy/kubernetes/values.yaml.

The manifests are checked offline with kubernetes-validate (``--strict``: an unknown field is an
error) against the values' ``kubernetesVersion``, and for what the schema cannot say: RBAC least
privilege, the downward API, security contexts, probes, and configs identical to deploy/'s.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.deploy.tools import ALERTMANAGER_DIR, DEPLOY, PROMETHEUS_DIR, REPO
from typer.testing import CliRunner

from apiary.deploy import load_values, render
from apiary.deploy.render import HEADER, _block
from apiary.errors import ValidationError

VALUES = DEPLOY / "kubernetes" / "values.yaml"
DEFAULTS = load_values(VALUES)
PLATFORM_NS = DEFAULTS.namespaces.platform
JOBS_NS = DEFAULTS.namespaces.jobs
EXPECTED_KINDS = {
    "Namespace", "ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
    "PersistentVolumeClaim", "Service", "Deployment", "DaemonSet",
}
WORKLOADS = ("Deployment", "DaemonSet")


def _validator() -> str:
    """kubernetes-validate of this interpreter's environment (a dev dependency)."""
    found = Path(sys.executable).with_name("kubernetes-validate")
    path = str(found) if found.exists() else shutil.which("kubernetes-validate")
    assert path, "kubernetes-validate is not installed (pip install -e '.[dev]')"
    return path


def kubernetes_validate(files: list[Path], version: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_validator(), "--strict", "--kubernetes-version", version, *map(str, files)],
        capture_output=True, text=True, timeout=120,
    )


def deep_merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def write_values(tmp_path: Path, **overrides: Any) -> Path:
    """deploy/kubernetes/values.yaml, its relative paths made absolute, with ``overrides`` merged
    in (``clusterConfig`` replaced whole), written to tmp_path/values.yaml."""
    data = yaml.safe_load(VALUES.read_text())
    data["clusterConfig"] = {"file": str((VALUES.parent / data["clusterConfig"]["file"]).resolve())}
    data["prometheus"]["configDir"] = str(PROMETHEUS_DIR)
    data["alertmanager"]["configFile"] = str(ALERTMANAGER_DIR / "alertmanager.yml")
    if "clusterConfig" in overrides:
        data["clusterConfig"] = overrides.pop("clusterConfig")
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(deep_merge(data, overrides), sort_keys=False))
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return render(VALUES, tmp_path_factory.mktemp("manifests"))


@pytest.fixture(scope="module")
def manifests(rendered: list[Path]) -> list[dict]:
    out = []
    for path in rendered:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert len(docs) == 1, f"{path.name} holds {len(docs)} manifests"
        out.append(docs[0])
    return out


def by_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


def one(manifests: list[dict], kind: str, name: str) -> dict:
    found = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# ---------------------------------------------------------------------- files and schema
def test_every_expected_kind_is_rendered_one_per_file_in_apply_order(rendered: list[Path], manifests: list[dict]):
    assert {m["kind"] for m in manifests} == EXPECTED_KINDS
    assert [p.name for p in rendered] == sorted(p.name for p in rendered)
    first_non_namespace = next(i for i, m in enumerate(manifests) if m["kind"] != "Namespace")
    assert all(m["kind"] == "Namespace" for m in manifests[:first_non_namespace])
    assert {(m["kind"], m["metadata"]["name"]) for m in by_kind(manifests, "Deployment") + by_kind(
        manifests, "DaemonSet")} == {
        ("Deployment", "apiary-control-plane"), ("Deployment", "apiary-prefect-server"),
        ("Deployment", "apiary-prefect-bridge"), ("Deployment", "apiary-prometheus"),
        ("Deployment", "apiary-alertmanager"), ("DaemonSet", "apiary-agent"),
    }
    assert {m["metadata"]["name"] for m in by_kind(manifests, "Service")} == {
        "apiary-control-plane", "apiary-prefect-server", "apiary-prometheus", "apiary-alertmanager"}
    assert all(p.read_text().startswith(HEADER) for p in rendered)


def test_manifests_pass_kubernetes_validate_strict(rendered: list[Path]):
    result = kubernetes_validate(rendered, DEFAULTS.kubernetes_version)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(rendered)


@pytest.mark.parametrize(
    ("file", "old", "new"),
    [
        ("40-deployment-apiary-control-plane.yaml", "containerPort:", "containerPrt:"),
        ("41-daemonset-apiary-agent.yaml", "fieldPath: spec.nodeName", "fieldPth: spec.nodeName"),
        ("13-role-apiary-agent.yaml", "verbs:", "verb:"),
    ],
    ids=["deployment-port", "daemonset-fieldref", "role-verbs"],
)
def test_kubernetes_validate_catches_a_typo(rendered: list[Path], tmp_path: Path, file: str, old: str, new: str):
    text = next(p for p in rendered if p.name == file).read_text()
    assert old in text
    broken = tmp_path / file
    broken.write_text(text.replace(old, new, 1))
    result = kubernetes_validate([broken], DEFAULTS.kubernetes_version)
    assert result.returncode != 0, result.stdout


def test_every_value_switch_still_validates(tmp_path: Path):
    """The optional branches of the templates, all taken (and all left out), are valid too."""
    cluster = (REPO / "examples/lab6/hived-config-one-vc.yaml").read_text()
    variants = {
        "all-on": dict(
            image={"pullSecrets": ["regcred"], "pullPolicy": "Always"},
            clusterConfig={"inline": cluster},
            controlPlane={"env": {"APIARY_LAZY_PREEMPTION": "true"}, "home": {"persistent": False}},
            agent={"metricsHost": "0.0.0.0", "simulatedGpus": True, "runtimeClassName": "nvidia",
                   "nodeSelector": {}, "tolerations": []},
            prefect={"database": {"name": "prefect-db", "key": "url"},
                     "home": {"persistent": True, "size": "2Gi", "storageClassName": "fast"}},
            prometheus={"storage": {"persistent": True, "size": "20Gi"}, "scrapeInterval": "5s",
                        "clusterLabel": "prod"},
        ),
        "all-off": dict(
            namespaces={"create": False},
            prefect={"enabled": False}, prometheus={"enabled": False}, alertmanager={"enabled": False},
        ),
        "no-alertmanager": dict(alertmanager={"enabled": False}),
    }
    files: list[Path] = []
    for name, overrides in variants.items():
        d = tmp_path / name
        d.mkdir()
        files += render(write_values(d, **overrides), d / "out")
    result = kubernetes_validate(files, DEFAULTS.kubernetes_version)
    assert result.returncode == 0, result.stdout + result.stderr
    off = {p.name for p in files if p.parent.parent.name == "all-off"}
    assert not any("prometheus" in n or "prefect" in n or "alertmanager" in n or "namespace-" in n for n in off)


# ---------------------------------------------------------------------- RBAC
def test_agents_manage_pods_logs_and_secrets_in_the_job_namespace_only(manifests: list[dict]):
    role = one(manifests, "Role", "apiary-agent")
    assert role["metadata"]["namespace"] == JOBS_NS
    granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert {r for r, _ in granted} == {"pods", "pods/log", "secrets"}
    # apiary.runtime.kubernetes' calls, nothing more.
    assert {v for r, v in granted if r == "pods"} == {"get", "list", "watch", "create", "delete"}
    assert {v for r, v in granted if r == "pods/log"} == {"get"}
    assert {v for r, v in granted if r == "secrets"} == {"get", "create", "patch", "delete"}
    assert all(rule["apiGroups"] == [""] for rule in role["rules"])
    binding = one(manifests, "RoleBinding", "apiary-agent")
    assert binding["metadata"]["namespace"] == JOBS_NS
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "apiary-agent"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "apiary-agent", "namespace": PLATFORM_NS}]
    # No other Role grants the agent anything, anywhere.
    for rb in by_kind(manifests, "RoleBinding"):
        if rb is not binding:
            assert all(s["name"] != "apiary-agent" for s in rb["subjects"])


def test_the_only_cluster_wide_permission_reads_nodes(manifests: list[dict]):
    [cluster_role] = by_kind(manifests, "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    [binding] = by_kind(manifests, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "apiary-agent", "namespace": PLATFORM_NS}]


def test_no_wildcards_and_no_escalation_verbs(manifests: list[dict]):
    for role in by_kind(manifests, "Role") + by_kind(manifests, "ClusterRole"):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(key, []), f"{role['kind']}/{role['metadata']['name']}: * in {key}"
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
            assert "nonResourceURLs" not in rule


def test_only_the_agents_and_prometheus_get_an_api_token(manifests: list[dict]):
    automount = {sa["metadata"]["name"]: sa["automountServiceAccountToken"]
                 for sa in by_kind(manifests, "ServiceAccount")}
    assert {n for n, on in automount.items() if on} == {"apiary-agent", "apiary-prometheus"}
    for w in by_kind(manifests, "Deployment") + by_kind(manifests, "DaemonSet"):
        spec = pod_spec(w)
        assert spec["serviceAccountName"] in automount
        assert spec["automountServiceAccountToken"] == automount[spec["serviceAccountName"]]
    prometheus = one(manifests, "Role", "apiary-prometheus")
    assert prometheus["metadata"]["namespace"] == PLATFORM_NS
    assert prometheus["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


# ---------------------------------------------------------------------- workloads
def test_agent_daemonset_names_its_node_with_the_downward_api(manifests: list[dict]):
    ds = one(manifests, "DaemonSet", "apiary-agent")
    spec = pod_spec(ds)
    [agent] = spec["containers"]
    assert env_of(agent)["NODE_NAME"] == {
        "name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    cmd = agent["command"]
    assert cmd[:2] == ["apiary", "agent"]
    assert cmd[cmd.index("--node") + 1] == "$(NODE_NAME)"
    assert cmd[cmd.index("--runtime") + 1] == "kubernetes"
    assert cmd[cmd.index("--api") + 1] == f"http://apiary-control-plane.{PLATFORM_NS}.svc:8470"
    assert cmd[cmd.index("--state-dir") + 1] == "/var/lib/apiary/agents"
    assert env_of(agent)["APIARY_K8S_NAMESPACE"]["value"] == JOBS_NS
    assert spec["nodeSelector"] == DEFAULTS.agent.node_selector
    assert spec["tolerations"] == DEFAULTS.agent.tolerations
    # The token: the Secret mounted where --credentials points.
    creds = cmd[cmd.index("--credentials") + 1]
    mount = next(m for m in agent["volumeMounts"] if m["mountPath"] == creds)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == DEFAULTS.agent.tokens_secret and mount["readOnly"] is True


def test_control_plane_reads_its_database_url_from_a_secret_and_its_cluster_config(manifests: list[dict]):
    cp = one(manifests, "Deployment", "apiary-control-plane")
    [main] = pod_spec(cp)["containers"]
    assert main["command"] == ["apiary", "control-plane", "--host", "0.0.0.0", "--port", "8470"]
    env = env_of(main)
    assert env["APIARY_DATABASE_URL"]["valueFrom"] == {"secretKeyRef": {"name": "apiary-database", "key": "url"}}
    assert env["APIARY_HOME"]["value"] == "/var/lib/apiary"
    assert cp["spec"]["replicas"] == 1 and cp["spec"]["strategy"]["type"] == "Recreate"
    config = one(manifests, "ConfigMap", "apiary-cluster-config")
    source = (VALUES.parent / yaml.safe_load(VALUES.read_text())["clusterConfig"]["file"]).read_text()
    assert config["data"]["cluster.yaml"] == source
    [init] = pod_spec(cp)["initContainers"]
    assert init["command"][-1] == "/var/lib/apiary/cluster.yaml"  # APIARY_HOME/cluster.yaml, writable
    home = next(v for v in pod_spec(cp)["volumes"] if v["name"] == "home")
    assert home["persistentVolumeClaim"]["claimName"] == "apiary-control-plane-home"
    one(manifests, "PersistentVolumeClaim", "apiary-control-plane-home")


def test_prefect_server_and_bridge(manifests: list[dict]):
    [server] = pod_spec(one(manifests, "Deployment", "apiary-prefect-server"))["containers"]
    assert server["command"] == ["prefect", "server", "start", "--host", "0.0.0.0", "--port", "4200"]
    assert env_of(server)["PREFECT_SERVER_API_AUTH_STRING"]["valueFrom"]["secretKeyRef"]["name"] == (
        "apiary-prefect-auth")
    [bridge] = pod_spec(one(manifests, "Deployment", "apiary-prefect-bridge"))["containers"]
    cmd = bridge["command"]
    assert cmd[:2] == ["apiary", "prefect-bridge"]
    assert cmd[cmd.index("--prefect-api") + 1] == f"http://apiary-prefect-server.{PLATFORM_NS}.svc:4200/api"
    assert env_of(bridge)["APIARY_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "apiary-bridge-token"
    assert server["image"] == bridge["image"] == "localhost:5000/apiary/prefect:0.1.0"


@pytest.mark.parametrize(
    ("name", "path"),
    [("apiary-control-plane", "/healthz"), ("apiary-prefect-server", "/api/health"),
     ("apiary-prometheus", "/-/healthy"), ("apiary-alertmanager", "/-/healthy")],
)
def test_services_with_a_health_endpoint_are_probed_on_it(manifests: list[dict], name: str, path: str):
    [container] = pod_spec(one(manifests, "Deployment", name))["containers"]
    if name == "apiary-control-plane":
        # Its /healthz is 503 while the store cannot write: out of the Service, not restarted.
        assert container["readinessProbe"]["httpGet"]["path"] == path
        assert container["livenessProbe"]["tcpSocket"]["port"] == "http"
    else:
        assert container["livenessProbe"]["httpGet"]["path"] == path
    assert "readinessProbe" in container
    service = one(manifests, "Service", name)
    assert service["spec"]["selector"].items() <= one(manifests, "Deployment", name)["spec"]["template"][
        "metadata"]["labels"].items()


def test_images_come_from_the_values(manifests: list[dict]):
    images = {c["image"] for w in by_kind(manifests, "Deployment") + by_kind(manifests, "DaemonSet")
              for c in containers(w)}
    assert images == {
        "localhost:5000/apiary/control-plane:0.1.0", "localhost:5000/apiary/agent:0.1.0",
        "localhost:5000/apiary/prefect:0.1.0", "prom/prometheus:v2.42.0", "prom/alertmanager:v0.25.0",
    }


def test_pods_run_non_root_read_only_without_escalation_and_with_resources(manifests: list[dict]):
    for w in by_kind(manifests, "Deployment") + by_kind(manifests, "DaemonSet"):
        spec = pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in containers(w):
            sc = c["securityContext"]
            where = f"{w['metadata']['name']}/{c['name']}"
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert "privileged" not in sc, where
            assert c["resources"]["requests"] and c["resources"]["limits"], where
        assert not any("hostPath" in v for v in spec.get("volumes", []))
        assert not spec.get("hostNetwork") and not spec.get("hostPID")


def test_every_object_has_the_recommended_labels(manifests: list[dict]):
    for m in manifests:
        labels = m["metadata"]["labels"]
        for key in ("name", "instance", "component", "part-of", "version", "managed-by"):
            assert f"app.kubernetes.io/{key}" in labels, f"{m['kind']}/{m['metadata']['name']}: {key}"
        if m["kind"] in WORKLOADS:
            selector = m["spec"]["selector"]["matchLabels"]
            assert "app.kubernetes.io/version" not in selector  # selectors are immutable
            assert selector.items() <= m["spec"]["template"]["metadata"]["labels"].items()


def test_objects_live_in_the_platform_namespace_except_the_agents_job_rbac(manifests: list[dict]):
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for m in manifests:
        ns = m["metadata"].get("namespace")
        if m["kind"] in cluster_scoped:
            assert ns is None
        elif m["kind"] in ("Role", "RoleBinding") and m["metadata"]["name"] == "apiary-agent":
            assert ns == JOBS_NS
        else:
            assert ns == PLATFORM_NS, f"{m['kind']}/{m['metadata']['name']}"
    levels = {m["metadata"]["name"]: m["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
              for m in by_kind(manifests, "Namespace")}
    assert levels == {PLATFORM_NS: "restricted", JOBS_NS: "privileged"}


# ---------------------------------------------------------------------- monitoring configs
def test_prometheus_configmap_is_deploy_prometheus(manifests: list[dict]):
    data = one(manifests, "ConfigMap", "apiary-prometheus")["data"]
    shipped = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    # Rules: every file prometheus.yml names, byte for byte, mounted where rule_files points.
    rule_paths = shipped["rule_files"]
    assert {k for k in data if k != "prometheus.yml"} == {Path(p).name for p in rule_paths}
    for rel in rule_paths:
        assert data[Path(rel).name] == (PROMETHEUS_DIR / rel).read_text()
    cfg = yaml.safe_load(data["prometheus.yml"])
    assert cfg["global"] == shipped["global"]
    assert cfg["rule_files"] == rule_paths
    items = {i["key"]: i["path"] for v in pod_spec(one(manifests, "Deployment", "apiary-prometheus"))["volumes"]
             if v["name"] == "config" for i in v["configMap"]["items"]}
    assert items == {"prometheus.yml": "prometheus.yml", **{Path(p).name: p for p in rule_paths}}
    # Only the `# apiary:` marked values change: addresses, and how node agents are found.
    assert cfg["alerting"] == {"alertmanagers": [{"static_configs": [
        {"targets": [f"apiary-alertmanager.{PLATFORM_NS}.svc:9093"]}]}]}
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    want = {j["job_name"]: j for j in shipped["scrape_configs"]}
    assert jobs.keys() == want.keys()
    assert jobs["apiary-control-plane"] == {**want["apiary-control-plane"], "static_configs": [
        {"targets": [f"apiary-control-plane.{PLATFORM_NS}.svc:8470"]}]}
    node, shipped_node = jobs["apiary-node"], want["apiary-node"]
    for key in ("honor_labels", "metrics_path", "metric_relabel_configs"):
        assert node[key] == shipped_node[key]
    assert node["relabel_configs"][-len(shipped_node["relabel_configs"]):] == shipped_node["relabel_configs"]
    assert {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"} in node["relabel_configs"]
    [sd] = node["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"] == {"names": [PLATFORM_NS]}
    assert "file_sd_configs" not in node


def test_alertmanager_configmap_is_deploy_alertmanager(manifests: list[dict]):
    text = one(manifests, "ConfigMap", "apiary-alertmanager")["data"]["alertmanager.yml"]
    cfg = yaml.safe_load(text)
    shipped = yaml.safe_load((ALERTMANAGER_DIR / "alertmanager.yml").read_text())
    assert cfg["route"] == shipped["route"]
    assert cfg["inhibit_rules"] == shipped["inhibit_rules"]
    assert cfg["global"] == shipped["global"]
    [hook] = next(r for r in cfg["receivers"] if r["name"] == "apiary-webhook")["webhook_configs"]
    assert hook["url"] == f"http://apiary-control-plane.{PLATFORM_NS}.svc:8470/api/v2/alerts/webhook"
    token_file = hook["http_config"]["authorization"]["credentials_file"]
    deployment = one(manifests, "Deployment", "apiary-alertmanager")
    [container] = pod_spec(deployment)["containers"]
    mount = next(m for m in container["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "apiary-alertmanager-token"
    assert volume["secret"]["items"] == [{"key": "token", "path": Path(token_file).name}]


def test_rendered_monitoring_configs_pass_promtool_and_amtool(manifests: list[dict], tmp_path: Path,
                                                              promtool: str, amtool: str):
    """Debian's Prometheus is built without Kubernetes service discovery, so promtool checks the
    config with the agents' kubernetes_sd_configs swapped for a static target (the upstream image
    the manifests run has it)."""
    data = one(manifests, "ConfigMap", "apiary-prometheus")["data"]
    (tmp_path / "rules").mkdir()
    for key, text in data.items():
        (tmp_path / (key if key == "prometheus.yml" else f"rules/{key}")).write_text(text)
    cfg = yaml.safe_load(data["prometheus.yml"])
    for job in cfg["scrape_configs"]:
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["static_configs"] = [{"targets": ["agent:9470"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    am = tmp_path / "alertmanager.yml"
    am.write_text(one(manifests, "ConfigMap", "apiary-alertmanager")["data"]["alertmanager.yml"])
    result = subprocess.run([amtool, "check-config", str(am)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------- values
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"replicas": 3}, "replicas"),
        ({"controlPlane": {"replicas": 3}}, "controlPlane.replicas"),
        ({"agent": {"nodeSelecter": {}}}, "agent.nodeSelecter"),
        ({"prometheus": {"storage": {"persistant": True}}}, "prometheus.storage.persistant"),
        ({"agent": {"metricsPort": 0}}, "agent.metricsPort"),
        ({"namespaces": {"jobs": "Apiary_Jobs"}}, "namespaces.jobs"),
        ({"kubernetesVersion": "1.30"}, "kubernetesVersion"),
        ({"controlPlane": {"env": {"APIARY_HOME": "/x"}}}, "controlPlane.env"),
        ({"clusterConfig": {"file": "a.yaml", "inline": "b"}}, "clusterConfig"),
        ({"clusterConfig": {}}, "clusterConfig"),
        ({"clusterConfig": {"inline": "physicalCluster: 3"}}, "clusterConfig.inline"),
        ({"clusterConfig": {"file": "missing.yaml"}}, "clusterConfig.file"),
        ({"prometheus": {"configDir": "nowhere"}}, "prometheus.configDir"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_values_are_a_validation_error_naming_the_field(tmp_path: Path, overrides: dict, field: str):
    path = write_values(tmp_path, **overrides)
    with pytest.raises(ValidationError) as info:
        render(path, tmp_path / "out")
    assert info.value.field == field
    assert field in str(info.value)
    assert not (tmp_path / "out").exists()  # nothing written for bad values


def test_values_keys_default(tmp_path: Path):
    """Only clusterConfig is required; everything else has a default."""
    path = tmp_path / "values.yaml"
    cluster = (REPO / "examples/lab6/hived-config-one-vc.yaml").read_text()
    path.write_text(yaml.safe_dump({"clusterConfig": {"inline": cluster}}))
    values = load_values(path)
    assert values.kubernetes_version == DEFAULTS.kubernetes_version
    assert values.namespaces == DEFAULTS.namespaces
    with pytest.raises(ValidationError) as info:
        path.write_text("{}\n")
        load_values(path)
    assert info.value.field == "clusterConfig"


def test_a_new_render_replaces_its_earlier_files_and_keeps_others(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "kustomization.yaml").write_text("resources: []\n")
    first = render(write_values(tmp_path), out)
    assert any("prometheus" in p.name for p in first)
    second = render(write_values(tmp_path, prometheus={"enabled": False}), out)
    assert sorted(out.glob("*.yaml")) == sorted([*second, out / "kustomization.yaml"])
    assert not any("prometheus" in p.name for p in second)


# ---------------------------------------------------------------------- CLI
def test_cli_deploy_render_writes_the_files(tmp_path: Path):
    from apiary.cli.main import app

    out = tmp_path / "manifests"
    result = CliRunner().invoke(app, ["deploy", "render", "--values", str(VALUES), "--out", str(out)])
    assert result.exit_code == 0, result.output
    printed = result.stdout.split()
    assert printed == [str(p) for p in sorted(out.glob("*.yaml"))]
    assert len(printed) >= len(EXPECTED_KINDS)


def test_cli_deploy_render_reports_the_bad_field(tmp_path: Path):
    from apiary.cli.main import app

    bad = tmp_path / "values.yaml"
    bad.write_text(VALUES.read_text() + "\nextraThing: 1\n")
    result = CliRunner().invoke(app, ["deploy", "render", "--values", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert "extraThing: unknown key" in result.output


# ---------------------------------------------------------------------- embedding text in YAML
@pytest.mark.parametrize(
    "text",
    ["a: 1\n", "a: 1", "", "\n", "a\n\n\n", "  leading spaces\nx\n", "tab\there\n", "trailing  \n",
     "# comment\n---\nb: 2\n", "unicode é ✓\n", "x\n\n  \ny\n"],
)
def test_block_filter_embeds_text_exactly(text: str):
    doc = yaml.safe_load(f"data:\n  key: {_block(text, 4)}\n")
    assert doc == {"data": {"key": text}}
