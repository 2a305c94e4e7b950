"""Apiary's scheduler: HiveD semantics as a pure algorithm behind one small interface.

``HivedScheduler(config, lazy_preemption=False)`` implements :class:`SchedulerAlgorithm` (validate,
schedule, allocate, release, cancel, set_node_health, nodes, status, group_of) plus ``status(vc)``,
``reconfigure(config)``, ``check_invariants()``, ``groups()`` and ``downgraded()``.  Virtual cells
bind lazily to physical cells by buddy allocation under HiveD's VC-safety invariant.  See
``STATE-MACHINE.md`` for the cell and group states.
"""

from apiary.scheduler.cells import CellState
from apiary.scheduler.hived import HivedScheduler
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
    "priority_label",
]
