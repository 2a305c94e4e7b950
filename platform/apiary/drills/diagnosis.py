"""The stress drill's diagnosis: benchmark results per node + rules (``rules.yaml``) -> verdicts.

Pure: no I/O but :func:`load_rules` reading the file it is given, no clock. The rule format is
SuperBench's data diagnosis with declarative criteria; ``rules.yaml`` beside this module documents
it and is the default.

Per-GPU metrics (``gpu<i>_<figure>``, examples/stress/bench.py) are judged per GPU: a variance
rule compares a GPU with the other GPUs of its group in the same run (on its node and on the
others), and a ``reference`` rule with its group's reference figure for ``<figure>``. So one slow
GPU fails its node, and the failure names the GPU (:attr:`RuleFailure.gpu`) and the metric.
"""

from __future__ import annotations

import bisect
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from apiary.errors import ValidationError
from apiary.spec.safeyaml import load as safe_load_yaml

DEFAULT_RULES = Path(__file__).with_name("rules.yaml")
FUNCTIONS = ("variance", "value", "reference", "failure_check")
#: The baseline group of nodes with simulated GPUs: they all run on the simulation's machine.
SIMULATED_GROUP = "simulated"

Function = Literal["variance", "value", "reference", "failure_check"]
#: A per-GPU metric: ``gpu<index>_<figure>`` (the benchmark's GPU figures and NVML readings).
GPU_METRIC = re.compile(r"gpu([0-9]+)_(.+)")


def split_gpu_metric(metric: str) -> tuple[int | None, str]:
    """``("gpu3_gemm_bf16_tflops")`` -> ``(3, "gemm_bf16_tflops")``; a node metric -> ``(None, metric)``."""
    m = GPU_METRIC.fullmatch(metric)
    return (int(m.group(1)), m.group(2)) if m else (None, metric)


@dataclass(frozen=True)
class NodeResult:
    """One node's benchmark result. ``ok`` False: no usable result (``error`` says why)."""

    node: str
    sku: str
    simulated: bool = False
    ok: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""

    @property
    def group(self) -> str:
        """The baseline group: the SKU, or ``simulated`` for simulated nodes (one machine)."""
        return SIMULATED_GROUP if self.simulated else self.sku


@dataclass(frozen=True)
class Rule:
    name: str
    function: Function
    metrics: tuple[re.Pattern[str], ...] = ()
    below: float | None = None
    above: float | None = None
    categories: str = ""

    def matches(self, metric: str) -> bool:
        return any(p.fullmatch(metric) for p in self.metrics)

    def violated(self, x: float) -> bool:
        return (self.below is not None and x < self.below) or (self.above is not None and x > self.above)

    def criteria(self) -> str:
        parts = ([f"< {self.below:g}"] if self.below is not None else []) + (
            [f"> {self.above:g}"] if self.above is not None else [])
        return " or ".join(parts)


@dataclass(frozen=True)
class Rules:
    rules: tuple[Rule, ...]
    #: group -> metric (or a per-GPU metric's ``<figure>``) -> fixed baseline of variance rules.
    baselines: dict[str, dict[str, float]] = field(default_factory=dict)
    #: group -> ``<figure>`` -> what a healthy GPU of the group reaches (``reference`` rules).
    references: dict[str, dict[str, float]] = field(default_factory=dict)
    min_peers: int = 1


@dataclass(frozen=True)
class RuleFailure:
    """``rule`` failed on ``metric`` (empty for failure_check) with ``value`` against ``baseline``
    (the peers' median, a fixed baseline or the reference; None for value rules); ``gpu``: the
    GPU index of a per-GPU metric."""

    rule: str
    metric: str
    value: float | None
    baseline: float | None
    detail: str
    gpu: int | None = None


