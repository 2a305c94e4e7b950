"""CI/CD records: ``POST/GET /api/v2/ci/runs`` and ``/api/v2/deployments`` (apiary.api.routers.ci_records,
apiary.ci.records), on SQLite and on PostgreSQL (``postgres`` marker; the store that refuses a NUL).

Who may call them, the 400 that names each bad field, the upsert on the flow run id, the filters,
the order (newest first) and the limits; and that the store clips what a caller that bypasses the
API hands it. Each test gets a fresh store and a real app with real tokens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tests.pg import create_database, start_postgres_or_skip
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6

from apiary.api import create_app
from apiary.auth import Directory
from apiary.ci.records import CiRecords
from apiary.control import ControlPlane
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

RUNS, DEPLOYS = "/api/v2/ci/runs", "/api/v2/deployments"
SHA_A, SHA_B = "a1" * 20, "b2" * 20


def a_run(flow_run_id: str = "fr-1", **changes: Any) -> dict[str, Any]:
    """A pipeline run as the flow posts it (builder: keyword arguments replace fields)."""
    return {"flowRunId": flow_run_id, "repo": "acme/apiary", "prNumber": 7, "sha": SHA_A, "ref": "refs/pull/7/head",
            "kind": "pr", "result": "running", "startedAt": "2026-11-25T10:00:00Z",
            "stages": [{"name": "lint", "state": "running"}], **changes}


def finished_run(flow_run_id: str = "fr-1", result: str = "success", **changes: Any) -> dict[str, Any]:
    stages = [{"name": "lint", "state": "passed", "durationS": 12.5, "summary": "ruff: clean"},
              {"name": "unit", "state": "passed" if result == "success" else "failed", "durationS": 200.0,
               "summary": "1 failed" if result != "success" else "812 passed"},
              {"name": "build", "state": "skipped" if result != "success" else "passed",
               "durationS": None if result != "success" else 95.0}]
    fields = {"result": result, "finishedAt": "2026-11-25T10:05:00Z", "stages": stages,
              "failedStage": None if result == "success" else "unit",
              "targetUrl": "http://127.0.0.1:4200/flow-runs/flow-run/fr"}
    return a_run(flow_run_id, **{**fields, **changes})


def a_deployment(**changes: Any) -> dict[str, Any]:
    images = {"control-plane": "reg/apiary-control-plane:b2b2", "agent": "reg/apiary-agent:b2b2",
              "prefect": "reg/apiary-prefect:b2b2"}
    previous = {k: v.replace("b2b2", "a1a1") for k, v in images.items()}
    return {"sha": SHA_B, "images": images, "previousImages": previous, "actor": "alice", "trigger": "push",
            "startedAt": "2026-11-25T11:00:00Z", "finishedAt": "2026-11-25T11:03:20Z", "result": "succeeded",
            "reason": None, "steps": [{"component": "control-plane", "image": images["control-plane"],
                                       "gate": "healthz", "ok": True, "detail": "200", "durationS": 40.0}],
            "flowRunId": None, **changes}


@dataclass
class Platform:
    client: TestClient
    headers: dict[str, dict[str, str]]
    plane: ControlPlane
    dialect: str

    def post(self, path: str, body: dict, who: str = "bridge") -> Any:
        # json.dumps escapes a lone surrogate as "\\ud800", as a hostile client would send it
        return self.client.post(path, content=json.dumps(body),
                                headers={**self.headers[who], "Content-Type": "application/json"})

    def get(self, path: str, who: str = "admin", **params: Any) -> Any:
        return self.client.get(path, params=params, headers=self.headers[who])


@pytest.fixture(scope="module")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, stop = start_postgres_or_skip(tmp_path_factory.mktemp("postgres"))
    try:
        yield url
    finally:
        stop()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def platform(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Platform]:
    """A fresh store (SQLite file, or a new database on the module's PostgreSQL server) under a real app."""
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        url = create_database(server, f"ci_{uuid.uuid4().hex[:16]}")
    else:
        url = f"sqlite:///{tmp_path}/a.db"
    engine = make_engine(url)
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    p = Principals(Directory(plane.sessions), ["default"])
    headers = {"anonymous": {}, "alice": bearer(p.user("alice")), "admin": bearer(p.admin()),
               "agent": bearer(p.agent("hostname-carol")), "bridge": bearer(p.service("bridge")),
               "alertmanager": bearer(p.service("alertmanager"))}
    with TestClient(create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}))) as client:
        yield Platform(client, headers, plane, engine.dialect.name)
    engine.dispose()


