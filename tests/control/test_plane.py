"""The control plane driven by hand: a fake clock, fake node agents and explicit scheduling cycles
(:class:`tests.support.plane.Harness`).

After every submission, report and cycle the harness checks the cluster-wide invariants (no run on
two nodes, no GPU given to two live runs of one node, no task instance running twice) and that the
store and the scheduler agree (``ControlPlane.check_consistency``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select
from tests.support.builders import job_text
from tests.support.plane import CAROL, DAN, LAB6, Harness

from apiary.control import ControlPlane
from apiary.errors import ConflictError, NotFoundError, QuotaExceededError, ValidationError
from apiary.lifecycle import EXIT_NODE_LOST, EXIT_STOPPED, classify_exit
from apiary.spec.cluster import load_cluster_config
from apiary.store import Placement, make_engine, migrate, session_factory


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


@pytest.fixture
def h1(tmp_path: Path) -> Harness:
    """The one-VC config: VC default = hostname-carol + hostname-dan, one GPU each."""
    return Harness(tmp_path, "one-vc")


# ---------------------------------------------------------------------------------- basic lifecycle
def test_submit_waits_then_places_runs_and_succeeds(h: Harness) -> None:
    job = h.plane.submit(job_text(0), "alice")
    assert job["id"] == "alice~job-config-0"
    assert job["state"] == "WAITING"
    assert job["waitingReason"]
    assert job["tasks"] == [
        {
            "taskRole": "train", "index": 0, "attempt": 0, "taskAttempt": 0, "state": "WAITING", "node": None,
            "gpus": [], "simulatedGpus": None, "exitCode": None, "exitPhrase": None, "startTime": None,
            "completionTime": None,
        }
    ]
    jid = job["id"]

    h.tick(1)
    result = h.cycle()
    assert result.placed == [jid]
    assert result.preempted == []
    t = h.task(jid)
    assert (t["state"], t["node"], t["gpus"]) == ("STARTING", DAN, [0])  # vc1 is hostname-dan
    assert h.job(jid)["state"] == "WAITING"
    assert h.job(jid)["waitingReason"] is None
    (a,) = h.plane.assignments(DAN)
    assert a["desired"] == "RUN"
    assert a["runId"] == "alice~job-config-0.a0.train.0.t0"
    assert a["launch"]["gpus"] == [0]
    assert h.plane.assignments(CAROL) == []

    h.tick(1)
    h.start(jid)
    job = h.job(jid)
    assert job["state"] == "RUNNING"
    assert job["launchTime"] == "2023-11-14T22:13:22.000Z"
    assert job["completionTime"] is None
    assert h.task(jid)["state"] == "RUNNING"

    h.tick(10)
    h.exit(jid, 0)
    job = h.job(jid)
    assert job["state"] == "SUCCEEDED"
    assert job["exitCode"] == 0
    assert job["completionTime"] == "2023-11-14T22:13:32.000Z"
    assert job["retries"] == 0 and job["retryDetails"] == {"user": 0, "platform": 0}
    assert h.task(jid)["state"] == "SUCCEEDED" and h.task(jid)["exitCode"] == 0
    assert h.plane.assignments(DAN) == []
    assert h.event_types(jid) == ["job.submitted", "job.placed", "task.started", "task.exited", "job.completed"]
    seqs = [e["seq"] for e in h.plane.events(job_id=jid)]
    assert seqs == sorted(seqs)
    # The GPU is free again: the next vc1 job is placed at once.
    jid2 = h.submit(0, user="bob")
    assert h.cycle().placed == [jid2]


def test_exit_reported_twice_is_applied_once(h: Harness) -> None:
    jid = h.submit(0)
    h.cycle()
    run_id = h.start(jid)
    ack = h.report(DAN, [h.status(run_id, "exited", 0)])
    assert ack == {"ack": [run_id]}
    before = h.plane.events(job_id=jid)
    ack = h.report(DAN, [h.status(run_id, "exited", 0), h.status(run_id, "running")])
    assert ack == {"ack": [run_id, run_id]}
    assert h.plane.events(job_id=jid) == before
    assert h.job(jid)["state"] == "SUCCEEDED"


def test_run_reported_by_another_node_is_ignored(h: Harness) -> None:
    jid = h.submit(0)
    h.cycle()
    run_id = h.find(jid)["runId"]
    # hostname-carol does not run this task: it is told to forget it and the task does not move.
    assert h.report(CAROL, [h.status(run_id, "exited", 1)]) == {"ack": [run_id]}
    assert h.task(jid)["state"] == "STARTING"
    assert h.job(jid)["state"] == "WAITING"


def test_unknown_node_report_is_rejected(h: Harness) -> None:
    with pytest.raises(NotFoundError, match="hostname-eve"):
        h.plane.node_report("hostname-eve", gpus=1, simulated_gpus=True, address="x", agent_id="t", runs=[])


def test_nodes_are_unhealthy_until_they_report(tmp_path: Path) -> None:
    h = Harness(tmp_path, report_nodes=False)
    jid = h.submit(0)
    result = h.cycle()
    assert result.placed == []
    assert "unhealthy" in result.waiting[jid]
    assert h.job(jid)["waitingReason"] == result.waiting[jid]
    assert h.events(jid, "job.waiting")[0]["reason"] == result.waiting[jid]
    h.report(DAN)
    assert h.cycle().placed == [jid]
    nodes = {n["name"]: n for n in h.plane.list_nodes()}
    assert nodes[DAN]["ready"] is True and nodes[DAN]["gpusUsed"] == 1
    assert nodes[CAROL]["ready"] is False and nodes[CAROL]["gpusUsed"] == 0


# ---------------------------------------------------------------------------------- retries
@pytest.mark.parametrize(
    ("job_retry_count", "code", "user_retries", "state"),
    [
        pytest.param(2, 1, 2, "FAILED", id="exit1-jobRetryCount2-retried-twice-then-failed"),
        pytest.param(0, 1, 0, "FAILED", id="exit1-jobRetryCount0-fails-at-once"),
        pytest.param(2, -1200, 0, "FAILED", id="permanent-1200-UserContainerDockerOOMKilled-never-retried"),
        pytest.param(2, 221, 0, "FAILED", id="permanent-221-ContainerTensorflowOOMKilled-never-retried"),
    ],
)
def test_job_retry_count(h: Harness, job_retry_count: int, code: int, user_retries: int, state: str) -> None:
    assert classify_exit(code).reaction == ("RETRY_TO_MAX" if code == 1 else "NEVER_RETRY")
    jid = h.submit(0, jobRetryCount=job_retry_count)
    for attempt in range(user_retries + 1):
        h.cycle()
        job = h.job(jid)
        assert job["attempt"] == attempt
        assert job["tasks"][0]["state"] == "STARTING"
        run_id = h.start(jid)
        assert run_id == f"{jid}.a{attempt}.train.0.t0"
        h.tick(5)
        h.exit(jid, code)
        job = h.job(jid)
        if attempt < user_retries:
            assert job["state"] == "WAITING", f"attempt {attempt}"
            assert job["attempt"] == attempt + 1
            assert job["retryDetails"] == {"user": attempt + 1, "platform": 0}
            assert job["waitingReason"].startswith("Retrying (user retry)")
            assert [t["state"] for t in job["tasks"]] == ["WAITING"]
    job = h.job(jid)
    assert job["state"] == state
    assert job["exitCode"] == code
    assert job["exitPhrase"] == classify_exit(code).phrase
    assert job["retryDetails"] == {"user": user_retries, "platform": 0}
    assert job["retries"] == user_retries
    assert job["attempt"] == user_retries
    assert len(h.events(jid, "job.retry")) == user_retries
    assert h.events(jid, "job.completed") == [{"state": state, "exitCode": code, "attempt": user_retries}]
    assert h.cycle().placed == []  # nothing left to run
    assert h.plane.assignments(DAN) == []


def test_transient_exit_is_a_platform_retry_not_counted_against_job_retry_count(h: Harness) -> None:
    assert classify_exit(137).reaction == "ALWAYS_RETRY"
    jid = h.submit(0, jobRetryCount=0)  # gangAllocation defaults to true
    h.cycle()
    h.start(jid)
    h.exit(jid, 137)
    job = h.job(jid)
    assert job["state"] == "WAITING"
    assert job["attempt"] == 1
    assert job["retryDetails"] == {"user": 0, "platform": 1}
    h.cycle()
    h.start(jid)
    h.exit(jid, 0)
    assert h.job(jid)["state"] == "SUCCEEDED"


def test_transient_exit_is_retried_without_using_job_retry_count(h: Harness) -> None:
    """What holds today for 137 whatever the retry path: the job is not failed and jobRetryCount is untouched."""
    jid = h.submit(0, jobRetryCount=0)
    h.cycle()
    first = h.start(jid)
    h.exit(jid, 137)
    job = h.job(jid)
    assert job["state"] in ("WAITING", "RUNNING")
    assert job["retryDetails"]["user"] == 0
    h.cycle()
    second = h.start(jid)
    assert second != first
    h.exit(jid, 0)
    job = h.job(jid)
    assert job["state"] == "SUCCEEDED"
    assert job["retryDetails"]["user"] == 0


@pytest.mark.parametrize(
    ("codes", "final_state", "task_attempts"),
    [
        pytest.param([1, 0], "SUCCEEDED", 2, id="fails-once-then-succeeds-in-place"),
        pytest.param([1, 1, 1], "FAILED", 3, id="taskRetryCount2-used-up-then-job-fails"),
        pytest.param([221], "FAILED", 1, id="permanent-code-is-not-retried-in-place"),
    ],
)
def test_task_retry_count_retries_in_place(h: Harness, codes: list[int], final_state: str, task_attempts: int) -> None:
    # OpenPAI honours taskRetryCount when extras.gangAllocation is false.
    jid = h.submit(0, taskRoles__train__taskRetryCount=2, extras__gangAllocation=False)
    h.cycle()
    run_ids = []
    for i, code in enumerate(codes):
        t = h.task(jid)
        assert (t["attempt"], t["taskAttempt"], t["node"], t["gpus"]) == (0, i, DAN, [0])
        assert t["state"] == "STARTING"
        run_ids.append(h.start(jid))
        h.tick(3)
        h.exit(jid, code)
        if i < len(codes) - 1:
            # Retried in place: no scheduling cycle needed, same node and cells, same job attempt.
            job = h.job(jid)
            assert job["state"] == "RUNNING"
            assert job["attempt"] == 0
            assert job["retryDetails"] == {"user": 0, "platform": 0}
    assert run_ids == [f"{jid}.a0.train.0.t{i}" for i in range(task_attempts)]
    job = h.job(jid)
    assert job["state"] == final_state
    assert job["attempt"] == 0
    assert job["exitCode"] == codes[-1]
    assert len(h.events(jid, "task.exited")) == task_attempts
    assert h.plane.assignments(DAN) == []


# ---------------------------------------------------------------------------------- completion policy
@pytest.mark.parametrize(
    ("stop_code", "stopped"),
    [
        pytest.param(None, True, id="killed-no-exit-code"),
        pytest.param(143, True, id="sigterm-143"),
        pytest.param(137, False, id="sigkill-137"),
    ],
)
def test_min_succeeded_instances_stops_the_other_instance(
    h1: Harness, stop_code: int | None, stopped: bool
) -> None:
    h = h1
    jid = h.submit(6)  # 2 instances, gang, minSucceededInstances 1, VC default (2 GPUs)
    assert h.cycle().placed == [jid]
    nodes = {h.task(jid, i)["node"] for i in (0, 1)}
    assert nodes == {CAROL, DAN}
    h.start(jid, 0)
    h.start(jid, 1)
    h.tick(5)
    h.exit(jid, 0, index=0)
    job = h.job(jid)
    assert job["state"] == "RUNNING"  # decided, but the other instance has not ended yet
    assert job["completionTime"] is None
    other = h.find(jid, 1)
    assert other["desired"] == "STOP"
    assert h.find(jid, 0) is None
    # The stop is idempotent from the scheduler's side: no re-placement while it ends.
    assert h.cycle().placed == []

    h.tick(1)
    h.exit(jid, stop_code, index=1, stopped=stopped)
    job = h.job(jid)
    assert job["state"] == "SUCCEEDED"
    assert job["exitCode"] == 0
    assert [t["state"] for t in job["tasks"]] == ["SUCCEEDED", "STOPPED"]
    expected = EXIT_STOPPED if stop_code is None else stop_code
    assert job["tasks"][1]["exitCode"] == expected
    assert job["retryDetails"] == {"user": 0, "platform": 0}
    assert h.find(jid, 1) is None
    assert all(n["gpusUsed"] == 0 for n in h.plane.list_nodes())


def test_min_failed_instances_fails_the_job_and_stops_the_other_instance(h1: Harness) -> None:
    h = h1
    jid = h.submit(6)
    h.cycle()
    h.start(jid, 0)
    h.start(jid, 1)
    h.exit(jid, 1, index=1)
    assert h.job(jid)["state"] == "RUNNING"
    assert h.find(jid, 0)["desired"] == "STOP"
    h.exit(jid, None, index=0, stopped=True)
    job = h.job(jid)
    assert job["state"] == "FAILED"
    assert job["exitCode"] == 1
    assert [t["state"] for t in job["tasks"]] == ["STOPPED", "FAILED"]


# ---------------------------------------------------------------------------------- incremental
def test_incremental_job_places_what_fits_and_the_rest_later(h1: Harness) -> None:
    h = h1
    jid = h.submit(7, taskRoles__train__instances=4, taskRoles__train__completion__minSucceededInstances=-1)
    result = h.cycle()
    assert result.placed == [jid]
    assert jid in result.waiting  # two of four placed; the job says why the rest wait
    states = [t["state"] for t in h.job(jid)["tasks"]]
    assert sorted(states) == ["STARTING", "STARTING", "WAITING", "WAITING"]
    assert h.job(jid)["waitingReason"]
    placed = [t["index"] for t in h.job(jid)["tasks"] if t["state"] == "STARTING"]
    for i in placed:
        h.start(jid, i)
    assert h.job(jid)["state"] == "RUNNING"
    assert h.cycle().placed == []
    for i in placed:
        h.exit(jid, 0, index=i)
    assert h.job(jid)["state"] == "RUNNING"  # minSucceededInstances -1: all four must finish
    assert h.cycle().placed == [jid]
    rest = [t["index"] for t in h.job(jid)["tasks"] if t["state"] == "STARTING"]
    assert sorted(rest + placed) == [0, 1, 2, 3]
    for i in rest:
        h.start(jid, i)
        h.exit(jid, 0, index=i)
    job = h.job(jid)
    assert job["state"] == "SUCCEEDED"
    assert [t["state"] for t in job["tasks"]] == ["SUCCEEDED"] * 4


def test_gang_job_larger_than_its_vc_is_rejected(h1: Harness) -> None:
    with pytest.raises(QuotaExceededError, match="Job requests 4 SKUs, exceeds maximum 2 SKUs in VC default."):
        h1.submit(6, taskRoles__train__instances=4)
    assert h1.plane.list_jobs() == []


# ---------------------------------------------------------------------------------- preemption
def test_prod_job_preempts_test_job_in_vc1(h: Harness) -> None:
    low = h.submit(1, user="alice")  # test priority, vc1
    assert h.cycle().placed == [low]
    low_run = h.start(low)
    assert h.task(low)["node"] == DAN

    h.tick(1)
    high = h.submit(2, user="bob")  # prod priority, vc1
    result = h.cycle()
    assert result.preempted == [low]
    assert result.placed == []
    assert high in result.waiting
    (a,) = h.plane.assignments(DAN)  # the victim still holds the GPU, now told to stop
    assert (a["runId"], a["desired"]) == (low_run, "STOP")
    assert h.job(low)["state"] == "RUNNING"
    assert h.job(high)["state"] == "WAITING"
    assert h.events(low, "job.preempted")[0]["by"] == high

    # Until the victim's exit is reported its cells stay taken: more cycles place nothing.
    for _ in range(2):
        result = h.cycle()
        assert result.placed == [] and result.preempted == []
        assert len(h.plane.assignments(DAN)) == 1

    h.tick(1)
    h.exit(low, None, stopped=True)
    job = h.job(low)
    assert job["state"] == "WAITING"
    assert job["attempt"] == 1
    assert job["retryDetails"] == {"user": 0, "platform": 1}
    assert job["tasks"][0]["state"] == "WAITING"
    assert h.plane.assignments(DAN) == []

    result = h.cycle()
    assert result.placed == [high]
    assert low in result.waiting  # a test job cannot preempt a prod job
    assert result.preempted == []
    (a,) = h.plane.assignments(DAN)
    assert a["launch"]["job_id"] == high and a["desired"] == "RUN"
    assert h.task(high)["node"] == DAN

    h.start(high)
    h.exit(high, 0)
    assert h.job(high)["state"] == "SUCCEEDED"
    assert h.cycle().placed == [low]
    run = h.start(low)
    assert run == f"{low}.a1.train.0.t0"
    h.exit(low, 0)
    job = h.job(low)
    assert job["state"] == "SUCCEEDED"
    assert job["retryDetails"] == {"user": 0, "platform": 1}


def test_opportunistic_job_borrows_an_idle_vc_and_is_preempted_by_its_owner(h: Harness) -> None:
    prod = h.submit(3)  # prod, vc1 -> hostname-dan
    h.cycle()
    h.start(prod)
    oppo = h.submit(4, user="bob")  # oppo, vc1 full -> borrows idle hostname-carol (VC default)
    assert h.cycle().placed == [oppo]
    assert h.task(oppo)["node"] == CAROL
    h.start(oppo)
    owner = h.submit(5, user="carol", name="test-in-default", extras__hivedScheduler__jobPriorityClass="test")
    result = h.cycle()
    assert result.preempted == [oppo]
    assert h.find(oppo)["desired"] == "STOP"
    h.exit(oppo, None, stopped=True)
    assert h.job(oppo)["retryDetails"] == {"user": 0, "platform": 1}
    assert h.cycle().placed == [owner]
    assert h.task(owner)["node"] == CAROL
    assert h.task(oppo)["state"] == "WAITING"
    h.start(owner)
    h.exit(owner, 0)
    assert h.cycle().placed == [oppo]
    h.start(oppo)
    h.exit(oppo, 0)
    assert h.job(oppo)["state"] == "SUCCEEDED"


def test_preempting_a_job_that_never_started(h: Harness) -> None:
    low = h.submit(1)
    h.cycle()  # STARTING on hostname-dan, never reported running
    high = h.submit(2, user="bob")
    assert h.cycle().preempted == [low]
    assert h.find(low)["desired"] == "STOP"
    h.exit(low, None, stopped=True)
    job = h.job(low)
    assert job["state"] == "WAITING" and job["retryDetails"]["platform"] == 1
    assert h.cycle().placed == [high]


# ---------------------------------------------------------------------------------- stop
def test_stop_waiting_job_is_stopped_at_once(h: Harness) -> None:
    jid = h.submit(0)
    job = h.plane.stop(jid)
    assert job["state"] == "STOPPED"
    assert job["executionType"] == "STOP"
    assert job["exitCode"] == EXIT_STOPPED
    assert job["completionTime"] is not None
    assert [t["state"] for t in job["tasks"]] == ["STOPPED"]
    assert h.cycle().placed == []
    assert h.plane.stop(jid) == job
    assert h.event_types(jid) == ["job.submitted", "job.stop_requested", "job.completed"]


@pytest.mark.parametrize("running", [True, False], ids=["running", "starting"])
def test_stop_placed_job_asks_the_task_to_stop_then_stops(h: Harness, running: bool) -> None:
    jid = h.submit(0)
    h.cycle()
    if running:
        h.start(jid)
    state = h.job(jid)["state"]
    job = h.plane.stop(jid)
    assert job["state"] == state  # not final until the task's exit is reported
    assert job["executionType"] == "STOP"
    assert h.find(jid)["desired"] == "STOP"
    assert h.plane.stop(jid) == job  # idempotent
    assert h.event_types(jid).count("job.stop_requested") == 1
    assert h.cycle().placed == []
    h.exit(jid, None, stopped=True)
    job = h.job(jid)
    assert job["state"] == "STOPPED"
    assert job["exitCode"] == EXIT_STOPPED
    assert job["tasks"][0]["state"] == "STOPPED"
    assert job["retryDetails"] == {"user": 0, "platform": 0}
    assert h.plane.assignments(DAN) == []
    assert h.plane.stop(jid) == job


def test_stop_during_preemption_is_not_retried(h: Harness) -> None:
    low = h.submit(1)
    h.cycle()
    h.start(low)
    high = h.submit(2, user="bob")
    assert h.cycle().preempted == [low]
    h.plane.stop(low)
    h.exit(low, None, stopped=True)
    job = h.job(low)
    assert job["state"] == "STOPPED"
    assert job["retryDetails"] == {"user": 0, "platform": 0}
    assert h.cycle().placed == [high]


def test_finished_job_stop_is_a_no_op(h: Harness) -> None:
    jid = h.submit(0)
    h.cycle()
    h.start(jid)
    h.exit(jid, 0)
    job = h.job(jid)
    assert h.plane.stop(jid) == job
    assert "job.stop_requested" not in h.event_types(jid)


def test_stop_unknown_job_is_not_found(h: Harness) -> None:
    with pytest.raises(NotFoundError):
        h.plane.stop("alice~nope")
    with pytest.raises(NotFoundError):
        h.plane.get_job("alice~nope")


# ---------------------------------------------------------------------------------- node loss
def lose(h: Harness, node: str, after: float = 31.0) -> None:
    """Let ``after`` seconds pass in which every node but ``node`` reports."""
    h.tick(after)
    h.report_all(except_=[node])


def test_node_is_lost_only_after_the_timeout(h: Harness) -> None:
    jid = h.submit(0)
    h.cycle()
    h.start(jid)
    lose(h, DAN, after=30)  # exactly node_lost_after_s: not lost yet
    h.cycle()
    assert h.task(jid)["state"] == "RUNNING"
    assert {n["name"]: n["healthy"] for n in h.plane.list_nodes()}[DAN] is True


def test_lost_node_fails_its_task_with_exit_node_lost_as_a_platform_retry(h: Harness) -> None:
    """What a node loss decides about the lost attempt (holds with and without the bug below)."""
    jid = h.submit(0)
    h.cycle()
    old_run = h.start(jid)
    lose(h, DAN)
    h.cycle()
    job = h.job(jid)
    assert job["state"] == "WAITING"
    assert job["attempt"] == 1
    assert job["retryDetails"] == {"user": 0, "platform": 1}
    assert job["exitCode"] is None and job["completionTime"] is None
    exited = h.events(jid, "task.exited")
    assert [(e["exitCode"], e["state"], e["attempt"]) for e in exited] == [(EXIT_NODE_LOST, "FAILED", 0)]
    assert h.events(jid, "job.retry")[0]["kind"] == "platform"
    assert h.plane.assignments(DAN) == []
    nodes = {n["name"]: n for n in h.plane.list_nodes()}
    assert nodes[DAN]["healthy"] is False and nodes[DAN]["ready"] is False and nodes[DAN]["gpusUsed"] == 0
    # The node comes back still believing it runs the lost run: it is told to forget it.
    assert h.report(DAN, [h.status(old_run, "running")]) == {"ack": [old_run]}
    assert h.find(jid) is None or h.find(jid)["runId"] != old_run


def test_job_on_a_lost_node_is_placed_again_when_the_node_returns(h: Harness) -> None:
    jid = h.submit(0)
    h.cycle()
    h.start(jid)
    lose(h, DAN)
    result = h.cycle()
    assert [t["state"] for t in h.job(jid)["tasks"]] == ["WAITING"]
    assert result.placed == []  # vc1 has only hostname-dan, which is not placed on while lost
    assert "unhealthy" in result.waiting[jid]
    assert h.cycle().placed == []
    h.report(DAN)
    assert h.cycle().placed == [jid]
    assert h.start(jid) == f"{jid}.a1.train.0.t0"
    h.exit(jid, 0)
    assert h.job(jid)["state"] == "SUCCEEDED"


def test_lost_node_is_not_placed_on_until_it_reports_again(h1: Harness) -> None:
    h = h1
    lose(h, DAN)
    h.cycle()
    first = h.submit(0, defaults__virtualCluster="default")
    second = h.submit(0, user="bob", defaults__virtualCluster="default")
    result = h.cycle()
    assert result.placed == [first]
    assert h.task(first)["node"] == CAROL
    assert "unhealthy" in result.waiting[second]
    h.report_all(except_=[DAN])
    assert h.cycle().placed == []
    assert h.plane.assignments(DAN) == []
    h.report(DAN)
    assert h.cycle().placed == [second]
    assert h.task(second)["node"] == DAN


def test_lost_node_of_a_two_node_job_stops_the_other_instance(h1: Harness) -> None:
    h = h1
    jid = h.submit(6)
    h.cycle()
    h.start(jid, 0)
    h.start(jid, 1)
    lost = h.task(jid, 1)["node"]
    alive = h.task(jid, 0)["node"]
    h.tick(31)
    h.report(alive)
    h.cycle()
    assert h.find(jid, 0)["desired"] == "STOP"
    assert h.find(jid, 1) is None
    assert h.job(jid)["state"] == "RUNNING"
    h.exit(jid, None, index=0, stopped=True)
    job = h.job(jid)
    assert job["state"] == "WAITING"
    assert job["retryDetails"] == {"user": 0, "platform": 1}
    # Only one healthy node: the gang of two cannot be placed until the lost node reports again.
    assert h.cycle().placed == []
    h.report(lost)
    assert h.cycle().placed == [jid]


# ---------------------------------------------------------------------------------- restart
def test_restart_keeps_every_job_and_placement(h: Harness) -> None:
    # running: job-config-5 (prod, VC default) on hostname-carol
    running = h.submit(5)
    # preempting: job-config-1 (test, vc1) on hostname-dan, preempted by job-config-2 (prod, vc1)
    victim = h.submit(1)
    h.cycle()
    running_run = h.start(running)
    victim_run = h.start(victim)
    preemptor = h.submit(2, user="bob")
    assert h.cycle().preempted == [victim]
    # waiting: a second prod job in vc1 behind job-config-2
    waiting = h.submit(0, user="carol")
    # finished: a stopped job
    stopped = h.submit(0, user="dave")
    h.plane.stop(stopped)
    h.cycle()

    before = {j["id"]: j for j in h.plane.list_jobs()}
    assert {j: before[j]["state"] for j in before} == {
        running: "RUNNING", victim: "RUNNING", preemptor: "WAITING", waiting: "WAITING", stopped: "STOPPED",
    }
    assignments_before = {n: h.plane.assignments(n) for n in h.nodes}

    # kill -9 + restart: a new control plane over the same database, well past the node-lost timeout.
    h.tick(120)
    h = h.restart()
    assert {j["id"]: j for j in h.plane.list_jobs()} == before
    assert {n: h.plane.assignments(n) for n in h.nodes} == assignments_before
    assert h.find(victim)["desired"] == "STOP"
    assert h.find(running)["desired"] == "RUN"
    # A restart never declares nodes lost: they get a fresh grace period.
    h.cycle()
    assert h.job(running)["state"] == "RUNNING" and h.task(running)["state"] == "RUNNING"

    # The agents report what they run; the scheduler must not hand the busy cells to anyone.
    h.report(CAROL, [h.status(running_run, "running")])
    h.report(DAN, [h.status(victim_run, "running")])
    other = h.submit(5, user="erin")  # prod in VC default: hostname-carol is busy with an equal priority
    result = h.cycle()
    assert result.placed == []
    assert result.preempted == []
    assert {other, preemptor, waiting} <= set(result.waiting)
    assert len(h.plane.assignments(CAROL)) == 1 and len(h.plane.assignments(DAN)) == 1

    # The preemption completes after the restart.
    h.exit(victim, None, stopped=True)
    job = h.job(victim)
    assert job["state"] == "WAITING" and job["retryDetails"] == {"user": 0, "platform": 1}
    assert h.cycle().placed == [preemptor]
    assert h.task(preemptor)["node"] == DAN

    # The job that ran across the restart completes with its original run.
    h.exit(running, 0)
    assert h.job(running)["state"] == "SUCCEEDED"
    assert h.cycle().placed == [other]
    assert h.task(other)["node"] == CAROL

    for jid in (preemptor, other):
        h.start(jid)
        h.exit(jid, 0)
    h.cycle()
    for jid in (waiting, victim):
        assert h.task(jid)["node"] == DAN, jid
        h.start(jid)
        h.exit(jid, 0)
        h.cycle()
    states = {j["id"]: j["state"] for j in h.plane.list_jobs()}
    assert states == {
        running: "SUCCEEDED", victim: "SUCCEEDED", preemptor: "SUCCEEDED", waiting: "SUCCEEDED",
        stopped: "STOPPED", other: "SUCCEEDED",
    }
    # Every run id was given to exactly one node, and every placement was released.
    assert len(h.run_nodes) == len(set(h.run_nodes))
    with h.sessions() as s:
        assert list(s.scalars(select(Placement).where(Placement.released.is_(False)))) == []


def test_after_a_restart_a_node_that_never_reports_again_is_lost_after_the_grace_period(h: Harness) -> None:
    jid = h.submit(0)
    h.cycle()
    h.start(jid)
    h = h.restart()
    h.report(CAROL)
    h.tick(20)
    h.report(CAROL)
    h.cycle()
    assert h.job(jid)["state"] == "RUNNING"  # within the fresh grace period
    h.tick(11)
    h.report(CAROL)
    h.cycle()
    job = h.job(jid)
    assert job["retryDetails"] == {"user": 0, "platform": 1}
    assert [e["exitCode"] for e in h.events(jid, "task.exited")] == [EXIT_NODE_LOST]
    assert h.plane.assignments(DAN) == []


def test_restart_in_the_middle_of_a_completion_policy_stop(tmp_path: Path) -> None:
    h = Harness(tmp_path, "one-vc")
    jid = h.submit(6)
    h.cycle()
    h.start(jid, 0)
    h.start(jid, 1)
    h.exit(jid, 0, index=0)
    h = h.restart()
    h.report_all()
    assert h.job(jid)["state"] == "RUNNING"
    assert h.find(jid, 1)["desired"] == "STOP"
    other = h.submit(0, user="bob", defaults__virtualCluster="default")
    h.cycle()
    # Only the GPU freed by the finished instance can be used; the stopping one is still held.
    assert h.task(other)["node"] == h.task(jid, 0)["node"]
    h.exit(jid, None, index=1, stopped=True)
    assert h.job(jid)["state"] == "SUCCEEDED"


# ---------------------------------------------------------------------------------- names
def test_duplicate_job_name_conflicts_per_user(h: Harness) -> None:
    h.submit(0, user="alice")
    with pytest.raises(ConflictError, match="job-config-0"):
        h.submit(0, user="alice")
    assert h.submit(0, user="bob") == "bob~job-config-0"
    assert [j["id"] for j in h.plane.list_jobs()] == ["alice~job-config-0", "bob~job-config-0"]
    # A finished job keeps its name taken, as in OpenPAI.
    h.plane.stop("alice~job-config-0")
    with pytest.raises(ConflictError):
        h.submit(0, user="alice")


@pytest.mark.parametrize(
    ("user", "changes", "field"),
    [
        pytest.param("bad user", {}, "user", id="user-with-space"),
        pytest.param("", {}, "user", id="empty-user"),
        pytest.param("alice", {"defaults.virtualCluster": "nope"}, "defaults.virtualCluster", id="unknown-vc"),
        pytest.param("alice", {"taskRoles.train.resourcePerInstance.gpu": -1},
                     "taskRoles.train.resourcePerInstance.gpu", id="negative-gpu"),
        pytest.param("alice", {"taskRoles.train.commands": ["echo <% $parameters.nope %>"]},
                     "taskRoles.train.commands[0]", id="unknown-template-reference"),
    ],
)
def test_invalid_submissions_leave_nothing_behind(h: Harness, user: str, changes: dict, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        h.plane.submit(job_text(0, **changes), user)
    assert err.value.field == field
    assert field in err.value.message
    assert h.plane.list_jobs() == []
    assert h.plane.events() == []


def test_list_jobs_filters(h: Harness) -> None:
    a = h.submit(0, user="alice")
    b = h.submit(5, user="bob")
    h.cycle()
    h.start(b)
    assert [j["id"] for j in h.plane.list_jobs(user="alice")] == [a]
    assert [j["id"] for j in h.plane.list_jobs(virtual_cluster="default")] == [b]
    assert [j["id"] for j in h.plane.list_jobs(state="running")] == [b]
    assert [j["id"] for j in h.plane.list_jobs(state="STARTING")] == []
    assert {j["id"] for j in h.plane.list_jobs()} == {a, b}


# ---------------------------------------------------------------------------------- logs
def test_append_log_is_idempotent_over_overlaps_and_read_logs_returns_the_text(h: Harness) -> None:
    jid = h.submit(0)
    h.cycle()
    run_id = h.start(jid)
    assert h.plane.append_log(run_id, "stdout", 0, b"hello ") == 6
    assert h.plane.append_log(run_id, "stdout", 0, b"hello ") == 6  # resend: skipped
    assert h.plane.append_log(run_id, "stdout", 3, b"lo world\n") == 12  # overlap: only the new part is kept
    assert h.plane.append_log(run_id, "stdout", 6, b"world\n") == 12
    assert h.plane.append_log(run_id, "stderr", 0, b"warn\n") == 5
    assert h.plane.read_logs(jid) == "hello world\n"
    assert h.plane.read_logs(jid, offset=6) == "world\n"
    assert h.plane.read_logs(jid, stream="stderr") == "warn\n"
    assert h.plane.read_logs(jid, stream="all") == "hello world\nwarn\n"
    with pytest.raises(ValidationError, match="stream"):
        h.plane.append_log(run_id, "bogus", 0, b"x")
    with pytest.raises(ValidationError, match="stream"):
        h.plane.read_logs(jid, stream="bogus")
    with pytest.raises(ValidationError, match="taskRole"):
        h.plane.read_logs(jid, task_role="nope")
    with pytest.raises(NotFoundError):
        h.plane.read_logs("alice~nope")


def test_read_logs_concatenates_the_runs_of_an_instance(h: Harness) -> None:
    jid = h.submit(0, jobRetryCount=1)
    h.cycle()
    first = h.start(jid)
    h.plane.append_log(first, "stdout", 0, b"try 1\n")
    h.exit(jid, 1)
    h.cycle()
    second = h.start(jid)
    h.plane.append_log(second, "stdout", 0, b"try 2\n")
    assert h.plane.read_logs(jid) == "try 1\ntry 2\n"
    assert h.plane.read_logs(jid, attempt=1) == "try 2\n"
    assert h.plane.read_logs(jid, attempt=0) == "try 1\n"


def test_cordoned_node_gets_no_new_placements_and_keeps_its_running_task(h1: Harness) -> None:
    first = h1.submit(5, user="alice")
    h1.cycle()
    node = h1.task(first)["node"]
    h1.start(first)
    h1.plane.cordon(node)
    assert next(n for n in h1.plane.list_nodes() if n["name"] == node)["cordoned"] is True
    h1.report_all()  # heartbeats must not undo a cordon
    second = h1.submit(7, user="bob")  # 2 instances, gangAllocation false
    h1.cycle()
    placed = {t["node"] for t in h1.job(second)["tasks"] if t["node"]}
    assert placed and node not in placed  # only the other node is used
    assert h1.job(first)["state"] == "RUNNING"  # cordon never stops running work
    h1.plane.cordon(node, False)
    h1.exit(first, 0)
    h1.cycle()
    assert {t["node"] for t in h1.job(second)["tasks"]} == {"hostname-carol", "hostname-dan"}


def test_reconfigure_keeps_jobs_that_still_fit_and_retries_the_rest(h: Harness) -> None:
    keep = h.submit(5, user="alice")  # prod in VC default (hostname-carol)
    drop = h.submit(0, user="bob")  # prod in VC vc1 (hostname-dan)
    h.cycle()
    run_keep = h.start(keep)
    h.start(drop)
    result = h.plane.reconfigure((LAB6 / "hived-config-one-vc.yaml").read_text())  # vc1 is gone
    assert result["kept"] == [keep]
    assert list(result["stopped"]) == [drop] and "vc1" in result["stopped"][drop]
    assert h.task(keep)["state"] == "RUNNING" and h.find(keep)["runId"] == run_keep  # untouched
    h.exit(drop, 143, stopped=True)
    job = h.job(drop)
    assert job["state"] == "WAITING" and job["retryDetails"] == {"user": 0, "platform": 1}
    assert "Cluster config changed" in job["waitingReason"]
    h.cycle()  # its VC no longer exists: it keeps waiting, and says why
    assert h.job(drop)["state"] == "WAITING" and "vc1" in h.job(drop)["waitingReason"]


LAZY_CONFIG = """
physicalCluster:
  skuTypes: {GPU: {gpu: 1, cpu: 2, memory: 4096Mi}}
  cellTypes:
    NODE: {childCellType: GPU, childCellNumber: 1, isNodeLevel: true}
    POOL: {childCellType: NODE, childCellNumber: 2}
  physicalCells:
  - cellType: POOL
    cellChildren: [{cellAddress: node-x}, {cellAddress: node-y}]
