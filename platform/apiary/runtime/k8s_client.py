"""The Kubernetes API calls of a node agent: :class:`PodClient` (its pods and their pull secrets in
one namespace) and :func:`api_client_from_env` (connecting to a real cluster).

Every call asks for the raw JSON (``_preload_content=False``) and carries a timeout, so no call
can hang the agent and no response is deserialized into client models the backend never reads.
A failed call becomes Apiary's error split (:meth:`PodClient.error`): :class:`UnavailableError`
for "try again" (unreachable, timeouts, 429, 5xx), :class:`PlatformError` for a refusal. The
streams (the watch, a pod's log) are handed back open: their reader owns the connection.

Kept apart from :class:`apiary.runtime.kubernetes.KubernetesBackend`, which holds the run
tracking (records, the watch-fed cache, log followers) and calls only this, so the HTTP edge is
one small surface (and the Role ``apiary deploy render`` writes can be checked against it).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s  # type: ignore[import-untyped, unused-ignore]
from kubernetes import config as k8s_config  # type: ignore[import-untyped, unused-ignore]
from kubernetes.client.exceptions import ApiException  # type: ignore[import-untyped, unused-ignore]

from apiary.errors import PlatformError, UnavailableError
from apiary.runtime.k8s_pods import ANNOTATION_RUN_ID, CONTAINER, LABEL_NODE, MANAGED_BY, MANAGED_BY_LABEL, label_value

logger = logging.getLogger(__name__)

__all__ = [
    "CHUNK",
    "ENV_KUBECONFIG",
    "RETRYABLE_STATUS",
    "TRANSPORT_ERRORS",
    "PodClient",
    "api_client_from_env",
    "api_message",
    "iter_lines",
]

ENV_KUBECONFIG = "APIARY_KUBECONFIG"
#: HTTP statuses that mean "try again" (0: no answer at all).
RETRYABLE_STATUS = frozenset({0, 408, 429, 500, 502, 503, 504})
#: What a call raises when the connection, not the API server, failed.
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, OSError)
#: Bytes read from a stream at a time.
CHUNK = 64 * 1024


# ---------------------------------------------------------------------------------------------
# Client configuration


def api_client_from_env(kubeconfig: str | Path | None = None, context: str | None = None) -> Any:
    """A ``kubernetes.client.ApiClient`` for a real cluster.

    ``kubeconfig`` (a path), else ``$APIARY_KUBECONFIG``; else, inside a pod
    (``KUBERNETES_SERVICE_HOST`` set), the service account's in-cluster configuration; else the
    client's default (``$KUBECONFIG`` or ``~/.kube/config``). ``context``: a kubeconfig context
    (default: the current one). Raises :class:`PlatformError` when no configuration loads.
    """
    path = kubeconfig or os.environ.get(ENV_KUBECONFIG)
    cfg = k8s.Configuration()
    try:
        if path:
            k8s_config.load_kube_config(config_file=str(Path(path).expanduser()), context=context,
                                        client_configuration=cfg, persist_config=False)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=cfg)
        else:
            k8s_config.load_kube_config(context=context, client_configuration=cfg, persist_config=False)
    except (k8s_config.ConfigException, OSError, ValueError, TypeError) as exc:
        raise PlatformError(
            f"no Kubernetes configuration ({exc}); set {ENV_KUBECONFIG} to a kubeconfig file or run in a pod"
        ) from exc
    return k8s.ApiClient(cfg)


# ---------------------------------------------------------------------------------------------
# Responses


def api_message(exc: Any) -> str:
    """The ``message`` of the Kubernetes ``Status`` body of ``exc`` (an ``ApiException``), else its
    HTTP reason; ``""`` when neither is given. Log this, never ``str(exc)``: the whole body may
    quote the pod spec the call sent (env values, a job's secrets)."""
    try:
        body = json.loads(exc.body) if exc.body else {}
    except (TypeError, ValueError):
        body = {}
    return str(body.get("message") or exc.reason or "") if isinstance(body, dict) else str(exc.reason or "")


def iter_lines(resp: Any) -> Iterator[bytes]:
    """The non-blank lines of a streamed response (a watch: one JSON event each), as they arrive,
    without their newline; a last line without one is yielded when the stream ends. Raises
    :data:`TRANSPORT_ERRORS` if the connection breaks."""
    buffer = b""
    while True:
        data = resp.read1(CHUNK)
        if not data:
            break
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        yield from (line for line in lines if line.strip())
    if buffer.strip():
        yield buffer


class PodClient:
    """The calls one node's agent makes: pods of ``node`` (and their pull secrets) in ``namespace``.

    ``api_client``: a ``kubernetes.client.ApiClient`` (the caller owns it and closes it).
    ``request_timeout_s``: the connect and read timeout of each call, in seconds. Thread-safe as
    the client is (one connection pool). Every method but the streams raises
    :class:`UnavailableError` / :class:`PlatformError` (see :meth:`error`); none retries.
    """

    def __init__(self, api_client: Any, *, namespace: str, node: str, request_timeout_s: float) -> None:
        self.api = api_client
        self.core = k8s.CoreV1Api(api_client)
        self.namespace = namespace
        self.node = node
        #: (connect, read) seconds
        self.timeout = (request_timeout_s, request_timeout_s)
        self.label_selector = f"{MANAGED_BY_LABEL}={MANAGED_BY},{LABEL_NODE}={label_value(node)}"
        self.field_selector = f"spec.nodeName={node}"

    def error(self, what: str, exc: BaseException) -> PlatformError:
        """The Apiary error for a failed API call: UnavailableError for "try again" (unreachable,
        timeouts, 429, 5xx), PlatformError for a refusal. ``what``: the call, for the message."""
        if isinstance(exc, ApiException):
            status = int(exc.status or 0)
            message = api_message(exc)
            if status in RETRYABLE_STATUS:
                return UnavailableError(f"{what}: the Kubernetes API answered {status}: {message}")
            return PlatformError(f"{what}: the Kubernetes API refused ({status}): {message}")
        return UnavailableError(f"{what}: the Kubernetes API server {self.api.configuration.host} "
                                f"is unreachable: {exc}")

    def list_pods(self) -> dict[str, Any]:
        """The node's pods: the API's ``PodList`` JSON (``items``, ``metadata.resourceVersion``)."""
        try:
            resp = self.core.list_namespaced_pod(
                self.namespace, label_selector=self.label_selector, field_selector=self.field_selector,
                _preload_content=False, _request_timeout=self.timeout)
            return dict(json.loads(resp.data))
        except (ApiException, *TRANSPORT_ERRORS, ValueError) as exc:
            raise self.error(f"list pods of node {self.node}", exc) from exc

    def watch_pods(self, resource_version: str | None, timeout_s: int) -> Any:
        """Open a watch of the node's pods from ``resource_version`` that the server ends after
        ``timeout_s`` seconds: the open response, one JSON event per line (:func:`iter_lines`);
        the caller releases it. Raises ApiException / :data:`TRANSPORT_ERRORS` as they come."""
        return self.core.list_namespaced_pod(
            self.namespace, label_selector=self.label_selector, field_selector=self.field_selector,
            watch=True, resource_version=resource_version, allow_watch_bookmarks=True,
            timeout_seconds=timeout_s, _preload_content=False,
            _request_timeout=(self.timeout[0], timeout_s + 30))

    def follow_log(self, name: str, read_timeout_s: float = 300) -> Any:
        """Open ``GET .../pods/<name>/log?follow=true`` for the task's container: the open
        response (the log from its start, then as it grows); the caller releases it. Raises
        ApiException (404: the pod is gone) / :data:`TRANSPORT_ERRORS` as they come."""
        return self.core.read_namespaced_pod_log(
            name, self.namespace, container=CONTAINER, follow=True, _preload_content=False,
            _request_timeout=(self.timeout[0], read_timeout_s))

    def create_pod(self, run_id: str, pod: Any) -> dict[str, Any]:
        """Create ``pod`` (a ``V1Pod`` named for ``run_id``): the created pod's JSON. A pod of that
        name that exists already (409) is returned if it is ``run_id``'s (adopted), else raises
        :class:`PlatformError`. Not idempotent past that: the name is the idempotency key."""
        name = pod.metadata.name
        try:
            resp = self.core.create_namespaced_pod(self.namespace, pod, _preload_content=False,
                                                   _request_timeout=self.timeout)
            return dict(json.loads(resp.data))
        except ApiException as exc:
            if exc.status != 409:
                raise self.error(f"create pod {name} for {run_id}", exc) from exc
            return self.read_owned_pod(run_id, name)
        except (*TRANSPORT_ERRORS, ValueError) as exc:
            raise self.error(f"create pod {name} for {run_id}", exc) from exc

    def read_owned_pod(self, run_id: str, name: str) -> dict[str, Any]:
        """Pod ``name``'s JSON, if its ``apiary.io/run-id`` annotation is ``run_id`` (else
        :class:`PlatformError`: the name is taken by another run)."""
        try:
            resp = self.core.read_namespaced_pod(name, self.namespace, _preload_content=False,
                                                 _request_timeout=self.timeout)
            existing = json.loads(resp.data)
        except (ApiException, *TRANSPORT_ERRORS, ValueError) as exc:
            raise self.error(f"read pod {name} of {run_id}", exc) from exc
        owner = ((existing.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RUN_ID)
        if owner != run_id:
            raise PlatformError(f"pod {name} exists in namespace {self.namespace} but runs {owner!r}, not {run_id}")
        logger.info("run=%s pod=%s existed already: adopted", run_id, name)
        return dict(existing)

    def put_secret(self, secret: Any) -> None:
        """Create ``secret`` (a ``V1Secret``), or refresh the data of one left by an earlier try."""
        name = secret.metadata.name
        try:
            self.core.create_namespaced_secret(self.namespace, secret, _preload_content=False,
                                               _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status != 409:
                raise self.error(f"create pull secret {name}", exc) from exc
            try:  # left by an earlier try of this run: refresh its credentials
                self.core.patch_namespaced_secret(name, self.namespace, {"data": secret.data},
                                                  _preload_content=False, _request_timeout=self.timeout)
            except (ApiException, *TRANSPORT_ERRORS) as exc2:
                raise self.error(f"update pull secret {name}", exc2) from exc2
        except TRANSPORT_ERRORS as exc:
            raise self.error(f"create pull secret {name}", exc) from exc

    def own_secret(self, name: str, pod: Mapping[str, Any]) -> None:
        """Make the pod the owner of its pull secret, so Kubernetes' garbage collector deletes the
        secret with the pod whoever deletes it (best effort: Apiary deletes it too; never raises)."""
        uid = (pod.get("metadata") or {}).get("uid")
        if not uid:
            return
        patch = {"metadata": {"ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}]}}
        try:
            self.core.patch_namespaced_secret(name, self.namespace, patch, _preload_content=False,
                                              _request_timeout=self.timeout)
        except (ApiException, *TRANSPORT_ERRORS) as exc:
            logger.warning("pull secret %s not owned by its pod: %s", name, exc)

    def delete_pod(self, name: str, grace_s: int | None) -> None:
        """Delete pod ``name`` (and its pull secret) with ``grace_s`` seconds of grace (None: the
        pod's own); a pod already gone is fine. Idempotent; returns once the API server took it."""
        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace_s,
                                            _preload_content=False, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status != 404:
                raise self.error(f"delete pod {name}", exc) from exc
        except TRANSPORT_ERRORS as exc:
            raise self.error(f"delete pod {name}", exc) from exc
        self.delete_secret(name)

    def delete_secret(self, name: str) -> None:
        """Delete pull secret ``name`` if it exists (best effort: a failure is logged, never raised)."""
        try:
            self.core.delete_namespaced_secret(name, self.namespace, _preload_content=False,
                                               _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status != 404:
                logger.warning("pull secret %s not deleted: %s", name, api_message(exc))
        except TRANSPORT_ERRORS as exc:
            logger.warning("pull secret %s not deleted: %s", name, exc)
