"""Escalation policies: who is paged when, until someone acknowledges (PagerDuty's model).

Semantics (PagerDuty's "Escalation Policy Basics" and "Acknowledgement timeout" docs; the tiers
are AI-System 7.6.5's: the DRI on call first, then senior or platform developers, then a manager
or the vendor):

* An incident triggered at ``T`` pages tier 1 at ``T``. If nobody acknowledges within tier 1's
  ``delay_min`` minutes, tier 2 is paged, and so on. After the last tier's delay the whole policy
  repeats, ``loops`` times (PagerDuty's "repeat this policy N times", at most 9), each repetition
  starting at tier 1; after the last repetition's last tier nothing more is paged.
* An acknowledgement stops escalation. If ``ack_timeout_min`` is set and the incident is not
  resolved within that many minutes of the (latest) acknowledgement, it re-triggers and
  escalation restarts at tier 1 of the first loop, at ``ack + ack_timeout_min``. (PagerDuty
  re-triggers the incident; Apiary's choice is to restart from tier 1.)
* Resolution is the caller's: a resolved incident is not asked about.

Every function here is pure and deterministic in its arguments (the stored facts: the policy,
``triggered_at``, the latest acknowledgement, and the instant asked about), so a durable
escalation worker that stores those facts recomputes the same deadlines after a restart. Instants
are aware datetimes (naive ones raise ValueError); returned instants are UTC.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import Field, model_validator

from apiary.oncall.common import FieldError, OncallModel, parse_model, parse_yaml, utc
from apiary.oncall.schedule import Schedule, on_call

__all__ = [
    "MAX_LOOPS",
    "Page",
    "Policy",
    "Target",
    "Tier",
    "escalation_plan",
    "load_policy",
    "next_page",
    "parse_policy",
    "resolve_targets",
]

#: PagerDuty's limit on "repeat this policy N times".
MAX_LOOPS = 9


class Target(OncallModel):
    """Whom a tier pages: exactly one of ``user`` (a user name) or ``schedule`` (a schedule name,
    meaning whoever is on call in it when the page goes out). YAML: ``{schedule: ml-primary}`` or
    ``{user: carol}``."""

    user: str | None = Field(default=None, min_length=1)
    schedule: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Target:
        if (self.user is None) == (self.schedule is None):
            raise ValueError("give exactly one of user or schedule")
        return self


class Tier(OncallModel):
    """One escalation level. ``level``: 1..n, in order. ``targets``: at least one. ``delay_min``:
    minutes (whole, at least 1, as in PagerDuty) to wait for an acknowledgement before paging the
    next tier (or, after the last tier, before the next loop). ``delay_s``: the same in seconds
    (at least 1), for drills and tests that cannot wait minutes; give exactly one of the two."""

    level: int = Field(ge=1)
    targets: tuple[Target, ...] = Field(min_length=1)
    delay_min: int | None = Field(default=None, ge=1, le=7 * 24 * 60)
    delay_s: int | None = Field(default=None, ge=1, le=7 * 24 * 3600)

    @model_validator(mode="after")
    def _one_delay(self) -> Tier:
        if (self.delay_min is None) == (self.delay_s is None):
            raise FieldError("delay_min", "give exactly one of delay_min or delay_s")
        return self

    @property
    def delay(self) -> timedelta:
        """The wait before the next tier."""
        return timedelta(minutes=self.delay_min) if self.delay_min is not None else timedelta(seconds=self.delay_s or 0)


class Policy(OncallModel):
    """A named escalation policy. ``tiers``: levels 1..n in order. ``loops``: how many times the
    whole policy repeats after the last tier (0..9). ``ack_timeout_min``: minutes after which an
    acknowledgement without a resolve re-triggers (None: never)."""

    name: str = Field(min_length=1)
    tiers: tuple[Tier, ...] = Field(min_length=1)
    loops: int = Field(default=0, ge=0, le=MAX_LOOPS)
    ack_timeout_min: int | None = Field(default=None, ge=1)
    ack_timeout_s: int | None = Field(default=None, ge=1)

    @property
    def ack_timeout(self) -> timedelta | None:
        """``ack_timeout_min`` (or ``ack_timeout_s``, for drills and tests) as a duration; None: never."""
        if self.ack_timeout_min is not None:
            return timedelta(minutes=self.ack_timeout_min)
        return None if self.ack_timeout_s is None else timedelta(seconds=self.ack_timeout_s)

    @model_validator(mode="after")
    def _check(self) -> Policy:
        if self.ack_timeout_min is not None and self.ack_timeout_s is not None:
            raise FieldError("ack_timeout_min", "give at most one of ack_timeout_min or ack_timeout_s")
        for i, tier in enumerate(self.tiers):
            if tier.level != i + 1:
                raise FieldError(
                    ("tiers", i, "level"), f"expected {i + 1} (levels are 1..n in order), got {tier.level}"
                )
        return self


@dataclass(frozen=True)
class Page:
    """A page due ``at`` (UTC) to tier ``tier`` (its level) with that tier's ``targets``
    (unresolved: see :func:`resolve_targets`), in repetition ``loop`` (0 is the first pass)."""

    at: datetime
    tier: int
    targets: tuple[Target, ...]
    loop: int


def escalation_plan(policy: Policy, triggered_at: datetime) -> list[Page]:
    """Every page of ``policy`` for an incident triggered at ``triggered_at`` (aware) that nobody
    acknowledges: ``(loops + 1) * len(tiers)`` pages in time order, the first at ``triggered_at``.
    Raises ValueError if ``triggered_at`` is naive."""
    at = utc(triggered_at, "triggered_at")
    pages = []
    for loop in range(policy.loops + 1):
        for tier in policy.tiers:
            pages.append(Page(at=at, tier=tier.level, targets=tier.targets, loop=loop))
            at += tier.delay
    return pages


def next_page(policy: Policy, triggered_at: datetime, acknowledged_at: datetime | None, now: datetime) -> Page | None:
    """The first page due at or after ``now`` (aware), or None if no more pages are due.

    ``acknowledged_at``: the latest acknowledgement at or before ``now`` (None: none yet; earlier
    acknowledgements change no page after it). Without an acknowledgement this is the first page
    of :func:`escalation_plan` at or after ``now``. After one: None if the policy has no
    ``ack_timeout_min``, otherwise the first page at or after ``now`` of the plan restarted at
    ``acknowledged_at + ack_timeout_min`` (tier 1, loop 0).

    Inclusive on purpose: at ``now == triggered_at`` the answer is tier 1. A worker that has just
    sent the page due at ``p.at`` asks again with a later ``now``; one that restarts asks with the
    instant just after the last page it recorded as sent (not the wall clock), so pages that fell
    due while it was down are sent late rather than never.

    Raises ValueError for a naive datetime, ``acknowledged_at`` before ``triggered_at`` or after
    ``now``.
    """
    trig, t = utc(triggered_at, "triggered_at"), utc(now, "now")
    start = trig
    if acknowledged_at is not None:
        ack = utc(acknowledged_at, "acknowledged_at")
        if ack < trig:
            raise ValueError(f"acknowledged_at {ack.isoformat()} is before triggered_at {trig.isoformat()}")
        if ack > t:
            raise ValueError(f"acknowledged_at {ack.isoformat()} is after now {t.isoformat()}")
        timeout = policy.ack_timeout
        if timeout is None:
            return None
        start = ack + timeout
    return next((p for p in escalation_plan(policy, start) if p.at >= t), None)


def resolve_targets(tier: Tier, schedules: Mapping[str, Schedule], at: datetime) -> list[str]:
    """The user names ``tier`` pages at ``at`` (aware): user targets as they are, schedule targets
    as whoever :func:`~apiary.oncall.schedule.on_call` gives at ``at`` (a schedule with nobody on
    call adds nobody). In target order, each user once. Raises ValueError for a schedule not in
    ``schedules`` or a naive ``at``."""
    out: list[str] = []
    for target in tier.targets:
        if target.user is not None:
            user: str | None = target.user
        else:
            assert target.schedule is not None  # Target._check: exactly one is set
            if target.schedule not in schedules:
                raise ValueError(f"tier {tier.level}: unknown schedule {target.schedule!r}")
            user = on_call(schedules[target.schedule], at)
        if user is not None and user not in out:
            out.append(user)
    return out


def parse_policy(data: Any, field: str = "") -> Policy:
    """A :class:`Policy` from plain data. Raises :class:`apiary.errors.ValidationError` naming
    the field (``tiers[1].delay_min: Input should be greater than or equal to 1``)."""
    return parse_model(Policy, data, field)


def load_policy(text: str | bytes) -> Policy:
    """A :class:`Policy` from YAML text. Raises :class:`apiary.errors.ValidationError`."""
    return parse_policy(parse_yaml(text, field="policy", what="escalation policy"))
