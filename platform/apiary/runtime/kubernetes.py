"""``KubernetesBackend``: runs each task instance as one Kubernetes Pod on the node Apiary chose.

Apiary stays the scheduler (HiveD's algorithm in :mod:`apiary.scheduler`): the pod is created
with ``spec.nodeName`` set, so the Kubernetes scheduler never sees it and the kubelet of that node
starts it directly. One backend serves one node (one agent per node, as for every backend).

The pod (:func:`build_pod`; Kubernetes API reference, core/v1 Pod):

* ``metadata.name``: :func:`pod_name` -- DNS-1123, deterministic from the run id, so the name is
  the idempotency key on the API server: a second create answers 409 ``AlreadyExists``.
* ``metadata.labels``: ``app.kubernetes.io/managed-by=apiary`` and ``apiary.io/{run-id, job,
  user, virtual-cluster, task-role, task-index, node}``, each value sanitized by
  :func:`label_value` (a label value is at most 63 characters of ``[A-Za-z0-9_.-]``); the exact
  run id and job id are in the annotations ``apiary.io/run-id`` and ``apiary.io/job-id``.
* HiveD's annotations (microsoft/hivedscheduler ``pkg/api/constants.go`` and ``types.go``):
  ``hivedscheduler.microsoft.com/pod-bind-info`` -- a ``PodBindInfo`` as YAML
  (:func:`hived_bind_info`), which OpenPAI's REST server reads to show a task's GPUs -- and
  ``hivedscheduler.microsoft.com/pod-leaf-cell-isolation`` (the GPU indices, comma-joined).
* ``spec``: ``nodeName``, ``restartPolicy: Never`` (an attempt is run once; retries are the
  control plane's), ``hostNetwork: true`` with ``dnsPolicy: ClusterFirstWithHostNet`` as OpenPAI's
  job pods have (the ``PAI_*`` host IP and port variables then mean what they say; see
  ``host_network``), ``enableServiceLinks: false`` (the environment is the task's, not the
  namespace's services), ``imagePullSecrets`` when the job gives registry credentials.
* One container ``task``: the image (``task.image`` or ``default_image``), the commands under
  ``/bin/sh -c`` after ``set -e`` (OpenPAI runs them with a shell; ``sh`` because an image need not
  have ``bash``), the task's environment plus GPU visibility (below), ``resources`` (``cpu`` cores
  and ``memory_mb`` MiB as equal requests and limits; ``nvidia.com/gpu: len(gpus)`` as a limit),
  container ports for the role's ports when the environment names their numbers, and the role's
  liveness / readiness probes as Kubernetes probes (:func:`k8s_probe`), run by the kubelet.

GPU visibility: ``NVIDIA_VISIBLE_DEVICES`` is the host indices HiveD chose (``void`` for none),
as the process backend sets it; ``CUDA_VISIBLE_DEVICES`` is ``0..n-1`` (``""`` for none), because
inside a container CUDA numbers only the devices it sees -- the host indices would hide them. On a
cluster whose NVIDIA device plugin allocates ``nvidia.com/gpu``, the plugin picks the devices and
its ``NVIDIA_VISIBLE_DEVICES`` wins; pass ``gpu_resource=None`` on a HiveD-style cluster whose
container runtime isolates GPUs by that variable instead.

State directory layout (one directory per run; the directory is the launch marker)::

    state_dir/<run_id>/
      launch.json   what was asked (no env values, no credentials) and the pod's name, written
                    BEFORE the create call; {"adopted": true, ...} for a pod found on the API server
      stdout.log    the container's log, streamed by a follower thread (Kubernetes merges stdout and
                    stderr into one log, so there is no stderr file: ``log_path(.., "stderr")`` is None)
      stop.json     {grace_s, requested_at}, written by stop() before deleting the pod
      final.json    {exit_code, lost, stopped, started_at, finished_at, reason}: the final status,
                    written once, when it is first known (so it survives the pod's deletion)
      log.done      the log follower has everything (the container ended, or the pod is gone)
      forgotten     present once forget() was called

How a run is tracked:

* ``launch`` writes the record, creates the pull secret (if any), then the pod; a 409 means an
  earlier agent created it: the pod is adopted (its ``apiary.io/run-id`` annotation must match).
  A create the API server refuses or never answers leaves no record (and the secret is deleted),
  so a retry may launch: the deterministic name still stops a second pod if the first create did
  land after all. ``launch`` never waits for the pod to start. "At most once, ever" rests on the
  record and the pod together: with both gone (a wiped state dir after forget() deleted the pod)
  a stale launch would create the pod again.
* One watch thread (``apiary-k8s-watch-<node>``) lists the node's pods
  (``labelSelector=app.kubernetes.io/managed-by=apiary,apiary.io/node=<node>`` and
  ``fieldSelector=spec.nodeName=<node>``), then watches from the list's ``resourceVersion``. After
  a disconnect it resumes from the last version it saw; a 410 ``Gone``/``Expired`` (the version was
  compacted away) makes it list again. Every list reconciles: pods it does not know are adopted
  (re-adoption after an agent restart, even with the state dir lost), and runs whose pod is gone
  end. :meth:`status` and :meth:`list` read only this cache and the state dir.
* A log follower thread per run (``apiary-k8s-log-<run_id>``) starts once the container has
  started, and appends ``GET .../pods/<name>/log?follow=true`` to ``stdout.log``; after a
  reconnect it re-reads the log and skips the bytes the file already has (a log the kubelet has
  rotated meanwhile is not handled). A run reads ``exited`` only once its follower is done, or
  :data:`LOG_DRAIN_S` after the end, so the agent ships a complete log before reporting the exit.

Exit codes (OpenPAI's exit spec, ``apiary/lifecycle/k8s-job-exit-spec.yaml``):

* the container's ``state.terminated.exitCode`` (``128 + signal`` when killed);
* **-1200** ``UserContainerDockerOOMKilled`` when ``terminated.reason`` is ``OOMKilled``;
* **254** ``ContainerImageNotExists`` when the container waits with ``ErrImagePull``,
  ``ImagePullBackOff``, ``InvalidImageName`` or ``ErrImageNeverPull``; the pod is then deleted
  (the kubelet would retry the pull forever), and the reason is appended to ``stdout.log``;
* a run that :meth:`stop` ended: ``stopped=True`` with the container's code (the kubelet sends
  SIGTERM, then SIGKILL after the grace period: 143 / 137); ``None`` if it never started (the
  control plane then records OpenPAI's -210); 137 when the pod's end was not confirmed in time.
  A run that stop() was asked to end never reads as lost.
* **Node loss reads as ``lost=True`` with ``exit_code=None``**: the pod's phase is ``Failed`` with
  reason ``NodeLost``, or it carries the ``DisruptionTarget`` condition with reason
  ``DeletionByTaintManager`` (the node became unreachable) or ``DeletionByPodGC`` (the node object
  was deleted), before any exit code was recorded. So does a pod deleted by someone else, and a
  pod that ended without a container exit code (evicted or refused by the kubelet before it
  started). This is the contract of :mod:`apiary.runtime.base` -- ``lost`` means "ended without
  a recorded exit code, a platform failure" -- and the control plane records a lost run as 137
  (transient, always retried, the reaction OpenPAI's -1001 ``PodNodeLost`` has too); when a lost
  node also takes its agent with it, the control plane issues -1001 itself for the silent node.

Connecting to a real cluster: pass ``api_client`` (a ``kubernetes.client.ApiClient``), or
``kubeconfig`` (a path), or set ``APIARY_KUBECONFIG``; inside a pod with a service account the
in-cluster configuration is used; else ``KUBECONFIG`` / ``~/.kube/config``
(:func:`api_client_from_env`). The namespace is ``namespace``, else ``APIARY_K8S_NAMESPACE``, else
``apiary-jobs``; create it first (``kubectl create namespace apiary-jobs``). The identity needs a
Role in it allowing ``pods``: create, get, list, watch, delete; ``pods/log``: get; ``secrets``:
create, patch, delete (``apiary deploy render`` writes that Role). Nodes must carry the names of
Apiary's cluster config.

Tested against a stateful fake of the Kubernetes API (``tests/support/fake_k8s.py``, driven by
the official client over HTTP), not a real cluster: no API server can run where the tests run.

Left out: ``task.workdir`` (the image's ``WORKDIR`` applies), port names (a probe's port label is
resolved to its number from the environment instead), gang-wide HiveD bind info (an agent knows
only its own task: ``affinityGroupBindInfo`` lists this pod's placement alone; nor the cell
chain: ``cellChain`` is empty).

One ``KubernetesBackend`` per ``state_dir`` and node at a time; thread-safe. :meth:`close` stops
its threads (tests); an agent just exits.

The code is in three modules: :mod:`apiary.runtime.k8s_pods` renders the pod and reads a run's end
from one (pure), :mod:`apiary.runtime.k8s_client` makes the API calls, and this module tracks the
runs. The pod's and the client's public names are re-exported here (``__all__``), so imports
from ``apiary.runtime.kubernetes`` written before the split keep working.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException  # type: ignore[import-untyped, unused-ignore]

from apiary.errors import PlatformError, ValidationError
from apiary.runtime.base import LogStream, RuntimeBackend, TaskLaunch, TaskStatus
from apiary.runtime.k8s_client import (
    CHUNK,
    ENV_KUBECONFIG,
    TRANSPORT_ERRORS,
    PodClient,
    api_client_from_env,
    api_message,
    iter_lines,
)
from apiary.runtime.k8s_pods import (
    ANNOTATION_JOB_ID,
    ANNOTATION_RUN_ID,
    CONTAINER,
    EXIT_IMAGE_NOT_EXISTS,
    EXIT_OOM_KILLED,
    GPU_RESOURCE,
    HIVED_BIND_INFO,
    HIVED_LEAF_CELL_ISOLATION,
    IMAGE_PULL_FAILURES,
    LABEL_NODE,
    LABEL_RUN_ID,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NODE_LOSS_DISRUPTIONS,
    PodExit,
    build_pod,
    container_gpu_env,
    container_started,
    container_state,
    hived_bind_info,
    k8s_probe,
    label_value,
    pod_exit,
    pod_labels,
    pod_name,
    pull_secret,
    started_at,
)
from apiary.runtime.records import read_json as _read_json
from apiary.runtime.records import valid_run_id as _valid_run_id
from apiary.runtime.records import write_atomic as _write_atomic

logger = logging.getLogger(__name__)

__all__ = [
    # this module's
    "DEFAULT_IMAGE",
    "DEFAULT_NAMESPACE",
    "ENV_NAMESPACE",
    "LOG_DRAIN_S",
    "KubernetesBackend",
    # re-exported: the pod (apiary.runtime.k8s_pods)
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
    "hived_bind_info",
    "k8s_probe",
    "label_value",
    "pod_exit",
    "pod_labels",
    "pod_name",
    "pull_secret",
    # re-exported: the API calls (apiary.runtime.k8s_client)
    "ENV_KUBECONFIG",
    "PodClient",
    "api_client_from_env",
]

#: The code of a stopped run whose container had started but whose end the kubelet never
#: confirmed: the kubelet SIGKILLs what outlives the grace period.
_EXIT_KILLED = 137

DEFAULT_NAMESPACE = "apiary-jobs"
#: The image of a task role whose job names no ``dockerImage`` prerequisite: Apiary's base image
#: (``apiary image build-base``); push it to a registry the nodes pull from, or pass ``default_image``.
DEFAULT_IMAGE = "apiary/base:bookworm"
ENV_NAMESPACE = "APIARY_K8S_NAMESPACE"
#: Seconds a run that ended waits for its log follower before it reads ``exited`` anyway.
LOG_DRAIN_S = 10.0

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class _Expired(Exception):
    """The watch's resourceVersion is gone (HTTP 410 / an ERROR event with code 410): relist."""