@dataclass(frozen=True)
class NodeVerdict:
    node: str
    sku: str
    failures: tuple[RuleFailure, ...] = ()
    #: (rule, metric) pairs skipped for want of a baseline (too few peers, none configured).
    skipped: tuple[tuple[str, str], ...] = ()
    #: It failed a first run and passed its confirmation run (the stress drill's ``confirm``).
    confirmed_ok: bool = False

    @property
    def passed(self) -> bool:
        return not self.failures


def parse_rules(data: Any, source: str = "rules") -> Rules:
    """Rules from the parsed YAML (the shape of ``rules.yaml``). Raises ValidationError naming the
    field for anything malformed (an unknown function, a bad regex, a criteria without a bound)."""
    if not isinstance(data, dict):
        raise ValidationError(source, "must be a mapping with 'rules'")
    raw_rules = data.get("rules")
    if not isinstance(raw_rules, dict) or not raw_rules:
        raise ValidationError(f"{source}.rules", "must be a non-empty mapping of rule name to rule")
    rules = []
    for name, r in raw_rules.items():
        where = f"{source}.rules.{name}"
        if not isinstance(r, dict):
            raise ValidationError(where, "must be a mapping")
        fn = r.get("function")
        if fn not in FUNCTIONS:
            raise ValidationError(f"{where}.function", f"must be one of {', '.join(FUNCTIONS)}, not {fn!r}")
        criteria = r.get("criteria") or {}
        if not isinstance(criteria, dict) or set(criteria) - {"below", "above"}:
            raise ValidationError(f"{where}.criteria", "must be a mapping with 'below' and/or 'above'")
        bounds: dict[str, float | None] = {}
        for key in ("below", "above"):
            value = criteria.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ValidationError(f"{where}.criteria.{key}", f"must be a number, not {value!r}")
            bounds[key] = None if value is None else float(value)
        patterns: list[re.Pattern[str]] = []
        metrics = r.get("metrics") or []
        if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
            raise ValidationError(f"{where}.metrics", "must be a list of metric name patterns")
        for i, m in enumerate(metrics):
            try:
                patterns.append(re.compile(m))
            except re.error as e:
                raise ValidationError(f"{where}.metrics[{i}]", f"not a regular expression: {e}") from e
        if fn != "failure_check":  # variance, value, reference
            if not patterns:
                raise ValidationError(f"{where}.metrics", f"a {fn} rule needs metrics")
            if bounds["below"] is None and bounds["above"] is None:
                raise ValidationError(f"{where}.criteria", f"a {fn} rule needs 'below' or 'above'")
        rules.append(Rule(name=str(name), function=fn, metrics=tuple(patterns), below=bounds["below"],
                          above=bounds["above"], categories=str(r.get("categories") or "")))
    min_peers = data.get("min_peers", 1)
    if isinstance(min_peers, bool) or not isinstance(min_peers, int) or min_peers < 1:
        raise ValidationError(f"{source}.min_peers", "must be an integer >= 1")
    return Rules(rules=tuple(rules), baselines=_figures(data, "baselines", source),
                 references=_figures(data, "references", source), min_peers=min_peers)


def _figures(data: dict, key: str, source: str) -> dict[str, dict[str, float]]:
    """``data[key]``: group -> metric -> a positive number (baselines, references)."""
    raw = data.get(key) or {}
    if not isinstance(raw, dict):
        raise ValidationError(f"{source}.{key}", "must be a mapping of group to {metric: value}")
    parsed: dict[str, dict[str, float]] = {}
    for group, values in raw.items():
        if not isinstance(values, dict):
            raise ValidationError(f"{source}.{key}.{group}", "must be a mapping of metric to value")
        for metric, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValidationError(f"{source}.{key}.{group}.{metric}", "must be a positive number")
        parsed[str(group)] = {str(k): float(v) for k, v in values.items()}
    return parsed


def load_rules(path: Path | str | None = None) -> Rules:
    """The rules in ``path`` (default: the packaged ``rules.yaml``)."""
    p = Path(path) if path is not None else DEFAULT_RULES
    return parse_rules(safe_load_yaml(p.read_text(), field="rules"), source=p.name)


