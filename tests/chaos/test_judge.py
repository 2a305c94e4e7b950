"""The journal judge on small recorded journals (tests/chaos/data/journals: real ones from runs
against the embedded platform, trimmed, and variants of them), table-driven."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from apiary.chaos.journal import judge, phase_durations

JOURNALS = Path(__file__).parent / "data" / "journals"


def load(name: str) -> dict:
    return json.loads((JOURNALS / f"{name}.json").read_text())


@pytest.mark.parametrize(("journal", "expected"), [
    pytest.param("passed", [], id="passed"),
    pytest.param("passed-with-rollbacks", [], id="passed, rollbacks ran and succeeded"),
    pytest.param("rollback-failed", [
        "rollback uncordon-a-node-that-does-not-exist failed: apiary.errors.NotFoundError: Node no-such-node is not "
        "in the cluster config."], id="a rollback failed (chaostoolkit: completed)"),
    pytest.param("deviated", [
        "status failed, not completed",
        "the steady state deviated after the method",
        "steady state not met after the method: probe no-task-ran-twice: apiary.chaos.SteadyStateViolation: task "
        "run(s) started twice: admin~chaos-inflight-40f31f91 attempt 0 train/0 (2 starts)"], id="deviated"),
    pytest.param("before-not-met", [
        "status failed, not completed",
        "steady state not met before the method: probe api-healthy: apiary.chaos.SteadyStateViolation: timed out "
        "after 30 s waiting for GET http://127.0.0.1:1/healthz"], id="steady state not met before"),
    pytest.param("method-failed", [
        "method activity inflight-job-succeeds-unrestarted failed: apiary.chaos.SteadyStateViolation: job "
        "admin~chaos-inflight-40f31f91 succeeded in attempt 1, later than 0 (retries {'user': 0, 'platform': 1})"],
        id="a method activity failed"),
    pytest.param("tolerance-missed", [
        "the steady state deviated after the method",
        "steady state not met after the method: probe store-and-scheduler-consistent: returned False, outside its "
        "tolerance"], id="a probe outside its tolerance"),
    pytest.param("interrupted", [
        "status interrupted, not completed",
        "steady state not checked after the method"], id="interrupted"),
    pytest.param("rollbacks-not-played", ["rollback(s) did not run: free-the-store-disk"],
                 id="declared rollbacks never played"),
])
def test_judge(journal: str, expected: list[str]) -> None:
    assert judge(load(journal)) == expected


def test_a_tolerated_method_failure_passes_and_only_that_one() -> None:
    j = load("method-failed")
    j["experiment"]["extensions"] = [{"name": "apiary", "tolerated_failures": ["inflight-job-succeeds-unrestarted"]}]
    assert judge(j) == []
    other = copy.deepcopy(j)
    other["experiment"]["extensions"][0]["tolerated_failures"] = ["kill-9-agent"]
    assert judge(other)[0].startswith("method activity inflight-job-succeeds-unrestarted failed")


def test_no_steady_state_at_all_fails() -> None:
    j = load("passed")
    j["steady_states"] = {"before": None, "after": None, "during": []}
    assert judge(j) == ["steady state not checked before the method"]


def test_phase_durations() -> None:
    d = phase_durations(load("passed-with-rollbacks"))
    assert set(d) == {"before", "method", "after", "rollbacks", "total"}
    assert all(v > 0 for k, v in d.items() if k != "rollbacks")
    # pauses (the disk stays full for 4 s) count in the total, not in any activity
    assert d["total"] >= d["before"] + d["method"] + d["after"] + d["rollbacks"]
