"""On-call schedules: rotation layers, restrictions and overrides, as PagerDuty has them.

Semantics (PagerDuty's "Schedule Basics", "Schedule Layers" and "Schedule Overrides" docs, with
the choices PagerDuty leaves open written down here):

* A :class:`Layer` rotates through its ``users`` in order: ``users[0]`` is on call from the
  layer's ``start`` until the first handoff strictly after it (a partial first turn when ``start``
  is not itself a handoff), then ``users[1]`` for a full turn, and so on, wrapping around. It has
  nobody before ``start`` and from ``end`` on.
* Handoffs are **local wall-clock** times in the layer's ``time_zone``: a daily rotation with a
  09:00 handoff hands off at 09:00 local every day, so the turn that spans a daylight-saving
  change is 23 h or 25 h long. Weekly: every week on ``handoff_day`` at ``handoff``. Custom:
  every ``turn_length_h`` hours of wall-clock time from ``start`` (12 h turns starting 09:00 stay
  09:00 / 21:00 all year). A handoff at a time the clock skips (02:30 at spring forward) happens
  when the clock jumps; at a time it shows twice, the first time (:func:`apiary.oncall.common.to_instant`).
* ``restrictions`` limit *when* a layer is on call (PagerDuty's "restrict on-call shifts", e.g.
  weekdays 09:00-18:00): outside every window the layer has nobody. The rotation keeps turning
  behind the restriction; it is masked, not paused.
* Layers later in ``Schedule.layers`` take precedence wherever they have someone (PagerDuty: a
  higher layer overrides the layers below it); where they have nobody, the next one down shows.
* An :class:`Override` replaces whoever the layers give for its window, and overrides take
  precedence over all layers. Where overrides overlap, the one later in ``Schedule.overrides``
  wins (PagerDuty: the most recently created override), so a short override nested inside a long
  one takes its window from it only if it is listed after it.

Everything is a function of the schedule and the instants passed in: no clock is read. Instants
returned are UTC; naive datetimes are refused with ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any
from zoneinfo import ZoneInfo

from pydantic import AwareDatetime, Field, model_validator

from apiary.oncall.common import (
    FieldError,
    LocalTime,
    OncallModel,
    TimeZoneName,
    Weekday,
    WeekdayName,
    local_reading,
    parse_model,
    parse_yaml,
    to_instant,
    utc,
)

__all__ = [
    "ALL_DAYS",
    "Layer",
    "Override",
    "Restriction",
    "Rotation",
    "Schedule",
    "Shift",
    "load_schedule",
    "on_call",
    "parse_schedule",
    "shifts",
]

#: Every day of the week: a restriction's default ``days``.
ALL_DAYS: tuple[Weekday, ...] = tuple(Weekday)

UserName = Annotated[str, Field(min_length=1)]


class Rotation(StrEnum):
    """How long a layer's turn is. ``custom`` needs ``turn_length_h``."""

    DAILY = "daily"
    WEEKLY = "weekly"
    CUSTOM = "custom"


class Restriction(OncallModel):
    """A recurring window in which a layer is on call (PagerDuty's restrictions).

    On each of ``days`` (default: every day), from ``start`` to ``end`` local time in the layer's
    time zone. ``end`` before ``start`` is an overnight window that ends the next day
    (``start: "18:00"``, ``end: "09:00"``); ``end`` equal to ``start`` is refused.
    """

    days: tuple[WeekdayName, ...] = Field(default=ALL_DAYS, min_length=1)
    start: LocalTime
    end: LocalTime

    @model_validator(mode="after")
    def _check(self) -> Restriction:
        if self.end == self.start:
            raise FieldError("end", "equals start (an always-on layer needs no restriction)")
        if len(set(self.days)) != len(self.days):
            raise FieldError("days", "a day is listed twice")
        return self

    def windows(self, tz: ZoneInfo, first: date, last: date) -> list[tuple[datetime, datetime]]:
        """The windows (UTC ``[start, end)``) that begin on local dates ``first`` to ``last``."""
        out = []
        day = first
        while day <= last:
            if day.weekday() in self.days:
                s = to_instant(datetime.combine(day, self.start), tz)
                end_day = day if self.end > self.start else day + timedelta(days=1)
                e = to_instant(datetime.combine(end_day, self.end), tz)
                if e > s:
                    out.append((s, e))
            day += timedelta(days=1)
        return out


