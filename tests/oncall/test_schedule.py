"""Schedules: rotation handoffs (daily, weekly, custom; across DST), restrictions, overrides,
layer precedence, handoff instants, naive datetimes, parse errors (PagerDuty semantics, see
apiary/oncall/schedule.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from pydantic import ValidationError as PydanticValidationError

from apiary.errors import ValidationError
from apiary.oncall import Layer, Override, Restriction, Schedule, Shift, load_schedule, on_call, parse_schedule, shifts

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
TOKYO = ZoneInfo("Asia/Tokyo")
US = timedelta(microseconds=1)


def at(tz: ZoneInfo, y: int, mo: int, d: int, h: int = 0, mi: int = 0, fold: int = 0) -> datetime:
    return datetime(y, mo, d, h, mi, tzinfo=tz, fold=fold)


def layer(**kw: object) -> Layer:
    """A daily a/b/c rotation handing off at 09:00 Berlin, starting Monday 2024-03-25 09:00."""
    fields: dict[str, object] = {
        "name": "primary",
        "users": ("a", "b", "c"),
        "rotation": "daily",
        "handoff": "09:00",
        "start": at(BERLIN, 2024, 3, 25, 9),
        "time_zone": "Europe/Berlin",
    }
    fields.update(kw)
    return Layer.model_validate(fields)


def sched(*layers: Layer, overrides: tuple[Override, ...] = ()) -> Schedule:
    return Schedule(name="s", layers=layers, overrides=overrides)


def local_table(rendered: list[Shift], tz: ZoneInfo) -> list[tuple[str, str, float]]:
    """(user, local start "MM-DD HH:MM", length in hours) per shift."""
    return [
        (s.user, s.start.astimezone(tz).strftime("%m-%d %H:%M"), (s.end - s.start).total_seconds() / 3600)
        for s in rendered
    ]


# --- rotations ------------------------------------------------------------------------------


def test_daily_handoff_stays_at_0900_local_across_spring_forward() -> None:
    s = sched(layer())
    got = local_table(shifts(s, at(BERLIN, 2024, 3, 29, 9), at(BERLIN, 2024, 4, 2, 9)), BERLIN)
    # Europe/Berlin springs forward on Sunday 2024-03-31 at 02:00: that turn is 23 h.
    assert got == [
        ("b", "03-29 09:00", 24),
        ("c", "03-30 09:00", 23),
        ("a", "03-31 09:00", 24),
        ("b", "04-01 09:00", 24),
    ]


def test_daily_handoff_across_fall_back_is_25h() -> None:
    s = sched(layer(start=at(BERLIN, 2024, 10, 25, 9)))
    got = local_table(shifts(s, at(BERLIN, 2024, 10, 25, 9), at(BERLIN, 2024, 10, 28, 9)), BERLIN)
    assert got == [("a", "10-25 09:00", 24), ("b", "10-26 09:00", 25), ("c", "10-27 09:00", 24)]


@pytest.mark.parametrize(
    ("first_monday", "hours"),
    [
        pytest.param((2024, 3, 4), 167, id="spring-forward-week"),
        pytest.param((2024, 10, 28), 169, id="fall-back-week"),
        pytest.param((2024, 6, 3), 168, id="summer-week"),
    ],
)
def test_weekly_handoff_monday_0900_new_york(first_monday: tuple[int, int, int], hours: float) -> None:
    start = at(NEW_YORK, *first_monday, 9)
    lay = layer(
        rotation="weekly",
        handoff="09:00",
        handoff_day="monday",
        start=start,
        time_zone="America/New_York",
        users=("x", "y"),
    )
    got = shifts(sched(lay), start, start + timedelta(days=14))
    assert [s.user for s in got] == ["x", "y"]
    assert (got[0].end - got[0].start) == timedelta(hours=hours)
    handoff = got[0].end.astimezone(NEW_YORK)
    assert (handoff.weekday(), handoff.hour, handoff.minute) == (0, 9, 0)


def test_weekly_handoff_defaults_to_start_and_first_turn_is_partial() -> None:
    # Starts Wednesday 14:00 with the handoff on Monday 09:00: a's first turn runs to Monday.
    lay = layer(rotation="weekly", handoff_day="mon", start=at(BERLIN, 2024, 3, 13, 14))
    got = local_table(shifts(sched(lay), at(BERLIN, 2024, 3, 1), at(BERLIN, 2024, 3, 26)), BERLIN)
    assert got == [("a", "03-13 14:00", 5 * 24 - 5), ("b", "03-18 09:00", 168), ("c", "03-25 09:00", 15)]
    # No handoff given: the start's weekday and local time (PagerDuty's rotation_virtual_start).
    implicit = layer(rotation="weekly", handoff=None, start=at(BERLIN, 2024, 3, 13, 14))
    got = local_table(shifts(sched(implicit), at(BERLIN, 2024, 3, 13), at(BERLIN, 2024, 3, 28)), BERLIN)
    assert got == [("a", "03-13 14:00", 168), ("b", "03-20 14:00", 168), ("c", "03-27 14:00", 10)]


def test_custom_12h_turns_keep_local_wall_clock_across_dst() -> None:
    lay = layer(rotation="custom", handoff=None, turn_length_h=12, users=("d", "n"), start=at(BERLIN, 2024, 3, 30, 9))
    got = local_table(shifts(sched(lay), at(BERLIN, 2024, 3, 30, 9), at(BERLIN, 2024, 4, 1, 9)), BERLIN)
    assert got == [
        ("d", "03-30 09:00", 12),
        ("n", "03-30 21:00", 11),
        ("d", "03-31 09:00", 12),
        ("n", "03-31 21:00", 12),
    ]


def test_handoff_in_the_skipped_hour_happens_at_the_jump_and_in_the_repeated_hour_the_first_time() -> None:
    lay = layer(handoff="02:30", start=at(BERLIN, 2024, 3, 29, 2, 30))
    # 2024-03-31 02:30 does not exist in Berlin: the clock jumps 02:00 CET -> 03:00 CEST at 01:00Z.
    assert on_call(sched(lay), datetime(2024, 3, 31, 1, 0, tzinfo=UTC)) == "c"
    assert on_call(sched(lay), datetime(2024, 3, 31, 1, 0, tzinfo=UTC) - US) == "b"
    fall = layer(handoff="02:30", start=at(BERLIN, 2024, 10, 26, 2, 30))
    # 2024-10-27 02:30 happens twice; the handoff is the first one, 02:30 CEST = 00:30Z.
    assert on_call(sched(fall), datetime(2024, 10, 27, 0, 30, tzinfo=UTC)) == "b"
    assert on_call(sched(fall), datetime(2024, 10, 27, 0, 30, tzinfo=UTC) - US) == "a"


def test_the_incoming_user_is_on_call_at_the_handoff_instant() -> None:
    s = sched(layer())
    handoff = at(BERLIN, 2024, 3, 26, 9)
    assert on_call(s, handoff - US) == "a"
    assert on_call(s, handoff) == "b"
    assert on_call(s, at(BERLIN, 2024, 3, 25, 9) - US) is None  # before the layer starts
    assert on_call(s, at(BERLIN, 2024, 3, 25, 9)) == "a"


def test_schedule_zone_differs_from_the_query_zone() -> None:
    # Tokyo hands off at 09:00 JST = 00:00Z = 19:00 the evening before in New York (EST).
    lay = layer(time_zone="Asia/Tokyo", start=at(TOKYO, 2024, 1, 10, 9), users=("t1", "t2"))
    s = sched(lay)
    assert on_call(s, at(NEW_YORK, 2024, 1, 10, 19) - US) == "t1"
    assert on_call(s, at(NEW_YORK, 2024, 1, 10, 19)) == "t2"
    instant = at(NEW_YORK, 2024, 1, 12, 3, 17)
    assert on_call(s, instant) == on_call(s, instant.astimezone(UTC)) == on_call(s, instant.astimezone(TOKYO))
    rendered = shifts(s, at(NEW_YORK, 2024, 1, 10, 12), at(NEW_YORK, 2024, 1, 11, 12))
    assert [(x.user, x.start.astimezone(NEW_YORK).hour) for x in rendered] == [("t1", 12), ("t2", 19)]
    assert all(x.start.tzinfo is UTC and x.end.tzinfo is UTC for x in rendered)


def test_layer_end() -> None:
    s = sched(layer(end=at(BERLIN, 2024, 3, 27, 12)))
    assert on_call(s, at(BERLIN, 2024, 3, 27, 12) - US) == "c"
    assert on_call(s, at(BERLIN, 2024, 3, 27, 12)) is None
    assert shifts(s, at(BERLIN, 2024, 3, 27), at(BERLIN, 2024, 3, 29))[-1].end == at(BERLIN, 2024, 3, 27, 12)


# --- restrictions ---------------------------------------------------------------------------

WEEKDAYS_9_TO_6 = Restriction(days=("mon", "tue", "wed", "thu", "fri"), start="09:00", end="18:00")


@pytest.mark.parametrize(
    ("when", "who"),
    [
        pytest.param(at(BERLIN, 2024, 3, 27, 8, 59), None, id="wed-08:59"),
        pytest.param(at(BERLIN, 2024, 3, 27, 9), "c", id="wed-09:00"),
        pytest.param(at(BERLIN, 2024, 3, 27, 17, 59), "c", id="wed-17:59"),
        pytest.param(at(BERLIN, 2024, 3, 27, 18), None, id="wed-18:00"),
        pytest.param(at(BERLIN, 2024, 3, 30, 12), None, id="saturday"),
        pytest.param(at(BERLIN, 2024, 4, 1, 10), "b", id="monday-after-dst"),
    ],
)
def test_weekday_restriction(when: datetime, who: str | None) -> None:
    assert on_call(sched(layer(restrictions=(WEEKDAYS_9_TO_6,))), when) == who


def test_restriction_renders_one_shift_per_window_and_the_rotation_keeps_turning() -> None:
    s = sched(layer(restrictions=(WEEKDAYS_9_TO_6,)))
    got = local_table(shifts(s, at(BERLIN, 2024, 3, 25), at(BERLIN, 2024, 4, 2)), BERLIN)
    # Saturday and Sunday are masked, not paused: Monday 04-01 is 7 turns on, b's (not c's).
    assert got == [
        ("a", "03-25 09:00", 9),
        ("b", "03-26 09:00", 9),
        ("c", "03-27 09:00", 9),
        ("a", "03-28 09:00", 9),
        ("b", "03-29 09:00", 9),
        ("b", "04-01 09:00", 9),
    ]


def test_overnight_restriction_ends_the_next_morning() -> None:
    nights = Restriction(days=("fri",), start="18:00", end="09:00")
    s = sched(layer(restrictions=(nights,)))
    assert on_call(s, at(BERLIN, 2024, 3, 29, 17, 59)) is None
    assert on_call(s, at(BERLIN, 2024, 3, 29, 18)) == "b"
    assert on_call(s, at(BERLIN, 2024, 3, 30, 8, 59)) == "b"  # still Friday's turn
    assert on_call(s, at(BERLIN, 2024, 3, 28, 20)) is None  # Thursday is not a listed day
    assert on_call(s, at(BERLIN, 2024, 3, 30, 9)) is None
    assert on_call(s, at(BERLIN, 2024, 3, 30, 18)) is None  # Saturday is not a listed day


# --- overrides and layers ---------------------------------------------------------------------


def test_override_partially_overlapping_two_turns() -> None:
    o = Override(user="x", start=at(BERLIN, 2024, 3, 25, 15), end=at(BERLIN, 2024, 3, 26, 12))
    s = sched(layer(), overrides=(o,))
    got = shifts(s, at(BERLIN, 2024, 3, 25, 9), at(BERLIN, 2024, 3, 27, 9))
    assert [(x.user, x.start.astimezone(BERLIN).strftime("%d %H"), x.source) for x in got] == [
        ("a", "25 09", "primary"),
        ("x", "25 15", "override"),
        ("b", "26 12", "primary"),
    ]
    assert on_call(s, o.start) == "x" and on_call(s, o.end) == "b"


@pytest.mark.parametrize(
    ("inner_last", "expected"),
    [
        pytest.param(True, ["X", "Y", "X"], id="nested-listed-after-wins"),
        pytest.param(False, ["X"], id="nested-listed-before-is-hidden"),
    ],
)
def test_nested_overrides(inner_last: bool, expected: list[str]) -> None:
    outer = Override(user="X", start=at(BERLIN, 2024, 3, 25, 10), end=at(BERLIN, 2024, 3, 25, 18))
    inner = Override(user="Y", start=at(BERLIN, 2024, 3, 25, 12), end=at(BERLIN, 2024, 3, 25, 14))
    s = sched(layer(), overrides=(outer, inner) if inner_last else (inner, outer))
    got = shifts(s, at(BERLIN, 2024, 3, 25, 10), at(BERLIN, 2024, 3, 25, 18))
    assert [x.user for x in got] == expected


def test_override_by_the_user_on_call_merges_into_one_shift() -> None:
    o = Override(user="a", start=at(BERLIN, 2024, 3, 26, 9), end=at(BERLIN, 2024, 3, 26, 12))
    got = shifts(sched(layer(), overrides=(o,)), at(BERLIN, 2024, 3, 25, 9), at(BERLIN, 2024, 3, 26, 15))
    assert [(x.user, x.source) for x in got] == [("a", "primary+override"), ("b", "primary")]
    assert got[0].end == at(BERLIN, 2024, 3, 26, 12)


def test_later_layers_take_precedence_where_they_have_someone() -> None:
    base = layer()
    nights = layer(
        name="nights",
        users=("n1", "n2"),
        handoff="18:00",
        start=at(BERLIN, 2024, 3, 25, 18),
        restrictions=(Restriction(start="18:00", end="09:00"),),
    )
    s = sched(base, nights)
    assert on_call(s, at(BERLIN, 2024, 3, 26, 12)) == "b"  # nights has nobody by day
    assert on_call(s, at(BERLIN, 2024, 3, 26, 20)) == "n2"
    assert on_call(s, at(BERLIN, 2024, 3, 27, 8, 59)) == "n2"
    assert on_call(s, at(BERLIN, 2024, 3, 27, 9)) == "c"
    assert on_call(sched(nights, base), at(BERLIN, 2024, 3, 26, 20)) == "b"  # order matters
    got = shifts(s, at(BERLIN, 2024, 3, 26, 9), at(BERLIN, 2024, 3, 27, 9))
    assert [(x.user, x.source) for x in got] == [("b", "primary"), ("n2", "nights")]


def test_nobody_on_call_is_a_gap_not_a_shift() -> None:
    s = sched(layer(start=at(BERLIN, 2024, 3, 26, 9)))
    got = shifts(s, at(BERLIN, 2024, 3, 25), at(BERLIN, 2024, 3, 26, 12))
    assert got == [Shift("a", at(BERLIN, 2024, 3, 26, 9).astimezone(UTC), at(BERLIN, 2024, 3, 26, 12), "primary")]
    assert shifts(s, at(BERLIN, 2024, 3, 27), at(BERLIN, 2024, 3, 27)) == []


# --- errors ---------------------------------------------------------------------------------


def test_naive_datetimes_are_rejected() -> None:
    s = sched(layer())
    with pytest.raises(ValueError, match="at must be a timezone-aware datetime"):
        on_call(s, datetime(2024, 3, 26, 9))
    with pytest.raises(ValueError, match="start must be a timezone-aware"):
        shifts(s, datetime(2024, 3, 26), at(BERLIN, 2024, 3, 27))
    with pytest.raises(ValueError, match="before start"):
        shifts(s, at(BERLIN, 2024, 3, 27), at(BERLIN, 2024, 3, 26))
    with pytest.raises(PydanticValidationError):
        layer(start=datetime(2024, 3, 25, 9))


def _layer_doc(**layer_fields: object) -> dict[str, object]:
    lay: dict[str, object] = {
        "name": "primary",
        "users": ["a"],
        "rotation": "daily",
        "handoff": "09:00",
        "start": "2024-03-25T09:00:00+01:00",
        "time_zone": "Europe/Berlin",
    }
    lay.update(layer_fields)
    return {k: v for k, v in lay.items() if v is not None}


def _doc(**layer_fields: object) -> dict[str, object]:
    return {"name": "s", "layers": [_layer_doc(**layer_fields)]}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        pytest.param(_doc(time_zone="Mars/Base"), "layers[0].time_zone: unknown time zone 'Mars/Base'", id="zone"),
        pytest.param(_doc(users=[]), "layers[0].users: Tuple should have at least 1 item", id="no-users"),
        pytest.param(_doc(start="2024-03-25T09:00:00"), "layers[0].start: Input should have timezone", id="naive"),
        pytest.param(_doc(handoff=1080), 'layers[0].handoff: expected a local time "HH:MM" as a string', id="1080"),
        pytest.param(_doc(handoff="25:00"), "layers[0].handoff: expected a local time", id="25h"),
        pytest.param(_doc(rotation="monthly"), "layers[0].rotation: Input should be 'daily'", id="rotation"),
        pytest.param(_doc(rotation="custom", handoff=None), "layers[0].turn_length_h: required", id="no-length"),
        pytest.param(_doc(turn_length_h=8), "layers[0].turn_length_h: only for a custom rotation", id="length"),
        pytest.param(_doc(handoff_day="mon"), "layers[0].handoff_day: only for a weekly", id="daily-day"),
        pytest.param(
            _doc(rotation="weekly", handoff_day="someday"), "layers[0].handoff_day: expected a weekday", id="day"
        ),
        pytest.param(_doc(colour="red"), "layers[0].colour: Extra inputs are not permitted", id="extra"),
        pytest.param(
            _doc(restrictions=[{"start": "09:00", "end": "09:00"}]),
            "layers[0].restrictions[0].end: equals start",
            id="restriction",
        ),
        pytest.param(
            {**_doc(), "overrides": [{"user": "x", "start": "2024-03-26T09:00Z", "end": "2024-03-26T08:00Z"}]},
            "overrides[0].end: must be after start",
            id="override",
        ),
        pytest.param(
            {"name": "s", "layers": [_layer_doc(), _layer_doc()]},
            "layers[1].name: duplicate layer name 'primary'",
            id="duplicate",
        ),
    ],
)
def test_parse_errors_name_the_field(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_schedule(doc)
    assert str(info.value).startswith(message), str(info.value)


def test_load_schedule_from_yaml() -> None:
    s = load_schedule(
        """
name: primary
layers:
  - name: weekly
    users: [alice, bob]
    rotation: weekly
    handoff: "09:00"
    handoff_day: monday
    start: 2024-03-04T09:00:00-05:00
    time_zone: America/New_York
overrides:
  - {user: carol, start: 2024-03-06T00:00:00Z, end: 2024-03-07T00:00:00Z}
"""
    )
    assert on_call(s, at(NEW_YORK, 2024, 3, 11, 9)) == "bob"
    assert on_call(s, datetime(2024, 3, 6, 12, tzinfo=UTC)) == "carol"
    with pytest.raises(ValidationError, match=r"^schedule: schedule is not valid YAML"):
        load_schedule("name: [")
