"""The bridge's event reader: Apiary's event log (``GET /api/v2/events``) as typed events.

The REST contract gives each event as ``{"seq": int, "time": float unix seconds, "jobId":
"user~name", "type": str, "data": dict}``; the lifecycle reducer (:mod:`apiary.lifecycle.reducer`)
writes them. :func:`read_event` turns one into a :class:`JobEvent` whose ``body`` is one typed
dataclass per :class:`EventType`, with the lifecycle's own enums where the event names a state
(:class:`~apiary.lifecycle.states.JobState` of ``job.completed``,
:class:`~apiary.lifecycle.states.TaskState` of ``task.exited``). What each one becomes in
Prefect is decided by type, in :mod:`apiary.tracking.states` and
:mod:`apiary.tracking.recorder`, never by matching names.

Errors: :class:`EventError` (a :class:`ValueError`) names the event's seq and the field that is
missing or malformed. An event type this module does not know reads as :class:`OtherEvent` (a
newer control plane may add types; the bridge logs them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeAlias

from apiary.lifecycle.states import JobState, TaskState

__all__ = [
    "Completed",
    "EventError",
    "EventType",
    "JobEvent",
    "OtherEvent",
    "Placed",
    "Placement",
    "Preempted",
    "Retry",
    "StopRequested",
    "Submitted",
    "TaskExited",
    "TaskStarted",
    "Waiting",
    "read_event",
]


class EventType(StrEnum):
    """The job event types the lifecycle reducer writes (``events.type``) and the bridge mirrors."""

    SUBMITTED = "job.submitted"
    WAITING = "job.waiting"
    PLACED = "job.placed"
    TASK_STARTED = "task.started"
    TASK_EXITED = "task.exited"
    PREEMPTED = "job.preempted"
    RETRY = "job.retry"
    STOP_REQUESTED = "job.stop_requested"
    COMPLETED = "job.completed"


class EventError(ValueError):
    """An event whose data lacks a field its type needs, or has one of the wrong kind."""


@dataclass(frozen=True)
class Submitted:
    """``job.submitted``: Apiary accepted the job. ``flow_run_id``: the flow run it came with
    (a flow engine runs it: the Prefect form), else None."""

    user: str | None
    name: str | None
    virtual_cluster: str | None
    priority_class: str | None
    flow_run_id: str | None


@dataclass(frozen=True)
class Waiting:
    """``job.waiting``: attempt ``attempt`` waits for placement, for ``reason``."""

    attempt: int
    reason: str | None


@dataclass(frozen=True)
class Placement:
    """One instance's place: ``task_role``/``index`` on ``node`` with ``gpus`` (GPU indexes)."""

    task_role: str
    index: int
    node: str | None
    gpus: Any


@dataclass(frozen=True)
class Placed:
    """``job.placed``: the scheduler placed every instance of attempt ``attempt``."""

    attempt: int
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class TaskStarted:
    """``task.started``: an instance's process started on ``node``."""

    attempt: int
    task_role: str
    index: int
    node: str | None
    gpus: Any


@dataclass(frozen=True)
class TaskExited:
    """``task.exited``: an instance's run ended with ``exit_code`` (its exit-spec ``phrase``);
    ``state`` is the task's final state (None from a control plane that did not send it)."""

    attempt: int
    task_role: str
    index: int
    exit_code: int | None
    phrase: str | None
    state: TaskState | None


@dataclass(frozen=True)
class Preempted:
    """``job.preempted``: attempt ``attempt`` was preempted ``by`` a job (or the cluster config)."""

    attempt: int
    by: str | None
    reason: str | None


@dataclass(frozen=True)
class Retry:
    """``job.retry``: attempt ``attempt`` was created after the previous one ended (``kind``:
    user or platform; the previous attempt's ``exit_code``)."""

    attempt: int
    kind: str | None
    reason: str | None
    exit_code: int | None


@dataclass(frozen=True)
class StopRequested:
    """``job.stop_requested``: someone (``by``, when the event says) asked to stop the job."""

    by: str | None


@dataclass(frozen=True)
class Completed:
    """``job.completed``: the job ended ``state`` (a final :class:`JobState`)."""

    state: JobState
    exit_code: int | None
    attempt: int | None


@dataclass(frozen=True)
class OtherEvent:
    """An event type the bridge does not mirror (logged as its type and data)."""

    type: str
    data: Mapping[str, Any]


Body: TypeAlias = (
    Submitted | Waiting | Placed | TaskStarted | TaskExited | Preempted | Retry | StopRequested | Completed | OtherEvent
)


@dataclass(frozen=True)
class JobEvent:
    """One event of the log: its ``seq``, ``time`` (unix seconds; None if the log had none), the
    job it is about and its typed ``body``."""

    seq: int
    time: float | None
    job_id: str
    type: str
    body: Body


