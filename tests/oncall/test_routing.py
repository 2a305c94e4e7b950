"""Routing: severity x (in hours, out of hours, weekend) -> channels with the default table
(AI-System 7.6.2), working-hour edges, first match wins, parse errors naming the field."""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from apiary.errors import ValidationError
from apiary.oncall import DEFAULT_ROUTING, DEFAULT_RULES, Rule, Severity, WorkingHours, load_routing, route
from apiary.oncall.routing import Routing

BERLIN = ZoneInfo("Europe/Berlin")
OFFICE = WorkingHours(
    time_zone="Europe/Berlin", weekdays=("mon", "tue", "wed", "thu", "fri"), start="09:00", end="18:00"
)

IN_HOURS = datetime(2024, 3, 13, 10, 0, tzinfo=BERLIN)  # Wednesday
OUT_OF_HOURS = datetime(2024, 3, 13, 22, 0, tzinfo=BERLIN)  # Wednesday night
WEEKEND = datetime(2024, 3, 16, 11, 0, tzinfo=BERLIN)  # Saturday late morning
WHEN = {"in-hours": IN_HOURS, "out-of-hours": OUT_OF_HOURS, "weekend": WEEKEND}

# severity, when -> channels (the default table, documented in apiary/oncall/routing.py)
TABLE = [
    ("Sev1", "in-hours", ["phone", "sms", "im"]),
    ("Sev1", "out-of-hours", ["phone", "sms", "im"]),
    ("Sev1", "weekend", ["phone", "sms", "im"]),
    ("Sev2", "in-hours", ["im", "email"]),
    ("Sev2", "out-of-hours", ["phone", "im"]),
    ("Sev2", "weekend", ["phone", "im"]),
    ("Sev3", "in-hours", ["email"]),
    ("Sev3", "out-of-hours", ["email"]),
    ("Sev3", "weekend", ["email"]),
    ("Sev4", "in-hours", ["email"]),
    ("Sev4", "out-of-hours", ["email"]),
    ("Sev4", "weekend", ["email"]),
]


@pytest.mark.parametrize(
    ("severity", "when", "channels"), [pytest.param(*row, id=f"{row[0]}-{row[1]}") for row in TABLE]
)
def test_default_table(severity: str, when: str, channels: list[str]) -> None:
    assert route(DEFAULT_RULES, OFFICE, Severity(severity), WHEN[when]) == channels
    # The instant may be written in any zone.
    assert route(DEFAULT_RULES, OFFICE, Severity(severity), WHEN[when].astimezone(ZoneInfo("Asia/Tokyo"))) == channels


@pytest.mark.parametrize(
    ("at", "in_hours"),
    [
        pytest.param(datetime(2024, 3, 13, 8, 59, tzinfo=BERLIN), False, id="08:59"),
        pytest.param(datetime(2024, 3, 13, 9, 0, tzinfo=BERLIN), True, id="09:00"),
        pytest.param(datetime(2024, 3, 13, 17, 59, tzinfo=BERLIN), True, id="17:59"),
        pytest.param(datetime(2024, 3, 13, 18, 0, tzinfo=BERLIN), False, id="18:00"),
        pytest.param(datetime(2024, 3, 13, 8, 30, tzinfo=UTC), True, id="utc-08:30-is-09:30-cet"),
        pytest.param(datetime(2024, 7, 10, 7, 30, tzinfo=UTC), True, id="utc-07:30-is-09:30-cest"),
        pytest.param(datetime(2024, 3, 17, 12, 0, tzinfo=BERLIN), False, id="sunday-noon"),
    ],
)
def test_working_hours_edges(at: datetime, in_hours: bool) -> None:
    assert OFFICE.contains(at) is in_hours
    assert route(DEFAULT_RULES, OFFICE, Severity.SEV2, at) == (["im", "email"] if in_hours else ["phone", "im"])


