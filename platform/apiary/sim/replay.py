"""Trace replay: one trace, one cluster, several policies, one metrics dict per policy.

``hived`` is :class:`apiary.scheduler.HivedScheduler` itself; ``quota`` and ``fifo`` are the
baselines of :mod:`apiary.sim.policies`.  All three run through the same
:class:`~apiary.sim.engine.Engine`.

Metrics per policy: ``jobs`` (replayed to completion), ``rejected`` (refused at submission:
unknown VC, larger than the VC's quota, or a task larger than any node the policy may use),
``wall_s`` (replay wall time), ``queue_delay_s`` and ``jct_s`` ({mean, p50, p95, p99}; delay =
first start - submission, JCT = completion - submission), ``gpu_utilization`` (busy GPU-seconds /
(total GPUs x makespan), makespan = last completion - first submission), ``preemptions``,
``sharing_anomaly_s`` (:mod:`apiary.sim.anomaly`; null for ``fifo``) and ``makespan_s``.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from apiary.errors import ValidationError
from apiary.lifecycle import RoleCompletion
from apiary.lifecycle.reducer import JobPolicy
from apiary.scheduler import HivedScheduler
from apiary.scheduler.types import GroupRequest, TaskRequest
from apiary.sim.anomaly import SharingAnomaly
from apiary.sim.cluster import derive_quotas, load_machines, machines_to_cluster, vc_gpus
from apiary.sim.engine import Engine, SimJob
from apiary.sim.policies import FifoScheduler, QuotaScheduler, config_nodes
from apiary.sim.trace import TraceJob, load_trace, trace_stats
from apiary.spec.cluster import ClusterConfig, load_cluster_config

POLICIES = ("hived", "quota", "fifo")


@dataclass
class PolicyResult:
    name: str
    metrics: dict
    delays: np.ndarray = field(repr=False)
    timeline: list[tuple[float, int]] = field(repr=False)
    total_gpus: int = 0


def make_scheduler(policy: str, config: ClusterConfig):
    if policy == "hived":
        return HivedScheduler(config)
    if policy == "quota":
        return QuotaScheduler(config)
    if policy == "fifo":
        return FifoScheduler(config)
    raise ValidationError("policy", f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")


def trace_cluster(
    jobs: Sequence[TraceJob], *, cluster: str | Path | None = None, machines: str | Path | None = None
) -> tuple[ClusterConfig, dict]:
    """The cluster to replay on: a HiveD config file as is, or a machine list with VC quotas derived
    from the trace (:func:`apiary.sim.cluster.derive_quotas`).  Returns (config, quota summary)."""
    if (cluster is None) == (machines is None):
        raise ValidationError("cluster", "give exactly one of --cluster and --machines")
    if cluster is not None:
        config = load_cluster_config(Path(cluster))
    else:
        assert machines is not None  # exactly one of the two, checked above
        ms = load_machines(machines)
        sizes: dict[int, int] = {}
        for m in ms:
            sizes[m.gpus] = sizes.get(m.gpus, 0) + 1
        gt, big = trace_stats(list(jobs))
        quotas = derive_quotas(gt, big, sizes)
        config = machines_to_cluster(ms, quotas)
    gpus = vc_gpus(config)
    summary = {
        "nodes": len(config_nodes(config)),
        "gpus": sum(n.gpus for n in config_nodes(config)),
        "virtualClusters": {
            v: {"gpus": gpus[v], "cells": {c.cell_type: c.cell_number for c in vc.virtual_cells}}
            for v, vc in config.virtual_clusters.items()
        },
    }
    return config, summary


@functools.cache
def _roles(instances: int) -> Mapping[str, RoleCompletion]:
    """OpenPAI's default completion policy for one role of ``instances`` (shared, read-only)."""
    return MappingProxyType({"train": RoleCompletion(instances=instances)})


def sim_job(tj: TraceJob, index: int, job_id: str | None = None) -> SimJob:
    """A trace job as one task role ``train`` of ``k`` instances x ``g`` GPUs (its shape), id
    ``vc~name`` (or ``job_id``), default completion policy and no retries (OpenPAI's defaults)."""
    k, g = tj.shape
    req = GroupRequest(
        name=job_id or f"{tj.vc}~{tj.name}",
        virtual_cluster=tj.vc,
        priority=tj.priority,
        gang=tj.gang,
        tasks=(TaskRequest("train", k, g, 0.0, 0),),
    )
    policy = JobPolicy(request=req, roles=_roles(k))
    return SimJob(id=req.name, vc=tj.vc, priority=tj.priority, gang=tj.gang, policy=policy, user=tj.vc,
                  duration=tj.duration, submit=tj.submit, shape=(k, g), gpus=k * g)


