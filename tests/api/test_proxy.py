"""The proxy to a task instance's named port (apiary.api.routers.proxy), in process.

alice's job runs one instance on hostname-carol (it reported no address: 127.0.0.1) with two named
ports: ``http``, served by a small HTTP server that answers what it received, and ``ws``, a
websocket echo server (the ``websockets`` library). Both record what reached them, so the tests can
say that the platform token never did and that the instance's secret did.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6, minimal_job
from websockets.sync.server import ServerConnection, serve

from apiary.api import create_app
from apiary.api.routers.proxy import COOKIE
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.control.proxy import SECRET_ENV
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.spec.cluster import load_cluster_config
from apiary.spec.ports import task_ports
from apiary.store import make_engine, migrate, session_factory

CAROL = "hostname-carol"


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers JSON ``{"method", "path", "headers", "body"}`` of what it received."""

    seen: list[dict[str, Any]] = []

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        headers = {k.lower(): v for k, v in self.headers.items()}
        got = {"method": self.command, "path": self.path, "headers": headers, "body": body}
        type(self).seen.append(got)
        out = json.dumps(got).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.send_header("Set-Cookie", f"{COOKIE}=forged; Path=/")  # the task may not set the platform's cookie
        self.send_header("Set-Cookie", "_xsrf=abc; Path=/")
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


