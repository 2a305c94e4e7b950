"""Writes the README's who-may-do-what table does not give, each found by an attacker on a running
platform: a user attaching their job to another user's Prefect flow run, users and the bridge
opening incidents, the bridge submitting as an admin, the last admin deleted, and refused
submissions spending a user's submission budget.

The platform is tests/api/test_authz.py's :class:`World` (Lab 6's two VCs; alice's running job
``alice~secret-train`` in VC default; eve shares VC default, bob has VC vc1; ``root`` is the admin).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.api.test_authz import CONFIG, JOB, World, secret_job
from tests.support.auth import Principals, bearer

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.response.config import ResponseConfig
from apiary.settings import Settings
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

RUN = "8c1a2b3c-0000-4000-8000-00000000a11c"  # alice's job's flow run
OTHER = "8c1a2b3c-0000-4000-8000-0000000000b0"
YAML = {"Content-Type": "text/yaml"}


@pytest.fixture
def world(tmp_path: Path):
    w = World(tmp_path)
    yield w
    w.close()


def _flow_run(w: World, job: str) -> str | None:
    return w.client.get(f"/api/v2/jobs/{job}", headers=w.headers["admin"]).json()["flowRunId"]


def _jobs(w: World) -> set[str]:
    return {j["id"] for j in w.client.get("/api/v2/jobs", headers=w.headers["admin"]).json()}


# --------------------------------------------------------------------------- flow-run links


def test_a_user_cannot_attach_a_job_to_another_users_flow_run(world: World) -> None:
    """The hijack: bob (or eve, who may read alice's job and its flowRunId) submits or clones with
    ``X-Apiary-Flow-Run-Id`` = alice's run. Was 202, and the run then showed bob's job."""
    c, h = world.client, world.headers
    assert c.put(f"/api/v2/jobs/{JOB}/flowRun", json={"id": RUN}, headers=h["bridge"]).status_code == 204
    assert c.get(f"/api/v2/jobs/{JOB}", headers=h["eve"]).json()["flowRunId"] == RUN  # readable by her VC
    before = _jobs(world)
    r = c.post("/api/v2/jobs", content=secret_job("hijack", vc="vc1"),
               headers={**h["bob"], **YAML, "X-Apiary-Flow-Run-Id": RUN})
    assert r.status_code == 403, r.text
    assert "X-Apiary-Flow-Run-Id" in r.json()["message"] and "user bob" in r.json()["message"]
    assert c.post("/api/v2/jobs", content=secret_job("mine", vc="vc1"), headers={**h["bob"], **YAML}).status_code == 202
    r = c.post("/api/v2/jobs/bob~mine/clone", headers={**h["bob"], "X-Apiary-Flow-Run-Id": RUN})
    assert r.status_code == 403, r.text
    r = c.post("/api/v2/jobs", content=secret_job("eve-hijack"), headers={**h["eve"], **YAML,
                                                                            "X-Apiary-Flow-Run-Id": RUN})
    assert r.status_code == 403
    # A user may not attach even their own job to a run by header (only the bridge links runs).
    r = c.post("/api/v2/jobs", content=secret_job("own"), headers={**h["alice"], **YAML, "X-Apiary-Flow-Run-Id": OTHER})
    assert r.status_code == 403
    assert _jobs(world) == before | {"bob~mine"}
    assert {j for j in _jobs(world) if _flow_run(world, j) == RUN} == {JOB}


def test_a_flow_run_another_job_holds_is_refused_even_for_the_bridge_and_admins(world: World) -> None:
    c, h = world.client, world.headers
    assert c.put("/api/v2/flowRuns", json={"links": [{"jobId": JOB, "flowRunId": RUN}]},
                 headers=h["bridge"]).status_code == 200
    r = c.post("/api/v2/jobs", content=secret_job("b1", vc="vc1"),
               headers={**h["bridge"], **YAML, "X-Apiary-On-Behalf-Of": "bob", "X-Apiary-Flow-Run-Id": RUN})
    assert r.status_code == 409 and r.json()["code"] == "ConflictFlowRunError", r.text
    assert RUN in r.json()["message"] and JOB in r.json()["message"]
    r = c.post("/api/v2/jobs", content=secret_job("a1"), headers={**h["admin"], **YAML, "X-Apiary-Flow-Run-Id": RUN})
    assert r.status_code == 409
    assert c.post("/api/v2/jobs", content=secret_job("b2", vc="vc1"), headers={**h["bob"], **YAML}).status_code == 202
    for who in ("bridge", "admin"):
        r = c.put("/api/v2/jobs/bob~b2/flowRun", json={"id": RUN}, headers=h[who])
        assert r.status_code == 409 and r.json()["code"] == "ConflictFlowRunError"
        # A batch with one bad link records none of it.
        r = c.put("/api/v2/flowRuns", json={"links": [{"jobId": "bob~b2", "flowRunId": OTHER},
                                                      {"jobId": "bob~b2", "flowRunId": RUN}]}, headers=h[who])
        assert r.status_code == 409  # the later link of a job wins (one key per job): RUN, held
        r = c.put("/api/v2/flowRuns", json={"links": [{"jobId": "bob~b2", "flowRunId": RUN}]}, headers=h[who])
        assert r.status_code == 409
        # A clone of an unrelated job cannot take the run either.
        r = c.post("/api/v2/jobs/bob~b2/clone", headers={**h[who], "X-Apiary-Flow-Run-Id": RUN})
        assert r.status_code == 409
    assert _flow_run(world, "bob~b2") is None and _flow_run(world, JOB) == RUN
    # Two jobs in one batch cannot take one free run.
    assert c.post("/api/v2/jobs", content=secret_job("b3", vc="vc1"), headers={**h["bob"], **YAML}).status_code == 202
    r = c.put("/api/v2/flowRuns", json={"links": [{"jobId": "bob~b2", "flowRunId": OTHER},
                                                  {"jobId": "bob~b3", "flowRunId": OTHER}]}, headers=h["bridge"])
    assert r.status_code == 409 and _flow_run(world, "bob~b2") is None and _flow_run(world, "bob~b3") is None
    # Re-recording the same link is idempotent, and a free run is fine.
    assert c.put(f"/api/v2/jobs/{JOB}/flowRun", json={"id": RUN}, headers=h["bridge"]).status_code == 204
    assert c.put("/api/v2/jobs/bob~b2/flowRun", json={"id": OTHER}, headers=h["bridge"]).status_code == 204


def test_retry_attaches_the_copy_to_its_sources_run(world: World) -> None:
    """Retry in the Prefect UI (apiary.tracking.portal): the bridge clones the job with the run it
    belongs to; the copy shares that run, the source keeps it (a second Retry finds it there)."""
    c, h = world.client, world.headers
    assert c.put(f"/api/v2/jobs/{JOB}/flowRun", json={"id": RUN}, headers=h["bridge"]).status_code == 204
    for n in (1, 2):
        r = c.post(f"/api/v2/jobs/{JOB}/clone", headers={**h["bridge"], "X-Apiary-Flow-Run-Id": RUN})
        assert r.status_code == 202, r.text
        assert r.json()["id"] == f"{JOB}-retry{n}" and r.json()["flowRunId"] == RUN
    assert _flow_run(world, JOB) == RUN
    # The submit-yaml run resubmitting its own job (the name is taken): 409 as before.
    r = c.post("/api/v2/jobs", content=secret_job(), headers={**h["bridge"], **YAML, "X-Apiary-On-Behalf-Of": "alice",
                                                              "X-Apiary-Flow-Run-Id": RUN})
    assert r.status_code == 409


# --------------------------------------------------------------------------- the README's table


def test_incidents_are_opened_by_admins_alertmanager_and_the_on_call_only(world: World) -> None:
    """Opening an incident pages people (Sev1: phone): any user and the bridge could, naming
    other users' jobs."""
    c, h = world.client, world.headers
    body = {"title": "fake outage", "severity": "sev1", "jobs": [JOB]}
    for who in ("alice", "eve", "bob", "bridge", "agent-carol"):
        r = c.post("/api/v2/incidents", json=body, headers=h[who])
        assert r.status_code == 403, (who, r.text)
    assert c.get("/api/v2/incidents", headers=h["admin"]).json()["incidents"] == []
    for who in ("admin", "alertmanager"):
        assert c.post("/api/v2/incidents", json={"title": who}, headers=h[who]).status_code == 201
    # eve is on call in a schedule; bob is a tier's user target: both may open one.
    c.app.state.incidents.config = ResponseConfig.parse({
        "schedules": [{"name": "primary", "layers": [{"name": "l", "users": ["eve"], "rotation": "weekly",
                                                      "start": "2026-01-05T09:00:00+00:00", "time_zone": "UTC"}]}],
        "policies": [{"name": "p", "tiers": [{"level": 1, "targets": [{"schedule": "primary"}], "delay_min": 5},
                                             {"level": 2, "targets": [{"user": "bob"}], "delay_min": 5}]}]})
    for who in ("eve", "bob"):
        r = c.post("/api/v2/incidents", json={"title": f"by {who}"}, headers=h[who])
        assert r.status_code == 201 and r.json()["timeline"][0]["actor"] == who, r.text
    assert c.post("/api/v2/incidents", json=body, headers=h["alice"]).status_code == 403


def test_the_bridge_submits_on_behalf_of_ordinary_users_only(world: World) -> None:
    c, h = world.client, world.headers
    Directory(world.plane.sessions).create_user("alertmanager", groups=["default"])  # a user named like a service
    for name in ("root", "alertmanager", "bridge"):
        r = c.post("/api/v2/jobs", content=secret_job(f"as-{name}"),
                   headers={**h["bridge"], **YAML, "X-Apiary-On-Behalf-Of": name})
        assert r.status_code == 403, (name, r.text)
        assert name in r.json()["message"]
    assert not {j for j in _jobs(world) if j.startswith(("root~", "alertmanager~", "bridge~"))}
    r = c.post("/api/v2/jobs", content=secret_job("ok"),
               headers={**h["bridge"], **YAML, "X-Apiary-On-Behalf-Of": "eve"})
    assert r.status_code == 202 and r.json()["id"] == "eve~ok"


def test_the_last_admin_stays(world: World) -> None:
    c, h = world.client, world.headers
    for method, path in (("DELETE", "/api/v2/users/root"), ("DELETE", "/api/v2/groups/admin/members/root"),
                         ("DELETE", "/api/v2/groups/admin")):
        r = c.request(method, path, headers=h["admin"])
        assert r.status_code == 409, (path, r.text)
        assert r.json()["code"] == "LastAdminError" and "no admin" in r.json()["message"]
    assert c.get("/api/v2/me", headers=h["admin"]).json()["admin"] is True
    assert [u["name"] for u in c.get("/api/v2/users", headers=h["admin"]).json() if u["admin"]] == ["root"]
    # With a second admin, the first may go (in any of the three ways).
    assert c.put("/api/v2/groups/admin/members/alice", headers=h["admin"]).status_code == 200
    assert c.delete("/api/v2/groups/admin/members/root", headers=h["admin"]).status_code == 200
    r = c.delete("/api/v2/groups/admin/members/alice", headers=h["alice"])
    assert r.status_code == 409 and r.json()["code"] == "LastAdminError"
    assert c.delete("/api/v2/users/root", headers=h["alice"]).status_code == 204
    assert c.delete("/api/v2/users/alice", headers=h["alice"]).status_code == 409


# --------------------------------------------------------------------------- limits and error codes


def test_refused_submissions_cost_no_submission_budget(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/r.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(CONFIG), tmp_path / "logs")
    directory = Directory(plane.sessions)
    p = Principals(directory, ["default"])
    directory.create_group("team-b", virtual_clusters=["vc1"])
    bob, bridge = bearer(p.user("bob", groups=("team-b",))), bearer(p.service("bridge"))
    settings = Settings(rate_calls="1000/minute", rate_submits="2/hour")
    with TestClient(create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}), settings=settings)) as c:
        refused = [
            c.post("/api/v2/jobs", content=secret_job("r1"), headers={**bob, **YAML}),  # 403: VC default
            c.post("/api/v2/jobs", content=b"name: [", headers={**bob, **YAML}),  # 400: not YAML
            c.post("/api/v2/jobs", content=secret_job("r2", vc="nope"), headers={**bob, **YAML}),  # 400: no VC
            c.post("/api/v2/jobs", content=secret_job("r3", vc="vc1"),
                   headers={**bob, **YAML, "X-Apiary-Flow-Run-Id": OTHER}),  # 403: no links by users
            c.post("/api/v2/jobs", content=secret_job("r4"),
                   headers={**bridge, **YAML, "X-Apiary-On-Behalf-Of": "bob"}),  # 403, on behalf
        ]
        assert [r.status_code for r in refused] == [403, 400, 400, 403, 403], [r.text for r in refused]
        ok = [c.post("/api/v2/jobs", content=secret_job(f"ok{i}", vc="vc1"), headers={**bob, **YAML}) for i in (1, 2)]
        assert [r.status_code for r in ok] == [202, 202], [r.text for r in ok]
        taken = c.post("/api/v2/jobs", content=secret_job("ok1", vc="vc1"), headers={**bob, **YAML})
        assert taken.status_code == 429  # the budget is spent: checked before the name
        # A copy is a submission of the job's owner too.
        r = c.post("/api/v2/jobs/bob~ok1/clone", headers=bob)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        r = c.post("/api/v2/jobs/bob~ok1/clone", headers=bridge)
        assert r.status_code == 429
    engine.dispose()