def _int(d: Mapping[str, Any], key: str, seq: int, default: int | None = None) -> int:
    value = d.get(key, default)
    if value is None or isinstance(value, bool):
        raise EventError(f"event seq={seq}: data.{key}: an integer is required, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EventError(f"event seq={seq}: data.{key}: an integer is required, got {value!r}") from None


def _opt_int(d: Mapping[str, Any], key: str, seq: int) -> int | None:
    return None if d.get(key) is None else _int(d, key, seq)


def _str(d: Mapping[str, Any], key: str, seq: int) -> str:
    value = d.get(key)
    if not isinstance(value, str) or not value:
        raise EventError(f"event seq={seq}: data.{key}: a non-empty string is required, got {value!r}")
    return value


def _opt_str(d: Mapping[str, Any], key: str) -> str | None:
    value = d.get(key)
    return None if value is None else str(value)


def _final_state(d: Mapping[str, Any], seq: int) -> JobState:
    """``data.state`` of ``job.completed``; anything but a final job state reads as FAILED (a job
    that ended in a state nobody knows cannot be a success)."""
    try:
        state = JobState(str(d.get("state", "FAILED")).upper())
    except ValueError:
        return JobState.FAILED
    return state if state.is_final else JobState.FAILED


def _task_state(d: Mapping[str, Any]) -> TaskState | None:
    try:
        return TaskState(str(d["state"])) if d.get("state") is not None else None
    except ValueError:
        return None


def _placements(d: Mapping[str, Any], seq: int) -> tuple[Placement, ...]:
    out = []
    for p in d.get("placements") or []:
        if not isinstance(p, Mapping):
            raise EventError(f"event seq={seq}: data.placements: objects are required, got {p!r}")
        out.append(Placement(_str(p, "taskRole", seq), _int(p, "index", seq), _opt_str(p, "node"), p.get("gpus")))
    return tuple(out)


#: How each type's data is read: the one place an event's type name is looked at.
_READERS: Mapping[EventType, Callable[[Mapping[str, Any], int], Body]] = {
    EventType.SUBMITTED: lambda d, seq: Submitted(
        _opt_str(d, "user"), _opt_str(d, "name"), _opt_str(d, "virtualCluster"), _opt_str(d, "priorityClass"),
        _opt_str(d, "flowRunId")),
    EventType.WAITING: lambda d, seq: Waiting(_int(d, "attempt", seq, 0), _opt_str(d, "reason")),
    EventType.PLACED: lambda d, seq: Placed(_int(d, "attempt", seq, 0), _placements(d, seq)),
    EventType.TASK_STARTED: lambda d, seq: TaskStarted(
        _int(d, "attempt", seq, 0), _str(d, "taskRole", seq), _int(d, "index", seq), _opt_str(d, "node"),
        d.get("gpus")),
    EventType.TASK_EXITED: lambda d, seq: TaskExited(
        _int(d, "attempt", seq, 0), _str(d, "taskRole", seq), _int(d, "index", seq), _opt_int(d, "exitCode", seq),
        _opt_str(d, "phrase"), _task_state(d)),
    EventType.PREEMPTED: lambda d, seq: Preempted(_int(d, "attempt", seq, 0), _opt_str(d, "by"),
                                                  _opt_str(d, "reason")),
    EventType.RETRY: lambda d, seq: Retry(_int(d, "attempt", seq, 0), _opt_str(d, "kind"), _opt_str(d, "reason"),
                                          _opt_int(d, "exitCode", seq)),
    EventType.STOP_REQUESTED: lambda d, seq: StopRequested(_opt_str(d, "by")),
    EventType.COMPLETED: lambda d, seq: Completed(_final_state(d, seq), _opt_int(d, "exitCode", seq),
                                                  _opt_int(d, "attempt", seq)),
}


def _body(kind: str, d: Mapping[str, Any], seq: int) -> Body:
    try:
        reader = _READERS[EventType(kind)]
    except ValueError:
        return OtherEvent(kind, dict(d))
    return reader(d, seq)


def read_event(raw: Mapping[str, Any]) -> JobEvent:
    """The typed form of one event of ``GET /api/v2/events``.

    Raises :class:`EventError` naming the seq and the field when ``seq``, ``jobId`` or a field
    the event's type needs is missing or malformed (the bridge logs it and skips the event).
    """
    seq = raw.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool):
        raise EventError(f"event {raw!r}: seq: an integer is required")
    job_id = raw.get("jobId")
    if not isinstance(job_id, str) or not job_id:
        raise EventError(f"event seq={seq}: jobId: a non-empty string is required, got {job_id!r}")
    kind = str(raw.get("type") or "")
    data = raw.get("data") or {}
    if not isinstance(data, Mapping):
        raise EventError(f"event seq={seq}: data: an object is required, got {data!r}")
    t = raw.get("time")
    return JobEvent(seq, float(t) if isinstance(t, int | float) else None, job_id, kind, _body(kind, data, seq))
