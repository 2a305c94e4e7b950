"""The guard of a drill against a live platform: abort and roll back when the steady state breaks.

Netflix's ChAP stops an experiment early when the steady-state metric of its experiment group
deviates beyond a bound; the guard does the same for the chaos and load drills:

* **Steady state** is the inspection probe (:func:`apiary.drills.inspection.probe`: every VC
  takes and runs a tiny job within ``probe_slo_s``) and the users' guaranteed jobs: those RUNNING
  when the drill starts must not be disrupted by the platform (their ``retryDetails.platform``
  must not grow: a lost node, a preemption).
* **Before** the drill: one probe round. A platform already off its steady state is not drilled
  (the drill is ``aborted`` without starting: there is nothing to learn and users would suffer).
* **During** the drill: a probe round every ``interval_s``. The error budget is
  ``max_probe_failures`` failed rounds; one more, or any disrupted guaranteed job unless the
  experiment allows it (``allow_disruption``), trips the breaker.
* **Abort** = the drill's ``abort`` event is set (the runner stops early when it can), the guard
  rolls back what the platform shows of the drill (each drill or chaos cordon set since it
  started is lifted, by its source; older ones, and an admin's, an alert's or an incident's,
  stay) and calls the drill's own ``rollback``, then waits ``grace_s`` for the runner.

The guard's probes are opportunistic jobs like the inspection's: they never take capacity from
a guaranteed job. Its decisions are logged and returned (:class:`Guarded`) for the drill's report.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from apiary.drills.common import DrillApi
from apiary.drills.inspection import ProbeResult, probe
from apiary.errors import ApiaryError

logger = logging.getLogger(__name__)

T = TypeVar("T")
Prober = Callable[[], list[ProbeResult]]


@dataclass
class GuardConfig:
    max_probe_failures: int = 2
    interval_s: float = 30.0
    probe_slo_s: float = 60.0
    #: The experiment may disrupt guaranteed jobs (it says so itself); the guard then ignores them.
    allow_disruption: bool = False
    grace_s: float = 30.0


@dataclass
class Guarded(Generic[T]):
    """What a guarded drill returns. ``result``: the work's return value (None when it was not
    started, raised, or is still running after an abort's grace period)."""

    result: T | None = None
    aborted: bool = False
    started: bool = False
    reasons: list[str] = field(default_factory=list)
    error: str | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)


