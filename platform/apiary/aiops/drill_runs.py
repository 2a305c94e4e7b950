"""Seeded fault-injection drill runs: the data AIOps is trained and evaluated on.

A run is a cluster of ``nodes`` simulated nodes observed once per :data:`DRILL_INTERVAL_S` for
``intervals`` observations. Its seed decides each node's fate (:class:`NodeFate`):

* ``degrading``: precursors start ``lead`` observations before the node fails (``lead`` drawn from
  ``lead_intervals``), each node with its own mix and strength: single-bit ECC errors on one GPU at a
  rate that rises towards the failure, hardware XIDs (63/64 page retirement and row remapping, 92 high
  single-bit rate, 94 contained ECC error) more often as it nears, a thermal excursion that grows.
* ``sudden``: fails with no precursor at all (``sudden_share`` of the failing nodes). Nothing can
  warn of these; they stay in the evaluation as misses, so recall is honest.
* ``healthy``: never fails; ``noise_share`` of them get benign noise that looks like a precursor for
  a moment: a one-off temperature spike, a single burst of single-bit errors that does not come back,
  application XIDs (13, 31, 43), a trickle of single-bit errors.

Every node also gets a background rate of single-bit errors and ambient temperature noise. A failure
is what the platform's alert rules cordon on: a double-bit ECC error, XID 79 (fallen off the bus) and
the GPU lost; the node is not observed after it.

The faults go in the way the node agent applies the ones ``POST /api/v2/nodes/{node}/faults`` queues
(:meth:`apiary.monitoring.gpu.SimulatedGpus.inject`), and every observation is read back from the
text exposition the node's collectors render (:class:`~apiary.monitoring.gpu.GpuCollector`,
:class:`~apiary.monitoring.tasks.TaskCollector`; the VC queue from
:class:`~apiary.monitoring.platform_metrics.PlatformCollector`) through
:func:`apiary.aiops.samples.parse_exposition`: the detectors see what Prometheus would scrape, never
the generator's variables. The GPU temperature is the simulator's load-driven model (read from a
fault-free twin of each node's GPUs) plus the injected noise and excursions, injected as ``temp``.

Deterministic per seed: numpy's PCG64 seeded with the seed, and the simulator's own hash-seeded jitter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from apiary.aiops.samples import Frame, Row, assemble, parse_exposition
from apiary.monitoring.gpu import GpuCollector, SimulatedGpus
from apiary.monitoring.platform_metrics import PlatformCollector
from apiary.monitoring.tasks import TaskCollector

#: Seconds between two observations: the inspection drill's cadence, ``*/5 * * * *`` in
#: ``DRILL_SCHEDULES`` of flows/serve.py (tests/aiops checks the two agree).
DRILL_INTERVAL_S = 300.0

#: NVIDIA's XID catalogue (docs.nvidia.com/deploy/xid-errors): 63/64 ECC page retirement or row
#: remapping, 92 high single-bit ECC error rate, 94 contained ECC error -- a GPU's memory wearing out.
HARDWARE_XIDS = (63, 64, 92, 94)
#: 13 graphics engine exception, 31 MMU fault, 43 GPU stopped processing: usually the application's.
APP_XIDS = (13, 31, 43)
#: 79: the GPU has fallen off the bus -- the failure itself, with a double-bit ECC error.
FAILURE_XID = 79

Fate = Literal["degrading", "sudden", "healthy"]


@dataclass(frozen=True)
class ScenarioConfig:
    """The shape of a run. Shares are probabilities per node (per run for ``stall_share`` and
    ``surge_share``); the defaults are this project's choice of a hard but fair test, not
    measurements of a real fleet."""

    nodes: int = 12
    intervals: int = 96  # 8 h at the inspection drill's 5 min
    gpus: int = 8
    virtual_clusters: tuple[str, ...] = ("vc-a", "vc-b", "vc-c")
    warmup_intervals: int = 12  # no failure in the first hour: the detectors learn what is normal
    failing_share: float = 0.3
    sudden_share: float = 0.1
    lead_intervals: tuple[int, int] = (3, 16)  # precursors start this many observations before failing
    noise_share: float = 0.6
    background_sbe_p: float = 0.003  # per GPU and observation: one single-bit error, on every node
    stall_share: float = 0.3  # a run where one job stops using its GPUs
    surge_share: float = 0.3  # a run where one VC's queue backs up


@dataclass(frozen=True)
class NodeFate:
    """What the scenario decided for ``node``: times in seconds from the run's start."""

    node: str
    fate: Fate
    fail_s: float | None = None
    onset_s: float | None = None
    gpu: int | None = None  # the GPU that degrades or fails
    precursors: tuple[str, ...] = ()  # of "ecc", "xid", "thermal"
    noise: tuple[str, ...] = ()  # of "temp_spike", "sbe_burst", "app_xid", "sbe_trickle"


