"""The one mapping from an Apiary job's state to its Prefect flow run's state.

Every job is one flow run of flow ``apiary-job``; what the Prefect UI shows for it comes from
this table and nowhere else (the bridge, :mod:`apiary.tracking.bridge`, sets the states; the
``apiary-job`` flows return :func:`final` as their result state). No Prefect import: the table is
tested without a server.

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

from dataclasses import dataclass

from apiary.lifecycle.exitspec import classify_exit

__all__ = ["FINAL_NAMES", "FINAL_TYPES", "StateSpec", "awaiting_retry", "final", "running", "submitted", "waiting"]

#: Apiary's final job state -> Prefect state type.
FINAL_TYPES = {"SUCCEEDED": "COMPLETED", "FAILED": "FAILED", "STOPPED": "CANCELLED"}
#: Prefect terminal state type -> the name the UI shows.
FINAL_NAMES = {"COMPLETED": "Completed", "FAILED": "Failed", "CANCELLED": "Cancelled"}


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


def submitted(user: str | None, virtual_cluster: str | None, priority_class: str | None) -> StateSpec:
    """The first state of a job's run: RUNNING "Submitted" (see the module docstring for why)."""
    return StateSpec("RUNNING", "Submitted",
                     f"accepted by Apiary: user={user} virtualCluster={virtual_cluster} priorityClass={priority_class}")


def waiting(reason: str | None, retry_cause: str | None = None) -> StateSpec:
    """WAITING: "Waiting" with the waiting reason, or "AwaitingRetry" while ``retry_cause`` is set
    (the job was preempted or is being retried and has not started again)."""
    if retry_cause:
        return awaiting_retry(retry_cause, reason)
    return StateSpec("PENDING", "Waiting", reason or "waiting for placement")


def awaiting_retry(cause: str, reason: str | None = None) -> StateSpec:
    """A preempted or retried job waiting for its next attempt: ``cause``, then the waiting reason."""
    return StateSpec("PENDING", "AwaitingRetry", f"{cause}; waiting: {reason}" if reason else cause)


def running(message: str) -> StateSpec:
    """RUNNING: an instance of the current attempt started."""
    return StateSpec("RUNNING", "Running", message)


def final(state: str, exit_code: int | None, attempt: int | None = None, stopped_by: str | None = None) -> StateSpec:
    """The terminal state of a job that ended ``state`` (SUCCEEDED | FAILED | STOPPED).

    FAILED carries the exit code with its OpenPAI exit-spec meaning
    (:func:`apiary.lifecycle.exitspec.classify_exit`: phrase, type and reason), e.g.
    ``exit code 1: PAIRuntimeExitAbnormally (USER_FAILURE) ...``. An unknown ``state`` maps to
    Failed (it cannot be a success). Raises nothing.
    """
    ptype = FINAL_TYPES.get(str(state).upper(), "FAILED")
    tail = f" (attempt {attempt})" if attempt else ""
    if ptype == "COMPLETED":
        message = f"job SUCCEEDED, exit code 0{tail}"
    elif ptype == "CANCELLED":
        message = f"job STOPPED{' by ' + stopped_by if stopped_by else ''}, exit code {exit_code}{tail}"
    elif exit_code is None:
        message = f"job {state}{tail}"
    else:
        info = classify_exit(int(exit_code))
        meaning = f"{info.phrase} ({info.type})" + (f": {info.reason}" if info.reason else "")
        message = f"job FAILED, exit code {exit_code}: {meaning}{tail}"
    return StateSpec(ptype, FINAL_NAMES[ptype], message)
