"""The online predictor: anomaly findings per series and node-failure warnings from precursors.

:class:`Predictor` is fed one observation at a time (:meth:`Predictor.observe` for a node,
:meth:`~Predictor.observe_job`, :meth:`~Predictor.observe_vc`, or a whole :class:`Frame` with
:meth:`~Predictor.observe_frame`) and returns the :class:`Finding` objects it raises. A finding is
raised when its rule starts firing for a subject, not again while it keeps firing (the event's dedup
key would join them anyway); a rule switched off in the config raises nothing.

Node-failure prediction: per node and observation, :func:`node_features` turns the last
``window_intervals`` observations into :data:`FEATURES` (single-bit ECC increases and their trend,
XIDs and whether their codes are hardware ones, the hottest GPU's distance from its own recent mean,
and river's anomaly scores of both); :class:`FailureModel` (scikit-learn's
``HistGradientBoostingClassifier``) gives the probability that the node fails within
``horizon_intervals`` observations, and a probability at ``probability_min`` is a warning. The model
is trained on drill runs (:func:`train`) and remembers their seeds, so a held-out evaluation can
refuse to test on them.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier  # type: ignore[import-untyped]  # no stubs shipped
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]  # no stubs shipped

from apiary.aiops.config import FAILURE_RULE, AiopsConfig, AnomalyRule, load_config
from apiary.aiops.detectors import SeriesDetector, Verdict
from apiary.aiops.drill_runs import HARDWARE_XIDS, DrillRun
from apiary.aiops.findings import Finding, SubjectKind
from apiary.aiops.samples import Frame, JobSample, NodeSample

logger = logging.getLogger(__name__)

#: The failure model's inputs, in column order. "_win" = over the feature window.
FEATURES = (
    "sbe_now", "sbe_win", "sbe_active_win", "sbe_trend", "sbe_score",
    "xid_win", "xid_hw_win",
    "temp_dev_now", "temp_dev_mean_win", "temp_hot_win", "temp_score",
)
TEMP_BASELINE = 12  # observations a GPU's own temperature mean is taken over (1 h at 5 min)
TEMP_HOT_C = 4.0  # a GPU this far above its own mean counts as "hot" in temp_hot_win


@dataclass(frozen=True)
class _Step:
    """One node observation reduced to the numbers the features need."""

    t: float
    sbe: float  # the largest single-bit increase of any GPU since the last observation
    xid: float  # XID events since the last observation, all GPUs
    xid_hw: float  # 1 when a GPU with a new XID shows a hardware code (HARDWARE_XIDS)
    temp_dev: float  # the largest (temperature - its GPU's recent mean), Celsius
    temps: dict[int, float]
    sbe_score: float
    temp_score: float


@dataclass
class _NodeState:
    sbe_detector: SeriesDetector
    last: NodeSample | None = None
    steps: deque[_Step] = field(default_factory=lambda: deque(maxlen=64))
    temp_hist: dict[int, deque[float]] = field(default_factory=dict)
    temp_detectors: dict[int, SeriesDetector] = field(default_factory=dict)


def _increase(now: float | None, before: float | None) -> float:
    """A counter's increase; a counter that went down was reset (a GPU reset zeroes volatile ECC)."""
    if now is None:
        return 0.0
    if before is None or now < before:
        return now if before is not None else 0.0
    return now - before


def node_features(steps: Sequence[_Step], window: int) -> list[float]:
    """:data:`FEATURES` of the last ``window`` steps (the last step is the current observation)."""
    win = list(steps)[-window:]
    now = win[-1]
    prev = win[:-1]
    prev_sbe = sum(s.sbe for s in prev) / len(prev) if prev else 0.0
    return [
        math.log1p(now.sbe),
        math.log1p(sum(s.sbe for s in win)),
        float(sum(1 for s in win if s.sbe > 0)),
        math.log1p(now.sbe) - math.log1p(prev_sbe),
        now.sbe_score,
        float(sum(s.xid for s in win)),
        float(sum(s.xid_hw for s in win)),
        now.temp_dev,
        sum(s.temp_dev for s in win) / len(win),
        float(sum(1 for s in win if s.temp_dev >= TEMP_HOT_C)),
        now.temp_score,
    ]


