"""The Pod Apiary writes for a task instance, and how it reads the run's end back from one.

Pure functions of a :class:`~apiary.runtime.base.TaskLaunch` (rendering) and of the API's JSON
of a Pod (reading); no API calls, no state. :mod:`apiary.runtime.kubernetes` (the backend, whose
module doc describes the pod field by field) creates and watches what these render and read, and
re-exports every public name here, so ``from apiary.runtime.kubernetes import build_pod`` keeps
working. Kept apart so that the backend class holds only the run tracking: the manifest and the
exit-code rules can be read, and tested, without a watch thread.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import yaml
from kubernetes import client as k8s  # type: ignore[import-untyped, unused-ignore]

from apiary.errors import ValidationError
from apiary.runtime.base import TaskLaunch
from apiary.runtime.env import gpu_env
from apiary.spec.probes import ExecAction, HTTPGetAction, ProbeSpec, probes_from_wire

logger = logging.getLogger(__name__)

__all__ = [
    "ANNOTATION_JOB_ID",
    "ANNOTATION_RUN_ID",
    "CONTAINER",
    "EXIT_IMAGE_NOT_EXISTS",
    "EXIT_OOM_KILLED",
    "GPU_RESOURCE",
    "HIVED_BIND_INFO",
    "HIVED_LEAF_CELL_ISOLATION",
    "IMAGE_PULL_FAILURES",
    "LABEL_NODE",
    "LABEL_RUN_ID",
    "MANAGED_BY",
    "MANAGED_BY_LABEL",
    "NODE_LOSS_DISRUPTIONS",
    "PodExit",
    "build_pod",
    "container_gpu_env",
    "container_started",
    "container_state",
    "hived_bind_info",
    "k8s_probe",
    "label_value",
    "pod_exit",
    "pod_labels",
    "pod_name",
    "pull_secret",
    "started_at",
]

#: OpenPAI exit spec -1200 UserContainerDockerOOMKilled (USER_FAILURE, PERMANENT, NEVER_RETRY).
EXIT_OOM_KILLED = -1200
#: OpenPAI exit spec 254 ContainerImageNotExists (USER_FAILURE, PERMANENT, NEVER_RETRY).
EXIT_IMAGE_NOT_EXISTS = 254

#: The task's container name.
CONTAINER = "task"
#: The extended resource of NVIDIA's device plugin.
GPU_RESOURCE = "nvidia.com/gpu"

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "apiary"
_PREFIX = "apiary.io/"
LABEL_RUN_ID = _PREFIX + "run-id"
LABEL_NODE = _PREFIX + "node"
ANNOTATION_RUN_ID = _PREFIX + "run-id"
ANNOTATION_JOB_ID = _PREFIX + "job-id"
#: HiveD's annotations (microsoft/hivedscheduler pkg/api/constants.go).
HIVED_BIND_INFO = "hivedscheduler.microsoft.com/pod-bind-info"
HIVED_LEAF_CELL_ISOLATION = "hivedscheduler.microsoft.com/pod-leaf-cell-isolation"

#: Waiting reasons of a container whose image cannot be pulled (kubelet ``images`` package).
IMAGE_PULL_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
#: ``DisruptionTarget`` reasons that mean the node is gone (an unreachable node's NoExecute taint;
#: the pod garbage collector removing pods of a deleted node).
NODE_LOSS_DISRUPTIONS = frozenset({"DeletionByTaintManager", "DeletionByPodGC"})

_DEFAULT_REGISTRY = "https://index.docker.io/v1/"
_NAME_BODY_MAX = 63 - 1 - 8  # "<body>-<8 hex>" fits a DNS-1123 label
_INVALID_NAME_CHARS = re.compile(r"[^a-z0-9-]+")
_INVALID_LABEL_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


# ---------------------------------------------------------------------------------------------
# Names, labels, the pod


def pod_name(run_id: str) -> str:
    """The pod name of ``run_id``: a DNS-1123 label (at most 63 characters of ``[a-z0-9-]``,
    alphanumeric at both ends), ``<sanitized run id>-<first 8 hex of sha1(run id)>``.

    ``alice~mnist.a0.train.0.t0`` -> ``alice-mnist-a0-train-0-t0-<hash>``. The hash is of the exact
    run id, so ids that differ only in case or in ``~ . _`` get different names.
    """
    digest = hashlib.sha1(run_id.encode()).hexdigest()[:8]
    body = _INVALID_NAME_CHARS.sub("-", run_id.lower()).strip("-")
    body = re.sub("-{2,}", "-", body)[:_NAME_BODY_MAX].strip("-") or "run"
    return f"{body}-{digest}"


def label_value(text: str) -> str:
    """``text`` as a valid Kubernetes label value: characters outside ``[A-Za-z0-9_.-]`` become
    ``_``, at most 63 characters, alphanumeric at both ends (``""`` if nothing is left).
    Lossy (``alice~mnist`` -> ``alice_mnist``): exact values go in annotations."""
    value = _INVALID_LABEL_CHARS.sub("_", str(text))[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def container_gpu_env(gpus: Sequence[int]) -> dict[str, str]:
    """GPU visibility inside the container: ``NVIDIA_VISIBLE_DEVICES`` = the host indices
    (``"void"`` for none, as :func:`apiary.runtime.env.gpu_env`), ``CUDA_VISIBLE_DEVICES`` =
    ``"0,...,n-1"`` (``""`` for none): CUDA renumbers the devices a container sees from 0.
    Raises :class:`ValidationError` for a negative or non-integer index."""
    env = gpu_env(gpus)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpus)))
    return env


def hived_bind_info(node: str, gpus: Sequence[int], leaf_cells: Sequence[int], cell_chain: str = "") -> str:
    """HiveD's ``PodBindInfo`` (microsoft/hivedscheduler ``pkg/api/types.go``) as YAML::

        node: worker-1
        leafCellIsolation: [2, 3]          # the GPU indices, as OpenPAI shows them
        cellChain: ''                      # cell_chain: a TaskLaunch does not carry the chain
        affinityGroupBindInfo:
        - podPlacements:
          - physicalNode: worker-1
            physicalLeafCellIndices: [2, 3]  # the leaf cell indices (the GPUs when none are given)
            preassignedCellTypes: []

    ``leaf_cells``: the placement's leaf cell indices within the node
    (:attr:`TaskLaunch.leaf_cells`). Only this pod's placement is listed: the agent does not know
    where the gang's other members run.
    """
    info = {
        "node": node,
        "leafCellIsolation": [int(g) for g in gpus],
        "cellChain": cell_chain,
        "affinityGroupBindInfo": [{"podPlacements": [{
            "physicalNode": node, "physicalLeafCellIndices": [int(c) for c in leaf_cells] or [int(g) for g in gpus],
            "preassignedCellTypes": []}]}],
    }
    return yaml.safe_dump(info, sort_keys=False, default_flow_style=None)


def _resolve_port(port: int | str, env: Mapping[str, str]) -> int | None:
    """A probe's port: a number, or a port label resolved as the node agent's prober does
    (the first port of ``PAI_CONTAINER_HOST_<label>_PORT_LIST``); None if unresolvable."""
    if isinstance(port, int):
        return port
    first = env.get(f"PAI_CONTAINER_HOST_{port}_PORT_LIST", "").split(",")[0].strip()
    return int(first) if first.isdigit() else None


def k8s_probe(probe: ProbeSpec, env: Mapping[str, str], host_network: bool = True) -> Any:
    """``probe`` (:class:`apiary.spec.probes.ProbeSpec`) as a ``kubernetes.client.V1Probe``.

    ``exec`` -> ``exec.command`` (run in the container); ``httpGet`` -> ``httpGet`` (path, port,
    scheme, headers); ``tcpSocket`` -> ``tcpSocket``; timings and thresholds as they are (the
    same names and defaults). A port label is resolved to its number from ``env``. ``host`` is kept
    with ``host_network`` (the kubelet probes from the node, whose loopback is then the pod's);
    without it a loopback host is dropped, so the kubelet probes the pod IP. Returns None when a
    port label cannot be resolved (logged).
    """
    action = probe.action
    kwargs: dict[str, Any] = {
        "initial_delay_seconds": probe.initial_delay_seconds,
        "period_seconds": probe.period_seconds,
        "timeout_seconds": probe.timeout_seconds,
        "success_threshold": probe.success_threshold,
        "failure_threshold": probe.failure_threshold,
    }
    if isinstance(action, ExecAction):
        return k8s.V1Probe(_exec=k8s.V1ExecAction(command=list(action.command)), **kwargs)
    port = _resolve_port(action.port, env)
    if port is None:
        logger.error("probe %s left out: port label %r has no port in the task's environment",
                     probe.describe(), action.port)
        return None
    host = action.host if host_network or action.host not in _LOOPBACK else None
    if isinstance(action, HTTPGetAction):
        headers = [k8s.V1HTTPHeader(name=h.name, value=h.value) for h in action.http_headers or []]
        return k8s.V1Probe(http_get=k8s.V1HTTPGetAction(
            path=action.path, port=port, host=host, scheme=action.scheme, http_headers=headers or None), **kwargs)
    return k8s.V1Probe(tcp_socket=k8s.V1TCPSocketAction(port=port, host=host), **kwargs)


def _cpu_quantity(cores: float) -> str:
    """Cores as a Kubernetes quantity: ``4`` -> ``"4"``, ``0.5`` -> ``"500m"``."""
    milli = round(cores * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def pod_labels(task: TaskLaunch, node: str) -> dict[str, str]:
    """The pod's labels (values sanitized by :func:`label_value`)."""
    return {
        MANAGED_BY_LABEL: MANAGED_BY,
        LABEL_RUN_ID: label_value(task.run_id),
        _PREFIX + "job": label_value(task.job_id),
        _PREFIX + "user": label_value(task.user),
        _PREFIX + "virtual-cluster": label_value(task.virtual_cluster),
        _PREFIX + "task-role": label_value(task.task_role),
        _PREFIX + "task-index": str(int(task.index)),
        LABEL_NODE: label_value(node),
    }


def build_pod(task: TaskLaunch, *, node: str, namespace: str, image: str, host_network: bool = True,
              gpu_resource: str | None = GPU_RESOURCE) -> Any:
    """The ``kubernetes.client.V1Pod`` that runs ``task`` on ``node`` (field by field in
    :mod:`apiary.runtime.kubernetes`' module doc).

    ``image``: the image to run (the caller resolves ``task.image`` or its default).
    ``gpu_resource``: the extended resource limited to ``len(task.gpus)``; None requests none.
    Probes that do not parse, or whose port cannot be resolved, are left out (logged): a bad
    probe never blocks the task. Raises :class:`ValidationError` for bad ``gpus``.
    """
    name = pod_name(task.run_id)
    env = dict(task.env)
    env.update(container_gpu_env(task.gpus))
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if task.gpus and gpu_resource:
        limits[gpu_resource] = str(len(task.gpus))
    if task.cpu and task.cpu > 0:
        requests["cpu"] = limits["cpu"] = _cpu_quantity(task.cpu)
    if task.memory_mb and task.memory_mb > 0:
        requests["memory"] = limits["memory"] = f"{int(task.memory_mb)}Mi"
    try:
        liveness, readiness = probes_from_wire(task.probes)
    except ValidationError as exc:
        logger.error("run=%s probes left out: %s", task.run_id, exc.message)
        liveness = readiness = None
    ports: list[Any] = []
    seen: set[int] = set()
    for label, count in sorted(task.ports.items()):
        raw = env.get(f"PAI_CONTAINER_HOST_{label}_PORT_LIST", "")
        numbers = [int(p) for p in raw.split(",") if p.strip().isdigit()][: max(0, int(count))]
        for number in numbers:
            if number not in seen:
                seen.add(number)
                ports.append(k8s.V1ContainerPort(container_port=number, host_port=number if host_network else None,
                                                 protocol="TCP"))
    container = k8s.V1Container(
        name=CONTAINER,
        image=image,
        command=["/bin/sh", "-c", "set -e\n" + "".join(f"{cmd}\n" for cmd in task.commands)],
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in sorted(env.items())],
        resources=k8s.V1ResourceRequirements(limits=limits or None, requests=requests or None),
        ports=ports or None,
        liveness_probe=k8s_probe(liveness, env, host_network) if liveness else None,
        readiness_probe=k8s_probe(readiness, env, host_network) if readiness else None,
        volume_mounts=[k8s.V1VolumeMount(name=f"storage-{i}", mount_path=m["target"], read_only=bool(m["readOnly"]))
                       for i, m in enumerate(task.mounts)] or None,
    )
    # The task's storage: the node agent mounted each server on the node (apiary.runtime.storage),
    # so the pod takes its directory as a hostPath volume (the agent runs on the pod's node).
    volumes = [k8s.V1Volume(name=f"storage-{i}", host_path=k8s.V1HostPathVolumeSource(path=m["source"],
                                                                                     type="Directory"))
               for i, m in enumerate(task.mounts)]
    annotations = {
        ANNOTATION_RUN_ID: task.run_id,
        ANNOTATION_JOB_ID: task.job_id,
        HIVED_BIND_INFO: hived_bind_info(node, task.gpus, task.leaf_cells),
        HIVED_LEAF_CELL_ISOLATION: ",".join(str(g) for g in task.gpus),
    }
    spec = k8s.V1PodSpec(
        node_name=node,
        restart_policy="Never",
        containers=[container],
        host_network=True if host_network else None,
        dns_policy="ClusterFirstWithHostNet" if host_network else None,
        enable_service_links=False,
        image_pull_secrets=[k8s.V1LocalObjectReference(name=name)] if task.image_auth else None,
        volumes=volumes or None,
    )
    meta = k8s.V1ObjectMeta(name=name, namespace=namespace, labels=pod_labels(task, node), annotations=annotations)
    return k8s.V1Pod(api_version="v1", kind="Pod", metadata=meta, spec=spec)


