"""Load profiles: how many simulated people are active at each second of a load test.

Pure (no Locust, no clock): the Locust shapes in ``loadtests/apiary_shapes.py`` call
:func:`target_users` with their run time, and the runner reads a profile's defaults (users,
duration) to size its timeouts. "Users" are always the simulated *people* (ML engineers and
operators); the node-agent users come on top, one pair per node (see ``loadtests/README.md``).

Shapes, for ``users`` = U and ``duration_s`` = D:

* ``steady``: U people from the start, spawned at U/10 per second (at least 1/s: a ramp of about
  10 s), held until D.
* ``ramp``: a linear climb to U over the first 80% of D (in whole users), held for the last 20%.
* ``spike``: a baseline of U/5 (at least 1) for the first third, U at once (spawned within a second)
  for the middle third, the baseline again for the last third.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SHAPES = ("steady", "ramp", "spike")


@dataclass(frozen=True)
class Profile:
    """A named load profile: a shape and its defaults."""

    name: str
    shape: str
    users: int
    """Simulated people at the peak (ML engineers + operators; node agents come on top)."""
    duration_s: float
    """Length of the run in seconds, ramps included."""
    description: str


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("smoke", "steady", 5, 30.0, "a few people for 30 s: does every endpoint answer, is no job lost"),
        Profile("ramp", "ramp", 50, 120.0, "a linear climb to 50 people over 96 s, held 24 s: where latency bends"),
        Profile("steady", "steady", 50, 120.0, "50 people for 2 min (the target: 0 failures, 0 lost jobs, "
                                               "submit p99 <= 500 ms)"),
        Profile("spike", "spike", 50, 90.0, "10 people, 50 within a second for 30 s, 10 again: recovery from a burst"),
    )
}


def get_profile(name: str) -> Profile:
    """The profile called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown load profile {name!r}; one of {', '.join(PROFILES)}") from None


def spike_baseline(users: int) -> int:
    return max(1, users // 5)


def target_users(shape: str, t: float, users: int, duration_s: float) -> tuple[int, float] | None:
    """``(people, spawn rate per second)`` wanted ``t`` seconds into a run of ``shape``; None once
    ``t >= duration_s`` (the run ends). ValueError for an unknown shape."""
    if shape not in SHAPES:
        raise ValueError(f"unknown load shape {shape!r}; one of {', '.join(SHAPES)}")
    if t >= duration_s:
        return None
    users = max(1, users)
    if shape == "steady":
        return users, max(1.0, users / 10)
    if shape == "ramp":
        climb = 0.8 * duration_s
        now = max(1, min(users, math.ceil(users * t / climb))) if climb > 0 else users
        return now, max(1.0, users / 10)
    # spike: the burst is spawned (and stopped) within about a second
    third = duration_s / 3
    if third <= t < 2 * third:
        return users, float(users)
    return spike_baseline(users), float(users)
