"""The stress drill: a hardware-validation job on every node, diagnosed by rules (AI-System 7.6.3.3).

1. **One job per node.** Apiary (like HiveD) has no node selector, so each job asks for a whole
   node: as many GPUs as the node has, of its SKU (``skuType``). N such jobs for the N schedulable
   nodes of a SKU land on N different nodes while they are idle; the node each ran on is read back
   from the job. A node that is busy, cordoned or unhealthy is not tested this time (the report
   lists it), and two jobs may meet on one node when one finished before another was placed.
   The jobs are opportunistic (``oppo``): they take idle GPUs only and are preempted first, so the
   drill never delays a guaranteed job.
2. **The benchmark** is ``examples/stress/bench.py`` (the job's command, from the task's working
   directory like Lab 6's jobs): matmul throughput and memory bandwidth with NumPy; per GPU, when
   the job's image has PyTorch or CuPy, bf16/fp32 GEMM TFLOP/s, device-memory and host<->device
   copy bandwidth (simulated GPUs report a modelled H200's figures); NVML readings when there is a
   driver. It prints one JSON line, read back from the job's log.
3. **Diagnosis** (:mod:`apiary.drills.diagnosis`, rules in ``rules.yaml``): per-node verdicts from
   variance against a per-SKU baseline (per GPU: against the SKU's other GPUs in the run), value
   thresholds, floors against the SKU's reference figures, and failure checks. A node that fails is
   tested again (a second wave over its group) and fails only when it fails twice: a benchmark
   disturbed once by other work on its machine is not a broken node.
4. **Action**: each failed node is reported (``apiary_drill_node_failed{node,rule}``, alert
   ``ApiaryDrillNodeFailed``) and cordoned unless ``cordon=False`` (``APIARY_DRILL_STRESS_CORDON``),
   with the cordon source :data:`CORDON_SOURCE` and the failed rules as its reason, so an admin's
   or an incident's uncordon leaves it. Un-cordoning after a repair is the operator's:
   ``apiary node uncordon <node> --source drill:stress`` (or ``--all``).

Simulated clusters: a ``degraded`` fault (``POST /api/v2/nodes/{node}/faults {"gpu": 0,
"degraded": 3}``) makes the node's agent set ``APIARY_SIMULATED_SLOWDOWN=3`` and
``APIARY_SIMULATED_SLOWDOWN_GPUS=0:3`` for tasks on that GPU: the benchmark's CPU figures run that
much slower and GPU 0's simulated figures are divided by 3, so the diagnosis can be tried end to end.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from apiary.drills.common import DrillApi, DrillOutcome, drill_job, record, unique_suffix
from apiary.drills.diagnosis import NodeResult, NodeVerdict, Rules, diagnose, split_gpu_metric
from apiary.errors import ApiaryError

logger = logging.getLogger(__name__)

STRESS_PREFIX = "apiary-stress"
BENCH_COMMAND = "python3 examples/stress/bench.py"
FINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def parse_bench_output(text: str) -> dict[str, Any] | None:
    """The last JSON line of the benchmark's stdout (``{"apiary_bench": 1, ...}``), or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("apiary_bench"):
                return doc
    return None


@dataclass
class NodeRun:
    """One node's part of the drill: the job, where it ran, what the benchmark said."""

    node: str
    sku: str
    simulated: bool
    job_id: str | None = None
    state: str = "untested"
    ran_on: str | None = None
    bench: dict[str, Any] | None = None
    error: str = ""


@dataclass
class StressReport:
    verdicts: list[NodeVerdict] = field(default_factory=list)
    runs: list[NodeRun] = field(default_factory=list)
    untested: dict[str, str] = field(default_factory=dict)  # node -> why
    cordoned: list[str] = field(default_factory=list)
    cordon_errors: dict[str, str] = field(default_factory=dict)

    @property
    def failed_nodes(self) -> list[str]:
        return [v.node for v in self.verdicts if not v.passed]


#: The source of the stress drill's cordons (:data:`apiary.control.nodes.CORDON_SOURCE`).
CORDON_SOURCE = "drill:stress"


