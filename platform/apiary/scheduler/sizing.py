"""How many leaf cells one task instance needs: the one rule, shared by every scheduler.

OpenPAI's REST server sizes a HiveD task by its ``resourcePerInstance`` against the leaf cell
(sku) it runs on, taking the scarcest dimension::

    cells per task = max(ceil(gpu / sku.gpu), ceil(cpu / sku.cpu), ceil(memoryMB / sku.memory))

and at least one cell.  :class:`~apiary.scheduler.hived.HivedScheduler` and the simulator's
baselines (:mod:`apiary.sim.policies`) both call :func:`leaf_cells_needed`, so a job costs the
same number of cells whichever policy places it.
"""

from __future__ import annotations

import math

from apiary.scheduler.types import TaskRequest
from apiary.spec.cluster import SkuType

__all__ = ["UNPLACEABLE", "leaf_cells_needed"]

#: The answer for a task that needs a resource its sku does not have (GPUs or memory on a sku
#: with none): more leaf cells than any node has, so validation rejects the task as too large.
UNPLACEABLE = 1 << 30


def leaf_cells_needed(task: TaskRequest, sku: SkuType) -> int:
    """Leaf cells of ``sku`` one instance of ``task`` needs: ``max(ceil(gpu / sku.gpu),
    ceil(cpu / sku.cpu), ceil(memory_mb / sku.memory_mb), 1)``.

    ``task.gpu`` GPUs, ``task.cpu`` cores, ``task.memory_mb`` MiB against the sku's per-cell
    amounts.  A dimension the task does not ask for (0) does not count, nor one the sku does not
    account (``cpu`` or ``memory`` None, as in HiveD's GPU-only configs); one the sku lacks (0 GPUs
    or 0 MiB) while the task asks for it gives :data:`UNPLACEABLE`.  Never raises.  Called in the
    schedulers' hot loops, so it stays a handful of arithmetic operations.
    """
    need = 1
    if task.gpu > 0:
        need = max(need, math.ceil(task.gpu / sku.gpu) if sku.gpu > 0 else UNPLACEABLE)
    if task.cpu > 0 and sku.cpu is not None:
        # cores are floats: 2.1 cores on 0.7-core cells is 3 cells, though 2.1 / 0.7 > 3.0
        need = max(need, math.ceil(task.cpu / sku.cpu - 1e-9))
    if task.memory_mb > 0 and sku.memory is not None:
        mem = sku.memory_mb or 0  # parsed from the sku's quantity string: read only when needed
        need = max(need, math.ceil(task.memory_mb / mem) if mem > 0 else UNPLACEABLE)
    return need