virtualClusters:
  a: {virtualCells: [{cellType: POOL.NODE, cellNumber: 1}]}
"""


def test_lazy_preemption_downgrades_the_victim_instead_of_stopping_it(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAZY_CONFIG), tmp_path / "logs",
                         lazy_preemption=True)
    for node in ("node-x", "node-y"):
        plane.node_report(node, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=[])
    low = plane.submit(job_text(1, **{"defaults.virtualCluster": "a"}), "alice")["id"]
    plane.cycle()
    low_node = plane.get_job(low)["tasks"][0]["node"]
    high = plane.submit(job_text(2, **{"defaults.virtualCluster": "a"}), "bob")["id"]
    result = plane.cycle()
    # VC a's one cell rebinds to the idle node: the prod job runs there, the test job keeps its node
    # as an opportunistic job instead of being stopped.
    assert result.preempted == [] and high in result.placed
    assert plane.get_job(high)["tasks"][0]["node"] != low_node
    assert all(a["desired"] == "RUN" for a in plane.assignments(low_node))
    assert [e["type"] for e in plane.events(job_id=low)][-1] == "job.downgraded"


def test_reconfigure_keeps_a_lazy_job_its_vc_no_longer_holds_as_opportunistic(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAZY_CONFIG), tmp_path / "logs",
                         lazy_preemption=True)
    for node in ("node-x", "node-y"):
        plane.node_report(node, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=[])
    job = plane.submit(job_text(2, **{"defaults.virtualCluster": "a"}), "alice")["id"]
    plane.cycle()
    node = plane.get_job(job)["tasks"][0]["node"]
    result = plane.reconfigure(LAZY_CONFIG.replace("cellNumber: 1", "cellNumber: 0"))
    assert result == {"kept": [job], "stopped": {}}
    assert plane.check_consistency() == []
    assert [a["desired"] for a in plane.assignments(node)] == ["RUN"]
    assert [e["type"] for e in plane.events(job_id=job)][-1] == "job.downgraded"
    assert plane.cluster_status()["groups"][job]["downgraded"] is True


def test_an_assignment_carries_each_instance_its_peers_hosts_and_its_own_placement(tmp_path: Path) -> None:
    """The launch fields an agent gets: a two-instance job over two nodes learns both nodes'
    reported addresses (PAI_HOST_IP_<role>_<index>), each run its own leaf cells and GPUs; a
    one-instance job's run gets its own node's address and simulated flag."""
    h = Harness(tmp_path, "one-vc", report_nodes=False)
    addresses = {CAROL: "10.0.0.1", DAN: "10.0.0.2"}
    for node, address in addresses.items():
        h.plane.node_report(node, gpus=1, simulated_gpus=node == DAN, address=address, agent_id="t", runs=[])
    gang = h.submit(6)  # two instances, one GPU each: one on each node
    assert h.cycle().placed == [gang]
    with h.sessions() as s:
        cells = {(p.node, p.index): p.leaf_cells for p in s.scalars(select(Placement).where(Placement.job_id == gang))}
    seen = {}
    for node in (CAROL, DAN):
        (a,) = h.plane.assignments(node)
        launch = a["launch"]
        index = launch["index"]
        seen[index] = node
        assert launch["leaf_cells"] == cells[(node, index)] and launch["leaf_cells"]
        assert launch["env"]["PAI_CONTAINER_HOST_IP"] == addresses[node]
        assert launch["env"]["APIARY_SIMULATED_GPUS"] == ("1" if node == DAN else "0")
        assert a["labels"] == {"job": gang, "user": "alice", "virtual_cluster": "default", "task_role": "train",
                               "index": str(index)}
    for node in (CAROL, DAN):
        (a,) = h.plane.assignments(node)
        assert {k: v for k, v in a["launch"]["env"].items() if k.startswith("PAI_HOST_IP_")} == {
            f"PAI_HOST_IP_train_{i}": addresses[n] for i, n in seen.items()}
