"""``apiary deploy render``: the Kubernetes manifests of deploy/kubernetes/values.yaml.

The manifests are checked offline with kubernetes-validate (``--strict``: an unknown field is an
error) against the values' ``kubernetesVersion``, and for what the schema cannot say: RBAC least
privilege, the downward API, security contexts, probes, configs identical to deploy/'s, and the
many-machines design (control-plane replicas with leader election and a PodDisruptionBudget, TLS
Secrets mounted read-only, agents that join with a bootstrap token).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.deploy.tools import ALERTMANAGER_DIR, DEPLOY, PROMETHEUS_DIR, REPO, in_ci
from typer.testing import CliRunner

from apiary.deploy import load_values, render
from apiary.deploy.render import BOOTSTRAP_TOKEN_RE, HEADER, NOTES_FILE, _block
from apiary.errors import ValidationError

VALUES = DEPLOY / "kubernetes" / "values.yaml"
DEFAULTS = load_values(VALUES)
PLATFORM_NS = DEFAULTS.namespaces.platform
JOBS_NS = DEFAULTS.namespaces.jobs
AGENTS_NS = DEFAULTS.namespaces.agents
#: The platform CA's pin the tests render with (the shipped values leave it to the operator).
CA_HASH = "sha256:" + "0f" * 32
EXPECTED_KINDS = {
    "Namespace", "ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
    "Service", "PodDisruptionBudget", "StatefulSet", "Deployment", "DaemonSet",
}
WORKLOADS = ("StatefulSet", "Deployment", "DaemonSet")
CONTROL_PLANE_URL = f"https://apiary-control-plane.{PLATFORM_NS}.svc:8470"
CA_FILE = "/etc/apiary/ca/ca.crt"


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
    """deploy/kubernetes/values.yaml, its relative paths made absolute and the CA pin set to
    :data:`CA_HASH`, with ``overrides`` merged in (``clusterConfig`` replaced whole), written to
    tmp_path/values.yaml."""
    data = yaml.safe_load(VALUES.read_text())
    data["clusterConfig"] = {"file": str((VALUES.parent / data["clusterConfig"]["file"]).resolve())}
    data["agent"]["caCertHash"] = CA_HASH
    data["prometheus"]["configDir"] = str(PROMETHEUS_DIR)
    data["alertmanager"]["configFile"] = str(ALERTMANAGER_DIR / "alertmanager.yml")
    if "clusterConfig" in overrides:
        data["clusterConfig"] = overrides.pop("clusterConfig")
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(deep_merge(data, overrides), sort_keys=False))
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("values")
    return render(write_values(tmp), tmp / "manifests")


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


def container(workload: dict, name: str) -> dict:
    [found] = [c for c in containers(workload) if c["name"] == name]
    return found


def workloads(manifests: list[dict]) -> list[dict]:
    return [m for m in manifests if m["kind"] in WORKLOADS]


def volume_of(workload: dict, c: dict, mount_path: str) -> tuple[dict, dict]:
    """The volume mount of ``c`` at ``mount_path`` and the pod's volume it mounts."""
    [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == mount_path]
    [volume] = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# ---------------------------------------------------------------------- files and schema
def test_every_expected_kind_is_rendered_one_per_file_in_apply_order(rendered: list[Path], manifests: list[dict]):
    assert {m["kind"] for m in manifests} == EXPECTED_KINDS
    assert [p.name for p in rendered] == sorted(p.name for p in rendered)
    first_non_namespace = next(i for i, m in enumerate(manifests) if m["kind"] != "Namespace")
    assert all(m["kind"] == "Namespace" for m in manifests[:first_non_namespace])
    assert {(m["kind"], m["metadata"]["name"]) for m in workloads(manifests)} == {
        ("StatefulSet", "apiary-control-plane"), ("Deployment", "apiary-prefect-server"),
        ("Deployment", "apiary-prefect-bridge"), ("Deployment", "apiary-prometheus"),
        ("Deployment", "apiary-alertmanager"), ("DaemonSet", "apiary-agent"),
    }
    assert {m["metadata"]["name"] for m in by_kind(manifests, "Service")} == {
        "apiary-control-plane", "apiary-control-plane-peers", "apiary-prefect-server", "apiary-prometheus",
        "apiary-alertmanager"}
    assert all(p.read_text().startswith(HEADER) for p in rendered)
    assert (rendered[0].parent / NOTES_FILE).read_text().startswith(HEADER)


