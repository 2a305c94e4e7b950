"""The scheduler's value types and its one interface.

The algorithm is pure: it takes state and requests and returns decisions; the live platform and
the simulator drive the same code.  The interface mirrors HiveD's ``SchedulerAlgorithm``
(pkg/algorithm): ``schedule`` ~ Schedule, ``allocate`` ~ AddAllocatedPod, ``release`` ~
DeleteAllocatedPod, ``status`` ~ GetClusterStatus.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

#: OpenPAI's jobPriorityClass -> HiveD priority (rest-server); guaranteed is 0..1000, oppo is -1.
PRIORITY_CLASSES: dict[str, int] = {"crit": 120, "prod": 100, "test": 10, "oppo": -1}
OPPORTUNISTIC_PRIORITY = -1
MAX_GUARANTEED_PRIORITY = 1000


def priority_label(priority: int) -> str:
    """``prod`` for 100, ``opportunistic`` for -1, ``priority 7`` otherwise."""
    if priority == OPPORTUNISTIC_PRIORITY:
        return "opportunistic"
    for name, p in PRIORITY_CLASSES.items():
        if p == priority:
            return name
    return f"priority {priority}"


@dataclass(frozen=True)
class TaskRequest:
    """One task role of a job: ``instances`` instances of ``resourcePerInstance``.

    ``gpu`` count, ``cpu`` cores, ``memory_mb`` MiB per instance.  ``sku_type`` is
    ``extras.hivedScheduler.taskRoles.<tr>.skuType`` (a leaf cell type; None = any the VC has);
    ``pinned_cell_id`` restricts the task to that pinned cell.
    """

    task_role: str
    instances: int
    gpu: int
    cpu: float
    memory_mb: int
    sku_type: str | None = None
    pinned_cell_id: str | None = None


@dataclass(frozen=True)
class GroupRequest:
    """One HiveD affinity group = the current attempt of one job.

    ``priority``: crit 120, prod 100, test 10 (guaranteed, 0..1000); -1 = opportunistic.
    ``gang``: True places all pending instances at once or none; False places incrementally.
    ``pending``: the ``(task_role, index)`` pairs still to place; None = all instances.
    ``lazy_preemption``: when this group is preempted, downgrade it to opportunistic first and kill it
    only if its cells are really needed (HiveD ``lazyPreemptionEnable``); None = the scheduler's
    default.
    """

    name: str
    virtual_cluster: str
    priority: int
    gang: bool
    tasks: tuple[TaskRequest, ...]
    pending: tuple[tuple[str, int], ...] | None = None
    lazy_preemption: bool | None = None

    @property
    def opportunistic(self) -> bool:
        return self.priority < 0

    def pending_instances(self) -> tuple[tuple[str, int], ...]:
        if self.pending is not None:
            return self.pending
        return tuple((t.task_role, i) for t in self.tasks for i in range(t.instances))

    def task(self, task_role: str) -> TaskRequest:
        for t in self.tasks:
            if t.task_role == task_role:
                return t
        raise KeyError(task_role)


@dataclass(frozen=True)
class TaskPlacement:
    """Where one instance runs: node name, leaf cell indices within the node (0-based) and the
    GPU indices on the node (leaf ``i`` of a sku with ``g`` GPUs owns GPUs ``i*g .. i*g+g-1``)."""

    task_role: str
    index: int
    node: str
    leaf_cell_indices: tuple[int, ...]
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Decision:
    """The answer for one waiting group.

    ``place``: ``placements`` are the instances to place now (all pending for gang, >= 1 for
    incremental); the caller commits them with ``allocate``.  ``preempt``: stop ``victims``; their
    cells are reserved for this group.  ``wait``: nothing now.  ``reason`` is always a sentence;
    for wait/preempt it is the job's waiting reason.  ``downgraded`` (lazy preemption only): groups
    that run on as opportunistic from now on (not stopped); ``victims`` are always "stop these now".
    """

    kind: Literal["place", "preempt", "wait"]
    placements: tuple[TaskPlacement, ...] = ()
    victims: tuple[str, ...] = ()
    reason: str = ""
    downgraded: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeInfo:
    """One node as node agents advertise it: ``leaf_cells`` leaf cells of ``sku_type``, ``gpus`` GPUs."""

    name: str
    leaf_cells: int
    gpus: int
    sku_type: str


@runtime_checkable
class SchedulerAlgorithm(Protocol):
    """The scheduling algorithm behind the platform and the simulator (see module docstring)."""

    def validate(self, request: GroupRequest) -> None: ...

    def schedule(self, request: GroupRequest) -> Decision: ...

    def allocate(self, name: str, request: GroupRequest, placements: Sequence[TaskPlacement]) -> None: ...

    def release(self, name: str, tasks: Sequence[tuple[str, int]] | None = None) -> None: ...

    def cancel(self, name: str) -> None: ...

    def set_node_health(self, node: str, healthy: bool) -> None: ...

    def nodes(self) -> dict[str, NodeInfo]: ...

    def status(self) -> dict: ...

    def group_of(self, name: str) -> list[TaskPlacement]: ...
