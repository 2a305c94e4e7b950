"""HiveD scheduling semantics for OpenPAI jobs, as a pure algorithm.

Rules and their sources:

* VC safety: a guaranteed group (priority 0..1000) uses only cells bound to its own VC's virtual cells,
  even when other VCs are idle (HiveD paper section 3, user manual "VC Safety").  Virtual cells bind
  LAZILY (paper section 4.2; doc/design/state-machine.md): when first used, by buddy allocation, and
  unbind when freed; the safety invariant of :class:`~apiary.scheduler.cells.Chain` is checked on every
  binding (a binding that would break it is refused; :meth:`HivedScheduler.check_invariants` verifies
  the whole state and raises PlatformError on any violation).
* Opportunistic groups (priority -1) use any free unpinned cell of the cluster, never preempt, and are
  preempted by guaranteed groups that need the cell (user manual "Opportunistic Job"; inter-VC
  preemption).  Where: leaf cells no VC holds first (best fit); when those have no room, HiveD's
  order for opportunistic pods (``topology_aware_scheduler.go`` with ``crossPriorityPack`` false):
  the node with the most leaf cells used by opportunistic groups, then the fewest used by guaranteed
  groups or reserved, then config order (:func:`~apiary.scheduler.placement.opportunistic_fit`).
  HiveD uses that order alone; taking unbound cells first is Apiary's, and keeps opportunistic work
  off the nodes the VCs are using (with HiveD's order alone the scheduler bench preempted about twice
  as often).
* Intra-VC preemption (:mod:`~apiary.scheduler.preemption`): a guaranteed group preempts strictly
  lower priority groups of its VC and opportunistic groups on its VC's cells; the preempted cells are
  *reserved* for it (HiveD "Preempting" state); a higher priority preemptor supersedes a lower one.
  Victims: the fewest, taken opportunistic first, then lower priority first, the most recently
  started first (Apiary's rule; HiveD instead packs across priorities, the node with the most leaf
  cells in use that has room at the request's priority, and stops what runs on the cells it picks).
  Lazy preemption (constructor ``lazy_preemption`` or ``GroupRequest.lazy_preemption`` of the
  victim): victims are first downgraded to opportunistic (``Decision.downgraded``) and killed only
  when the preemptor really needs their cells.
* Gang: all pending instances at once or none (OpenPAI ``extras.gangAllocation``, HiveD affinity
  group); incremental groups place as many as fit.  A waiting gang reserves nothing unless it
  preempts, so it never blocks smaller jobs (no head-of-line blocking).
* Each task on one node; pack by best fit and keep a group under its lowest common ancestor cell
  (HiveD topology-aware placement; :mod:`~apiary.scheduler.placement`).  Ties: among segments with
  the same free count, the one that has had that count longest (config order on a fresh cluster);
  among cells to bind, config order (:mod:`~apiary.scheduler.allocation`).  HiveD takes the first in
  its free list, whose order depends on the history of splits and merges.
* Leaf cells per task = max(ceil(gpu/sku.gpu), ceil(cpu/sku.cpu), ceil(memory/sku.memory)), >= 1
  (OpenPAI rest-server; :func:`~apiary.scheduler.sizing.leaf_cells_needed`); a gang job larger
  than its VC is rejected with OpenPAI's message.
* Bad nodes (unhealthy or cordoned) get no new placements; bindings prefer healthy cells;
  ``status()`` reports per VC the virtual cells that only bad hardware can satisfy ("doomed").

Units: leaf cells (``gpu`` GPUs each), MiB, cores.  Errors: ValidationError / QuotaExceededError for
requests, PlatformError for inconsistent allocations or a broken invariant.

No I/O, clock, threads or randomness: every call is a deterministic function of the call history.

Layout, along HiveD's files: :mod:`~apiary.scheduler.allocation` (``cell_allocation.go``: state, buddy
binding), :mod:`~apiary.scheduler.preemption` (reservations, victims),
:mod:`~apiary.scheduler.intra_vc` (``intra_vc_scheduler.go``), :mod:`~apiary.scheduler.placement`
(``topology_aware_scheduler.go``), :mod:`~apiary.scheduler.inspection` (status, invariants) and this
module (``hived_algorithm.go``: the entry points).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from apiary.errors import PlatformError, QuotaExceededError, ValidationError
from apiary.scheduler.allocation import Group, unknown_vc_message
from apiary.scheduler.cells import ALL_VCS, BOUND, Cell, PoolKey
from apiary.scheduler.inspection import Inspection
from apiary.scheduler.placement import (
    Fit,
    Instance,
    Item,
    Source,
    best_option,
    combine,
    fit_items,
    opportunistic_fit,
)
from apiary.scheduler.types import (
    MAX_GUARANTEED_PRIORITY,
    Decision,
    GroupRequest,
    NodeInfo,
    TaskPlacement,
    TaskRequest,
)
from apiary.spec.cluster import ClusterConfig

__all__ = ["HivedScheduler"]


class HivedScheduler(Inspection):
    """HiveD semantics over one :class:`~apiary.spec.cluster.ClusterConfig`.

    Implements :class:`~apiary.scheduler.types.SchedulerAlgorithm`.  Construction builds the cell
    tree and checks that every VC's virtual cells fit (raises ValidationError naming the VC and level
    on an impossible assignment).  ``lazy_preemption``: default for groups whose request does not say.
    The layers below (cell allocation, preemption, intra-VC scheduling, inspection) hold the state
    and the steps; this class is the algorithm's entry points.
    """

    def _sku_options(self, request: GroupRequest) -> list[dict[str, str]]:
        """Candidate task_role -> sku assignments (a pinned cell fixes its sku)."""
        fixed: dict[str, str] = {}
        for t in request.tasks:
            if t.pinned_cell_id is not None:
                fixed[t.task_role] = self.topo.pinned[t.pinned_cell_id].sku
            elif t.sku_type is not None:
                fixed[t.task_role] = t.sku_type
        free = [t.task_role for t in request.tasks if t.task_role not in fixed]
        if not free:
            return [fixed]
        named = {t.sku_type for t in request.tasks if t.sku_type is not None}
        if len(named) == 1:
            cands = list(named)
        elif request.opportunistic:
            cands = self._cluster_skus
        else:
            cands = self._vc_skus.get(request.virtual_cluster, [])
        return [{**fixed, **{tr: s for tr in free}} for s in cands] or [fixed]

    # ------------------------------------------------------------------ validate
    def validate(self, request: GroupRequest) -> None:
        """Submission-time checks (OpenPAI rest-server + HiveD webserver).

        Raises ValidationError for an unknown VC (``defaults.virtualCluster``), a priority outside
        -1..1000, an unknown skuType or pinnedCellId, a pinned cell of another VC, or a task that
        needs more leaf cells than any node of its VC (the whole cluster for opportunistic jobs)
        has; QuotaExceededError "Job requests N SKUs, exceeds maximum M SKUs in VC X." for a gang
        job larger than its VC.
        """
        vc = request.virtual_cluster
        if vc not in self._unbound:
            raise ValidationError("defaults.virtualCluster", unknown_vc_message(vc, self._vcs))
        if not (request.priority == -1 or 0 <= request.priority <= MAX_GUARANTEED_PRIORITY):
            raise ValidationError(
                "extras.hivedScheduler.jobPriorityClass",
                f"priority {request.priority} is neither -1 (opportunistic) nor in 0..{MAX_GUARANTEED_PRIORITY}",
            )
        if not request.tasks:
            raise ValidationError("taskRoles", "a job needs at least one task role")
        for t in request.tasks:
            base = f"extras.hivedScheduler.taskRoles.{t.task_role}"
            if t.instances < 1:
                raise ValidationError(f"taskRoles.{t.task_role}.instances", "must be >= 1")
            if t.sku_type is not None and t.sku_type not in self._skus:
                raise ValidationError(f"{base}.skuType", f"unknown sku type {t.sku_type!r}")
            if t.pinned_cell_id is not None:
                if t.pinned_cell_id not in self.topo.pinned:
                    raise ValidationError(f"{base}.pinnedCellId", f"unknown pinned cell {t.pinned_cell_id!r}")
                owner = self.topo.pinned_vc.get(t.pinned_cell_id)
                if owner != vc:
                    raise ValidationError(f"{base}.pinnedCellId", f"pinned cell {t.pinned_cell_id!r} is not in VC {vc}")
                psku = self.topo.pinned[t.pinned_cell_id].sku
                if t.sku_type is not None and t.sku_type != psku:
                    raise ValidationError(f"{base}.skuType", f"pinned cell {t.pinned_cell_id!r} has sku {psku}")
        last: Exception | None = None
        for option in self._sku_options(request):
            try:
                self._validate_option(request, option)
                return
            except (ValidationError, QuotaExceededError) as e:
                last = e
        if last is None:
            raise ValidationError("defaults.virtualCluster", f"VC {vc} has no cells")
        raise last

    def _scope(self, request: GroupRequest, t: TaskRequest) -> str:
        return ALL_VCS if request.opportunistic and t.pinned_cell_id is None else request.virtual_cluster

    def _validate_option(self, request: GroupRequest, option: dict[str, str]) -> None:
        vc = request.virtual_cluster
        total_need = 0
        quota_keys: set[PoolKey] = set()
        for t in request.tasks:
            sku = option.get(t.task_role)
            if sku is None:
                raise ValidationError("defaults.virtualCluster", f"VC {vc} has no cells")
            need = self._leaf_need(t, sku)
            scope = self._scope(request, t)
            key: PoolKey = (scope, t.pinned_cell_id, sku)
            biggest = self._pool_max.get(key, 0)
            if need > biggest:
                where = "the cluster" if scope == ALL_VCS else f"VC {vc}"
                raise ValidationError(
                    f"taskRoles.{t.task_role}.resourcePerInstance",
                    f"each instance needs {need} {sku} leaf cell(s) on one node, but the largest node in "
                    f"{where} has {biggest}",
                )
            total_need += need * t.instances
            quota_keys.add(key)
        if request.gang:
            cap = sum(self._pool_leaves.get(k, 0) for k in quota_keys)
            if total_need > cap:
                where = f"VC {vc}" if not request.opportunistic else "the cluster"
                raise QuotaExceededError(f"Job requests {total_need} SKUs, exceeds maximum {cap} SKUs in {where}.")

    # ------------------------------------------------------------------ schedule
    def schedule(self, request: GroupRequest) -> Decision:
        """Decide for one waiting group: ``place`` (not committed), ``preempt`` (cells reserved) or
        ``wait``.  Idempotent for the same group and state.  Raises like :meth:`validate`."""
        self.validate(request)
        name = request.name
        placed = self._groups[name].placements if name in self._groups else {}
        pending = tuple(i for i in request.pending_instances() if i not in placed)
        if not pending:
            return Decision("wait", reason=f"All instances of {name} are already placed.")
        self._plans.pop(name, None)
        res = self._reservations.get(name)
        if res is not None:
            d = self._resume_reservation(request, res, pending)
            if d is not None:
                return d
        options = self._sku_options(request)
        try:
            if request.opportunistic:
                return self._schedule_oppo(request, pending, options)
            d = self._schedule_guaranteed(request, pending, options)
            if d.kind == "wait" and d.downgraded and d.reason == "lazy":
                # lazy preemption: victims now run opportunistically; plan again, kill only if needed
                self._gc()
                d2 = self._schedule_guaranteed(request, pending, options)
                d = replace(d2, downgraded=d.downgraded + d2.downgraded)
                if d.kind == "preempt" and name in self._reservations:
                    self._reservations[name].downgraded = d.downgraded
            return d
        finally:
            self._gc()

    def _schedule_oppo(
        self, request: GroupRequest, pending: tuple[Instance, ...], options: list[dict[str, str]]
    ) -> Decision:
        """Place an opportunistic group anywhere in the cluster, in HiveD's node order for
        opportunistic pods (:func:`~apiary.scheduler.placement.opportunistic_fit`); a task on a
        pinned cell only in its VC's pinned cell.  Never preempts: otherwise it waits."""

        def fit_anywhere(key: tuple[str | None, str], items: list[Item]) -> Fit | None:
            pinned, sku = key
            if pinned is not None:
                idx = self._index.get((request.virtual_cluster, pinned, sku))
                return fit_items(items, Source(index=idx), request.gang) if idx is not None else None
            unbound = self._index.get((None, None, sku))  # cells no VC holds: away from guaranteed work
            if unbound is not None and (r := fit_items(items, Source(index=unbound), request.gang)):
                return r
            idx = self._index.get((ALL_VCS, None, sku))
            return opportunistic_fit(items, idx, request.gang) if idx is not None else None

        best = best_option(
            request, options, lambda option: combine(request, self._items(request, pending, option), fit_anywhere)
        )
        if best:
            pl = self._placements(best)
            return Decision("place", pl, reason=self._place_reason(request, pl, len(pending)))
        return Decision("wait", reason=self._wait_reason(request, pending, options[0]))

    def allocate(self, name: str, request: GroupRequest, placements: Sequence[TaskPlacement]) -> None:
        """Commit placements (HiveD AddAllocatedPod); also rebuilds state after a restart.

        Accepts any physically consistent placement (known node, existing leaf indices, GPUs that
        match the leaves) that the group may use: for a guaranteed group, leaves its VC has bound or
        can bind (lazy binding, safety kept); for an opportunistic one, unpinned leaves.  Raises
        PlatformError when a leaf is used by another group, the placement is inconsistent or the VC
        has no quota for it; re-allocating an identical instance is a no-op.  Reservations that
        overlap are dropped (the other preemptor schedules again).
        """
        self._allocate(name, request, placements, None)

    def _allocate(
        self, name: str, request: GroupRequest, placements: Sequence[TaskPlacement], plan: list[Cell] | None
    ) -> None:
        """The body of :meth:`allocate`; ``plan``: cells to bind first (None = schedule's plan)."""
        resolved: list[tuple[TaskPlacement, list[Cell]]] = []
        taken: set[int] = set()
        g = self._groups.get(name)
        guaranteed = (g.priority if g is not None else request.priority) >= 0
        for pl in placements:
            node_cells = self.topo.nodes.get(pl.node)
            if node_cells is None:
                raise PlatformError(f"allocate {name}: unknown node {pl.node!r}")
            if not pl.leaf_cell_indices:
                raise PlatformError(f"allocate {name}: {pl.task_role}[{pl.index}] has no leaf cells")
            by_index = {lf.index: lf for c in node_cells for lf in c.leaves}
            leaves = []
            for i in pl.leaf_cell_indices:
                lf = by_index.get(i)
                if lf is None or id(lf) in taken:
                    raise PlatformError(f"allocate {name}: node {pl.node} has no free leaf cell {i} for it")
                taken.add(id(lf))
                leaves.append(lf)
            gpu = self._skus[leaves[0].sku].gpu
            expect = tuple(x * gpu + k for x in sorted(pl.leaf_cell_indices) for k in range(gpu))
            if tuple(sorted(pl.gpus)) != expect:
                raise PlatformError(f"allocate {name}: GPUs {pl.gpus} do not match leaf cells {pl.leaf_cell_indices}")
            key = (pl.task_role, pl.index)
            if g is not None and key in g.placements:
                if g.placements[key].node == pl.node and set(g.placements[key].leaf_cell_indices) == set(
                    pl.leaf_cell_indices
                ):
                    continue
                raise PlatformError(f"allocate {name}: {pl.task_role}[{pl.index}] is already placed elsewhere")
            for lf in leaves:
                if lf.group is not None:
                    raise PlatformError(
                        f"allocate {name}: leaf cell {lf.index} of node {pl.node} is already used by {lf.group}"
                    )
                if lf.pinned_cell_id is not None and not guaranteed:
                    raise PlatformError(f"allocate {name}: leaf cell {lf.index} of node {pl.node} is pinned")
            resolved.append((pl, leaves))
        plan_entry = self._plans.pop(name, None)
        if guaranteed and resolved:
            if plan is None:
                plan = plan_entry[1] if plan_entry is not None and plan_entry[0] == tuple(placements) else []
            new = self._cover(name, request.virtual_cluster, [lf for _, lv in resolved for lf in lv], plan)
            for pl, leaves in resolved:  # a task inside one of its VC's cells (see _seg)
                roots = {id(lf.bound_root()) for lf in leaves if lf.pinned_cell_id is None}
                if len(roots) > 1:
                    for c in reversed(new):
                        if c.state == BOUND and c.hold == 0:
                            self._unbind(c)
                    raise PlatformError(
                        f"allocate {name}: {pl.task_role}[{pl.index}] on {pl.node} would span {len(roots)} of VC "
                        f"{request.virtual_cluster}'s cells; a task must fit inside one"
                    )
        self._cancel(name)
        if g is None:
            self._alloc_seq += 1
            g = self._groups[name] = Group(request, priority=request.priority, seq=self._alloc_seq)
            self._groups_prio[request.virtual_cluster][g.priority][name] = None
        else:
            g.request = request
        for pl, leaves in resolved:
            for lf in leaves:
                if lf.reserved_by is not None and lf.reserved_by != name:
                    self._cancel(lf.reserved_by)
            key = (pl.task_role, pl.index)
            g.placements[key] = pl
            g.leaves[key] = leaves
            for lf in leaves:
                self._set_leaf(lf, name, None)
        if not g.placements:
            self._drop_group(name)
        self._gc()

    def _drop_group(self, name: str) -> None:
        g = self._groups.pop(name)
        self._groups_prio[g.request.virtual_cluster][g.priority].pop(name, None)

    def release(self, name: str, tasks: Sequence[tuple[str, int]] | None = None) -> None:
        """Free the group's cells, all or the given instances (HiveD DeleteAllocatedPod); bound cells
        left without guaranteed use unbind.  Releasing everything also drops the group's
        reservation.  Idempotent."""
        g = self._groups.get(name)
        if tasks is None:
            self._cancel(name)
        if g is not None:
            keys = list(g.placements) if tasks is None else [(role, index) for role, index in tasks]
            for key in keys:
                if key not in g.placements:
                    continue
                for lf in g.leaves.pop(key):
                    self._set_leaf(lf, None, lf.reserved_by)
                del g.placements[key]
            if not g.placements:
                self._drop_group(name)
        self._gc()

    # ------------------------------------------------------------------ queries
    def nodes(self) -> dict[str, NodeInfo]:
        """Node name -> NodeInfo (leaf cells, GPUs, sku) from the physical config."""
        out = {}
        for name, cells in self.topo.nodes.items():
            leaves = [lf for c in cells for lf in c.leaves]
            skus = list(dict.fromkeys(lf.sku for lf in leaves))
            gpus = sum(self._skus[lf.sku].gpu for lf in leaves)
            out[name] = NodeInfo(name, len(leaves), gpus, "+".join(skus))  # "+": a node of several leaf types
        return out

    def group_of(self, name: str) -> list[TaskPlacement]:
        """The group's committed placements (empty if unknown)."""
        g = self._groups.get(name)
        return list(g.placements.values()) if g else []

    def groups(self) -> dict[str, GroupRequest]:
        """Groups holding cells, by name."""
        return {n: g.request for n, g in self._groups.items()}

    def downgraded(self) -> list[str]:
        """Guaranteed groups that lazy preemption turned opportunistic (still running)."""
        return [n for n, g in self._groups.items() if g.priority < 0 <= g.request.priority]

    def reconfigure(self, new_config: ClusterConfig) -> dict[str, str]:
        """Apply a changed cluster config with groups running (HiveD reconfiguration).

        Groups whose cells still exist and whose VC still has quota for them keep their placements
        (replayed with :meth:`allocate`, guaranteed groups first); a guaranteed group with lazy
        preemption that its VC can no longer hold runs on as opportunistic (downgraded), as HiveD
        keeps it; returns {group: explanation} for each group that no longer fits at all (dropped
        here; the caller stops or retries it).
        Reservations are dropped (preemptors schedule again); node health is kept for nodes that
        still exist.  Raises ValidationError (state unchanged) when ``new_config`` itself is illegal.
        """
        new, dropped = self.reconfigured(new_config)
        self.__dict__.update(new.__dict__)
        return dropped

    def reconfigured(self, new_config: ClusterConfig) -> tuple[HivedScheduler, dict[str, str]]:
        """What :meth:`reconfigure` would make, without changing this scheduler: the new scheduler and
        the dropped groups. The control plane commits the dropped jobs' stops first and swaps the
        scheduler only after the commit.  Raises ValidationError when ``new_config`` is illegal."""
        new = HivedScheduler(new_config, lazy_preemption=self.lazy_preemption)
        for n in sorted(self._unhealthy):
            if n in new.topo.nodes:
                new.set_node_health(n, False)
        dropped: dict[str, str] = {}
        order = sorted(self._groups.items(), key=lambda kv: (kv[1].priority < 0, -kv[1].priority))
        for name, g in order:
            req = g.request
            if req.virtual_cluster not in new._unbound:
                dropped[name] = f"VC {req.virtual_cluster} no longer exists"
                continue
            if g.priority < 0 <= req.priority:  # downgraded by lazy preemption: replay as opportunistic
                new._groups[name] = Group(req, priority=-1)
                new._groups_prio[req.virtual_cluster][-1][name] = None
            plan: list[Cell] = []  # the same virtual-cell levels as before, where the cells still exist
            for lf in (x for lv in g.leaves.values() for x in lv):
                root = lf.bound_root()
                if root is None or lf.node_name not in new.topo.nodes or root.state != BOUND:
                    continue
                nl = next((x for x in new.topo.node_leaves(lf.node_name) if x.index == lf.index), None)
                a = new._ancestor_at(nl, root.level) if nl is not None else None
                if a is not None and a.cell_type == root.cell_type and a not in plan:
                    plan.append(a)
            try:
                new._allocate(name, req, list(g.placements.values()), plan)
            except PlatformError as e:
                new._groups.pop(name, None)
                new._groups_prio[req.virtual_cluster][-1].pop(name, None)
                # HiveD keeps a guaranteed group its VC can no longer hold running as opportunistic
                # (lazy preemption); only what cannot run at all is dropped.
                if g.priority >= 0 and self._lazy_ok(g):
                    new._groups[name] = Group(req, priority=-1)
                    new._groups_prio[req.virtual_cluster][-1][name] = None
                    try:
                        new._allocate(name, req, list(g.placements.values()), [])
                    except PlatformError:
                        new._groups.pop(name, None)
                        new._groups_prio[req.virtual_cluster][-1].pop(name, None)
                    else:
                        new._groups[name].seq = g.seq
                        continue
                dropped[name] = f"no longer fits: {e.message}"
                continue
            new._groups[name].seq = g.seq  # keep the allocation order across the replay
        new._alloc_seq = self._alloc_seq
        return new, dropped
