"""KubernetesBackend against a fake Kubernetes API (tests/support/fake_k8s.py).

No Kubernetes API server can run on the machines these tests run on, so every test talks, through
the official ``kubernetes`` client, to :class:`~tests.support.fake_k8s.FakeKubernetes`: a real
HTTP server on loopback that stores pods, secrets and nodes with resourceVersions and streams
watches and logs. The test controls play the kubelet and the node controller (``set_running``,
``terminate``, ``set_waiting``, ``lose_node``) and the network (``drop_watches``, ``compact``).
The manifests are also checked against Kubernetes 1.35's schema (``kubernetes-validate``).
Nothing sleeps to wait: every wait polls with a deadline.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes import client as k8s
from tests.support.fake_k8s import FakeKubernetes
from tests.support.polling import until

from apiary.errors import PlatformError, UnavailableError, ValidationError
from apiary.lifecycle import classify_exit
from apiary.runtime.base import TaskLaunch, TaskStatus
from apiary.runtime.kubernetes import (
    ANNOTATION_RUN_ID,
    EXIT_IMAGE_NOT_EXISTS,
    EXIT_OOM_KILLED,
    HIVED_BIND_INFO,
    KubernetesBackend,
    api_client_from_env,
    build_pod,
    hived_bind_info,
    label_value,
    pod_exit,
    pod_name,
)

NODE = "worker-1"
NS = "apiary-jobs"
WAIT_S = 5.0
RUN = "alice~mnist.a0.train.0.t0"
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def make_task(run_id: str = RUN, **overrides: Any) -> TaskLaunch:
    """A task of alice's mnist job, role ``train``; ``overrides`` replace fields."""
    task = TaskLaunch(
        run_id=run_id, job_id="alice~mnist", user="alice", job_name="mnist", task_role="train", index=0,
        commands=["echo start", "python3 train.py"],
        env={"PAI_JOB_NAME": "alice~mnist", "PAI_CURRENT_TASK_ROLE_NAME": "train", "PAI_TASK_INDEX": "0"},
        virtual_cluster="vc-a",
    )
    return replace(task, **overrides)


@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    with FakeKubernetes() as server:
        server.add_node(NODE)
        yield server


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def backend(fake: FakeKubernetes, state_dir: Path) -> Iterator[KubernetesBackend]:
    with KubernetesBackend(state_dir, node=NODE, namespace=NS, api_client=fake.api_client()) as b:
        yield b


def wait_status(backend: KubernetesBackend, run_id: str, pred: Any, what: str) -> TaskStatus:
    def check() -> TaskStatus | None:
        st = backend.status(run_id)
        return st if st is not None and pred(st) else None

    return until(check, WAIT_S, what, poll_s=0.01)


def wait_exited(backend: KubernetesBackend, run_id: str = RUN) -> TaskStatus:
    return wait_status(backend, run_id, lambda s: s.state == "exited", f"{run_id} to exit")


def wait_started(backend: KubernetesBackend, run_id: str = RUN) -> TaskStatus:
    return wait_status(backend, run_id, lambda s: s.started_at is not None, f"{run_id} to start")


# -- the pod ---------------------------------------------------------------------------------


