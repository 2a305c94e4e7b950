"""The load profiles' schedules (apiary.load.profiles), which the Locust shapes in loadtests/ follow."""

from __future__ import annotations

import pytest

from apiary.load.profiles import PROFILES, get_profile, target_users


@pytest.mark.parametrize(
    ("shape", "t", "want"),
    [
        ("steady", 0.0, (50, 5.0)),
        ("steady", 119.9, (50, 5.0)),
        ("steady", 120.0, None),
        ("ramp", 0.0, (1, 5.0)),
        ("ramp", 48.0, (25, 5.0)),
        ("ramp", 96.0, (50, 5.0)),
        ("ramp", 110.0, (50, 5.0)),
        ("spike", 10.0, (10, 50.0)),
        ("spike", 40.0, (50, 50.0)),
        ("spike", 80.0, (10, 50.0)),
        ("spike", 120.0, None),
    ],
    ids=["steady-start", "steady-end", "steady-over", "ramp-start", "ramp-half", "ramp-top", "ramp-hold",
         "spike-before", "spike-burst", "spike-after", "spike-over"],
)
def test_target_users(shape: str, t: float, want: tuple[int, float] | None) -> None:
    assert target_users(shape, t, 50, 120.0) == want


def test_small_runs_spawn_at_least_one_per_second() -> None:
    assert target_users("steady", 0.0, 3, 30.0) == (3, 1.0)
    assert target_users("spike", 0.0, 3, 30.0) == (1, 3.0)


def test_profiles() -> None:
    assert set(PROFILES) == {"smoke", "ramp", "steady", "spike"}
    assert get_profile("steady").users == 50  # the 50 concurrent users
    assert get_profile("smoke").duration_s <= 30
    with pytest.raises(ValueError, match="smoke, ramp, steady, spike"):
        get_profile("soak")
    with pytest.raises(ValueError):
        target_users("square", 0.0, 1, 1.0)
