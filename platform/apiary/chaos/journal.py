"""Judging a chaostoolkit journal: passed, or the reasons it did not.

chaostoolkit's exit code says little (a failed rollback still exits 0), so the verdict comes from
the journal alone. An experiment passes only when all of these hold:

1. ``status`` is ``completed`` (not ``failed``, ``aborted`` or ``interrupted``) and it did not
   ``deviate``;
2. the steady state was checked and met before the method (``steady_states.before``) and after it
   (``steady_states.after``);
3. every activity of the method (``run[*]``) succeeded, except those the experiment tolerates;
4. every declared rollback ran (``rollbacks[*]``) and succeeded.

An experiment tolerates a method activity's failure by naming it in its Apiary extension::

    "extensions": [{"name": "apiary", "tolerated_failures": ["submit-while-the-disk-is-full"]}]

Pure: a function of the journal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def apiary_extension(experiment: Mapping[str, Any]) -> dict[str, Any]:
    for ext in experiment.get("extensions") or []:
        if isinstance(ext, Mapping) and ext.get("name") == "apiary":
            return dict(ext)
    return {}


def tags(experiment: Mapping[str, Any]) -> list[str]:
    return [str(t) for t in experiment.get("tags") or []]


def _why(run: Mapping[str, Any]) -> str:
    """The last line of an activity's exception, or its output when it ran but missed its tolerance."""
    exc = run.get("exception")
    if exc:
        lines = [line.strip() for line in (exc if isinstance(exc, list) else [str(exc)]) if str(line).strip()]
        text = lines[-1] if lines else ""
        # chaoslib wraps a provider's exception: "chaoslib.exceptions.ActivityFailed: apiary....: message"
        for prefix in ("chaoslib.exceptions.ActivityFailed: ",):
            text = text.removeprefix(prefix)
        return text
    return f"returned {run.get('output')!r}, outside its tolerance"


def _name(run: Mapping[str, Any]) -> str:
    return str((run.get("activity") or {}).get("name") or "(unnamed)")


def _hypothesis(state: Mapping[str, Any] | None, when: str) -> list[str]:
    if not state:
        return [f"steady state not checked {when} the method"]
    if state.get("steady_state_met"):
        return []
    failing = [r for r in state.get("probes") or [] if r.get("status") != "succeeded" or not r.get("tolerance_met")]
    if not failing:
        return [f"steady state not met {when} the method"]
    return [f"steady state not met {when} the method: probe {_name(r)}: {_why(r)}" for r in failing]


def judge(journal: Mapping[str, Any]) -> list[str]:
    """The reasons the journal's experiment failed; ``[]`` when it passed."""
    reasons: list[str] = []
    experiment = journal.get("experiment") or {}
    status = journal.get("status")
    if status != "completed":
        reasons.append(f"status {status}, not completed")
    if journal.get("deviated"):
        reasons.append("the steady state deviated after the method")
    states = journal.get("steady_states") or {}
    reasons += _hypothesis(states.get("before"), "before")
    if (states.get("before") or {}).get("steady_state_met"):
        # after a failed "before", chaostoolkit skips the method and the "after" check: one reason is enough
        reasons += _hypothesis(states.get("after"), "after")
    tolerated = set(apiary_extension(experiment).get("tolerated_failures") or [])
    for run in journal.get("run") or []:
        if run.get("status") != "succeeded" and _name(run) not in tolerated:
            reasons.append(f"method activity {_name(run)} failed: {_why(run)}")
    declared = [str(a.get("name")) for a in experiment.get("rollbacks") or []]
    ran = journal.get("rollbacks") or []
    for run in ran:
        if run.get("status") != "succeeded":
            reasons.append(f"rollback {_name(run)} failed: {_why(run)}")
    missing = [n for n in declared if n not in {_name(r) for r in ran}]
    if missing:
        reasons.append(f"rollback(s) did not run: {', '.join(missing)}")
    return reasons


def phase_durations(journal: Mapping[str, Any]) -> dict[str, float]:
    """Seconds spent per phase: ``before``, ``method``, ``after``, ``rollbacks`` (sums of the
    activities' durations) and ``total`` (the journal's own duration)."""
    def total(runs: Any) -> float:
        return round(sum(float(r.get("duration") or 0.0) for r in runs or []), 2)

    states = journal.get("steady_states") or {}
    return {
        "before": total((states.get("before") or {}).get("probes")),
        "method": total(journal.get("run")),
        "after": total((states.get("after") or {}).get("probes")),
        "rollbacks": total(journal.get("rollbacks")),
        "total": round(float(journal.get("duration") or 0.0), 2),
    }