def cordon_reason(verdict: NodeVerdict) -> str:
    """Why the drill cordons ``verdict``'s node: ``stress drill failed: <rule>: <detail>; ...``
    (at most 500 characters, the API's limit)."""
    failures = "; ".join(f"{f.rule}: {f.detail}" if f.detail else f.rule for f in verdict.failures)
    return f"stress drill failed: {failures or 'no benchmark result'}"[:500]


def _result_of(run: NodeRun) -> NodeResult:
    node = run.ran_on or run.node
    if run.state != "SUCCEEDED" and run.bench is None:
        return NodeResult(node, run.sku, run.simulated, ok=False, error=run.error or f"job {run.state}")
    if run.bench is None:
        return NodeResult(node, run.sku, run.simulated, ok=False, error="no benchmark result line in the job's log")
    if not run.bench.get("ok"):
        return NodeResult(node, run.sku, run.simulated, ok=False, error=str(run.bench.get("error") or "ok=false"))
    metrics = {k: float(v) for k, v in (run.bench.get("metrics") or {}).items() if isinstance(v, int | float)}
    return NodeResult(node, run.sku, run.simulated, ok=True, metrics=metrics)


class _Wave:
    """One round of benchmark jobs (one per target node) and what came of them."""

    def __init__(self, api: DrillApi, *, image: str, command: str, poll_s: float,
                 clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
        self.api, self.image, self.command, self.poll_s = api, image, command, poll_s
        self.clock, self.sleep = clock, sleep

    def run(self, targets: list[dict], name: str, deadline: float) -> tuple[list[NodeRun], list[NodeResult],
                                                                          dict[str, str]]:
        """Submit one job per target, follow them until final or ``deadline`` (then stop them);
        returns (runs, one result per node that ran one, untested node -> why)."""
        api = self.api
        vc_of_any = next(iter(sorted(api.cluster_status().get("virtualClusters", {}))), "default")
        runs: list[NodeRun] = []
        for i, n in enumerate(targets):
            run = NodeRun(n["name"], n["skuType"], bool(n.get("simulatedGpus")))
            text = drill_job(f"{name}-{i}", vc_of_any, image=self.image, commands=[self.command],
                             gpu=int(n["gpus"]), sku=n["skuType"], role="bench")
            try:
                run.job_id = api.submit_job(text)["id"]
                run.state = "WAITING"
            except ApiaryError as e:
                run.error = f"submission refused: {e.message}"
            runs.append(run)
        while True:
            for r in [r for r in runs if r.job_id and r.state not in FINAL]:
                self._poll(r)
            if not [r for r in runs if r.job_id and r.state not in FINAL]:
                break
            if self.clock() >= deadline:
                for r in runs:
                    if r.job_id and r.state not in FINAL:
                        try:
                            api.stop(r.job_id)
                        except ApiaryError as e:
                            logger.warning("stress job=%s not stopped: %s", r.job_id, e.message)
                        r.error = f"not finished in time ({r.state})"
                        r.state = "untested"
                break
            self.sleep(self.poll_s)
        results: list[NodeResult] = []
        untested: dict[str, str] = {}
        seen: set[str] = set()
        for r in runs:
            if r.state == "untested" or (r.state == "STOPPED" and r.bench is None) or r.job_id is None:
                untested.setdefault(r.ran_on or r.node, r.error or "not run")
                continue
            res = _result_of(r)
            if res.node in seen:  # a second job on a node tested already (module doc): the first counts
                continue
            seen.add(res.node)
            results.append(res)
        for n in targets:
            if n["name"] not in seen:
                untested.setdefault(n["name"], "no benchmark job ran there (busy, or another node took its job)")
        return runs, results, {n: why for n, why in untested.items() if n not in seen}

    def _poll(self, r: NodeRun) -> None:
        try:
            job = self.api.get(r.job_id or "")
        except ApiaryError as e:
            logger.warning("stress job=%s unreadable: %s", r.job_id, e.message)
            return
        r.state = job["state"]
        r.ran_on = next((t["node"] for t in job.get("tasks") or [] if t.get("node")), r.ran_on)
        if r.state in FINAL:
            try:
                r.bench = parse_bench_output(self.api.logs(r.job_id or "", task_role="bench"))
            except ApiaryError as e:
                r.error = f"log unreadable: {e.message}"
            if r.state != "SUCCEEDED":
                r.error = r.error or f"job {r.state} (exit code {job.get('exitCode')})"


def stress(api: DrillApi, rules: Rules, *, image: str, timeout_s: float = 900.0, cordon: bool = True,
           nodes: list[str] | None = None, command: str = BENCH_COMMAND, poll_s: float = 1.0,
           max_cordon_fraction: float = 0.5, confirm: bool = True,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> StressReport:
    """Run the benchmark on every schedulable node with GPUs (or ``nodes``), diagnose, cordon the
    failed nodes when ``cordon`` (none when more than ``max_cordon_fraction`` of the tested nodes
    failed: see the code). Jobs still unfinished after ``timeout_s`` are stopped (their nodes
    untested). Raises an :mod:`apiary.errors` error only when the node list cannot be read.

    ``confirm``: a node that fails is tested again before it counts, in a second wave of the jobs
    of its group (its SKU's nodes, or every simulated node: the jobs cannot name a node, and a wave
    of whole-node jobs covers the group); it fails only when it fails both. A benchmark disturbed
    once by other work on the machine (simulated nodes share one) is not a broken node."""
    report = StressReport()
    wanted = set(nodes) if nodes else None
    targets: list[dict] = []
    for n in api.nodes():
        if wanted is not None and n["name"] not in wanted:
            continue
        if not n.get("schedulable"):
            report.untested[n["name"]] = "cordoned" if n.get("cordoned") else "not ready"
        elif not n.get("gpus"):
            report.untested[n["name"]] = "no GPUs"
        else:
            targets.append(n)
    deadline = clock() + timeout_s
    wave = _Wave(api, image=image, command=command, poll_s=poll_s, clock=clock, sleep=sleep)
    name = f"{STRESS_PREFIX}-{unique_suffix()}"
    report.runs, results, untested = wave.run(targets, name, deadline)
    report.untested.update(untested)
    report.verdicts = diagnose(results, rules)
    suspects = {v.node for v in report.verdicts if not v.passed}
    if confirm and suspects:
        groups = {r.group for r in results if r.node in suspects}
        again = [n for n in targets if ("simulated" if n.get("simulatedGpus") else n["skuType"]) in groups]
        logger.info("stress: confirming suspects=%s with a wave over %s", sorted(suspects), [n["name"] for n in again])
        runs2, results2, _ = wave.run(again, f"{name}-confirm", deadline)
        report.runs += runs2
        second = {v.node: v for v in diagnose(results2, rules)}
        report.verdicts = [
            v if v.passed or v.node not in second or not second[v.node].passed else replace(v, failures=(),
                                                                                          confirmed_ok=True)
            for v in report.verdicts
        ]
    failed = [v for v in report.verdicts if not v.passed]
    # A circuit breaker on the action: when most nodes fail at once, the drill itself (an image
    # without the benchmark, a bad baseline) is the likelier fault, and cordoning them all would
    # take the cluster down. Report them; cordon none.
    limit = max(1, int(max_cordon_fraction * len(report.verdicts)))
    if cordon and len(failed) > limit:
        report.cordon_errors = {v.node: f"not cordoned: {len(failed)} of {len(report.verdicts)} nodes failed "
                                        f"(more than {max_cordon_fraction:.0%}); check the drill first" for v in failed}
        cordon = False
    for v in failed:
        logger.warning("stress node=%s failed rules=%s", v.node, [f.rule for f in v.failures])
        if cordon:
            try:
                api.cordon(v.node, True, source=CORDON_SOURCE, reason=cordon_reason(v))
                report.cordoned.append(v.node)
            except ApiaryError as e:
                report.cordon_errors[v.node] = e.message
    return report


def _slowest_gpu(metrics: dict[str, Any], *figures: str) -> float | None:
    """The lowest of the node's per-GPU ``figures`` (``gpu<i>_<figure>``), rounded; None without."""
    split = {k: split_gpu_metric(k) for k in metrics}
    values = [v for k, v in metrics.items() if split[k][0] is not None and split[k][1] in figures]
    return round(min(values), 3) if values else None


def rows(report: StressReport) -> list[dict[str, Any]]:
    """The table artifact: one row per node (tested or not). The GPU columns give the node's
    slowest GPU (the one a verdict is about)."""
    by_node: dict[str, NodeRun] = {}
    for r in report.runs:  # the first run of each node: the one the verdict's details are about
        by_node.setdefault(r.ran_on or r.node, r)
    out: list[dict[str, Any]] = []
    for v in report.verdicts:
        run = by_node.get(v.node)
        metrics = (run.bench or {}).get("metrics", {}) if run else {}
        out.append({
            "node": v.node, "sku": v.sku,
            "verdict": "FAILED" if not v.passed else "passed on confirmation" if v.confirmed_ok else "passed",
            "matmulGflops": round(metrics["matmul_gflops"], 3) if "matmul_gflops" in metrics else None,
            "memBandwidthGbps": round(metrics["mem_bandwidth_gbps"], 3) if "mem_bandwidth_gbps" in metrics else None,
            "backend": (run.bench or {}).get("backend") if run else None,
            "gpuGemmTflopsMin": _slowest_gpu(metrics, "gemm_bf16_tflops", "gemm_fp16_tflops"),
            "gpuHbmGbpsMin": _slowest_gpu(metrics, "hbm_bandwidth_gbps"),
            "failedRules": ", ".join(sorted({f.rule for f in v.failures})),
            "detail": "; ".join(f.detail for f in v.failures),
            "cordoned": v.node in report.cordoned,
            "job": run.job_id if run else None,
            "note": (run.bench or {}).get("note", "") if run else "",
        })
    for node, why in sorted(report.untested.items()):
        out.append({"node": node, "sku": None, "verdict": "untested", "matmulGflops": None, "memBandwidthGbps": None,
                    "backend": None, "gpuGemmTflopsMin": None, "gpuHbmGbpsMin": None,
                    "failedRules": "", "detail": why, "cordoned": False, "job": None, "note": ""})
    return out


def run_stress(api: DrillApi, rules: Rules, *, image: str, timeout_s: float = 900.0, cordon: bool = True,
               nodes: list[str] | None = None, report: bool = True, **kw: Any) -> DrillOutcome:
    """The ``stress-drill``: :func:`stress`, then report the verdicts (``nodeFailures``). Passed
    when at least one node was tested and none failed."""
    started = time.time()
    rep = stress(api, rules, image=image, timeout_s=timeout_s, cordon=cordon, nodes=nodes, **kw)
    failed = rep.failed_nodes
    tested = len(rep.verdicts)
    summary = f"{tested - len(failed)}/{tested} tested nodes passed"
    if failed:
        summary += f"; failed: {', '.join(failed)}"
        if rep.cordoned:
            summary += f" (cordoned: {', '.join(rep.cordoned)})"
    if rep.untested:
        summary += f"; untested: {', '.join(sorted(rep.untested))}"
    if rep.cordon_errors:
        summary += "; cordon refused: " + "; ".join(f"{n}: {m}" for n, m in rep.cordon_errors.items())
    outcome = DrillOutcome(
        drill="stress-drill", result="passed" if tested and not failed else "failed", summary=summary,
        started_at=started, finished_at=time.time(), rows=rows(rep),
        details={"failedNodes": failed, "cordoned": rep.cordoned, "untested": rep.untested},
    )
    outcome.plots = _plots(rep)
    failures = [{"node": v.node, "rule": f.rule, "detail": f.detail[:2000]}
                for v in rep.verdicts for f in v.failures]
    if report:
        record(api, outcome, nodeFailures=failures)
    return outcome


def _plots(report: StressReport) -> dict[str, str]:
    """A bar chart of each benchmark per node (markdown with the PNG inline), when any node ran."""
    table = [r for r in rows(report) if r["matmulGflops"] is not None]
    if not table:
        return {}
    import base64
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("matmulGflops", "CPU matmul GFLOP/s"), ("memBandwidthGbps", "CPU memory bandwidth GB/s")]
    if any(r["gpuGemmTflopsMin"] is not None for r in table):
        panels.append(("gpuGemmTflopsMin", "slowest GPU bf16/fp16 GEMM TFLOP/s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.2))
    names = [r["node"] for r in table]
    colors = ["tab:red" if r["verdict"] == "FAILED" else "tab:green" for r in table]
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.bar(names, [r[key] or 0.0 for r in table], color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    png = base64.b64encode(buf.getvalue()).decode()
    return {"stress drill: benchmarks per node (red: failed)": f"![benchmarks](data:image/png;base64,{png})"}