def test_manifests_pass_kubernetes_validate_strict(rendered: list[Path]):
    result = kubernetes_validate(rendered, DEFAULTS.kubernetes_version)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(rendered)


@pytest.mark.parametrize(
    ("file", "old", "new"),
    [
        ("40-statefulset-apiary-control-plane.yaml", "containerPort:", "containerPrt:"),
        ("41-daemonset-apiary-agent.yaml", "fieldPath: spec.nodeName", "fieldPth: spec.nodeName"),
        ("13-role-apiary-agent.yaml", "verbs:", "verb:"),
    ],
    ids=["statefulset-port", "daemonset-fieldref", "role-verbs"],
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
            controlPlane={"env": {"APIARY_LAZY_PREEMPTION": "true"}, "home": {"persistent": False},
                          "replicas": 3, "antiAffinity": "preferred",
                          "leaderElection": {"leaseDurationS": 15, "renewDeadlineS": 10, "retryPeriodS": 2}},
            agent={"metricsHost": "0.0.0.0", "simulatedGpus": True, "runtimeClassName": "nvidia",
                   "nodeSelector": {}, "tolerations": []},
            prefect={"database": {"name": "prefect-db", "key": "url"},
                     "home": {"persistent": True, "size": "2Gi", "storageClassName": "fast"}},
            prometheus={"storage": {"persistent": True, "size": "20Gi"}, "scrapeInterval": "5s",
                        "clusterLabel": "prod"},
        ),
        "all-off": dict(
            namespaces={"create": False}, controlPlane={"replicas": 1},
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
    assert not any("poddisruptionbudget" in n for n in off)  # one replica: a PDB would block every drain
    claims = yaml.safe_load(next(p for p in files if p.parent.parent.name == "all-off"
                                 and p.name == "40-statefulset-apiary-control-plane.yaml").read_text())
    assert claims["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "home"


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
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "apiary-agent", "namespace": AGENTS_NS}]
    # No other Role grants the agent anything, anywhere.
    for rb in by_kind(manifests, "RoleBinding"):
        if rb is not binding:
            assert all(s["name"] != "apiary-agent" for s in rb["subjects"])


