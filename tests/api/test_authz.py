"""Who may call what: every route x every principal, and the seven authorization holes it once had.

The platform: Lab 6's two-VC cluster (VC ``default`` = hostname-carol, VC ``vc1`` = hostname-dan).
Principals, each with a real token from :class:`apiary.auth.Directory`:

* anonymous (no token), ``alice`` and ``eve`` (group ``default``: VC default), ``bob`` (group
  ``team-b``: VC vc1), ``root`` (group ``admin``);
* the agent of hostname-carol (the node running alice's job) and of hostname-dan (another node);
* the Alertmanager and Prefect bridge service tokens.

alice's job ``alice~secret-train`` carries a planted secret and runs on hostname-carol.
"""

from __future__ import annotations

import http.server
import itertools
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6, job_text
from tests.support.fake_registry import FakeRegistry, PushingBuilder, context_tar
from tests.support.mlflow import fake_mlflow

from apiary.api import create_app
from apiary.api.access import ACCESS, FLOW_RUN, HIDDEN, ON_BEHALF, Access
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.control.jobssh import key_pair
from apiary.images.service import ImageService
from apiary.marketplace.models import ModelRegistry
from apiary.mounts.table import MountTable
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.response.config import ResponseConfig
from apiary.settings import Settings
from apiary.spec.cluster import load_cluster_config
from apiary.spec.ports import task_ports
from apiary.storage.files import StorageFiles
from apiary.storage.service import StorageService
from apiary.store import make_engine, migrate, session_factory

CONFIG = LAB6 / "hived-config-two-vcs.yaml"
SECRET = "s3cr3t-planted-7f1c"
JOB = "alice~secret-train"
CAROL, DAN = "hostname-carol", "hostname-dan"
PRINCIPALS = ("anonymous", "alice", "eve", "bob", "admin", "agent-carol", "agent-dan", "alertmanager", "bridge")


def secret_job(name: str = "secret-train", vc: str = "default") -> str:
    doc = yaml.safe_load(job_text(5))
    doc["name"] = name
    doc["defaults"] = {"virtualCluster": vc}
    doc["secrets"] = {"token": SECRET}
    doc["taskRoles"]["train"]["commands"] = ["echo using <% $secrets.token %>", "sleep 600"]
    doc["taskRoles"]["train"]["resourcePerInstance"]["ports"] = {"http": 1}  # reached through the proxy
    return yaml.safe_dump(doc, sort_keys=False)


class World:
    """The platform, the principals' headers, and alice's running job."""

    def __init__(self, tmp: Path) -> None:
        self.engine = make_engine(f"sqlite:///{tmp}/a.db")
        migrate(self.engine)
        self.plane = ControlPlane(session_factory(self.engine), load_cluster_config(CONFIG), tmp / "logs")
        directory = Directory(self.plane.sessions)
        p = Principals(directory, ["default"])
        directory.create_group("team-b", virtual_clusters=["vc1"])
        self.headers: dict[str, dict[str, str]] = {
            "anonymous": {},
            "alice": bearer(p.user("alice")),
            "eve": bearer(p.user("eve")),
            "bob": bearer(p.user("bob", groups=("team-b",))),
            "admin": bearer(p.admin()),
            "agent-carol": bearer(p.agent(CAROL)),
            "agent-dan": bearer(p.agent(DAN)),
            "alertmanager": bearer(p.service("alertmanager")),
            "bridge": bearer(p.service("bridge")),
        }
        # Storage: a local server and config "team" granted to group default (alice and eve), with a file.
        self.storage_root = tmp / "storage"
        (self.storage_root / "team").mkdir(parents=True)
        (self.storage_root / "team" / "seed.txt").write_text("seed\n")
        storage = StorageService(self.plane.sessions)
        storage.put_server("local1", "local", {"rootPath": str(self.storage_root)})
        storage.put_config("team", default=False, mount_infos=[{"mountPoint": "/mnt/team", "server": "local1",
                                                                "path": "team"}])
        directory.set_storage_grant("default", "team")
        files = StorageFiles(storage, MountTable(tmp / "mounts"), max_upload_bytes=1 << 20)
        # Images: a fake registry holding the shared apiary/mnist, builds pushed into it.
        self.registry = FakeRegistry().start()
        self.registry.push("apiary/mnist", "latest", {"io.apiary.framework": "numpy"})
        images = ImageService(lambda: self.registry.address, builder=PushingBuilder(self.registry))
        # The model registry over an MLflow stand-in: model mnist is alice's (MLflow lets her and admins read it).
        models = ModelRegistry("http://mlflow.test", transport=fake_mlflow(
            {h["Authorization"].partition(" ")[2] for h in (self.headers["alice"], self.headers["admin"])}))
        self.client = TestClient(create_app(self.plane, AlertReceiver(self.plane, ActionsConfig(), notifiers={}),
                                            storage=storage, storage_files=files, images=images, models=models))
        self.client.__enter__()
        c, h = self.client, self.headers
        for node in (CAROL, DAN):
            self.report(node)
        r = c.post("/api/v2/jobs", content=secret_job(), headers={**h["alice"], "Content-Type": "text/yaml"})
        assert r.status_code == 202, r.text
        assert c.post("/api/v2/scheduler/cycle", headers=h["admin"]).status_code == 200
        self.run_id = self.assignments(CAROL)[0]["runId"]
        self.report(CAROL, [{"run_id": self.run_id, "state": "running", "pid": 1, "started_at": 1.0}])
        r = c.post(f"/api/v2/nodes/{CAROL}/logs", params={"runId": self.run_id, "stream": "stdout", "offset": 0},
                   content=f"using {SECRET}\n".encode(), headers=h["agent-carol"])
        assert r.status_code == 200, r.text
        assert self.state() == "RUNNING"

    def report(self, node: str, runs: list[dict] | None = None, who: str | None = None) -> int:
        r = self.client.post(f"/api/v2/nodes/{node}/status", headers=self.headers[who or f"agent-{node[9:]}"],
                             json={"agentId": "t", "gpus": 1, "simulatedGpus": True, "runs": runs or []})
        return r.status_code

    def assignments(self, node: str) -> list[dict]:
        r = self.client.get(f"/api/v2/nodes/{node}/assignments", headers=self.headers[f"agent-{node[9:]}"])
        assert r.status_code == 200, r.text
        return r.json()["assignments"]

    def state(self, job: str = JOB) -> str:
        return self.client.get(f"/api/v2/jobs/{job}", headers=self.headers["admin"]).json()["state"]

    def close(self) -> None:
        if hasattr(self, "task_server"):
            self.task_server.shutdown()
            self.task_server.server_close()
        self.client.__exit__(None, None, None)
        self.registry.stop()
        self.engine.dispose()