@dataclass(frozen=True)
class DrillRun:
    """One seeded run: ``frames`` in time order (one per observation), and the truth in ``fates``."""

    seed: int
    interval_s: float
    frames: tuple[Frame, ...]
    fates: Mapping[str, NodeFate]
    events: Mapping[str, Any] = field(default_factory=dict)  # the stalled job and the VC surge, if any

    @property
    def failures(self) -> dict[str, float]:
        """``{node: fail_s}`` of the nodes that failed."""
        return {n: f.fail_s for n, f in self.fates.items() if f.fail_s is not None}


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _SimNode:
    """One node: simulated GPUs with faults, a fault-free twin (the thermal baseline) and the registry
    a node agent would serve for them (GPU and task collectors)."""

    def __init__(self, name: str, gpus: int, seed: int, clock: _Clock, jobs: list[dict[str, Any]]):
        self.name = name
        self.jobs = jobs  # what the platform lists as running here
        self.stalled: set[str] = set()  # jobs whose processes no longer use their GPUs
        self.sim = SimulatedGpus(name, gpus, tasks=self._on_gpus, clock=clock, period_s=DRILL_INTERVAL_S, seed=seed)
        self.twin = SimulatedGpus(name, gpus, tasks=self._on_gpus, clock=clock, period_s=DRILL_INTERVAL_S, seed=seed)
        collector = GpuCollector(self.sim, name, expected=gpus)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.registry.register(TaskCollector(name, lambda: self.jobs, gpu_util=collector.utilization, clock=clock))

    def _on_gpus(self) -> list[dict[str, Any]]:
        return [j for j in self.jobs if j["job"] not in self.stalled]

    def base_temps(self) -> dict[int, float]:
        return {s.index: float(s.temp_c or 0.0) for s in self.twin.samples()}

    def rows(self) -> list[Row]:
        return parse_exposition(generate_latest(self.registry).decode())


def _fates(rng: np.random.Generator, cfg: ScenarioConfig) -> dict[str, NodeFate]:
    out: dict[str, NodeFate] = {}
    last = cfg.intervals - 1
    for i in range(cfg.nodes):
        node = f"node-{i:02d}"
        gpu = int(rng.integers(cfg.gpus))
        if rng.random() < cfg.failing_share:
            if rng.random() < cfg.sudden_share:
                fail_k = int(rng.integers(cfg.warmup_intervals, last + 1))
                out[node] = NodeFate(node, "sudden", fail_s=fail_k * DRILL_INTERVAL_S, gpu=gpu)
                continue
            lo, hi = cfg.lead_intervals
            lead = int(rng.integers(lo, hi + 1))
            fail_k = int(rng.integers(min(cfg.warmup_intervals + lead, last), last + 1))
            kinds = tuple(k for k, p in (("ecc", 0.85), ("xid", 0.5), ("thermal", 0.4)) if rng.random() < p)
            out[node] = NodeFate(node, "degrading", fail_s=fail_k * DRILL_INTERVAL_S,
                                 onset_s=max(0, fail_k - lead) * DRILL_INTERVAL_S, gpu=gpu,
                                 precursors=kinds or ("ecc",))
        else:
            noise: tuple[str, ...] = ()
            if rng.random() < cfg.noise_share:
                pool = ("temp_spike", "sbe_burst", "app_xid", "sbe_trickle")
                picks = rng.choice(len(pool), size=int(rng.integers(1, 3)), replace=False)
                noise = tuple(pool[int(p)] for p in sorted(picks))
            out[node] = NodeFate(node, "healthy", gpu=gpu, noise=noise)
    return out