def test_the_only_cluster_wide_permission_reads_nodes(manifests: list[dict]):
    [cluster_role] = by_kind(manifests, "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    [binding] = by_kind(manifests, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "apiary-agent", "namespace": AGENTS_NS}]


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
    for w in workloads(manifests):
        spec = pod_spec(w)
        assert spec["serviceAccountName"] in automount
        assert spec["automountServiceAccountToken"] == automount[spec["serviceAccountName"]]
    prometheus = one(manifests, "Role", "apiary-prometheus")
    assert prometheus["metadata"]["namespace"] == AGENTS_NS
    assert prometheus["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


# ---------------------------------------------------------------------- workloads
def test_agent_daemonset_names_its_node_with_the_downward_api(manifests: list[dict]):
    ds = one(manifests, "DaemonSet", "apiary-agent")
    assert ds["metadata"]["namespace"] == AGENTS_NS
    spec = pod_spec(ds)
    [agent] = spec["containers"]
    assert env_of(agent)["NODE_NAME"] == {
        "name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    cmd = agent["command"]
    assert cmd[:2] == ["apiary", "agent"]
    assert cmd[cmd.index("--node") + 1] == "$(NODE_NAME)"
    assert cmd[cmd.index("--runtime") + 1] == "kubernetes"
    assert cmd[cmd.index("--api") + 1] == CONTROL_PLANE_URL
    assert cmd[cmd.index("--state-dir") + 1] == "/var/lib/apiary/agents"
    assert cmd[cmd.index("--ca-cert") + 1] == CA_FILE == env_of(agent)["APIARY_CA_CERT"]["value"]
    assert env_of(agent)["APIARY_K8S_NAMESPACE"]["value"] == JOBS_NS
    assert spec["nodeSelector"] == DEFAULTS.agent.node_selector
    assert spec["tolerations"] == DEFAULTS.agent.tolerations
    # The credential: the node's directory the join wrote, read-only for the agent.
    mount, volume = volume_of(ds, agent, cmd[cmd.index("--credentials") + 1])
    assert mount["readOnly"] is True
    assert volume["hostPath"] == {"path": "/var/lib/apiary/credentials", "type": "DirectoryOrCreate"}


def join_command(manifests: list[dict]) -> tuple[str, list[str]]:
    """The join init container's shell script and the command it completes with the token."""
    join = container(one(manifests, "DaemonSet", "apiary-agent"), "join")
    sh, flags, script, arg0, *command = join["command"]
    assert (sh, flags, arg0) == ("sh", "-ec", "join")
    return script, command


def test_agents_join_with_their_nodes_bootstrap_token_and_the_ca_pin(manifests: list[dict]):
    ds = one(manifests, "DaemonSet", "apiary-agent")
    names = [c["name"] for c in pod_spec(ds)["initContainers"]]
    assert names == ["credentials-dir", "join"]  # the directory is the agent's before the join writes
    script, command = join_command(manifests)
    assert command[:3] == ["apiary", "agent", "join"]
    flags = dict(zip(command[3::2], command[4::2], strict=True))
    assert flags == {"--api": CONTROL_PLANE_URL, "--ca-cert-hash": CA_HASH, "--node": "$(NODE_NAME)",
                     "--credentials": "/var/lib/apiary/credentials"}
    assert 'exec "$@" --token "$BOOTSTRAP_TOKEN"' in script
    join = container(ds, "join")
    assert env_of(join)["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # It writes the credential where the agent reads it, and reads the tokens from their Secret.
    mount, volume = volume_of(ds, join, flags["--credentials"])
    assert "readOnly" not in mount and "hostPath" in volume
    mount, volume = volume_of(ds, join, "/etc/apiary/bootstrap")
    assert mount["readOnly"] is True
    assert volume["secret"] == {"secretName": "apiary-bootstrap-tokens", "optional": True, "defaultMode": 0o440}
    assert not any(m["name"] == volume["name"] for m in container(ds, "agent")["volumeMounts"])
    # The directory: 0700 and the agent user's, set by the only root container, with two capabilities.
    prepare = container(ds, "credentials-dir")
    assert prepare["command"] == ["sh", "-ec", "chown 10001:10001 /var/lib/apiary/credentials && "
                                               "chmod 0700 /var/lib/apiary/credentials"]
    assert prepare["securityContext"]["runAsUser"] == 0
    assert prepare["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container command: ``$(VAR)`` of a defined variable -> its
    value, ``$$`` -> ``$``, anything else kept (k8s.io/kubernetes third_party/forked/golang/expansion)."""
    def one_ref(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([^)]*)\)", one_ref, arg)


@pytest.mark.parametrize("case", ["first-join", "joined-already", "no-token"])
def test_join_init_container_joins_once_with_the_nodes_token(manifests: list[dict], tmp_path: Path, case: str):
    """The script the join init container runs, run by sh with a stand-in `apiary` that records
    its arguments: it joins with the node's token when the node has no credential yet, and is a
    no-op once it has one (a used bootstrap token cannot join again)."""
    script, command = join_command(manifests)
    creds, tokens, bin_dir = tmp_path / "credentials", tmp_path / "bootstrap", tmp_path / "bin"
    for d in (creds, tokens, bin_dir):
        d.mkdir()
    script = script.replace("/var/lib/apiary/credentials", str(creds)).replace("/etc/apiary/bootstrap", str(tokens))
    command = [str(creds) if a == "/var/lib/apiary/credentials" else a for a in command]
    calls = tmp_path / "calls"
    fake = bin_dir / "apiary"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {calls}\n')
    fake.chmod(0o755)
    token = "abcdef.0123456789abcdef"
    if case != "no-token":
        (tokens / "node-1").write_text(token)
    if case == "joined-already":
        (creds / "agent-node-1.token").write_text("earlier credential")
    env = {"NODE_NAME": "node-1", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(["sh", "-ec", _expand(script, env), "join", *(_expand(a, env) for a in command)],
                            env=env, capture_output=True, text=True, timeout=30)
    if case == "first-join":
        assert result.returncode == 0, result.stderr
        assert calls.read_text().split("\n")[:-1] == [
            "agent", "join", "--api", CONTROL_PLANE_URL, "--ca-cert-hash", CA_HASH, "--node", "node-1",
            "--credentials", str(creds), "--token", token]
        assert token not in result.stdout + result.stderr
    elif case == "joined-already":
        assert result.returncode == 0, result.stderr
        assert not calls.exists()
        assert "joined already" in result.stdout
    else:
        assert result.returncode == 1 and not calls.exists()
        assert "key node-1 of Secret apiary-bootstrap-tokens" in result.stderr


def test_control_plane_replicas_elect_a_leader_on_the_stores_lease(manifests: list[dict]):
    cp = one(manifests, "StatefulSet", "apiary-control-plane")
    assert cp["spec"]["replicas"] == 2
    assert cp["spec"]["serviceName"] == "apiary-control-plane-peers"
    assert cp["spec"]["podManagementPolicy"] == "Parallel"
    [main] = pod_spec(cp)["containers"]
    assert main["command"] == ["apiary", "control-plane", "--host", "0.0.0.0", "--port", "8470"]
    env = env_of(main)
    assert {k: e.get("value") for k, e in env.items() if k.startswith(("APIARY_LE", "APIARY_RE"))} == {
        "APIARY_LEADER_ELECT": "true", "APIARY_LEASE_DURATION_S": "6.0", "APIARY_RENEW_DEADLINE_S": "4.0",
        "APIARY_RETRY_PERIOD_S": "1.0", "APIARY_REPLICA_ID": None}
    assert env["APIARY_REPLICA_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # Advertised as its peer name (a DNS name its certificate carries), built from its pod name.
    assert env["APIARY_ADVERTISE_URL"]["value"] == (
        f"https://$(APIARY_REPLICA_ID).apiary-control-plane-peers.{PLATFORM_NS}.svc:8470")
    names = list(env)
    assert names.index("APIARY_REPLICA_ID") < names.index("APIARY_ADVERTISE_URL")  # $(VAR) needs it defined first
    peers = one(manifests, "Service", "apiary-control-plane-peers")
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    # PostgreSQL: the URL from a Secret, verified (libpq's verify-full) against the platform CA.
    assert env["APIARY_DATABASE_URL"]["valueFrom"] == {"secretKeyRef": {"name": "apiary-database", "key": "url"}}
    assert env["PGSSLMODE"]["value"] == "verify-full" and env["PGSSLROOTCERT"]["value"] == CA_FILE
    assert env["APIARY_HOME"]["value"] == "/var/lib/apiary"
    config = one(manifests, "ConfigMap", "apiary-cluster-config")
    source = (VALUES.parent / yaml.safe_load(VALUES.read_text())["clusterConfig"]["file"]).read_text()
    assert config["data"]["cluster.yaml"] == source
    [init] = pod_spec(cp)["initContainers"]
    assert init["command"][-1] == "/var/lib/apiary/cluster.yaml"  # APIARY_HOME/cluster.yaml, writable
    # Each replica its own home claim.
    [claim] = cp["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "home" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert not any(v["name"] == "home" for v in pod_spec(cp)["volumes"])


def test_control_plane_replicas_spread_over_nodes_and_keep_one_through_a_drain(manifests: list[dict]):
    cp = one(manifests, "StatefulSet", "apiary-control-plane")
    selector = cp["spec"]["selector"]["matchLabels"]
    [term] = pod_spec(cp)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": selector}}
    pdb = one(manifests, "PodDisruptionBudget", "apiary-control-plane")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": selector}}
    # The Service is in front of every replica (followers forward writes to the leader).
    service = one(manifests, "Service", "apiary-control-plane")
    assert service["spec"]["selector"] == selector
    assert service["spec"].get("clusterIP") != "None"


@pytest.mark.parametrize(("replicas", "anti_affinity"), [(1, "required"), (3, "preferred")])
def test_replicas_and_anti_affinity_follow_the_values(tmp_path: Path, replicas: int, anti_affinity: str):
    files = render(write_values(tmp_path, controlPlane={"replicas": replicas, "antiAffinity": anti_affinity}),
                   tmp_path / "out")
    manifests = [yaml.safe_load(p.read_text()) for p in files]
    cp = one(manifests, "StatefulSet", "apiary-control-plane")
    assert cp["spec"]["replicas"] == replicas
    assert len(by_kind(manifests, "PodDisruptionBudget")) == (1 if replicas >= 2 else 0)
    anti = pod_spec(cp)["affinity"]["podAntiAffinity"]
    if anti_affinity == "preferred":
        [term] = anti["preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["weight"] == 100 and term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    else:
        assert "requiredDuringSchedulingIgnoredDuringExecution" in anti
    # The certificate the NOTES ask for names every replica.
    notes = (tmp_path / "out" / NOTES_FILE).read_text()
    for n in range(replicas):
        assert f"--host apiary-control-plane-{n}.apiary-control-plane-peers.{PLATFORM_NS}.svc" in notes
    assert f"apiary-control-plane-{replicas}." not in notes


def test_control_plane_serves_https_with_its_tls_secret(manifests: list[dict]):
    cp = one(manifests, "StatefulSet", "apiary-control-plane")
    [main] = pod_spec(cp)["containers"]
    env = env_of(main)
    assert env["APIARY_CA_CERT"]["value"] == CA_FILE
    cert, key = env["APIARY_TLS_CERT"]["value"], env["APIARY_TLS_KEY"]["value"]
    mount, volume = volume_of(cp, main, str(Path(cert).parent))
    assert str(Path(key).parent) == mount["mountPath"] and mount["readOnly"] is True
    assert volume["secret"]["secretName"] == "apiary-control-plane-tls"
    assert {i["key"]: i["path"] for i in volume["secret"]["items"]} == {
        "tls.crt": Path(cert).name, "tls.key": Path(key).name}
    mount, volume = volume_of(cp, main, str(Path(CA_FILE).parent))
    assert mount["readOnly"] is True
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # never a CA key
    for probe in ("startupProbe", "readinessProbe"):
        assert main[probe]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}


def test_every_tls_and_token_secret_is_mounted_read_only_and_not_world_readable(manifests: list[dict]):
    """Secrets in the pods: read-only mounts, mode 0400 or 0440 (the pod's fsGroup lets the
    non-root user read 0440; Kubernetes' default 0644 would let any user in the container read)."""
    seen = set()
    for w in workloads(manifests):
        secret_volumes = {v["name"]: v["secret"] for v in pod_spec(w).get("volumes", []) if "secret" in v}
        for c in containers(w):
            for m in c.get("volumeMounts", []):
                if m["name"] in secret_volumes:
                    where = f"{w['metadata']['name']}/{c['name']}:{m['mountPath']}"
                    assert m.get("readOnly") is True, where
                    assert secret_volumes[m["name"]]["defaultMode"] in (0o400, 0o440), where
                    seen.add(secret_volumes[m["name"]]["secretName"])
    assert seen == {"apiary-ca", "apiary-control-plane-tls", "apiary-prefect-tls", "apiary-bootstrap-tokens",
                    "apiary-alertmanager-token"}


def test_no_secret_value_is_in_any_manifest(rendered: list[Path], manifests: list[dict]):
    """Secrets are referenced, never rendered: no Secret object, no key or certificate, no
    bootstrap token, and every env value that is a credential comes from a secretKeyRef."""
    assert not by_kind(manifests, "Secret")
    for path in rendered:
        text = path.read_text()
        assert "PRIVATE KEY" not in text and "BEGIN CERTIFICATE" not in text, path.name
        assert not re.search(BOOTSTRAP_TOKEN_RE, text), path.name
    for w in workloads(manifests):
        for c in containers(w):
            for e in c.get("env", []):
                if re.search(r"TOKEN|PASSWORD|AUTH|DATABASE_URL|CONNECTION_URL", e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{w['metadata']['name']}/{e['name']}"


def test_notes_say_how_to_make_every_referenced_secret(rendered: list[Path]):
    notes = (rendered[0].parent / NOTES_FILE).read_text()
    assert "apiary ca init --dir ./ca" in notes
    assert "apiary ca issue control-plane --dir ./ca --out ./certs --host apiary-control-plane " in notes
    assert "apiary ca issue prefect --dir ./ca --out ./certs " in notes
    for ns in (PLATFORM_NS, AGENTS_NS):
        assert f"kubectl -n {ns} create secret generic apiary-ca --from-file=ca.crt=" in notes
    assert f"kubectl -n {PLATFORM_NS} create secret tls apiary-control-plane-tls" in notes
    assert f"kubectl -n {PLATFORM_NS} create secret tls apiary-prefect-tls" in notes
    assert "sslmode=verify-full&sslrootcert=/etc/apiary/ca/ca.crt" in notes
    # One bootstrap token per node of the cluster config (examples/lab6's two-VC config).
    for node in ("hostname-carol", "hostname-dan"):
        assert f"--from-literal={node}=\"$(apiary node bootstrap-token create --ttl 1h --node {node})\"" in notes
    assert CA_HASH in notes


def test_prefect_server_is_behind_a_tls_terminator_and_the_bridge_verifies_both(manifests: list[dict]):
    deployment = one(manifests, "Deployment", "apiary-prefect-server")
    server, proxy = container(deployment, "prefect-server"), container(deployment, "tls-proxy")
    assert server["command"] == ["prefect", "server", "start", "--host", "127.0.0.1", "--port", "4201"]
    assert "ports" not in server  # loopback only
    assert env_of(server)["PREFECT_SERVER_API_AUTH_STRING"]["valueFrom"]["secretKeyRef"]["name"] == (
        "apiary-prefect-auth")
    assert proxy["image"] == "nginx:1.27-bookworm"
    assert proxy["ports"] == [{"name": "https", "containerPort": 4200, "protocol": "TCP"}]
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/api/health", "port": "https", "scheme": "HTTPS"}
    conf = one(manifests, "ConfigMap", "apiary-prefect-tls-proxy")["data"]["nginx.conf"]
    assert "listen 4200 ssl;" in conf and "proxy_pass http://127.0.0.1:4201;" in conf
    _, volume = volume_of(deployment, proxy, "/etc/apiary/tls/prefect")
    assert volume["secret"]["secretName"] == "apiary-prefect-tls"
    assert "ssl_certificate /etc/apiary/tls/prefect/tls.crt;" in conf
    assert "ssl_certificate_key /etc/apiary/tls/prefect/tls.key;" in conf
    assert one(manifests, "Service", "apiary-prefect-server")["spec"]["ports"][0]["targetPort"] == "https"
    bridge_deployment = one(manifests, "Deployment", "apiary-prefect-bridge")
    [bridge] = pod_spec(bridge_deployment)["containers"]
    cmd = bridge["command"]
    assert cmd[:2] == ["apiary", "prefect-bridge"]
    assert cmd[cmd.index("--api") + 1] == CONTROL_PLANE_URL
    assert cmd[cmd.index("--prefect-api") + 1] == f"https://apiary-prefect-server.{PLATFORM_NS}.svc:4200/api"
    assert env_of(bridge)["APIARY_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "apiary-bridge-token"
    assert env_of(bridge)["APIARY_CA_CERT"]["value"] == env_of(bridge)["PREFECT_API_SSL_CERT_FILE"]["value"] == CA_FILE
    volume_of(bridge_deployment, bridge, str(Path(CA_FILE).parent))
    assert server["image"] == bridge["image"] == "localhost:5000/apiary/prefect:0.1.0"


def test_nginx_accepts_the_terminator_config(manifests: list[dict], tmp_path: Path):
    """``nginx -t`` on the rendered config, with a throwaway certificate where the Secret is
    mounted (skipped without Debian's nginx)."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        reason = "nginx not installed (apt-get install nginx; .ci/run does this)"
        if in_ci():
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    conf = one(manifests, "ConfigMap", "apiary-prefect-tls-proxy")["data"]["nginx.conf"]
    tls = tmp_path / "tls"
    tls.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-subj", "/CN=localhost", "-days", "1", "-keyout", str(tls / "tls.key"), "-out",
                    str(tls / "tls.crt")], check=True, capture_output=True, timeout=30)
    conf = conf.replace(" /tmp/", f" {tmp_path}/").replace("/etc/apiary/tls/prefect", str(tls))
    (tmp_path / "nginx.conf").write_text(conf)
    result = subprocess.run([nginx, "-t", "-e", "stderr", "-c", str(tmp_path / "nginx.conf")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("kind", "name", "container_name", "path"),
    [("StatefulSet", "apiary-control-plane", "control-plane", "/healthz"),
     ("Deployment", "apiary-prefect-server", "tls-proxy", "/api/health"),
     ("Deployment", "apiary-prometheus", "prometheus", "/-/healthy"),
     ("Deployment", "apiary-alertmanager", "alertmanager", "/-/healthy")],
)
def test_services_with_a_health_endpoint_are_probed_on_it(manifests: list[dict], kind: str, name: str,
                                                          container_name: str, path: str):
    workload = one(manifests, kind, name)
    probed = container(workload, container_name)
    if name in ("apiary-control-plane", "apiary-prefect-server"):
        # Its health endpoint can fail for what a restart does not cure (the control plane's store,
        # the terminator's upstream): out of the Service, not restarted.
        assert probed["readinessProbe"]["httpGet"]["path"] == path
        assert probed["livenessProbe"]["tcpSocket"]["port"] == "https"
    else:
        assert probed["livenessProbe"]["httpGet"]["path"] == path
    assert "readinessProbe" in probed
    service = one(manifests, "Service", name)
    assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def test_images_come_from_the_values(manifests: list[dict]):
    images = {c["image"] for w in workloads(manifests) for c in containers(w)}
    assert images == {
        "localhost:5000/apiary/control-plane:0.1.0", "localhost:5000/apiary/agent:0.1.0",
        "localhost:5000/apiary/prefect:0.1.0", "prom/prometheus:v2.42.0", "prom/alertmanager:v0.25.0",
        "nginx:1.27-bookworm",
    }


def test_pods_run_non_root_read_only_without_escalation_and_with_resources(manifests: list[dict]):
    """Every container but the agents' credentials-dir (root with CHOWN and FOWNER, for its
    chown and chmod) is non-root with no capabilities; the agents' credential directory is the
    only hostPath, and only in the agents namespace (Pod Security privileged there alone)."""
    for w in workloads(manifests):
        spec = pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in containers(w):
            sc = c["securityContext"]
            where = f"{w['metadata']['name']}/{c['name']}"
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            if where != "apiary-agent/credentials-dir":
                assert sc["capabilities"] == {"drop": ["ALL"]}, where
                assert sc.get("runAsUser", 1) != 0 and sc.get("runAsNonRoot", True) is True, where
            assert "privileged" not in sc, where
            assert c["resources"]["requests"] and c["resources"]["limits"], where
        host_paths = [v["hostPath"]["path"] for v in spec.get("volumes", []) if "hostPath" in v]
        if w["metadata"]["name"] == "apiary-agent":
            assert host_paths == ["/var/lib/apiary/credentials"]
        else:
            assert not host_paths, w["metadata"]["name"]
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


def test_objects_live_in_the_platform_namespace_except_the_agents_and_their_job_rbac(manifests: list[dict]):
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    in_agents_ns = {("DaemonSet", "apiary-agent"), ("ServiceAccount", "apiary-agent"),
                    ("Role", "apiary-prometheus"), ("RoleBinding", "apiary-prometheus")}
    for m in manifests:
        ns = m["metadata"].get("namespace")
        if m["kind"] in cluster_scoped:
            assert ns is None
        elif m["kind"] in ("Role", "RoleBinding") and m["metadata"]["name"] == "apiary-agent":
            assert ns == JOBS_NS
        elif (m["kind"], m["metadata"]["name"]) in in_agents_ns:
            assert ns == AGENTS_NS
        else:
            assert ns == PLATFORM_NS, f"{m['kind']}/{m['metadata']['name']}"
    levels = {m["metadata"]["name"]: m["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
              for m in by_kind(manifests, "Namespace")}
    assert levels == {PLATFORM_NS: "restricted", JOBS_NS: "privileged", AGENTS_NS: "privileged"}


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
        {"targets": [f"apiary-control-plane.{PLATFORM_NS}.svc:8470"]}], "scheme": "https",
        "tls_config": {"ca_file": CA_FILE}}
    prometheus = one(manifests, "Deployment", "apiary-prometheus")
    volume_of(prometheus, container(prometheus, "prometheus"), str(Path(CA_FILE).parent))
    node, shipped_node = jobs["apiary-node"], want["apiary-node"]
    for key in ("honor_labels", "metrics_path", "metric_relabel_configs"):
        assert node[key] == shipped_node[key]
    assert node["relabel_configs"][-len(shipped_node["relabel_configs"]):] == shipped_node["relabel_configs"]
    assert {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"} in node["relabel_configs"]
    [sd] = node["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"] == {"names": [AGENTS_NS]}
    assert "file_sd_configs" not in node


def test_alertmanager_configmap_is_deploy_alertmanager(manifests: list[dict]):
    text = one(manifests, "ConfigMap", "apiary-alertmanager")["data"]["alertmanager.yml"]
    cfg = yaml.safe_load(text)
    shipped = yaml.safe_load((ALERTMANAGER_DIR / "alertmanager.yml").read_text())
    assert cfg["route"] == shipped["route"]
    assert cfg["inhibit_rules"] == shipped["inhibit_rules"]
    assert cfg["global"] == shipped["global"]
    [hook] = next(r for r in cfg["receivers"] if r["name"] == "apiary-webhook")["webhook_configs"]
    assert hook["url"] == f"https://apiary-control-plane.{PLATFORM_NS}.svc:8470/api/v2/alerts/webhook"
    assert hook["http_config"]["tls_config"] == {"ca_file": CA_FILE}
    token_file = hook["http_config"]["authorization"]["credentials_file"]
    deployment = one(manifests, "Deployment", "apiary-alertmanager")
    [main] = pod_spec(deployment)["containers"]
    _, volume = volume_of(deployment, main, str(Path(token_file).parent))
    assert volume["secret"]["secretName"] == "apiary-alertmanager-token"
    assert volume["secret"]["items"] == [{"key": "token", "path": Path(token_file).name}]
    _, volume = volume_of(deployment, main, str(Path(CA_FILE).parent))
    assert volume["secret"]["secretName"] == "apiary-ca"


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
        ({"controlPlane": {"replicas": 0}}, "controlPlane.replicas"),
        ({"controlPlane": {"leaderElection": {"renewDeadlineS": 6}}}, "controlPlane.leaderElection"),
        ({"controlPlane": {"leaderElection": {"retryPeriodS": 4}}}, "controlPlane.leaderElection"),
        ({"controlPlane": {"antiAffinity": "sometimes"}}, "controlPlane.antiAffinity"),
        ({"controlPlane": {"env": {"APIARY_LEADER_ELECT": "false"}}}, "controlPlane.env"),
        ({"agent": {"caCertHash": None}}, "agent.caCertHash"),
        ({"agent": {"caCertHash": "sha256:abc"}}, "agent.caCertHash"),
        ({"agent": {"tokensSecret": "apiary-agent-tokens"}}, "agent.tokensSecret"),
        ({"agent": {"credentialsHostPath": "relative/dir"}}, "agent.credentialsHostPath"),
        ({"namespaces": {"agents": "apiary"}}, "namespaces"),
        ({"tls": {"controlPlaneSecret": "Not_A_Name"}}, "tls.controlPlaneSecret"),
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


def test_the_shipped_values_need_the_operators_ca_pin(tmp_path: Path):
    """deploy/kubernetes/values.yaml renders once agent.caCertHash is set, and not before: the
    agents cannot join without the pin, and no pin is right for every cluster."""
    assert DEFAULTS.agent.ca_cert_hash is None
    with pytest.raises(ValidationError) as info:
        render(VALUES, tmp_path / "out")
    assert info.value.field == "agent.caCertHash" and "apiary ca hash" in info.value.message
    assert not (tmp_path / "out").exists()


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
    values = write_values(tmp_path)
    result = CliRunner().invoke(app, ["deploy", "render", "--values", str(values), "--out", str(out)])
    assert result.exit_code == 0, result.output
    printed = result.stdout.split()
    assert printed == [str(p) for p in sorted(out.glob("*.yaml"))]
    assert len(printed) >= len(EXPECTED_KINDS)


def test_cli_deploy_render_reports_the_bad_field(tmp_path: Path):
    from apiary.cli.main import app

    bad = write_values(tmp_path)
    bad.write_text(bad.read_text() + "\nextraThing: 1\n")
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