@pytest.fixture
def world(tmp_path: Path):
    w = World(tmp_path)
    yield w
    w.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("authz"))
    yield w
    w.close()


def _alert(name: str = "ApiaryTestAlert") -> dict:
    return {"version": "4", "status": "firing", "receiver": "apiary-webhook", "groupKey": "{}:{}",
            "alerts": [{"status": "firing", "labels": {"alertname": name, "severity": "info"}, "annotations": {},
                        "startsAt": "2026-11-25T10:00:00Z", "fingerprint": "abc123"}]}


# --------------------------------------------------------------------------- every route x every principal
#
# The cases are generated from the app's own /openapi.json: every path x method it publishes is
# requested by every principal, and the expected status comes from the one table,
# apiary.api.access.ACCESS (the README's who-may-do-what table mirrors it). What this file adds per
# operation is only how to make a request the table can judge: a target (whose job, which node) and
# a body where the operation needs one (REQUESTS), and a request for each part of a request that
# narrows who may call it (VARIANTS). An operation without them fails, as does an operation, or a
# route hidden from the document, the table does not name.

#: On call in the shared world (a schedule with her alone): the ``oncall`` principal.
ONCALL = {"schedules": [{"name": "primary", "layers": [
    {"name": "all", "users": ["eve"], "rotation": "weekly", "start": "2026-01-05T09:00:00+00:00",
     "time_zone": "UTC"}]}]}
USER_VCS = {"alice": {"default"}, "eve": {"default"}, "bob": {"vc1"}}
USER_STORAGE = {"alice": {"team"}, "eve": {"team"}}


@dataclass
class Target:
    """One request and what it is about: the resource's owner, its VC, the user and node the path names."""

    path: str
    kw: dict[str, Any] = field(default_factory=dict)
    owner: str | None = None
    vc: str | None = None
    user: str | None = None
    node: str | None = None
    storage: str | None = None


def _run(n: int) -> str:
    return f"8c1a2b3c-0000-4000-8000-{n:012d}"


_seq = itertools.count(100)


def _job(w: World, who: str, vc: str = "default", **headers: str) -> Target:
    name = f"j{next(_seq)}"
    return Target("/api/v2/jobs", {"content": secret_job(name, vc),
                                   "headers": {"Content-Type": "text/yaml", **headers}}, vc=vc)


def _alices_job(w: World, prefix: str) -> str:
    name = f"{prefix}{next(_seq)}"
    r = w.client.post("/api/v2/jobs", content=secret_job(name),
                      headers={**w.headers["alice"], "Content-Type": "text/yaml"})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def _fresh_user(w: World, _who: str) -> str:
    name = f"u{next(_seq)}"
    w.client.post("/api/v2/users", json={"username": name}, headers=w.headers["admin"]).raise_for_status()
    return name


def _fresh_group(w: World, _who: str) -> str:
    name = f"g{next(_seq)}"
    w.client.post("/api/v2/groups", json={"groupname": name}, headers=w.headers["admin"]).raise_for_status()
    return name


def _fresh_server(w: World) -> str:
    name = f"s{next(_seq)}"
    w.client.put(f"/api/v2/storages/servers/{name}", json={"type": "local", "data": {"rootPath": str(w.storage_root)}},
                 headers=w.headers["admin"]).raise_for_status()
    return name


def _fresh_config(w: World) -> str:
    name = f"c{next(_seq)}"
    w.client.put(f"/api/v2/storages/configs/{name}", json={"mountInfos": [
        {"mountPoint": "/mnt/x", "server": "local1", "path": "team"}]}, headers=w.headers["admin"]).raise_for_status()
    return name


def _fresh_file(w: World) -> str:
    name = f"f{next(_seq)}"
    w.client.put("/api/v2/storages/configs/team/files", params={"path": name}, content=b"x",
                 headers=w.headers["admin"]).raise_for_status()
    return name


_S = "/api/v2/storages"
_T = "/api/v2/templates"


def _template_doc(name: str, **extra: Any) -> dict:
    """A template of alice's job shape (VC default), with one parameter."""
    job = yaml.safe_load(secret_job("tj"))
    job["parameters"] = {"steps": 1}
    return {"name": name, "summary": "authz", "job": yaml.safe_dump(job, sort_keys=False), **extra}


def _alices_template(w: World) -> str:
    name = f"t{next(_seq)}"
    w.client.post(_T, json=_template_doc(name), headers=w.headers["alice"]).raise_for_status()
    return name


def _image_build(**params: str) -> Target:
    return Target("/api/v2/images/builds", {"params": {"name": f"i{next(_seq)}", **params},
                                            "content": context_tar("FROM apiary/base:bookworm\n"),
                                            "headers": {"Content-Type": "application/octet-stream"}})


def _alices_token(w: World) -> str:
    r = w.client.post("/api/v2/tokens", json={"description": "authz"}, headers=w.headers["alice"])
    r.raise_for_status()
    return r.json()["id"]


def _alices_ssh_key(w: World) -> str:
    title = f"k{next(_seq)}"
    r = w.client.post("/api/v2/users/alice/sshKeys", json={"title": title, "value": key_pair("authz")[1]},
                      headers=w.headers["admin"])
    r.raise_for_status()
    return title


def _incident(w: World) -> str:
    if not hasattr(w, "incident"):
        r = w.client.post("/api/v2/incidents", json={"title": "authz", "severity": "sev2", "jobs": [JOB]},
                          headers=w.headers["admin"])
        r.raise_for_status()
        iid = r.json()["id"]
        w.client.post(f"/api/v2/incidents/{iid}/resolve", json={}, headers=w.headers["admin"]).raise_for_status()
        w.incident = iid  # type: ignore[attr-defined]  # resolved sev2: it has a postmortem
    return w.incident  # type: ignore[attr-defined]