def test_error_codes_name_what_is_missing(world: World) -> None:
    c, h = world.client, world.headers
    r = c.post("/api/v2/jobs", content=secret_job("x"),
               headers={**h["bridge"], **YAML, "X-Apiary-On-Behalf-Of": "nobody"})
    assert r.status_code == 404 and r.json()["code"] == "NoUserError" and "nobody" in r.json()["message"]
    for method, path, code in (("GET", "/api/v2/users/nobody", "NoUserError"),
                               ("DELETE", "/api/v2/users/nobody", "NoUserError"),
                               ("DELETE", "/api/v2/groups/nope", "NoGroupError"),
                               ("PUT", "/api/v2/groups/nope/members/alice", "NoGroupError"),
                               ("PUT", "/api/v2/groups/team-b/members/nobody", "NoUserError"),
                               ("PUT", "/api/v2/groups/team-b/virtualClusters/nope", "NoVirtualClusterError"),
                               ("DELETE", "/api/v2/tokens/000000000000", "NoTokenError"),
                               ("GET", "/api/v2/jobs/alice~nope", "NoJobError"),
                               ("GET", "/api/v2/incidents/999999", "NoIncidentError")):
        r = c.request(method, path, headers=h["admin"])
        assert (r.status_code, r.json()["code"]) == (404, code), (path, r.text)
    r = c.post("/api/v2/users", json={"username": "alice"}, headers=h["admin"])
    assert (r.status_code, r.json()["code"]) == (409, "ConflictUserError")


def test_two_admins_removing_each_other_at_once_leave_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last-admin check and the delete are one step: with the check's read slowed down, two
    deletes that each see the other admin still there would otherwise both commit."""
    import threading
    import time

    from apiary.auth import directory as directory_module
    from apiary.errors import LastAdminError

    engine = make_engine(f"sqlite:///{tmp_path}/admins.db")
    migrate(engine)
    directory = Directory(session_factory(engine))
    directory.create_group("admins", admin=True)
    for name in ("root", "alice"):
        directory.create_user(name, groups=["admins"])
    read = directory_module._admin_memberships

    def slow_read(s):  # noqa: ANN001, ANN202 - the session, the rows
        rows = read(s)
        time.sleep(0.3)
        return rows

    monkeypatch.setattr(directory_module, "_admin_memberships", slow_read)
    refused: list[str] = []

    def delete(name: str) -> None:
        try:
            directory.delete_user(name)
        except LastAdminError:
            refused.append(name)

    threads = [threading.Thread(target=delete, args=(n,)) for n in ("root", "alice")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert len(refused) == 1
    assert [u["name"] for u in directory.list_users()] == refused
    engine.dispose()