def test_first_matching_rule_wins_and_no_match_raises() -> None:
    rules = [
        Rule(severities=("Sev1", "Sev2"), when="always", channels=("im",)),
        Rule(severities=("Sev1",), when="always", channels=("phone",)),
    ]
    assert route(rules, OFFICE, Severity.SEV1, IN_HOURS) == ["im"]
    with pytest.raises(ValueError, match="no routing rule for Sev3 out of hours"):
        route(rules, OFFICE, Severity.SEV3, OUT_OF_HOURS)
    with pytest.raises(ValueError, match="at must be a timezone-aware"):
        route(rules, OFFICE, Severity.SEV1, datetime(2024, 3, 13, 10))


def test_default_routing_is_a_valid_table() -> None:
    assert DEFAULT_ROUTING.rules == DEFAULT_RULES
    assert Routing.model_validate(DEFAULT_ROUTING.model_dump()) == DEFAULT_ROUTING


def _routing(**fields: object) -> str:
    import yaml

    doc: dict[str, object] = {
        "working_hours": {"time_zone": "Europe/Berlin", "start": "09:00", "end": "18:00"},
        "rules": [{"severities": ["Sev1", "Sev2", "Sev3", "Sev4"], "when": "always", "channels": ["email"]}],
    }
    doc.update(fields)
    return yaml.safe_dump(doc)


def _rule(**fields: object) -> list[dict[str, object]]:
    rule: dict[str, object] = {"severities": ["Sev1", "Sev2", "Sev3", "Sev4"], "when": "always", "channels": ["email"]}
    rule.update(fields)
    return [rule]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            _routing(rules=_rule(channels=["phone", "pager"])),
            "rules[0].channels[1]: Input should be 'phone', 'sms', 'im' or 'email'",
            id="channel",
        ),
        pytest.param(_routing(rules=_rule(severities=["Sev5"])), "rules[0].severities[0]: Input should be", id="sev5"),
        pytest.param(_routing(rules=_rule(when="sometimes")), "rules[0].when: Input should be 'in_hours'", id="when"),
        pytest.param(_routing(rules=_rule(channels=[])), "rules[0].channels: Tuple should have at least 1", id="empty"),
        pytest.param(
            _routing(rules=_rule(channels=["im", "im"])), "rules[0].channels: an item is listed twice", id="dup"
        ),
        pytest.param(
            _routing(rules=_rule(severities=["Sev1", "Sev2", "Sev3"])),
            "rules: no rule for Sev4 in_hours",
            id="coverage",
        ),
        pytest.param(
            _routing(rules=_rule(when="in_hours")), "rules: no rule for Sev1 out_of_hours", id="coverage-out-of-hours"
        ),
        pytest.param(
            _routing(working_hours={"time_zone": "Mars/Base", "start": "09:00", "end": "18:00"}),
            "working_hours.time_zone: unknown time zone 'Mars/Base'",
            id="zone",
        ),
        pytest.param(
            _routing(working_hours={"time_zone": "UTC", "start": "18:00", "end": "09:00"}),
            "working_hours.end: must be after start",
            id="overnight",
        ),
        pytest.param(
            "working_hours: {time_zone: UTC, start: '09:00', end: 18:00}\nrules: []\n",
            'working_hours.end: expected a local time "HH:MM" as a string, got the number 1080',
            id="unquoted-18:00",
        ),
        pytest.param(
            _routing(working_hours={"time_zone": "UTC", "weekdays": ["mon", 5], "start": "09:00", "end": "18:00"}),
            "working_hours.weekdays[1]: expected a weekday name",
            id="weekday-number",
        ),
        pytest.param("rules: [\n", "routing: routing table is not valid YAML", id="yaml"),
    ],
)
def test_parse_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        load_routing(text)
    assert str(info.value).startswith(message), str(info.value)


def test_severity_names_are_case_insensitive() -> None:
    table = load_routing(_routing(rules=_rule(severities=["sev1", "SEV2", "Sev3", "sEv4"])))
    assert table.rules[0].severities == (Severity.SEV1, Severity.SEV2, Severity.SEV3, Severity.SEV4)
    assert table.route(Severity.SEV3, WEEKEND) == ["email"]
