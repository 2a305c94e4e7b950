"""Scheduler throughput and latency: the pure HiveD algorithm on generated large clusters.

:func:`measure` builds a :class:`~apiary.scheduler.hived.HivedScheduler` for a generated cluster of
``nodes`` 8-GPU nodes (:func:`cluster_config`) and drives it, in this one thread, with a seeded
pseudo-random stream of gang groups (:func:`Stream`), releasing random running groups to keep the
cluster between :data:`LOW_WATERMARK` and :data:`HIGH_WATERMARK` utilized. Only the scheduler calls
are timed (``time.perf_counter_ns``):

* a *sample* = every ``schedule()`` call made for one group that ends placed (including a
  ``preempt`` answer and the second ``schedule()`` after its victims were released) + its
  ``allocate()``; releasing the victims is not part of the sample;
* ``placements_per_s`` = placed groups / the summed time of *every* ``schedule()`` + ``allocate()``
  call of the measured phase, including groups that got ``wait`` (and were dropped);
* ``release()`` calls (utilization control and preemption victims) are timed separately
  (``release_mean_ms``) and are in neither figure.

The process runs with the control plane's garbage-collection policy (:mod:`apiary.gcpolicy`,
installed by ``apiary up``'s control-plane process too): the heap is collected and frozen once the
scheduler is built, and every later full collection freezes its survivors. Collector pauses that
fall inside a timed call are part of its sample; ``gc_max_pause_ms`` is the longest pause of the
measured phase wherever it fell, ``gc_full_collections`` how many full collections it ran.

The scheduler is pure (no clock, randomness, threads or I/O), so the same seed gives the same
call sequence on every machine; only the timings differ.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass, field

import numpy as np

from apiary import gcpolicy
from apiary.scheduler import GroupRequest, HivedScheduler, TaskRequest
from apiary.spec.cluster import ClusterConfig

GPUS_PER_NODE = 8
NODES_PER_RACK = 40
# VC name -> share of the nodes (cellType RACK.NODE quota); together every node.
VC_SHARES: dict[str, float] = {"vc-a": 0.4, "vc-b": 0.3, "vc-c": 0.2, "vc-d": 0.1}
# Gang size (GPUs) -> weight. > 8 GPUs = size/8 tasks of 8 GPUs (one per node).
GANG_SIZES: dict[int, float] = {1: 0.35, 2: 0.15, 4: 0.15, 8: 0.15, 16: 0.12, 32: 0.08}
OPPORTUNISTIC_SHARE = 0.2
HIGH_WATERMARK = 0.85  # when utilization goes above this ...
LOW_WATERMARK = 0.75  # ... release random running groups until it is at or below this
WARMUP_UTILIZATION = 0.80  # the measured phase starts once the cluster first reaches this
SEED = 20240601


# ---------------------------------------------------------------------- inputs
def cluster_config(nodes: int, nodes_per_rack: int = NODES_PER_RACK) -> dict:
    """A bare HiveD config (dict) of ``nodes`` nodes in racks of ``nodes_per_rack``.

    Cell types, bottom up (5 levels; the issue's "4-level" GPU/switch/socket/node, racks on top as
    the chain): ``GPU`` (sku: 1 GPU, 4 CPUs, 32 GiB) -> ``PCIE-SWITCH`` (2 GPUs) -> ``CPU-SOCKET``
    (2 switches) -> ``NODE`` (2 sockets = 8 GPUs, ``isNodeLevel``) -> ``RACK`` (``nodes_per_rack``
    nodes; every physical cell is one rack, all in chain ``RACK``). VCs (:data:`VC_SHARES`) get
    ``RACK.NODE`` cells: 40/30/20/10 % of the nodes, bound buddy-style by the scheduler.
    """
    if nodes % nodes_per_rack:
        nodes_per_rack = next(k for k in range(min(nodes_per_rack, nodes), 0, -1) if nodes % k == 0)
    racks = nodes // nodes_per_rack
    physical = [
        {
            "cellType": "RACK",
            "cellChildren": [{"cellAddress": f"node-{r * nodes_per_rack + i:05d}"} for i in range(nodes_per_rack)],
        }
        for r in range(racks)
    ]
    quotas = {vc: int(nodes * share) for vc, share in VC_SHARES.items()}
    first = next(iter(quotas))
    quotas[first] += nodes - sum(quotas.values())  # rounding: the rest to the first VC
    return {
        "physicalCluster": {
            "skuTypes": {"GPU": {"gpu": 1, "cpu": 4, "memory": "32Gi"}},
            "cellTypes": {
                "PCIE-SWITCH": {"childCellType": "GPU", "childCellNumber": 2},
                "CPU-SOCKET": {"childCellType": "PCIE-SWITCH", "childCellNumber": 2},
                "NODE": {"childCellType": "CPU-SOCKET", "childCellNumber": 2, "isNodeLevel": True},
                "RACK": {"childCellType": "NODE", "childCellNumber": nodes_per_rack},
            },
            "physicalCells": physical,
        },
        "virtualClusters": {
            vc: {"virtualCells": [{"cellType": "RACK.NODE", "cellNumber": n}]} for vc, n in quotas.items() if n > 0
        },
    }


class Stream:
    """The seeded request stream: group ``i`` is a gang of 1, 2, 4, 8, 16 or 32 GPUs
    (:data:`GANG_SIZES`; > 8 GPUs = ``size/8`` tasks of 8 GPUs), opportunistic (priority -1) with
    probability :data:`OPPORTUNISTIC_SHARE`, else prod (100) or test (10) with equal probability;
    its VC is drawn uniformly (so the 10 % VC gets as much guaranteed demand as the 40 % one and
    runs full: that is where ``wait`` and ``preempt`` answers come from)."""

    def __init__(self, vcs: list[str], seed: int = SEED) -> None:
        self.rng = random.Random(seed)
        self.vcs = list(vcs)
        self.sizes = list(GANG_SIZES)
        self.size_weights = [GANG_SIZES[s] for s in self.sizes]
        self.i = 0

    def next(self) -> GroupRequest:
        rng = self.rng
        size = rng.choices(self.sizes, self.size_weights)[0]
        if rng.random() < OPPORTUNISTIC_SHARE:
            prio = -1
        else:
            prio = 100 if rng.random() < 0.5 else 10
        vc = rng.choice(self.vcs)
        per, n = (size, 1) if size <= GPUS_PER_NODE else (GPUS_PER_NODE, size // GPUS_PER_NODE)
        task = TaskRequest("worker", n, per, float(2 * per), 8192 * per)
        self.i += 1
        return GroupRequest(f"g{self.i:07d}", vc, prio, True, (task,))


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``p`` in [0, 100]; ValueError when empty."""
    if not values:
        raise ValueError("no samples")
    return float(np.percentile(values, p))


