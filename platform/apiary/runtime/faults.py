"""Simulated-GPU faults on a node's agent: the faults the control plane queues, applied once each.

A fault (``POST /api/v2/nodes/{node}/faults``) reaches the agent with its assignments; ids only grow,
so :attr:`SimulatedFaults.applied` (the last id applied, reported back as ``faultsApplied``) is all
that is needed to apply each once. ``degraded`` (a slowdown factor) is kept here whether or not the
node serves metrics: tasks launched later on that GPU are told it (:meth:`slowdown`); ``clear``
resets the GPU. The other kinds go to the node's exporter's simulated GPUs.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class SimulatedFaults:
    """The faults of node ``node`` (see the module doc). ``exporter``: the node's
    :class:`~apiary.monitoring.NodeExporter`, set later when the node serves metrics."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.exporter: Any = None
        self.applied = 0  # the last fault id applied
        self._degraded: dict[int, float] = {}  # GPU -> simulated slowdown factor (fault `degraded`)

    def apply(self, faults: list[dict]) -> None:
        """Apply the queued faults not applied yet, in order; a rejected one is logged, not raised."""
        for f in faults:
            if f["id"] <= self.applied:
                continue
            self.applied = f["id"]
            if f.get("clear"):
                self._degraded.pop(f["gpu"], None)
            elif f.get("degraded") is not None:
                self._degraded[f["gpu"]] = float(f["degraded"])
                logger.info("node=%s gpu=%s degraded x%s (simulated)", self.node, f["gpu"], f["degraded"])
            if self.exporter is None or self.exporter.simulated is None:
                if f.get("degraded") is None:
                    logger.warning("node=%s fault %s ignored: no simulated GPUs", self.node, f)
                continue
            kinds = {k: v for k, v in f.items() if k not in ("id", "gpu", "clear")}
            try:
                if f.get("clear"):
                    self.exporter.clear(f["gpu"])
                else:
                    self.exporter.inject(f["gpu"], **kinds)
                logger.info("node=%s fault applied %s", self.node, f)
            except (ValueError, TypeError) as e:
                logger.warning("node=%s fault %s rejected: %s", self.node, f, e)

    def slowdown(self, gpus: list[int]) -> float:
        """The simulated slowdown factor of a task on ``gpus`` (the largest ``degraded`` fault among
        them; for a task without GPUs, the node's largest); 1.0 when none is degraded."""
        factors = [self._degraded.get(g, 1.0) for g in gpus] if gpus else list(self._degraded.values())
        return max(factors, default=1.0)
