"""Completion and retry policy: pure functions of counts and exit codes (no I/O, no clock).

Sources:

* OpenPAI job protocol v2, ``taskRoles.<role>.completion`` (``minFailedInstances``,
  ``minSucceededInstances``), ``jobRetryCount`` and ``taskRetryCount``; and OpenPAI's user manual,
  ``manual/cluster-user/advanced-jobs.md``, section "Job Exit Spec, Retry Policy, and Completion Policy".
* FrameworkController, ``pkg/apis/frameworkcontroller/v1/types.go``: ``CompletionPolicySpec``
  (``minFailedTaskCount`` / ``minSucceededTaskCount``, which OpenPAI's completion fields map to) and
  ``RetryPolicySpec`` (``fancyRetryPolicy``: transient failures always retry, permanent never, the rest
  up to ``maxRetryCount``).
* The exit spec's ``behavior`` / ``reaction`` fields (:mod:`apiary.lifecycle.exitspec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from apiary.errors import ValidationError
from apiary.lifecycle.exitspec import EXIT_STOPPED, EXIT_SUCCEEDED, ExitInfo, classify_exit

__all__ = [
    "RetryDecision",
    "RoleCompletion",
    "RoleOutcome",
    "decide_retry",
    "evaluate_completion",
    "task_retry",
]

_RETRY_ALWAYS = frozenset({"ALWAYS_RETRY", "ALWAYS_BACKOFF_RETRY"})


# --------------------------------------------------------------------------------------------------
# Completion policy
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleCompletion:
    """A task role's size and completion policy (OpenPAI ``taskRoles.<role>``).

    ``instances``: number of task instances, >= 1. ``min_failed`` (``completion.minFailedInstances``):
    -1 (never fail the job because of this role) or 1..instances; default 1 (OpenPAI). ``min_succeeded``
    (``completion.minSucceededInstances``): -1 (this role never ends the attempt by succeeding; the job
    succeeds when every task of every role has finished) or 1..instances; default -1 (OpenPAI user
    manual). Values outside these ranges raise :class:`~apiary.errors.ValidationError` (OpenPAI's REST
    server also rejects a min count larger than the instances).
    """

    instances: int
    min_failed: int = 1
    min_succeeded: int = -1

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValidationError("instances", f"must be >= 1, got {self.instances}")
        for field, value in (
            ("completion.minFailedInstances", self.min_failed),
            ("completion.minSucceededInstances", self.min_succeeded),
        ):
            if value != -1 and not 1 <= value <= self.instances:
                raise ValidationError(
                    field, f"must be -1 or between 1 and instances ({self.instances}), got {value}"
                )


@dataclass(frozen=True)
class RoleOutcome:
    """Counts of a role's task instances in final states in the current attempt.

    ``finished`` counts every final state (SUCCEEDED + FAILED + STOPPED), so ``succeeded + failed <=
    finished``. Negative counts or ``succeeded + failed > finished`` raise ``ValueError``.
    """

    succeeded: int = 0
    failed: int = 0
    finished: int = 0

    def __post_init__(self) -> None:
        if min(self.succeeded, self.failed, self.finished) < 0:
            raise ValueError(f"negative count in {self}")
        if self.succeeded + self.failed > self.finished:
            raise ValueError(f"succeeded + failed exceeds finished in {self}")


def evaluate_completion(
    roles: Mapping[str, RoleCompletion], outcomes: Mapping[str, RoleOutcome]
) -> Literal["SUCCEEDED", "FAILED"] | None:
    """Whether the current attempt is complete, and how: ``"SUCCEEDED"``, ``"FAILED"`` or ``None``.

    ``roles``: role name -> policy; ``outcomes``: role name -> counts (a role without an entry has no
    finished task yet). Rules, after FrameworkController's ``CompletionPolicySpec`` and OpenPAI's
    completion fields:

    1. ``FAILED`` as soon as some role has ``min_failed != -1`` and ``failed >= min_failed``, regardless
       of unfinished tasks. (FrameworkController rule 2; OpenPAI: "number of failed tasks to fail the
       entire job ... -1 means the job will always succeed regardless any task failure".)
    2. Otherwise ``SUCCEEDED`` as soon as some role has ``min_succeeded != -1`` and ``succeeded >=
       min_succeeded``, regardless of unfinished tasks (FrameworkController rule 3). So a role with 2
       instances and ``min_succeeded=1`` succeeds the job when its first instance succeeds.
    3. Otherwise ``SUCCEEDED`` once every instance of every role has finished (FrameworkController rule
       5: "the CompletionStatus is succeeded which is not generated from any Task").
    4. Otherwise ``None``: the attempt goes on.

    ``-1`` for ``min_succeeded`` disables rule 2 for that role; it does not mean "all of this role's
    instances". Per the protocol: "if set to -1 means the job will only succeed until all tasks are
    completed and minFailedInstances is not triggered", i.e. rule 3 over the whole job. With a single
    role and ``min_failed=1`` the two readings agree; with several roles they differ (a ``-1`` worker
    role whose instances all succeeded does not end the job while a ``-1`` ps role still runs).

    When failure and success fire in the same evaluation, FAILED wins: FrameworkController leaves the
    choice open ("can be any one of these satisfied conditions"); Apiary is deterministic and
    conservative. Rule 3 follows FrameworkController/the protocol even when tasks failed under
    ``min_failed=-1`` (a newer OpenPAI manual says "-1 ... succeed only when all tasks are completed with
    exit code 0", which contradicts the protocol's "-1 means the job will always succeed regardless any
    task failure"; Apiary follows the protocol).

    Raises ``ValueError`` when ``roles`` is empty, an outcome names an unknown role, or a role reports
    more finished instances than it has.
    """
    if not roles:
        raise ValueError("a job has at least one task role")
    for name in outcomes:
        if name not in roles:
            raise ValueError(f"outcomes for unknown task roles: {sorted(set(outcomes) - set(roles))}")
    empty = RoleOutcome()
    counts = {name: outcomes.get(name, empty) for name in roles}
    for name, outcome in counts.items():
        if outcome.finished > roles[name].instances:
            raise ValueError(
                f"task role {name!r}: {outcome.finished} finished of {roles[name].instances} instances"
            )

    for name, policy in roles.items():
        if policy.min_failed != -1 and counts[name].failed >= policy.min_failed:
            return "FAILED"
    for name, policy in roles.items():
        if policy.min_succeeded != -1 and counts[name].succeeded >= policy.min_succeeded:
            return "SUCCEEDED"
    if all(counts[name].finished == policy.instances for name, policy in roles.items()):
        return "SUCCEEDED"
    return None


# --------------------------------------------------------------------------------------------------
# Retry policy
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryDecision:
    """Whether the ended attempt is retried.

    ``retry``: retry or not. ``kind``: the retry counter the retry increments, ``"user"`` (counted
    against ``jobRetryCount``) or ``"platform"`` (never counted); ``None`` when not retrying. ``reason``:
    a sentence citing the exit code's phrase and the rule applied. ``backoff``: the spec's reaction is
    ``ALWAYS_BACKOFF_RETRY`` (e.g. 251 JobGangAllocationTimeout), so the retry should wait first; how
    long is the caller's choice.
    """

    retry: bool
    kind: Literal["user", "platform"] | None
    reason: str
    backoff: bool = False


def _describe(info: ExitInfo) -> str:
    return f"exit code {info.code} ({info.phrase}, {info.behavior}, {info.reaction})"


def _check_counts(used: int, allowed: int, used_name: str, allowed_name: str) -> None:
    if used < 0:
        raise ValueError(f"{used_name} must be >= 0, got {used}")
    if allowed < 0:
        raise ValueError(f"{allowed_name} must be >= 0, got {allowed}")


def decide_retry(
    exit_code: int, *, user_retries: int, job_retry_count: int, platform_cause: bool = False
) -> RetryDecision:
    """Decide whether a job attempt that ended with ``exit_code`` (and did not succeed) is retried.

    ``user_retries``: retries already counted against the job's ``jobRetryCount`` (>= 0).
    ``job_retry_count``: the protocol's ``jobRetryCount`` (>= 0, default 0). ``platform_cause``: Apiary
    itself knows the attempt ended because of the platform (preemption, node loss).

    Rules, in order:

    1. ``EXIT_SUCCEEDED`` (0) and ``EXIT_STOPPED`` (-210 StopFrameworkRequested, USER_STOP) never retry,
       whatever else holds: success is final, and a user stop is final (OpenPAI: stop has reaction
       NEVER_RETRY; FrameworkController: "If ... the ExecutionType is ExecutionStop ... will not retry").
    2. ``platform_cause=True`` -> retry, kind ``"platform"``: the cause is Apiary's, so it is never
       counted against jobRetryCount (the spec gives the matching codes -1003 PodPreemptedForCriticalPod
       and -1001 PodNodeLost behavior TRANSIENT, reaction ALWAYS_RETRY).
    3. Reaction ``ALWAYS_RETRY`` / ``ALWAYS_BACKOFF_RETRY`` (behavior TRANSIENT / TRANSIENT_CONFLICT,
       e.g. 137 ContainerSigKillReceived) -> retry, kind ``"platform"`` (OpenPAI: "transient error will
       be always retried"); ``backoff`` is set for ALWAYS_BACKOFF_RETRY.
    4. Reaction ``NEVER_RETRY`` (behavior PERMANENT, e.g. 141 ContainerSigPipeReceived) -> no retry
       ("permanent error will never be retried").
    5. Reaction ``RETRY_TO_MAX`` (behavior UNKNOWN, e.g. plain ``exit 1`` via the 256 fallback) -> retry
       with kind ``"user"`` while ``user_retries < job_retry_count``, else no retry ("If unknown error
       happens, PAI will retry it according to user settings").

    Raises ``ValueError`` for a negative count and ``TypeError`` for a non-integer exit code.
    """
    _check_counts(user_retries, job_retry_count, "user_retries", "job_retry_count")
    info = classify_exit(exit_code)
    what = _describe(info)
    if exit_code == EXIT_SUCCEEDED:
        return RetryDecision(False, None, f"{what}: the attempt succeeded; success is never retried")
    if exit_code == EXIT_STOPPED:
        return RetryDecision(False, None, f"{what}: the user stopped the job; a stop is never retried")
    if platform_cause:
        return RetryDecision(
            True, "platform", f"{what}: ended by a platform cause; platform retry, not counted"
        )
    if info.reaction in _RETRY_ALWAYS:
        backoff = info.reaction == "ALWAYS_BACKOFF_RETRY"
        return RetryDecision(
            True,
            "platform",
            f"{what}: transient failure; platform retry{' after a backoff' if backoff else ''}, not counted",
            backoff=backoff,
        )
    if info.reaction == "NEVER_RETRY":
        return RetryDecision(False, None, f"{what}: permanent; never retried")
    # RETRY_TO_MAX (and anything the spec may add later): bounded by jobRetryCount.
    if user_retries < job_retry_count:
        return RetryDecision(
            True,
            "user",
            f"{what}: unknown failure; user retry {user_retries + 1} of jobRetryCount {job_retry_count}",
        )
    return RetryDecision(
        False,
        None,
        f"{what}: unknown failure and jobRetryCount {job_retry_count} is used up "
        f"({user_retries} retries); no retry",
    )


def task_retry(exit_code: int, *, task_retries: int, task_retry_count: int) -> bool:
    """Whether a task instance that ended with ``exit_code`` is retried in place (``taskRetryCount``).

    ``task_retries``: in-place retries this instance already used against ``task_retry_count`` (both >= 0).
    Same rules as :func:`decide_retry` at task scope (OpenPAI manual: transient errors are always
    retried, permanent errors never, unknown errors as the user's retry count allows; FrameworkController
    applies its ``RetryPolicySpec`` to each Task the same way): 0 and ``EXIT_STOPPED`` never;
    ``ALWAYS_RETRY`` / ``ALWAYS_BACKOFF_RETRY`` always; ``NEVER_RETRY`` (permanent) never;
    ``RETRY_TO_MAX`` while ``task_retries < task_retry_count``. OpenPAI only honours taskRetryCount when
    ``extras.gangAllocation`` is false; that gate is the caller's. Raises ``ValueError`` for a negative
    count and ``TypeError`` for a non-integer exit code.
    """
    _check_counts(task_retries, task_retry_count, "task_retries", "task_retry_count")
    info = classify_exit(exit_code)
    if exit_code in (EXIT_SUCCEEDED, EXIT_STOPPED):
        return False
    if info.reaction in _RETRY_ALWAYS:
        return True
    if info.reaction == "NEVER_RETRY":
        return False
    return task_retries < task_retry_count