class _TaskHandler(http.server.BaseHTTPRequestHandler):
    """The web server of alice's task (its named port ``http``): 200 to every method."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


def _proxied(w: World) -> Target:
    """A request through the proxy to alice's running task's named port ``http``, served on the node's
    address (hostname-carol reported none: 127.0.0.1) by a server started on first use."""
    if not hasattr(w, "task_server"):
        run_id = w.run_id
        port = task_ports(run_id, ["http"])["http"]
        w.task_server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _TaskHandler)  # type: ignore[attr-defined]
        threading.Thread(target=w.task_server.serve_forever, daemon=True).start()  # type: ignore[attr-defined]
    return Target(f"/api/v2/jobs/{JOB}/proxy/train/0/http/index.html", owner="alice", vc="default")


def _bootstrap_token(w: World) -> str:
    r = w.client.post("/api/v2/bootstrap-tokens", json={}, headers=w.headers["admin"])
    r.raise_for_status()
    return r.json()["id"]


Make = Callable[[World, str], Target]
_INCIDENT = "/api/v2/incidents/{incident_id}"

#: (METHOD, path) -> the request principal ``who`` sends (made afresh for each one where it changes
#: something). Operations not named here are sent as they are, with the path's parameters below.
REQUESTS: dict[tuple[str, str], Make] = {
    ("POST", "/api/v2/jobs"): lambda w, who: _job(w, who),
    ("POST", "/api/v2/jobs/{job_id}/clone"): lambda w, who: Target(f"/api/v2/jobs/{JOB}/clone", owner="alice",
                                                                   vc="default"),
    ("PUT", "/api/v2/jobs/{job_id}/executionType"): lambda w, who: Target(
        f"/api/v2/jobs/{_alices_job(w, 'stop')}/executionType", {"json": {"value": "STOP"}}, owner="alice",
        vc="default"),
    ("PUT", "/api/v2/jobs/{job_id}/flowRun"): lambda w, who: Target(
        f"/api/v2/jobs/{_alices_job(w, 'link')}/flowRun", {"json": {"id": _run(next(_seq))}}, owner="alice"),
    ("PUT", "/api/v2/flowRuns"): lambda w, who: Target("/api/v2/flowRuns", {"json": {"links": [
        {"jobId": _alices_job(w, "links"), "flowRunId": _run(next(_seq))}]}}),
    ("POST", "/api/v2/logs/query"): lambda w, who: Target("/api/v2/logs/query", {"json": {"reads": [
        {"jobId": JOB, "taskRole": "train", "index": 0, "attempt": 0, "stream": "stdout"}]}}),
    ("PUT", "/api/v2/cluster/config"): lambda w, who: Target(
        "/api/v2/cluster/config", {"content": CONFIG.read_bytes(), "headers": {"Content-Type": "text/yaml"}}),
    ("PUT", "/api/v2/nodes/{node}/cordon"): lambda w, who: Target(f"/api/v2/nodes/{DAN}/cordon",
                                                                  {"json": {"value": False}}, node=DAN),
    ("POST", "/api/v2/nodes/{node}/faults"): lambda w, who: Target(f"/api/v2/nodes/{DAN}/faults",
                                                                   {"json": {"gpu": 0, "temp": 50}}, node=DAN),
    ("POST", "/api/v2/nodes/{node}/status"): lambda w, who: Target(f"/api/v2/nodes/{CAROL}/status", {"json": {
        "agentId": "t", "gpus": 1, "simulatedGpus": True, "runs": []}}, node=CAROL),
    ("POST", "/api/v2/nodes/{node}/logs"): lambda w, who: Target(f"/api/v2/nodes/{CAROL}/logs", {
        "params": {"runId": w.run_id, "stream": "stdout", "offset": 0}, "content": b""}, node=CAROL),
    ("POST", "/api/v2/alerts/webhook"): lambda w, who: Target("/api/v2/alerts/webhook", {"json": _alert()}),
    ("POST", "/api/v2/users"): lambda w, who: Target("/api/v2/users", {"json": {"username": f"n{next(_seq)}"}}),
    ("GET", "/api/v2/users/{name}"): lambda w, who: Target("/api/v2/users/alice", user="alice"),
    ("DELETE", "/api/v2/users/{name}"): lambda w, who: Target(f"/api/v2/users/{_fresh_user(w, who)}"),
    ("GET", "/api/v2/users/{name}/sshKeys"): lambda w, who: Target("/api/v2/users/alice/sshKeys", user="alice"),
    ("POST", "/api/v2/users/{name}/sshKeys"): lambda w, who: Target("/api/v2/users/alice/sshKeys", {"json": {
        "title": f"k{next(_seq)}", "value": key_pair("authz")[1]}}, user="alice"),
    ("DELETE", "/api/v2/users/{name}/sshKeys/{title}"): lambda w, who: Target(
        f"/api/v2/users/alice/sshKeys/{_alices_ssh_key(w)}", user="alice"),
    ("POST", "/api/v2/groups"): lambda w, who: Target("/api/v2/groups", {"json": {"groupname": f"n{next(_seq)}"}}),
    ("DELETE", "/api/v2/groups/{name}"): lambda w, who: Target(f"/api/v2/groups/{_fresh_group(w, who)}"),
    ("PUT", "/api/v2/groups/{name}/members/{user}"): lambda w, who: Target(
        f"/api/v2/groups/{_fresh_group(w, who)}/members/{_fresh_user(w, who)}"),
    ("DELETE", "/api/v2/groups/{name}/members/{user}"): lambda w, who: Target(
        f"/api/v2/groups/{_fresh_group(w, who)}/members/{_fresh_user(w, who)}"),
    ("PUT", "/api/v2/groups/{name}/virtualClusters/{vc}"): lambda w, who: Target(
        f"/api/v2/groups/{_fresh_group(w, who)}/virtualClusters/vc1"),
    ("DELETE", "/api/v2/groups/{name}/virtualClusters/{vc}"): lambda w, who: Target(
        f"/api/v2/groups/{_fresh_group(w, who)}/virtualClusters/vc1"),
    ("PUT", "/api/v2/groups/{name}/storageConfigs/{config}"): lambda w, who: Target(
        f"/api/v2/groups/{_fresh_group(w, who)}/storageConfigs/team"),
    ("DELETE", "/api/v2/groups/{name}/storageConfigs/{config}"): lambda w, who: Target(
        f"/api/v2/groups/{_fresh_group(w, who)}/storageConfigs/team"),
    ("GET", _S + "/servers/{name}"): lambda w, who: Target(f"{_S}/servers/local1"),
    ("PUT", _S + "/servers/{name}"): lambda w, who: Target(f"{_S}/servers/s{next(_seq)}", {"json": {
        "type": "local", "data": {"rootPath": str(w.storage_root)}}}),
    ("DELETE", _S + "/servers/{name}"): lambda w, who: Target(f"{_S}/servers/{_fresh_server(w)}"),
    ("GET", _S + "/configs/{name}"): lambda w, who: Target(f"{_S}/configs/team", storage="team"),
    ("PUT", _S + "/configs/{name}"): lambda w, who: Target(f"{_S}/configs/c{next(_seq)}", {"json": {
        "mountInfos": [{"mountPoint": "/mnt/x", "server": "local1"}]}}),
    ("DELETE", _S + "/configs/{name}"): lambda w, who: Target(f"{_S}/configs/{_fresh_config(w)}"),
    ("GET", _S + "/configs/{name}/list"): lambda w, who: Target(f"{_S}/configs/team/list", storage="team"),
    ("GET", _S + "/configs/{name}/files"): lambda w, who: Target(f"{_S}/configs/team/files", {
        "params": {"path": "seed.txt"}}, storage="team"),
    ("PUT", _S + "/configs/{name}/files"): lambda w, who: Target(f"{_S}/configs/team/files", {
        "params": {"path": f"up{next(_seq)}"}, "content": b"x"}, storage="team"),
    ("DELETE", _S + "/configs/{name}/files"): lambda w, who: Target(f"{_S}/configs/team/files", {
        "params": {"path": _fresh_file(w)}}, storage="team"),
    ("POST", _T): lambda w, who: Target(_T, {"json": _template_doc(f"n{next(_seq)}")}),
    ("GET", _T + "/{name}"): lambda w, who: Target(f"{_T}/{_alices_template(w)}"),
    ("PUT", _T + "/{name}"): lambda w, who: Target(f"{_T}/{_alices_template(w)}", {
        "json": {k: v for k, v in _template_doc("x", summary="changed").items() if k != "name"}}, owner="alice"),
    ("DELETE", _T + "/{name}"): lambda w, who: Target(f"{_T}/{_alices_template(w)}", owner="alice"),
    ("POST", _T + "/{name}/runs"): lambda w, who: Target(f"{_T}/{_alices_template(w)}/runs", {
        "json": {"parameters": {"steps": 2}}}, vc="default"),
    # Model mnist is alice's in the MLflow stand-in (World).
    **{("GET", "/api/v2/models/{name}" + tail): lambda w, who, t=tail: Target(
        "/api/v2/models/mnist" + t.replace("{version}", "1"), owner="alice")
       for tail in ("", "/versions/{version}", "/versions/{version}/download")},
    ("GET", "/api/v2/images/{repository}"): lambda w, who: Target("/api/v2/images/apiary/mnist"),
    ("POST", "/api/v2/images/builds"): lambda w, who: _image_build(),
    ("POST", "/api/v2/tokens"): lambda w, who: Target("/api/v2/tokens", {"json": {}}),
    ("DELETE", "/api/v2/tokens/{token_id}"): lambda w, who: Target(f"/api/v2/tokens/{_alices_token(w)}", owner="alice"),
    ("POST", "/api/v2/bootstrap-tokens"): lambda w, who: Target("/api/v2/bootstrap-tokens", {"json": {}}),
    **{(method, "/api/v2/jobs/{job_id}/proxy/{role}/{index}/{port}/{path}"): lambda w, who: _proxied(w)
       for method in ("GET", "POST", "PUT", "PATCH", "DELETE")},
    ("POST", "/api/v2/nodes/{node}/join"): lambda w, who: Target(f"/api/v2/nodes/{DAN}/join", {"json": {}},
                                                                  node=DAN),
    ("DELETE", "/api/v2/bootstrap-tokens/{token_id}"): lambda w, who: Target(
        f"/api/v2/bootstrap-tokens/{_bootstrap_token(w)}"),
    ("POST", "/api/v2/drills/results"): lambda w, who: Target("/api/v2/drills/results", {"json": {
        "drill": "inspection", "result": "passed", "startedAt": 1.0, "finishedAt": 2.0}}),
    # GitHub's webhook: unsigned (and the intake unconfigured here), so nobody's token counts.
    ("POST", "/api/v2/ci/webhooks/github"): lambda w, who: Target("/api/v2/ci/webhooks/github", {
        "json": {"zen": "x"}, "headers": {"X-GitHub-Event": "ping", "X-GitHub-Delivery": f"d{next(_seq)}"}}),
    ("POST", "/api/v2/ci/runs"): lambda w, who: Target("/api/v2/ci/runs", {"json": {
        "flowRunId": f"authz-{next(_seq)}", "repo": "acme/apiary", "sha": "a" * 40, "ref": "refs/heads/main",
        "kind": "deploy", "result": "running", "startedAt": "2026-11-25T10:00:00Z"}}),
    ("POST", "/api/v2/deployments"): lambda w, who: Target("/api/v2/deployments", {"json": {
        "sha": "b" * 40, "images": {"agent": "reg/agent:b"}, "actor": who, "trigger": "push",
        "startedAt": "2026-11-25T10:00:00Z", "finishedAt": "2026-11-25T10:01:00Z", "result": "succeeded"}}),
    ("POST", "/api/v2/incidents"): lambda w, who: Target("/api/v2/incidents", {"json": {"title": f"by {who}"}}),
    ("POST", "/api/v2/incidents/events"): lambda w, who: Target("/api/v2/incidents/events", {"json": {
        "event_action": "trigger", "dedup_key": f"authz:{who}", "payload": {
            "summary": "x", "severity": "info", "source": DAN, "component": "node", "class": "authz"}}}),
    ("GET", _INCIDENT): lambda w, who: Target(f"/api/v2/incidents/{_incident(w)}", owner="alice"),
    ("POST", _INCIDENT + "/actions"): lambda w, who: Target(
        f"/api/v2/incidents/{_incident(w)}/actions", {"json": {"action": "uncordon-node", "node": DAN}}),
    ("GET", _INCIDENT + "/postmortem"): lambda w, who: Target(f"/api/v2/incidents/{_incident(w)}/postmortem"),
    ("PUT", _INCIDENT + "/postmortem"): lambda w, who: Target(f"/api/v2/incidents/{_incident(w)}/postmortem", {
        "json": {"markdown": w.client.get(f"/api/v2/incidents/{_incident(w)}/postmortem",
                                          headers=w.headers["admin"]).json()["markdown"]}}),
    ("POST", _INCIDENT + "/{event}"): lambda w, who: Target(f"/api/v2/incidents/{_incident(w)}/comment",
                                                            {"json": {"message": f"by {who}"}}),
}

#: Path parameters of the operations sent as they are.
PARAMS = {"job_id": JOB, "node": DAN}
#: What each path parameter makes the request about (Target fields).
ABOUT = {"job_id": {"owner": "alice", "vc": "default"}, "node": {"node": DAN}}


def _with(make: Make, **headers: str) -> Make:
    def variant(w: World, who: str) -> Target:
        t = make(w, who)
        t.kw["headers"] = {**t.kw.get("headers", {}), **headers}
        return t
    return variant


def _on_behalf(w: World, who: str) -> Target:
    return _job(w, who, **{ON_BEHALF: "alice"})


#: (METHOD, path, the parts of the request it carries) -> the request: one for each ``only`` part
#: and each ``needs`` of the table, so that every narrowing is tried by every principal.
VARIANTS: dict[tuple[str, str, frozenset[str]], Make] = {
    ("POST", "/api/v2/jobs", frozenset({ON_BEHALF})): _on_behalf,
    ("POST", "/api/v2/jobs", frozenset({FLOW_RUN})): lambda w, who: _with(_job, **{FLOW_RUN: _run(next(_seq))})(w, who),
    ("POST", "/api/v2/jobs", frozenset({ON_BEHALF, FLOW_RUN})): lambda w, who: _with(
        _on_behalf, **{FLOW_RUN: _run(next(_seq))})(w, who),
    ("POST", "/api/v2/jobs/{job_id}/clone", frozenset({FLOW_RUN})): lambda w, who: _with(
        REQUESTS[("POST", "/api/v2/jobs/{job_id}/clone")], **{FLOW_RUN: _run(next(_seq))})(w, who),
    ("POST", "/api/v2/alerts/webhook", frozenset({"?action"})): lambda w, who: Target(
        "/api/v2/alerts/webhook", {"json": _alert("ApiaryTestAlert2"), "params": {"action": "stop-job"}}),
    ("POST", _T, frozenset({"official"})): lambda w, who: Target(_T, {"json": _template_doc(
        f"n{next(_seq)}", official=True)}),
    ("PUT", _T + "/{name}", frozenset({"official"})): lambda w, who: Target(f"{_T}/{_alices_template(w)}", {
        "json": {k: v for k, v in _template_doc("x", official=True).items() if k != "name"}}, owner="alice"),
    ("POST", _T + "/{name}/runs", frozenset({ON_BEHALF})): lambda w, who: _with(
        REQUESTS[("POST", _T + "/{name}/runs")], **{ON_BEHALF: "alice"})(w, who),
    ("POST", _T + "/{name}/runs", frozenset({FLOW_RUN})): lambda w, who: _with(
        REQUESTS[("POST", _T + "/{name}/runs")], **{FLOW_RUN: _run(next(_seq))})(w, who),
    ("POST", _T + "/{name}/runs", frozenset({ON_BEHALF, FLOW_RUN})): lambda w, who: _with(
        REQUESTS[("POST", _T + "/{name}/runs")], **{ON_BEHALF: "alice", FLOW_RUN: _run(next(_seq))})(w, who),
    ("POST", "/api/v2/images/builds", frozenset({"?shared"})): lambda w, who: _image_build(shared="true"),
    ("POST", "/api/v2/tokens", frozenset({"machine-or-other-or-unexpiring"})): lambda w, who: Target(
        "/api/v2/tokens", {"json": {"kind": "agent", "subject": DAN}}),
}


def roles(who: str, t: Target) -> set[str]:
    """The table's principals ``who`` is for the request ``t``."""
    if who == "anonymous":
        return set()
    if who in ("bridge", "alertmanager"):
        return {"token", who}
    if who.startswith("agent-"):
        return {"token", "agent"} if t.node == f"hostname-{who[6:]}" else {"token"}
    name = "root" if who == "admin" else who
    out = {"token", "user"} | ({"admin"} if who == "admin" else set())
    out |= {"owner"} if t.owner == name else set()
    out |= {"vc"} if t.vc is not None and (who == "admin" or t.vc in USER_VCS.get(who, set())) else set()
    out |= {"storage"} if t.storage is not None and t.storage in USER_STORAGE.get(who, set()) else set()
    out |= {"self"} if t.user == name else set()
    out |= {"oncall"} if who == "eve" else set()
    return out


