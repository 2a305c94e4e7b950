"""Completion policy (minFailedInstances / minSucceededInstances) and retry decisions."""

from __future__ import annotations

import pytest

from apiary.errors import ValidationError
from apiary.lifecycle import (
    EXIT_ATTEMPT_COMPLETED,
    EXIT_LAUNCH_FAILED,
    EXIT_LIVENESS_FAILED,
    EXIT_NODE_LOST,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    RetryDecision,
    RoleCompletion,
    RoleOutcome,
    decide_retry,
    evaluate_completion,
    task_retry,
)

RC = RoleCompletion


def done(succeeded: int = 0, failed: int = 0, stopped: int = 0) -> RoleOutcome:
    """Outcome counts; ``finished`` includes the stopped instances."""
    return RoleOutcome(succeeded=succeeded, failed=failed, finished=succeeded + failed + stopped)


# --------------------------------------------------------------------------------------------------
# Completion policy
# --------------------------------------------------------------------------------------------------

# job-config-6: 2 instances, minSucceededInstances 1, minFailedInstances 1
CFG6 = {"worker": RC(instances=2, min_failed=1, min_succeeded=1)}
# OpenPAI protocol example: worker (minSucceeded 1) + ps_server (minSucceeded -1)
TF_PS = {"worker": RC(instances=2, min_failed=1, min_succeeded=1), "ps": RC(instances=1, min_succeeded=-1)}
# both roles -1: success only once every task of every role finished
BOTH_ALL = {"worker": RC(instances=2), "ps": RC(instances=1)}

COMPLETION_CASES = [
    # id, roles, outcomes, expected
    ("cfg6-nothing-finished", CFG6, {}, None),
    ("cfg6-one-succeeded-other-running", CFG6, {"worker": done(succeeded=1)}, "SUCCEEDED"),
    ("cfg6-one-failed-other-running", CFG6, {"worker": done(failed=1)}, "FAILED"),
    ("cfg6-one-each-failure-wins", CFG6, {"worker": done(succeeded=1, failed=1)}, "FAILED"),
    ("cfg6-one-stopped-only", CFG6, {"worker": done(stopped=1)}, None),
    ("default-single-running", {"r": RC(instances=3)}, {"r": done(succeeded=2)}, None),
    ("default-single-all-succeeded", {"r": RC(instances=3)}, {"r": done(succeeded=3)}, "SUCCEEDED"),
    ("default-single-one-failed", {"r": RC(instances=3)}, {"r": done(succeeded=2, failed=1)}, "FAILED"),
    ("min-failed-2-one-failed", {"r": RC(instances=3, min_failed=2)}, {"r": done(failed=1)}, None),
    ("min-failed-2-two-failed", {"r": RC(instances=3, min_failed=2)}, {"r": done(failed=2)}, "FAILED"),
    (
        "min-failed-2-all-finished-one-failed",
        {"r": RC(instances=3, min_failed=2)},
        {"r": done(succeeded=2, failed=1)},
        "SUCCEEDED",
    ),
    (
        "min-failed-minus1-failures-pending",
        {"r": RC(instances=2, min_failed=-1)},
        {"r": done(failed=1)},
        None,
    ),
    (
        "min-failed-minus1-all-failed-still-succeeds",
        {"r": RC(instances=2, min_failed=-1)},
        {"r": done(failed=2)},
        "SUCCEEDED",
    ),
    (
        "all-finished-with-stops-succeeds",
        {"r": RC(instances=2)},
        {"r": done(succeeded=1, stopped=1)},
        "SUCCEEDED",
    ),
    ("tf-ps-worker-succeeded-ps-running", TF_PS, {"worker": done(succeeded=1)}, "SUCCEEDED"),
    ("tf-ps-ps-failed", TF_PS, {"ps": done(failed=1)}, "FAILED"),
    ("tf-ps-ps-succeeded-worker-running", TF_PS, {"ps": done(succeeded=1)}, None),
    ("both-minus1-workers-done-ps-running", BOTH_ALL, {"worker": done(succeeded=2)}, None),
    ("both-minus1-all-done", BOTH_ALL, {"worker": done(succeeded=2), "ps": done(succeeded=1)}, "SUCCEEDED"),
    ("both-minus1-worker-failed", BOTH_ALL, {"worker": done(failed=1)}, "FAILED"),
    (
        "min-succeeded-equals-instances",
        {"r": RC(instances=2, min_succeeded=2), "s": RC(instances=1)},
        {"r": done(succeeded=2)},
        "SUCCEEDED",
    ),
]