def _jobs(rng: np.random.Generator, node: str, cfg: ScenarioConfig) -> list[dict[str, Any]]:
    """One 8-GPU job or two 4-GPU ones, or (one node in four) idle."""
    if rng.random() < 0.25:
        return []
    parts = [list(range(cfg.gpus))] if rng.random() < 0.5 else [list(range(cfg.gpus // 2)),
                                                                list(range(cfg.gpus // 2, cfg.gpus))]
    return [{"job": f"user{int(rng.integers(20))}~train-{node}-{k}", "user": "user",
             "virtual_cluster": str(rng.choice(list(cfg.virtual_clusters))), "task_role": "worker", "index": 0,
             "gpus": gpus} for k, gpus in enumerate(parts)]


def generate_run(seed: int, config: ScenarioConfig | None = None) -> DrillRun:
    """The drill run of ``seed`` (same seed, same run: frames equal value for value)."""
    cfg = config or ScenarioConfig()
    rng = np.random.default_rng(seed)
    fates = _fates(rng, cfg)
    clock = _Clock()
    nodes = {n: _SimNode(n, cfg.gpus, seed, clock, _jobs(rng, n, cfg)) for n in fates}
    k_of = {n: (None if f.fail_s is None else int(f.fail_s // DRILL_INTERVAL_S)) for n, f in fates.items()}
    onset = {n: (None if f.onset_s is None else int(f.onset_s // DRILL_INTERVAL_S)) for n, f in fates.items()}
    strength = {n: float(rng.uniform(0.3, 1.0)) for n in fates}
    thermal_peak = {n: float(rng.uniform(6.0, 18.0)) for n in fates}
    noise_at = {n: {kind: int(rng.integers(cfg.warmup_intervals // 2, cfg.intervals)) for kind in f.noise}
                for n, f in fates.items()}
    events: dict[str, Any] = {}
    running = [(n, j["job"]) for n, sn in nodes.items() if fates[n].fate == "healthy" for j in sn.jobs]
    if running and rng.random() < cfg.stall_share:
        node, job = running[int(rng.integers(len(running)))]
        events["stall"] = {"node": node, "job": job,
                           "at_s": int(rng.integers(cfg.warmup_intervals, cfg.intervals)) * DRILL_INTERVAL_S}
    if rng.random() < cfg.surge_share:
        k0 = int(rng.integers(cfg.warmup_intervals * 2, cfg.intervals))
        events["surge"] = {"virtual_cluster": str(rng.choice(list(cfg.virtual_clusters))),
                           "from_s": k0 * DRILL_INTERVAL_S, "to_s": (k0 + 12) * DRILL_INTERVAL_S}
    waiting: dict[str, list[float]] = {vc: [] for vc in cfg.virtual_clusters}
    queue: dict[str, Any] = {}
    platform = CollectorRegistry(auto_describe=False)
    platform.register(PlatformCollector(lambda: queue, clock=clock))

    frames: list[Frame] = []
    for k in range(cfg.intervals):
        t = k * DRILL_INTERVAL_S
        clock.t = t
        rows: list[Row] = []
        for n, sn in nodes.items():
            fail_k = k_of[n]
            if fail_k is not None and k > fail_k:
                continue  # failed: down, not scraped any more
            _step_node(rng, sn, fates[n], k, fail_k, onset[n], strength[n], thermal_peak[n], noise_at[n], cfg)
            stall = events.get("stall")
            if stall and stall["node"] == n and t >= stall["at_s"]:
                sn.stalled.add(stall["job"])
            rows += sn.rows()
        _step_queue(rng, waiting, t, events.get("surge"))
        queue.clear()
        queue.update({"now": t, "waiting_jobs": [
            {"job": f"{vc}-waiting-{i}", "user": "user", "virtual_cluster": vc, "submitted_at": s}
            for vc, subs in waiting.items() for i, s in enumerate(subs)]})
        rows += parse_exposition(generate_latest(platform).decode())
        frames.append(assemble(t, rows))
    return DrillRun(seed=seed, interval_s=DRILL_INTERVAL_S, frames=tuple(frames), fates=fates, events=events)


def _step_node(rng: np.random.Generator, sn: _SimNode, fate: NodeFate, k: int, fail_k: int | None,
               onset_k: int | None, strength: float, thermal_peak: float, noise_at: Mapping[str, int],
               cfg: ScenarioConfig) -> None:
    """Inject observation ``k``'s faults into ``sn`` (see the module doc for what each fate does)."""
    bad = fate.gpu if fate.gpu is not None else 0
    temps = {g: base + float(rng.normal(0.0, 0.8)) for g, base in sn.base_temps().items()}
    for g in range(cfg.gpus):
        if rng.random() < cfg.background_sbe_p:
            sn.sim.inject(g, ecc_sbe=1)
    if fail_k is not None and k == fail_k:
        sn.sim.inject(bad, ecc_dbe=1, xid=FAILURE_XID, lost=True)
    elif fate.fate == "degrading" and onset_k is not None and fail_k is not None and k >= onset_k:
        p = (k - onset_k + 1) / max(1, fail_k - onset_k)  # 0 < p <= 1 towards the failure
        if "ecc" in fate.precursors:
            n = int(rng.poisson(strength * (0.5 + 30.0 * p * p)))
            if n:
                sn.sim.inject(bad, ecc_sbe=n)
        if "xid" in fate.precursors and rng.random() < 0.1 + 0.5 * p * strength:
            codes = HARDWARE_XIDS if rng.random() < 0.8 else APP_XIDS
            sn.sim.inject(bad, xid=int(codes[int(rng.integers(len(codes)))]))
        if "thermal" in fate.precursors:
            temps[bad] += thermal_peak * p + float(rng.normal(0.0, 1.5))
    for kind, at in noise_at.items():
        if kind == "temp_spike" and k == at:
            temps[bad] += float(rng.uniform(15.0, 25.0))
        elif kind == "sbe_burst" and k == at:
            sn.sim.inject(bad, ecc_sbe=int(rng.integers(5, 31)))
        elif kind == "app_xid" and (k == at or k == at + int(rng.integers(3, 30))):
            sn.sim.inject(bad, xid=int(APP_XIDS[int(rng.integers(len(APP_XIDS)))]))
        elif kind == "sbe_trickle" and k >= at and rng.random() < 0.15:
            sn.sim.inject(bad, ecc_sbe=1)
    for g, temp in temps.items():
        sn.sim.inject(g, temp=round(temp, 1))


def _step_queue(rng: np.random.Generator, waiting: dict[str, list[float]], t: float,
                surge: Mapping[str, Any] | None) -> None:
    """Arrivals (Poisson, 0.8 per VC and observation) and admissions (each waiting job with
    probability 0.6, 0.02 in a surge) of the VCs' queues."""
    for vc, subs in waiting.items():
        crunch = surge is not None and surge["virtual_cluster"] == vc and surge["from_s"] <= t < surge["to_s"]
        admit = 0.02 if crunch else 0.6
        subs[:] = [s for s in subs if rng.random() >= admit]
        subs += [t - float(rng.uniform(0.0, DRILL_INTERVAL_S)) for _ in range(int(rng.poisson(0.8)))]
