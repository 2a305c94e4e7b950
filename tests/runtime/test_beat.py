"""The heartbeat schedule (apiary.runtime.beat): jittered periods, full-jitter retries, and random
phases after a storm, so a fleet does not beat in step."""

from __future__ import annotations

import random

from apiary.runtime.beat import (
    HEARTBEAT_JITTER,
    RECOVERY_PERIOD_MIN,
    REPORT_RETRY_MIN_S,
    SLOW_ANSWER,
    SLOW_PERIOD_MIN,
    HeartbeatTimer,
)


def test_a_steady_agent_beats_every_period_stretched_by_at_most_the_jitter() -> None:
    t = HeartbeatTimer(random.Random(1))
    t.answered(100.0, 100.01, 10.0)  # the first answer: a random phase
    assert RECOVERY_PERIOD_MIN <= t.stretch <= 1.0 and t.last == 100.0
    stretches = []
    for k in range(1, 50):
        t.answered(100.0 + 10 * k, 100.0 + 10 * k + 0.01, 10.0)
        stretches.append(t.stretch)
        assert t.last == 100.0 + 10 * k  # counted from the send
    assert all(1.0 <= s <= 1.0 + HEARTBEAT_JITTER for s in stretches) and len(set(stretches)) > 40


def test_agents_answered_together_after_a_storm_leave_it_spread_over_a_period() -> None:
    rng = random.Random(7)
    fleet = [HeartbeatTimer(rng) for _ in range(1000)]
    for t in fleet:
        t.answered(50.0, 50.1, 10.0)  # a first answer
        t.answered(60.0, 85.0, 10.0)  # answered 25 s late, all in the same catch-up burst
    due = sorted(t.last + t.period_s(10.0) for t in fleet)
    assert due[0] >= 85.0 + RECOVERY_PERIOD_MIN * 10.0 and due[-1] <= 95.0  # from the answer, within a period
    per_second = [sum(1 for d in due if s <= d - 85.0 < s + 1) for s in range(1, 10)]
    assert max(per_second) < 2 * 1000 / 9  # spread, not all at once


def test_a_late_answer_of_a_self_fencing_agent_keeps_two_thirds_of_its_time_to_the_fence() -> None:
    t = HeartbeatTimer(random.Random(3))
    t.last = 1.0
    t.answered(10.0, 25.0, 10.0, fence_left_s=6.0)
    assert t.period_s(10.0) <= 2.0 + 1e-9 and t.last == 25.0


def test_retries_wait_a_random_time_whose_cap_doubles_up_to_one_period_and_reset_on_an_answer() -> None:
    t = HeartbeatTimer(random.Random(5))
    waits = [t.retry_s(10.0) for _ in range(12)]
    assert t.failures == 12
    assert all(REPORT_RETRY_MIN_S <= w <= 10.0 for w in waits)
    assert waits[0] <= 2 * REPORT_RETRY_MIN_S and max(waits) > 4 * REPORT_RETRY_MIN_S
    t.answered(200.0, 200.1, 10.0)
    assert t.failures == 0 and RECOVERY_PERIOD_MIN <= t.stretch <= 1.0  # back at a random phase
    assert HeartbeatTimer(random.Random(5)).retry_s(0.2) == REPORT_RETRY_MIN_S  # never under the minimum


def test_agents_sent_in_step_and_answered_slowly_leave_the_step() -> None:
    rng = random.Random(11)
    fleet = [HeartbeatTimer(rng) for _ in range(1000)]
    for t in fleet:
        t.answered(50.0, 50.1, 10.0)  # a first answer
        t.answered(60.0 + rng.uniform(0, 0.5), 63.0, 10.0)  # sent within half a second, answered 3 s later
    due = sorted(t.last + t.period_s(10.0) for t in fleet)
    assert due[0] >= 63.0 + SLOW_PERIOD_MIN * 10.0 and due[-1] <= 73.0  # counted from the answer
    per_second = [sum(1 for d in due if s <= d - 63.0 < s + 1) for s in range(5, 10)]
    assert max(per_second) < 2 * 1000 / 5
    fencing = HeartbeatTimer(random.Random(4))
    fencing.answered(50.0, 50.1, 10.0)
    fencing.answered(60.0, 63.0, 10.0, fence_left_s=9.0)  # slow, 9 s left before the fence
    assert fencing.period_s(10.0) <= 3.0 + 1e-9 and fencing.last == 63.0
    t = HeartbeatTimer(random.Random(2))
    t.answered(50.0, 50.1, 10.0)
    t.answered(60.0, 60.0 + SLOW_ANSWER * 10.0 * 0.9, 10.0)  # just under slow: the steady jitter
    assert 1.0 <= t.stretch <= 1.0 + HEARTBEAT_JITTER