def test_launch_creates_a_pod_bound_to_the_node(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    task = make_task(
        gpus=[2, 3], leaf_cells=[2, 3], cpu=4, memory_mb=8192, image="openpai/standard:pytorch",
        ports={"http": 1}, env={**make_task().env, "PAI_CONTAINER_HOST_http_PORT_LIST": "18080"},
        probes={"livenessProbe": {"exec": {"command": ["cat", "/tmp/healthy"]}, "periodSeconds": 5},
                "readinessProbe": {"httpGet": {"port": "http", "path": "/ready"}, "failureThreshold": 2}},
    )
    st = backend.launch(task)
    assert (st.state, st.exit_code, st.started_at, st.pid) == ("running", None, None, None)

    [body] = fake.created_pods
    kubernetes_validate.validate(body, "1.35.0", strict=True)
    pod = fake.pods(NS)[pod_name(RUN)]
    spec = pod["spec"]
    assert spec["nodeName"] == NODE
    assert spec["restartPolicy"] == "Never"
    assert spec["hostNetwork"] is True
    [c] = spec["containers"]
    assert c["image"] == "openpai/standard:pytorch"
    assert c["command"] == ["/bin/sh", "-c", "set -e\necho start\npython3 train.py\n"]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "2", "cpu": "4", "memory": "8192Mi"},
                              "requests": {"cpu": "4", "memory": "8192Mi"}}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["PAI_JOB_NAME"] == "alice~mnist"
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["CUDA_VISIBLE_DEVICES"]) == ("2,3", "0,1")
    assert c["ports"] == [{"containerPort": 18080, "hostPort": 18080, "protocol": "TCP"}]
    assert c["livenessProbe"]["exec"] == {"command": ["cat", "/tmp/healthy"]}
    assert c["livenessProbe"]["periodSeconds"] == 5
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 18080, "host": "127.0.0.1", "scheme": "HTTP"}
    assert c["readinessProbe"]["failureThreshold"] == 2

    meta = pod["metadata"]
    assert meta["annotations"][ANNOTATION_RUN_ID] == RUN
    assert meta["labels"]["apiary.io/run-id"] == "alice_mnist.a0.train.0.t0"
    assert {k: meta["labels"][k] for k in ("apiary.io/job", "apiary.io/user", "apiary.io/virtual-cluster",
                                           "apiary.io/task-role", "apiary.io/task-index")} == {
        "apiary.io/job": "alice_mnist", "apiary.io/user": "alice", "apiary.io/virtual-cluster": "vc-a",
        "apiary.io/task-role": "train", "apiary.io/task-index": "0"}
    assert yaml.safe_load(meta["annotations"][HIVED_BIND_INFO]) == {
        "node": NODE, "leafCellIsolation": [2, 3], "cellChain": "",
        "affinityGroupBindInfo": [{"podPlacements": [
            {"physicalNode": NODE, "physicalLeafCellIndices": [2, 3], "preassignedCellTypes": []}]}],
    }
    assert meta["annotations"]["hivedscheduler.microsoft.com/pod-leaf-cell-isolation"] == "2,3"
    launch = json.loads((backend.state_dir / RUN / "launch.json").read_text())
    assert launch["pod_name"] == pod_name(RUN) and "env" not in launch


def test_pod_without_gpus_or_host_network() -> None:
    task = make_task(probes={"livenessProbe": {"tcpSocket": {"port": 8080}}})
    pod = k8s.ApiClient().sanitize_for_serialization(
        build_pod(task, node=NODE, namespace=NS, image="busybox", host_network=False))
    kubernetes_validate.validate(pod, "1.35.0", strict=True)
    c = pod["spec"]["containers"][0]
    assert "hostNetwork" not in pod["spec"] and "dnsPolicy" not in pod["spec"]
    assert c.get("resources", {}) == {}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["CUDA_VISIBLE_DEVICES"]) == ("void", "")
    assert c["livenessProbe"]["tcpSocket"] == {"port": 8080}  # no loopback host: the kubelet probes the pod IP


def test_hived_bind_info_leaf_cells_apart_from_gpus() -> None:
    """A leaf cell of two GPUs: leaf 1 owns GPUs 2 and 3 (apiary.scheduler.TaskPlacement)."""
    info = yaml.safe_load(hived_bind_info(NODE, [2, 3], [1]))
    assert info["leafCellIsolation"] == [2, 3]
    assert info["affinityGroupBindInfo"][0]["podPlacements"][0]["physicalLeafCellIndices"] == [1]


@pytest.mark.parametrize(
    "run_id",
    [RUN, "Bob~Job_1.a12.worker.3.t4", "x" * 200, "a~.b", "-lead~dash.a0.r.0.t0", "__~__.a0.r.0.t0"],
    ids=["plain", "upper-underscore", "200-chars", "dots", "leading-dash", "only-symbols"],
)
def test_pod_names_are_dns1123_labels(run_id: str) -> None:
    name = pod_name(run_id)
    assert len(name) <= 63 and _DNS1123_LABEL.match(name), name
    assert pod_name(run_id) == name  # deterministic
    assert label_value(run_id) == "" or _LABEL_VALUE.match(label_value(run_id))
    assert len(label_value(run_id)) <= 63


def test_pod_names_keep_run_ids_apart() -> None:
    ids = ["alice~mnist.a0.train.0.t0", "Alice~mnist.a0.train.0.t0", "alice~mnist.a0.train_0.t0",
           "alice-mnist.a0.train.0.t0"]
    assert len({pod_name(i) for i in ids}) == len(ids)