class FailureModel:
    """P(node fails within the horizon | features). ``seeds``: the drill runs it was trained on."""

    def __init__(self, classifier: HistGradientBoostingClassifier, seeds: Iterable[int]):
        self.classifier = classifier
        self.seeds = frozenset(seeds)

    def probabilities(self, rows: Sequence[Sequence[float]]) -> list[float]:
        """P(fails within the horizon) per row of :data:`FEATURES` values."""
        # One OpenMP thread: for a handful of rows, waking a thread per core for each of the
        # ensemble's trees costs far more than the prediction (measured 40x on 16 cores).
        with threadpool_limits(1, user_api="openmp"):
            probs = self.classifier.predict_proba(np.asarray(rows, dtype=float))[:, 1]
        return [float(p) for p in probs]


class Predictor:
    """Online findings for a cluster (see the module doc). ``model`` None: no failure prediction.
    Not thread-safe: one caller feeds it, observations of a subject in time order."""

    def __init__(self, config: AiopsConfig | None = None, model: FailureModel | None = None):
        self.config = config or load_config()
        self.model = model
        self._nodes: dict[str, _NodeState] = {}
        self._series: dict[tuple[str, str], SeriesDetector] = {}
        self._firing: set[tuple[str, str]] = set()
        self.last_features: dict[str, list[float]] = {}
        self.last_probability: dict[str, float] = {}

    # -- anomaly rules
    def _edge(self, rule: str, subject: str, fired: bool) -> bool:
        """True when ``rule`` starts firing for ``subject`` (a rising edge)."""
        key = (rule, subject)
        if not fired:
            self._firing.discard(key)
            return False
        if key in self._firing:
            return False
        self._firing.add(key)
        return True

    def _anomaly(self, rule_name: str, subject: str, kind: SubjectKind, t: float, v: Verdict, unit: str,
                 window_s: tuple[float, float], extra: dict[str, Any]) -> list[Finding]:
        rule: AnomalyRule = self.config.rules.anomaly(rule_name)
        if not rule.enabled or not self._edge(rule_name, subject, v.fired):
            return []
        evidence = {**extra, "value": round(v.value, 3), "windowMean": round(v.mean, 3), "unit": unit,
                    "window": {"from_s": window_s[0], "to_s": window_s[1], "observations": v.observations},
                    "thresholds": {"score_min": rule.score_min, "min_delta": rule.min_delta}}
        summary = (f"{rule_name} anomaly on {kind} {subject}: {v.value:.1f} {unit} vs a mean of {v.mean:.1f} "
                   f"over the last {v.observations} observations (score {v.score:.4f})")
        return [Finding(rule_name, subject, kind, t, v.score, summary, evidence)]

    def _series_detector(self, rule_name: str, subject: str, direction: str) -> SeriesDetector:
        key = (rule_name, subject)
        det = self._series.get(key)
        if det is None:
            det = SeriesDetector(self.config.rules.anomaly(rule_name), "low" if direction == "low" else "high")
            self._series[key] = det
        return det

    def observe_job(self, t: float, job: JobSample) -> list[Finding]:
        """A running job's utilisation; fires ``job-utilisation`` when it drops (a stalled job)."""
        if not self.config.rules.job_utilisation.enabled:
            return []
        v = self._series_detector("job-utilisation", job.job, "low").step(job.util_pct)
        span = self.config.rules.job_utilisation.window
        return self._anomaly("job-utilisation", job.job, "job", t, v, "%", (t - span, t),
                             {"node": job.node, "virtualCluster": job.virtual_cluster})

    def observe_vc(self, t: float, vc: str, delay_s: float) -> list[Finding]:
        """A VC's longest queueing delay; fires ``vc-queue-delay`` when it climbs."""
        if not self.config.rules.vc_queue_delay.enabled:
            return []
        v = self._series_detector("vc-queue-delay", vc, "high").step(delay_s)
        return self._anomaly("vc-queue-delay", vc, "vc", t, v, "s", (t, t), {"virtualCluster": vc})

    # -- nodes
    def observe(self, node: str, t: float, sample: NodeSample) -> list[Finding]:
        """One observation of ``node`` at ``t`` (seconds): its temperature and single-bit ECC
        findings, and a ``node-failure`` warning when the model's probability reaches the threshold."""
        findings = self._observe_node(node, t, sample)
        return findings + self._failures(t, [(node, sample)])

    def _observe_node(self, node: str, t: float, sample: NodeSample) -> list[Finding]:
        """The anomaly findings of one node observation; records its step and features."""
        cfg = self.config.rules
        st = self._nodes.get(node)
        if st is None:
            st = self._nodes[node] = _NodeState(SeriesDetector(cfg.ecc_sbe_rate))
        before = {g.index: g for g in st.last.gpus} if st.last is not None else {}
        sbe = {g.index: _increase(g.sbe_total, before[g.index].sbe_total if g.index in before else None)
               for g in sample.gpus}
        xid = {g.index: _increase(g.xid_events, before[g.index].xid_events if g.index in before else None)
               for g in sample.gpus}
        xid_hw = any(xid[g.index] > 0 and int(g.xid_last or 0) in HARDWARE_XIDS for g in sample.gpus)
        temps = {g.index: float(g.temp_c) for g in sample.gpus if g.temp_c is not None}
        findings: list[Finding] = []
        temp_dev, temp_score = 0.0, 0.0
        for gpu, temp in temps.items():
            hist = st.temp_hist.get(gpu)
            if hist is None:
                hist = st.temp_hist[gpu] = deque(maxlen=TEMP_BASELINE)
            dev = temp - sum(hist) / len(hist) if hist else 0.0
            hist.append(temp)
            det = st.temp_detectors.get(gpu)
            if det is None:
                det = st.temp_detectors[gpu] = SeriesDetector(cfg.gpu_temperature)
            v = det.step(temp)
            temp_dev = max(temp_dev, dev)
            temp_score = max(temp_score, v.score if v.value >= v.mean else 0.0)
            findings += self._anomaly("gpu-temperature", f"{node}/gpu{gpu}", "node", t, v, "C",
                                      (t - cfg.gpu_temperature.window, t), {"node": node, "gpu": gpu})
        sbe_max = max(sbe.values(), default=0.0)
        v = st.sbe_detector.step(sbe_max)
        sbe_score = v.score if v.value >= v.mean else 0.0
        findings += self._anomaly("ecc-sbe-rate", node, "node", t, v, "errors/observation",
                                  (t - cfg.ecc_sbe_rate.window, t),
                                  {"node": node, "gpu": max(sbe, key=lambda g: sbe[g]) if sbe else None})
        st.steps.append(_Step(t, sbe_max, sum(xid.values()), 1.0 if xid_hw else 0.0, temp_dev, temps,
                              sbe_score, temp_score))
        st.last = sample
        self.last_features[node] = node_features(st.steps, cfg.node_failure.window_intervals)
        return findings

    def _failures(self, t: float, observed: Sequence[tuple[str, NodeSample]]) -> list[Finding]:
        """``node-failure`` warnings for the nodes just observed: one model call for all of them
        (the model's per-call cost dwarfs its per-row cost)."""
        if not self.config.rules.node_failure.enabled or self.model is None or not observed:
            return []
        probs = self.model.probabilities([self.last_features[n] for n, _ in observed])
        out: list[Finding] = []
        for (node, sample), p in zip(observed, probs, strict=True):
            out += self._failure(node, t, self._nodes[node], self.last_features[node], sample, p)
        return out

    def _failure(self, node: str, t: float, st: _NodeState, feats: list[float], sample: NodeSample,
                 p: float) -> list[Finding]:
        rule = self.config.rules.node_failure
        self.last_probability[node] = p
        if not self._edge(FAILURE_RULE, node, p >= rule.probability_min):
            return []
        win = list(st.steps)[-rule.window_intervals:]
        evidence = {
            "node": node,
            "probability": round(p, 4),
            "horizon_s": rule.horizon_intervals * _interval(win),
            "features": {k: round(x, 4) for k, x in zip(FEATURES, feats, strict=True)},
            "window": {"from_s": win[0].t, "to_s": win[-1].t, "observations": len(win)},
            "series": {
                "t": [s.t for s in win],
                "sbeIncrease": [s.sbe for s in win],
                "xidEvents": [s.xid for s in win],
                "hottestGpuAboveMeanC": [round(s.temp_dev, 2) for s in win],
            },
            "gpus": [{"gpu": g.index, "tempC": g.temp_c, "eccSbeVolTotal": g.sbe_total, "xidLast": g.xid_last}
                     for g in sample.gpus],
            "thresholds": {"probability_min": rule.probability_min},
        }
        parts = [f"{int(sum(s.sbe for s in win))} single-bit ECC errors"] if any(s.sbe for s in win) else []
        if any(s.xid for s in win):
            parts.append(f"{int(sum(s.xid for s in win))} XIDs")
        if feats[FEATURES.index("temp_hot_win")]:
            parts.append(f"GPU up to {max(s.temp_dev for s in win):.0f} C above its mean")
        summary = (f"node {node} may fail within {rule.horizon_intervals} observations (p={p:.2f}): "
                   + (", ".join(parts) or "precursor pattern") + f" in the last {len(win)} observations")
        return [Finding(FAILURE_RULE, node, "node", t, p, summary, evidence)]

    def observe_frame(self, frame: Frame) -> list[Finding]:
        """Every node, job and VC of ``frame``."""
        out: list[Finding] = []
        for node, sample in frame.nodes.items():
            out += self._observe_node(node, frame.t, sample)
        out += self._failures(frame.t, list(frame.nodes.items()))
        for job in frame.jobs:
            out += self.observe_job(frame.t, job)
        for vc, delay in sorted(frame.vc_delay_s.items()):
            out += self.observe_vc(frame.t, vc, delay)
        return out


