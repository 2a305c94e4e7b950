"""Apiary's scheduler: HiveD semantics as a pure algorithm behind one small interface.

``HivedScheduler(config)`` implements :class:`SchedulerAlgorithm` (validate, schedule, allocate,
release, cancel, set_node_health, nodes, status, group_of).  See ``STATE-MACHINE.md`` for the cell
and group states.
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
