"""The scheduling loop runs at most one cycle per ``min_interval_s``, however often it is woken
(a burst of submissions is decided by a few cycles, not one each), and still runs at once when woken
after a quiet spell. A fake plane records when each cycle started; nothing here sleeps to wait."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from apiary.control.loop import SchedulingLoop


@dataclass
class _Result:
    duration_ms: float = 0.0
    placed: int = 0
    preempted: int = 0


class _Plane:
    """Counts cycles; every cycle wakes the loop again, as a steady stream of submissions would."""

    def __init__(self, keep_waking: bool) -> None:
        self.wake = threading.Event()
        self.starts: list[float] = []
        self.keep_waking = keep_waking

    def cycle(self) -> _Result:
        self.starts.append(time.monotonic())
        if self.keep_waking:
            self.wake.set()
        return _Result()


def _wait_for(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_loop_woken_all_the_time_keeps_min_interval_between_cycles() -> None:
    plane = _Plane(keep_waking=True)
    loop = SchedulingLoop(plane, tick_s=60.0, min_interval_s=0.2)  # type: ignore[arg-type]
    loop.start()
    plane.wake.set()
    try:
        _wait_for(lambda: len(plane.starts) >= 4)
    finally:
        loop.stop()
    gaps = [b - a for a, b in zip(plane.starts, plane.starts[1:], strict=False)]
    assert min(gaps) >= 0.2 - 0.01, gaps  # without pacing these are microseconds


def test_a_wake_after_a_quiet_spell_runs_a_cycle_without_the_tick() -> None:
    plane = _Plane(keep_waking=False)
    loop = SchedulingLoop(plane, tick_s=60.0, min_interval_s=0.05)  # type: ignore[arg-type]
    loop.start()
    try:
        plane.wake.set()
        _wait_for(lambda: len(plane.starts) == 1)
        plane.wake.set()  # long before the 60 s tick: the wake alone starts the next cycle
        _wait_for(lambda: len(plane.starts) == 2)
    finally:
        loop.stop()