def expected(access: Access, who: str, t: Target, parts: frozenset[str]) -> str:
    """``"ok"`` (any 2xx) or the refusal's status, as the table says."""
    if "anyone" in access.who:
        return "ok"
    if who == "anonymous" or "signed" in access.who or "bootstrap" in access.who:
        return "401"  # (none of the principals holds a bootstrap token: tests/api/test_join.py)
    mine = roles(who, t)
    admitted = mine & access.who - {w for w, part in access.needs.items() if part not in parts}
    if admitted and all(mine & access.only[part] for part in parts):
        return "ok"
    if mine & access.hidden_to and not mine & access.sees:
        return "404"
    return "403"


def operations(client: TestClient) -> list[tuple[str, str, dict]]:
    """Every (METHOD, path, operation) of the app's /openapi.json."""
    doc = client.get("/openapi.json").json()
    return [(method.upper(), path, op) for path, ops in doc["paths"].items() for method, op in ops.items()]


def test_every_operation_of_the_openapi_document_for_every_principal(shared: World) -> None:
    """Each (METHOD, path) of /openapi.json, and each narrowing variant of it, by each principal:
    the status is the one the table (apiary.api.access) gives. Every mismatch is listed."""
    shared.client.app.state.incidents.config = ResponseConfig.parse(ONCALL)
    ops = operations(shared.client)
    cases: list[tuple[str, str, frozenset[str], Make]] = []
    problems: list[str] = []
    assert ops, "the OpenAPI document lists no operation: the test would check nothing"
    for method, path, op in ops:
        if (method, path) not in ACCESS:
            problems.append(f"{method} {path}: no row in apiary.api.access.ACCESS")
            continue
        make = REQUESTS.get((method, path))
        if make is None:
            names = re.findall(r"\{(\w+)\}", path)
            if "requestBody" in op or any(n not in PARAMS for n in names):
                problems.append(f"{method} {path}: add its request to REQUESTS")
                continue
            about = {k: v for n in names for k, v in ABOUT[n].items()}
            concrete = path.format(**PARAMS)
            make = lambda w, who, c=concrete, a=about: Target(c, **a)  # noqa: E731
        cases.append((method, path, frozenset(), make))
        access = ACCESS[(method, path)]
        for part in [*access.only, *access.needs.values()]:
            variants = [k for k in VARIANTS if k[:2] == (method, path) and part in k[2]]
            if not variants:
                problems.append(f"{method} {path}: add a request carrying {part!r} to VARIANTS")
        cases += [(m, p, parts, v) for (m, p, parts), v in VARIANTS.items() if (m, p) == (method, path)]
    for method, path, parts, make in cases:
        access = ACCESS[(method, path)]
        for who in PRINCIPALS:
            t = make(shared, who)
            kw = dict(t.kw)
            headers = {**kw.pop("headers", {}), **shared.headers[who]}
            status = shared.client.request(method, t.path, headers=headers, **kw).status_code
            got = "ok" if 200 <= status < 300 else str(status)
            want = expected(access, who, t, parts)
            if got != want:
                problems.append(f"{method} {path} {sorted(parts) or ''} as {who}: {status}, the table says {want}")
    assert problems == []