def _interval(steps: Sequence[_Step]) -> float:
    return steps[-1].t - steps[-2].t if len(steps) >= 2 else 0.0


def training_rows(run: DrillRun, config: AiopsConfig) -> tuple[list[list[float]], list[int]]:
    """Features and labels of every node observation of ``run`` before its node failed. Label 1:
    the node fails within ``horizon_intervals`` observations after it."""
    horizon_s = config.rules.node_failure.horizon_intervals * run.interval_s
    pred = Predictor(config, model=None)
    failures = run.failures
    x: list[list[float]] = []
    y: list[int] = []
    for frame in run.frames:
        pred.observe_frame(frame)
        for node in frame.nodes:
            fail = failures.get(node)
            if fail is not None and frame.t >= fail:
                continue  # the failure itself is visible: not a prediction
            x.append(pred.last_features[node])
            y.append(int(fail is not None and fail - frame.t <= horizon_s))
    return x, y


def train(runs: Sequence[DrillRun], config: AiopsConfig | None = None) -> FailureModel:
    """Fit the failure model on ``runs`` (training seeds only). Raises ValueError when the runs hold
    no failure to learn from."""
    cfg = config or load_config()
    x: list[list[float]] = []
    y: list[int] = []
    for run in runs:
        rx, ry = training_rows(run, cfg)
        x += rx
        y += ry
    if not any(y):
        raise ValueError("the training runs hold no node that fails: nothing to learn")
    clf = HistGradientBoostingClassifier(max_iter=100, learning_rate=0.1, max_leaf_nodes=15,
                                         l2_regularization=1.0, random_state=0)
    clf.fit(np.asarray(x, dtype=float), np.asarray(y, dtype=int))
    logger.info("failure model trained runs=%d rows=%d positives=%d", len(runs), len(y), sum(y))
    return FailureModel(clf, (r.seed for r in runs))
