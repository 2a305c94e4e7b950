"""The stress drill over simulated GPUs, from the fault to the verdict, without a platform.

A ``degraded`` fault on GPU 1 of hostname-dan reaches dan's node agent, which launches the
benchmark with the per-GPU slowdown in its environment (apiary.runtime.agent.node_task_env, as in production); the
benchmark's simulated path (examples/stress/bench.py) prints the figures it reports there; the
drill (against tests/drills/fakes.py's in-memory API) reads them back from the job logs and the
packaged rules judge them. The same on a real embedded platform: tests/drills/test_drills_e2e.py.
"""

from __future__ import annotations

import json

from tests.drills.benchmod import bench
from tests.drills.fake_gpulibs import importer
from tests.drills.fakes import T0, FakeApi, job, node
from tests.monitoring.fake_nvml import NVMLError_LibraryNotFound

from apiary.drills.diagnosis import load_rules
from apiary.drills.stress import run_stress
from apiary.runtime.agent import NodeAgent, node_task_env
from apiary.runtime.env import gpu_env

CAROL, DAN = "hostname-carol", "hostname-dan"
GPUS = [0, 1]
GPU_RULES = {"gpu-gemm-below-peers", "gpu-memory-below-peers", "gpu-pcie-below-peers", "gpu-gemm-floor",
             "gpu-memory-floor", "gpu-pcie-floor"}


class _Backend:
    """All the agent's task environment needs of a runtime: its name (no task is launched here)."""

    name = "process"
    runs_probes = False


class _NoNvml:
    def nvmlInit(self) -> None:
        raise NVMLError_LibraryNotFound()


class _Ticks:
    """Every clock reading 1 ms after the last; sleeping moves it on (the CPU figures' slowdown)."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        self.now += 0.001
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def bench_output(name: str, faults: list[dict]) -> str:
    """What the benchmark prints on node ``name`` (2 simulated GPUs) after ``faults``."""
    agent = NodeAgent(name, "http://unused", _Backend(), client=None, gpus=len(GPUS), simulated_gpus=True)
    agent._apply_faults(faults)
    env = {**node_task_env({"APIARY_SIMULATED_GPUS": "1"}, GPUS, agent.faults, agent.backend.name),
           **gpu_env(GPUS)}  # the process backend adds gpu_env
    args = bench.parse_args(["--matmul-n", "64", "--mem-mib", "1", "--trials", "2"])
    ticks = _Ticks()
    result = bench.run(args, env, nvml=_NoNvml(), import_module=importer(), clock=ticks.clock, sleep=ticks.sleep)
    return "warming up\n" + json.dumps(result)


def on_its_node(doc: dict) -> list[dict]:
    """Each job runs on the node of its SKU (GPU-C: carol, GPU-D: dan) and succeeds."""
    where = {"GPU-C": CAROL, "GPU-D": DAN}[doc["extras"]["hivedScheduler"]["taskRoles"]["bench"]["skuType"]]
    return [job(doc["id"], "SUCCEEDED", node=where, started=T0, completed=T0 + 1)]


def drill(logs: dict[str, str]) -> tuple[FakeApi, object]:
    nodes = [node(CAROL, "GPU-C", gpus=2), node(DAN, "GPU-D", gpus=2)]
    api = FakeApi(on_its_node, nodes=nodes, logs=logs)
    outcome = run_stress(api, load_rules(), image="python:3.11", sleep=lambda s: None)
    return api, outcome


def test_a_degraded_gpu_fails_its_node_by_the_gpu_rules_naming_the_gpu() -> None:
    logs = {CAROL: bench_output(CAROL, []), DAN: bench_output(DAN, [{"id": 1, "gpu": 1, "degraded": 5}])}
    api, outcome = drill(logs)
    by_node = {r["node"]: r for r in outcome.rows}
    assert {n: r["verdict"] for n, r in by_node.items()} == {CAROL: "passed", DAN: "FAILED"}, outcome.rows
    assert api.cordons == [(DAN, True)]
    assert all(s["taskRoles"]["bench"]["resourcePerInstance"]["gpu"] == 2 for s in api.submitted)  # whole nodes
    (report,) = api.reports
    failures = [(f["rule"], f["detail"]) for f in report["nodeFailures"] if f["node"] == DAN]
    gpu_failures = {(rule, detail.split("=")[0]) for rule, detail in failures if rule in GPU_RULES}
    # Every GPU rule fails on GPU 1's figures (a fifth of its peers' and of the reference), none on GPU 0's.
    assert {rule for rule, _ in gpu_failures} == GPU_RULES
    assert {metric for _, metric in gpu_failures} == {f"gpu1_{k}" for k in bench.SIMULATED_SKUS["H200"]}
    assert not [f for f in report["nodeFailures"] if f["node"] == CAROL]
    # The task-wide factor still slows the CPU figures, so the CPU rules agree.
    assert {"matmul-below-baseline", "memory-bandwidth-below-baseline"} <= {rule for rule, _ in failures}
    dan, carol = by_node[DAN], by_node[CAROL]
    assert dan["backend"] == carol["backend"] == "simulated"
    assert dan["gpuGemmTflopsMin"] < carol["gpuGemmTflopsMin"] / 4
    assert "gpu1 simulated slowdown x5" in dan["note"]
    assert len(outcome.plots) == 1  # the chart gains the slowest GPU's GEMM panel


def test_without_a_fault_every_simulated_gpu_passes() -> None:
    _, outcome = drill({CAROL: bench_output(CAROL, []), DAN: bench_output(DAN, [])})
    assert outcome.result == "passed", outcome.rows
    assert {r["node"]: r["failedRules"] for r in outcome.rows} == {CAROL: "", DAN: ""}
