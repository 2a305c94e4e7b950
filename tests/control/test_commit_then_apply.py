"""Commit, then apply: a store that refuses commits never leaves memory claiming what it does not hold.

The store is real (SQLite); :class:`tests.support.plane.FlakySession` makes chosen commits fail with
the error a full disk gives SQLite (``database or disk is full``). After every step the harness checks
``ControlPlane.check_consistency()`` (store and scheduler agree) besides the cluster invariants.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.support.auth import with_auth
from tests.support.builders import job_text
from tests.support.plane import CAROL, DAN, Harness

from apiary.api import create_app
from apiary.errors import UnavailableError

DISK_FULL = "database or disk is full"


@pytest.fixture
def h1(tmp_path: Path) -> Harness:
    """The one-VC config: VC default = hostname-carol + hostname-dan, one GPU each."""
    return Harness(tmp_path, "one-vc")


def in_default(n: int, user: str, **changes) -> tuple[str, str]:
    return job_text(n, **{"defaults.virtualCluster": "default", **changes}), user


def test_a_commit_failing_in_the_middle_of_a_cycle_leaves_store_and_scheduler_agreeing(h1: Harness) -> None:
    h = h1
    first = h.submit(0, user="alice", defaults__virtualCluster="default")
    second = h.submit(0, user="bob", defaults__virtualCluster="default")
    h.fault.fail_commits(2)  # the cycle's first job commits, the second job's commit fails
    with pytest.raises(UnavailableError, match=DISK_FULL):
        h.plane.cycle()
    h.check_invariants()  # includes check_consistency() == []
    assert h.task(first)["state"] == "STARTING"
    assert h.task(second)["state"] == "WAITING" and h.task(second)["node"] is None
    # The scheduler holds exactly the committed placement: one GPU busy, one free.
    status = h.plane.cluster_status("default")["virtualClusters"]["default"]
    assert status["used"] == 1 and status["free"] == 1
    # The next cycle (the store works again) places the second job on the other node.
    assert h.cycle().placed == [second]
    assert {h.task(first)["node"], h.task(second)["node"]} == {CAROL, DAN}


def test_a_failed_preemption_commit_leaves_no_reservation_behind(h1: Harness) -> None:
    h = h1
    low = h.submit(7, user="alice", extras__hivedScheduler__jobPriorityClass="test")  # 2 x 1 GPU, incremental
    h.cycle()
    h.start(low, 0)
    h.start(low, 1)
    high = h.submit(5, user="bob")  # prod, 1 GPU: preempts the test job
    h.fault.fail_commits(1)
    with pytest.raises(UnavailableError, match=DISK_FULL):
        h.plane.cycle()
    h.check_invariants()
    assert h.plane.cluster_status()["reservations"] == {}  # the scheduler was rebuilt from the store
    assert all(a["desired"] == "RUN" for n in h.nodes for a in h.plane.assignments(n))
    result = h.cycle()
    assert result.preempted == [low] and high in result.waiting


def test_a_full_disk_for_a_while_loses_nothing_and_strands_no_job(h1: Harness) -> None:
    """The issue's case: tasks end (one with 137) and jobs wait while every commit fails; once the
    disk has room again, the agents' resent reports and the next cycles finish everything."""
    h = h1
    a = h.submit(0, user="alice", defaults__virtualCluster="default")
    b = h.submit(0, user="bob", defaults__virtualCluster="default")
    h.cycle()
    h.start(a)
    h.start(b)
    c = h.submit(0, user="carol", defaults__virtualCluster="default")
    d = h.submit(0, user="dave", defaults__virtualCluster="default")
    before = {j["id"]: j["state"] for j in h.plane.list_jobs()}

    h.fault.failing = True
    # A submission answers 503 naming the cause, and nothing of it is kept.
    with pytest.raises(UnavailableError, match=DISK_FULL):
        h.plane.submit(job_text(0, **{"defaults.virtualCluster": "default"}), "erin")
    # The runs end; their reports cannot be stored: the agent keeps them to resend.
    with pytest.raises(UnavailableError, match=DISK_FULL):
        h.exit(a, 0)
    with pytest.raises(UnavailableError, match=DISK_FULL):
        h.exit(b, 137)
    for _ in range(3):
        with pytest.raises(UnavailableError, match=DISK_FULL):
            h.plane.cycle()
        h.check_invariants()
    assert {j["id"]: j["state"] for j in h.plane.list_jobs()} == before
    assert h.fault.failed >= 6

    h.fault.failing = False
    h.exit(a, 0)  # the agent resends
    h.exit(b, 137)  # transient: a platform retry
    assert h.job(a)["state"] == "SUCCEEDED"
    assert h.job(b)["state"] == "WAITING" and h.job(b)["retryDetails"] == {"user": 0, "platform": 1}
    # Both GPUs are free in the scheduler, not held by anything the store lost: the retried job keeps
    # its place in the queue (FIFO by submission), then the oldest waiting one.
    assert h.cycle().placed == [b, c]
    for job_id in (b, c):
        h.start(job_id)
        h.exit(job_id, 0)
    assert h.cycle().placed == [d]
    h.start(d)
    h.exit(d, 0)
    assert {j["id"]: j["state"] for j in h.plane.list_jobs()} == {
        a: "SUCCEEDED", b: "SUCCEEDED", c: "SUCCEEDED", d: "SUCCEEDED"}
    erin = h.submit(0, user="erin", defaults__virtualCluster="default")  # the refused job, resubmitted
    assert h.cycle().placed == [erin]


def test_the_api_answers_503_with_the_cause_while_the_store_cannot_commit(h1: Harness) -> None:
    client = with_auth(TestClient(create_app(h1.plane)), h1.plane)
    body, user = in_default(0, "alice")
    h1.fault.failing = True
    r = client.post("/api/v2/jobs", content=body, headers={"X-Test-User": user})
    assert r.status_code == 503
    assert r.json()["code"] == "UnavailableError" and DISK_FULL in r.json()["message"]
    assert client.get("/api/v2/jobs").json() == []
    h1.fault.failing = False
    r = client.post("/api/v2/jobs", content=body, headers={"X-Test-User": user})
    assert r.status_code == 202 and r.json()["state"] == "WAITING"


def test_applying_a_committed_change_that_fails_rebuilds_the_scheduler(h1: Harness, monkeypatch) -> None:
    h = h1
    job = h.submit(0, user="alice", defaults__virtualCluster="default")
    real = type(h.plane.scheduler).allocate
    calls = []

    def broken(self, *args, **kwargs):  # the in-memory apply breaks once (a bug, a lost race)
        calls.append(args[0])
        if len(calls) == 1:
            raise RuntimeError("apply failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(h.plane.scheduler), "allocate", broken)
    assert h.cycle().placed == [job]  # committed; memory rebuilt from the store
    assert h.plane.check_consistency() == []
    assert h.plane.cluster_status("default")["virtualClusters"]["default"]["used"] == 1
