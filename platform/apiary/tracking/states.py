"""The one mapping from an Apiary job's state to its Prefect flow run's state.

Every job is one flow run of flow ``apiary-job``; what the Prefect UI shows for it comes from
this table (:data:`FLOW_RUN_STATES`) and nowhere else (the bridge, :mod:`apiary.tracking.bridge`,
sets the states; the ``apiary-job`` flows return :func:`final` as their result state). No Prefect
import: the table is tested without a server.

=======================================  ============  ==============  =========================================
Apiary                                   Prefect type  Prefect name    message
=======================================  ============  ==============  =========================================
accepted (``job.submitted``)             RUNNING       Submitted       who submitted it, to which VC
WAITING (first attempt)                  PENDING       Waiting         the waiting reason (updated when it changes)
WAITING after a preemption or a retry    PENDING       AwaitingRetry   the cause, then the current waiting reason
RUNNING (an instance started)            RUNNING       Running         which instance started where
SUCCEEDED                                COMPLETED     Completed       exit code 0
FAILED                                   FAILED        Failed          exit code, its exit-spec phrase and reason
STOPPED                                  CANCELLED     Cancelled       who stopped it (exit code -210)
=======================================  ============  ==============  =========================================

Why these types:

* Waiting and AwaitingRetry are PENDING, not SCHEDULED (Prefect's own AwaitingRetry is a
  SCHEDULED state): a SCHEDULED run of a served deployment is picked up and executed by the
  deployment's runner, and the job would be submitted a second time. PENDING is "accepted, not
  running yet", which is what a queued job is.
* The run's first state is RUNNING "Submitted": Prefect fixes a run's expected start time at its
  first state and shows a run "late" when it starts more than 60 s after it (server
  ``estimated_start_time_delta``, UI ``FlowRun.delta``). Starting the run when Apiary accepts the
  job makes the run's start time the submission time, so a queued job is never "late"; the
  time spent queued is visible as the Waiting state in the run's state history.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from apiary.lifecycle.exitspec import classify_exit
from apiary.lifecycle.states import JobState

__all__ = [
    "FINAL_NAMES",
    "FINAL_TYPES",
    "FLOW_RUN_STATES",
    "StateSpec",
    "awaiting_retry",
    "final",
    "running",
    "submitted",
    "waiting",
]

#: THE table: a job's lifecycle state -> its flow run's (Prefect state type, name). The key is the
#: :class:`~apiary.lifecycle.states.JobState` (None: accepted, before the scheduler's first word)
#: and whether the job waits for another attempt (after a preemption or a retry). Every state the
#: bridge or a flow sets comes from here; the functions below only add the message.
FLOW_RUN_STATES: Mapping[tuple[JobState | None, bool], tuple[str, str]] = MappingProxyType({
    (None, False): ("RUNNING", "Submitted"),
    (JobState.WAITING, False): ("PENDING", "Waiting"),
    (JobState.WAITING, True): ("PENDING", "AwaitingRetry"),
    (JobState.RUNNING, False): ("RUNNING", "Running"),
    (JobState.SUCCEEDED, False): ("COMPLETED", "Completed"),
    (JobState.FAILED, False): ("FAILED", "Failed"),
    (JobState.STOPPED, False): ("CANCELLED", "Cancelled"),
})

#: Apiary's final job state -> Prefect state type (the final rows of :data:`FLOW_RUN_STATES`).
FINAL_TYPES: Mapping[JobState, str] = MappingProxyType(
    {s: FLOW_RUN_STATES[(s, False)][0] for s in sorted(JobState.final_states())})
#: Prefect terminal state type -> the name the UI shows.
FINAL_NAMES: Mapping[str, str] = MappingProxyType(
    {FLOW_RUN_STATES[(s, False)][0]: FLOW_RUN_STATES[(s, False)][1] for s in sorted(JobState.final_states())})


@dataclass(frozen=True)
class StateSpec:
    """A Prefect state to set: ``type`` is a ``prefect.client.schemas.objects.StateType`` value
    (``"PENDING"``, ``"RUNNING"``, ...), ``name`` the name the UI shows, ``message`` its message."""

    type: str
    name: str
    message: str

    @property
    def final(self) -> bool:
        """True for COMPLETED, FAILED and CANCELLED."""
        return self.type in FINAL_NAMES


def _row(state: JobState | None, message: str, retrying: bool = False) -> StateSpec:
    ptype, name = FLOW_RUN_STATES[(state, retrying)]
    return StateSpec(ptype, name, message)


def submitted(user: str | None, virtual_cluster: str | None, priority_class: str | None) -> StateSpec:
    """The first state of a job's run: RUNNING "Submitted" (see the module docstring for why)."""
    return _row(None, f"accepted by Apiary: user={user} virtualCluster={virtual_cluster} "
                      f"priorityClass={priority_class}")


def waiting(reason: str | None, retry_cause: str | None = None) -> StateSpec:
    """WAITING: "Waiting" with the waiting reason, or "AwaitingRetry" while ``retry_cause`` is set
    (the job was preempted or is being retried and has not started again)."""
    if retry_cause:
        return awaiting_retry(retry_cause, reason)
    return _row(JobState.WAITING, reason or "waiting for placement")


def awaiting_retry(cause: str, reason: str | None = None) -> StateSpec:
    """A preempted or retried job waiting for its next attempt: ``cause``, then the waiting reason."""
    return _row(JobState.WAITING, f"{cause}; waiting: {reason}" if reason else cause, retrying=True)


def running(message: str) -> StateSpec:
    """RUNNING: an instance of the current attempt started."""
    return _row(JobState.RUNNING, message)


def final(state: JobState | str, exit_code: int | None, attempt: int | None = None,
          stopped_by: str | None = None) -> StateSpec:
    """The terminal state of a job that ended ``state`` (SUCCEEDED | FAILED | STOPPED, the enum or
    its name in any case).

    FAILED carries the exit code with its OpenPAI exit-spec meaning
    (:func:`apiary.lifecycle.exitspec.classify_exit`: phrase, type and reason), e.g.
    ``exit code 1: PAIRuntimeExitAbnormally (USER_FAILURE) ...``. An unknown or non-final
    ``state`` maps to Failed (it cannot be a success). Raises nothing.
    """
    try:
        job_state = JobState(str(state).upper())
    except ValueError:
        job_state = JobState.FAILED
    if not job_state.is_final:
        job_state = JobState.FAILED
    tail = f" (attempt {attempt})" if attempt else ""
    if job_state is JobState.SUCCEEDED:
        message = f"job SUCCEEDED, exit code 0{tail}"
    elif job_state is JobState.STOPPED:
        message = f"job STOPPED{' by ' + stopped_by if stopped_by else ''}, exit code {exit_code}{tail}"
    elif exit_code is None:
        message = f"job {state}{tail}"
    else:
        info = classify_exit(int(exit_code))
        meaning = f"{info.phrase} ({info.type})" + (f": {info.reason}" if info.reason else "")
        message = f"job FAILED, exit code {exit_code}: {meaning}{tail}"
    return _row(job_state, message)
