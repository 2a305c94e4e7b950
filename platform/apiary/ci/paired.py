"""The regression stage's judgement: the change against its base commit, measured in the same run.

Absolute timings follow the machine, not the code: on a 2-core CI host also running other work
(load 5-9) the quick scheduler benchmark measured p99 4.6 ms for a good change, against a 2.0 ms
target met at 0.52 ms on a quiet machine. So the stage measures the base commit beside the change,
on the same machine in the same minutes, and judges the ratio, as a paired benchmark does:

* :func:`measure_interleaved` runs the two alternately in ABBA order (base, change, change, base,
  base, change, ...) so that a load that rises or falls during the stage weighs on both alike;
* :func:`judge` compares the median of each metric (robust to the odd run a burst of load hits)
  and fails a metric whose change median is more than :data:`TOLERANCE` times worse than the
  base's. A machine that slows both down leaves the ratio near 1; a change that makes the
  scheduler twice as slow fails whatever the load.

Pure: the measurements come from the callables given (the stage runs ``bench/run.py`` in the two
checkouts: :func:`apiary.ci.stages.regression`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Metric:
    """A number in ``bench/run.py``'s results: ``path`` dotted (``scheduler.nodes_200.p99_ms``),
    ``higher_is_better`` (a rate) or not (a latency)."""

    path: str
    higher_is_better: bool

    def read(self, results: Mapping[str, Any]) -> float | None:
        """The metric's value in ``results``; None when absent or not a finite number."""
        value: Any = results
        for key in self.path.split("."):
            if not isinstance(value, Mapping) or key not in value:
                return None
            value = value[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return None
        return float(value)


#: What the stage judges: the quick scheduler benchmark's throughput and tail latency.
METRICS = (Metric("scheduler.nodes_200.placements_per_s", True), Metric("scheduler.nodes_200.p99_ms", False))
#: How many times worse than the base's a change's median may be. A 2x slowdown fails; the noise
#: of the medians of 7 paired quick runs on a loaded 2-core machine stays well under it.
TOLERANCE = 1.5
#: Runs of each side (odd: the median is one run's value).
ROUNDS = 7


@dataclass(frozen=True)
class Comparison:
    """One metric: the base's and the change's medians, ``slowdown`` (how many times worse the
    change is: > 1 worse, < 1 better) and whether it is within the tolerance."""

    metric: Metric
    base: float
    change: float
    slowdown: float
    ok: bool

    def line(self) -> str:
        name = self.metric.path.split(".")[-1]
        return (f"{name} {self.change:.4g} vs base {self.base:.4g} ({self.slowdown:.2f}x "
                f"{'worse' if self.slowdown > 1 else 'as good or better'})")


@dataclass(frozen=True)
class Verdict:
    """The judgement of every metric measured on both sides; ``skipped``: metrics the base (an
    older benchmark) or the change did not report."""

    comparisons: tuple[Comparison, ...]
    skipped: tuple[str, ...]
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    def summary(self) -> str:
        """One line: the failing metrics when any, else every metric."""
        shown = [c for c in self.comparisons if not c.ok] or list(self.comparisons)
        text = "; ".join(c.line() for c in shown) or "no metric measured on both sides"
        return f"{text} (tolerance {self.tolerance:g}x, medians)"

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "tolerance": self.tolerance, "skipped": list(self.skipped),
                "metrics": [{"metric": c.metric.path, "base": c.base, "change": c.change, "slowdown": c.slowdown,
                             "ok": c.ok} for c in self.comparisons]}


def measure_interleaved(measure_base: Callable[[], Mapping[str, Any]],
                        measure_change: Callable[[], Mapping[str, Any]],
                        rounds: int = ROUNDS) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """``rounds`` results of each side, measured in ABBA order (base first in even rounds, change
    first in odd ones); ``(base results, change results)``. A measurement's exception propagates."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    base: list[Mapping[str, Any]] = []
    change: list[Mapping[str, Any]] = []
    for i in range(rounds):
        if i % 2 == 0:
            base.append(measure_base())
            change.append(measure_change())
        else:
            change.append(measure_change())
            base.append(measure_base())
    return base, change


def _slowdown(metric: Metric, base: float, change: float) -> float:
    worse, better = (base, change) if metric.higher_is_better else (change, base)
    if better <= 0:
        return 1.0 if worse <= 0 else math.inf
    return worse / better


def judge(base: Sequence[Mapping[str, Any]], change: Sequence[Mapping[str, Any]],
          metrics: Sequence[Metric] = METRICS, tolerance: float = TOLERANCE) -> Verdict:
    """Compare the medians of each metric over the ``base`` and ``change`` results (each a
    ``bench/run.py`` results document); a metric fails when the change is more than ``tolerance``
    times worse. A metric missing from every run of either side is skipped."""
    if tolerance < 1:
        raise ValueError(f"tolerance must be at least 1, not {tolerance}")
    comparisons: list[Comparison] = []
    skipped: list[str] = []
    for metric in metrics:
        b = [v for v in (metric.read(r) for r in base) if v is not None]
        c = [v for v in (metric.read(r) for r in change) if v is not None]
        if not b or not c:
            skipped.append(metric.path)
            continue
        mb, mc = statistics.median(b), statistics.median(c)
        slowdown = _slowdown(metric, mb, mc)
        comparisons.append(Comparison(metric, mb, mc, slowdown, slowdown <= tolerance))
    return Verdict(tuple(comparisons), tuple(skipped), tolerance)
