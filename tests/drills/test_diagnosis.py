"""apiary.drills.diagnosis: SuperBench-style rules over per-node benchmark results (pure)."""

from __future__ import annotations

import random
import statistics

import pytest

from apiary.drills.diagnosis import (
    DEFAULT_RULES,
    NodeResult,
    _GpuPeers,
    diagnose,
    load_rules,
    parse_rules,
    split_gpu_metric,
)
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
                     "gpu-gemm-below-peers", "gpu-memory-below-peers", "gpu-pcie-below-peers", "gpu-gemm-floor",
                     "gpu-memory-floor", "gpu-pcie-floor", "benchmark-failed"]
    assert DEFAULT_RULES.name == "rules.yaml" and RULES.baselines == {} and RULES.min_peers == 1
    assert set(RULES.references) == {"simulated"}


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
    pytest.param({"rules": {"x": {"function": "reference", "criteria": {"below": -0.2}}}}, "rules.rules.x.metrics",
                 id="reference without metrics"),
    pytest.param({"rules": {"x": {"function": "failure_check"}}, "references": {"H200": {"h2d_gbps": -1}}},
                 "rules.references.H200.h2d_gbps", id="negative reference"),
    pytest.param({"rules": {"x": {"function": "failure_check"}}, "references": ["H200"]}, "rules.references",
                 id="references not a mapping"),
])
def test_bad_rules_name_the_field(doc: object, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_rules(doc)
    assert e.value.field == field


# ------------------------------------------------------------------------------ GPU figures

#: What a healthy simulated GPU reports (examples/stress/bench.py's model, the rules' reference).
HEALTHY = RULES.references["simulated"]
GPU_RULES = {"gpu-gemm-below-peers", "gpu-memory-below-peers", "gpu-pcie-below-peers", "gpu-gemm-floor",
             "gpu-memory-floor", "gpu-pcie-floor"}


def gpu_node(node: str, gpus: int = 4, *, slow: dict[int, float] | None = None, sku: str = "GPU-C",
             simulated: bool = True, scale: float = 1.0, cpu: bool = True) -> NodeResult:
    """A node's result with ``gpus`` GPUs at ``scale`` x the healthy figures, GPU g divided by
    ``slow[g]``; the CPU figures of :func:`result` unless not ``cpu``."""
    metrics = {"matmul_gflops": 40.0, "mem_bandwidth_gbps": 15.0} if cpu else {}
    for g in range(gpus):
        for figure, value in HEALTHY.items():
            metrics[f"gpu{g}_{figure}"] = value * scale / (slow or {}).get(g, 1.0)
    return NodeResult(node, sku, simulated, metrics=metrics)


def test_healthy_gpus_pass_every_gpu_rule() -> None:
    verdicts = diagnose([gpu_node("a"), gpu_node("b", scale=0.97), gpu_node("c", scale=1.02)], RULES)
    assert all(v.passed for v in verdicts) and not [s for v in verdicts for s in v.skipped if s[0] in GPU_RULES]


def test_one_slow_gpu_fails_its_node_naming_the_gpu_and_the_metric() -> None:
    a, b = diagnose([gpu_node("a"), gpu_node("b", slow={2: 3.0})], RULES)
    assert a.passed and not b.passed
    assert {f.rule for f in b.failures} == GPU_RULES  # every figure of GPU 2 is a third of its peers'
    assert {f.gpu for f in b.failures} == {2}
    (gemm,) = [f for f in b.failures if f.rule == "gpu-gemm-below-peers" and f.metric == "gpu2_gemm_bf16_tflops"]
    assert gemm.value == pytest.approx(HEALTHY["gemm_bf16_tflops"] / 3) and gemm.baseline == HEALTHY["gemm_bf16_tflops"]
    assert gemm.detail == "gpu2_gemm_bf16_tflops=247.3 is -67% from the baseline 742 (variance < -0.15)"
    (floor,) = [f for f in b.failures if f.rule == "gpu-gemm-floor" and f.metric == "gpu2_gemm_bf16_tflops"]
    assert floor.detail == "gpu2_gemm_bf16_tflops=247.3 is -67% from the simulated reference 742 (reference < -0.2)"


def test_a_single_node_s_slow_gpu_is_judged_against_its_own_other_gpus() -> None:
    (v,) = diagnose([gpu_node("lonely", gpus=8, slow={5: 1.3}, simulated=False, sku="H200")], RULES)
    # A real SKU without a reference in rules.yaml: the floors are skipped (and say so); the peers
    # (the node's other seven GPUs) catch the GPU at -23 %: GEMM and memory fail, PCIe's -25 % budget holds.
    assert {(f.rule, f.gpu) for f in v.failures} == {("gpu-gemm-below-peers", 5), ("gpu-memory-below-peers", 5)}
    assert ("gpu-gemm-floor", "gpu5_gemm_bf16_tflops") in v.skipped


def test_gpus_all_slow_alike_pass_the_peers_but_fail_the_floors() -> None:
    verdicts = diagnose([gpu_node("a", scale=0.5), gpu_node("b", scale=0.5)], RULES)
    assert [{f.rule for f in v.failures} for v in verdicts] == [{"gpu-gemm-floor", "gpu-memory-floor",
                                                                  "gpu-pcie-floor"}] * 2


def test_gpu_peers_are_the_same_sku_only() -> None:
    results = [gpu_node("c1", sku="GPU-C", simulated=False), gpu_node("c2", sku="GPU-C", simulated=False),
               gpu_node("d1", sku="GPU-D", simulated=False, scale=0.3)]  # a slower SKU, alone: no peers
    assert {v.node: v.passed for v in diagnose(results, RULES)} == {"c1": True, "c2": True, "d1": True}


def test_cpu_only_results_are_still_judged_by_the_cpu_rules_beside_gpu_nodes() -> None:
    results = [result("cpu-a", simulated=True), result("cpu-b", matmul=4.0, simulated=True),
               gpu_node("gpu-a"), gpu_node("gpu-b")]
    assert failed_rules(results) == {"cpu-a": set(), "cpu-b": {"matmul-below-baseline"}, "gpu-a": set(),
                                     "gpu-b": set()}


def test_a_fixed_baseline_may_name_the_figure_of_every_gpu() -> None:
    rules = parse_rules({"baselines": {"H200": {"gemm_bf16_tflops": 700.0}}, "rules": {
        "slow": {"function": "variance", "metrics": ["gpu[0-9]+_gemm_bf16_tflops"], "criteria": {"below": -0.1}}}})
    metrics = {"gpu0_gemm_bf16_tflops": 690.0, "gpu1_gemm_bf16_tflops": 600.0}
    (v,) = diagnose([NodeResult("n", "H200", metrics=metrics)], rules)
    assert [(f.gpu, f.baseline) for f in v.failures] == [(1, 700.0)]


@pytest.mark.parametrize(("metric", "expected"), [
    ("gpu0_gemm_bf16_tflops", (0, "gemm_bf16_tflops")), ("gpu12_temp_c", (12, "temp_c")),
    ("matmul_gflops", (None, "matmul_gflops")), ("gpux_temp_c", (None, "gpux_temp_c")),
])
def test_split_gpu_metric(metric: str, expected: tuple) -> None:
    assert split_gpu_metric(metric) == expected


@pytest.mark.parametrize("n", [2, 3, 4, 9, 10])
def test_the_leave_one_out_median_is_the_median_of_the_others(n: int) -> None:
    rng = random.Random(n)
    values = [float(rng.choice([1, 2, 2, 3, 5, 8])) for _ in range(n)]  # with repeats
    peers = _GpuPeers([NodeResult("n", "S", metrics={f"gpu{i}_x": v for i, v in enumerate(values)})])
    for i, v in enumerate(values):
        median, count = peers.median_without("S", "x", v)
        assert (median, count) == (statistics.median(values[:i] + values[i + 1:]), n - 1)
    assert _GpuPeers([NodeResult("n", "S", metrics={"gpu0_x": 1.0})]).median_without("S", "x", 1.0) == (None, 0)