def app_routes(routes: list[Any]) -> Iterator[tuple[str, set[str] | None]]:
    """``(path, methods)`` of every route, those of included routers too: FastAPI 0.150 keeps an
    included router as one entry of ``app.routes`` whose routes it lists itself (a walk of
    ``app.routes`` alone saw only the app's own few routes)."""
    for route in routes:
        if hasattr(route, "effective_route_contexts"):
            yield from ((_template(r.path), r.methods) for r in route.effective_route_contexts())
        else:
            yield _template(route.path), getattr(route, "methods", None)


def _template(path: str) -> str:
    """A route's path as the OpenAPI document writes it: ``{path:path}`` is ``{path}`` there."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)


def test_every_route_is_in_the_table_and_the_openapi_document_says_who(shared: World) -> None:
    """A route added without a row in the table fails here; so does a route left out of the
    OpenAPI document without a reason (apiary.api.access.HIDDEN), and a row naming no route."""
    published = {(m, p): op for m, p, op in operations(shared.client)}
    routes = {(method, path) for path, methods in app_routes(shared.client.app.routes)
              for method in (methods or set()) - {"HEAD", "OPTIONS"}}
    assert sorted(routes - set(published) - set(HIDDEN)) == []  # hidden without a reason
    assert sorted(set(HIDDEN) - routes) == [] and not set(HIDDEN) & set(published)
    assert sorted(routes - set(ACCESS)) == []  # no row
    assert sorted(set(ACCESS) - routes) == []  # a row for no route
    for (method, path), op in published.items():
        assert op.get("x-apiary-principals") == ACCESS[(method, path)].principals(), (method, path)
    # The narrowing parts the table names are real parts of their routes' requests.
    for (method, path), access in ACCESS.items():
        assert set(access.needs.values()) <= set(access.only), (method, path)


def test_hidden_routes_answer_as_the_table_says(shared: World) -> None:
    """The public documents answer everyone; a signed link with a bad signature changes nothing,
    whoever's bearer token comes with it."""
    c = shared.client
    for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
        assert ACCESS[("GET", path)].who == {"anyone"}
        assert {c.get(path, headers=shared.headers[who]).status_code for who in PRINCIPALS} == {200}, path
    iid = _incident(shared)
    for who in PRINCIPALS:
        for method in ("GET", "POST"):
            r = c.request(method, f"/api/v2/incidents/{iid}/link/acknowledge?token=forged",
                          headers=shared.headers[who])
            assert r.status_code == 403, (who, method, r.text)


