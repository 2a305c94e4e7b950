"""Who may call what: every route x every principal, and the seven holes of issue 10.

The platform: Lab 6's two-VC cluster (VC ``default`` = hostname-carol, VC ``vc1`` = hostname-dan).
Principals, each with a real token from :class:`apiary.auth.Directory`:

* anonymous (no token), ``alice`` and ``eve`` (group ``default``: VC default), ``bob`` (group
  ``team-b``: VC vc1), ``root`` (group ``admin``);
* the agent of hostname-carol (the node running alice's job) and of hostname-dan (another node);
* the Alertmanager and Prefect bridge service tokens.

alice's job ``alice~secret-train`` carries a planted secret and runs on hostname-carol.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6, job_text

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.settings import Settings
from apiary.spec.cluster import load_cluster_config
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
        self.client = TestClient(create_app(self.plane, AlertReceiver(self.plane, ActionsConfig(), notifiers={})))
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
        self.client.__exit__(None, None, None)
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


# (method, path, keyword arguments for the request (a function of the principal), expected status
# per principal; principals not named expect ``rest``).
Body = Callable[[str, "World"], dict]
ALL_200 = dict.fromkeys(PRINCIPALS, 200)
PEOPLE = {"alice": 200, "eve": 200, "bob": 200, "admin": 200, "bridge": 200}
MACHINES_403 = {"agent-carol": 403, "agent-dan": 403, "alertmanager": 403}


def row(method: str, path: str, expect: dict[str, int], rest: int = 403, body: Body | None = None,
        id: str | None = None):  # noqa: A002 - pytest's name
    full = {p: expect.get(p, 401 if p == "anonymous" else rest) for p in PRINCIPALS}
    return pytest.param(method, path, body or (lambda who, w: {}), full, id=id or f"{method} {path}")


ROUTES = [
    row("GET", "/healthz", ALL_200),
    row("GET", "/metrics", ALL_200),
    row("GET", "/openapi.json", ALL_200),
    row("GET", "/api/v2/me", {**PEOPLE, "agent-carol": 200, "agent-dan": 200, "alertmanager": 200}),
    row("POST", "/api/v2/jobs", {"alice": 202, "eve": 202, "admin": 202, "bob": 403},
        body=lambda who, w: {"content": secret_job(f"m-{who}"), "headers": {"Content-Type": "text/yaml"}},
        id="POST /api/v2/jobs (VC default)"),
    row("POST", "/api/v2/jobs", {"bob": 202, "admin": 202, "alice": 403, "eve": 403},
        body=lambda who, w: {"content": secret_job(f"v-{who}", vc="vc1"), "headers": {"Content-Type": "text/yaml"}},
        id="POST /api/v2/jobs (VC vc1)"),
    row("POST", "/api/v2/jobs", {"bridge": 202, "alice": 403, "admin": 403, "bob": 403, "eve": 403},
        body=lambda who, w: {"content": secret_job(f"b-{who}"),
                          "headers": {"Content-Type": "text/yaml", "X-Apiary-On-Behalf-Of": "alice"}},
        id="POST /api/v2/jobs on behalf of alice"),
    row("GET", "/api/v2/jobs", PEOPLE),
    row("GET", f"/api/v2/jobs/{JOB}", {**PEOPLE, "bob": 404}),
    row("PUT", f"/api/v2/jobs/{JOB}/flowRun", {"admin": 204, "bridge": 204, "bob": 403},
        body=lambda who, w: {"json": {"id": "8c1a2b3c-0000-4000-8000-000000000001"}}),
    row("POST", "/api/v2/logs/query", {"admin": 200, "bridge": 200, "alice": 403, "bob": 403},
        body=lambda who, w: {"json": {"reads": [
            {"jobId": JOB, "taskRole": "train", "index": 0, "attempt": 0, "stream": "stdout"}]}}),
    row("PUT", "/api/v2/flowRuns", {"admin": 200, "bridge": 200, "bob": 403},
        body=lambda who, w: {"json": {"links": [{"jobId": JOB, "flowRunId": "8c1a2b3c-0000-4000-8000-000000000003"}]}}),
    row("POST", f"/api/v2/jobs/{JOB}/clone", {"alice": 202, "admin": 202, "bridge": 202, "eve": 403, "bob": 404}),
    row("GET", f"/api/v2/jobs/{JOB}/logs", {"alice": 200, "admin": 200, "bridge": 200, "eve": 403, "bob": 404}),
    row("GET", "/api/v2/events", PEOPLE),
    row("POST", "/api/v2/scheduler/cycle", {"admin": 200, "bridge": 200}),
    row("GET", "/api/v2/cluster/status", PEOPLE),
    row("GET", "/api/v2/cluster/consistency", {"admin": 200}),
    row("PUT", "/api/v2/cluster/config", {"admin": 200},
        body=lambda who, w: {"content": CONFIG.read_bytes(), "headers": {"Content-Type": "text/yaml"}}),
    row("GET", "/api/v2/nodes", {**PEOPLE, "agent-carol": 200, "agent-dan": 200, "alertmanager": 200}),
    row("PUT", f"/api/v2/nodes/{DAN}/cordon", {"admin": 200}, body=lambda who, w: {"json": {"value": False}}),
    row("POST", f"/api/v2/nodes/{DAN}/faults", {"admin": 200}, body=lambda who, w: {"json": {"gpu": 0, "temp": 50}}),
    row("POST", f"/api/v2/nodes/{CAROL}/status", {"agent-carol": 200},
        body=lambda who, w: {"json": {"agentId": "t", "gpus": 1, "simulatedGpus": True, "runs": []}}),
    row("GET", f"/api/v2/nodes/{CAROL}/assignments", {"agent-carol": 200}),
    row("POST", f"/api/v2/nodes/{CAROL}/logs", {"agent-carol": 200},
        body=lambda who, w: {"params": {"runId": w.run_id, "stream": "stdout", "offset": 0}, "content": b""}),
    row("POST", "/api/v2/alerts/webhook", {"alertmanager": 200, "admin": 200}, body=lambda who, w: {"json": _alert()}),
    row("POST", "/api/v2/alerts/webhook?action=stop-job", {"admin": 200, "alertmanager": 403},
        body=lambda who, w: {"json": _alert("ApiaryTestAlert2")}),
    row("GET", "/api/v2/alerts", {"admin": 200}),
    row("GET", "/api/v2/users", {"admin": 200}),
    row("POST", "/api/v2/users", {"admin": 201}, body=lambda who, w: {"json": {"username": f"new-{who}"}}),
    row("GET", "/api/v2/users/alice", {"admin": 200, "alice": 200}),
    row("GET", "/api/v2/groups", {"admin": 200}),
    row("POST", "/api/v2/groups", {"admin": 201}, body=lambda who, w: {"json": {"groupname": f"g-{who}"}}),
    row("PUT", "/api/v2/groups/team-b/members/eve", {"admin": 200}),
    row("PUT", "/api/v2/groups/team-b/virtualClusters/vc1", {"admin": 200}),
    row("POST", "/api/v2/tokens", {"alice": 201, "eve": 201, "bob": 201, "admin": 201},
        body=lambda who, w: {"json": {}}),
    row("POST", "/api/v2/tokens", {"admin": 201},
        body=lambda who, w: {"json": {"kind": "agent", "subject": DAN}}, id="POST /api/v2/tokens (agent)"),
    row("GET", "/api/v2/tokens", PEOPLE),
    row("POST", "/api/v2/drills/results", {"admin": 200, "bridge": 200},
        body=lambda who, w: {"json": {"drill": "inspection", "result": "passed", "startedAt": 1.0, "finishedAt": 2.0}}),
    row("GET", "/api/v2/drills", PEOPLE),
    # GitHub's webhook takes no token: unsigned (and the intake unconfigured here), 401 for everyone.
    row("POST", "/api/v2/ci/webhooks/github", {}, rest=401,
        body=lambda who, w: {"json": {"zen": "x"}, "headers": {"X-GitHub-Event": "ping", "X-GitHub-Delivery": "d"}}),
    row("GET", "/api/v2/ci/deliveries", {"admin": 200}),
    # CI/CD records: the flows write with the service token (or an admin's); admins read.
    row("POST", "/api/v2/ci/runs", {"admin": 201, "bridge": 201},
        body=lambda who, w: {"json": {"flowRunId": f"authz-{who}", "repo": "acme/apiary", "sha": "a" * 40,
                                      "ref": "refs/heads/main", "kind": "deploy", "result": "running",
                                      "startedAt": "2026-11-25T10:00:00Z"}}),
    row("GET", "/api/v2/ci/runs", {"admin": 200, "bridge": 200}),
    row("POST", "/api/v2/deployments", {"admin": 201, "bridge": 201},
        body=lambda who, w: {"json": {"sha": "b" * 40, "images": {"agent": "reg/agent:b"}, "actor": who,
                                      "trigger": "push", "startedAt": "2026-11-25T10:00:00Z",
                                      "finishedAt": "2026-11-25T10:01:00Z", "result": "succeeded"}}),
    row("GET", "/api/v2/deployments", {"admin": 200}),
]


@pytest.mark.parametrize(("method", "path", "body", "expect"), ROUTES)
def test_every_route_for_every_principal(shared: World, method: str, path: str, body: Body,
                                         expect: dict[str, int]) -> None:
    got = {}
    for who in PRINCIPALS:
        kw = body(who, shared)
        headers = {**kw.pop("headers", {}), **shared.headers[who]}
        got[who] = shared.client.request(method, path, headers=headers, **kw).status_code
    assert got == expect


def test_the_route_table_covers_every_route(shared: World) -> None:
    """A route added without a row here fails this test."""
    tested = {(p.values[0], p.values[1].split("?")[0]) for p in ROUTES}
    app = shared.client.app
    missing = []
    for route in app.routes:
        for method in getattr(route, "methods", set()) - {"HEAD", "OPTIONS"}:
            path = route.path
            if path.startswith(("/docs", "/redoc")):
                continue
            candidates = {t for t in tested if t[0] == method and _matches(path, t[1])}
            if not candidates and path not in ("/api/v2/users/{name}", "/api/v2/groups/{name}",
                                               "/api/v2/tokens/{token_id}", "/api/v2/groups/{name}/members/{user}",
                                               "/api/v2/groups/{name}/virtualClusters/{vc}"):
                missing.append(f"{method} {path}")
    assert missing == []


def _matches(template: str, path: str) -> bool:
    t, p = template.strip("/").split("/"), path.strip("/").split("/")
    return len(t) == len(p) and all(a == b or a.startswith("{") for a, b in zip(t, p, strict=True))


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