# ------------------------------------------------------------------------------ who may call

@pytest.mark.parametrize(("who", "write", "read_runs", "read_deploys"), [
    ("anonymous", 401, 401, 401), ("alice", 403, 403, 403), ("agent", 403, 403, 403),
    ("alertmanager", 403, 403, 403), ("bridge", 201, 200, 403), ("admin", 201, 200, 200),
])
def test_writes_are_for_admins_and_the_service_token_reads_for_admins(platform: Platform, who: str, write: int,
                                                                       read_runs: int, read_deploys: int) -> None:
    # The service token reads the runs: the deploy flow looks for a passing run of its commit.
    assert platform.post(RUNS, a_run(f"fr-{who}"), who).status_code == write
    assert platform.post(DEPLOYS, a_deployment(), who).status_code == write
    assert platform.get(RUNS, who).status_code == read_runs
    assert platform.get(DEPLOYS, who).status_code == read_deploys


def test_a_caller_without_a_token_gets_401_even_for_a_malformed_body(platform: Platform) -> None:
    r = platform.client.post(RUNS, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 401


# ------------------------------------------------------------------------------ validation

BAD_RUNS = [
    pytest.param({"kind": "nightly"}, "kind", id="kind not pr or deploy"),
    pytest.param({"result": "passed"}, "result", id="result not a run result"),
    pytest.param({"sha": "not-a-sha"}, "sha", id="sha not hex"),
    pytest.param({"sha": "a" * 65}, "sha", id="sha too long"),
    pytest.param({"repo": "no-owner"}, "repo", id="repo not owner/name"),
    pytest.param({"flowRunId": "x" * 65}, "flowRunId", id="flow run id too long"),
    pytest.param({"flowRunId": None}, "flowRunId", id="flow run id missing"),
    pytest.param({"prNumber": 2**40}, "prNumber", id="pr number overflows int32"),
    pytest.param({"ref": ""}, "ref", id="empty ref"),
    pytest.param({"startedAt": "yesterday"}, "startedAt", id="start not ISO 8601"),
    pytest.param({"startedAt": "1969-12-31T23:59:59Z"}, "startedAt", id="start before 1970"),
    pytest.param({"finishedAt": "2026-11-25T09:00:00Z"}, "finishedAt", id="finish before start"),
    pytest.param({"durationS": -1}, "durationS", id="negative duration"),
    pytest.param({"reason": "x" * 4001}, "reason", id="reason too long"),
    pytest.param({"reason": "nul \x00 here"}, "reason", id="NUL in reason"),
    pytest.param({"ref": "\ud800"}, "ref", id="lone surrogate in ref"),
    pytest.param({"failedStage": "s" * 101}, "failedStage", id="failed stage too long"),
    pytest.param({"stages": [{"name": "lint", "state": "green"}]}, "stages[0].state", id="bad stage state"),
    pytest.param({"stages": [{"name": "lint", "state": "passed", "summary": "\x00"}]}, "stages[0].summary",
                 id="NUL in a stage summary"),
    pytest.param({"stages": [{"name": "", "state": "passed"}]}, "stages[0].name", id="empty stage name"),
    pytest.param({"stages": [{"name": "a", "state": "passed", "colour": "red"}]}, "stages[0].colour",
                 id="unknown stage field"),
    pytest.param({"stages": [{"name": "s", "state": "passed"}] * 101}, "stages", id="too many stages"),
    pytest.param({"targetUrl": "javascript:alert(1)"}, "targetUrl", id="target url not http"),
    pytest.param({"branch": "main"}, "branch", id="unknown field"),
]


@pytest.mark.parametrize(("changes", "field"), BAD_RUNS)
def test_a_bad_run_is_a_400_naming_the_field_and_stores_nothing(platform: Platform, changes: dict,
                                                                 field: str) -> None:
    r = platform.post(RUNS, a_run(**changes))
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "InvalidParametersError" and r.json()["field"] == field, r.json()
    assert platform.get(RUNS).json() == {"runs": []}


BAD_DEPLOYMENTS = [
    pytest.param({"trigger": "cron"}, "trigger", id="trigger not push, rollback or manual"),
    pytest.param({"result": "success"}, "result", id="result not a deployment result"),
    pytest.param({"images": {}}, "images", id="no images"),
    pytest.param({"images": {"Control Plane": "x"}}, "images.Control Plane.[key]", id="component not a name"),
    pytest.param({"images": {"agent": "i" * 501}}, "images.agent", id="image too long"),
    pytest.param({"previousImages": {"agent": ""}}, "previousImages.agent", id="empty previous image"),
    pytest.param({"actor": ""}, "actor", id="empty actor"),
    pytest.param({"finishedAt": None}, "finishedAt", id="no finish"),
    pytest.param({"finishedAt": "2026-11-25T10:59:59Z"}, "finishedAt", id="finish before start"),
    pytest.param({"steps": [{"component": "agent"}]}, "steps[0].ok", id="step without ok"),
    pytest.param({"steps": [{"component": "agent", "ok": True, "detail": "\x00"}]}, "steps[0].detail",
                 id="NUL in a step"),
    pytest.param({"sha": "abc"}, "sha", id="sha too short"),
]


@pytest.mark.parametrize(("changes", "field"), BAD_DEPLOYMENTS)
def test_a_bad_deployment_is_a_400_naming_the_field_and_stores_nothing(platform: Platform, changes: dict,
                                                                       field: str) -> None:
    r = platform.post(DEPLOYS, a_deployment(**changes))
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field, r.json()
    assert platform.get(DEPLOYS).json() == {"deployments": []}


@pytest.mark.parametrize(("path", "params", "field"), [
    (RUNS, {"limit": 0}, "limit"), (RUNS, {"limit": 1001}, "limit"), (RUNS, {"result": "passed"}, "result"),
    (RUNS, {"kind": "nightly"}, "kind"), (RUNS, {"repo": "r" * 201}, "repo"),
    (DEPLOYS, {"sha": "xyz"}, "sha"), (DEPLOYS, {"result": "success"}, "result"), (DEPLOYS, {"limit": -1}, "limit"),
])
def test_bad_query_parameters_are_400s_naming_them(platform: Platform, path: str, params: dict, field: str) -> None:
    r = platform.get(path, **params)
    assert r.status_code == 400 and r.json()["field"] == field, r.text


def test_a_body_over_the_cap_is_413(platform: Platform) -> None:
    huge = a_run(stages=[{"name": "s", "state": "passed", "summary": "x" * 2000}] * 100, reason="r" * 4000)
    huge["padding"] = "p" * 1_100_000
    assert platform.post(RUNS, huge).status_code == 413


# ------------------------------------------------------------------------------ records

def test_the_flow_posts_running_then_its_result_and_one_run_is_recorded(platform: Platform) -> None:
    first = platform.post(RUNS, a_run())
    assert first.status_code == 201, first.text
    started = first.json()
    assert started["result"] == "running" and started["finishedAt"] is None and started["durationS"] is None
    assert started["stages"] == [{"name": "lint", "state": "running", "durationS": None, "summary": ""}]

    final = platform.post(RUNS, finished_run(result="failure"))
    assert final.status_code == 200, final.text
    got = final.json()
    assert got["id"] == started["id"]
    assert got == {
        "id": started["id"], "flowRunId": "fr-1", "repo": "acme/apiary", "prNumber": 7, "sha": SHA_A,
        "ref": "refs/pull/7/head", "kind": "pr", "result": "failure", "failedStage": "unit", "reason": None,
        "startedAt": "2026-11-25T10:00:00Z", "finishedAt": "2026-11-25T10:05:00Z", "durationS": 300.0,
        "stages": [{"name": "lint", "state": "passed", "durationS": 12.5, "summary": "ruff: clean"},
                   {"name": "unit", "state": "failed", "durationS": 200.0, "summary": "1 failed"},
                   {"name": "build", "state": "skipped", "durationS": None, "summary": ""}],
        "targetUrl": "http://127.0.0.1:4200/flow-runs/flow-run/fr",
    }
    assert platform.get(RUNS).json() == {"runs": [got]}
    again = platform.post(RUNS, finished_run(result="failure"))  # a retried post: idempotent
    assert again.status_code == 200 and again.json() == got
    assert len(platform.get(RUNS).json()["runs"]) == 1


def test_times_are_read_as_iso_8601_and_answered_in_utc(platform: Platform) -> None:
    r = platform.post(RUNS, a_run("naive", startedAt="2026-11-25T10:00:00", finishedAt="2026-11-25T12:30:00+02:00",
                                  result="success", durationS=1800.5))
    assert r.status_code == 201, r.text
    assert r.json()["startedAt"] == "2026-11-25T10:00:00Z" and r.json()["finishedAt"] == "2026-11-25T10:30:00Z"
    assert r.json()["durationS"] == 1800.5  # the flow's own measure wins over finishedAt - startedAt
    unix = platform.post(RUNS, a_run("unix", startedAt=1_795_600_800))
    assert unix.json()["startedAt"] == "2026-11-25T10:00:00Z"


def test_runs_are_newest_first_filtered_and_limited(platform: Platform) -> None:
    specs = [("r1", "acme/apiary", "pr", "success", "08"), ("r2", "acme/apiary", "deploy", "failure", "09"),
             ("r3", "acme/docs", "deploy", "success", "10"), ("r4", "acme/apiary", "pr", "running", "11"),
             ("r5", "acme/apiary", "deploy", "error", "07")]
    for flow, repo, kind, result, hour in specs:
        body = a_run(flow, repo=repo, kind=kind, result=result, startedAt=f"2026-11-25T{hour}:00:00Z",
                     prNumber=7 if kind == "pr" else None)
        assert platform.post(RUNS, body).status_code == 201

    def flows(**params: Any) -> list[str]:
        r = platform.get(RUNS, **params)
        assert r.status_code == 200, r.text
        return [run["flowRunId"] for run in r.json()["runs"]]

    assert flows() == ["r4", "r3", "r2", "r1", "r5"]
    assert flows(limit=2) == ["r4", "r3"]
    assert flows(repo="acme/apiary") == ["r4", "r2", "r1", "r5"]
    assert flows(kind="deploy") == ["r3", "r2", "r5"]
    assert flows(result="success") == ["r3", "r1"]
    assert flows(repo="acme/apiary", kind="deploy", result="failure") == ["r2"]
    assert flows(repo="acme/nothing") == []


def test_deployments_are_recorded_newest_first_and_filtered_by_sha_prefix_and_result(platform: Platform) -> None:
    first = platform.post(DEPLOYS, a_deployment())
    assert first.status_code == 201, first.text
    d = first.json()
    assert d["durationS"] == 200.0 and d["startedAt"] == "2026-11-25T11:00:00Z"
    assert d["images"]["control-plane"] == "reg/apiary-control-plane:b2b2" and d["steps"][0]["gate"] == "healthz"
    rolled = platform.post(DEPLOYS, a_deployment(sha=SHA_A.upper(), result="rolled_back", reason="smoke job failed",
                                                 startedAt="2026-11-25T12:00:00Z", finishedAt="2026-11-25T12:10:00Z",
                                                 durationS=590.0))
    assert rolled.status_code == 201 and rolled.json()["sha"] == SHA_A  # stored lower-case
    manual = platform.post(DEPLOYS, a_deployment(trigger="rollback", actor="root", startedAt="2026-11-25T13:00:00Z",
                                                 finishedAt="2026-11-25T13:01:00Z"))
    assert manual.status_code == 201

    def ids(**params: Any) -> list[int]:
        r = platform.get(DEPLOYS, **params)
        assert r.status_code == 200, r.text
        return [x["id"] for x in r.json()["deployments"]]

    newest = [manual.json()["id"], rolled.json()["id"], d["id"]]
    assert ids() == newest
    assert ids(limit=1) == newest[:1]
    assert ids(sha=SHA_B[:7]) == [manual.json()["id"], d["id"]]
    assert ids(sha=SHA_A[:7].upper()) == [rolled.json()["id"]]
    assert ids(sha="") == newest  # empty: any
    assert ids(result="rolled_back") == [rolled.json()["id"]]
    assert ids(result="failed") == []


def test_a_deployment_reported_twice_by_its_flow_run_is_one_record(platform: Platform) -> None:
    first = platform.post(DEPLOYS, a_deployment(flowRunId="deploy-fr-1", result="failed", reason="gate"))
    second = platform.post(DEPLOYS, a_deployment(flowRunId="deploy-fr-1"))
    assert (first.status_code, second.status_code) == (201, 200)
    assert second.json()["id"] == first.json()["id"] and second.json()["result"] == "succeeded"
    assert [x["result"] for x in platform.get(DEPLOYS).json()["deployments"]] == ["succeeded"]


def test_the_store_clips_what_a_caller_bypassing_the_api_hands_it(platform: Platform) -> None:
    """No NUL and no lone surrogate reaches the database (PostgreSQL would fail the statement), and
    nothing is longer than its column."""
    records = CiRecords(platform.plane.sessions)
    run, created = records.record_run({
        "flowRunId": "f\x00" + "x" * 100, "repo": "acme/\x00apiary", "sha": "A" * 80, "ref": "r\ud800ef",
        "kind": "pr", "result": "failure", "reason": "why\x00" * 2000, "startedAt": 1.0, "finishedAt": 3.0,
        "stages": [{"name": "n\x00" * 80, "state": "failed", "durationS": 1, "summary": "s" * 5000}] * 150,
    })
    assert created and run["flowRunId"] == "f" + "x" * 63 and run["repo"] == "acme/apiary"
    assert run["sha"] == "a" * 64 and run["ref"] == "r?ef" and run["durationS"] == 2.0
    assert len(run["reason"]) == 4000 and "\x00" not in run["reason"]
    assert len(run["stages"]) == 100 and run["stages"][0]["name"] == "n" * 80
    assert len(run["stages"][0]["summary"]) == 2000
    deployment, _ = records.record_deployment({
        "sha": "b" * 40, "images": {f"c{i}\x00": "i" * 900 for i in range(40)}, "actor": "\x00" * 300,
        "trigger": "push", "startedAt": 5.0, "finishedAt": 4.0, "result": "failed",
        "steps": [{"component": "agent", "ok": 1, "detail": "\x00d"}] * 300,
    })
    assert len(deployment["images"]) == 16 and all(len(v) == 500 for v in deployment["images"].values())
    assert deployment["actor"] == "" and deployment["durationS"] == 0.0
    assert len(deployment["steps"]) == 100 and deployment["steps"][0]["detail"] == "d"
    assert records.runs(10)[0] == run and records.deployments(10)[0] == deployment


def test_the_metrics_are_computed_from_the_store_on_either_database(platform: Platform) -> None:
    """The snapshot's queries (grouping, the newest default-branch run per repository by a window
    function) give the same answers on SQLite and PostgreSQL."""
    for flow, repo, result, hour in [("d1", "acme/apiary", "success", "08"), ("d2", "acme/apiary", "failure", "09"),
                                     ("d3", "acme/docs", "failure", "08"), ("d4", "acme/docs", "success", "09")]:
        body = finished_run(flow, result, repo=repo, kind="deploy", prNumber=None,
                            startedAt=f"2026-11-25T{hour}:00:00Z", finishedAt=f"2026-11-25T{hour}:05:00Z")
        assert platform.post(RUNS, body).status_code == 201
    assert platform.post(RUNS, a_run("d5", repo="acme/docs", kind="deploy", prNumber=None,
                                     startedAt="2026-11-25T10:00:00Z")).status_code == 201  # still running
    assert platform.post(DEPLOYS, a_deployment(result="rolled_back")).status_code == 201
    snap = CiRecords(platform.plane.sessions).metrics_snapshot()
    assert snap["default_branch"] == {"acme/apiary": False, "acme/docs": True}
    assert snap["runs"] == {"success": 2, "failure": 2, "error": 0}
    assert snap["deploys"] == {"succeeded": 0, "rolled_back": 1, "failed": 0} and snap["rollbacks"] == 1
    assert sorted(snap["stage_durations"]) == sorted([("lint", 12.5), ("unit", 200.0)] * 4 + [("build", 95.0)] * 2)