class Layer(OncallModel):
    """One rotation layer of a schedule.

    ``users``: the rotation order (a name may appear more than once). ``rotation``: ``daily``,
    ``weekly`` or ``custom`` (then ``turn_length_h``, hours of wall-clock time, at least 1, as in
    PagerDuty). ``handoff``: the local time of day of handoffs, ``"HH:MM"``, and ``handoff_day``
    its weekday for a weekly rotation; both default to ``start``'s local time and weekday (PagerDuty's
    API derives them from ``rotation_virtual_start`` the same way) and are refused for ``custom``,
    whose turns start at ``start``. ``start`` / ``end``: aware datetimes, when the layer begins and
    stops (``end`` optional). ``time_zone``: IANA name; handoffs and restrictions are local to it.
    """

    name: str = Field(min_length=1)
    users: tuple[UserName, ...] = Field(min_length=1)
    rotation: Rotation
    turn_length_h: float | None = None
    handoff: LocalTime | None = None
    handoff_day: WeekdayName | None = None
    start: AwareDatetime
    end: AwareDatetime | None = None
    time_zone: TimeZoneName
    restrictions: tuple[Restriction, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Layer:
        if self.rotation is Rotation.CUSTOM:
            if self.turn_length_h is None:
                raise FieldError("turn_length_h", "required for a custom rotation")
            if not 1 <= self.turn_length_h <= 24 * 7 * 52:
                raise FieldError("turn_length_h", f"must be between 1 and 8736 hours, got {self.turn_length_h}")
            if self.handoff is not None or self.handoff_day is not None:
                raise FieldError("handoff", "not used by a custom rotation: turns start at start")
        else:
            if self.turn_length_h is not None:
                raise FieldError("turn_length_h", f"only for a custom rotation, not {self.rotation.value}")
            if self.rotation is Rotation.DAILY and self.handoff_day is not None:
                raise FieldError("handoff_day", "only for a weekly rotation")
        if self.end is not None and self.end <= self.start:
            raise FieldError("end", "must be after start")
        return self

    # --- derived once (the model is frozen) -------------------------------------------------

    @cached_property
    def tz(self) -> ZoneInfo:
        """The layer's time zone."""
        return ZoneInfo(self.time_zone)

    @cached_property
    def period(self) -> timedelta:
        """A full turn in wall-clock time: 1 day, 7 days or ``turn_length_h`` hours."""
        if self.rotation is Rotation.DAILY:
            return timedelta(days=1)
        if self.rotation is Rotation.WEEKLY:
            return timedelta(days=7)
        assert self.turn_length_h is not None  # checked by _check
        return timedelta(hours=self.turn_length_h)

    @cached_property
    def _start_utc(self) -> datetime:
        return utc(self.start, "start")

    @cached_property
    def _end_utc(self) -> datetime | None:
        return None if self.end is None else utc(self.end, "end")

    @cached_property
    def _anchor(self) -> datetime:
        """The local reading of the first handoff strictly after ``start``."""
        start_local = local_reading(self._start_utc, self.tz)
        if self.rotation is Rotation.CUSTOM:
            reading = start_local + self.period
        else:
            at = self.handoff if self.handoff is not None else start_local.time()
            day = start_local.date()
            if self.rotation is Rotation.WEEKLY:
                weekday = self.handoff_day if self.handoff_day is not None else day.weekday()
                day -= timedelta(days=(day.weekday() - weekday) % 7)
            reading = datetime.combine(day, at) - self.period
        while to_instant(reading, self.tz) <= self._start_utc:
            reading += self.period
        return reading

    def _boundary(self, k: int) -> datetime:
        """When turn ``k`` begins (UTC): ``start`` for turn 0, then the handoffs."""
        if k == 0:
            return self._start_utc
        return to_instant(self._anchor + (k - 1) * self.period, self.tz)

    def _turn(self, at: datetime) -> int:
        """The turn that ``at`` (UTC, not before start) falls in."""
        if at < self._boundary(1):
            return 0
        k = max(1, (local_reading(at, self.tz) - self._anchor) // self.period + 1)
        while k > 1 and self._boundary(k) > at:
            k -= 1
        while self._boundary(k + 1) <= at:
            k += 1
        return k

    def _active(self, at: datetime) -> bool:
        if at < self._start_utc or (self._end_utc is not None and at >= self._end_utc):
            return False
        if not self.restrictions:
            return True
        day = local_reading(at, self.tz).date()
        return any(s <= at < e for r in self.restrictions for s, e in r.windows(self.tz, day - timedelta(days=1), day))

    # --- public -----------------------------------------------------------------------------

    def user_at(self, at: datetime) -> str | None:
        """Who this layer has on call at ``at`` (aware), or None (before start, after end, or
        outside its restrictions). Raises ValueError on a naive datetime."""
        t = utc(at, "at")
        if not self._active(t):
            return None
        return self.users[self._turn(t) % len(self.users)]

    def changes(self, start: datetime, end: datetime) -> list[datetime]:
        """Every instant in ``(start, end)`` (UTC, both aware) at which :meth:`user_at` may change:
        handoffs, the layer's start and end, restriction window edges. Sorted, no duplicates."""
        s, e = utc(start, "start"), utc(end, "end")
        out: set[datetime] = {self._start_utc}
        if self._end_utc is not None:
            out.add(self._end_utc)
        if e > self._start_utc:
            k = self._turn(max(s, self._start_utc)) + 1
            while (b := self._boundary(k)) < e:
                out.add(b)
                k += 1
        if self.restrictions:
            first = local_reading(s, self.tz).date() - timedelta(days=1)
            last = local_reading(e, self.tz).date() + timedelta(days=1)
            for r in self.restrictions:
                for ws, we in r.windows(self.tz, first, last):
                    out.update((ws, we))
        return sorted(t for t in out if s < t < e)


class Override(OncallModel):
    """``user`` is on call from ``start`` to ``end`` (aware; ``[start, end)``), whatever the layers say."""

    user: UserName
    start: AwareDatetime
    end: AwareDatetime

    @model_validator(mode="after")
    def _check(self) -> Override:
        if self.end <= self.start:
            raise FieldError("end", "must be after start")
        return self

    def covers(self, at: datetime) -> bool:
        """Whether ``at`` (aware) is in ``[start, end)``. Raises ValueError if it is naive."""
        return utc(self.start, "start") <= utc(at, "at") < utc(self.end, "end")


class Schedule(OncallModel):
    """A named schedule: ``layers`` (at least one; later ones take precedence where they have
    someone) and ``overrides`` (precedence over all layers; later ones over earlier ones).
    Layer names are unique: a :class:`Shift`'s ``source`` names them."""

    name: str = Field(min_length=1)
    layers: tuple[Layer, ...] = Field(min_length=1)
    overrides: tuple[Override, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Schedule:
        seen: set[str] = set()
        for i, layer in enumerate(self.layers):
            if layer.name in seen:
                raise FieldError(("layers", i, "name"), f"duplicate layer name {layer.name!r}")
            seen.add(layer.name)
        return self

    def who(self, at: datetime) -> tuple[str, str] | None:
        """``(user, source)`` on call at ``at`` (aware), source ``"override"`` or the layer's
        name; None when nobody is. Raises ValueError on a naive datetime."""
        t = utc(at, "at")
        for override in reversed(self.overrides):
            if override.covers(t):
                return override.user, "override"
        for layer in reversed(self.layers):
            user = layer.user_at(t)
            if user is not None:
                return user, layer.name
        return None


@dataclass(frozen=True)
class Shift:
    """One block of the rendered schedule: ``user`` is on call in ``[start, end)`` (UTC).

    ``source`` says where it comes from: ``"override"`` or a layer's name; a block merged from
    adjacent pieces with different sources joins them with ``+`` in order (``"primary+override"``).
    """

    user: str
    start: datetime
    end: datetime
    source: str


def on_call(schedule: Schedule, at: datetime) -> str | None:
    """Who is on call in ``schedule`` at ``at``: an aware datetime in any zone (it need not be
    the layers' zone). At a handoff instant the incoming user is on call (turns are ``[start,
    end)``). Returns None when no override and no layer has anyone. Raises ValueError if ``at``
    is naive."""
    found = schedule.who(at)
    return None if found is None else found[0]


def shifts(schedule: Schedule, start: datetime, end: datetime) -> list[Shift]:
    """The final rendered timeline of ``schedule`` over ``[start, end)`` (aware datetimes).

    Returns the shifts in time order, clipped to the window, in UTC, with adjacent shifts of the
    same user merged; times when nobody is on call are absent. For every instant ``t`` in the
    window, ``on_call(schedule, t)`` is the user of the shift covering ``t`` (None if none does).
    Raises ValueError if ``start`` or ``end`` is naive or ``end`` is before ``start``.
    """
    s, e = utc(start, "start"), utc(end, "end")
    if e < s:
        raise ValueError(f"end {end.isoformat()} is before start {start.isoformat()}")
    cuts: set[datetime] = {s, e}
    for layer in schedule.layers:
        cuts.update(layer.changes(s, e))
    for override in schedule.overrides:
        cuts.update(t for t in (utc(override.start, "start"), utc(override.end, "end")) if s < t < e)
    points = sorted(cuts)
    out: list[Shift] = []
    for a, b in zip(points, points[1:], strict=False):
        found = schedule.who(a)
        if found is None:
            continue
        user, source = found
        last = out[-1] if out else None
        if last is not None and last.user == user and last.end == a:
            sources = last.source.split("+")
            merged = last.source if source in sources else f"{last.source}+{source}"
            out[-1] = Shift(user, last.start, b, merged)
        else:
            out.append(Shift(user, a, b, source))
    return out


def parse_schedule(data: Any, field: str = "") -> Schedule:
    """A :class:`Schedule` from plain data (a dict, as YAML gives it).

    Raises :class:`apiary.errors.ValidationError` naming the field below ``field``:
    ``layers[0].time_zone: unknown time zone 'Mars/Base'``.
    """
    return parse_model(Schedule, data, field)


def load_schedule(text: str | bytes) -> Schedule:
    """A :class:`Schedule` from YAML text. Raises :class:`apiary.errors.ValidationError`."""
    return parse_schedule(parse_yaml(text, field="schedule", what="schedule"))