# ---------------------------------------------------------------------- measurement
@dataclass
class Result:
    nodes: int
    gpus: int
    build_s: float = 0.0
    warmup_placements: int = 0
    samples_ns: list[int] = field(default_factory=list)
    busy_ns: int = 0  # every schedule() + allocate() of the measured phase
    attempts: int = 0
    waits: int = 0
    preemptions: int = 0  # preempt answers that ended placed
    victims: int = 0
    downgrades: int = 0  # groups a preempt answer downgraded to opportunistic (lazy preemption)
    releases: int = 0
    release_ns: int = 0
    util_sum: float = 0.0
    util_min: float = 1.0
    util_max: float = 0.0
    by_size: dict[int, int] = field(default_factory=dict)  # placed groups per gang size (GPUs)
    gc_pauses_ns: list[int] = field(default_factory=list)  # every collection of the measured phase
    gc_full: int = 0

    def to_dict(self) -> dict:
        ms = [x / 1e6 for x in self.samples_ns]
        return {
            "placements_per_s": round(len(ms) / (self.busy_ns / 1e9), 1) if self.busy_ns else 0.0,
            "p50_ms": round(percentile(ms, 50), 4),
            "p99_ms": round(percentile(ms, 99), 4),
            "max_ms": round(max(ms), 4),
            "samples": len(ms),
            "attempts": self.attempts,
            "waits": self.waits,
            "preemptions": self.preemptions,
            "victims": self.victims,
            "downgrades": self.downgrades,
            "release_mean_ms": round(self.release_ns / self.releases / 1e6, 4) if self.releases else 0.0,
            "utilization_mean": round(self.util_sum / max(self.attempts, 1), 3),
            "utilization_min": round(self.util_min, 3),
            "utilization_max": round(self.util_max, 3),
            "placed_by_gang_gpus": {str(k): v for k, v in sorted(self.by_size.items())},
            "build_s": round(self.build_s, 3),
            "gpus": self.gpus,
            "gc_max_pause_ms": round(max(self.gc_pauses_ns, default=0) / 1e6, 4),
            "gc_full_collections": self.gc_full,
        }


