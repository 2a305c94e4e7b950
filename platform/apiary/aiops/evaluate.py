"""Honest evaluation of node-failure prediction: train on some drill runs, score on held-out ones.

Per node of each held-out run (the unit is a node, so one noisy node cannot count twice):

* a node that fails and was warned in the ``horizon_intervals`` observations before its failure is a
  true positive; its lead time is the failure's time minus the first such warning's;
* a node that fails with no warning in that span is a miss (the ``sudden`` failures always are);
* a node that never fails but was warned is a false positive, and so is a failing node warned only
  earlier than the horizon (the warning promised a failure that did not come in time).

precision = tp / (tp + fp), recall = tp / (tp + fn); ``lead_time_s`` is the median lead time of the
true positives. Warnings at or after the failure do not count: the node is gone.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from apiary.aiops.config import FAILURE_RULE, AiopsConfig, load_config
from apiary.aiops.drill_runs import DRILL_INTERVAL_S, DrillRun, ScenarioConfig, generate_run
from apiary.aiops.predictor import FailureModel, Predictor, train
from apiary.errors import ValidationError


def _runs(seeds: Sequence[int], scenario: ScenarioConfig | None, workers: int) -> list[DrillRun]:
    if workers <= 1 or len(seeds) <= 1:
        return [generate_run(s, scenario) for s in seeds]
    with ProcessPoolExecutor(max_workers=min(workers, len(seeds))) as pool:
        return list(pool.map(generate_run, seeds, [scenario] * len(seeds)))


def check_separate(train_seeds: Iterable[int], test_seeds: Iterable[int]) -> None:
    """Raises ValidationError (field ``test_seeds``) when a test seed is also a training seed, or
    either set is empty."""
    tr, te = set(train_seeds), set(test_seeds)
    if not tr:
        raise ValidationError("train_seeds", "at least one training run is needed")
    if not te:
        raise ValidationError("test_seeds", "at least one held-out run is needed")
    if tr & te:
        raise ValidationError("test_seeds", f"seeds {sorted(tr & te)} are training seeds too: held-out runs "
                                            "must be unseen")


def score_runs(model: FailureModel, runs: Sequence[DrillRun], config: AiopsConfig) -> dict[str, Any]:
    """Precision, recall and lead times of ``model`` on ``runs`` (none of them a training run:
    ValidationError otherwise). Also counts the anomaly findings per rule."""
    check_separate(model.seeds, [r.seed for r in runs])
    horizon = config.rules.node_failure.horizon_intervals
    tp = fp = fn = 0
    leads: list[float] = []
    missed: dict[str, int] = {"sudden": 0, "degrading": 0}
    anomalies: dict[str, int] = {}
    nodes = 0
    for run in runs:
        pred = Predictor(config, model)
        warned: dict[str, list[float]] = {}
        for frame in run.frames:
            for f in pred.observe_frame(frame):
                if f.rule == FAILURE_RULE:
                    warned.setdefault(f.subject, []).append(f.t)
                else:
                    anomalies[f.rule] = anomalies.get(f.rule, 0) + 1
        for node, fate in run.fates.items():
            nodes += 1
            times = warned.get(node, [])
            if fate.fail_s is None:
                fp += 1 if times else 0
                continue
            in_span = [t for t in times if fate.fail_s - horizon * run.interval_s <= t < fate.fail_s]
            early = [t for t in times if t < fate.fail_s - horizon * run.interval_s]
            fp += 1 if early else 0
            if in_span:
                tp += 1
                leads.append(fate.fail_s - min(in_span))
            else:
                fn += 1
                missed[fate.fate] = missed.get(fate.fate, 0) + 1
    interval = runs[0].interval_s if runs else DRILL_INTERVAL_S
    lead = statistics.median(leads) if leads else 0.0
    return {
        "precision": round(tp / (tp + fp), 4) if tp + fp else 0.0,
        "recall": round(tp / (tp + fn), 4) if tp + fn else 0.0,
        # recall over the failures that had precursors (the sudden ones excluded): the model's own share
        "recall_with_precursors": round(tp / (tp + missed.get("degrading", 0)), 4) if tp else 0.0,
        "lead_time_s": lead,
        "lead_time_intervals": round(lead / interval, 2),
        "lead_time_min_s": min(leads) if leads else 0.0,
        "lead_time_p90_s": round(statistics.quantiles(leads, n=10)[-1], 1) if len(leads) >= 2 else lead,
        "tp": tp, "fp": fp, "fn": fn,
        "fn_sudden": missed.get("sudden", 0), "fn_degrading": missed.get("degrading", 0),
        "failures": tp + fn, "nodes": nodes, "runs": len(runs),
        "anomaly_findings": dict(sorted(anomalies.items())),
    }


def evaluate(train_seeds: Sequence[int], test_seeds: Sequence[int], *, scenario: ScenarioConfig | None = None,
             config: AiopsConfig | None = None, workers: int = 1) -> dict[str, Any]:
    """Generate the training runs, train, generate the held-out runs, score (see the module doc).

    Returns ``{"precision", "recall", "recall_with_precursors", "lead_time_s" (median),
    "lead_time_intervals", "lead_time_min_s", "lead_time_p90_s", "tp", "fp", "fn", "fn_sudden",
    "fn_degrading", "failures", "nodes", "runs", "anomaly_findings", "drill_interval_s",
    "horizon_intervals", "train_seeds", "test_seeds" (each [min, max, count]), "train_failures"}``.
    ``workers`` > 1 generates runs in that many processes (same runs: each is a
    function of its seed). Raises ValidationError when the seed sets overlap or one is empty."""
    check_separate(train_seeds, test_seeds)
    cfg = config or load_config()
    train_runs = _runs(list(train_seeds), scenario, workers)
    model = train(train_runs, cfg)
    result = score_runs(model, _runs(list(test_seeds), scenario, workers), cfg)
    result.update({
        "drill_interval_s": DRILL_INTERVAL_S,
        "horizon_intervals": cfg.rules.node_failure.horizon_intervals,
        "train_seeds": [min(train_seeds), max(train_seeds), len(train_seeds)],
        "test_seeds": [min(test_seeds), max(test_seeds), len(test_seeds)],
        "train_failures": sum(len(r.failures) for r in train_runs),
    })
    return result
