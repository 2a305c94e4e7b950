"""The drills against the live platform: ``chaos-drill`` and ``load-drill``, each under the guard.

* ``chaos-drill``: the chaostoolkit experiments in ``chaos/`` tagged ``drill`` or ``ci``, one
  after another (apiary.chaos.runner), each under its own :func:`apiary.drills.guard.guarded`:
  a broken steady state aborts it, rolls back and skips the rest. Experiments tagged
  ``disrupts-guaranteed-jobs`` run only with ``allow_disruptive`` (and the guard then lets
  guaranteed jobs be disturbed: the experiment says so); those tagged ``root`` (their own network
  namespace or tmpfs) only when named.
* ``load-drill``: one load profile (apiary.load.runner; ``smoke`` by default) under the guard,
  its engineers' jobs opportunistic, without simulated node agents (the runner's default: on a
  live platform the real agents are the background, and a simulated heartbeat would hide a node
  that died during the drill).

Passed: every experiment held its hypothesis / the load run met its gates, and the guard never
tripped. Aborted: the guard tripped. Failed: otherwise (a runner error included).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from apiary.drills import adapters
from apiary.drills.common import DrillApi, DrillOutcome, Result, record
from apiary.drills.guard import GuardConfig, Prober, guarded

logger = logging.getLogger(__name__)


def run_chaos_drill(api: DrillApi, experiments: list[Path], *, home: Path, journal_dir: Path, timeout_s: float,
                    guard: GuardConfig, image: str, report: bool = True, prober: Prober | None = None) -> DrillOutcome:
    """Each experiment under its own guard (``prober``: the guard's steady-state check, default the
    inspection probe); an aborted one ends the drill."""
    started = time.time()
    rows: list[dict[str, Any]] = []
    reasons: list[str] = []
    aborted = False
    for path in experiments:
        disruptive = adapters.DISRUPTIVE_TAG in adapters.experiment_tags(path)
        cfg = GuardConfig(**{**vars(guard), "allow_disruption": guard.allow_disruption or disruptive})

        def work(abort: threading.Event, path: Path = path) -> adapters.ExperimentResult:
            return adapters.run_chaos_experiment(path, api_url=api.api_url, token=api.token, home=home,
                                                 journal_dir=journal_dir, timeout_s=timeout_s, abort=abort)

        t0 = time.time()
        g = guarded(work, api, cfg, image=image, prober=prober)
        res = g.result
        row = {"experiment": path.stem, "passed": bool(res and res.passed and not g.aborted and not g.error),
               "aborted": g.aborted, "durationS": round(time.time() - t0, 1),
               "reasons": "; ".join((res.reasons if res else []) + g.reasons + ([g.error] if g.error else [])),
               "rolledBack": "; ".join(g.rolled_back), "journal": res.journal if res else None,
               "guardRounds": len(g.rounds)}
        rows.append(row)
        if not row["passed"]:
            reasons.append(f"{path.stem}: {row['reasons'] or 'hypothesis not held'}")
        if g.aborted:
            aborted = True
            break  # the steady state broke: no further experiment on this platform now
    result: Result = "aborted" if aborted else ("passed" if rows and all(r["passed"] for r in rows) else "failed")
    ran = ", ".join(r["experiment"] for r in rows) or "none"
    summary = f"{sum(r['passed'] for r in rows)}/{len(rows)} experiments held ({ran})"
    if not experiments:
        summary = "no chaos experiment tagged for drills"
    if reasons:
        summary += "; " + "; ".join(reasons)
    outcome = DrillOutcome(drill="chaos-drill", result=result, summary=summary, started_at=started,
                           finished_at=time.time(), rows=rows, details={"experiments": [str(p) for p in experiments]})
    if report:
        record(api, outcome)
    return outcome


def run_load_drill(api: DrillApi, *, profile: str, duration_s: float | None, out_dir: Path,
                   guard: GuardConfig, image: str, report: bool = True, prober: Prober | None = None) -> DrillOutcome:
    """The load profile under the guard (``prober`` as for :func:`run_chaos_drill`)."""
    started = time.time()

    def work(abort: threading.Event) -> adapters.LoadResult:
        return adapters.run_load(api_url=api.api_url, token=api.token, profile=profile, duration_s=duration_s,
                                 out_dir=out_dir, abort=abort)

    g = guarded(work, api, guard, image=image, prober=prober)
    res = g.result
    result: Result = "aborted" if g.aborted else ("passed" if res and res.passed and not g.error else "failed")
    reasons = (res.reasons if res else []) + g.reasons + ([g.error] if g.error else [])
    rows = [{"metric": k, "value": v} for k, v in sorted((res.summary if res else {}).items())]
    rows.append({"metric": "result", "value": result})
    if g.rolled_back:
        rows.append({"metric": "rolledBack", "value": "; ".join(g.rolled_back)})
    length = f"{duration_s:g} s" if duration_s is not None else "its default length"
    summary = f"load profile {profile} ({length}): {result}"
    if reasons:
        summary += "; " + "; ".join(reasons)
    outcome = DrillOutcome(drill="load-drill", result=result, summary=summary, started_at=started,
                           finished_at=time.time(), rows=rows,
                           details={"outDir": res.out_dir if res else None, "guardRounds": g.rounds})
    if res is not None and res.report:
        outcome.plots[f"load {profile}: gates, latency and throughput"] = res.report
    if report:
        record(api, outcome)
    return outcome