def pull_secret(auth: Mapping[str, str], name: str, namespace: str, labels: Mapping[str, str]) -> Any:
    """A ``kubernetes.io/dockerconfigjson`` ``V1Secret`` named ``name`` holding ``auth``
    (``username``, ``password``, ``registryuri``; Docker Hub when no registry is given)."""
    user, password = auth.get("username", ""), auth.get("password", "")
    registry = auth.get("registryuri") or _DEFAULT_REGISTRY
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    config = {"auths": {registry: {"username": user, "password": password, "auth": token}}}
    return k8s.V1Secret(
        api_version="v1", kind="Secret", type="kubernetes.io/dockerconfigjson",
        metadata=k8s.V1ObjectMeta(name=name, namespace=namespace, labels=dict(labels)),
        data={".dockerconfigjson": base64.b64encode(json.dumps(config).encode()).decode()},
    )


# ---------------------------------------------------------------------------------------------
# Reading a pod


def _parse_time(text: object) -> float | None:
    """An RFC 3339 timestamp (``2026-11-25T19:40:01Z``) as unix seconds; None if absent or bad."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def container_state(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The ``state`` of the task's container in ``pod`` (the API's JSON of a Pod): a dict with at
    most one of ``waiting`` / ``running`` / ``terminated``; ``{}`` when no status is reported yet.
    The first container's when none is named :data:`CONTAINER` (a pod Apiary did not write)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for cs in statuses:
        if cs.get("name") == CONTAINER:
            return cs.get("state") or {}
    return (statuses[0].get("state") or {}) if statuses else {}


def started_at(pod: Mapping[str, Any]) -> float | None:
    """When the task's container started, in unix seconds; None until it has (or unparseable)."""
    state = container_state(pod)
    return _parse_time((state.get("running") or state.get("terminated") or {}).get("startedAt"))


