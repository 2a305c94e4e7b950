"""One univariate anomaly detector: river's ``GaussianScorer`` with a rule's thresholds.

``GaussianScorer`` fits a Gaussian to the last ``window`` values and scores a new one 2|CDF(x) - 0.5|
(0 = the mean, -> 1 far in either tail); it returns 0 for the first ``grace`` values. It is a
two-sided score, so the detector adds a direction and a floor (``min_delta``, in the series' unit):
a near-constant series has a tiny variance and would otherwise score 1 on any wiggle. It learns
every value, anomalous or not, so a lasting change of level (a job placed on an idle GPU) is
absorbed within a window instead of firing for ever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from river import anomaly

from apiary.aiops.config import AnomalyRule


@dataclass(frozen=True)
class Verdict:
    """One value judged: ``score`` 0..1, ``mean`` of the window before it, ``fired``."""

    value: float
    score: float
    mean: float
    observations: int
    fired: bool


class SeriesDetector:
    """Judges one series value by value (:meth:`step`). ``direction``: ``"high"`` fires above the
    window's mean, ``"low"`` below it. Not thread-safe; one per series."""

    def __init__(self, rule: AnomalyRule, direction: Literal["high", "low"] = "high"):
        self.rule = rule
        self.sign = 1.0 if direction == "high" else -1.0
        self._scorer = anomaly.GaussianScorer(window_size=rule.window, grace_period=rule.grace)
        self._history: deque[float] = deque(maxlen=rule.window)

    def step(self, value: float) -> Verdict:
        """Score ``value`` against the window, then learn it."""
        n = len(self._history)
        mean = sum(self._history) / n if n else value
        if n >= 2 and max(self._history) - min(self._history) < 1e-9:
            # A constant window: river's rolling variance can come out a hair below zero and its
            # sigma complex (TypeError in cdf). The limit of the score is 0 at the mean, 1 elsewhere.
            score = 0.0 if abs(value - mean) < 1e-9 or n < self.rule.grace else 1.0
        else:
            score = float(self._scorer.score_one(None, value))
        fired = (n >= self.rule.grace and score >= self.rule.score_min
                 and self.sign * (value - mean) >= self.rule.min_delta)
        self._scorer.learn_one(None, value)
        self._history.append(value)
        return Verdict(value=value, score=score, mean=mean, observations=n, fired=fired)