def test_identity_deletes_are_admin_only(world: World) -> None:
    c, h = world.client, world.headers
    for who in ("alice", "bob", "agent-carol", "alertmanager", "bridge"):
        assert c.delete("/api/v2/users/eve", headers=h[who]).status_code == 403
        assert c.delete("/api/v2/groups/team-b", headers=h[who]).status_code == 403
        assert c.delete("/api/v2/groups/team-b/members/bob", headers=h[who]).status_code == 403
        assert c.delete("/api/v2/groups/team-b/virtualClusters/vc1", headers=h[who]).status_code == 403
    assert c.delete("/api/v2/groups/team-b/members/bob", headers=h["admin"]).status_code == 200
    assert c.delete("/api/v2/users/eve", headers=h["admin"]).status_code == 204
    assert c.get("/api/v2/me", headers=h["eve"]).status_code == 401  # her tokens went with her


# --------------------------------------------------------------------------- the seven holes


def test_hole_1_a_forged_agent_report_does_not_finish_the_job(world: World) -> None:
    done = [{"run_id": world.run_id, "state": "exited", "exit_code": 0}]
    c = world.client
    body = {"agentId": "evil", "gpus": 1, "simulatedGpus": True, "runs": done}
    assert c.post(f"/api/v2/nodes/{DAN}/status", json=body).status_code == 401
    assert c.post(f"/api/v2/nodes/{CAROL}/status", json=body, headers=world.headers["alice"]).status_code == 403
    assert c.post(f"/api/v2/nodes/{CAROL}/status", json=body, headers=world.headers["agent-dan"]).status_code == 403
    # dan's own agent reporting carol's run: acknowledged (dan must not run it) and ignored
    assert c.post(f"/api/v2/nodes/{DAN}/status", json=body, headers=world.headers["agent-dan"]).status_code == 200
    assert world.state() == "RUNNING"
    assert world.report(CAROL, done) == 200  # the right agent
    assert world.state() == "SUCCEEDED"