class Platform:
    def __init__(self, tmp: Path) -> None:
        self.engine = make_engine(f"sqlite:///{tmp}/p.db")
        migrate(self.engine)
        self.plane = ControlPlane(session_factory(self.engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                                  tmp / "logs")
        directory = Directory(self.plane.sessions)
        p = Principals(directory, ["default"])
        directory.create_group("team-b", virtual_clusters=["vc1"])
        self.headers = {"alice": bearer(p.user("alice")), "eve": bearer(p.user("eve")),
                        "bob": bearer(p.user("bob", groups=("team-b",))), "admin": bearer(p.admin()),
                        "agent": bearer(p.agent(CAROL)), "bridge": bearer(p.service("bridge"))}
        self.client = TestClient(create_app(self.plane, AlertReceiver(self.plane, ActionsConfig(), notifiers={})))
        self.client.__enter__()
        job = minimal_job("nb", **{"taskRoles.train.resourcePerInstance.ports": {"http": 1, "ws": 1},
                                   "taskRoles.train.commands": ["sleep 600"]})
        r = self.client.post("/api/v2/jobs", content=yaml.safe_dump(job), headers=self.headers["alice"])
        assert r.status_code == 202, r.text
        self.job = r.json()["id"]
        self.report([])
        assert self.client.post("/api/v2/scheduler/cycle", headers=self.headers["admin"]).status_code == 200
        r = self.client.get(f"/api/v2/nodes/{CAROL}/assignments", headers=self.headers["agent"])
        (self.launch,) = [a["launch"] for a in r.json()["assignments"]]
        self.run_id = self.launch["run_id"]
        self.ports = task_ports(self.run_id, ["http", "ws"])
        self.base = f"/api/v2/jobs/{self.job}/proxy/train/0"

    def report(self, runs: list[dict]) -> None:
        r = self.client.post(f"/api/v2/nodes/{CAROL}/status", headers=self.headers["agent"],
                             json={"agentId": "t", "gpus": 1, "simulatedGpus": True, "runs": runs})
        assert r.status_code == 200, r.text

    def running(self) -> None:
        self.report([{"run_id": self.run_id, "state": "running", "pid": 1, "started_at": 1.0}])

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.engine.dispose()


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[Platform]:
    p = Platform(tmp_path)
    yield p
    p.close()


@pytest.fixture
def task_http(platform: Platform) -> Iterator[list[dict[str, Any]]]:
    Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", platform.ports["http"]), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield Recorder.seen
    server.shutdown()
    server.server_close()


@pytest.fixture
def task_ws(platform: Platform) -> Iterator[list[dict[str, str]]]:
    seen: list[dict[str, str]] = []

    def echo(conn: ServerConnection) -> None:
        seen.append({"path": conn.request.path, **{k.lower(): v for k, v in conn.request.headers.raw_items()}}
                    if conn.request else {})
        for message in conn:
            conn.send(message)

    server = serve(echo, "127.0.0.1", platform.ports["ws"], subprotocols=None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield seen
    server.shutdown()


def test_the_owner_reaches_the_tasks_port_and_the_task_never_sees_the_platform_token(platform, task_http) -> None:
    platform.running()
    alice = platform.headers["alice"]
    token = alice["Authorization"].split()[1]
    port = platform.ports["http"]
    r = platform.client.post(f"{platform.base}/{port}/api/contents?x=1", content=b"hello",
                             headers={**alice, "Cookie": f"{COOKIE}={token}; _xsrf=abc"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["method"] == "POST" and got["body"] == "hello"
    assert got["path"] == f"{platform.base}/{port}/api/contents?x=1"  # the path as it came: the app's base URL
    assert token not in json.dumps(got)  # neither the header nor the cookie reached the task
    assert got["headers"]["authorization"] == f"token {platform.launch['env'][SECRET_ENV]}"
    assert got["headers"]["cookie"] == "_xsrf=abc"  # the task's own cookie passes
    assert [c for c in r.headers.get_list("set-cookie") if c.startswith(COOKIE)] == []  # dropped
    # By name, every method.
    for method in ("GET", "PUT", "PATCH", "DELETE"):
        r = platform.client.request(method, f"{platform.base}/http/x", headers=alice)
        assert r.status_code == 200 and r.json()["method"] == method
    secret = platform.launch["env"][SECRET_ENV]
    job = platform.client.get(f"/api/v2/jobs/{platform.job}", headers=alice).json()
    assert len(secret) == 64 and secret not in str(job)


def test_a_token_in_the_query_becomes_a_cookie_for_that_jobs_proxy_path(platform, task_http) -> None:
    platform.running()
    token = platform.headers["alice"]["Authorization"].split()[1]
    c = platform.client
    r = c.get(f"{platform.base}/http/lab?token={token}&tab=1", follow_redirects=False)
    assert r.status_code == 303, r.text
    assert r.headers["location"] == f"{platform.base}/http/lab?tab=1"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}={token};")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and f"Path=/api/v2/jobs/{platform.job}/proxy/" in cookie
    assert task_http == []  # the redirect is the proxy's own answer
    r = c.get(r.headers["location"], headers={"Cookie": f"{COOKIE}={token}"})
    assert r.status_code == 200 and token not in r.text
    # A ``token`` that is no platform token is the task's own: forwarded with the cookie's caller.
    r = c.get(f"{platform.base}/http/api?token=jupyters-own", headers={"Cookie": f"{COOKIE}={token}"})
    assert r.status_code == 200 and r.json()["path"].endswith("?token=jupyters-own")
    c.cookies.clear()  # the client kept the cookie of the redirect, as a browser does
    assert c.get(f"{platform.base}/http/api?token=jupyters-own").status_code == 401


@pytest.mark.parametrize(("who", "status"), [("anonymous", 401), ("eve", 403), ("bob", 404), ("admin", 403),
                                             ("bridge", 403), ("agent", 403)])
def test_nobody_but_the_owner(platform, task_http, who: str, status: int) -> None:
    platform.running()
    headers = platform.headers.get(who, {})
    r = platform.client.get(f"{platform.base}/http/", headers=headers)
    assert r.status_code == status, r.text
    token = headers.get("Authorization", "x y").split()[1]
    r = platform.client.get(f"{platform.base}/http/?token={token}", follow_redirects=False)
    assert r.status_code == (401 if who == "anonymous" else status)
    assert task_http == []


def test_only_the_instances_named_ports_while_it_runs(platform, task_http) -> None:
    c, alice = platform.client, platform.headers["alice"]
    r = c.get(f"{platform.base}/http/", headers=alice)
    assert r.status_code == 409 and "STARTING" in r.json()["message"]
    platform.running()
    other = next(p for p in range(20000, 32000) if p not in platform.ports.values())
    for port in (str(other), "22", "ssh", "8470"):
        r = c.get(f"{platform.base}/{port}/", headers=alice)
        assert r.status_code == 403 and "named ports: http=" in r.json()["message"], (port, r.text)
    assert c.get(f"/api/v2/jobs/{platform.job}/proxy/train/1/http/", headers=alice).status_code == 404
    assert c.get(f"/api/v2/jobs/{platform.job}/proxy/eval/0/http/", headers=alice).status_code == 404
    assert c.get("/api/v2/jobs/alice~nope/proxy/train/0/http/", headers=alice).status_code == 404
    assert task_http == []


def test_a_task_that_does_not_listen_is_a_502(platform) -> None:
    platform.running()
    r = platform.client.get(f"{platform.base}/http/", headers=platform.headers["alice"])
    assert r.status_code == 502 and r.json()["code"] == "BadGatewayError"


def test_a_websocket_round_trip_through_the_proxy(platform, task_ws) -> None:
    platform.running()
    c, alice = platform.client, platform.headers["alice"]
    token = alice["Authorization"].split()[1]
    with c.websocket_connect(f"{platform.base}/ws/api/kernels/1/channels?session=s", headers=alice) as ws:
        ws.send_text("hello")
        assert ws.receive_text() == "hello"
        ws.send_bytes(b"\x00\x01")
        assert ws.receive_bytes() == b"\x00\x01"
    with c.websocket_connect(f"{platform.base}/ws/x?token={token}") as ws:  # the query's token, stripped
        ws.send_text("again")
        assert ws.receive_text() == "again"
    first, second = task_ws
    assert first["path"] == f"{platform.base}/ws/api/kernels/1/channels?session=s"
    assert second["path"] == f"{platform.base}/ws/x"
    for seen in task_ws:
        assert token not in json.dumps(seen)
        assert seen["authorization"] == f"token {platform.launch['env'][SECRET_ENV]}"
        assert "origin" not in seen
    for who, status in (("eve", 403), ("bob", 404), ("admin", 403)):
        with pytest.raises(WebSocketDenialResponse) as denied:
            c.websocket_connect(f"{platform.base}/ws/x", headers=platform.headers[who]).__enter__()
        assert denied.value.status_code == status
    with pytest.raises(WebSocketDenialResponse) as denied:
        c.websocket_connect(f"{platform.base}/ws/x").__enter__()
    assert denied.value.status_code == 401
    assert len(task_ws) == 2