def container_started(pod: Mapping[str, Any]) -> bool:
    """Whether the task's container is running or has run (its log can then be read)."""
    state = container_state(pod)
    return "running" in state or "terminated" in state


@dataclass(frozen=True)
class PodExit:
    """How a pod ended, as :func:`pod_exit` reads it.

    ``exit_code``: the code to report, None with ``lost``. ``lost``: ended without a recorded exit
    code. ``started_at`` / ``finished_at``: unix seconds or None. ``reason``: a short text for
    logs. ``delete``: the pod must be deleted (an image that cannot be pulled).
    """

    exit_code: int | None
    lost: bool
    started_at: float | None
    finished_at: float | None
    reason: str
    delete: bool = False


def pod_exit(pod: Mapping[str, Any], *, deleted: bool = False) -> PodExit | None:
    """The end of the run in ``pod`` (the API's JSON of a Pod), or None while it still runs.

    In order: a terminated container gives its ``exitCode`` (-1200 for ``OOMKilled``); a container
    waiting for an image that cannot be pulled gives 254 (``delete``); a pod whose node is lost
    (phase ``Failed`` reason ``NodeLost``; ``DisruptionTarget`` by the taint manager or the pod GC),
    a pod ``Failed``/``Succeeded`` without a container exit code, or one ``deleted`` from the API
    gives ``lost``. Sources: Kubernetes' pod lifecycle documentation and OpenPAI's exit spec.
    """
    status = pod.get("status") or {}
    state = container_state(pod)
    started = started_at(pod)
    terminated = state.get("terminated") or {}
    if terminated.get("exitCode") is not None:
        code = int(terminated["exitCode"])
        reason = str(terminated.get("reason") or "")
        if reason == "OOMKilled":
            code = EXIT_OOM_KILLED
        finished = _parse_time(terminated.get("finishedAt")) or time.time()
        return PodExit(code, False, started, finished, reason or f"exit {code}")
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in IMAGE_PULL_FAILURES:
        reason = f"{waiting['reason']}: {waiting.get('message') or 'the image cannot be pulled'}"
        return PodExit(EXIT_IMAGE_NOT_EXISTS, False, None, time.time(), reason, delete=True)
    phase = status.get("phase")
    if phase == "Failed" and status.get("reason") == "NodeLost":
        return PodExit(None, True, started, None, f"NodeLost: {status.get('message') or ''}".strip())
    for cond in status.get("conditions") or []:
        if (cond.get("type") == "DisruptionTarget" and cond.get("status") == "True"
                and cond.get("reason") in NODE_LOSS_DISRUPTIONS):
            return PodExit(None, True, started, None, f"{cond['reason']}: {cond.get('message') or ''}".strip())
    if phase in ("Failed", "Succeeded"):
        return PodExit(None, True, started, None, f"pod {phase} without an exit code: {status.get('reason') or ''}")
    if deleted:
        return PodExit(None, True, started, None, "pod deleted before its container recorded an exit code")
    return None
