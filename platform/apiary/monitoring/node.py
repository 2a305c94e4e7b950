"""One registry per node: GPU (real or simulated), host and task collectors -- what a node agent serves."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from apiary.monitoring.gpu import GpuCollector, GpuSource, NvmlGpus, SimulatedGpus
from apiary.monitoring.guard import GuardedCollectors
from apiary.monitoring.host import HostCollector
from apiary.monitoring.server import Health, add_routes, make_app
from apiary.monitoring.tasks import TaskCollector, TaskList, platform_pids


class NodeExporter:
    """The metrics of node ``node`` in :attr:`registry`.

    ``tasks`` lists the node's running tasks (dicts with ``job``, ``user``, ``virtual_cluster``,
    ``task_role``, ``index``, ``pid``, ``gpus``). ``gpus`` is the GPU count the cluster config declares
    (exported as ``apiary_node_gpu_expected``). With ``simulated=True`` the GPUs are a
    :class:`SimulatedGpus` model driven by ``tasks`` (faults through :meth:`inject`/:meth:`clear`);
    otherwise NVML is used (``nvml`` may inject a stand-in module), except on a node declaring
    ``gpus=0``, which gets no GPU collector at all. ``gpu_source`` overrides both.

    The collectors run under :class:`GuardedCollectors` in the order gpu, host, tasks (the task
    collector reuses that scrape's GPU samples).
    """

    def __init__(
        self,
        node: str,
        tasks: TaskList,
        *,
        gpus: int | None = None,
        simulated: bool = False,
        gpu_source: GpuSource | None = None,
        nvml: Any = None,
        mountpoints: Sequence[str] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.node = node
        self.registry = CollectorRegistry(auto_describe=False)
        if gpu_source is None:
            if simulated:
                gpu_source = SimulatedGpus(node, gpus or 0, tasks=tasks, clock=clock)
            elif gpus != 0:
                gpu_source = NvmlGpus(nvml)
        self.gpu_source = gpu_source
        self.gpu = (
            GpuCollector(gpu_source, node, expected=gpus, task_pids=platform_pids(tasks))
            if gpu_source is not None else None
        )
        self.host = HostCollector(node, mountpoints=mountpoints)
        self.tasks = TaskCollector(node, tasks, gpu_util=self.gpu.utilization if self.gpu else None, clock=clock)
        collectors: dict[str, Any] = {}
        if self.gpu is not None:
            collectors["gpu"] = self.gpu
        collectors["host"] = self.host
        collectors["tasks"] = self.tasks
        self.collectors = GuardedCollectors(collectors, {"Hostname": node})
        self.registry.register(self.collectors)

    @property
    def simulated(self) -> SimulatedGpus | None:
        return self.gpu_source if isinstance(self.gpu_source, SimulatedGpus) else None

    def _sim(self) -> SimulatedGpus:
        if self.simulated is None:
            raise ValueError(f"node {self.node} has real GPUs: faults can only be injected into simulated GPUs")
        return self.simulated

    def inject(self, gpu: int, **faults: Any) -> dict[str, Any]:
        """Inject faults into a simulated GPU (see :meth:`SimulatedGpus.inject`); ValueError on real GPUs."""
        return self._sim().inject(gpu, **faults)

    def clear(self, gpu: int | None = None) -> None:
        self._sim().clear(gpu)

    def faults(self) -> dict[int, dict[str, Any]]:
        return self.simulated.faults() if self.simulated is not None else {}

    def render(self) -> bytes:
        """The Prometheus text exposition of the node (what ``GET /metrics`` returns)."""
        return generate_latest(self.registry)

    def app(self, health: Health | None = None) -> Any:
        """A stand-alone ASGI app with ``/metrics`` and ``/healthz``."""
        return make_app(self.registry, health)

    def add_routes(self, app: Any, health: Health | None = None) -> None:
        """Mount ``/metrics`` and ``/healthz`` on an existing FastAPI/Starlette app."""
        add_routes(app, self.registry, health)

    def close(self) -> None:
        if isinstance(self.gpu_source, NvmlGpus):
            self.gpu_source.close()
