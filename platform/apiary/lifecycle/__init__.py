"""Job and task lifecycle: state machines, OpenPAI's exit spec, completion and retry policy.

* :mod:`.states`: :class:`JobState`, :class:`TaskState`, the transition tables and their checks
  (``STATES.md`` documents every edge).
* :mod:`.exitspec`: the OpenPAI job exit spec (``k8s-job-exit-spec.yaml``) and the ``EXIT_*`` codes
  Apiary issues.
* :mod:`.policy`: the completion policy (minFailedInstances / minSucceededInstances) and the retry
  decisions (jobRetryCount / taskRetryCount), as pure functions.
* :mod:`.reducer`: the lifecycle itself, ``step(job, input, now) -> Effects``, the one core the control
  plane and the simulator both drive.
"""

from apiary.lifecycle.exitspec import (
    EXIT_ATTEMPT_COMPLETED,
    EXIT_LAUNCH_FAILED,
    EXIT_LIVENESS_FAILED,
    EXIT_MOUNT_FAILED,
    EXIT_NODE_LOST,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_SUCCEEDED,
    UNDEFINED_NEGATIVE_EXIT,
    UNDEFINED_POSITIVE_EXIT,
    ExitInfo,
    classify_exit,
    exit_spec,
)
from apiary.lifecycle.policy import (
    RetryDecision,
    RoleCompletion,
    RoleOutcome,
    decide_retry,
    evaluate_completion,
    task_retry,
)
from apiary.lifecycle.states import (
    JOB_TRANSITIONS,
    TASK_TRANSITIONS,
    AttemptOutcome,
    Desired,
    ExecutionType,
    JobState,
    TaskState,
    check_job_transition,
    check_task_transition,
)

__all__ = [
    "EXIT_ATTEMPT_COMPLETED",
    "EXIT_LAUNCH_FAILED",
    "EXIT_LIVENESS_FAILED",
    "EXIT_MOUNT_FAILED",
    "EXIT_NODE_LOST",
    "EXIT_PREEMPTED",
    "EXIT_STOPPED",
    "EXIT_SUCCEEDED",
    "JOB_TRANSITIONS",
    "TASK_TRANSITIONS",
    "UNDEFINED_NEGATIVE_EXIT",
    "UNDEFINED_POSITIVE_EXIT",
    "AttemptOutcome",
    "Desired",
    "ExecutionType",
    "ExitInfo",
    "JobState",
    "RetryDecision",
    "RoleCompletion",
    "RoleOutcome",
    "TaskState",
    "check_job_transition",
    "check_task_transition",
    "classify_exit",
    "decide_retry",
    "evaluate_completion",
    "exit_spec",
    "task_retry",
]
