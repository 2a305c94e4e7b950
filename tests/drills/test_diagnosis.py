"""apiary.drills.diagnosis: SuperBench-style rules over per-node benchmark results (pure)."""

from __future__ import annotations

import pytest

from apiary.drills.diagnosis import DEFAULT_RULES, NodeResult, diagnose, load_rules, parse_rules
from apiary.errors import ValidationError

RULES = load_rules()


def result(node: str, matmul: float | None = 40.0, membw: float | None = 15.0, *, sku: str = "GPU-C",
           simulated: bool = False, **extra: float) -> NodeResult:
    metrics = {k: v for k, v in {"matmul_gflops": matmul, "mem_bandwidth_gbps": membw}.items() if v is not None}
    return NodeResult(node, sku, simulated, metrics={**metrics, **extra})


def failed_rules(results: list[NodeResult], rules=RULES) -> dict[str, set[str]]:
    return {v.node: {f.rule for f in v.failures} for v in diagnose(results, rules)}


def test_the_packaged_rules_load() -> None:
    names = [r.name for r in RULES.rules]
    assert names == ["matmul-below-baseline", "memory-bandwidth-below-baseline", "matmul-floor", "gpu-too-hot",
                     "benchmark-failed"]
    assert DEFAULT_RULES.name == "rules.yaml" and RULES.baselines == {} and RULES.min_peers == 1


@pytest.mark.parametrize(("results", "expected"), [
    pytest.param([result("a"), result("b"), result("c")], {"a": set(), "b": set(), "c": set()},
                 id="three equal nodes pass"),
    pytest.param([result("a"), result("b"), result("c", matmul=10.0)],
                 {"a": set(), "b": set(), "c": {"matmul-below-baseline"}},
                 id="a node at a quarter of its peers' matmul fails the variance rule"),
    pytest.param([result("a"), result("b", matmul=30.0, membw=9.0)], {"a": set(), "b": set()},
                 id="25 and 40 percent below stay within the 50 percent budget"),
    pytest.param([result("a"), result("b", matmul=4.0, membw=1.5)],
                 {"a": set(), "b": {"matmul-below-baseline", "memory-bandwidth-below-baseline"}},
                 id="two nodes: leave-one-out flags only the slow one"),
    pytest.param([result("a", sku="GPU-C"), result("b", matmul=4.0, sku="GPU-D")], {"a": set(), "b": set()},
                 id="real nodes of different SKUs are not compared"),
    pytest.param([result("a", sku="GPU-C", simulated=True), result("b", matmul=4.0, sku="GPU-D", simulated=True)],
                 {"a": set(), "b": {"matmul-below-baseline"}},
                 id="simulated nodes share one machine: one group whatever their SKU"),
    pytest.param([result("a", matmul=0.01)], {"a": {"matmul-floor"}}, id="value floor without peers"),
    pytest.param([result("a", gpu0_temp_c=95.0, gpu1_temp_c=60.0)], {"a": {"gpu-too-hot"}},
                 id="value ceiling on a regex of metrics"),
    pytest.param([NodeResult("a", "GPU-C", ok=False, error="job FAILED (exit code 1)"), result("b")],
                 {"a": {"benchmark-failed"}, "b": set()}, id="failure_check: no result"),
])
def test_verdicts(results: list[NodeResult], expected: dict[str, set[str]]) -> None:
    assert failed_rules(results) == expected


def test_a_fixed_baseline_beats_the_peers_and_details_say_why() -> None:
    rules = parse_rules({"baselines": {"GPU-C": {"matmul_gflops": 100.0}}, "rules": {
        "slow": {"function": "variance", "metrics": ["matmul_gflops"], "criteria": {"below": -0.5}}}})
    (v,) = diagnose([result("a", matmul=40.0)], rules)
    (f,) = v.failures
    assert (f.rule, f.metric, f.value, f.baseline) == ("slow", "matmul_gflops", 40.0, 100.0)
    assert f.detail == "matmul_gflops=40 is -60% from the baseline 100 (variance < -0.5)"


def test_a_variance_rule_without_a_baseline_is_skipped_and_said_so() -> None:
    (v,) = diagnose([result("lonely")], RULES)
    assert v.passed and ("matmul-below-baseline", "matmul_gflops") in v.skipped


def test_failed_peers_are_not_baselines() -> None:
    results = [result("a", matmul=4.0), NodeResult("b", "GPU-C", ok=False, error="lost")]
    assert failed_rules(results) == {"a": set(), "b": {"benchmark-failed"}}


@pytest.mark.parametrize(("doc", "field"), [
    pytest.param([], "rules", id="not a mapping"),
    pytest.param({"rules": {}}, "rules.rules", id="no rules"),
    pytest.param({"rules": {"x": {"function": "lambda"}}}, "rules.rules.x.function", id="unknown function"),
    pytest.param({"rules": {"x": {"function": "value", "metrics": ["m"], "criteria": {"below": "1"}}}},
                 "rules.rules.x.criteria.below", id="criteria not a number"),
    pytest.param({"rules": {"x": {"function": "value", "metrics": ["m"], "criteria": {"lambda": 1}}}},
                 "rules.rules.x.criteria", id="criteria key"),
    pytest.param({"rules": {"x": {"function": "value", "metrics": ["("], "criteria": {"below": 1}}}},
                 "rules.rules.x.metrics[0]", id="bad regex"),
    pytest.param({"rules": {"x": {"function": "variance", "criteria": {"below": 1}}}}, "rules.rules.x.metrics",
                 id="variance without metrics"),
    pytest.param({"rules": {"x": {"function": "value", "metrics": ["m"]}}}, "rules.rules.x.criteria",
                 id="value without a bound"),
    pytest.param({"rules": {"x": {"function": "failure_check"}}, "baselines": {"C": {"m": 0}}},
                 "rules.baselines.C.m", id="zero baseline"),
    pytest.param({"rules": {"x": {"function": "failure_check"}}, "min_peers": 0}, "rules.min_peers",
                 id="min_peers"),
])
def test_bad_rules_name_the_field(doc: object, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_rules(doc)
    assert e.value.field == field
