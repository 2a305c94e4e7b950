"""The scheduler's value types and its one interface.

The algorithm is pure: it takes state and requests and returns decisions; the live platform and
the simulator drive the same code.  The interface mirrors HiveD's ``SchedulerAlgorithm``
(pkg/algorithm): ``schedule`` ~ Schedule, ``allocate`` ~ AddAllocatedPod, ``release`` ~
DeleteAllocatedPod, ``set_node_health`` ~ AddNode/DeleteNode (health), ``status`` ~
GetClusterStatus, ``reconfigure`` ~ HiveD's reconfiguration on restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # the value types stay importable without the config models
    from apiary.spec.cluster import ClusterConfig

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
    """The scheduling algorithm behind the platform and the simulator (see module docstring).

    Implementations: :class:`~apiary.scheduler.hived.HivedScheduler` (the platform's) and the
    simulator's baselines (:mod:`apiary.sim.policies`).  Every method is a pure function of the
    call history: no I/O, clock, threads or randomness; the caller serialises calls.  Units are
    leaf cells (a sku's ``gpu`` GPUs each) unless a method says otherwise.  A group is named by
    ``GroupRequest.name`` (one per job attempt; the caller keeps names unique).
    """

    def validate(self, request: GroupRequest) -> None:
        """Submission-time check of one group against the cluster config; changes nothing.

        Raises ValidationError (field = the job spec's dotted path) for a request that no state of
        this cluster could place (HivedScheduler: unknown VC, sku or pinned cell, priority outside
        -1..1000, no task role, a task larger than any node it may use) and QuotaExceededError for a
        gang larger than its VC ("Job requests N SKUs, exceeds maximum M SKUs in VC X.").
        Idempotent.
        """
        ...

    def schedule(self, request: GroupRequest) -> Decision:
        """Decide for one waiting group: ``place`` (placements for its pending instances; nothing is
        committed until :meth:`allocate`), ``preempt`` (stop ``victims``; their cells are reserved
        for this group) or ``wait`` (``reason`` says why).

        Raises like :meth:`validate`.  Idempotent for the same group and state: asking again returns
        the same decision (a reservation is kept, not made twice).
        """
        ...

    def allocate(self, name: str, request: GroupRequest, placements: Sequence[TaskPlacement]) -> None:
        """Commit ``placements`` of group ``name`` (HiveD AddAllocatedPod); also how the caller
        rebuilds the state after a restart, so any consistent placement is accepted, not only one
        :meth:`schedule` returned.

        Raises PlatformError (HivedScheduler) or ValidationError (baselines) for an unknown node, a
        leaf cell that is not free or a placement the group may not use; nothing changes then.
        Idempotent: re-allocating an identical instance is a no-op.
        """
        ...

    def release(self, name: str, tasks: Sequence[tuple[str, int]] | None = None) -> None:
        """Free the cells of group ``name`` (HiveD DeleteAllocatedPod): all of them (``tasks`` None,
        which also drops its reservation) or the given ``(task_role, index)`` instances.  Unknown
        groups and instances are ignored.  Idempotent; never raises.
        """
        ...

    def cancel(self, name: str) -> None:
        """Drop the reservation (HiveD's Preempting state) of a group that no longer waits; its
        placed instances are untouched.  Idempotent; never raises.
        """
        ...

    def set_node_health(self, node: str, healthy: bool) -> None:
        """Mark ``node`` healthy or not (unhealthy or cordoned): an unhealthy node gets no new
        placements; what runs there stays allocated.  Raises ValidationError for an unknown node.
        Idempotent.
        """
        ...

    def nodes(self) -> dict[str, NodeInfo]:
        """Node name -> :class:`NodeInfo` (leaf cells, GPUs, sku) of the cluster config.  Read-only."""
        ...

    def group_of(self, name: str) -> list[TaskPlacement]:
        """The committed placements of group ``name`` (empty when unknown).  Read-only."""
        ...

    def groups(self) -> dict[str, GroupRequest]:
        """The groups holding cells: name -> the request they were last allocated with.  Read-only."""
        ...

    def status(self, vc: str | None = None) -> dict[str, Any]:
        """A JSON-able snapshot, cheap enough to call every scheduling cycle.  Read-only.

        Every implementation returns at least ``nodes`` {node: {leafCells, healthy, used: {group:
        leaf cells}}}, ``groups`` {group: {vc, priority, placements: [{task: "role[i]", node,
        leafCells: [int]}]}} and ``virtualClusters`` {vc: {...}} (per-VC usage, in the unit the
        implementation documents; empty for a scheduler without VCs), and may add more.  ``vc``
        narrows the answer to one VC's groups (and the nodes they use); raises ValidationError for
        a VC the cluster config does not define.
        """
        ...

    def reconfigure(self, new_config: ClusterConfig) -> dict[str, str]:
        """Apply a changed cluster config while groups hold cells (HiveD reconfiguration).

        Groups that still fit keep their placements; returns {group: explanation} for every group
        dropped because it no longer fits (the caller stops or retries it).  Raises ValidationError
        with nothing changed when ``new_config`` is illegal or the implementation cannot apply a
        new config (the simulator's baselines).  Idempotent in effect: a second call with the same
        config drops nothing more and returns {}.
        """
        ...