@pytest.mark.parametrize(
    ("roles", "outcomes", "expected"),
    [case[1:] for case in COMPLETION_CASES],
    ids=[case[0] for case in COMPLETION_CASES],
)
def test_evaluate_completion(roles, outcomes, expected):
    assert evaluate_completion(roles, outcomes) == expected


def test_role_completion_defaults_are_openpais():
    role = RoleCompletion(instances=4)
    assert (role.min_failed, role.min_succeeded) == (1, -1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"instances": 0}, "instances"),
        ({"instances": 2, "min_failed": 0}, "completion.minFailedInstances"),
        ({"instances": 2, "min_failed": 3}, "completion.minFailedInstances"),
        ({"instances": 2, "min_failed": -2}, "completion.minFailedInstances"),
        ({"instances": 2, "min_succeeded": 0}, "completion.minSucceededInstances"),
        ({"instances": 2, "min_succeeded": 3}, "completion.minSucceededInstances"),
    ],
    ids=["no-instances", "min-failed-0", "min-failed-gt", "min-failed-neg", "min-succ-0", "min-succ-gt"],
)
def test_role_completion_validation(kwargs, field):
    with pytest.raises(ValidationError) as caught:
        RoleCompletion(**kwargs)
    assert caught.value.field == field
    assert field in str(caught.value)


@pytest.mark.parametrize(
    ("succeeded", "failed", "finished"),
    [(-1, 0, 0), (0, 0, -1), (1, 1, 1)],
    ids=["negative-succeeded", "negative-finished", "more-than-finished"],
)
def test_role_outcome_validation(succeeded, failed, finished):
    with pytest.raises(ValueError):
        RoleOutcome(succeeded=succeeded, failed=failed, finished=finished)


def test_evaluate_completion_rejects_bad_input():
    with pytest.raises(ValueError):
        evaluate_completion({}, {})
    with pytest.raises(ValueError, match="ghost"):
        evaluate_completion({"r": RC(instances=1)}, {"ghost": done(succeeded=1)})
    with pytest.raises(ValueError, match="3 finished of 2"):
        evaluate_completion({"r": RC(instances=2, min_failed=-1)}, {"r": done(stopped=3)})


# --------------------------------------------------------------------------------------------------
# Job retry
# --------------------------------------------------------------------------------------------------

RETRY_CASES = [
    # id, exit_code, user_retries, job_retry_count, platform_cause, (retry, kind, backoff)
    ("always-retry-137-sigkill", 137, 0, 0, False, (True, "platform", False)),
    ("always-retry-143-sigterm", 143, 5, 1, False, (True, "platform", False)),
    ("always-retry-node-lost-code", EXIT_NODE_LOST, 0, 0, False, (True, "platform", False)),
    ("backoff-251-gang-timeout", 251, 0, 0, False, (True, "platform", True)),
    ("never-retry-141-sigpipe", 141, 0, 3, False, (False, None, False)),
    ("never-retry-launch-failed", EXIT_LAUNCH_FAILED, 0, 3, False, (False, None, False)),
    ("never-retry-success", 0, 0, 3, False, (False, None, False)),
    ("stopped-never-retries", EXIT_STOPPED, 0, 3, False, (False, None, False)),
    ("stopped-never-retries-even-platform", EXIT_STOPPED, 0, 3, True, (False, None, False)),
    ("attempt-completion-never-retries", EXIT_ATTEMPT_COMPLETED, 0, 3, False, (False, None, False)),
    ("retry-to-max-exit1-no-retries-configured", 1, 0, 0, False, (False, None, False)),
    ("retry-to-max-exit1-first", 1, 0, 2, False, (True, "user", False)),
    ("retry-to-max-exit1-last-allowed", 1, 1, 2, False, (True, "user", False)),
    ("retry-to-max-exit1-boundary-exhausted", 1, 2, 2, False, (False, None, False)),
    ("retry-to-max-exit1-over", 1, 3, 2, False, (False, None, False)),
    ("retry-to-max-unknown-negative", -5, 0, 1, False, (True, "user", False)),
    ("retry-to-max-liveness", EXIT_LIVENESS_FAILED, 1, 1, False, (False, None, False)),
    ("platform-cause-preempted", EXIT_PREEMPTED, 0, 0, True, (True, "platform", False)),
    ("platform-cause-overrides-exhausted-user-retries", 1, 9, 2, True, (True, "platform", False)),
    ("platform-cause-overrides-permanent-code", 141, 0, 0, True, (True, "platform", False)),
]


