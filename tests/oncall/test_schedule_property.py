"""Property tests: for random schedules (daily / weekly / custom layers in zones with DST changes,
handoffs in skipped and repeated hours, restrictions, overlapping overrides), ``shifts()`` is the
timeline ``on_call`` answers from."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from zoneinfo import ZoneInfo

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apiary.oncall import Layer, Override, Restriction, Schedule, on_call, shifts
from apiary.oncall.common import Weekday

# Zones with 1 h, 30 min and no DST changes, north and south, and one with a 30-min offset.
ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "UTC", "America/Sao_Paulo"]
# Instants in the 45 days around each of 2024's DST seasons (Berlin, New York and Lord Howe
# change in March/April and October/November), to the minute.
SEASONS = [datetime(2024, 3, 1, tzinfo=UTC), datetime(2024, 10, 1, tzinfo=UTC)]
instants = st.builds(
    lambda base, m: base + timedelta(minutes=m), st.sampled_from(SEASONS), st.integers(0, 45 * 24 * 60)
)
# Handoff times include the ones DST skips or repeats (02:00-03:00).
local_times = st.sampled_from([time(0, 0), time(2, 0), time(2, 30), time(9, 0), time(18, 0), time(23, 59)])
users = st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4)


@st.composite
def layers(draw: st.DrawFn, name: str) -> Layer:
    rotation = draw(st.sampled_from(["daily", "weekly", "custom"]))
    extra: dict[str, object] = {}
    if rotation == "custom":
        extra["turn_length_h"] = draw(st.sampled_from([1, 5, 8, 12, 36]))
    else:
        extra["handoff"] = draw(st.none() | local_times)
        if rotation == "weekly":
            extra["handoff_day"] = draw(st.none() | st.sampled_from(list(Weekday)))
    start = draw(instants)
    restrictions = []
    for _ in range(draw(st.integers(0, 2))):
        days = draw(st.lists(st.sampled_from(list(Weekday)), min_size=1, max_size=7, unique=True))
        begin = draw(local_times)
        finish = draw(st.sampled_from([time(1, 0), time(3, 0), time(9, 0), time(17, 30)]))
        if begin != finish:
            restrictions.append(Restriction(days=tuple(days), start=begin, end=finish))
    end = draw(st.none() | st.integers(60, 40 * 24 * 60).map(lambda m: start + timedelta(minutes=m)))
    return Layer(
        name=name,
        users=tuple(draw(users)),
        rotation=rotation,
        start=start.astimezone(ZoneInfo(draw(st.sampled_from(ZONES)))),
        end=end,
        time_zone=draw(st.sampled_from(ZONES)),
        restrictions=tuple(restrictions),
        **extra,
    )


@st.composite
def overrides(draw: st.DrawFn) -> Override:
    start = draw(instants)
    return Override(
        user=draw(st.sampled_from(["a", "x", "y"])), start=start, end=start + timedelta(hours=draw(st.integers(1, 60)))
    )


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    n = draw(st.integers(1, 3))
    return Schedule(
        name="s",
        layers=tuple(draw(layers(f"l{i}")) for i in range(n)),
        overrides=tuple(draw(st.lists(overrides(), max_size=3))),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schedule=schedules(), window_start=instants, days=st.integers(0, 14), probes=st.lists(st.floats(0, 1), max_size=30)
)
def test_on_call_is_the_user_of_the_shift_covering_each_instant(
    schedule: Schedule, window_start: datetime, days: int, probes: list[float]
) -> None:
    window_end = window_start + timedelta(days=days, hours=5)
    rendered = shifts(schedule, window_start, window_end)
    # Sorted, inside the window, non-empty, non-overlapping, and merged.
    for prev, cur in zip(rendered, rendered[1:], strict=False):
        assert prev.end <= cur.start
        assert not (prev.end == cur.start and prev.user == cur.user)
    assert all(window_start <= s.start < s.end <= window_end for s in rendered)
    # Every shift edge and a sample of instants agree with on_call (edges: [start, end)).
    checks = [s.start for s in rendered] + [s.end - timedelta(microseconds=1) for s in rendered]
    checks += [window_start + (window_end - window_start) * p for p in probes]
    for t in checks:
        if not window_start <= t < window_end:
            continue
        covering = [s.user for s in rendered if s.start <= t < s.end]
        assert len(covering) <= 1
        assert on_call(schedule, t) == (covering[0] if covering else None), t
        # The zone the instant is written in does not matter.
        assert on_call(schedule, t.astimezone(ZoneInfo("Pacific/Chatham"))) == on_call(schedule, t)


def _handoff_at(instant: datetime, handoff: time, tz: ZoneInfo) -> bool:
    """Whether the clock in ``tz`` shows ``handoff`` at ``instant``, or jumps over it there."""
    now = instant.astimezone(tz).replace(tzinfo=None)
    before = (instant - timedelta(microseconds=1)).astimezone(tz).replace(tzinfo=None)
    if now.time() == handoff:
        return True
    skipped = datetime.combine(now.date(), handoff)
    return before < skipped < now and now - before > timedelta(minutes=1)


@settings(max_examples=100, deadline=None)
@given(
    zone=st.sampled_from(ZONES),
    handoff=local_times,
    start=instants,
    rotation=st.sampled_from(["daily", "weekly"]),
)
def test_handoffs_are_at_the_local_handoff_time_or_the_dst_jump_over_it(
    zone: str, handoff: time, start: datetime, rotation: str
) -> None:
    lay = Layer(name="l", users=("a", "b"), rotation=rotation, handoff=handoff, start=start, time_zone=zone)
    tz = ZoneInfo(zone)
    rendered = shifts(Schedule(name="s", layers=(lay,)), start, start + timedelta(days=60))
    period = timedelta(days=1 if rotation == "daily" else 7)
    for s in rendered[1:]:
        assert _handoff_at(s.start, handoff, tz), s.start.astimezone(tz)
    for s in rendered[1:-1]:
        # Full turns are a wall-clock day or week long, give or take a DST change.
        assert abs((s.end - s.start) - period) <= timedelta(hours=1)
