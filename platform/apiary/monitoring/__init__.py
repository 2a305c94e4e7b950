"""Prometheus metrics of the platform: GPU (NVML or simulated), host, per-task and control-plane collectors.

Every collector is a custom :class:`prometheus_client.registry.Collector` whose ``collect`` computes
its families fresh on each scrape; nothing is updated in the background. ``METRICS.md`` next to this
file lists every metric (type, unit, labels, source) and is what the alert rules and dashboards read.

* :mod:`apiary.monitoring.gpu` -- :class:`GpuCollector` over :class:`NvmlGpus` (real GPUs through
  ``pynvml``) or :class:`SimulatedGpus` (load-driven model with DCGM-like fault injection), exposing
  dcgm-exporter's names and labels; :mod:`apiary.monitoring.gpu_health` reads and models the health
  fields beyond ECC and XID (row remapping, retired pages, clock-throttle reasons, PCIe link).
* :mod:`apiary.monitoring.host` -- :class:`HostCollector` (psutil: CPU, memory, disks, network).
* :mod:`apiary.monitoring.tasks` -- :class:`TaskCollector` (CPU, RSS and GPU use of each running task).
* :mod:`apiary.monitoring.platform_metrics` -- :class:`PlatformCollector` (jobs, queue, VC cells,
  nodes, heartbeats from a control-plane snapshot) and :func:`observe_cycle`.
* :mod:`apiary.monitoring.node` -- :class:`NodeExporter`, one registry per node agent.
* :mod:`apiary.monitoring.server` -- :func:`make_app` (ASGI ``/metrics`` + ``/healthz``) and
  :func:`serve_metrics` (a stand-alone HTTP server thread).
"""

from __future__ import annotations

from apiary.monitoring.gpu import GpuCollector, GpuSample, NvmlGpus, SimulatedGpus
from apiary.monitoring.guard import GuardedCollectors
from apiary.monitoring.host import HostCollector
from apiary.monitoring.node import NodeExporter
from apiary.monitoring.platform_metrics import (
    SCHEDULING_CYCLE_SECONDS,
    PlatformCollector,
    beat,
    observe_cycle,
)
from apiary.monitoring.server import make_app, serve_metrics
from apiary.monitoring.tasks import TaskCollector, platform_pids

__all__ = [
    "SCHEDULING_CYCLE_SECONDS",
    "GpuCollector",
    "GpuSample",
    "GuardedCollectors",
    "HostCollector",
    "NodeExporter",
    "NvmlGpus",
    "PlatformCollector",
    "SimulatedGpus",
    "TaskCollector",
    "beat",
    "make_app",
    "observe_cycle",
    "platform_pids",
    "serve_metrics",
]
