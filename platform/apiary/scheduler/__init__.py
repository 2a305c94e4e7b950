"""Apiary's scheduler: HiveD semantics as a pure algorithm behind one small interface.

``HivedScheduler(config, lazy_preemption=False)`` implements :class:`SchedulerAlgorithm` (validate,
schedule, allocate, release, cancel, set_node_health, nodes, group_of, groups, status(vc),
reconfigure(config)) plus ``check_invariants()`` and ``downgraded()``.  Virtual cells bind lazily
to physical cells by buddy allocation under HiveD's VC-safety invariant.  See ``STATE-MACHINE.md``
for the cell and group states.  :func:`leaf_cells_needed` is the one rule sizing a task in leaf
cells, shared with the simulator's baselines.  :func:`unknown_vc_message` is the one wording of an
unknown VC error (the valid names and the closest one).

Modules, along HiveD's files: ``hived`` (entry points), ``intra_vc``, ``placement`` (topology-aware),
``allocation`` (cells, buddy binding), ``preemption``, ``inspection`` (status, invariants).
"""

from apiary.scheduler.allocation import unknown_vc_message
from apiary.scheduler.cells import CellState
from apiary.scheduler.hived import HivedScheduler
from apiary.scheduler.sizing import leaf_cells_needed
from apiary.scheduler.types import (
    OPPORTUNISTIC_PRIORITY,
    PRIORITY_CLASSES,
    Decision,
    GroupRequest,
    NodeInfo,
    SchedulerAlgorithm,
    TaskPlacement,
    TaskRequest,
    priority_label,
)

__all__ = [
    "OPPORTUNISTIC_PRIORITY",
    "PRIORITY_CLASSES",
    "CellState",
    "Decision",
    "GroupRequest",
    "HivedScheduler",
    "NodeInfo",
    "SchedulerAlgorithm",
    "TaskPlacement",
    "TaskRequest",
    "leaf_cells_needed",
    "priority_label",
    "unknown_vc_message",
]
