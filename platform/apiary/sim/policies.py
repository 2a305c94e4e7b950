"""Baseline scheduling policies with the :class:`~apiary.scheduler.types.SchedulerAlgorithm` interface.

Pure (no I/O, clock or randomness), so the replay loop drives them exactly like ``HivedScheduler``:

* :class:`QuotaScheduler` (``quota``): per-VC GPU-count quotas without topology guarantees, like
  YARN's capacity scheduler.  A group starts when its VC's used GPUs plus its own stay within the
  VC's quota (the GPUs of the VC's virtual cells in the cluster config) and its tasks fit on nodes
  anywhere in the cluster, each task on the first node (config order) with enough free leaf cells.
  Opportunistic groups (priority -1) skip the quota check.  No preemption.
* :class:`FifoScheduler` (``fifo``): one queue, no VCs, first fit anywhere.  No preemption.

Leaf cells per task follow HiveD: ``max(ceil(gpu/sku.gpu), ceil(cpu/sku.cpu), ceil(memory/sku.memory))``
(:func:`apiary.scheduler.sizing.leaf_cells_needed`, the rule HiveD uses too).  Both implement the
whole interface; ``reconfigure`` is not supported (a replay runs on one cluster config) and raises
ValidationError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from apiary.errors import QuotaExceededError, ValidationError
from apiary.scheduler import unknown_vc_message
from apiary.scheduler.sizing import leaf_cells_needed
from apiary.scheduler.types import Decision, GroupRequest, NodeInfo, TaskPlacement, TaskRequest
from apiary.sim.cluster import vc_gpus
from apiary.spec.cluster import ClusterConfig, PhysicalCell

__all__ = ["FifoScheduler", "QuotaScheduler", "config_nodes"]


def config_nodes(config: ClusterConfig) -> list[NodeInfo]:
    """The nodes of a cluster config in physical-cell order."""
    out: list[NodeInfo] = []
    types = config.physical_cluster.cell_types
    skus = config.physical_cluster.sku_types

    def walk(cell: PhysicalCell, t: str) -> None:
        ct = types.get(t)
        if ct is None:
            return
        if ct.is_node_level:
            sku = config.leaf_sku(t)
            leaves = config.leaf_count(t)
            out.append(NodeInfo(str(cell.cell_address), leaves, leaves * skus[sku].gpu, sku))
            return
        for ch in cell.cell_children:
            walk(ch, ch.cell_type or ct.child_cell_type)

    for c in config.physical_cluster.physical_cells:
        walk(c, c.cell_type or "")
    return out


class _MaxTree:
    """Segment tree over node positions holding free leaf counts; leftmost position with >= n."""

    def __init__(self, values: list[int]) -> None:
        self.n = 1
        while self.n < max(len(values), 1):
            self.n *= 2
        self.t = [0] * (2 * self.n)
        for i, v in enumerate(values):
            self.t[self.n + i] = v
        for i in range(self.n - 1, 0, -1):
            self.t[i] = max(self.t[2 * i], self.t[2 * i + 1])

    def set(self, i: int, v: int) -> None:
        i += self.n
        self.t[i] = v
        i //= 2
        while i:
            self.t[i] = max(self.t[2 * i], self.t[2 * i + 1])
            i //= 2

    def first(self, need: int) -> int:
        if self.t[1] < need:
            return -1
        i = 1
        while i < self.n:
            i = 2 * i if self.t[2 * i] >= need else 2 * i + 1
        return i - self.n


@dataclass
class _Group:
    request: GroupRequest
    placements: dict[tuple[str, int], TaskPlacement] = field(default_factory=dict)


class _FirstFit:
    """Shared node bookkeeping of the baselines: free leaf cells per node, first-fit placement."""

    policy = "first-fit"  # the policy's name, for messages
    uses_quota = False

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._skus = config.physical_cluster.sku_types
        self._nodes = config_nodes(config)
        self._pos = {n.name: i for i, n in enumerate(self._nodes)}
        self._free: list[list[int]] = [list(range(n.leaf_cells)) for n in self._nodes]
        self._healthy = [True] * len(self._nodes)
        self._trees: dict[str, _MaxTree] = {}
        for sku in {n.sku_type for n in self._nodes}:
            self._trees[sku] = _MaxTree([n.leaf_cells if n.sku_type == sku else 0 for n in self._nodes])
        self._groups: dict[str, _Group] = {}
        self._max_leaves = {s: max((n.leaf_cells for n in self._nodes if n.sku_type == s), default=0)
                            for s in self._trees}
        self.total_gpus = sum(n.gpus for n in self._nodes)
        self.used_gpus = 0

    # ---------------------------------------------------------------- helpers
    def _need(self, task: TaskRequest, sku: str) -> int:
        return leaf_cells_needed(task, self._skus[sku])

    def _skus_for(self, task: TaskRequest) -> list[str]:
        return [task.sku_type] if task.sku_type is not None else sorted(self._trees)

    def _tree_value(self, i: int) -> int:
        return len(self._free[i]) if self._healthy[i] else 0

    def _gpus(self, sku: str, leaves: Sequence[int]) -> tuple[int, ...]:
        g = self._skus[sku].gpu
        return tuple(x * g + k for x in sorted(leaves) for k in range(g))

    def _check_shape(self, request: GroupRequest) -> None:
        if not request.tasks:
            raise ValidationError("taskRoles", "a job needs at least one task role")
        for t in request.tasks:
            if t.instances < 1:
                raise ValidationError(f"taskRoles.{t.task_role}.instances", "must be >= 1")
            if t.sku_type is not None and t.sku_type not in self._trees:
                raise ValidationError(f"extras.hivedScheduler.taskRoles.{t.task_role}.skuType",
                                      f"unknown sku type {t.sku_type!r}")
            if not any(self._need(t, s) <= self._max_leaves[s] for s in self._skus_for(t)):
                raise ValidationError(f"taskRoles.{t.task_role}.resourcePerInstance",
                                      "needs more leaf cells than any node of the cluster has")

    @staticmethod
    def request_gpus(request: GroupRequest, pending: Sequence[tuple[str, int]] | None = None) -> int:
        if pending is None:
            return sum(t.instances * t.gpu for t in request.tasks)
        by = {t.task_role: t.gpu for t in request.tasks}
        return sum(by[r] for r, _ in pending)

    def _admit(self, request: GroupRequest, pending: tuple[tuple[str, int], ...]) -> str | None:
        """A reason the group may not start now regardless of placement, or None."""
        return None

    def _fit(self, request: GroupRequest, pending: tuple[tuple[str, int], ...]) -> list[TaskPlacement]:
        taken: list[tuple[int, str, list[int]]] = []
        out: list[TaskPlacement] = []
        try:
            for role, idx in pending:
                task = request.task(role)
                placed = False
                for sku in self._skus_for(task):
                    need = self._need(task, sku)
                    i = self._trees[sku].first(need)
                    if i < 0:
                        continue
                    leaves, self._free[i] = self._free[i][:need], self._free[i][need:]
                    self._trees[sku].set(i, self._tree_value(i))
                    taken.append((i, sku, leaves))
                    out.append(TaskPlacement(role, idx, self._nodes[i].name, tuple(leaves), self._gpus(sku, leaves)))
                    placed = True
                    break
                if not placed and request.gang:
                    return []
            return out
        finally:
            for i, sku, leaves in taken:  # schedule() is a query: undo the trial
                self._free[i] = sorted(self._free[i] + leaves)
                self._trees[sku].set(i, self._tree_value(i))

    # ---------------------------------------------------------------- interface
    def validate(self, request: GroupRequest) -> None:
        self._check_shape(request)

    def schedule(self, request: GroupRequest) -> Decision:
        pending = request.pending_instances()
        if not pending:
            return Decision("place", (), reason="Nothing to place.")
        why = self._admit(request, pending)
        if why is not None:
            return Decision("wait", reason=why)
        placements = self._fit(request, pending)
        if not placements:
            free = self.total_gpus - self.used_gpus
            return Decision("wait", reason=f"Waiting for resources: no node fits the tasks ({free} GPUs free).")
        return Decision("place", tuple(placements), reason=f"Placed {len(placements)} of {len(pending)} tasks.")

    def allocate(self, name: str, request: GroupRequest, placements: Sequence[TaskPlacement]) -> None:
        """Commit ``placements`` (see the protocol).  Raises ValidationError, with nothing changed,
        for an unknown node or a leaf cell that is not free; an instance already placed is skipped."""
        g = self._groups.get(name)
        new: list[tuple[int, TaskPlacement]] = []
        claimed: dict[int, set[int]] = {}  # node position -> leaves taken by this call
        for pl in placements:  # check everything first: a refused call changes nothing
            if g is not None and (pl.task_role, pl.index) in g.placements:
                continue
            i = self._pos.get(pl.node)
            if i is None:
                raise ValidationError("placements", f"allocate {name}: unknown node {pl.node!r}")
            want = set(pl.leaf_cell_indices)
            taken = claimed.setdefault(i, set())
            if not want <= set(self._free[i]) or want & taken:
                raise ValidationError("placements", f"allocate {name}: leaf cells {sorted(want)} of {pl.node} not free")
            taken |= want
            new.append((i, pl))
        if g is None:
            g = self._groups[name] = _Group(request)
        for i, pl in new:
            want = set(pl.leaf_cell_indices)
            self._free[i] = [x for x in self._free[i] if x not in want]
            self._trees[self._nodes[i].sku_type].set(i, self._tree_value(i))
            g.placements[(pl.task_role, pl.index)] = pl
            self._on_use(g.request, len(pl.gpus))
        if not g.placements:
            del self._groups[name]

    def _on_use(self, request: GroupRequest, gpus: int) -> None:
        self.used_gpus += gpus

    def release(self, name: str, tasks: Sequence[tuple[str, int]] | None = None) -> None:
        g = self._groups.get(name)
        if g is None:
            return
        keys = list(g.placements) if tasks is None else [(role, index) for role, index in tasks]
        for key in keys:
            pl = g.placements.pop(key, None)
            if pl is None:
                continue
            i = self._pos[pl.node]
            self._free[i] = sorted(self._free[i] + list(pl.leaf_cell_indices))
            self._trees[self._nodes[i].sku_type].set(i, self._tree_value(i))
            self._on_use(g.request, -len(pl.gpus))
        if not g.placements:
            del self._groups[name]

    def cancel(self, name: str) -> None:
        """No reservations (these policies never preempt)."""

    def set_node_health(self, node: str, healthy: bool) -> None:
        """An unhealthy node gets no new placements (see the protocol)."""
        if node not in self._pos:
            raise ValidationError("node", f"unknown node {node!r}")
        i = self._pos[node]
        self._healthy[i] = healthy
        self._trees[self._nodes[i].sku_type].set(i, self._tree_value(i))

    def nodes(self) -> dict[str, NodeInfo]:
        return {n.name: n for n in self._nodes}

    def group_of(self, name: str) -> list[TaskPlacement]:
        g = self._groups.get(name)
        return list(g.placements.values()) if g else []

    def groups(self) -> dict[str, GroupRequest]:
        return {n: g.request for n, g in self._groups.items()}

    def status(self, vc: str | None = None) -> dict[str, Any]:
        """The protocol's ``nodes`` (plus ``free`` leaf cells), ``groups`` and ``virtualClusters``
        (in GPUs: see the subclasses), and ``totalGpus`` / ``usedGpus`` of the whole cluster.
        ``vc`` keeps that VC's groups and the nodes they use; ValidationError for a VC the
        cluster config does not define."""
        if vc is not None and vc not in self.config.virtual_clusters:
            raise ValidationError("vc", unknown_vc_message(vc, list(self.config.virtual_clusters)))
        groups = {
            name: {
                "vc": g.request.virtual_cluster,
                "priority": g.request.priority,
                "placements": [
                    {"task": f"{p.task_role}[{p.index}]", "node": p.node, "leafCells": list(p.leaf_cell_indices)}
                    for p in g.placements.values()
                ],
            }
            for name, g in self._groups.items()
            if vc is None or g.request.virtual_cluster == vc
        }
        nodes: dict[str, dict[str, Any]] = {
            n.name: {"leafCells": n.leaf_cells, "healthy": self._healthy[i], "free": len(self._free[i]), "used": {}}
            for i, n in enumerate(self._nodes)
        }
        for name in groups:
            for p in self._groups[name].placements.values():
                used = nodes[p.node]["used"]
                used[name] = used.get(name, 0) + len(p.leaf_cell_indices)
        if vc is not None:
            nodes = {n: row for n, row in nodes.items() if row["used"]}
        return {
            "totalGpus": self.total_gpus,
            "usedGpus": self.used_gpus,
            "nodes": nodes,
            "groups": groups,
            "virtualClusters": self._vc_status(vc),
        }

    def _vc_status(self, vc: str | None) -> dict[str, dict[str, int]]:
        return {}  # no VCs (fifo)

    def reconfigure(self, new_config: ClusterConfig) -> dict[str, str]:
        """Not supported: a baseline serves one replay on one cluster config.  Always raises
        ValidationError (nothing changes); replay again with the new config instead."""
        raise ValidationError(
            "config", f"the {self.policy} baseline does not support reconfiguration; replay with the new cluster config"
        )


class FifoScheduler(_FirstFit):
    """``fifo``: one queue, no VCs, first fit (see module docstring)."""

    policy = "fifo"

    def validate(self, request: GroupRequest) -> None:
        self._check_shape(request)
        n = self.request_gpus(request)
        if n > self.total_gpus:
            raise QuotaExceededError(f"Job requests {n} GPUs, exceeds the cluster's {self.total_gpus} GPUs.")


class QuotaScheduler(_FirstFit):
    """``quota``: per-VC GPU-count quotas, no topology guarantee (see module docstring)."""

    policy = "quota"
    uses_quota = True

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config)
        self.quota = vc_gpus(config)
        self.vc_used = {v: 0 for v in self.quota}

    def validate(self, request: GroupRequest) -> None:
        vc = request.virtual_cluster
        if vc not in self.quota:
            raise ValidationError("defaults.virtualCluster", unknown_vc_message(vc, list(self.quota)))
        self._check_shape(request)
        n = self.request_gpus(request)
        if not request.opportunistic and request.gang and n > self.quota[vc]:
            raise QuotaExceededError(f"Job requests {n} GPUs, exceeds maximum {self.quota[vc]} GPUs in VC {vc}.")

    def _admit(self, request: GroupRequest, pending: tuple[tuple[str, int], ...]) -> str | None:
        if request.opportunistic:
            return None
        vc = request.virtual_cluster
        n = self.request_gpus(request, pending if request.gang else pending[:1])
        if self.vc_used[vc] + n > self.quota[vc]:
            return (f"Waiting for quota: VC {vc} uses {self.vc_used[vc]} of {self.quota[vc]} GPUs; "
                    f"this job needs {n} more.")
        return None

    def _fit(self, request: GroupRequest, pending: tuple[tuple[str, int], ...]) -> list[TaskPlacement]:
        out = super()._fit(request, pending)
        if request.opportunistic or request.gang:
            return out
        room = self.quota[request.virtual_cluster] - self.vc_used[request.virtual_cluster]
        kept = []
        for p in out:  # incremental: only as many tasks as the quota allows
            if len(p.gpus) > room:
                break
            room -= len(p.gpus)
            kept.append(p)
        return kept

    def _on_use(self, request: GroupRequest, gpus: int) -> None:
        super()._on_use(request, gpus)
        if not request.opportunistic:
            self.vc_used[request.virtual_cluster] += gpus

    def _vc_status(self, vc: str | None) -> dict[str, dict[str, int]]:
        """Per VC, in GPUs: ``quotaGpus`` and ``usedGpus`` (guaranteed groups only)."""
        return {
            v: {"quotaGpus": q, "usedGpus": self.vc_used[v]}
            for v, q in self.quota.items()
            if vc is None or v == vc
        }
