"""Tier delays and acknowledgement timeouts in seconds (drills and tests cannot wait minutes), and
routing rules that notify every channel at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from apiary.errors import ValidationError
from apiary.oncall import escalation_plan, next_page, parse_policy, parse_routing
from apiary.oncall.routing import Severity, match_rule

T0 = datetime(2026, 11, 26, 3, 0, tzinfo=UTC)


def test_delays_in_seconds_drive_the_plan_and_the_ack_timeout() -> None:
    policy = parse_policy({"name": "p", "ack_timeout_s": 90, "tiers": [
        {"level": 1, "targets": [{"user": "a"}], "delay_s": 20},
        {"level": 2, "targets": [{"user": "b"}], "delay_min": 1}]})
    assert [(p.at - T0).total_seconds() for p in escalation_plan(policy, T0)] == [0, 20]
    ack = T0 + timedelta(seconds=5)
    page = next_page(policy, T0, ack, ack)
    assert page is not None and page.tier == 1 and page.at == ack + timedelta(seconds=90)


@pytest.mark.parametrize("tier", [
    {"level": 1, "targets": [{"user": "a"}]},
    {"level": 1, "targets": [{"user": "a"}], "delay_s": 5, "delay_min": 1},
    {"level": 1, "targets": [{"user": "a"}], "delay_s": 0},
])
def test_a_tier_has_exactly_one_positive_delay(tier: dict) -> None:
    with pytest.raises(ValidationError) as e:
        parse_policy({"name": "p", "tiers": [tier]})
    assert "tiers[0]" in str(e.value.field)


def test_notify_all_and_the_first_matching_rule() -> None:
    routing = parse_routing({"working_hours": {"time_zone": "Europe/Berlin", "start": "09:00", "end": "18:00"},
                             "rules": [{"severities": ["Sev1"], "channels": ["phone", "sms"]},
                                       {"severities": ["Sev2", "Sev3", "Sev4"], "when": "in_hours",
                                        "channels": ["email", "im"], "notify": "all"},
                                       {"severities": ["Sev2", "Sev3", "Sev4"], "when": "out_of_hours",
                                        "channels": ["email"]}]})
    in_hours = datetime(2026, 11, 26, 10, 0, tzinfo=UTC)  # 11:00 in Berlin, a Thursday
    rule = match_rule(routing.rules, routing.working_hours, Severity.SEV2, in_hours)
    assert rule.notify == "all" and [c.value for c in rule.channels] == ["email", "im"]
    night = match_rule(routing.rules, routing.working_hours, Severity.SEV2, T0)
    assert night.notify == "first" and [c.value for c in night.channels] == ["email"]
    assert match_rule(routing.rules, routing.working_hours, Severity.SEV1, T0).notify == "first"