def _stats(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"mean": None, "p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"mean": round(float(values.mean()), 3), "p50": round(float(p50), 3), "p95": round(float(p95), 3),
            "p99": round(float(p99), 3)}


@contextmanager
def _without_cycle_collection() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for one replay.

    A replay allocates millions of small acyclic objects (jobs, lifecycle records, effects, queue
    entries) and keeps most of them to the end; the collector's generation-2 passes re-scan all of
    them again and again, which took about a third of a Philly replay's wall time (measured: building
    the 82,247 jobs alone, 1.44 s with the collector and 0.34 s without). Reference counting still
    frees everything as usual; the few reference cycles (engine <-> observer) are collected after.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def replay_policy(jobs: Sequence[TraceJob], config: ClusterConfig, policy: str) -> PolicyResult:
    """Replay ``jobs`` on ``config`` under ``policy``; the metrics of the module docstring."""
    with _without_cycle_collection():
        return _replay_policy(jobs, config, policy)


def _replay_policy(jobs: Sequence[TraceJob], config: ClusterConfig, policy: str) -> PolicyResult:
    t0 = time.perf_counter()
    sched = make_scheduler(policy, config)
    engine = Engine(sched, policy, vc_quota=vc_gpus(config))
    anomaly = SharingAnomaly(engine, config) if policy != "fifo" else None
    sims = []
    seen: dict[str, int] = {}
    for i, tj in enumerate(jobs):
        sj = sim_job(tj, i)
        if sj.id in seen:  # duplicate names in a generic trace: keep them apart
            seen[sj.id] += 1
            sj = sim_job(tj, i, f"{sj.id}-{seen[sj.id]}")
        else:
            seen[sj.id] = 0
        engine.submit(sj, tj.submit)
        sims.append(sj)
    engine.run()
    wall = time.perf_counter() - t0
    done = [j for j in sims if j.state == "SUCCEEDED"]
    rejected = sum(1 for j in sims if j.state == "REJECTED")
    # A job that succeeded has started and finished.
    starts = [j.first_start if j.first_start is not None else j.submit for j in done]
    ends = [j.finish if j.finish is not None else j.submit for j in done]
    delays = np.array([s - j.submit for s, j in zip(starts, done, strict=True)], dtype=np.float64)
    jct = np.array([e - j.submit for e, j in zip(ends, done, strict=True)], dtype=np.float64)
    first = min((j.submit for j in sims), default=0.0)
    last = max(ends, default=first)
    makespan = last - first
    util = engine.busy_gpu_s / (engine.total_gpus * makespan) if makespan > 0 and engine.total_gpus else 0.0
    metrics = {
        "jobs": len(done),
        "rejected": rejected,
        "wall_s": round(wall, 3),
        "queue_delay_s": _stats(delays),
        "jct_s": _stats(jct),
        "gpu_utilization": round(util, 6),
        "preemptions": engine.preemptions,
        "sharing_anomaly_s": round(anomaly.total, 3) if anomaly is not None else None,
        "makespan_s": round(makespan, 3),
    }
    if anomaly is not None and anomaly.overflow:
        metrics["mirror_overflow"] = anomaly.overflow
    unfinished = len(sims) - len(done) - rejected
    if unfinished:
        metrics["unfinished"] = unfinished
    return PolicyResult(policy, metrics, delays, engine.timeline, engine.total_gpus)


def replay(
    trace: str | Path | Sequence[TraceJob],
    *,
    cluster: str | Path | None = None,
    machines: str | Path | None = None,
    policies: Sequence[str] = POLICIES,
    limit: int | None = None,
    plots: str | Path | None = None,
) -> tuple[dict, list[PolicyResult]]:
    """Load, replay under every policy, optionally plot.  Returns (the JSON document, results)."""
    if isinstance(trace, str | Path):
        jobs = load_trace(trace, limit=limit)
    else:
        jobs = list(trace)[:limit] if limit is not None else list(trace)
    for p in policies:
        if p not in POLICIES:
            raise ValidationError("policy", f"unknown policy {p!r}; use one of {', '.join(POLICIES)}")
    config, summary = trace_cluster(jobs, cluster=cluster, machines=machines)
    results = [replay_policy(jobs, config, p) for p in policies]
    doc: dict[str, Any] = {
        "trace": {"source": str(trace) if isinstance(trace, str | Path) else None, "jobs": len(jobs)},
        "cluster": summary,
        "policies": {r.name: r.metrics for r in results},
    }
    if plots is not None:
        from apiary.sim.plots import write_plots

        doc["plots"] = [str(p) for p in write_plots(results, Path(plots))]
    return doc, results