def test_hole_2_secrets_reach_only_the_right_agent_and_logs_only_the_owner(world: World) -> None:
    c, h = world.client, world.headers
    assert SECRET in str(world.assignments(CAROL))
    for who in ("anonymous", "alice", "bob", "admin", "agent-dan", "bridge"):
        r = c.get(f"/api/v2/nodes/{CAROL}/assignments", headers=h[who])
        assert r.status_code in (401, 403) and SECRET not in r.text
    assert SECRET not in str(world.assignments(DAN))
    assert c.get(f"/api/v2/jobs/{JOB}/logs", headers=h["bob"]).status_code == 404
    assert c.get(f"/api/v2/jobs/{JOB}/logs", headers=h["eve"]).status_code == 403
    assert SECRET in c.get(f"/api/v2/jobs/{JOB}/logs", headers=h["alice"]).text


def test_hole_3_only_admins_rewrite_the_cluster(world: World) -> None:
    one_node = (LAB6 / "hived-config-one-vc.yaml").read_bytes()
    for who, status in (("anonymous", 401), ("alice", 403), ("bob", 403), ("agent-carol", 403), ("bridge", 403)):
        r = world.client.put("/api/v2/cluster/config", content=one_node, headers=world.headers[who])
        assert r.status_code == status
    assert set(world.plane.cluster.virtual_clusters) == {"default", "vc1"}


def test_hole_4_no_impersonation_by_query_or_header(world: World) -> None:
    c, h = world.client, world.headers
    assert c.post("/api/v2/jobs?user=alice", content=secret_job("imp", vc="vc1")).status_code == 401
    r = c.post("/api/v2/jobs?user=alice", content=secret_job("imp", vc="vc1"),
               headers={**h["bob"], "X-Apiary-User": "alice"})
    assert r.status_code == 202 and r.json()["id"] == "bob~imp"
    r = c.post("/api/v2/jobs", content=secret_job("imp2", vc="vc1"),
               headers={**h["bob"], "X-Apiary-On-Behalf-Of": "alice"})
    assert r.status_code == 403
    r = c.post("/api/v2/jobs", content=secret_job("imp3"), headers={**h["bridge"], "X-Apiary-On-Behalf-Of": "nobody"})
    assert r.status_code == 404
    r = c.post("/api/v2/jobs", content=secret_job("x"), headers=h["bob"])
    assert r.status_code == 403
    assert r.json()["message"] == "User bob has no access to virtual cluster default."


def test_hole_5_forged_alerts_stop_nothing(world: World) -> None:
    c, h = world.client, world.headers
    alert = _alert("ApiaryGpuEccDoubleBitError")
    alert["alerts"][0]["labels"].update({"node": CAROL, "job_id": JOB, "severity": "fatal"})
    assert c.post("/api/v2/alerts/webhook?action=stop-job", json=alert).status_code == 401
    assert c.post("/api/v2/alerts/webhook", json=alert).status_code == 401
    assert c.post("/api/v2/alerts/webhook?action=stop-job", json=alert, headers=h["alice"]).status_code == 403
    assert c.post("/api/v2/alerts/webhook?action=stop-job", json=alert,
                  headers=h["alertmanager"]).status_code == 403
    assert world.state() == "RUNNING"
    assert not next(n for n in c.get("/api/v2/nodes", headers=h["admin"]).json() if n["name"] == CAROL)["cordoned"]


def test_hole_6_bob_cannot_touch_alice(world: World) -> None:
    c, h = world.client, world.headers
    assert c.put(f"/api/v2/jobs/{JOB}/executionType", json={"value": "STOP"}, headers=h["bob"]).status_code == 404
    assert c.put(f"/api/v2/jobs/{JOB}/executionType", json={"value": "STOP"}, headers=h["eve"]).status_code == 403
    r = c.post(f"/api/v2/nodes/{CAROL}/logs", params={"runId": world.run_id, "stream": "stdout", "offset": 0},
               content=b"forged\n", headers=h["bob"])
    assert r.status_code == 403
    r = c.post(f"/api/v2/nodes/{DAN}/logs", params={"runId": world.run_id, "stream": "stdout", "offset": 0},
               content=b"forged\n", headers=h["agent-dan"])
    assert r.status_code == 403  # dan's agent, but the run is carol's
    assert "forged" not in c.get(f"/api/v2/jobs/{JOB}/logs", headers=h["alice"]).text
    assert c.put(f"/api/v2/nodes/{CAROL}/cordon", json={"value": True}, headers=h["bob"]).status_code == 403
    assert c.post(f"/api/v2/nodes/{CAROL}/faults", json={"gpu": 0, "eccDbe": 1}, headers=h["bob"]).status_code == 403
    assert c.post("/api/v2/scheduler/cycle", headers=h["bob"]).status_code == 403
    r = c.put(f"/api/v2/jobs/{JOB}/flowRun", json={"id": "8c1a2b3c-0000-4000-8000-000000000002"}, headers=h["bob"])
    assert r.status_code == 403
    r = c.put("/api/v2/flowRuns", json={"links": [{"jobId": JOB, "flowRunId": "forged"}]}, headers=h["bob"])
    assert r.status_code == 403
    events = c.get("/api/v2/events", headers=h["bob"]).json()["events"]
    assert all(e["jobId"].startswith("bob~") for e in events)
    assert c.get("/api/v2/alerts", headers=h["bob"]).status_code == 403
    assert JOB not in [j["id"] for j in c.get("/api/v2/jobs", headers=h["bob"]).json()]
    assert JOB in [j["id"] for j in c.get("/api/v2/jobs", headers=h["eve"]).json()]  # same VC: visible
    assert world.state() == "RUNNING"