@dataclass
class _Run:
    """What the backend holds of one run (lock held for every access)."""

    run_id: str
    dir: Path
    pod_name: str
    pod: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    final_mono: float | None = None
    stop: dict[str, Any] | None = None
    forgotten: bool = False
    #: monotonic time the create call returned; 0.0 for a run of an earlier agent; None while in flight
    created_mono: float | None = None
    started: bool = False
    log_thread: threading.Thread | None = None
    log_resp: Any = None
    log_done: bool = False
    drain_cut: bool = False


@dataclass(frozen=True)
class _Final:
    exit_code: int | None
    lost: bool
    stopped: bool
    started_at: float | None
    finished_at: float | None
    reason: str


class KubernetesBackend(RuntimeBackend):
    """Runs tasks as Pods bound to ``node`` (see the module doc).

    ``state_dir``: per-run records and logs (created if missing). ``node``: the Kubernetes node
    name (``spec.nodeName``; Apiary's node name). ``namespace``: default ``$APIARY_K8S_NAMESPACE``,
    else ``apiary-jobs``. ``api_client``: a ``kubernetes.client.ApiClient``; default
    :func:`api_client_from_env` (``kubeconfig``, ``$APIARY_KUBECONFIG``, in-cluster, ``~/.kube``).
    ``default_image``: the image of a task without one. ``host_network``: run pods in the node's
    network namespace, as OpenPAI does (default). ``gpu_resource``: the extended resource GPUs are
    requested as (None: none). ``request_timeout_s``: connect/read timeout of each API call.
    ``watch_timeout_s``: how long one watch request lasts before it is renewed (the server ends it).

    The constructor lists the node's pods once (re-adopting those of an earlier agent) and starts
    the watch thread. Raises :class:`ValidationError` for a bad ``node`` or ``namespace``,
    :class:`UnavailableError` when the API server does not answer and :class:`PlatformError` when
    it refuses (e.g. 403: the identity may not list pods in the namespace).
    """

    name = "kubernetes"
    runs_probes = True  # the pod's livenessProbe / readinessProbe: the kubelet probes

    def __init__(
        self,
        state_dir: Path | str,
        *,
        node: str,
        namespace: str | None = None,
        api_client: Any = None,
        kubeconfig: str | Path | None = None,
        default_image: str = DEFAULT_IMAGE,
        host_network: bool = True,
        gpu_resource: str | None = GPU_RESOURCE,
        request_timeout_s: float = 10.0,
        watch_timeout_s: float = 240.0,
    ) -> None:
        if not isinstance(node, str) or not node or len(node) > 253:
            raise ValidationError("node", f"must be a Kubernetes node name, got {node!r}")
        namespace = namespace or os.environ.get(ENV_NAMESPACE) or DEFAULT_NAMESPACE
        if not _DNS1123_LABEL.match(namespace) or len(namespace) > 63:
            raise ValidationError("namespace", f"{namespace!r} is not a Kubernetes namespace name (DNS-1123 label)")
        self.node = node
        self.namespace = namespace
        self.default_image = default_image
        self.host_network = host_network
        self.gpu_resource = gpu_resource
        self.state_dir = Path(state_dir).absolute()
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PlatformError(f"cannot create runtime state dir {self.state_dir}: {exc}") from exc
        self._own_client = api_client is None
        self._api = api_client if api_client is not None else api_client_from_env(kubeconfig)
        # Every API call goes through the client; this class keeps the runs' state.
        self._client = PodClient(self._api, namespace=namespace, node=node, request_timeout_s=request_timeout_s)
        self._watch_timeout_s = max(1, int(watch_timeout_s))
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._closed = threading.Event()
        self._runs: dict[str, _Run] = {}
        self._rv: str | None = None
        self._watch_resp: Any = None
        #: how many times the pods were listed (1 at start, +1 per 410) -- for tests and metrics
        self.resyncs = 0
        #: how many watch requests were made
        self.watches = 0
        self._load_records()
        try:
            self._resync()
        except PlatformError:
            if self._own_client:
                self._api.close()
            raise
        self._watch_thread = threading.Thread(target=self._watch_loop, name=f"apiary-k8s-watch-{node}", daemon=True)
        self._watch_thread.start()

    # -- records -----------------------------------------------------------------------------

    def _load_records(self) -> None:
        """Runs of earlier agents on this state dir: their records, final states and markers."""
        for run_dir in sorted(self.state_dir.iterdir()):
            if not run_dir.is_dir() or not _valid_run_id(run_dir.name):
                continue
            launch = _read_json(run_dir / "launch.json") or {}
            run = _Run(run_id=run_dir.name, dir=run_dir, pod_name=str(launch.get("pod_name") or pod_name(run_dir.name)),
                       created_mono=0.0)
            run.final = _read_json(run_dir / "final.json")
            if run.final is not None:
                # Reported exited already, so never "running" again while a follower catches up.
                run.final_mono, run.drain_cut = time.monotonic(), True
            run.stop = _read_json(run_dir / "stop.json")
            run.forgotten = (run_dir / "forgotten").exists()
            run.log_done = (run_dir / "log.done").exists()
            self._runs[run.run_id] = run

    def _adopt(self, run_id: str, pod: Mapping[str, Any]) -> _Run | None:
        """A run for a pod of this node that no record names (lock held): write an adopted record."""
        name = str((pod.get("metadata") or {}).get("name") or "")
        if name != pod_name(run_id):
            logger.warning("pod=%s ignored: its run id annotation %r does not give its name", name, run_id)
            return None
        run_dir = self.state_dir / run_id
        try:
            run_dir.mkdir(exist_ok=True)
            record = {"run_id": run_id, "pod_name": name, "namespace": self.namespace, "node": self.node,
                      "adopted": True, "adopted_at": time.time()}
            _write_atomic(run_dir / "launch.json", json.dumps(record, indent=2) + "\n")
        except OSError as exc:
            logger.error("run=%s pod=%s cannot be adopted: %s", run_id, name, exc)
            return None
        logger.info("run=%s pod=%s node=%s adopted from the API server", run_id, name, self.node)
        run = _Run(run_id=run_id, dir=run_dir, pod_name=name, created_mono=0.0)
        self._runs[run_id] = run
        return run

    # -- reading pods ------------------------------------------------------------------------

    def _observe(self, pod: dict[str, Any], deleted: bool) -> list[Callable[[], None]]:
        """Apply one pod state from a list or watch (lock held); returns the API calls to make
        once the lock is released."""
        run_id = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RUN_ID)
        if not isinstance(run_id, str) or not _valid_run_id(run_id):
            return []
        run = self._runs.get(run_id)
        if run is None:
            if deleted:
                return []
            run = self._adopt(run_id, pod)
            if run is None:
                return []
        return self._apply(run, pod, deleted)

    def _apply(self, run: _Run, pod: dict[str, Any], deleted: bool) -> list[Callable[[], None]]:
        actions: list[Callable[[], None]] = []
        if run.final is not None:
            if deleted:
                return actions
            if run.forgotten:
                actions.append(lambda: self._client.delete_pod(run.pod_name, None))  # left by a failed forget()
            elif run.log_thread is None and not run.log_done and container_started(pod):
                actions.append(lambda: self._start_log_follower(run))  # an earlier agent died mid-log
            return actions
        if not deleted:
            run.pod = pod
        if container_started(pod):
            run.started = True
            if run.log_thread is None and not run.log_done:
                actions.append(lambda: self._start_log_follower(run))
        end = pod_exit(pod, deleted=deleted)
        if end is None:
            return actions
        stopped = run.stop is not None
        code, lost = end.exit_code, end.lost
        if stopped and lost:
            # We asked for the pod's end; no exit code came back (it never started, or the kubelet
            # could not confirm): a stop, not a loss.
            code, lost = (_EXIT_KILLED if run.started else None), False
        self._finish(run, _Final(code, lost, stopped, end.started_at, end.finished_at, end.reason))
        if lost:
            run.drain_cut = True  # a lost pod's log cannot be read any more: report the loss at once
        if end.delete and not deleted:
            self._append_log(run, f"[apiary] {end.reason}\n")
            actions.append(lambda: self._client.delete_pod(run.pod_name, 0))
        return actions

    def _finish(self, run: _Run, final: _Final) -> None:
        """Record the run's final status (lock held), once."""
        if run.final is not None:
            return
        run.final = asdict(final)
        run.final_mono = time.monotonic()
        try:
            _write_atomic(run.dir / "final.json", json.dumps(run.final) + "\n")
        except OSError as exc:
            logger.error("run=%s cannot record its final status: %s", run.run_id, exc)
        logger.info("run=%s pod=%s node=%s ended exit_code=%s lost=%s stopped=%s reason=%s", run.run_id,
                    run.pod_name, self.node, final.exit_code, final.lost, final.stopped, final.reason)
        self._changed.notify_all()

    def _append_log(self, run: _Run, text: str) -> None:
        try:
            with open(run.dir / "stdout.log", "a", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            logger.warning("run=%s cannot write its log: %s", run.run_id, exc)

    @staticmethod
    def _run_actions(actions: list[Callable[[], None]]) -> None:
        for action in actions:
            try:
                action()
            except ApiException as exc:
                # Its status and message only: str(exc) carries the whole response body, which
                # may quote the pod spec the call sent (env values, the job's secrets).
                logger.warning("kubernetes call failed: %s %s", exc.status, api_message(exc))
            except (PlatformError, *TRANSPORT_ERRORS) as exc:
                logger.warning("kubernetes call failed: %s", exc)

    # -- list and watch ----------------------------------------------------------------------

    def _resync(self) -> None:
        """List this node's pods, reconcile the cache with them and remember the list's version.

        Pods no run knows are adopted; runs whose pod is missing (and whose create had returned
        before the list started) end. Raises UnavailableError / PlatformError.
        """
        started = time.monotonic()
        body = self._client.list_pods()
        actions: list[Callable[[], None]] = []
        with self._lock:
            present: set[str] = set()
            for pod in body.get("items") or []:
                run_id = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RUN_ID)
                if isinstance(run_id, str):
                    present.add(run_id)
                actions += self._observe(pod, deleted=False)
            for run in list(self._runs.values()):
                if (run.final is None and run.run_id not in present and run.created_mono is not None
                        and run.created_mono < started):
                    actions += self._apply(run, run.pod or {}, deleted=True)
            self._rv = str((body.get("metadata") or {}).get("resourceVersion") or "") or None
            self.resyncs += 1
        self._run_actions(actions)

    def _watch_once(self) -> None:
        """One watch request from ``self._rv``, applied event by event until the server ends it.
        Raises :class:`_Expired` on 410, ApiException / transport errors otherwise."""
        resp = self._client.watch_pods(self._rv, self._watch_timeout_s)
        with self._lock:
            self.watches += 1
            self._watch_resp = resp
            if self._closed.is_set():  # close() ran before it could see this response
                resp.release_conn()
                self._watch_resp = None
                return
        try:
            for line in iter_lines(resp):
                if self._closed.is_set():
                    return
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired(obj.get("message", "resource version expired"))
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    with self._lock:
                        actions = self._observe(obj, deleted=kind == "DELETED")
                        if version:
                            self._rv = str(version)
                    self._run_actions(actions)
                elif version:  # BOOKMARK
                    with self._lock:
                        self._rv = str(version)
        finally:
            with self._lock:
                self._watch_resp = None
            resp.release_conn()

    def _watch_loop(self) -> None:
        """The watch thread: resume from the last version after a disconnect, relist after a 410
        or when no version is known, back off (0.1 s doubling to 5 s) while the server is down."""
        backoff = 0.1
        while not self._closed.is_set():
            try:
                if self._rv is None:
                    self._resync()
                began = time.monotonic()
                self._watch_once()
                if time.monotonic() - began < 1.0:  # ended at once: do not hammer the server
                    self._closed.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                else:
                    backoff = 0.1
            except _Expired as exc:
                logger.info("node=%s watch expired (%s): listing again", self.node, exc)
                with self._lock:
                    self._rv = None
            except ApiException as exc:
                if exc.status == 410:
                    with self._lock:
                        self._rv = None
                    continue
                logger.warning("node=%s watch failed: %s", self.node, self._client.error("watch pods", exc))
                self._closed.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except (PlatformError, *TRANSPORT_ERRORS, ValueError) as exc:
                if self._closed.is_set():
                    return
                logger.warning("node=%s watch interrupted: %s", self.node, exc)
                self._closed.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    # -- logs --------------------------------------------------------------------------------

    def _start_log_follower(self, run: _Run) -> None:
        with self._lock:
            if run.log_thread is not None or run.log_done or self._closed.is_set():
                return
            run.log_thread = threading.Thread(target=self._follow_log, args=(run,),
                                              name=f"apiary-k8s-log-{run.run_id}", daemon=True)
            run.log_thread.start()

    def _follow_log(self, run: _Run) -> None:
        """Append the container's log to ``stdout.log``. Done once a stream that began after the
        container had ended reached its end (it then holds the whole log), the pod is gone (404),
        or the run ended :data:`LOG_DRAIN_S` ago and the log still cannot be read."""
        path = run.dir / "stdout.log"
        backoff = 0.1
        try:
            while not self._closed.is_set():
                with self._lock:
                    ended_before = run.final is not None or "terminated" in container_state(run.pod or {})
                    if run.forgotten or (run.final_mono is not None
                                         and time.monotonic() > run.final_mono + LOG_DRAIN_S):
                        return
                skip = path.stat().st_size if path.exists() else 0
                complete = False
                try:
                    resp = self._client.follow_log(run.pod_name)
                    with self._lock:
                        run.log_resp = resp
                        if self._closed.is_set():  # close() ran before it could see this response
                            return
                    with open(path, "ab") as out:
                        while True:
                            data = resp.read1(CHUNK)
                            if not data:
                                break
                            if skip:  # a reconnect re-reads the log from its start
                                dropped = min(skip, len(data))
                                data, skip = data[dropped:], skip - dropped
                            if data:
                                out.write(data)
                                out.flush()
                    resp.release_conn()
                    complete, backoff = ended_before, 0.1
                except ApiException as exc:
                    if exc.status == 404:
                        return  # the pod is gone, and its log with it
                    logger.debug("run=%s log not readable yet: %s", run.run_id, exc.status)
                    self._closed.wait(backoff)
                    backoff = min(backoff * 2, 2.0)
                except TRANSPORT_ERRORS as exc:
                    logger.debug("run=%s log stream broken: %s", run.run_id, exc)
                    self._closed.wait(backoff)
                    backoff = min(backoff * 2, 2.0)
                finally:
                    with self._lock:
                        run.log_resp = None
                if complete:
                    return
                with self._changed:
                    # A stream ends with the container, whose terminated state may arrive just after;
                    # then one more read (which returns at once) makes sure nothing was missed.
                    self._changed.wait_for(lambda: run.final is not None or self._closed.is_set(), timeout=0.25)
        finally:
            with self._changed:
                run.log_done = True
                try:
                    (run.dir / "log.done").touch()
                except OSError:
                    pass
                self._changed.notify_all()

    # -- the contract ------------------------------------------------------------------------

    def launch(self, task: TaskLaunch) -> TaskStatus:
        """Create ``task``'s pod bound to this node; see :meth:`RuntimeBackend.launch`.

        Idempotent: a run with a record (``state_dir/<run_id>/``), or whose pod exists on the API
        server (409 on create, adopted), returns its status and creates nothing. Writes the record
        BEFORE creating anything. Raises :class:`ValidationError` for a bad ``run_id``, ``commands``
        or ``gpus``; :class:`UnavailableError` when the API server does not answer (or answers 429
        / 5xx) and :class:`PlatformError` when it refuses the pod (403, 422, ...) -- in both cases
        no record is left, so a retry may launch. Never waits for the pod to start.
        """
        if not _valid_run_id(task.run_id):
            raise ValidationError(
                "run_id",
                f"{task.run_id!r} must be 1-200 characters of letters, digits and ~ . - _, not starting with '.'",
            )
        if isinstance(task.commands, str) or not all(isinstance(c, str) for c in task.commands):
            raise ValidationError("commands", "must be a list of strings")
        name = pod_name(task.run_id)
        with self._lock:
            existing = self._runs.get(task.run_id)
            if existing is not None:
                return self._status_of(existing)
            pod = build_pod(task, node=self.node, namespace=self.namespace, image=task.image or self.default_image,
                            host_network=self.host_network, gpu_resource=self.gpu_resource)
            run_dir = self.state_dir / task.run_id
            record = {k: v for k, v in asdict(task).items() if k not in ("env", "image_auth")}
            record.update(env_keys=sorted(task.env), image_auth=task.image_auth is not None, pod_name=name,
                          namespace=self.namespace, node=self.node, created_at=time.time())
            try:
                run_dir.mkdir()
                _write_atomic(run_dir / "launch.json", json.dumps(record, indent=2) + "\n")
            except OSError as exc:
                shutil.rmtree(run_dir, ignore_errors=True)
                raise PlatformError(f"cannot write the launch record of {task.run_id}: {exc}") from exc
            run = _Run(run_id=task.run_id, dir=run_dir, pod_name=name)
            self._runs[task.run_id] = run
        try:
            if task.image_auth:
                self._client.put_secret(pull_secret(task.image_auth, name, self.namespace, pod_labels(task, self.node)))
            created = self._client.create_pod(task.run_id, pod)  # a 409 adopts the pod if it is this run's
        except PlatformError:
            self._abandon(run, task)
            raise
        except ValueError as exc:  # the client refused a value before sending the secret (ApiValueError)
            self._abandon(run, task)
            raise self._client.error(f"create pod {name} for {task.run_id}", exc) from exc
        logger.info("run=%s pod=%s node=%s namespace=%s created", task.run_id, name, self.node, self.namespace)
        with self._lock:
            run.created_mono = time.monotonic()
            actions = self._apply(run, created, deleted=False) if run.pod is None else []
            if run.stop is not None and run.final is None:  # stop() ran while the create was in flight
                grace = int(math.ceil(float(run.stop.get("grace_s", 0))))
                actions.append(lambda: self._client.delete_pod(name, grace))
            status = self._status_of(run)
        if task.image_auth:
            self._client.own_secret(name, created)
        self._run_actions(actions)
        return status

    def _abandon(self, run: _Run, task: TaskLaunch) -> None:
        """Undo a launch whose create failed: drop the record (unless the watch saw the pod after
        all) and the pull secret, so that a retry may launch."""
        with self._lock:
            if run.pod is not None:
                return
            self._runs.pop(run.run_id, None)
            shutil.rmtree(run.dir, ignore_errors=True)
        if task.image_auth:
            self._run_actions([lambda: self._client.delete_secret(run.pod_name)])

    def _draining(self, run: _Run) -> bool:
        """The run ended but its log follower may still be writing (lock held)."""
        return (run.final is not None and run.log_thread is not None and not run.log_done and not run.drain_cut
                and run.final_mono is not None and time.monotonic() < run.final_mono + LOG_DRAIN_S)

    def _status_of(self, run: _Run) -> TaskStatus:
        final = run.final
        if final is not None and not self._draining(run):
            return TaskStatus(
                run_id=run.run_id, state="exited", exit_code=final.get("exit_code"), pid=None,
                started_at=final.get("started_at"), finished_at=final.get("finished_at"),
                lost=bool(final.get("lost")), stopped=bool(final.get("stopped")),
            )
        started = final.get("started_at") if final is not None else (started_at(run.pod) if run.pod else None)
        return TaskStatus(run_id=run.run_id, state="running", exit_code=None, pid=None, started_at=started,
                          finished_at=None)

    def status(self, run_id: str) -> TaskStatus | None:
        """See :meth:`RuntimeBackend.status`: reads the watch-fed cache. ``pid`` is always None
        (the task runs on the kubelet's node); ``started_at`` is None until the container started."""
        if not _valid_run_id(run_id):
            return None
        with self._lock:
            run = self._runs.get(run_id)
            return None if run is None else self._status_of(run)

    def list(self) -> list[TaskStatus]:
        """See :meth:`RuntimeBackend.list`: every known run (records and adopted pods) not forgotten."""
        with self._lock:
            return [self._status_of(r) for _, r in sorted(self._runs.items()) if not r.forgotten]

    def log_path(self, run_id: str, stream: LogStream) -> Path | None:
        """``state_dir/<run_id>/stdout.log`` for ``stdout`` (it exists once the container has
        logged something); None for ``stderr`` -- Kubernetes merges the container's stderr into
        its one log, which lands in stdout.log -- and for an unknown run. Raises
        :class:`ValidationError` for a stream other than ``stdout``/``stderr``."""
        if stream not in ("stdout", "stderr"):
            raise ValidationError("stream", f"must be 'stdout' or 'stderr', got {stream!r}")
        if stream == "stderr" or not _valid_run_id(run_id):
            return None
        with self._lock:
            run = self._runs.get(run_id)
            return None if run is None else run.dir / "stdout.log"

    def stop(self, run_id: str, grace_s: float = 5.0) -> None:
        """Delete the run's pod with ``gracePeriodSeconds = ceil(grace_s)``: the kubelet sends
        SIGTERM, then SIGKILL after the grace period.

        Writes ``stop.json`` first, then waits until the watch reports the pod's end, at most
        ``grace_s + 1`` seconds; if it has not by then, the run is recorded as stopped with 137
        (the container had started) or no code (it had not) -- Apiary does not wait for a kubelet
        that may never answer. Idempotent: unknown, malformed or finished ``run_id`` returns at
        once. Raises :class:`UnavailableError` / :class:`PlatformError` if the API server does not
        take the deletion (``stop.json`` stays; calling again retries).
        """
        if not _valid_run_id(run_id):
            return
        deadline = time.monotonic() + max(0.0, grace_s) + 1.0
        with self._lock:
            run = self._runs.get(run_id)
            if run is None or run.final is not None:
                return
            if run.stop is None:
                run.stop = {"grace_s": max(0.0, grace_s), "requested_at": time.time()}
                try:
                    _write_atomic(run.dir / "stop.json", json.dumps(run.stop) + "\n")
                except OSError as exc:
                    logger.warning("run=%s cannot record its stop: %s", run_id, exc)
            in_flight = run.created_mono is None
        logger.info("run=%s pod=%s node=%s stop grace_s=%s", run_id, run.pod_name, self.node, grace_s)
        if not in_flight:  # else launch() deletes it once its create returns
            self._client.delete_pod(run.pod_name, int(math.ceil(max(0.0, grace_s))))
        with self._changed:
            self._changed.wait_for(lambda: run.final is not None and not self._draining(run),
                                   timeout=max(0.0, deadline - time.monotonic()))
            if run.final is None:
                self._finish(run, _Final(_EXIT_KILLED if run.started else None, False, True,
                                         started_at(run.pod) if run.pod else None, time.time(),
                                         "stop: the pod's end was not confirmed within the grace period"))
            run.drain_cut = True

    def forget(self, run_id: str) -> None:
        """Drop a finished run from :meth:`list`; see :meth:`RuntimeBackend.forget`.

        Writes ``state_dir/<run_id>/forgotten`` and deletes the pod (finished pods stay on the API
        server until then, so ``kubectl logs`` works) and its pull secret. Keeps the record and the
        log: :meth:`status` still answers and a repeated :meth:`launch` returns the final status
        and creates nothing. A deletion that fails is retried at the next relist. Raises
        :class:`PlatformError` if the run is still running.
        """
        if not _valid_run_id(run_id):
            return
        with self._lock:
            run = self._runs.get(run_id)
            if run is None or run.forgotten:
                return
            if self._status_of(run).state == "running":
                raise PlatformError(f"cannot forget {run_id}: it is still running (stop it first)")
            run.forgotten = True
            try:
                (run.dir / "forgotten").touch()
            except OSError as exc:
                logger.warning("run=%s cannot record that it was forgotten: %s", run_id, exc)
        self._run_actions([lambda: self._client.delete_pod(run.pod_name, None)])

    def close(self) -> None:
        """Stop the watch and log threads (open streams are shut down) and close the client this
        backend made. The pods keep running. Idempotent."""
        self._closed.set()
        with self._changed:
            responses = [self._watch_resp] + [r.log_resp for r in self._runs.values()]
            threads = [r.log_thread for r in self._runs.values() if r.log_thread is not None]
            self._changed.notify_all()
        for resp in responses:
            if resp is not None:
                try:
                    resp.shutdown()
                except (OSError, AttributeError, urllib3.exceptions.HTTPError):
                    pass
        self._watch_thread.join(5)
        for thread in threads:
            thread.join(2)
        if self._own_client:
            self._api.close()

    def __enter__(self) -> KubernetesBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
