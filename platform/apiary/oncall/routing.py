"""Notification channels by severity and hour (AI-System 7.6.2).

AI-System 7.6.2 has alerts reach people over phone, SMS, IM and email, each channel for its own
severities and hours: a page that must wake someone up rings the phone, one that can wait for the
morning is an email. :func:`route` answers "which channels, in which order" for one alert.

* :class:`Severity`: ``Sev1`` (most severe: the platform or a whole VC is down) to ``Sev4``
  (informational). In YAML any case (``sev1``, ``SEV1``).
* :class:`Rule`: ``severities``, ``when`` (``in_hours``, ``out_of_hours`` or ``always``) and
  ``channels``, an ordered list among ``phone``, ``sms``, ``im``, ``email``: the order is the
  fallback order (try the phone; if that fails or is not answered, SMS; ...). The first rule that
  matches wins.
* :class:`WorkingHours`: weekdays and a local start/end time in a time zone. Public holidays are
  not modelled (a holiday counts as a working day).

:data:`DEFAULT_RULES`, the documented default table:

======== ============== ====================== ==========================================
severity when           channels               why
======== ============== ====================== ==========================================
Sev1     always         phone, sms, im         wake someone now, day or night
Sev2     out_of_hours   phone, im              urgent enough to wake the on-call
Sev2     in_hours       im, email              people are at their desks
Sev3     in_hours       email
Sev3     out_of_hours   email                  read the next working morning: that is fine
Sev4     always         email                  sent as a digest (the sender batches them)
======== ============== ====================== ==========================================
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo

from pydantic import BeforeValidator, Field, model_validator

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
    utc,
)

__all__ = [
    "DEFAULT_ROUTING",
    "DEFAULT_RULES",
    "DEFAULT_WORKING_HOURS",
    "Channel",
    "Routing",
    "Rule",
    "Severity",
    "When",
    "WorkingHours",
    "load_routing",
    "parse_routing",
    "route",
]


class Severity(StrEnum):
    """Incident severity, ``Sev1`` the most severe."""

    SEV1 = "Sev1"
    SEV2 = "Sev2"
    SEV3 = "Sev3"
    SEV4 = "Sev4"

    @classmethod
    def parse(cls, value: Any) -> Any:
        """``sev1`` / ``SEV1`` / ``Sev1`` -> :attr:`SEV1`; anything else is left to pydantic's error."""
        if isinstance(value, str):
            for sev in cls:
                if value.strip().lower() == sev.value.lower():
                    return sev
        return value


class Channel(StrEnum):
    """A notification channel (AI-System 7.6.2)."""

    PHONE = "phone"
    SMS = "sms"
    IM = "im"
    EMAIL = "email"


class When(StrEnum):
    """When a rule applies, against :class:`WorkingHours`."""

    IN_HOURS = "in_hours"
    OUT_OF_HOURS = "out_of_hours"
    ALWAYS = "always"

    def matches(self, in_hours: bool) -> bool:
        return self is When.ALWAYS or (self is When.IN_HOURS) == in_hours


SeverityName = Annotated[Severity, BeforeValidator(Severity.parse)]


class Rule(OncallModel):
    """Alerts of ``severities`` at times matching ``when`` go to ``channels``, in that order.
    Both lists are non-empty without repeats. ``notify``: ``first`` (default) delivers on the
    first channel that works, the rest being fallbacks; ``all`` delivers on every channel (a page
    by email and IM at once), each failed one falling back to the channels after it."""

    severities: tuple[SeverityName, ...] = Field(min_length=1)
    when: When = When.ALWAYS
    channels: tuple[Channel, ...] = Field(min_length=1)
    notify: Literal["first", "all"] = "first"

    @model_validator(mode="after")
    def _check(self) -> Rule:
        for name in ("severities", "channels"):
            items: tuple[Any, ...] = getattr(self, name)
            if len(set(items)) != len(items):
                raise FieldError(name, "an item is listed twice")
        return self

    def matches(self, severity: Severity, in_hours: bool) -> bool:
        return severity in self.severities and self.when.matches(in_hours)


