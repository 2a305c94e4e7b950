"""A stateful fake of the Kubernetes API (core/v1 pods, secrets and nodes), for the Kubernetes runtime tests.

It is a fake because no Kubernetes API server (nor etcd, nor a kubelet) can run on the machines
these tests run on. It is a real HTTP/1.1 server on ``127.0.0.1`` (a port the OS picks) that the
official ``kubernetes`` client talks to unchanged: ``FakeKubernetes().api_client()`` is a
``kubernetes.client.ApiClient`` whose ``Configuration.host`` is the fake's URL.

What it models, after the Kubernetes API conventions
(https://kubernetes.io/docs/reference/using-api/api-concepts/):

* Objects in memory with a cluster-wide ``resourceVersion`` counter: every change bumps it, stamps
  the object and appends a watch event to a log.
* ``POST`` (409 ``AlreadyExists`` for a taken name; 422 ``Invalid`` for a pod name that is no
  DNS-1123 subdomain or a label value Kubernetes would refuse), ``GET``, list with
  ``labelSelector`` (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, comma-joined) and ``fieldSelector``
  (``metadata.name``, ``metadata.namespace``, ``spec.nodeName``, ``status.phase``; ``=``/``==``/``!=``),
  ``DELETE`` (``gracePeriodSeconds``), ``PATCH`` (a JSON merge patch, also for strategic-merge
  requests), and ``GET .../pods/<name>/log`` (plain text; ``follow=true`` streams until the
  container ended; 400 while the container has not started, as the kubelet answers).
* Watches: ``?watch=true&resourceVersion=N`` answers 200 with chunked, newline-delimited JSON events
  (``ADDED`` / ``MODIFIED`` / ``DELETED``) after ``N``; no or ``0`` version starts with a synthetic
  ``ADDED`` per existing object. A version older than the last :meth:`FakeKubernetes.compact`
  gets what a real API server sends: 200 and one ``ERROR`` event whose object is a ``Status`` with
  ``code: 410`` (``Expired``). ``timeoutSeconds`` ends the stream.
* A minimal kubelet: deleting a pod whose container runs records ``terminated`` with 143 (SIGTERM,
  grace > 0) or 137 (grace 0) before the pod goes, unless the pod's node was lost. The garbage
  collector: a secret whose ``ownerReferences`` name a deleted pod's uid is deleted with it.

Test controls (thread-safe): :meth:`add_node`, :meth:`set_running`, :meth:`terminate`,
:meth:`set_waiting`, :meth:`lose_node`, :meth:`delete_pod` (someone else deletes it),
:meth:`write_log`, :meth:`drop_watches`, :meth:`drop_log_streams`, :meth:`hold_watches` (new
watch requests wait until released, so a test can change things while the client is blind),
:meth:`compact` (older versions answer 410) and :meth:`fail_next` (the next matching request gets
an error status). Requests are recorded in :attr:`requests` (method, path, query).

Not modelled: authentication, namespaces as objects, admission, scheduling (pods name their node),
graceful deletion that outlives the DELETE call, bookmarks, ``resourceVersionMatch``.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client as k8s

_KINDS = {"pods": "Pod", "secrets": "Secret", "nodes": "Node"}
_NAMESPACED = {"pods", "secrets"}
_POLL_S = 0.02
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
CONTAINER_IMAGE_ID = "docker-pullable://fake@sha256:" + "0" * 64


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch of ``target`` by ``patch`` (in place; returns ``target``)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


def _label_match(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "" if node is None else str(node)


def _field_match(obj: dict[str, Any], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, value = (term.split("!=", 1) if negate else term.replace("==", "=").split("=", 1))
        if (_field(obj, key.strip()) == value.strip()) == negate:
            return False
    return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet: clients hang up on streams all the time (that is what close() does)."""


@dataclass(frozen=True)
class _Event:
    rv: int
    kind: str
    namespace: str
    type: str
    obj: dict[str, Any]