class SteadyStateGuard:
    """Checks the steady state (module doc) on demand (:meth:`check`) or every ``interval_s`` in a
    thread (:meth:`start` / :meth:`stop`); :attr:`tripped` is set once the budget is spent."""

    def __init__(self, api: DrillApi, config: GuardConfig, *, image: str, prober: Prober | None = None,
                 on_trip: Callable[[], None] | None = None) -> None:
        self.api = api
        self.config = config
        self.prober = prober or (lambda: probe(api, slo_s=config.probe_slo_s, image=image))
        self.on_trip = on_trip
        self.tripped = threading.Event()
        self.reasons: list[str] = []
        self.rounds: list[dict[str, Any]] = []
        self.failed_rounds = 0
        self._guaranteed: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def snapshot_guaranteed(self) -> None:
        """Remember the guaranteed jobs RUNNING now and their platform retries."""
        try:
            jobs = self.api.list(state="RUNNING")
        except ApiaryError as e:
            logger.warning("guard: running jobs unreadable, not watched: %s", e.message)
            return
        self._guaranteed = {j["id"]: int((j.get("retryDetails") or {}).get("platform", 0))
                            for j in jobs if j.get("priorityClass") != "oppo"}

    def _disrupted(self) -> list[str]:
        out = []
        for job_id, before in self._guaranteed.items():
            try:
                job = self.api.get(job_id)
            except ApiaryError:
                continue
            now = int((job.get("retryDetails") or {}).get("platform", 0))
            if now > before:
                out.append(f"{job_id} (platform retries {before} -> {now})")
        return out

    def check(self) -> bool:
        """One round; True when the steady state holds. Trips the breaker when the budget is spent."""
        results = self.prober()
        failed = [r for r in results if not r.success]
        self.rounds.append({"at": time.time(), "ok": not failed and bool(results),
                            "failed": {r.virtual_cluster: r.reason for r in failed}})
        if failed or not results:
            self.failed_rounds += 1
            logger.warning("guard: probe round failed (%d/%d allowed): %s", self.failed_rounds,
                           self.config.max_probe_failures, [f"{r.virtual_cluster}: {r.reason}" for r in failed])
            if self.failed_rounds > self.config.max_probe_failures:
                self.trip(f"inspection probe failed {self.failed_rounds} times "
                          f"(error budget {self.config.max_probe_failures})")
        if not self.config.allow_disruption:
            hit = self._disrupted()
            if hit:
                self.trip("guaranteed jobs disrupted: " + ", ".join(hit))
        return not self.tripped.is_set() and not failed

    def trip(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)
        if not self.tripped.is_set():
            logger.error("guard: tripped: %s", reason)
            self.tripped.set()
            if self.on_trip is not None:
                self.on_trip()

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.config.interval_s):
                try:
                    self.check()
                except Exception:  # a bug in a check must not leave the drill unguarded silently
                    logger.exception("guard: check failed")
                    self.trip("the guard's check failed (see the log)")
                if self.tripped.is_set():
                    return

        self._thread = threading.Thread(target=loop, name="drill-guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.config.probe_slo_s + 30)


#: The cordon sources a drill's abort may lift: the drills' own and their chaos experiments'.
DRILL_CORDON_SOURCES = ("drill:", "chaos:")


def _drill_cordons(api: DrillApi) -> set[tuple[str, str]]:
    """``(node, source)`` of every cordon a drill or a chaos experiment holds. Others (an admin's,
    an alert's, an incident's) are never the drill's to lift, even when set while it ran."""
    return {(n["name"], c["source"]) for n in api.nodes() for c in n.get("cordons") or []
            if c["source"].startswith(DRILL_CORDON_SOURCES)}


def guarded(work: Callable[[threading.Event], T], api: DrillApi, config: GuardConfig, *, image: str,
            rollback: Callable[[], list[str]] | None = None, prober: Prober | None = None) -> Guarded[T]:
    """Run ``work(abort)`` under a :class:`SteadyStateGuard` (module doc). ``work`` should return
    soon after ``abort`` is set; ``rollback`` undoes the drill's own changes and returns what it did."""
    out: Guarded[T] = Guarded()
    wake = threading.Event()
    guard = SteadyStateGuard(api, config, image=image, prober=prober, on_trip=wake.set)
    guard.snapshot_guaranteed()
    if not guard.check():
        why = guard.reasons or [f"{vc}: {reason}" for vc, reason in guard.rounds[-1]["failed"].items()]
        out.aborted, out.rounds = True, guard.rounds
        out.reasons = ["steady state broken before the drill started: " + "; ".join(why or ["no VC probed"])]
        logger.error("drill not started: %s", out.reasons[0])
        return out
    guard.failed_rounds = 0  # the budget counts the drill's rounds, not the check before it
    before = _drill_cordons(api)
    abort = threading.Event()
    done = threading.Event()

    def run() -> None:
        try:
            out.result = work(abort)
        except Exception as e:  # the work's failure is the drill's result, not the guard's
            logger.exception("drill work failed")
            out.error = f"{type(e).__name__}: {getattr(e, 'message', None) or e}"
        finally:
            done.set()
            wake.set()

    worker = threading.Thread(target=run, name="drill-work", daemon=True)
    out.started = True
    guard.start()
    worker.start()
    while not done.is_set() and not guard.tripped.is_set():
        wake.wait()
        wake.clear()
    guard.stop()
    if guard.tripped.is_set() and not done.is_set():
        out.aborted = True
        abort.set()
        try:
            for node, source in sorted(_drill_cordons(api) - before):  # each source's own undo
                api.cordon(node, False, source=source)
                out.rolled_back.append(f"uncordoned {node} ({source})")
        except ApiaryError as e:
            out.rolled_back.append(f"uncordon failed: {e.message}")
        if rollback is not None:
            out.rolled_back += rollback()
        if not done.wait(config.grace_s):
            out.rolled_back.append(f"the drill's runner had not stopped {config.grace_s:g} s after the abort")
    elif guard.tripped.is_set():
        out.aborted = True  # tripped as the work ended: the steady state still broke during it
    out.reasons = list(guard.reasons)
    out.rounds = guard.rounds
    return out
