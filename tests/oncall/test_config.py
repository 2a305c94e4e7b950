"""The example on-call config (apiary/oncall/oncall.example.yaml) loads, and answers who is paged
and how: schedules -> tier targets -> channels. Replayed like HiveD's own example configs."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import yaml

import apiary.oncall
from apiary.errors import ValidationError
from apiary.oncall import Severity, escalation_plan, load_config, next_page, on_call, parse_config, resolve_targets

EXAMPLE = Path(apiary.oncall.__file__).parent / "oncall.example.yaml"
BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


@pytest.fixture(scope="module")
def example() -> apiary.oncall.OncallConfig:
    return load_config(EXAMPLE.read_bytes())


def test_example_loads(example: apiary.oncall.OncallConfig) -> None:
    assert [s.name for s in example.schedules] == ["ml-platform-primary", "ml-platform-senior"]
    policy = example.policy("ml-platform")
    assert [t.level for t in policy.tiers] == [1, 2, 3]
    assert (policy.loops, policy.ack_timeout_min) == (2, 30)
    assert len(escalation_plan(policy, datetime(2024, 3, 13, tzinfo=BERLIN))) == 9


@pytest.mark.parametrize(
    ("when", "primary"),
    [
        # weekly a/b/c from Monday 2024-01-01 09:00: week 10 (from 03-11) is bob's.
        pytest.param(datetime(2024, 3, 11, 10, tzinfo=BERLIN), "bob", id="monday-day"),
        pytest.param(datetime(2024, 3, 12, 12, tzinfo=BERLIN), "chen", id="override"),
        pytest.param(datetime(2024, 3, 13, 10, tzinfo=BERLIN), "bob", id="after-override"),
        # nights-us, daily from 2024-01-01 18:00: day 72 (03-13) is dana's, weeknights only.
        pytest.param(datetime(2024, 3, 13, 22, tzinfo=BERLIN), "dana", id="weeknight"),
        pytest.param(datetime(2024, 3, 14, 8, 59, tzinfo=BERLIN), "dana", id="weeknight-morning"),
        pytest.param(datetime(2024, 3, 16, 22, tzinfo=BERLIN), "bob", id="saturday-night"),
        # Sunday night is no weeknight, so the weekly layer shows through: week 12 is alice's, and
        # week 13 starts Monday 2024-04-01 09:00 CEST, after the DST change, with bob.
        pytest.param(datetime(2024, 4, 1, 8, 59, tzinfo=BERLIN), "alice", id="sunday-night"),
        pytest.param(datetime(2024, 4, 1, 9, 0, tzinfo=BERLIN), "bob", id="handoff-after-dst"),
    ],
)
def test_example_primary_schedule(example: apiary.oncall.OncallConfig, when: datetime, primary: str) -> None:
    assert on_call(example.schedule_map()["ml-platform-primary"], when) == primary


def test_example_incident_end_to_end(example: apiary.oncall.OncallConfig) -> None:
    """A Sev1 at 22:00 on a Wednesday in Berlin: who gets which page, when, and how."""
    policy, schedules = example.policy("ml-platform"), example.schedule_map()
    t = datetime(2024, 3, 13, 22, tzinfo=BERLIN)
    assert example.routing.route(Severity.SEV1, t) == ["phone", "sms", "im"]
    assert example.routing.route(Severity.SEV2, t) == ["phone", "im"]
    assert example.routing.route(Severity.SEV3, t) == ["email"]
    pages = escalation_plan(policy, t)
    who = [resolve_targets(policy.tiers[p.tier - 1], schedules, p.at) for p in pages[:3]]
    # 22:00 Berlin = 17:00 New York: the seniors' restriction (08:00-20:00 NY) still has frank
    # (daily from 2024-01-01: day 72 is even).
    assert who == [["dana"], ["frank", "platform-lead"], ["eng-manager", "vendor-support"]]
    # Acked by dana at 22:05 and not resolved: tier 1 again at 22:35.
    page = next_page(policy, t, t + timedelta(minutes=5), t + timedelta(minutes=5))
    assert page is not None and (page.tier, page.at) == (1, t + timedelta(minutes=35))


def _example_data() -> dict[str, object]:
    data = yaml.safe_load(EXAMPLE.read_text())
    assert isinstance(data, dict)
    return data


def test_config_errors_name_the_field() -> None:
    data = _example_data()
    data["schedules"][0]["layers"][0]["time_zone"] = "Mars/Base"  # type: ignore[index]
    with pytest.raises(
        ValidationError, match=r"^schedules\[0\]\.layers\[0\]\.time_zone: unknown time zone 'Mars/Base'"
    ):
        parse_config(data)
    data = _example_data()
    data["policies"][0]["tiers"][1]["targets"][0]["schedule"] = "nope"  # type: ignore[index]
    with pytest.raises(
        ValidationError, match=r"^policies\[0\]\.tiers\[1\]\.targets\[0\]\.schedule: unknown schedule 'nope'"
    ):
        parse_config(data)
    data = _example_data()
    data["schedules"].append(data["schedules"][0])  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match=r"^schedules\[2\]\.name: duplicate name 'ml-platform-primary'"):
        parse_config(data)
    with pytest.raises(ValidationError, match=r"^config: on-call config is not valid YAML"):
        load_config("schedules: [")


def test_routing_defaults_when_absent() -> None:
    assert parse_config({}).routing == apiary.oncall.DEFAULT_ROUTING