@pytest.mark.parametrize(
    ("exit_code", "user_retries", "job_retry_count", "platform_cause", "expected"),
    [case[1:] for case in RETRY_CASES],
    ids=[case[0] for case in RETRY_CASES],
)
def test_decide_retry(exit_code, user_retries, job_retry_count, platform_cause, expected):
    decision = decide_retry(
        exit_code, user_retries=user_retries, job_retry_count=job_retry_count, platform_cause=platform_cause
    )
    assert isinstance(decision, RetryDecision)
    assert (decision.retry, decision.kind, decision.backoff) == expected
    assert f"exit code {exit_code} " in decision.reason
    assert decision.reason


def test_retry_reason_cites_the_phrase():
    assert "ContainerSigKillReceived" in decide_retry(137, user_retries=0, job_retry_count=0).reason
    reason = decide_retry(1, user_retries=2, job_retry_count=2).reason
    assert "PAIRuntimeExitAbnormally" in reason and "jobRetryCount 2" in reason


def test_user_retries_are_bounded_by_job_retry_count():
    """Simulate a job whose every attempt exits 1: exactly jobRetryCount user retries happen."""
    user_retries = 0
    while (decision := decide_retry(1, user_retries=user_retries, job_retry_count=3)).retry:
        assert decision.kind == "user"
        user_retries += 1
    assert user_retries == 3


def test_platform_retries_do_not_consume_user_retries():
    """A platform retry between user retries does not change the user budget."""
    assert decide_retry(EXIT_NODE_LOST, user_retries=1, job_retry_count=1, platform_cause=True).retry
    assert not decide_retry(1, user_retries=1, job_retry_count=1).retry


@pytest.mark.parametrize(
    ("user_retries", "job_retry_count"), [(-1, 0), (0, -1)], ids=["negative-used", "negative-allowed"]
)
def test_decide_retry_rejects_negative_counts(user_retries, job_retry_count):
    with pytest.raises(ValueError):
        decide_retry(1, user_retries=user_retries, job_retry_count=job_retry_count)


# --------------------------------------------------------------------------------------------------
# Task retry (taskRetryCount)
# --------------------------------------------------------------------------------------------------

TASK_RETRY_CASES = [
    # id, exit_code, task_retries, task_retry_count, expected
    ("success-never", 0, 0, 5, False),
    ("stopped-never", EXIT_STOPPED, 0, 5, False),
    ("permanent-never", 141, 0, 5, False),
    ("permanent-launch-never", EXIT_LAUNCH_FAILED, 0, 5, False),
    ("transient-always", 137, 10, 0, True),
    ("backoff-always", 251, 10, 0, True),
    ("unknown-no-budget", 1, 0, 0, False),
    ("unknown-within-budget", 1, 1, 2, True),
    ("unknown-boundary", 1, 2, 2, False),
]


@pytest.mark.parametrize(
    ("exit_code", "task_retries", "task_retry_count", "expected"),
    [case[1:] for case in TASK_RETRY_CASES],
    ids=[case[0] for case in TASK_RETRY_CASES],
)
def test_task_retry(exit_code, task_retries, task_retry_count, expected):
    assert task_retry(exit_code, task_retries=task_retries, task_retry_count=task_retry_count) is expected


def test_task_retry_rejects_negative_counts():
    with pytest.raises(ValueError):
        task_retry(1, task_retries=-1, task_retry_count=0)
