"""Escalation policies: plan times with delays and loops, acknowledgements, ack timeouts, the
deterministic recomputation a restarted worker relies on, and tier targets through schedules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from apiary.errors import ValidationError
from apiary.oncall import (
    Layer,
    Override,
    Page,
    Policy,
    Schedule,
    Target,
    Tier,
    escalation_plan,
    load_policy,
    next_page,
    parse_policy,
    resolve_targets,
)

T = datetime(2024, 3, 13, 2, 0, tzinfo=UTC)


def minutes(m: float) -> datetime:
    return T + timedelta(minutes=m)


def policy(loops: int = 2, ack_timeout_min: int | None = None) -> Policy:
    """Tiers 1 (schedule primary, 15 min), 2 (schedule senior + lead, 20 min), 3 (manager, 30 min)."""
    return Policy(
        name="ml-platform",
        loops=loops,
        ack_timeout_min=ack_timeout_min,
        tiers=(
            Tier(level=1, targets=(Target(schedule="primary"),), delay_min=15),
            Tier(level=2, targets=(Target(schedule="senior"), Target(user="lead")), delay_min=20),
            Tier(level=3, targets=(Target(user="manager"),), delay_min=30),
        ),
    )


def timeline(pages: list[Page]) -> list[tuple[float, int, int]]:
    """(minutes after T, tier, loop) per page."""
    return [((p.at - T).total_seconds() / 60, p.tier, p.loop) for p in pages]


def when(page: Page | None) -> tuple[float, int, int] | None:
    return None if page is None else timeline([page])[0]


def test_plan_with_delays_and_loops() -> None:
    assert timeline(escalation_plan(policy(loops=2), T)) == [
        (0, 1, 0),
        (15, 2, 0),
        (35, 3, 0),
        (65, 1, 1),  # tier 3's 30 minutes, then the policy repeats
        (80, 2, 1),
        (100, 3, 1),
        (130, 1, 2),
        (145, 2, 2),
        (165, 3, 2),
    ]
    assert timeline(escalation_plan(policy(loops=0), T)) == [(0, 1, 0), (15, 2, 0), (35, 3, 0)]
    plan = escalation_plan(policy(), T.astimezone(ZoneInfo("Asia/Tokyo")))
    assert plan[0].at == T and plan[0].at.tzinfo is UTC
    assert plan[1].targets == (Target(schedule="senior"), Target(user="lead"))


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        pytest.param(0, (0, 1, 0), id="at-trigger-tier-1"),
        pytest.param(0.5, (15, 2, 0), id="after-tier-1"),
        pytest.param(15, (15, 2, 0), id="exactly-at-tier-2"),
        pytest.param(64, (65, 1, 1), id="before-loop-1"),
        pytest.param(165, (165, 3, 2), id="last-page"),
        pytest.param(166, None, id="after-the-last-page"),
    ],
)
def test_next_page_without_ack(now: float, expected: tuple[float, int, int] | None) -> None:
    assert when(next_page(policy(), T, None, minutes(now))) == expected


def test_an_acknowledgement_stops_escalation() -> None:
    p = policy(ack_timeout_min=None)
    assert next_page(p, T, minutes(5), minutes(5)) is None
    assert next_page(p, T, minutes(5), minutes(10_000)) is None
    assert next_page(p, T, T, T) is None  # acked at the trigger instant: tier 1 is not paged


def test_ack_timeout_retriggers_at_tier_1() -> None:
    p = policy(loops=1, ack_timeout_min=30)
    # Tier 2 was paged at 15; acked at 20; not resolved by 50: tier 1 again at 50, then on.
    assert when(next_page(p, T, minutes(20), minutes(20))) == (50, 1, 0)
    assert when(next_page(p, T, minutes(20), minutes(50))) == (50, 1, 0)
    assert when(next_page(p, T, minutes(20), minutes(51))) == (65, 2, 0)
    # The restarted escalation has all its loops: the last page is 100 min after the restart.
    assert when(next_page(p, T, minutes(20), minutes(115))) == (115, 1, 1)
    assert when(next_page(p, T, minutes(20), minutes(150))) == (150, 3, 1)
    assert next_page(p, T, minutes(20), minutes(151)) is None
    # A second acknowledgement (the latest is what counts) restarts the timeout.
    assert when(next_page(p, T, minutes(60), minutes(60))) == (90, 1, 0)


def _worker(p: Policy, acks: dict[int, datetime], crash_after: int | None) -> list[Page]:
    """A durable escalation worker over stored facts: it sends each page as it falls due, stores
    only the `at` of the last page sent, and (if `crash_after`) restarts after that many pages,
    recomputing from the stored facts alone. `acks`: acknowledgement time by the number of
    pages sent before it."""
    sent: list[Page] = []
    cursor = T  # nothing sent yet: ask from the trigger itself
    ack: datetime | None = None
    while True:
        if len(sent) in acks:
            ack = acks[len(sent)]
            cursor = max(cursor, ack)
        page = next_page(p, T, ack, cursor)
        if page is None:
            return sent
        sent.append(page)
        cursor = page.at + timedelta(microseconds=1)
        if crash_after is not None and len(sent) == crash_after:
            crash_after = None  # the restart: nothing survives but (T, ack, cursor) in the store
            cursor = sent[-1].at + timedelta(microseconds=1)


@pytest.mark.parametrize("crash_after", [None, 1, 2, 4], ids=lambda c: f"crash-after-{c}")
def test_a_restarted_worker_recomputes_the_same_deadlines(crash_after: int | None) -> None:
    p = policy(loops=1, ack_timeout_min=30)
    assert _worker(p, {}, crash_after) == escalation_plan(p, T)
    acked = _worker(p, {2: minutes(20)}, crash_after)
    assert timeline(acked) == [
        (0, 1, 0),
        (15, 2, 0),
        (50, 1, 0),
        (65, 2, 0),
        (85, 3, 0),
        (115, 1, 1),
        (130, 2, 1),
        (150, 3, 1),
    ]
    # Same facts, same answers, whatever zone the instants are written in.
    tokyo = ZoneInfo("Asia/Tokyo")
    for now in (0, 7, 15, 49, 50, 200):
        assert next_page(p, T, minutes(20), minutes(max(now, 20))) == next_page(
            p, T.astimezone(tokyo), minutes(20).astimezone(tokyo), minutes(max(now, 20)).astimezone(tokyo)
        )


@pytest.mark.parametrize(
    ("ack", "now", "message"),
    [
        pytest.param(minutes(-1), minutes(5), "before triggered_at", id="ack-before-trigger"),
        pytest.param(minutes(10), minutes(5), "after now", id="ack-after-now"),
        pytest.param(None, datetime(2024, 3, 13, 3), "now must be a timezone-aware", id="naive-now"),
    ],
)
def test_next_page_rejects_inconsistent_facts(ack: datetime | None, now: datetime, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        next_page(policy(), T, ack, now)


def test_resolve_targets_through_schedules() -> None:
    primary = Schedule(
        name="primary",
        layers=(
            Layer(
                name="daily",
                users=("alice", "bob"),
                rotation="daily",
                handoff="09:00",
                start=datetime(2024, 3, 11, 9, tzinfo=ZoneInfo("Europe/Berlin")),
                time_zone="Europe/Berlin",
            ),
        ),
        overrides=(Override(user="lead", start=minutes(60), end=minutes(120)),),
    )
    nobody_yet = Schedule(
        name="senior",
        layers=(Layer(name="l", users=("sam",), rotation="weekly", start=minutes(24 * 60), time_zone="UTC"),),
    )
    schedules = {"primary": primary, "senior": nobody_yet}
    tier1, tier2, tier3 = policy().tiers
    # 2024-03-13 03:00 Berlin is Tuesday's turn (handoff Wednesday 09:00): bob.
    assert resolve_targets(tier1, schedules, T) == ["bob"]
    assert resolve_targets(tier1, schedules, minutes(60)) == ["lead"]  # the override
    assert resolve_targets(tier2, schedules, T) == ["lead"]  # senior has nobody yet
    assert resolve_targets(tier2, schedules, minutes(24 * 60)) == ["sam", "lead"]
    assert resolve_targets(tier3, {}, T) == ["manager"]
    both = Tier(level=1, targets=(Target(schedule="primary"), Target(user="lead")), delay_min=5)
    assert resolve_targets(both, schedules, minutes(60)) == ["lead"]  # each user once
    with pytest.raises(ValueError, match="tier 1: unknown schedule 'primary'"):
        resolve_targets(tier1, {}, T)


def _policy_doc(**fields: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "name": "p",
        "tiers": [
            {"level": 1, "targets": [{"user": "a"}], "delay_min": 5},
            {"level": 2, "targets": [{"schedule": "s"}], "delay_min": 5},
        ],
    }
    doc.update(fields)
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        pytest.param(_policy_doc(loops=10), "loops: Input should be less than or equal to 9", id="loops"),
        pytest.param(_policy_doc(ack_timeout_min=0), "ack_timeout_min: Input should be greater", id="ack"),
        pytest.param(_policy_doc(tiers=[]), "tiers: Tuple should have at least 1 item", id="no-tiers"),
        pytest.param(
            _policy_doc(tiers=[{"level": 2, "targets": [{"user": "a"}], "delay_min": 5}]),
            "tiers[0].level: expected 1 (levels are 1..n in order), got 2",
            id="level",
        ),
        pytest.param(
            _policy_doc(tiers=[{"level": 1, "targets": [{"user": "a", "schedule": "s"}], "delay_min": 5}]),
            "tiers[0].targets[0]: give exactly one of user or schedule",
            id="target",
        ),
        pytest.param(
            _policy_doc(tiers=[{"level": 1, "targets": [{"user": "a"}], "delay_min": 0}]),
            "tiers[0].delay_min: Input should be greater than or equal to 1",
            id="delay",
        ),
        pytest.param(
            _policy_doc(tiers=[{"level": 1, "targets": ["alice"], "delay_min": 5}]),
            "tiers[0].targets[0]: Input should be a valid dictionary",
            id="bare-name",
        ),
    ],
)
def test_policy_parse_errors_name_the_field(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_policy(doc)
    assert str(info.value).startswith(message), str(info.value)


def test_load_policy_from_yaml() -> None:
    p = load_policy(
        "name: p\nloops: 1\nack_timeout_min: 30\ntiers:\n- {level: 1, targets: [{user: a}], delay_min: 5}\n"
    )
    assert timeline(escalation_plan(p, T)) == [(0, 1, 0), (5, 1, 1)]
