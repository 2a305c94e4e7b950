"""One CI record: a GitHub delivery, its pipeline run and its deployment are one row whose state
advances (apiary.ci.records, apiary.ci.intake), the deploy gate asks the API for its sha, and the
migration copies the three former tables into it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import text

from apiary.ci import run as ci_run
from apiary.ci.config import CiConfig
from apiary.ci.intake import WebhookIntake
from apiary.ci.records import CiRecords
from apiary.ci.starter import Pending, PipelineStarter, Started
from apiary.ci.webhooks import PipelineRequest, body_sha256
from apiary.store import make_engine, migrate, session_factory
from apiary.store.engine import MIGRATIONS
from apiary.store.unit import Sessions

GITHUB = Path(__file__).parent.parent / "data" / "github"
PUSH_SHA = "6113728f27ae82c7b1a177c8d03f9e96e0adf246"


class FakeStarter(PipelineStarter):
    def __init__(self, outcome: Started | Pending) -> None:
        self.outcome = outcome

    def start(self, delivery: str, request: PipelineRequest) -> Started | Pending:
        return self.outcome


@pytest.fixture
def sessions(tmp_path: Path) -> Any:
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    yield session_factory(engine)
    engine.dispose()


def deliver(intake: WebhookIntake, name: str = "push.default-branch", delivery: str = "d-1") -> Any:
    body = (GITHUB / f"{name}.json").read_bytes()
    return intake.accept(name.split(".")[0], delivery, json.loads(body), body_sha256(body))


def a_run(flow_run_id: str, result: str, sha: str = PUSH_SHA, **more: Any) -> dict[str, Any]:
    finished = {} if result == "running" else {"finishedAt": 200.0}
    return {"flowRunId": flow_run_id, "repo": "acme/apiary", "sha": sha, "ref": "refs/heads/main", "kind": "deploy",
            "result": result, "startedAt": 100.0, "stages": [{"name": "unit", "state": "passed"}], **finished,
            **more}


def a_deployment(result: str = "succeeded", **more: Any) -> dict[str, Any]:
    return {"sha": PUSH_SHA, "images": {"control-plane": "reg/cp:1"}, "actor": "octocat", "trigger": "push",
            "startedAt": 300.0, "finishedAt": 400.0, "result": result, **more}


def test_a_push_its_pipeline_and_its_deployment_are_one_record_whose_state_advances(sessions: Sessions) -> None:
    intake = WebhookIntake(sessions, FakeStarter(Started("deploy-flow")), "secret")
    records = CiRecords(sessions)
    accepted = deliver(intake)
    assert accepted.request is not None and not accepted.duplicate
    states = [records.records()[0]["state"]]
    intake.start("d-1", accepted.request)
    states.append(records.records()[0]["state"])
    # the deploy flow's gate runs the pipeline as a subflow (its own flow run), naming the delivery
    records.record_run(a_run("ci-subflow", "running", delivery="d-1"))
    states.append(records.records()[0]["state"])
    run, created = records.record_run(a_run("ci-subflow", "success", delivery="d-1"))
    assert not created
    states.append(records.records()[0]["state"])
    deployment, created = records.record_deployment(a_deployment(flowRunId="deploy-flow", delivery="d-1"))
    assert not created
    states.append(records.records()[0]["state"])
    assert states == ["received", "started", "running", "passed", "deployed"]

    [record] = records.records()
    assert record["delivery"]["delivery"] == "d-1" and record["delivery"]["flowRunId"] == "deploy-flow"
    assert record["run"] == run and record["deployment"] == deployment and record["sha"] == PUSH_SHA
    # the three views still show each part, on the same record
    assert [r["id"] for r in records.runs()] == [d["id"] for d in records.deployments()] == [record["id"]]
    assert intake.recent()[0]["state"] == "started" and intake.recent()[0]["record"] == "deployed"


def test_a_start_recorded_after_the_pipeline_reported_does_not_move_the_state_back(sessions: Sessions) -> None:
    intake = WebhookIntake(sessions, FakeStarter(Started("pr-flow")), "secret")
    records = CiRecords(sessions)
    accepted = deliver(intake, "pull_request.opened", "d-pr")
    assert accepted.request is not None
    records.record_run(a_run("pr-flow", "failure", sha=accepted.request.sha, kind="pr", delivery="d-pr"))
    intake.start("d-pr", accepted.request)
    [record] = records.records()
    assert record["state"] == "failed" and record["delivery"]["flowRunId"] == "pr-flow"


def test_a_pending_start_keeps_its_reason_and_its_delivery_state(sessions: Sessions) -> None:
    records = CiRecords(sessions)
    pending = WebhookIntake(sessions, FakeStarter(Pending("no deployment yet")), "secret")
    accepted = deliver(pending, delivery="d-p")
    assert accepted.request is not None
    pending.start("d-p", accepted.request)
    assert records.records(delivery="d-p")[0]["state"] == "pending"
    assert pending.recent()[0]["state"] == "pending" and pending.recent()[0]["reason"] == "no deployment yet"


def test_a_second_deployment_of_the_delivery_by_another_flow_run_is_a_record_of_its_own(sessions: Sessions) -> None:
    intake = WebhookIntake(sessions, FakeStarter(Started("deploy-1")), "secret")
    records = CiRecords(sessions)
    deliver(intake)
    first, created_first = records.record_deployment(a_deployment("rolled_back", flowRunId="deploy-1",
                                                                  delivery="d-1"))
    again, created_again = records.record_deployment(a_deployment(flowRunId="deploy-1", delivery="d-1"))
    other, created_other = records.record_deployment(a_deployment(flowRunId="deploy-2", delivery="d-1"))
    assert (created_first, created_again, created_other) == (False, False, True)
    assert again["id"] == first["id"] != other["id"] and again["result"] == "succeeded"
    assert [r["delivery"] and r["delivery"]["delivery"] for r in records.records()] == [None, "d-1"]


def test_the_gate_finds_its_sha_however_many_newer_runs_passed(sessions: Sessions,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate asks the API for the sha (the store filters): the former gate read the newest 200
    passing runs and looked for the sha among them, so an older passing run was not found."""
    records = CiRecords(sessions)
    records.record_run(a_run("wanted", "success"))
    for i in range(210):
        records.record_run(a_run(f"other-{i}", "success", sha=f"{i:040x}", startedAt=1000.0 + i))
    asked: list[dict[str, Any]] = []

    class Client:
        def ci_runs(self, limit: int = 50, **filters: str | None) -> list[dict]:
            asked.append({"limit": limit, **filters})
            return records.runs(limit, repo=filters.get("repo"), result=filters.get("result"),
                                kind=filters.get("kind"), sha=filters.get("sha"))

        def close(self) -> None:
            pass

    monkeypatch.setattr(ci_run, "_client", lambda config: Client())
    found = ci_run.passing_run(CiConfig(), PUSH_SHA)
    assert found is not None and found["flowRunId"] == "wanted"
    assert asked and all(a.get("sha") == PUSH_SHA for a in asked)
    assert ci_run.passing_run(CiConfig(), PUSH_SHA[:-1] + "0") is None


