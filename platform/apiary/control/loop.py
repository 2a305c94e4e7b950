"""The scheduling loop: runs :meth:`ControlPlane.cycle` when woken and at least every tick.

It is a plain thread inside the control-plane process so jobs keep being scheduled while the
Prefect server is down; the ``scheduling-loop`` Prefect flow can drive extra cycles through the API.
"""

from __future__ import annotations

import logging
import threading
import time

from apiary.control.plane import ControlPlane
from apiary.errors import UnavailableError
from apiary.monitoring.platform_metrics import observe_cycle

logger = logging.getLogger(__name__)


class SchedulingLoop:
    """Start with :meth:`start`; :meth:`stop` returns after the current cycle (bounded by ``join_s``).

    ``tick_s``: the longest wait for a wake before a cycle runs anyway (seconds). ``min_interval_s``:
    the shortest time from one cycle's start to the next's (seconds). A cycle costs about the same
    fixed work whether it decides one new job or twenty, so under a stream of submissions the loop
    decides them in batches: at 50 ms, 4 clients submitting put ~10 jobs in a cycle instead of ~3
    (bench/api_submit.py), and a job waits at most 50 ms longer for its first decision.
    """

    def __init__(self, plane: ControlPlane, tick_s: float = 1.0, min_interval_s: float = 0.05) -> None:
        self.plane = plane
        self.tick_s = tick_s
        self.min_interval_s = min_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduling-loop", daemon=True)
        self.cycles = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float = 5.0) -> None:
        self._stop.set()
        self.plane.wake.set()
        self._thread.join(join_s)

    def _run(self) -> None:
        started = 0.0
        while not self._stop.is_set():
            # At most one cycle per min_interval_s: a burst of submissions is decided by one cycle
            # instead of one each (every cycle pays for its snapshot and commit).
            pause = started + self.min_interval_s - time.monotonic()
            if pause > 0 and self._stop.wait(pause):
                break
            self.plane.wake.wait(self.tick_s)
            started = time.monotonic()
            self.plane.wake.clear()
            if self._stop.is_set():
                break
            try:
                result = self.plane.cycle()
                self.cycles += 1
                # apiary_scheduling_cycle_seconds and the "scheduling cycle stuck" alert's timestamp.
                observe_cycle(result.duration_ms / 1000)
                if result.placed or result.preempted:
                    logger.info(
                        "cycle placed=%s preempted=%s ms=%.1f", result.placed, result.preempted, result.duration_ms
                    )
            except UnavailableError as e:  # the store refuses commits (disk full, database gone)
                # Nothing of the failed step was applied to memory (commit, then apply), so the next
                # cycle starts from the store's truth once it accepts writes again.
                logger.warning("scheduling cycle failed: %s", e.message)
            except Exception:  # keep scheduling; the plane rebuilt its scheduler if memory was in doubt
                logger.exception("scheduling cycle failed")
