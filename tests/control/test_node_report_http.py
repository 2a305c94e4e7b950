"""``POST /api/v2/nodes/{node}/status`` with a node agent's token: no combination of a run's report
fields answers 500 or leaves the job stuck.

The case that did (an agent killed between starting a task and recording it reports, once restarted,
the run exited 0 with no start): 500 "illegal job state transition WAITING -> SUCCEEDED" on every
resend while the job stayed WAITING. It is now recorded started at its end, then succeeded, once.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6, job_text

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.lifecycle import EXIT_LAUNCH_FAILED
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

CONFIG = LAB6 / "hived-config-two-vcs.yaml"
CAROL = "hostname-carol"  # VC default's one node, one GPU


class Platform:
    """The control plane behind its HTTP API, with alice's, an admin's and carol's agent's tokens."""

    def __init__(self, tmp: Path) -> None:
        self.engine = make_engine(f"sqlite:///{tmp}/a.db")
        migrate(self.engine)
        self.plane = ControlPlane(session_factory(self.engine), load_cluster_config(CONFIG), tmp / "logs")
        p = Principals(Directory(self.plane.sessions), ["default"])
        self.alice, self.admin, self.agent = bearer(p.user("alice")), bearer(p.admin()), bearer(p.agent(CAROL))
        self.client = TestClient(create_app(self.plane, AlertReceiver(self.plane, ActionsConfig(), notifiers={})))
        self.client.__enter__()
        assert self.report([]).status_code == 200
        self.jobs = 0

    def report(self, runs: list[dict]):
        return self.client.post(f"/api/v2/nodes/{CAROL}/status", headers=self.agent,
                                json={"agentId": "a", "gpus": 1, "simulatedGpus": True, "runs": runs})

    def placed_job(self) -> tuple[str, str]:
        """Submit a one-instance job of alice's, place it on carol: ``(job id, run id)``."""
        self.jobs += 1
        doc = yaml.safe_load(job_text(5))
        doc["name"] = f"r{self.jobs}"
        doc["defaults"] = {"virtualCluster": "default"}
        r = self.client.post("/api/v2/jobs", content=yaml.safe_dump(doc), headers={**self.alice,
                                                                                     "Content-Type": "text/yaml"})
        assert r.status_code == 202, r.text
        assert self.client.post("/api/v2/scheduler/cycle", headers=self.admin).status_code == 200
        r = self.client.get(f"/api/v2/nodes/{CAROL}/assignments", headers=self.agent)
        (a,) = [a for a in r.json()["assignments"] if a["launch"]["job_name"] == doc["name"]]
        return a["launch"]["job_id"], a["runId"]

    def job(self, job_id: str) -> dict:
        return self.client.get(f"/api/v2/jobs/{job_id}", headers=self.admin).json()

    def clear(self, job_id: str) -> None:
        """End the job whatever state the test left it in, so the next one gets carol's GPU."""
        if self.job(job_id)["state"] in ("SUCCEEDED", "FAILED", "STOPPED"):
            return
        r = self.client.put(f"/api/v2/jobs/{job_id}/executionType", json={"value": "STOP"}, headers=self.admin)
        assert r.status_code == 200, r.text
        for a in self.client.get(f"/api/v2/nodes/{CAROL}/assignments", headers=self.agent).json()["assignments"]:
            assert self.report([{"run_id": a["runId"], "state": "exited", "exit_code": None, "stopped": True,
                                 "finished_at": 9.0}]).status_code == 200
        assert self.job(job_id)["state"] == "STOPPED"

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.engine.dispose()


@pytest.fixture
def platform(tmp_path: Path):
    p = Platform(tmp_path)
    yield p
    p.close()


def test_an_exit_0_reported_without_a_start_succeeds_the_job_once(platform: Platform) -> None:
    job_id, run_id = platform.placed_job()
    assert platform.job(job_id)["state"] == "WAITING"
    run = {"run_id": run_id, "state": "exited", "exit_code": 0, "pid": None, "started_at": None,
           "finished_at": 1_700_000_100.0, "lost": False, "stopped": False}
    for _ in range(2):  # the agent resends until it has the ack; the second changes nothing
        r = platform.report([run])
        assert r.status_code == 200, r.text
        assert r.json()["ack"] == [run_id]
    job = platform.job(job_id)
    assert (job["state"], job["exitCode"], job["retries"]) == ("SUCCEEDED", 0, 0)
    assert job["tasks"][0]["state"] == "SUCCEEDED" and job["launchTime"] is not None
    assert platform.client.get(f"/api/v2/nodes/{CAROL}/assignments", headers=platform.agent).json()[
        "assignments"] == []  # nothing left to run: it never runs again


def test_no_combination_of_report_fields_answers_500_or_sticks_the_job(platform: Platform) -> None:
    for state, code, started_at, lost, stopped in itertools.product(
        ("exited", "running", "unknown"), (None, 0, 1, 137, EXIT_LAUNCH_FAILED), (None, 1_700_000_050.0),
        (False, True), (False, True),
    ):
        if state != "exited" and (code, lost, stopped) != (None, False, False):
            continue  # a running run carries no exit fields worth crossing
        job_id, run_id = platform.placed_job()
        run = {"run_id": run_id, "state": state, "exit_code": code, "pid": 42, "started_at": started_at,
               "finished_at": 1_700_000_100.0 if state == "exited" else None, "lost": lost, "stopped": stopped}
        case = f"{run}"
        r = platform.report([run])
        assert r.status_code == 200, f"{case}: {r.status_code} {r.text}"
        job = platform.job(job_id)
        if state == "exited":
            assert r.json()["ack"] == [run_id], case
            # Decided: finished, or retried with a new attempt waiting (never the old run still STARTING).
            assert job["state"] in ("SUCCEEDED", "FAILED", "STOPPED") or (
                job["state"] == "WAITING" and job["retries"] == 1 and job["tasks"][0]["attempt"] == 1), f"{case}: {job}"
        assert platform.report([run]).status_code == 200, case
        platform.clear(job_id)


def test_an_agent_that_says_it_cannot_record_makes_healthz_503_until_it_can(platform: Platform) -> None:
    """The agent's ``cannotRecord`` goes through the HTTP report to the control plane's /healthz."""
    c = platform.client

    def report(cannot_record: str | None) -> int:
        body = {"agentId": "a", "gpus": 1, "simulatedGpus": True, "runs": [], "cannotRecord": cannot_record}
        return c.post(f"/api/v2/nodes/{CAROL}/status", headers=platform.agent, json=body).status_code

    assert c.get("/healthz").status_code == 200
    assert report("cannot write to /var/lib/apiary/agents: No space left on device") == 200
    r = c.get("/healthz")
    assert r.status_code == 503 and CAROL in r.json()["reason"] and "No space left" in r.json()["reason"]
    assert report(None) == 200
    assert c.get("/healthz").status_code == 200
