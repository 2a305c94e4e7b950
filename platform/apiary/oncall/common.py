"""Pieces shared by the on-call models: parsing helpers and local wall-clock arithmetic.

Two rules hold everywhere in :mod:`apiary.oncall`:

* **Instants are UTC.** Every datetime a function returns is aware and in UTC, and every datetime
  it takes must be aware (``ValueError`` otherwise) and is converted to UTC first. Python compares
  and subtracts two datetimes that share a ``tzinfo`` by wall clock, ignoring ``fold``, which is
  wrong across a fall-back change; in UTC that cannot happen.
* **Local times are naive wall-clock readings** in a named IANA zone (``zoneinfo``; reading the
  zone database is the only file access here, like ``importlib.resources`` elsewhere in the pure
  core). :func:`to_instant` turns a reading into an instant with one rule for the two
  daylight-saving oddities: a reading the clock skips (spring forward, 02:30 in Europe/Berlin on
  the last Sunday of March) happens when the clock jumps over it, i.e. at the end of the gap; a
  reading the clock shows twice (fall back) happens the first time. "The handoff is when the local
  clock first shows at least 02:30."
"""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from enum import IntEnum
from typing import Annotated, Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict
from pydantic import ValidationError as PydanticValidationError

from apiary.errors import ValidationError
from apiary.spec import safeyaml
from apiary.spec.cluster import loc_path

__all__ = [
    "FieldError",
    "LocalTime",
    "OncallModel",
    "TimeZoneName",
    "Weekday",
    "WeekdayName",
    "local_reading",
    "parse_model",
    "parse_yaml",
    "to_instant",
    "utc",
]


class OncallModel(BaseModel):
    """Base of every on-call model: immutable, unknown fields refused (dstack's ``CoreModel``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class FieldError(ValueError):
    """A check of a whole model that blames one of its fields.

    Raised inside a model validator; :func:`parse_model` appends ``field`` to the model's path, so
    the message reads ``layers[0].turn_length_h: ...`` rather than ``layers[0]: ...``.
    """

    def __init__(self, field: str | tuple[int | str, ...], reason: str) -> None:
        self.loc: tuple[int | str, ...] = (field,) if isinstance(field, str) else field
        self.reason = reason
        super().__init__(f"{loc_path(self.loc)}: {reason}")


class Weekday(IntEnum):
    """A day of the week, numbered like :meth:`datetime.date.weekday` (Monday 0). In YAML a name:
    ``mon`` or ``monday``, any case. Plain integers are refused (0-6 or ISO 1-7 is a guess)."""

    MON = 0
    TUE = 1
    WED = 2
    THU = 3
    FRI = 4
    SAT = 5
    SUN = 6

    @classmethod
    def parse(cls, value: Any) -> Weekday:
        if isinstance(value, Weekday):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for day in cls:
                full = _FULL_NAMES[day]
                if key in (day.name.lower(), full):
                    return day
        raise ValueError(f"expected a weekday name (mon..sun or monday..sunday), got {value!r}")


_FULL_NAMES = {
    Weekday.MON: "monday",
    Weekday.TUE: "tuesday",
    Weekday.WED: "wednesday",
    Weekday.THU: "thursday",
    Weekday.FRI: "friday",
    Weekday.SAT: "saturday",
    Weekday.SUN: "sunday",
}


def _hhmm(value: Any) -> time:
    if isinstance(value, time):
        if value.tzinfo is not None:
            raise ValueError("a local time of day has no time zone (the zone is the model's time_zone)")
        return value
    if isinstance(value, bool):
        raise ValueError(f'expected a local time "HH:MM", got {value!r}')
    if isinstance(value, int):
        hours, minutes = divmod(value, 60)
        raise ValueError(
            f'expected a local time "HH:MM" as a string, got the number {value} (YAML 1.1 reads an '
            f"unquoted {hours}:{minutes:02d} as a base-60 number: quote it)"
        )
    if isinstance(value, str):
        parts = value.strip().split(":")
        if len(parts) == 2 and all(p.isdigit() and len(p) == 2 for p in parts):
            h, m = int(parts[0]), int(parts[1])
            if h < 24 and m < 60:
                return time(h, m)
    raise ValueError(f'expected a local time "HH:MM" (00:00 to 23:59), got {value!r}')


def _zone(name: str) -> str:
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r}") from None
    return name


#: A local time of day, ``"HH:MM"`` in YAML (a :class:`datetime.time` without tzinfo in Python).
LocalTime = Annotated[time, BeforeValidator(_hhmm)]
#: An IANA time zone name (``Europe/Berlin``); ``unknown time zone 'Mars/Base'`` otherwise.
TimeZoneName = Annotated[str, AfterValidator(_zone)]
#: A weekday name, see :class:`Weekday`.
WeekdayName = Annotated[Weekday, BeforeValidator(Weekday.parse)]


def utc(value: datetime, name: str) -> datetime:
    """``value`` as a UTC datetime. Raises ValueError naming ``name`` if it is naive."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be a timezone-aware datetime, got naive {value.isoformat()}")
    return value.astimezone(UTC)


def local_reading(instant: datetime, tz: ZoneInfo) -> datetime:
    """What a wall clock in ``tz`` shows at ``instant`` (aware), as a naive datetime."""
    return instant.astimezone(tz).replace(tzinfo=None)


def to_instant(reading: datetime, tz: ZoneInfo) -> datetime:
    """The UTC instant when a wall clock in ``tz`` first shows at least ``reading`` (naive).

    An ambiguous reading (fall back) is its first occurrence; a skipped one (spring forward) is
    the instant of the jump. Monotonic: a later reading never gives an earlier instant.
    """
    first = reading.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if local_reading(first, tz) == reading:
        return first
    # In a gap. fold=1 applies the offset after the jump, fold=0 the one before, so the jump lies
    # in (low, high]: find it by bisection on whole seconds (zone transitions are on seconds).
    low = reading.replace(tzinfo=tz, fold=1).astimezone(UTC)
    high = first
    after = high.astimezone(tz).utcoffset()
    lo_s, hi_s = 0, int((high - low).total_seconds())
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if (low + timedelta(seconds=mid)).astimezone(tz).utcoffset() == after:
            hi_s = mid
        else:
            lo_s = mid
    return low + timedelta(seconds=hi_s)


M = TypeVar("M", bound=BaseModel)


def parse_model(model: type[M], data: Any, field: str = "") -> M:
    """Validate ``data`` (plain dicts and lists, as YAML gives them) as ``model``.

    Raises :class:`apiary.errors.ValidationError` for the first problem, its ``field`` the dotted
    path below ``field`` (``layers[0].time_zone``) and its reason pydantic's message or ours
    (``unknown time zone 'Mars/Base'``).
    """
    try:
        return model.model_validate(data)
    except PydanticValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        reason = err["msg"]
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, FieldError):
            loc, reason = (*loc, *cause.loc), cause.reason
        elif isinstance(cause, ValueError):
            reason = str(cause)
        prefix = (field,) if field else ()
        raise ValidationError(loc_path((*prefix, *loc)), reason) from None


def parse_yaml(text: str | bytes, field: str, what: str) -> Any:
    """One YAML document through :func:`apiary.spec.safeyaml.load` (bounded, duplicate keys
    refused). Raises :class:`apiary.errors.ValidationError` with ``field``."""
    return safeyaml.load(text, field=field, what=what)
