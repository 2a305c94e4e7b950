"""A node report may say a run exited although its start was never recorded (an agent killed between
starting a task and recording it reports the exit it finds afterwards). The core records the start
first, at the run's end, then the exit: the job's edges stay legal and the run is never run again.

The last test feeds every combination of a report's fields to a run in each state a run of the
reporting node can be in, and checks that the core never raises and never leaves the run undecided.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from tests.lifecycle.test_reducer import new_job, place, run

from apiary.lifecycle import EXIT_LAUNCH_FAILED, JobState, TaskState
from apiary.lifecycle.reducer import JobRecord, RunReported, StopRequested, step


def test_an_exit_0_without_a_start_is_a_start_then_a_success() -> None:
    job = new_job(0)
    place(job, "n1")
    t = run(job)
    assert t.run_id and job.state is JobState.WAITING and t.state is TaskState.STARTING
    fx = step(job, RunReported(node="n1", run_id=t.run_id, exited=True, exit_code=0, finished_at=5.0), 6.0)
    assert fx.ack
    assert job.state is JobState.SUCCEEDED and t.state is TaskState.SUCCEEDED
    assert (t.started, t.finished, job.launch_time, job.exit_code) == (5.0, 5.0, 5.0, 0)
    assert [e for e, _ in fx.events if e.startswith("task.")] == ["task.started", "task.exited"]
    assert job.retries_platform == 0 and job.retries_user == 0  # it ran: never again


def test_an_exit_without_a_start_or_an_end_is_dated_now() -> None:
    job = new_job(0)
    place(job, "n1")
    t = run(job)
    assert t.run_id
    step(job, RunReported(node="n1", run_id=t.run_id, exited=True, exit_code=0), 7.0)
    assert job.state is JobState.SUCCEEDED and t.started == 7.0 and t.finished == 7.0


def _fresh() -> JobRecord:
    job = new_job(0)
    place(job, "n1")
    return job


def _stop_requested() -> JobRecord:
    job = _fresh()
    step(job, StopRequested(), 1.5)
    return job


def _running() -> JobRecord:
    job = _fresh()
    t = run(job)
    assert t.run_id
    step(job, RunReported(node="n1", run_id=t.run_id, started_at=2.0), 2.0)
    return job


def _two_instances() -> JobRecord:
    job = new_job(0, taskRoles__train__instances=2, taskRoles__train__completion__minSucceededInstances=2)
    place(job, "n1", "n2")
    return job


def _retried_in_place() -> JobRecord:
    job = new_job(0, taskRoles__train__taskRetryCount=2, extras__gangAllocation=False)
    place(job, "n1")
    t = run(job)
    assert t.run_id
    step(job, RunReported(node="n1", run_id=t.run_id, exited=True, exit_code=1, started_at=2.0, finished_at=3.0), 3.0)
    return job


SITUATIONS: dict[str, Callable[[], JobRecord]] = {
    "starting": _fresh, "stop requested": _stop_requested, "running": _running,
    "one of two instances": _two_instances, "retried in place": _retried_in_place,
}
CODES = (None, 0, 1, 137, 143, EXIT_LAUNCH_FAILED, -210, 2**31 - 1, -(2**31))


@pytest.mark.parametrize("situation", SITUATIONS)
def test_no_combination_of_report_fields_breaks_the_core(situation: str) -> None:
    # (A report's ``stopped`` does not reach the core: the task's desired state decides a stop.)
    for state, code, started_at, finished_at, lost in itertools.product(
        ("running", "exited", "other"), CODES, (None, 2.5), (None, 4.0), (False, True),
    ):
        job = SITUATIONS[situation]()
        t = run(job)
        assert t.run_id and t.node and not t.state.is_final
        report = RunReported(node=t.node, run_id=t.run_id, exited=state == "exited", exit_code=code,
                             started_at=started_at, finished_at=finished_at, pid=7, lost=lost)
        case = f"{situation}: {report}"
        fx = step(job, report, 5.0)  # raises InvalidTransitionError on an illegal edge
        if state == "exited":
            assert fx.ack, case
            assert t.state.is_final, case
            assert t.started is not None and t.finished is not None, case
        elif started_at is not None:
            assert t.state is TaskState.RUNNING, case
        # The same report again changes nothing and raises nothing.
        again = step(job, report, 6.0)
        assert again.ops == [] or state != "exited", case