class WorkingHours(OncallModel):
    """Working hours: on ``weekdays`` (default Monday to Friday), from ``start`` to ``end``
    (``"HH:MM"``, ``start`` before ``end``; ``[start, end)``) local time in ``time_zone``."""

    time_zone: TimeZoneName
    weekdays: tuple[WeekdayName, ...] = Field(default=tuple(Weekday)[:5], min_length=1)
    start: LocalTime
    end: LocalTime

    @model_validator(mode="after")
    def _check(self) -> WorkingHours:
        if self.end <= self.start:
            raise FieldError("end", "must be after start (working hours do not cross midnight)")
        return self

    def contains(self, at: datetime) -> bool:
        """Whether ``at`` (aware, any zone) is in working hours. Raises ValueError if naive."""
        local = local_reading(utc(at, "at"), ZoneInfo(self.time_zone))
        return local.weekday() in self.weekdays and self.start <= local.time() < self.end


class Routing(OncallModel):
    """A routing table: ``working_hours`` and ``rules``. The rules must give every severity a
    channel both in and out of hours, so :func:`route` always has an answer."""

    working_hours: WorkingHours
    rules: tuple[Rule, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Routing:
        for sev in Severity:
            for in_hours, label in ((True, "in_hours"), (False, "out_of_hours")):
                if not any(r.matches(sev, in_hours) for r in self.rules):
                    raise FieldError("rules", f"no rule for {sev.value} {label}")
        return self

    def route(self, severity: Severity, at: datetime) -> list[str]:
        """:func:`route` with this table."""
        return route(self.rules, self.working_hours, severity, at)


def match_rule(rules: Sequence[Rule], working_hours: WorkingHours, severity: Severity, at: datetime) -> Rule:
    """The first rule for ``severity`` at ``at`` (aware). Raises ValueError as :func:`route` does."""
    in_hours = working_hours.contains(at)
    for rule in rules:
        if rule.matches(severity, in_hours):
            return rule
    label = "in hours" if in_hours else "out of hours"
    raise ValueError(f"no routing rule for {severity.value} {label}")


def route(rules: Sequence[Rule], working_hours: WorkingHours, severity: Severity, at: datetime) -> list[str]:
    """The channels (``"phone"``, ``"sms"``, ``"im"``, ``"email"``, in fallback order) for an alert
    of ``severity`` at ``at`` (aware): those of the first rule that matches. Raises ValueError if
    ``at`` is naive or no rule matches (a table that went through :class:`Routing` has a rule for
    every case)."""
    in_hours = working_hours.contains(at)
    for rule in rules:
        if rule.matches(severity, in_hours):
            return [c.value for c in rule.channels]
    label = "in hours" if in_hours else "out of hours"
    raise ValueError(f"no routing rule for {severity.value} {label}")


#: The default table (see the module docstring).
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(severities=(Severity.SEV1,), when=When.ALWAYS, channels=(Channel.PHONE, Channel.SMS, Channel.IM)),
    Rule(severities=(Severity.SEV2,), when=When.OUT_OF_HOURS, channels=(Channel.PHONE, Channel.IM)),
    Rule(severities=(Severity.SEV2,), when=When.IN_HOURS, channels=(Channel.IM, Channel.EMAIL)),
    Rule(severities=(Severity.SEV3,), when=When.IN_HOURS, channels=(Channel.EMAIL,)),
    # Out of hours a Sev3 waits for the next working morning: email, no phone.
    Rule(severities=(Severity.SEV3,), when=When.OUT_OF_HOURS, channels=(Channel.EMAIL,)),
    # The sender batches Sev4 email into a digest.
    Rule(severities=(Severity.SEV4,), when=When.ALWAYS, channels=(Channel.EMAIL,)),
)
#: Default working hours: Monday to Friday, 09:00-18:00 UTC. Set your team's zone.
DEFAULT_WORKING_HOURS = WorkingHours(time_zone="UTC", start="09:00", end="18:00")
#: :data:`DEFAULT_RULES` with :data:`DEFAULT_WORKING_HOURS`.
DEFAULT_ROUTING = Routing(working_hours=DEFAULT_WORKING_HOURS, rules=DEFAULT_RULES)


def parse_routing(data: Any, field: str = "") -> Routing:
    """A :class:`Routing` from plain data (``{working_hours: {...}, rules: [...]}``). Raises
    :class:`apiary.errors.ValidationError` naming the field (``rules[0].channels[1]: Input
    should be 'phone', 'sms', 'im' or 'email'``)."""
    return parse_model(Routing, data, field)


def load_routing(text: str | bytes) -> Routing:
    """A :class:`Routing` from YAML text. Raises :class:`apiary.errors.ValidationError`."""
    return parse_routing(parse_yaml(text, field="routing", what="routing table"))
