"""Job and task state machines.

The job states are OpenPAI's (``WAITING``, ``RUNNING``, ``SUCCEEDED``, ``FAILED``, ``STOPPED``); a task
adds ``STARTING`` between placement and the process reporting that it started. Every legal edge is a key
of :data:`JOB_TRANSITIONS` / :data:`TASK_TRANSITIONS`, whose value is a sentence saying when the edge
happens; ``STATES.md`` next to this file is the same table for people, written like HiveD's
``doc/design/state-machine.md``. Anything not in a table is illegal and :func:`check_job_transition` /
:func:`check_task_transition` raise :class:`apiary.errors.InvalidTransitionError`.

Final states (``SUCCEEDED``, ``FAILED``, ``STOPPED``) have no outgoing edge: a retry never reopens a
finished job or task. A job retry ends the attempt while the job is still ``RUNNING``/``WAITING`` and
moves it (back) to ``WAITING``; the new attempt's tasks are new task records. A task retried in place
(OpenPAI ``taskRetryCount``) keeps its record ``FAILED`` (the run that failed) and gets a new record for
the next run of the same instance, created ``WAITING`` and at once ``STARTING`` on the same cells.

The enums of the other lifecycle fields live here too: :class:`AttemptOutcome`, :class:`Desired` (what a
node should do with a run) and :class:`ExecutionType` (OpenPAI's ``executionType``).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

from apiary.errors import InvalidTransitionError

__all__ = [
    "JOB_TRANSITIONS",
    "TASK_TRANSITIONS",
    "AttemptOutcome",
    "Desired",
    "ExecutionType",
    "JobState",
    "TaskState",
    "check_job_transition",
    "check_task_transition",
]


class JobState(StrEnum):
    """OpenPAI's job states (the ``state`` field of a job in the REST API). Values equal the names.

    A :class:`~enum.StrEnum`, so each member is a ``str`` equal to its value (``str(JobState.RUNNING) ==
    "RUNNING"``) and an :class:`~enum.Enum`.
    """

    WAITING = "WAITING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @classmethod
    def final_states(cls) -> frozenset[JobState]:
        """``{SUCCEEDED, FAILED, STOPPED}``: states with no outgoing edge."""
        return frozenset({cls.SUCCEEDED, cls.FAILED, cls.STOPPED})

    @property
    def is_final(self) -> bool:
        """True for ``SUCCEEDED``, ``FAILED`` and ``STOPPED``."""
        return self in _FINAL_JOB_STATES


class TaskState(StrEnum):
    """State of one task instance (``taskRole`` x ``taskIndex``) within the current job attempt.

    ``WAITING``: not placed yet. ``STARTING``: placed and sent to its node, the process has not been
    reported started. ``RUNNING``: the process runs. ``STOPPED``: killed by a user stop, a preemption or
    the completion policy ending the attempt (it neither succeeded nor failed on its own).
    """

    WAITING = "WAITING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @classmethod
    def final_states(cls) -> frozenset[TaskState]:
        """``{SUCCEEDED, FAILED, STOPPED}``: states with no outgoing edge."""
        return frozenset({cls.SUCCEEDED, cls.FAILED, cls.STOPPED})

    @property
    def is_final(self) -> bool:
        """True for ``SUCCEEDED``, ``FAILED`` and ``STOPPED``."""
        return self in _FINAL_TASK_STATES


# Built once: is_final is asked on every lifecycle step (the simulator replays 82k jobs).
_FINAL_JOB_STATES = JobState.final_states()
_FINAL_TASK_STATES = TaskState.final_states()


class AttemptOutcome(StrEnum):
    """How an attempt was decided (``attempts.outcome``); None while undecided.

    ``SUCCEEDED`` / ``FAILED``: the completion policy. ``STOPPED``: a user stop. ``PREEMPTED``: a HiveD
    preemption. ``NODE_LOST``: a node of the attempt stopped heart-beating. ``RECONFIGURED``: a new
    cluster config cannot hold the attempt's cells. The last three are platform causes: their retry is
    never counted against ``jobRetryCount``.
    """

    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    PREEMPTED = "PREEMPTED"
    NODE_LOST = "NODE_LOST"
    RECONFIGURED = "RECONFIGURED"

    @classmethod
    def platform_causes(cls) -> frozenset[AttemptOutcome]:
        """``{PREEMPTED, NODE_LOST, RECONFIGURED}``: outcomes the platform caused."""
        return frozenset({cls.PREEMPTED, cls.NODE_LOST, cls.RECONFIGURED})

    @property
    def platform_cause(self) -> bool:
        """True when the platform, not the job, ended the attempt (the retry is not counted)."""
        return self in _PLATFORM_CAUSES


_PLATFORM_CAUSES = AttemptOutcome.platform_causes()


class Desired(StrEnum):
    """What the node should do with a placed run (``tasks.desired``; the agents' ``desired``)."""

    RUN = "RUN"
    STOP = "STOP"


class ExecutionType(StrEnum):
    """OpenPAI's ``executionType`` of a job: ``START`` as submitted, ``STOP`` once the user stopped it."""

    START = "START"
    STOP = "STOP"


_J = JobState
_T = TaskState

#: ``(from, to) -> when it happens``. ``from`` is ``None`` for the submission edge.
JOB_TRANSITIONS: Mapping[tuple[JobState | None, JobState], str] = MappingProxyType(
    {
        (None, _J.WAITING): "the job is submitted and accepted; its first attempt waits for placement",
        (_J.WAITING, _J.RUNNING): "the first task of the current attempt reported that its process started",
        (_J.WAITING, _J.WAITING): (
            "an attempt that never started a task ended and a retry was decided (e.g. a transient launch "
            "failure, a gang allocation timeout, preemption before start); the next attempt waits"
        ),
        (_J.WAITING, _J.STOPPED): "the user stopped the job before any task of the attempt started",
        (_J.WAITING, _J.FAILED): (
            "an attempt that never started a task failed and no retry was decided (e.g. all tasks failed "
            "to launch with a permanent exit code, or the retries are exhausted)"
        ),
        (_J.RUNNING, _J.WAITING): (
            "the attempt ended and a retry was decided: a user retry (jobRetryCount) or a platform retry "
            "(transient exit code, preemption, node loss); the new attempt waits for placement"
        ),
        (_J.RUNNING, _J.SUCCEEDED): "the completion policy decided SUCCEEDED for the attempt",
        (_J.RUNNING, _J.FAILED): "the completion policy decided FAILED and no retry was decided",
        (_J.RUNNING, _J.STOPPED): "the user stopped the job; its running tasks are killed",
    }
)

#: ``(from, to) -> when it happens``. ``from`` is ``None`` when the task record is created.
TASK_TRANSITIONS: Mapping[tuple[TaskState | None, TaskState], str] = MappingProxyType(
    {
        (None, _T.WAITING): (
            "the task record is created: for each instance of a new job attempt, or for the next run of an "
            "instance retried in place (taskRetryCount), which then moves to STARTING on the same cells at once"
        ),
        (_T.WAITING, _T.STARTING): "the scheduler placed the task and it was sent to its node",
        (_T.WAITING, _T.STOPPED): (
            "the attempt ended before the task was placed (user stop, preemption of the job, a job retry, "
            "or the completion policy completed the attempt)"
        ),
        (_T.STARTING, _T.RUNNING): "the node reported that the task's process started",
        (_T.STARTING, _T.FAILED): (
            "the process could not be started (launch failure); the exit code says why. If the task is "
            "retried in place, this record stays FAILED and a new record runs the instance again"
        ),
        (_T.STARTING, _T.STOPPED): (
            "the task was killed before its process was reported started (user stop, preemption, a job "
            "retry ending the attempt, or the completion policy completed the attempt)"
        ),
        (_T.RUNNING, _T.SUCCEEDED): "the process exited with code 0",
        (_T.RUNNING, _T.FAILED): (
            "the process exited non-zero, or the platform ended it with a failure code (its node was lost: "
            "-1001; a liveness probe failed: -300). If the task is retried in place, this record stays FAILED "
            "and a new record runs the instance again"
        ),
        (_T.RUNNING, _T.STOPPED): (
            "the process was killed by a user stop, a preemption, a job retry ending the attempt, or the "
            "completion policy completing the attempt"
        ),
    }
)


def _coerce(enum: type[JobState] | type[TaskState], value: object, kind: str) -> JobState | TaskState:
    try:
        return enum(str(value))
    except ValueError:
        raise InvalidTransitionError(f"unknown {kind} state {value!r}") from None


def _check(
    enum: type[JobState] | type[TaskState],
    table: Mapping[tuple[JobState | None, JobState], str] | Mapping[tuple[TaskState | None, TaskState], str],
    old: object,
    new: object,
    kind: str,
) -> None:
    if (old, new) in table:  # members (and their equal strings) hash like the keys
        return
    old_state = None if old is None else _coerce(enum, old, kind)
    new_state = _coerce(enum, new, kind)
    if (old_state, new_state) not in table:
        source = "<new>" if old_state is None else old_state.value
        raise InvalidTransitionError(f"illegal {kind} state transition {source} -> {new_state.value}")


def check_job_transition(old: JobState | None, new: JobState) -> None:
    """Return if ``old -> new`` is an edge of :data:`JOB_TRANSITIONS`; ``old=None`` means submission.

    Plain strings equal to a state's value are accepted. Raises
    :class:`~apiary.errors.InvalidTransitionError` naming both states when the edge is not in the table,
    and for an unknown state name.
    """
    if (old, new) not in JOB_TRANSITIONS:  # legal edges return here: this runs on every state change
        _check(JobState, JOB_TRANSITIONS, old, new, "job")


def check_task_transition(old: TaskState | None, new: TaskState) -> None:
    """Return if ``old -> new`` is an edge of :data:`TASK_TRANSITIONS`; ``old=None`` means creation.

    Plain strings equal to a state's value are accepted. Raises
    :class:`~apiary.errors.InvalidTransitionError` naming both states when the edge is not in the table,
    and for an unknown state name.
    """
    if (old, new) not in TASK_TRANSITIONS:
        _check(TaskState, TASK_TRANSITIONS, old, new, "task")
