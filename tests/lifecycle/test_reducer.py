"""The lifecycle core, ``step(job, input, now) -> Effects``, on its own: no store, no scheduler, no clock.

Each test submits a job (Lab 6's files through the real parser), feeds inputs the way a shell would
and checks the record, the events and the scheduler operations. The last tests drive the core through
every edge of both transition tables and check that it takes no edge outside them (so ``STATES.md``,
the tables and the code agree).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.support.builders import job_text

import apiary.lifecycle.reducer as reducer
from apiary.lifecycle import (
    EXIT_NODE_LOST,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    JOB_TRANSITIONS,
    TASK_TRANSITIONS,
    AttemptOutcome,
    Desired,
    JobState,
    TaskState,
)
from apiary.lifecycle.reducer import (
    Allocate,
    Cancel,
    Effects,
    JobRecord,
    NodeLost,
    Placed,
    Preempted,
    Reconfigured,
    Release,
    RunReported,
    StopRequested,
    Waiting,
    job_policy,
    step,
    submit,
)
from apiary.scheduler import TaskPlacement
from apiary.spec.job import parse_job


def new_job(n: int = 0, user: str = "alice", **changes) -> JobRecord:
    spec = parse_job(job_text(n, **changes))
    job, fx = submit(f"{user}~{spec.name}", user, job_policy(f"{user}~{spec.name}", spec), 0.0, name=spec.name,
                     priority_class=spec.priority_class)
    assert [t for t, _ in fx.events] == ["job.submitted"] and fx.wake
    return job


def place(job: JobRecord, *nodes: str, now: float = 1.0) -> Effects:
    """Place the first pending instances, one per node given, one GPU each."""
    pending = job.pending()
    placements = tuple(TaskPlacement(r, i, node, (0,), (0,)) for (r, i), node in zip(pending, nodes, strict=False))
    return step(job, Placed(placements, "rest waits"), now)


def run(job: JobRecord, index: int = 0, role: str = "train") -> reducer.TaskRecord:
    return job.tasks[(role, index)]


def started(job: JobRecord, index: int = 0, now: float = 2.0) -> Effects:
    t = run(job, index)
    assert t.node and t.run_id
    return step(job, RunReported(node=t.node, run_id=t.run_id, started_at=now), now)


def exited(job: JobRecord, code: int | None, index: int = 0, now: float = 3.0) -> Effects:
    t = run(job, index)
    assert t.node and t.run_id
    return step(job, RunReported(node=t.node, run_id=t.run_id, exited=True, exit_code=code, finished_at=now), now)


def types(fx: Effects) -> list[str]:
    return [t for t, _ in fx.events]


# ------------------------------------------------------------------------------------------ basics
def test_a_job_runs_and_succeeds_with_the_operations_a_shell_applies() -> None:
    job = new_job(0)
    assert (job.state, job.pending(), job.schedulable()) == (JobState.WAITING, [("train", 0)], True)
    fx = place(job, "n1")
    assert types(fx) == ["job.placed"] and fx.touched == {"n1"}
    (op,) = fx.ops
    assert isinstance(op, Allocate) and op.job == job.id and op.attempt == 0
    assert run(job).state is TaskState.STARTING and run(job).run_id == "alice~job-config-0.a0.train.0.t0"
    assert job.waiting_reason is None and not job.schedulable()
    fx = started(job)
    assert types(fx) == ["task.started"] and job.state is JobState.RUNNING and job.launch_time == 2.0
    assert not fx.ack  # a start is not final: the agent keeps reporting the run
    fx = exited(job, 0)
    assert types(fx) == ["task.exited", "job.completed"] and fx.ack
    assert fx.touched == set()  # the node reported the exit itself: its agent need not poll again
    assert fx.ops == [Release(job.id, 0, None)]  # the whole attempt at once (it also drops a reservation)
    assert (job.state, job.exit_code, job.completion_time) == (JobState.SUCCEEDED, 0, 3.0)


def test_a_report_for_an_unknown_or_moved_run_is_acknowledged_and_changes_nothing() -> None:
    job = new_job(0)
    place(job, "n1")
    fx = step(job, RunReported(node="n2", run_id=run(job).run_id or "", started_at=1.0), 1.0)
    assert fx.ack and fx.events == [] and run(job).state is TaskState.STARTING
    fx = step(job, RunReported(node="n1", run_id="someone-else", exited=True, exit_code=1), 1.0)
    assert fx.ack and fx.events == []


@pytest.mark.parametrize(
    ("code", "lost"), [(None, False), (None, True), (143, False)], ids=["killed-no-code", "vanished-process", "sigterm"]
)
def test_a_stopped_run_ends_stopped_whatever_its_code(code: int | None, lost: bool) -> None:
    job = new_job(6, **{"defaults.virtualCluster": "default"})  # 2 instances, minSucceededInstances 1
    place(job, "n1", "n2")
    started(job, 0)
    started(job, 1)
    fx = exited(job, 0, index=0)
    assert job.attempt.outcome is AttemptOutcome.SUCCEEDED and run(job, 1).desired is Desired.STOP
    assert fx.stopping == [run(job, 1)] and fx.touched == {"n2"}  # n1 reported its own exit
    t = run(job, 1)
    step(job, RunReported(node="n2", run_id=t.run_id or "", exited=True, exit_code=code, lost=lost), 4.0)
    assert t.state is TaskState.STOPPED  # desired STOP decides, even for a vanished process
    assert t.exit_code == (code if code is not None else (reducer.EXIT_LOST_PROCESS if lost else EXIT_STOPPED))
    assert job.state is JobState.SUCCEEDED


def test_waiting_reasons_are_recorded_once() -> None:
    job = new_job(0)
    assert types(step(job, Waiting("VC vc1 is full."), 1.0)) == ["job.waiting"]
    assert step(job, Waiting("VC vc1 is full."), 2.0).events == []
    assert job.waiting_reason == "VC vc1 is full."


# ------------------------------------------------------------------------------------------ retries
def test_a_user_retry_counts_and_makes_a_new_attempt_with_new_tasks() -> None:
    job = new_job(0, jobRetryCount=1)
    place(job, "n1")
    started(job)
    old = run(job)
    fx = exited(job, 1)
    assert types(fx) == ["task.exited", "job.retry"] and fx.wake
    assert fx.new_attempt is job.attempt and job.attempt.index == 1 and fx.new_tasks == [run(job)]
    assert old.state is TaskState.FAILED and run(job).state is TaskState.WAITING and run(job) is not old
    assert (job.state, job.retries_user, job.retries_platform) == (JobState.WAITING, 1, 0)
    assert job.waiting_reason and job.waiting_reason.startswith("Retrying (user retry)")
    place(job, "n1")
    started(job)
    exited(job, 1)
    assert job.state is JobState.FAILED and job.exit_code == 1


def test_task_retry_count_runs_the_instance_again_in_place_on_its_cells() -> None:
    job = new_job(0, taskRoles__train__taskRetryCount=1, extras__gangAllocation=False)
    place(job, "n1")
    started(job)
    first = run(job)
    fx = exited(job, 1)
    again = run(job)
    assert fx.ops == [] and fx.new_tasks == [again] and fx.touched == {"n1"}  # the cells stay held
    assert (first.state, first.latest) == (TaskState.FAILED, False)
    assert (again.state, again.node, again.task_attempt) == (TaskState.STARTING, "n1", 1)
    assert again.run_id == "alice~job-config-0.a0.train.0.t1" and job.attempt.index == 0


def test_preemption_decides_once_and_the_retry_is_a_platform_retry() -> None:
    job = new_job(1)
    place(job, "n1")
    started(job)
    fx = step(job, Preempted(by="bob~job-config-2"), 5.0)
    assert fx.decided and types(fx) == ["job.preempted"] and fx.stopping == [run(job)]
    assert job.attempt.outcome is AttemptOutcome.PREEMPTED and job.attempt.exit_code == EXIT_PREEMPTED
    assert not step(job, Preempted(by="carol~other"), 5.0).decided  # already decided
    exited(job, None, now=6.0)
    assert (job.state, job.retries_platform, job.attempt.index) == (JobState.WAITING, 1, 1)


def test_a_lost_node_fails_its_runs_and_stops_the_rest_of_the_attempt() -> None:
    job = new_job(6, **{"defaults.virtualCluster": "default"})
    place(job, "n1", "n2")
    started(job, 0)  # instance 1 never reported started
    fx = step(job, NodeLost("n2"), 9.0)
    assert fx.touched == {"n1", "n2"}  # n2's run ended here, not by its report; n1's is told to stop
    assert run(job, 1).exit_code == EXIT_NODE_LOST and run(job, 1).state is TaskState.FAILED
    assert run(job, 0).desired is Desired.STOP and job.attempt.outcome is AttemptOutcome.NODE_LOST
    assert "task.exited" in types(fx)
    exited(job, None, index=0, now=9.5)
    assert job.state is JobState.WAITING and job.retries_platform == 1


def test_reconfiguration_and_stop() -> None:
    job = new_job(0)
    fx = step(job, Reconfigured("VC vc1 no longer exists"), 1.0)
    # Nothing was placed: the attempt ends at once and retries.
    assert fx.decided and job.attempt.index == 1 and job.retries_platform == 1
    fx = step(job, StopRequested(), 2.0)
    assert types(fx) == ["job.stop_requested", "job.completed"] and job.state is JobState.STOPPED
    assert fx.ops == [Cancel(job.id), Release(job.id, 1, None)]
    assert step(job, StopRequested(), 3.0).events == []  # idempotent


# ------------------------------------------------------------------------------------------ edges
def _edges(monkeypatch) -> tuple[set, set]:
    jobs: set = set()
    tasks: set = set()
    real_job, real_task = reducer.check_job_transition, reducer.check_task_transition

    def job_edge(old, new):
        real_job(old, new)
        jobs.add((old, new))

    def task_edge(old, new):
        real_task(old, new)
        tasks.add((old, new))

    monkeypatch.setattr(reducer, "check_job_transition", job_edge)
    monkeypatch.setattr(reducer, "check_task_transition", task_edge)
    return jobs, tasks


def _every_path() -> Iterator[JobRecord]:
    # succeeded; failed; user retry from RUNNING
    for code, retries in ((0, 0), (1, 0), (1, 1)):
        job = new_job(0, jobRetryCount=retries)
        place(job, "n1")
        started(job)
        exited(job, code)
        yield job
    # stopped while running; stopped while waiting (never placed); stopped after placement, before start
    job = new_job(0)
    place(job, "n1")
    started(job)
    step(job, StopRequested(), 4.0)
    exited(job, None)
    yield job
    job = new_job(0)
    step(job, StopRequested(), 1.0)
    yield job
    job = new_job(0)
    place(job, "n1")
    step(job, StopRequested(), 4.0)
    exited(job, None)
    yield job
    # launch failures (no start): transient -> retried from WAITING; permanent -> FAILED from WAITING
    for code in (137, -1203):
        job = new_job(0)
        place(job, "n1")
        exited(job, code)
        yield job


def test_the_core_takes_every_edge_of_both_tables_and_no_other(monkeypatch) -> None:
    jobs, tasks = _edges(monkeypatch)
    finals = [job.state for job in _every_path()]
    assert {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED, JobState.WAITING} <= set(finals)
    assert jobs == set(JOB_TRANSITIONS)
    assert tasks == set(TASK_TRANSITIONS)


@given(
    user=st.from_regex(r"[a-z][a-z0-9._-]{0,20}", fullmatch=True),
    name=st.from_regex(r"[A-Za-z0-9_-]{1,30}", fullmatch=True),
    attempt=st.integers(0, 10_000),
    role=st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,20}", fullmatch=True),
    index=st.integers(0, 10_000),
    task_attempt=st.integers(0, 100),
)
def test_a_run_id_names_its_job(user, name, attempt, role, index, task_attempt):
    """The control plane reads a reported run's job from its run id (dots in the job id included)."""
    from apiary.lifecycle.reducer import job_of_run, run_id_for

    job_id = f"{user}~{name}"
    assert job_of_run(run_id_for(job_id, attempt, role, index, task_attempt)) == job_id


@pytest.mark.parametrize("run_id", ["", "x", "alice~j.a0.train.0", "alice~j.a0.train.0.0", ".a0.train.0.t0",
                                    "alice~j.b0.train.0.t0", "alice~j.a0.tr-ain.0.t0", "alice~j.a0.train.x.t0",
                                    "alice~j.a0.train.0.t0\n"])
def test_a_run_id_not_of_that_shape_names_no_job(run_id):
    from apiary.lifecycle.reducer import job_of_run

    assert job_of_run(run_id) is None