class FakeKubernetes:
    """The fake API server (see the module doc). Use as a context manager, or :meth:`close` it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._events: list[_Event] = []
        self._rv = 0
        self._compacted = 0
        self._watch_gen = 0
        self._log_gen = 0
        self._held = False
        self._closed = False
        self._logs: dict[tuple[str, str], bytearray] = {}
        self._lost_nodes: set[str] = set()
        self._failures: list[tuple[str, str, int, str]] = []
        #: every request: ``(method, path, {query parameter: value})``
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        #: the JSON bodies of accepted pod creations, as the client sent them
        self.created_pods: list[dict[str, Any]] = []
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="fake-k8s", daemon=True)
        self._thread.start()

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving; open watch and log streams end."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> FakeKubernetes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def configuration(self) -> k8s.Configuration:
        """A ``kubernetes.client.Configuration`` pointing at this fake (no auth, no TLS)."""
        cfg = k8s.Configuration()
        cfg.host = self.url
        return cfg

    def api_client(self) -> k8s.ApiClient:
        return k8s.ApiClient(self.configuration())

    # -- store ---------------------------------------------------------------------------------

    def _put(self, kind: str, namespace: str, obj: dict[str, Any], event: str) -> dict[str, Any]:
        """Store ``obj`` (lock held), bump the version, log the event; returns the stored copy."""
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = (kind, namespace, obj["metadata"]["name"])
        if event == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        self._events.append(_Event(self._rv, kind, namespace, event, copy.deepcopy(obj)))
        self._cond.notify_all()
        return copy.deepcopy(obj)

    def _pod(self, name: str, namespace: str | None) -> dict[str, Any]:
        for (kind, ns, n), obj in self._objects.items():
            if kind == "pods" and n == name and (namespace is None or ns == namespace):
                return obj
        raise KeyError(f"no pod {name!r}")

    def _set_container(self, pod: dict[str, Any], state: dict[str, Any], ready: bool) -> None:
        container = pod["spec"]["containers"][0]
        pod["status"]["containerStatuses"] = [{
            "name": container["name"], "image": container.get("image", ""), "imageID": CONTAINER_IMAGE_ID,
            "ready": ready, "restartCount": 0, "started": "running" in state, "state": state,
        }]

    def _delete_pod(self, pod: dict[str, Any], grace: int, kubelet: bool) -> dict[str, Any]:
        """Delete ``pod`` (lock held): the kubelet's last word first, then the object, then its secrets."""
        ns = pod["metadata"]["namespace"]
        node = pod["spec"].get("nodeName")
        state = (pod["status"].get("containerStatuses") or [{}])[0].get("state", {})
        pod["metadata"]["deletionTimestamp"] = _now()
        pod["metadata"]["deletionGracePeriodSeconds"] = grace
        if kubelet and node not in self._lost_nodes and "running" in state:
            started = state["running"].get("startedAt", _now())
            code = 143 if grace > 0 else 137
            self._set_container(pod, {"terminated": {"exitCode": code, "reason": "Error", "startedAt": started,
                                                     "finishedAt": _now()}}, False)
            pod["status"]["phase"] = "Failed"
            self._put("pods", ns, pod, "MODIFIED")
        final = self._put("pods", ns, pod, "DELETED")
        uid = pod["metadata"].get("uid")
        for (kind, sns, _), obj in list(self._objects.items()):
            owners = obj["metadata"].get("ownerReferences") or []
            if kind == "secrets" and sns == ns and any(o.get("uid") == uid for o in owners):
                self._put("secrets", sns, obj, "DELETED")
        return final

    # -- test controls -------------------------------------------------------------------------

    def add_node(self, name: str) -> None:
        """Register a Ready node ``name``."""
        with self._cond:
            node = {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": _now()},
                    "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}
            self._put("nodes", "", node, "ADDED")

    def pods(self, namespace: str | None = None) -> dict[str, dict[str, Any]]:
        """Every pod (a copy), by name."""
        with self._cond:
            return {n: copy.deepcopy(o) for (k, ns, n), o in self._objects.items()
                    if k == "pods" and (namespace is None or ns == namespace)}

    def pod(self, name: str) -> dict[str, Any] | None:
        """A copy of pod ``name`` (any namespace), or None."""
        with self._cond:
            try:
                return copy.deepcopy(self._pod(name, None))
            except KeyError:
                return None

    def secrets(self, namespace: str | None = None) -> dict[str, dict[str, Any]]:
        with self._cond:
            return {n: copy.deepcopy(o) for (k, ns, n), o in self._objects.items()
                    if k == "secrets" and (namespace is None or ns == namespace)}

    def set_running(self, name: str) -> None:
        """Pod ``name``'s container runs (phase Running, Ready)."""
        with self._cond:
            pod = self._pod(name, None)
            pod["status"].update({"phase": "Running", "startTime": _now(), "hostIP": "10.0.0.1", "podIP": "10.0.0.1"})
            self._set_container(pod, {"running": {"startedAt": _now()}}, True)
            self._put("pods", pod["metadata"]["namespace"], pod, "MODIFIED")

    def terminate(self, name: str, exit_code: int, reason: str | None = None) -> None:
        """Pod ``name``'s container ended with ``exit_code`` (``reason`` default: Completed / Error)."""
        with self._cond:
            pod = self._pod(name, None)
            state = (pod["status"].get("containerStatuses") or [{}])[0].get("state", {})
            started = state.get("running", {}).get("startedAt", _now())
            reason = reason or ("Completed" if exit_code == 0 else "Error")
            self._set_container(pod, {"terminated": {"exitCode": exit_code, "reason": reason, "startedAt": started,
                                                     "finishedAt": _now()}}, False)
            pod["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            self._put("pods", pod["metadata"]["namespace"], pod, "MODIFIED")

    def set_waiting(self, name: str, reason: str = "ErrImagePull", message: str = "pull access denied") -> None:
        """Pod ``name``'s container waits (e.g. the image cannot be pulled)."""
        with self._cond:
            pod = self._pod(name, None)
            pod["status"]["phase"] = "Pending"
            self._set_container(pod, {"waiting": {"reason": reason, "message": message}}, False)
            self._put("pods", pod["metadata"]["namespace"], pod, "MODIFIED")

    def lose_node(self, node: str, how: str = "evict") -> None:
        """Node ``node`` stops answering. Its Ready condition turns Unknown, and its pods:

        * ``how="evict"`` (Kubernetes >= 1.26): the taint manager marks each pod with the
          ``DisruptionTarget`` condition (reason ``DeletionByTaintManager``) and deletes it; with
          no kubelet to confirm, the pod garbage collector removes the object (no exit code).
        * ``how="phase"`` (older Kubernetes): the node controller sets phase ``Failed``, reason
          ``NodeLost``; the pod object stays.
        """
        with self._cond:
            self._lost_nodes.add(node)
            node_obj = self._objects.get(("nodes", "", node))
            if node_obj is not None:
                node_obj["status"]["conditions"] = [{"type": "Ready", "status": "Unknown",
                                                     "reason": "NodeStatusUnknown"}]
                self._put("nodes", "", node_obj, "MODIFIED")
            for (kind, ns, _), pod in list(self._objects.items()):
                if kind != "pods" or pod["spec"].get("nodeName") != node:
                    continue
                if how == "phase":
                    pod["status"].update({"phase": "Failed", "reason": "NodeLost",
                                          "message": f"Node {node} which was running pod is unresponsive"})
                    self._put("pods", ns, pod, "MODIFIED")
                else:
                    pod["status"].setdefault("conditions", []).append({
                        "type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
                        "message": "Taint manager: deleting due to NoExecute taint", "lastTransitionTime": _now()})
                    pod["metadata"]["deletionTimestamp"] = _now()
                    self._put("pods", ns, pod, "MODIFIED")
                    self._delete_pod(pod, 0, kubelet=False)

    def delete_pod(self, name: str) -> None:
        """Someone else (``kubectl delete pod --force``) deletes pod ``name``: no kubelet word."""
        with self._cond:
            self._delete_pod(self._pod(name, None), 0, kubelet=False)

    def write_log(self, name: str, text: str | bytes) -> None:
        """Append to pod ``name``'s container log."""
        with self._cond:
            pod = self._pod(name, None)
            key = (pod["metadata"]["namespace"], name)
            self._logs.setdefault(key, bytearray()).extend(text.encode() if isinstance(text, str) else text)
            self._cond.notify_all()

    def drop_watches(self) -> None:
        """End every open watch stream cleanly (as an API server restart or a load balancer would)."""
        with self._cond:
            self._watch_gen += 1
            self._cond.notify_all()

    def drop_log_streams(self) -> None:
        """End every open ``follow=true`` log stream."""
        with self._cond:
            self._log_gen += 1
            self._cond.notify_all()

    @contextmanager
    def hold_watches(self) -> Iterator[None]:
        """While inside, new watch requests wait (the client is blind); they proceed on exit."""
        with self._cond:
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def compact(self) -> None:
        """Forget the event history: a watch from an older version now gets 410 Expired."""
        with self._cond:
            self._compacted = self._rv
            self._events = []
            self._cond.notify_all()

    def fail_next(self, method: str, kind: str, status: int, reason: str = "Forbidden") -> None:
        """The next ``method`` request on ``kind`` (``pods``, ``secrets``, ...) answers ``status``."""
        with self._cond:
            self._failures.append((method, kind, status, reason))

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def watch_versions(self) -> list[str]:
        """The ``resourceVersion`` of every watch request so far (``""`` when none was given)."""
        return [q.get("resourceVersion", "") for m, p, q in list(self.requests)
                if m == "GET" and q.get("watch", "").lower() in ("true", "1")]

    def count(self, method: str, suffix: str) -> int:
        """How many ``method`` requests had a path ending in ``suffix`` (e.g. ``POST``, ``/pods``)."""
        return sum(1 for m, p, _ in list(self.requests) if m == method and p.endswith(suffix))


def _handler(fake: FakeKubernetes) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        # -- plumbing --------------------------------------------------------------------------

        def _send(self, code: int, body: dict[str, Any] | bytes, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, reason: str, message: str) -> None:
            self._send(code, _status(code, reason, message))

        def _start_stream(self, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

        def _chunk(self, data: bytes) -> None:
            if data:
                self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        def _end_stream(self) -> None:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def _read_body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                data = json.loads(raw) if raw else {}
            except ValueError:
                data = {}
            return data if isinstance(data, dict) else {}

        def _route(self, method: str) -> None:
            body = self._read_body()  # always: an unread body would be parsed as the next request
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            fake.requests.append((method, url.path, query))
            parts = [p for p in url.path.split("/") if p]
            # /api/v1/namespaces/{ns}/{kind}[/{name}[/log]]  or  /api/v1/{kind}[/{name}]
            if parts[:2] != ["api", "v1"]:
                return self._error(404, "NotFound", f"the server could not find the requested resource {url.path}")
            rest = parts[2:]
            namespace: str | None = None
            if rest[:1] == ["namespaces"] and len(rest) >= 3:
                namespace, rest = rest[1], rest[2:]
            if not rest or rest[0] not in _KINDS or len(rest) > 3 or (len(rest) == 3 and rest[2] != "log"):
                return self._error(404, "NotFound", f"the server could not find the requested resource {url.path}")
            kind = rest[0]
            name = rest[1] if len(rest) >= 2 else None
            with fake._cond:
                for i, (m, k, status, reason) in enumerate(fake._failures):
                    if m == method and k == kind:
                        del fake._failures[i]
                        return self._error(status, reason, f"injected failure: {method} {kind}")
            if kind in _NAMESPACED and namespace is None and method != "GET":
                return self._error(405, "MethodNotAllowed", "a namespace is required")
            ns = namespace if kind in _NAMESPACED else ""
            try:
                if len(rest) == 3:
                    return self._log(ns or "", name or "", query)
                if method == "GET" and name is None:
                    if query.get("watch", "").lower() in ("true", "1"):
                        return self._watch(kind, namespace, query)
                    return self._list(kind, namespace, query)
                if method == "GET":
                    return self._get(kind, ns or "", name or "")
                if method == "POST" and name is None:
                    return self._create(kind, ns or "", body)
                if method == "DELETE" and name is not None:
                    return self._delete(kind, ns or "", name, query, body)
                if method == "PATCH" and name is not None:
                    return self._patch(kind, ns or "", name, body)
            except (BrokenPipeError, ConnectionResetError):
                return None
            return self._error(405, "MethodNotAllowed", f"{method} {url.path}")

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def do_DELETE(self) -> None:
            self._route("DELETE")

        def do_PATCH(self) -> None:
            self._route("PATCH")

        # -- verbs -----------------------------------------------------------------------------

        def _get(self, kind: str, ns: str, name: str) -> None:
            with fake._cond:
                obj = fake._objects.get((kind, ns, name))
                body = copy.deepcopy(obj) if obj is not None else None
            if body is None:
                return self._error(404, "NotFound", f'{kind} "{name}" not found')
            self._send(200, body)

        def _matches(self, kind: str, ns: str, namespace: str | None, obj: dict[str, Any], query: dict[str, str],
                     wanted_kind: str) -> bool:
            return (kind == wanted_kind and (namespace is None or ns == namespace)
                    and _label_match(obj["metadata"].get("labels") or {}, query.get("labelSelector", ""))
                    and _field_match(obj, query.get("fieldSelector", "")))

        def _list(self, kind: str, namespace: str | None, query: dict[str, str]) -> None:
            with fake._cond:
                items = [copy.deepcopy(o) for (k, ns, _), o in sorted(fake._objects.items())
                         if self._matches(k, ns, namespace, o, query, kind)]
                rv = fake._rv
            self._send(200, {"kind": f"{_KINDS[kind]}List", "apiVersion": "v1",
                             "metadata": {"resourceVersion": str(rv)}, "items": items})

        def _watch(self, kind: str, namespace: str | None, query: dict[str, str]) -> None:
            timeout = float(query.get("timeoutSeconds") or 1800)
            deadline = time.monotonic() + timeout
            with fake._cond:
                fake._cond.wait_for(lambda: not fake._held or fake._closed)
                gen = fake._watch_gen
                since = int(query.get("resourceVersion") or 0)
                initial: list[tuple[str, dict[str, Any]]] = []
                expired = since and since < fake._compacted
                if not since:
                    initial = [("ADDED", copy.deepcopy(o)) for (k, ns, _), o in sorted(fake._objects.items())
                               if self._matches(k, ns, namespace, o, query, kind)]
                    since = fake._rv
            self._start_stream("application/json")
            if expired:
                error = _status(410, "Expired", f"too old resource version: {since} ({fake._compacted})")
                self._chunk(json.dumps({"type": "ERROR", "object": error}).encode() + b"\n")
                return self._end_stream()
            for event, obj in initial:
                self._chunk(json.dumps({"type": event, "object": obj}).encode() + b"\n")
            position = since
            while True:
                with fake._cond:
                    fake._cond.wait_for(
                        lambda p=position: fake._closed or fake._watch_gen != gen or fake._rv > p
                        or time.monotonic() >= deadline, timeout=_POLL_S)
                    if fake._closed or fake._watch_gen != gen or time.monotonic() >= deadline:
                        break
                    if position < fake._compacted:
                        error = _status(410, "Expired", f"too old resource version: {position} ({fake._compacted})")
                        pending = [json.dumps({"type": "ERROR", "object": error})]
                        position = fake._rv
                        done = True
                    else:
                        pending = [json.dumps({"type": e.type, "object": e.obj}) for e in fake._events
                                   if e.rv > position and self._matches(e.kind, e.namespace, namespace, e.obj, query,
                                                                        kind)]
                        position = fake._rv
                        done = False
                for line in pending:
                    self._chunk(line.encode() + b"\n")
                if done:
                    break
            self._end_stream()

        def _create(self, kind: str, ns: str, body: dict[str, Any]) -> None:
            meta = body.get("metadata") or {}
            name = meta.get("name")
            if not name or not _DNS1123_SUBDOMAIN.match(name) or len(name) > 253:
                return self._error(422, "Invalid", f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 "
                                                   "subdomain must consist of lower case alphanumeric characters")
            for key, value in (meta.get("labels") or {}).items():
                if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
                    return self._error(422, "Invalid", f"metadata.labels: Invalid value: {value!r} ({key})")
            with fake._cond:
                if (kind, ns, name) in fake._objects:
                    return self._error(409, "AlreadyExists", f'{kind} "{name}" already exists')
                obj = copy.deepcopy(body)
                obj.setdefault("apiVersion", "v1")
                obj.setdefault("kind", _KINDS[kind])
                obj["metadata"].update({"namespace": ns, "uid": str(uuid.uuid4()), "creationTimestamp": _now()})
                if kind == "pods":
                    fake.created_pods.append(copy.deepcopy(body))
                    obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
                stored = fake._put(kind, ns, obj, "ADDED")
            self._send(201, stored)

        def _delete(self, kind: str, ns: str, name: str, query: dict[str, str], body: dict[str, Any]) -> None:
            grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
            with fake._cond:
                obj = fake._objects.get((kind, ns, name))
                if obj is None:
                    final = None
                elif kind == "pods":
                    final = fake._delete_pod(obj, int(grace) if grace is not None else 30, kubelet=True)
                else:
                    final = fake._put(kind, ns, obj, "DELETED")
            if final is None:
                return self._error(404, "NotFound", f'{kind} "{name}" not found')
            self._send(200, final)

        def _patch(self, kind: str, ns: str, name: str, body: dict[str, Any]) -> None:
            with fake._cond:
                obj = fake._objects.get((kind, ns, name))
                stored = None if obj is None else fake._put(kind, ns, _merge(obj, body), "MODIFIED")
            if stored is None:
                return self._error(404, "NotFound", f'{kind} "{name}" not found')
            self._send(200, stored)

        def _log(self, ns: str, name: str, query: dict[str, str]) -> None:
            def state() -> tuple[bool, dict[str, Any]]:
                obj = fake._objects.get(("pods", ns, name))
                if obj is None:
                    return False, {}
                return True, ((obj["status"].get("containerStatuses") or [{}])[0].get("state") or {})

            def node_lost() -> bool:
                obj = fake._objects.get(("pods", ns, name))
                return obj is not None and obj["spec"].get("nodeName") in fake._lost_nodes

            with fake._cond:
                exists, st = state()
                data = bytes(fake._logs.get((ns, name), b""))
                gen = fake._log_gen
                lost = node_lost()
            if not exists:
                return self._error(404, "NotFound", f'pods "{name}" not found')
            if lost:  # the API server cannot reach the kubelet
                return self._error(500, "InternalError", f"Get https://{name}:10250/containerLogs: no route to host")
            if "running" not in st and "terminated" not in st:
                reason = (st.get("waiting") or {}).get("reason", "ContainerCreating")
                return self._error(400, "BadRequest",
                                   f'container "task" in pod "{name}" is waiting to start: {reason}')
            if query.get("follow", "").lower() not in ("true", "1"):
                return self._send(200, data, "text/plain")
            self._start_stream("text/plain")
            self._chunk(data)
            position = len(data)
            while True:
                with fake._cond:
                    fake._cond.wait_for(
                        lambda p=position: fake._closed or fake._log_gen != gen or node_lost()
                        or len(fake._logs.get((ns, name), b"")) > p or "running" not in state()[1],
                        timeout=_POLL_S)
                    if fake._closed or fake._log_gen != gen or node_lost():
                        break
                    more = bytes(fake._logs.get((ns, name), b""))[position:]
                    ended = "running" not in state()[1]
                position += len(more)
                self._chunk(more)
                if ended:
                    break
            self._end_stream()

    return Handler
