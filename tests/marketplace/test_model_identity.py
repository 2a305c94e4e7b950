"""The tasks' MLflow secrets and ``GET /api/v2/mlflow/identity`` (apiary.marketplace.identity): a
job's launch carries the tracking server, its own run's secret and its user's experiment; the
identity route answers the job's user for that secret while the run lives and 401 once it ended,
a user's token as that user, and refuses forged secrets, other runs' secrets and machine tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6, job_text

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.marketplace import models
from apiary.marketplace.identity import TaskTokens
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

CAROL = "hostname-carol"
MLFLOW = "http://127.0.0.1:5999"
IDENTITY = "/api/v2/mlflow/identity"


class World:
    def __init__(self, tmp: Path) -> None:
        self.engine = make_engine(f"sqlite:///{tmp}/a.db")
        migrate(self.engine)
        self.plane = ControlPlane(session_factory(self.engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                                  tmp / "logs")
        directory = Directory(self.plane.sessions)
        p = Principals(directory, ["default"])
        directory.create_group("team-b", virtual_clusters=["vc1"])
        self.key = tmp / "credentials" / "mlflow-task.key"
        parts = models.build(self.plane.sessions, directory, self.key, mlflow_url=MLFLOW)
        self.plane.agents.task_env = parts.task_env
        self.parts = parts
        self.h = {"alice": bearer(p.user("alice")), "bob": bearer(p.user("bob", groups=("team-b",))),
                  "admin": bearer(p.admin()), "agent": bearer(p.agent(CAROL))}
        self.client = TestClient(create_app(self.plane, AlertReceiver(self.plane, ActionsConfig(), notifiers={}),
                                            directory=directory, models=parts.registry,
                                            mlflow_identity=parts.identity))
        self.client.__enter__()

    def report(self, runs: list[dict]) -> None:
        r = self.client.post(f"/api/v2/nodes/{CAROL}/status", headers=self.h["agent"],
                             json={"agentId": "t", "gpus": 1, "simulatedGpus": True, "runs": runs})
        assert r.status_code == 200, r.text

    def running_job(self, name: str) -> dict:
        """Alice's one-instance job, placed and RUNNING; its launch."""
        doc = yaml.safe_load(job_text(5))
        doc["name"], doc["defaults"] = name, {"virtualCluster": "default"}
        doc["taskRoles"]["train"]["commands"] = ["sleep 600"]
        r = self.client.post("/api/v2/jobs", content=yaml.safe_dump(doc),
                             headers={**self.h["alice"], "Content-Type": "text/yaml"})
        assert r.status_code == 202, r.text
        self.report([])
        assert self.client.post("/api/v2/scheduler/cycle", headers=self.h["admin"]).status_code == 200
        r = self.client.get(f"/api/v2/nodes/{CAROL}/assignments", headers=self.h["agent"])
        launch = next(a["launch"] for a in r.json()["assignments"] if a["launch"]["job_id"] == f"alice~{name}")
        self.report([{"run_id": launch["run_id"], "state": "running", "pid": 1, "started_at": 1.0}])
        return launch

    def identity(self, headers: dict[str, str]) -> tuple[int, dict]:
        r = self.client.get(IDENTITY, headers=headers)
        return r.status_code, r.json()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.client.__exit__(None, None, None)
    w.engine.dispose()


def test_a_launch_gets_the_tracking_server_its_runs_secret_and_its_users_experiment(world: World) -> None:
    launch = world.running_job("env")
    env = launch["env"]
    assert env["MLFLOW_TRACKING_URI"] == MLFLOW
    assert env["MLFLOW_EXPERIMENT_NAME"] == "users/alice"
    token = env["MLFLOW_TRACKING_TOKEN"]
    assert TaskTokens(bytes.fromhex(world.key.read_text())).verify(token) == launch["run_id"]
    assert world.key.stat().st_mode & 0o777 == 0o600
    # The job's own identity variables are there too (the run's tags come from them).
    assert env["APIARY_JOB_ID"] == "alice~env" and env["PAI_JOB_ATTEMPT_ID"] == "0"
    assert env["PAI_CURRENT_TASK_ROLE_NAME"] == "train" and env["PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX"] == "0"
    # Nothing of the platform's own credentials.
    assert not {k for k in env if k in ("APIARY_TOKEN", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_USERNAME")}


def test_a_tasks_secret_is_its_jobs_user_until_the_run_ends(world: World) -> None:
    launch = world.running_job("live")
    secret = launch["env"]["MLFLOW_TRACKING_TOKEN"]
    status, who = world.identity({"Authorization": f"Bearer {secret}"})
    assert (status, who) == (200, {"user": "alice", "admin": False, "groups": ["default"]})

    world.report([{"run_id": launch["run_id"], "state": "exited", "exit_code": 0, "pid": 1, "started_at": 1.0,
                   "finished_at": 2.0}])
    status, body = world.identity({"Authorization": f"Bearer {secret}"})
    assert status == 401 and "ended" in body["message"]


@pytest.mark.parametrize("forge", [
    pytest.param(lambda s: s[:-1] + ("0" if s[-1] != "0" else "1"), id="one-hex-digit-changed"),
    pytest.param(lambda s: s.replace(".a0.", ".a1."), id="another-run-id-same-mac"),
    pytest.param(lambda s: TaskTokens(b"k" * 32).issue(s.split(".", 1)[1].rsplit(".", 1)[0]), id="another-key"),
    pytest.param(lambda s: "mlflow-task.", id="empty"),
])
def test_a_forged_secret_is_refused(world: World, forge) -> None:
    secret = world.running_job("forged")["env"]["MLFLOW_TRACKING_TOKEN"]
    status, _ = world.identity({"Authorization": f"Bearer {forge(secret)}"})
    assert status == 401


def test_users_tokens_are_themselves_and_machines_have_no_identity(world: World) -> None:
    assert world.identity(world.h["bob"]) == (200, {"user": "bob", "admin": False, "groups": ["team-b"]})
    status, who = world.identity(world.h["admin"])
    assert status == 200 and who["user"] == "root" and who["admin"] is True
    assert world.identity(world.h["agent"])[0] == 403
    assert world.identity({})[0] == 401
    assert world.identity({"Authorization": "Bearer nope"})[0] == 401


def test_a_platform_minted_user_credential_expires(world: World) -> None:
    tokens = TaskTokens(bytes.fromhex(world.key.read_text()))
    fresh = tokens.issue_user("alice", now=world.parts.identity.clock())
    assert world.identity({"Authorization": f"Bearer {fresh}"})[1]["user"] == "alice"
    stale = tokens.issue_user("alice", now=world.parts.identity.clock() - 120)
    assert world.identity({"Authorization": f"Bearer {stale}"})[0] == 401
    assert world.identity({"Authorization": f"Bearer {fresh.replace('alice', 'root')}"})[0] == 401
