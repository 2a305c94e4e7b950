"""Building a :class:`GroupRequest` from an OpenPAI job spec: one definition shared by the control
plane and the simulator, so both ask the scheduler exactly the same question for a job."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from apiary.scheduler.types import GroupRequest, TaskRequest

if TYPE_CHECKING:  # the scheduler stays independent of the job-spec package at import time
    from apiary.spec.job import JobSpec


def group_request(job_id: str, spec: JobSpec, pending: Sequence[tuple[str, int]] | None = None) -> GroupRequest:
    """The affinity group of one job: a TaskRequest per task role (resourcePerInstance, skuType and
    pinnedCellId from ``extras.hivedScheduler``), the job's VC, priority and gang flag; ``pending``
    lists the (taskRole, index) instances still to place (None: all)."""
    tasks = tuple(
        TaskRequest(
            task_role=role,
            instances=tr.instances,
            gpu=tr.resource_per_instance.gpu,
            cpu=tr.resource_per_instance.cpu,
            memory_mb=tr.resource_per_instance.memory_mb,
            sku_type=spec.sku_type(role),
            pinned_cell_id=spec.pinned_cell_id(role),
        )
        for role, tr in spec.task_roles.items()
    )
    return GroupRequest(
        name=job_id,
        virtual_cluster=spec.virtual_cluster,
        priority=spec.priority,
        gang=spec.gang,
        tasks=tasks,
        pending=tuple(pending) if pending is not None else None,
    )