# -- launch ----------------------------------------------------------------------------------


def test_launch_is_idempotent(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    first = backend.launch(make_task())
    again = backend.launch(make_task(commands=["echo different"]))
    assert again.run_id == first.run_id and again.state == "running"
    assert fake.count("POST", "/pods") == 1
    assert list(fake.pods(NS)) == [pod_name(RUN)]


@pytest.mark.parametrize("run_id", ["", ".hidden", "a/b", "a b", "x" * 201], ids=["empty", "dot", "slash", "space",
                                                                                  "too-long"])
def test_bad_run_id_is_a_validation_error(fake: FakeKubernetes, backend: KubernetesBackend, run_id: str) -> None:
    with pytest.raises(ValidationError) as err:
        backend.launch(make_task(run_id=run_id))
    assert err.value.field == "run_id"
    assert backend.status(run_id) is None
    assert fake.count("POST", "/pods") == 0


def test_refused_create_is_a_platform_error_and_leaves_no_record(fake: FakeKubernetes,
                                                                 backend: KubernetesBackend) -> None:
    fake.fail_next("POST", "pods", 403, "Forbidden")
    with pytest.raises(PlatformError) as err:
        backend.launch(make_task())
    assert not isinstance(err.value, UnavailableError) and "403" in err.value.message
    assert backend.status(RUN) is None and not (backend.state_dir / RUN).exists()
    assert backend.launch(make_task()).state == "running"  # a retry launches
    assert list(fake.pods(NS)) == [pod_name(RUN)]


def test_api_server_down_is_unavailable(fake: FakeKubernetes, backend: KubernetesBackend, state_dir: Path) -> None:
    fake.fail_next("POST", "pods", 503, "ServiceUnavailable")
    with pytest.raises(UnavailableError):
        backend.launch(make_task())
    assert backend.status(RUN) is None
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    cfg = k8s.Configuration()
    cfg.host = f"http://127.0.0.1:{dead}"
    cfg.retries = 0
    with pytest.raises(UnavailableError, match="unreachable"):
        KubernetesBackend(state_dir / "other", node=NODE, namespace=NS, api_client=k8s.ApiClient(cfg))


def test_kubeconfig_from_apiary_kubeconfig(fake: FakeKubernetes, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented way to a real cluster: APIARY_KUBECONFIG and APIARY_K8S_NAMESPACE."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
        "users": [{"name": "agent", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
    }))
    monkeypatch.setenv("APIARY_KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("APIARY_K8S_NAMESPACE", "team-a")
    assert api_client_from_env().configuration.host == fake.url
    with KubernetesBackend(tmp_path / "state", node=NODE) as b:
        assert b.namespace == "team-a"
        b.launch(make_task())
    assert list(fake.pods("team-a")) == [pod_name(RUN)]
    monkeypatch.setenv("APIARY_KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(PlatformError, match="APIARY_KUBECONFIG"):
        api_client_from_env()


# -- exit codes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "reason", "expected"),
    [(0, None, 0), (1, None, 1), (143, "Error", 143), (137, "OOMKilled", EXIT_OOM_KILLED)],
    ids=["success", "failure", "sigterm", "oom-killed"],
)
def test_exit_codes(fake: FakeKubernetes, backend: KubernetesBackend, code: int, reason: str | None,
                    expected: int) -> None:
    backend.launch(make_task())
    fake.set_running(pod_name(RUN))
    started = wait_started(backend)
    fake.terminate(pod_name(RUN), code, reason)
    st = wait_exited(backend)
    assert (st.exit_code, st.lost, st.stopped) == (expected, False, False)
    assert st.succeeded is (expected == 0)
    assert st.started_at == started.started_at and st.finished_at is not None
    assert json.loads((backend.state_dir / RUN / "final.json").read_text())["exit_code"] == expected


def test_exit_codes_are_openpai_entries() -> None:
    assert classify_exit(EXIT_OOM_KILLED).phrase == "UserContainerDockerOOMKilled"
    assert classify_exit(EXIT_IMAGE_NOT_EXISTS).phrase == "ContainerImageNotExists"


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff", "InvalidImageName"])
def test_image_pull_failure_is_254_and_deletes_the_pod(fake: FakeKubernetes, backend: KubernetesBackend,
                                                       reason: str) -> None:
    backend.launch(make_task(image="registry.example/nope:1", image_auth={
        "username": "alice", "password": "s3cret", "registryuri": "registry.example"}))
    assert pod_name(RUN) in fake.secrets(NS)
    fake.set_waiting(pod_name(RUN), reason, 'pull access denied for registry.example/nope')
    st = wait_exited(backend)
    assert (st.exit_code, st.lost, st.stopped, st.started_at) == (EXIT_IMAGE_NOT_EXISTS, False, False, None)
    until(lambda: not fake.pods(NS) and not fake.secrets(NS), WAIT_S, "the pod and its secret to be deleted",
          poll_s=0.01)
    log = backend.log_path(RUN, "stdout")
    assert log is not None and reason in log.read_text()
    assert "s3cret" not in log.read_text()


def test_pull_secret(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    backend.launch(make_task(image="registry.example/mnist:1", image_auth={
        "username": "alice", "password": "s3cret", "registryuri": "registry.example"}))
    pod = fake.pods(NS)[pod_name(RUN)]
    secret = fake.secrets(NS)[pod_name(RUN)]
    assert pod["spec"]["imagePullSecrets"] == [{"name": pod_name(RUN)}]
    assert secret["type"] == "kubernetes.io/dockerconfigjson"
    auths = json.loads(base64.b64decode(secret["data"][".dockerconfigjson"]))["auths"]
    assert auths["registry.example"]["auth"] == base64.b64encode(b"alice:s3cret").decode()
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": pod_name(RUN), "uid": pod["metadata"]["uid"]}]
    assert "s3cret" not in (backend.state_dir / RUN / "launch.json").read_text()


# -- node loss, deletion ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["evict", "phase"], ids=["taint-eviction", "phase-nodelost"])
def test_node_loss_reads_as_lost(fake: FakeKubernetes, backend: KubernetesBackend, how: str) -> None:
    backend.launch(make_task())
    fake.set_running(pod_name(RUN))
    wait_started(backend)
    fake.lose_node(NODE, how=how)
    st = wait_exited(backend)
    assert (st.exit_code, st.lost, st.stopped, st.finished_at) == (None, True, False, None)
    assert not st.succeeded


def test_pod_deleted_by_someone_else_is_lost(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    backend.launch(make_task())
    fake.set_running(pod_name(RUN))
    wait_started(backend)
    fake.delete_pod(pod_name(RUN))
    st = wait_exited(backend)
    assert (st.exit_code, st.lost, st.stopped) == (None, True, False)


@pytest.mark.parametrize(
    ("pod", "deleted", "expected"),
    [
        ({"status": {"phase": "Pending"}}, False, None),
        ({"status": {"phase": "Running", "containerStatuses": [{"name": "task", "state": {"running": {}}}]}}, False,
         None),
        ({"status": {"containerStatuses": [{"name": "task", "state": {"terminated": {"exitCode": 2}}}]}}, True,
         (2, False)),
        ({"status": {"phase": "Failed", "reason": "Evicted"}}, False, (None, True)),
        ({"status": {"phase": "Running", "conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]}}, False, None),
        ({"status": {"phase": "Running", "conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC"}]}}, False, (None, True)),
        ({"status": {"phase": "Running"}}, True, (None, True)),
    ],
    ids=["pending", "running", "deleted-after-exit", "evicted-before-start", "preemption-waits-for-kubelet",
         "node-object-deleted", "deleted-without-code"],
)
def test_pod_exit_table(pod: dict[str, Any], deleted: bool, expected: tuple[int | None, bool] | None) -> None:
    end = pod_exit(pod, deleted=deleted)
    assert (None if end is None else (end.exit_code, end.lost)) == expected


# -- stop and forget -------------------------------------------------------------------------


def test_stop_deletes_the_pod(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    backend.launch(make_task())
    fake.set_running(pod_name(RUN))
    wait_started(backend)
    began = time.monotonic()
    backend.stop(RUN, grace_s=2.0)
    assert time.monotonic() - began < 3.0
    st = backend.status(RUN)
    assert st is not None and (st.state, st.exit_code, st.stopped, st.lost) == ("exited", 143, True, False)
    assert fake.pods(NS) == {}
    deletes = [q for m, p, q in fake.requests if m == "DELETE" and p.endswith("/pods/" + pod_name(RUN))]
    assert deletes == [{"gracePeriodSeconds": "2"}]
    backend.stop(RUN, grace_s=2.0)  # idempotent: nothing more is deleted
    backend.stop("never~launched.a0.r.0.t0")
    backend.stop("../bad")
    assert fake.count("DELETE", "/pods/" + pod_name(RUN)) == 1


def test_stop_before_the_container_started(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    backend.launch(make_task())
    backend.stop(RUN, grace_s=0)
    st = backend.status(RUN)
    assert st is not None and (st.state, st.exit_code, st.stopped, st.lost) == ("exited", None, True, False)


def test_stop_does_not_wait_for_a_kubelet_that_never_answers(fake: FakeKubernetes,
                                                             backend: KubernetesBackend) -> None:
    backend.launch(make_task())
    fake.set_running(pod_name(RUN))
    wait_started(backend)
    with fake.hold_watches():
        fake.drop_watches()  # the backend is blind: the pod's end never reaches it
        began = time.monotonic()
        backend.stop(RUN, grace_s=0.2)
        assert time.monotonic() - began < 1.5
    st = backend.status(RUN)
    assert st is not None and (st.state, st.exit_code, st.stopped) == ("exited", 137, True)


def test_forget(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    backend.launch(make_task())
    fake.set_running(pod_name(RUN))
    wait_started(backend)
    with pytest.raises(PlatformError, match="still running"):
        backend.forget(RUN)
    fake.terminate(pod_name(RUN), 0)
    wait_exited(backend)
    assert pod_name(RUN) in fake.pods(NS)  # a finished pod stays until forgotten (kubectl logs works)
    backend.forget(RUN)
    backend.forget(RUN)
    backend.forget("unknown~run.a0.r.0.t0")
    assert backend.list() == []
    until(lambda: not fake.pods(NS), WAIT_S, "the forgotten pod to be deleted", poll_s=0.01)
    st = backend.status(RUN)
    assert st is not None and st.exit_code == 0  # still answers
    assert backend.launch(make_task()).exit_code == 0  # and never runs again
    assert fake.count("POST", "/pods") == 1


# -- watch -----------------------------------------------------------------------------------


def test_watch_resumes_from_its_resource_version(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    backend.launch(make_task())
    fake.set_running(pod_name(RUN))
    wait_started(backend)
    seen_version = str(fake.resource_version)
    with fake.hold_watches():
        fake.drop_watches()
        fake.terminate(pod_name(RUN), 3)  # happens while the backend is disconnected
    st = wait_exited(backend)
    assert st.exit_code == 3
    assert backend.resyncs == 1  # resumed, not relisted
    assert seen_version in fake.watch_versions()[1:]


def test_relist_after_410(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    backend.launch(make_task())
    backend.launch(make_task(run_id="alice~mnist.a0.train.1.t0", index=1))
    fake.set_running(pod_name(RUN))
    wait_started(backend)
    with fake.hold_watches():
        fake.drop_watches()
        fake.terminate(pod_name(RUN), 0)
        fake.delete_pod(pod_name("alice~mnist.a0.train.1.t0"))
        fake.compact()  # the backend's version is gone: its next watch gets 410 Expired
    assert wait_exited(backend).exit_code == 0
    other = wait_exited(backend, "alice~mnist.a0.train.1.t0")
    assert (other.lost, other.exit_code) == (True, None)  # the relist found its pod gone
    assert backend.resyncs == 2


# -- re-adoption -----------------------------------------------------------------------------


def test_restarted_agent_readopts_its_pods(fake: FakeKubernetes, state_dir: Path) -> None:
    running, finished = RUN, "alice~mnist.a0.train.1.t0"
    with KubernetesBackend(state_dir, node=NODE, namespace=NS, api_client=fake.api_client()) as first:
        first.launch(make_task(running))
        first.launch(make_task(finished, index=1))
        fake.set_running(pod_name(running))
        wait_started(first, running)
    fake.set_running(pod_name(finished))
    fake.terminate(pod_name(finished), 1)  # while no agent runs

    with KubernetesBackend(state_dir, node=NODE, namespace=NS, api_client=fake.api_client()) as second:
        assert [s.run_id for s in second.list()] == [running, finished]
        assert second.status(running).state == "running"  # type: ignore[union-attr]
        assert wait_exited(second, finished).exit_code == 1
        assert second.launch(make_task(running)).state == "running"
    assert fake.count("POST", "/pods") == 2

    shutil.rmtree(state_dir)  # a new machine: the API server is all that is left
    with KubernetesBackend(state_dir, node=NODE, namespace=NS, api_client=fake.api_client()) as third:
        assert [s.run_id for s in third.list()] == [running, finished]
        assert json.loads((state_dir / running / "launch.json").read_text())["adopted"] is True
        assert third.launch(make_task(running)).state == "running"
        fake.terminate(pod_name(running), 0)
        assert wait_exited(third, running).exit_code == 0
    assert len(fake.pods(NS)) == 2  # never created twice


def test_a_409_on_launch_adopts_the_existing_pod(fake: FakeKubernetes, state_dir: Path) -> None:
    """The create landed but the agent died before it could tell (no record, the pod exists)."""
    with KubernetesBackend(state_dir, node=NODE, namespace=NS, api_client=fake.api_client()) as b:
        with fake.hold_watches():  # the backend is blind when the pod appears
            fake.drop_watches()
            k8s.CoreV1Api(fake.api_client()).create_namespaced_pod(
                NS, build_pod(make_task(), node=NODE, namespace=NS, image="busybox"))
            st = b.launch(make_task())
        assert st.state == "running"
        assert json.loads((state_dir / RUN / "launch.json").read_text())["pod_name"] == pod_name(RUN)
        assert (fake.count("POST", "/pods"), len(fake.pods(NS))) == (2, 1)  # the second create met a 409
        fake.set_running(pod_name(RUN))
        wait_started(b)


def test_other_nodes_pods_are_not_adopted(fake: FakeKubernetes, state_dir: Path, tmp_path: Path) -> None:
    fake.add_node("worker-2")
    with KubernetesBackend(tmp_path / "w2", node="worker-2", namespace=NS, api_client=fake.api_client()) as other:
        other.launch(make_task())
    with KubernetesBackend(state_dir, node=NODE, namespace=NS, api_client=fake.api_client()) as b:
        assert b.list() == []


# -- logs ------------------------------------------------------------------------------------


def test_logs_reach_the_log_file_before_the_exit(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    backend.launch(make_task())
    name = pod_name(RUN)
    fake.write_log(name, "epoch 1\n")
    fake.set_running(name)
    path = backend.log_path(RUN, "stdout")
    assert path is not None and path.parent == backend.state_dir / RUN
    until(lambda: path.exists() and path.read_text() == "epoch 1\n", WAIT_S, "the first line", poll_s=0.01)
    fake.drop_log_streams()  # the follower reconnects and must not repeat what it has
    fake.write_log(name, "epoch 2\n")
    fake.write_log(name, "done\n")
    fake.terminate(name, 0)
    wait_exited(backend)
    assert path.read_text() == "epoch 1\nepoch 2\ndone\n"
    assert backend.log_path(RUN, "stderr") is None  # Kubernetes merges stderr into the one log
    assert backend.log_path("unknown~run.a0.r.0.t0", "stdout") is None
    with pytest.raises(ValidationError):
        backend.log_path(RUN, "stdin")  # type: ignore[arg-type]


def test_list_is_ordered_by_run_id(fake: FakeKubernetes, backend: KubernetesBackend) -> None:
    for i in (2, 0, 1):
        backend.launch(make_task(run_id=f"alice~mnist.a0.train.{i}.t0", index=i))
    assert [s.run_id for s in backend.list()] == [f"alice~mnist.a0.train.{i}.t0" for i in range(3)]


def test_a_failed_call_is_logged_without_the_response_body(caplog: pytest.LogCaptureFixture) -> None:
    """An API error's body may quote the pod spec it refused (env values, a job's secrets): the
    log line gives its status and Status message only."""
    from kubernetes.client.exceptions import ApiException

    from apiary.runtime.kubernetes import KubernetesBackend

    def refused() -> None:
        exc = ApiException(status=422, reason="Unprocessable Entity")
        exc.body = json.dumps({"kind": "Status", "message": "Pod is invalid",
                               "details": {"causes": [{"field": "env", "message": "s3cr3t-in-env"}]}})
        raise exc

    with caplog.at_level("WARNING", logger="apiary.runtime.kubernetes"):
        KubernetesBackend._run_actions([refused])
    assert "422 Pod is invalid" in caplog.text and "s3cr3t-in-env" not in caplog.text