class _GpuPeers:
    """The per-GPU figures of each group in one run, sorted, so that a GPU's leave-one-out median
    costs O(log n): a run over thousands of GPUs stays linear-ish, not quadratic."""

    def __init__(self, results: list[NodeResult]) -> None:
        self._values: dict[tuple[str, str], list[float]] = {}
        for r in results:
            if not r.ok:  # a failed node is nobody's baseline
                continue
            for metric, value in r.metrics.items():
                gpu, figure = split_gpu_metric(metric)
                if gpu is not None:
                    self._values.setdefault((r.group, figure), []).append(value)
        for values in self._values.values():
            values.sort()

    def median_without(self, group: str, figure: str, value: float) -> tuple[float | None, int]:
        """(median, count) of the group's ``figure`` values without one occurrence of ``value`` (the
        GPU's own, which is among them); (None, 0) when it has no peer."""
        values = self._values.get((group, figure), [])
        n = len(values) - 1
        if n < 1:
            return None, 0
        own = bisect.bisect_left(values, value)

        def at(k: int) -> float:  # the k-th value of the list without values[own]
            return values[k] if k < own else values[k + 1]

        mid = n // 2
        return (at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2.0), n


def _baseline(rules: Rules, result: NodeResult, metric: str, results: list[NodeResult],
              gpu_peers: _GpuPeers) -> float | None:
    """A variance rule's baseline: the group's fixed one (by metric, or a per-GPU metric's
    ``<figure>``), else the median of the peers (None with fewer than ``min_peers``). A node
    metric's peers are the other nodes of the group; a per-GPU metric's are the group's other GPUs,
    on this node or another."""
    gpu, figure = split_gpu_metric(metric)
    fixed = rules.baselines.get(result.group, {})
    if metric in fixed or figure in fixed:
        return fixed.get(metric, fixed.get(figure))
    if gpu is not None:
        median, count = gpu_peers.median_without(result.group, figure, result.metrics[metric])
        return median if count >= rules.min_peers else None
    peers = [r.metrics[metric] for r in results
             if r.ok and r.node != result.node and r.group == result.group and metric in r.metrics]
    if len(peers) < rules.min_peers:
        return None
    return float(statistics.median(peers))


def diagnose(results: list[NodeResult], rules: Rules) -> list[NodeVerdict]:
    """One verdict per result, in the results' order. A node fails when any rule fails on it."""
    verdicts = []
    gpu_peers = _GpuPeers(results)
    for res in results:
        failures: list[RuleFailure] = []
        skipped: list[tuple[str, str]] = []
        for rule in rules.rules:
            if rule.function == "failure_check":
                if not res.ok:
                    failures.append(RuleFailure(rule.name, "", None, None, res.error or "no benchmark result"))
                continue
            if not res.ok:
                continue
            for metric, value in sorted(res.metrics.items()):
                if not rule.matches(metric):
                    continue
                gpu, figure = split_gpu_metric(metric)
                if rule.function == "value":
                    if rule.violated(value):
                        failures.append(RuleFailure(rule.name, metric, value, None,
                                                    f"{metric}={value:.4g} ({rule.criteria()})", gpu))
                    continue
                if rule.function == "reference":
                    base = rules.references.get(res.group, {}).get(figure)
                    what = f"the {res.group} reference"
                else:
                    base = _baseline(rules, res, metric, results, gpu_peers)
                    what = "the baseline"
                if base is None or base <= 0:
                    skipped.append((rule.name, metric))
                    continue
                variance = (value - base) / base
                if rule.violated(variance):
                    failures.append(RuleFailure(
                        rule.name, metric, value, base,
                        f"{metric}={value:.4g} is {variance:+.0%} from {what} {base:.4g} "
                        f"({rule.function} {rule.criteria()})", gpu))
        verdicts.append(NodeVerdict(res.node, res.sku, tuple(failures), tuple(skipped)))
    return verdicts