def test_the_migration_copies_the_three_tables_into_records(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/old.db")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    stages = json.dumps([{"name": "unit", "state": "passed", "durationS": 3.0, "summary": ""}])
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0009")
        conn.execute(text(
            "INSERT INTO ci_deliveries (delivery, event, kind, state, flow_run_id, reason, received_at, sha, repo) "
            "VALUES ('pr-d', 'pull_request', 'pr', 'started', 'pr-flow', '', 1, 'aa', 'acme/apiary'), "
            "('push-d', 'push', 'deploy', 'started', 'deploy-flow', '', 2, 'bb', 'acme/apiary'), "
            "('ping-d', 'ping', 'ping', 'accepted', NULL, 'pong', 3, NULL, NULL)"))
        conn.execute(text(
            "INSERT INTO ci_runs (flow_run_id, repo, sha, ref, kind, result, started_at, finished_at, stages) "
            f"VALUES ('pr-flow', 'acme/apiary', 'aa', 'refs/pull/1/head', 'pr', 'success', 10, 20, '{stages}'), "
            f"('local-1', 'acme/apiary', 'cc', 'main', 'deploy', 'failure', 30, 40, '{stages}')"))
        conn.execute(text(
            "INSERT INTO deployments (sha, images, actor, trigger, started_at, finished_at, duration_s, result, "
            "steps, flow_run_id) VALUES ('bb', '{\"agent\": \"a:1\"}', 'octocat', 'push', 50, 60, 10, "
            "'rolled_back', '[]', 'deploy-flow'), ('dd', '{}', 'ops', 'manual', 70, 80, 10, 'succeeded', '[]', NULL)"))
    engine.dispose()
    migrate(engine := make_engine(f"sqlite:///{tmp_path}/old.db"))
    records = CiRecords(session_factory(engine))
    by_sha = {r["sha"]: r for r in records.records(200)}
    assert {sha: r["state"] for sha, r in by_sha.items()} == {
        "aa": "passed", "bb": "rolled_back", None: "received", "cc": "failed", "dd": "deployed"}
    assert by_sha["aa"]["delivery"]["delivery"] == "pr-d" and by_sha["aa"]["run"]["flowRunId"] == "pr-flow"
    assert by_sha["aa"]["run"]["stages"][0]["durationS"] == 3.0
    assert by_sha["bb"]["delivery"]["delivery"] == "push-d"
    assert by_sha["bb"]["deployment"]["images"] == {"agent": "a:1"}
    assert by_sha["cc"]["delivery"] is None and by_sha["dd"]["deployment"]["trigger"] == "manual"
    assert by_sha[None]["delivery"]["reason"] == "pong"
    assert [r["sha"] for r in records.runs()] == ["cc", "aa"]
    assert [d["sha"] for d in records.deployments()] == ["dd", "bb"]

    with engine.begin() as conn:  # and back
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0009")
        assert conn.execute(text("SELECT count(*) FROM ci_deliveries")).scalar() == 3
        assert conn.execute(text("SELECT count(*) FROM ci_runs")).scalar() == 2
        assert conn.execute(text("SELECT count(*) FROM deployments")).scalar() == 2
    engine.dispose()


def test_the_api_filters_runs_by_sha_and_shows_whole_records(sessions: Sessions) -> None:
    """``GET /api/v2/ci/runs?sha=`` (what the deploy gate asks) and ``GET /api/v2/ci/records``,
    through the router over the store (the caller is the Prefect service token)."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from apiary.api.auth import get_principal
    from apiary.api.routers import ci_records
    from apiary.auth.principal import Principal

    app = FastAPI()
    app.include_router(ci_records.router)
    app.state.plane = SimpleNamespace(sessions=sessions)
    app.dependency_overrides[get_principal] = lambda: Principal(kind="service", name="bridge", token_id="t")
    intake = WebhookIntake(sessions, FakeStarter(Started("deploy-flow")), "secret")
    accepted = deliver(intake)
    assert accepted.request is not None
    intake.start("d-1", accepted.request)
    with TestClient(app) as client:
        body = {**a_run("ci-sub", "success", delivery="d-1"), "startedAt": "2026-11-25T10:00:00Z",
                "finishedAt": "2026-11-25T10:05:00Z"}
        assert client.post("/api/v2/ci/runs", json=body).status_code == 200  # the delivery's record
        other = {**body, "flowRunId": "other", "sha": "f" * 40, "delivery": None}
        assert client.post("/api/v2/ci/runs", json=other).status_code == 201
        runs = client.get("/api/v2/ci/runs", params={"sha": PUSH_SHA, "result": "success", "limit": 1}).json()
        assert [r["flowRunId"] for r in runs["runs"]] == ["ci-sub"]
        assert client.get("/api/v2/ci/runs", params={"sha": "6113728"}).json()["runs"][0]["sha"] == PUSH_SHA
        [record] = client.get("/api/v2/ci/records", params={"delivery": "d-1"}).json()["records"]
        assert record["state"] == "passed" and record["deployment"] is None
        assert record["delivery"]["flowRunId"] == "deploy-flow" and record["run"]["flowRunId"] == "ci-sub"
        assert [r["sha"] for r in client.get("/api/v2/ci/records", params={"state": "passed"}).json()["records"]] \
            == ["f" * 40, PUSH_SHA]
        # a bad filter is refused naming it (the full app answers 400; this bare router FastAPI's 422)
        bad = client.get("/api/v2/ci/records", params={"state": "nonsense"})
        assert bad.status_code == 422 and "state" in bad.text
        bad = client.get("/api/v2/ci/runs", params={"sha": "xyz"})
        assert bad.status_code == 422 and "sha" in bad.text