class _Running:
    """Running groups with O(1) random removal."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.pos: dict[str, int] = {}
        self.gpus: dict[str, int] = {}

    def add(self, name: str, gpus: int) -> None:
        self.pos[name] = len(self.names)
        self.names.append(name)
        self.gpus[name] = gpus

    def remove(self, name: str) -> int:
        i = self.pos.pop(name)
        last = self.names.pop()
        if last != name:
            self.names[i] = last
            self.pos[last] = i
        return self.gpus.pop(name)


def measure(nodes: int, samples: int, *, seed: int = SEED, max_attempts_factor: int = 5) -> Result:
    """Build the scheduler for a ``nodes``-node cluster, fill it to :data:`WARMUP_UTILIZATION`
    (not measured), then measure until ``samples`` groups were placed (or ``max_attempts_factor *
    samples`` attempts). See the module docstring for what is timed."""
    cfg_dict = cluster_config(nodes)
    cfg = ClusterConfig.from_dict(cfg_dict)
    pc = time.perf_counter_ns
    t0 = pc()
    sched = HivedScheduler(cfg)
    res = Result(nodes=nodes, gpus=nodes * GPUS_PER_NODE, build_s=(pc() - t0) / 1e9)
    gcpolicy.install()  # as the control-plane process does; collects and freezes the built tree
    try:
        return _drive(sched, cfg_dict, res, nodes, samples, seed, max_attempts_factor)
    finally:
        gcpolicy.uninstall()


def _drive(
    sched: HivedScheduler, cfg_dict: dict, res: Result, nodes: int, samples: int, seed: int, max_attempts_factor: int
) -> Result:
    pc = time.perf_counter_ns
    stream = Stream(list(cfg_dict["virtualClusters"]), seed)
    rng = random.Random(seed + 1)  # which running group to release
    running = _Running()
    total = res.gpus
    used = 0

    def release(name: str) -> None:
        nonlocal used
        t = pc()
        sched.release(name)
        res.release_ns += pc() - t
        res.releases += 1
        used -= running.remove(name)

    def attempt() -> tuple[bool, int, int]:
        """One group through schedule (-> preempt -> release victims -> schedule) -> allocate.
        Returns (placed, scheduler ns spent = its sample when placed, GPUs placed)."""
        nonlocal used
        req = stream.next()
        spent = 0
        preempted = False
        for _ in range(3):
            t = pc()
            d = sched.schedule(req)
            spent += pc() - t
            res.downgrades += len(getattr(d, "downgraded", ()))  # lazy preemption (newer schedulers)
            if d.kind == "place":
                t = pc()
                sched.allocate(req.name, req, d.placements)
                spent += pc() - t
                gpus = sum(len(p.gpus) for p in d.placements)
                running.add(req.name, gpus)
                used += gpus
                res.preemptions += preempted
                return True, spent, gpus
            if d.kind == "wait":
                break
            preempted = True  # preempt: the victims stop, then the group schedules again
            for v in d.victims:
                release(v)
                res.victims += 1
        sched.cancel(req.name)  # dropped: give up any reservation it holds
        return False, spent, 0

    def control() -> None:
        if used / total > HIGH_WATERMARK:
            while used / total > LOW_WATERMARK and running.names:
                release(running.names[rng.randrange(len(running.names))])

    # warm-up: fill the cluster (not measured)
    guard = 0
    while used / total < WARMUP_UTILIZATION and guard < 50 * nodes:
        guard += 1
        placed, _, _ = attempt()
        res.warmup_placements += placed
        control()
    res.releases = res.release_ns = res.victims = res.preemptions = res.downgrades = 0

    # measured phase
    gc_start = [0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = pc()
        else:
            res.gc_pauses_ns.append(pc() - gc_start[0])
            res.gc_full += info.get("generation") == 2

    gc.callbacks.append(on_gc)  # last: a full collection's pause includes the policy's freeze
    try:
        while len(res.samples_ns) < samples and res.attempts < max_attempts_factor * samples:
            placed, spent, gpus = attempt()
            res.attempts += 1
            res.busy_ns += spent
            if placed:
                res.samples_ns.append(spent)
                res.by_size[gpus] = res.by_size.get(gpus, 0) + 1
            else:
                res.waits += 1
            u = used / total
            res.util_sum += u
            res.util_min = min(res.util_min, u)
            res.util_max = max(res.util_max, u)
            control()
    finally:
        gc.callbacks.remove(on_gc)
    if not res.samples_ns:
        raise RuntimeError(f"no group was placed in {res.attempts} attempts on {nodes} nodes")
    return res