def test_tokens_expire_and_revoke(world: World) -> None:
    c, h = world.client, world.headers
    new = c.post("/api/v2/tokens", json={"description": "ci"}, headers=h["alice"]).json()
    mine = bearer(new["token"])
    assert c.get("/api/v2/me", headers=mine).json()["name"] == "alice"
    assert new["id"] in [t["id"] for t in c.get("/api/v2/tokens", headers=h["alice"]).json()]
    assert "token" not in c.get("/api/v2/tokens", headers=h["alice"]).json()[0]
    assert c.delete(f"/api/v2/tokens/{new['id']}", headers=h["bob"]).status_code == 404  # not his
    assert c.delete(f"/api/v2/tokens/{new['id']}", headers=h["alice"]).status_code == 200
    r = c.get("/api/v2/me", headers=mine)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    # a user may not mint never-expiring tokens or tokens for others
    assert c.post("/api/v2/tokens", json={"expiresInS": None}, headers=h["alice"]).status_code == 403
    assert c.post("/api/v2/tokens", json={"subject": "bob"}, headers=h["alice"]).status_code == 403
    for bad in ("Bearer nonsense", "Bearer apiary_000000000000_" + "a" * 43, "Basic YWRtaW46cGFzcw==", "Bearer "):
        assert c.get("/api/v2/me", headers={"Authorization": bad}).status_code == 401


def test_a_token_past_its_expiry_is_refused(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/b.db")
    migrate(engine)
    now = [1000.0]
    directory = Directory(session_factory(engine), clock=lambda: now[0])
    directory.create_user("alice")
    token = directory.create_token("user", "alice", expires_in_s=60).token
    assert directory.authenticate(token).name == "alice"
    now[0] += 61
    with pytest.raises(Exception, match="expired"):
        directory.authenticate(token)
    engine.dispose()


def test_users_are_rate_limited_with_retry_after_admins_and_machines_are_not(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/r.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(CONFIG), tmp_path / "logs")
    p = Principals(Directory(plane.sessions), ["default", "vc1"])
    alice, admin, agent = bearer(p.user("alice")), bearer(p.admin()), bearer(p.agent(CAROL))
    settings = Settings(rate_calls="5/minute", rate_submits="2/hour")
    with TestClient(create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}), settings=settings)) as c:
        assert [c.get("/api/v2/me", headers=alice).status_code for _ in range(5)] == [200] * 5
        r = c.get("/api/v2/me", headers=alice)
        assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60
        assert "600" not in r.json()["message"] and r.json()["code"] == "TooManyRequestsError"
        assert all(c.get("/api/v2/me", headers=h).status_code == 200 for h in (admin, agent) for _ in range(10))
        bob = bearer(p.user("bob"))
        codes = [c.post("/api/v2/jobs", content=secret_job(f"r{i}"), headers=bob).status_code for i in range(3)]
        assert codes == [202, 202, 429]  # the submission limit, before the call limit (3 calls)
    engine.dispose()


def test_output_inside_a_node_report_is_stored_for_the_nodes_own_runs_only(world: World) -> None:
    """Agents send small output with their report (NodeReport.logs). Dan's agent cannot write into
    a run placed on Carol: the chunk is left out, Dan's heartbeat still counts; bad chunks are a
    400 naming the field, with nothing stored."""
    import base64

    c, h = world.client, world.headers
    b64 = lambda text: base64.b64encode(text.encode()).decode()  # noqa: E731
    body = {"agentId": "t", "gpus": 1, "simulatedGpus": True, "runs": []}
    size = len(f"using {SECRET}\n".encode())  # what the World's setup shipped with POST .../logs

    def logs(text: str, offset: int = size) -> list[dict]:
        return [{"runId": world.run_id, "stream": "stdout", "offset": offset, "data": b64(text)}]

    r = c.post(f"/api/v2/nodes/{DAN}/status", json={**body, "logs": logs("forged\n")}, headers=h["agent-dan"])
    assert r.status_code == 200 and r.json()["logs"] == [None], r.text  # left out, and said so
    r = c.post(f"/api/v2/nodes/{CAROL}/status", json={**body, "logs": [{**logs("x")[0], "data": "not base64!"}]},
               headers=h["agent-carol"])
    assert r.status_code == 400 and "logs.data" in r.text
    r = c.post(f"/api/v2/nodes/{CAROL}/status", json={**body, "logs": [{**logs("x")[0], "data": "zé=="}]},
               headers=h["agent-carol"])
    assert r.status_code == 400 and "logs.data" in r.text  # found by test_fuzz: it was a 500
    r = c.post(f"/api/v2/nodes/{CAROL}/status", json={**body, "logs": logs("y" * (64 * 1024 + 1))},
               headers=h["agent-carol"])
    assert r.status_code == 400 and '"logs' in r.text
    exited = {"run_id": world.run_id, "state": "exited", "exit_code": 0, "pid": 1, "started_at": 1.0,
              "finished_at": 2.0}
    r = c.post(f"/api/v2/nodes/{CAROL}/status", json={**body, "runs": [exited], "logs": logs("epoch 1 done\n")},
               headers=h["agent-carol"])
    assert r.status_code == 200 and r.json() == {"ack": [world.run_id], "logs": [size + len("epoch 1 done\n")]}
    text = c.get(f"/api/v2/jobs/{JOB}/logs", headers=h["alice"]).text
    assert "epoch 1 done" in text and "forged" not in text and "not base64" not in text and "yyy" not in text
    # Resent (the agent did not get the answer): stored once.
    c.post(f"/api/v2/nodes/{CAROL}/status", json={**body, "logs": logs("epoch 1 done\n")}, headers=h["agent-carol"])
    assert c.get(f"/api/v2/jobs/{JOB}/logs", headers=h["alice"]).text.count("epoch 1 done") == 1
    assert world.state() == "SUCCEEDED"
