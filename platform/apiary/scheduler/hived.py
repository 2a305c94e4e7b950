"""HiveD scheduling semantics for OpenPAI jobs, as a pure algorithm.

Rules and their sources:

* VC safety: a guaranteed group (priority 0..1000) uses only its own VC's cells, even when other VCs
  are idle (HiveD paper section 3, user manual "VC Safety").
* Opportunistic groups (priority -1) use any free cell of the cluster, never preempt, and are
  preempted by guaranteed groups that need the cell (user manual "Opportunistic Job").
* Intra-VC preemption: a guaranteed group preempts strictly lower priority groups (and opportunistic
  ones) on its VC's cells; the preempted cells are *reserved* for it (HiveD "Preempting" state,
  doc/design/state-machine.md); a higher priority preemptor supersedes a lower one.
* Gang: all pending instances at once or none (OpenPAI ``extras.gangAllocation``, HiveD affinity
  group); incremental groups place as many as fit.
* Each task on one node; pack by best fit and keep a group under its lowest common ancestor cell
  (HiveD buddy allocation / topology-aware placement).
* Leaf cells per task = max(ceil(gpu/sku.gpu), ceil(cpu/sku.cpu), ceil(memory/sku.memory)), >= 1
  (OpenPAI rest-server); a gang job larger than its VC is rejected with OpenPAI's message.

No I/O, clock, threads or randomness: every call is a deterministic function of the call history.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from apiary.errors import PlatformError, QuotaExceededError, ValidationError
from apiary.scheduler.cells import (
    ALL_VCS,
    BucketIndex,
    Cell,
    PoolKey,
    Segment,
    bind_virtual_clusters,
    build_topology,
)
from apiary.scheduler.types import (
    MAX_GUARANTEED_PRIORITY,
    Decision,
    GroupRequest,
    NodeInfo,
    TaskPlacement,
    TaskRequest,
    priority_label,
)
from apiary.spec.cluster import ClusterConfig

Instance = tuple[str, int]
_Item = tuple[str, int, int]  # (task_role, index, leaf cells needed)
_Fit = dict[Instance, tuple[Segment, list[Cell]]]


@dataclass
class _Group:
    request: GroupRequest
    placements: dict[Instance, TaskPlacement] = field(default_factory=dict)
    leaves: dict[Instance, list[Cell]] = field(default_factory=dict)

    @property
    def priority(self) -> int:
        return self.request.priority


@dataclass
class _Reservation:
    priority: int
    pending: tuple[Instance, ...]
    placements: tuple[TaskPlacement, ...]
    leaves: list[Cell]
    reason: str


def _self_label(priority: int) -> str:
    lab = priority_label(priority)
    return lab if lab.startswith("priority") or priority < 0 else f"{lab}, {priority}"


def _who(g: _Group) -> str:
    if g.priority < 0:
        return f"{g.request.name} (opportunistic)"
    lab = priority_label(g.priority)
    return (
        f"{g.request.name} ({lab}, priority {g.priority})"
        if not lab.startswith("priority")
        else (f"{g.request.name} ({lab})")
    )


class _Source:
    """Available leaves for a fit: either a live BucketIndex (free leaves) or an explicit overlay."""

    def __init__(
        self,
        index: BucketIndex | None = None,
        avail: dict[Segment, list[Cell]] | None = None,
        group: str | None = None,
    ) -> None:
        self.index = index
        self.avail = avail
        self.group = group

    def best_fit(self, need: int) -> Segment | None:
        if self.index is not None:
            return self.index.best_fit(need)
        best: Segment | None = None
        for seg, lv in self.avail.items():  # type: ignore[union-attr]
            n = len(lv)
            if n >= need and (
                best is None
                or n < len(self.avail[best])  # type: ignore[index]
                or (n == len(self.avail[best]) and seg.order < best.order)
            ):  # type: ignore[index]
                best = seg
        return best

    def leaves(self, seg: Segment) -> list[Cell]:
        if self.avail is not None:
            return self.avail[seg]
        return seg.free_leaves(self.group)

    def as_dict(self) -> dict[Segment, list[Cell]]:
        if self.avail is not None:
            return self.avail
        return {seg: seg.free_leaves(self.group) for seg in self.index.segments()}  # type: ignore[union-attr]

    def total(self) -> int:
        if self.avail is not None:
            return sum(len(v) for v in self.avail.values())
        return self.index.free_total()  # type: ignore[union-attr]


def _pick_leaves(node: Cell, avail: list[Cell], need: int) -> list[Cell]:
    """``need`` leaves of ``avail`` (one node), packed into the lowest, fullest sub-cell."""
    if not node.internal:
        return sorted(avail, key=lambda c: c.index)[:need]
    ids = {id(c) for c in avail}
    best: tuple[int, int, int] | None = None
    best_cell = node
    for c in node.internal:
        n = sum(1 for lf in c.leaves if id(lf) in ids)
        if n >= need:
            key = (c.level, n, c.order)
            if best is None or key < best:
                best, best_cell = key, c
    return [lf for lf in best_cell.leaves if id(lf) in ids][:need]


def _greedy(items: Sequence[_Item], avail: dict[Segment, list[Cell]], partial: bool) -> _Fit | None:
    """Best-fit each item (largest first) onto segments; same node preferred for the next item."""
    if not avail:
        return {} if partial else None
    maxc = max(len(v) for v in avail.values())
    buckets: list[deque[Segment]] = [deque() for _ in range(maxc + 1)]
    for seg in sorted(avail, key=lambda s: s.order):
        buckets[len(avail[seg])].append(seg)
    remaining = {seg: list(v) for seg, v in avail.items()}
    assigned: dict[Segment, list[_Item]] = defaultdict(list)
    order = (
        sorted(items, key=lambda it: (-it[2], it[0], it[1]))
        if not partial
        else sorted(items, key=lambda it: (it[2], it[0], it[1]))
    )
    for it in order:
        need = it[2]
        chosen = None
        for k in range(need, maxc + 1):
            if buckets[k]:
                chosen = buckets[k].popleft()
                buckets[k - need].appendleft(chosen)
                break
        if chosen is None:
            if partial:
                continue
            return None
        assigned[chosen].append(it)
    out: _Fit = {}
    for seg, its in assigned.items():
        pool = remaining[seg]
        for it in its:
            picked = _pick_leaves(seg.node, pool, it[2])
            ids = {id(c) for c in picked}
            pool = [c for c in pool if id(c) not in ids]
            out[(it[0], it[1])] = (seg, picked)
    return out


def _fit(items: Sequence[_Item], src: _Source, gang: bool) -> _Fit | None:
    """Place ``items`` from ``src``: all of them (gang) or as many as fit (>= 1, else None)."""
    if not items:
        return {}
    total = sum(it[2] for it in items)
    if src.total() < (total if gang else min(it[2] for it in items)):
        return None
    seg = src.best_fit(total)  # the whole group on one node
    if seg is not None:
        pool = list(src.leaves(seg))
        out: _Fit = {}
        for it in sorted(items, key=lambda it: (-it[2], it[0], it[1])):
            picked = _pick_leaves(seg.node, pool, it[2])
            ids = {id(c) for c in picked}
            pool = [c for c in pool if id(c) not in ids]
            out[(it[0], it[1])] = (seg, picked)
        return out
    if len(items) == 1:
        return None
    avail = src.as_dict()
    # lowest common ancestor first: try every ancestor level above the node, fullest cell first
    depth = 1
    while True:
        members: dict[Cell, list[Segment]] = {}
        agg: dict[Cell, int] = defaultdict(int)
        any_anc = False
        for s, lv in avail.items():
            anc: Cell | None = s.node
            for _ in range(depth):
                anc = anc.parent if anc is not None else None
            if anc is None:
                continue
            any_anc = True
            members.setdefault(anc, []).append(s)
            agg[anc] += len(lv)
        if not any_anc:
            break
        for anc in sorted((a for a in agg if agg[a] >= total), key=lambda a: (agg[a], a.order)):
            r = _greedy(items, {s: avail[s] for s in members[anc]}, partial=False)
            if r is not None:
                return r
        depth += 1
    r = _greedy(items, avail, partial=False)  # across chains
    if r is not None or gang:
        return r
    r = _greedy(items, avail, partial=True)
    return r or None


class HivedScheduler:
    """HiveD semantics over one :class:`~apiary.spec.cluster.ClusterConfig`.

    Implements :class:`~apiary.scheduler.types.SchedulerAlgorithm`.  Construction builds the cell
    tree and binds every VC (raises ValidationError naming the VC on an impossible assignment).
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.topo = build_topology(config)
        bind_virtual_clusters(self.topo, config)
        self._skus = config.physical_cluster.sku_types
        self._sku_order = list(self._skus)
        self._vcs = list(config.virtual_clusters)
        self._groups: dict[str, _Group] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._unhealthy: set[str] = set()
        self._index: dict[PoolKey, BucketIndex] = {}
        self._pool_segments: dict[PoolKey, list[Segment]] = defaultdict(list)
        self._pool_max: dict[PoolKey, int] = defaultdict(int)
        self._pool_leaves: dict[PoolKey, int] = defaultdict(int)
        self._node_segments: dict[str, list[Segment]] = defaultdict(list)
        # per VC (None = unbound): quota leaves, used, oppo used, reserved
        self._stats: dict[str | None, dict[str, int]] = {
            v: {"quota": 0, "used": 0, "opportunistic_used": 0, "reserved": 0} for v in [*self._vcs, None]
        }
        for seg in self.topo.segments:
            vc, pinned, sku = seg.pool
            keys: list[PoolKey] = [seg.pool]
            if pinned is None:
                keys.append((ALL_VCS, None, sku))
            for key in keys:
                idx = self._index.setdefault(key, BucketIndex())
                idx.move(seg, 0, seg.free)
                seg.index.append(idx)
                self._pool_segments[key].append(seg)
                self._pool_max[key] = max(self._pool_max[key], len(seg.leaves))
                self._pool_leaves[key] += len(seg.leaves)
            self._node_segments[seg.node.address].append(seg)
            self._stats[vc]["quota"] += len(seg.leaves)
        self._vc_skus: dict[str, list[str]] = {
            v: [s for s in self._sku_order if self._pool_leaves.get((v, None, s))] for v in self._vcs
        }
        self._cluster_skus = [s for s in self._sku_order if self._pool_leaves.get((ALL_VCS, None, s))]

    # ------------------------------------------------------------------ request helpers
    def _leaf_need(self, task: TaskRequest, sku: str) -> int:
        s = self._skus[sku]
        need = 1
        if task.gpu > 0:
            need = max(need, math.ceil(task.gpu / s.gpu) if s.gpu > 0 else 1 << 30)
        if task.cpu > 0:
            need = max(need, math.ceil(task.cpu / s.cpu - 1e-9))
        if task.memory_mb > 0:
            mem = s.memory_mb
            need = max(need, math.ceil(task.memory_mb / mem) if mem > 0 else 1 << 30)
        return need

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

    def _pool(self, request: GroupRequest, task: TaskRequest, sku: str, vc: str | None = None) -> PoolKey:
        return (vc if vc is not None else request.virtual_cluster, task.pinned_cell_id, sku)

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
        if vc not in self._stats or vc is None:
            raise ValidationError("defaults.virtualCluster", f"unknown virtual cluster {vc!r}")
        if not (request.priority == -1 or 0 <= request.priority <= MAX_GUARANTEED_PRIORITY):
            raise ValidationError(
                "extras.hivedScheduler.jobPriorityClass",
                f"priority {request.priority} is neither -1 (opportunistic) "
                f"nor in 0..{MAX_GUARANTEED_PRIORITY}",
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
                    raise ValidationError(
                        f"{base}.pinnedCellId", f"pinned cell {t.pinned_cell_id!r} is not in VC {vc}"
                    )
                psku = self.topo.pinned[t.pinned_cell_id].sku
                if t.sku_type is not None and t.sku_type != psku:
                    raise ValidationError(
                        f"{base}.skuType", f"pinned cell {t.pinned_cell_id!r} has sku {psku}"
                    )
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

    def _validate_option(self, request: GroupRequest, option: dict[str, str]) -> None:
        vc = request.virtual_cluster
        total_need = 0
        quota_keys: set[PoolKey] = set()
        for t in request.tasks:
            sku = option.get(t.task_role)
            if sku is None:
                raise ValidationError("defaults.virtualCluster", f"VC {vc} has no cells")
            need = self._leaf_need(t, sku)
            scope = ALL_VCS if request.opportunistic and t.pinned_cell_id is None else vc
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
                raise QuotaExceededError(
                    f"Job requests {total_need} SKUs, exceeds maximum {cap} SKUs in {where}."
                )

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
        res = self._reservations.get(name)
        if res is not None:
            d = self._resume_reservation(request, res, pending)
            if d is not None:
                return d
        options = self._sku_options(request)
        if request.opportunistic:
            return self._schedule_oppo(request, pending, options)
        return self._schedule_guaranteed(request, pending, options)

    def _items(
        self, request: GroupRequest, pending: Iterable[Instance], option: dict[str, str]
    ) -> dict[tuple[str | None, str], list[_Item]]:
        """Pending instances grouped by (pinned id, sku)."""
        out: dict[tuple[str | None, str], list[_Item]] = defaultdict(list)
        for tr, i in pending:
            t = request.task(tr)
            sku = option[tr]
            out[(t.pinned_cell_id, sku)].append((tr, i, self._leaf_need(t, sku)))
        return out

    def _placements(self, fit: _Fit) -> tuple[TaskPlacement, ...]:
        out = []
        for (tr, i), (seg, leaves) in sorted(fit.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            g = self._skus[seg.pool[2]].gpu
            idx = tuple(sorted(lf.index for lf in leaves))
            gpus = tuple(x * g + k for x in idx for k in range(g))
            out.append(TaskPlacement(tr, i, seg.node.address, idx, gpus))
        return tuple(out)

    def _place_reason(self, request: GroupRequest, placements: Sequence[TaskPlacement], pending: int) -> str:
        nodes = ", ".join(dict.fromkeys(p.node for p in placements))
        where = "opportunistically" if request.opportunistic else f"in VC {request.virtual_cluster}"
        return f"Placing {len(placements)} of {pending} pending instance(s) {where} on {nodes}."

    def _schedule_guaranteed(
        self, request: GroupRequest, pending: tuple[Instance, ...], options: list[dict[str, str]]
    ) -> Decision:
        vc = request.virtual_cluster
        best: _Fit | None = None
        for option in options:
            fit: _Fit = {}
            ok = True
            for (pinned, sku), items in self._items(request, pending, option).items():
                idx = self._index.get((vc, pinned, sku))
                r = _fit(items, _Source(index=idx), request.gang) if idx is not None else None
                if r is None:
                    ok = False
                    if request.gang:
                        break
                    continue
                fit.update(r)
            if request.gang and ok:
                best = fit
                break
            if not request.gang and fit and (best is None or len(fit) > len(best)):
                best = fit
        if best:
            pl = self._placements(best)
            return Decision("place", pl, reason=self._place_reason(request, pl, len(pending)))
        target = pending if request.gang else pending[:1]
        for option in options:
            d = self._plan_preemption(request, target, option)
            if d is not None:
                return d
        return Decision("wait", reason=self._wait_reason(request, pending, options[0]))

    def _schedule_oppo(
        self, request: GroupRequest, pending: tuple[Instance, ...], options: list[dict[str, str]]
    ) -> Decision:
        best: _Fit | None = None
        for option in options:
            fit: _Fit = {}
            ok = True
            for (pinned, sku), items in self._items(request, pending, option).items():
                if pinned is not None:
                    scopes: list[str | None] = [request.virtual_cluster]
                else:  # unbound cells first, then the VC with the most free cells, then anywhere
                    vcs = sorted(self._vcs, key=lambda v: (-self._free_of(v), self._vcs.index(v)))
                    scopes = [None, *vcs, ALL_VCS]
                r = None
                for scope in scopes:
                    idx = self._index.get((scope, pinned, sku))
                    if idx is None:
                        continue
                    r = _fit(items, _Source(index=idx), request.gang)
                    if r:
                        break
                if not r:
                    ok = False
                    if request.gang:
                        break
                    continue
                fit.update(r)
            if request.gang and ok:
                best = fit
                break
            if not request.gang and fit and (best is None or len(fit) > len(best)):
                best = fit
        if best:
            pl = self._placements(best)
            return Decision("place", pl, reason=self._place_reason(request, pl, len(pending)))
        return Decision("wait", reason=self._wait_reason(request, pending, options[0]))

    def _free_of(self, vc: str | None) -> int:
        st = self._stats[vc]
        return st["quota"] - st["used"] - st["reserved"]

    # ------------------------------------------------------------------ preemption
    def _prio(self, name: str) -> int:
        if name in self._reservations:
            return self._reservations[name].priority
        if name in self._groups:
            return self._groups[name].priority
        return -1

    def _plan_preemption(
        self, request: GroupRequest, pending: tuple[Instance, ...], option: dict[str, str]
    ) -> Decision | None:
        name, p, vc = request.name, request.priority, request.virtual_cluster
        item_groups = self._items(request, pending, option)
        base: dict[PoolKey, dict[Segment, list[Cell]]] = {}
        victim_leaves: dict[str, dict[PoolKey, dict[Segment, list[Cell]]]] = {}
        for pinned, sku in item_groups:
            key: PoolKey = (vc, pinned, sku)
            base[key] = {}
            for seg in self._pool_segments.get(key, []):
                if seg.node.address in self._unhealthy:
                    continue
                for lf in seg.leaves:
                    r = lf.reserved_by
                    r_ok = r is None or r == name or self._prio(r) < p
                    if lf.group is None:
                        if r_ok:
                            base[key].setdefault(seg, []).append(lf)
                    elif r_ok and lf.group != name and self._groups[lf.group].priority < p:
                        victim_leaves.setdefault(lf.group, {}).setdefault(key, {}).setdefault(seg, []).append(
                            lf
                        )
        need = {(pin, sku): sum(it[2] for it in items) for (pin, sku), items in item_groups.items()}

        def counts(chosen: Sequence[str]) -> bool:
            for (pin, sku), n in need.items():
                key = (vc, pin, sku)
                have = sum(len(v) for v in base[key].values()) + sum(
                    len(lv) for g in chosen for lv in victim_leaves[g].get(key, {}).values()
                )
                if have < n:
                    return False
            return True

        def try_fit(chosen: Sequence[str]) -> _Fit | None:
            if not counts(chosen):
                return None
            out: _Fit = {}
            for (pin, sku), items in item_groups.items():
                key = (vc, pin, sku)
                avail = {s: list(v) for s, v in base[key].items()}
                for g in chosen:
                    for s, lv in victim_leaves[g].get(key, {}).items():
                        avail.setdefault(s, []).extend(lv)
                for s in avail:
                    avail[s].sort(key=lambda c: c.index)
                r = _fit(items, _Source(avail=avail), gang=True)
                if r is None:
                    return None
                out.update(r)
            return out

        fit = try_fit(())
        chosen: list[str] = []
        if fit is None:
            order = sorted(
                victim_leaves,
                key=lambda g: (
                    self._groups[g].priority >= 0,
                    self._groups[g].priority,
                    -sum(len(lv) for pk in victim_leaves[g].values() for lv in pk.values()),
                    g,
                ),
            )
            for g in order:
                chosen.append(g)
                fit = try_fit(chosen)
                if fit is not None:
                    break
            if fit is None:
                return None
            for g in list(reversed(chosen[:-1])):  # minimality
                trial = [x for x in chosen if x != g]
                r = try_fit(trial)
                if r is not None:
                    chosen, fit = trial, r
        placements = self._placements(fit)
        leaves = [lf for _, lv in fit.values() for lf in lv]
        occupied = {lf.group for lf in leaves if lf.group}
        victims = [g for g in chosen if g in occupied]
        if not victims:  # lower-priority reservations on these cells are superseded at allocate()
            return Decision("place", placements, reason=self._place_reason(request, placements, len(pending)))
        who = ", ".join(_who(self._groups[g]) for g in victims)
        n_cells = sum(1 for lf in leaves if lf.group)
        reason = f"Preempting {who} to free {n_cells} cell{'s' if n_cells != 1 else ''} in VC {vc}."
        self._reserve(name, _Reservation(p, pending, placements, leaves, reason))
        return Decision("preempt", victims=tuple(victims), reason=reason)

    def _reserve(self, name: str, res: _Reservation) -> None:
        self.cancel(name)
        for lf in res.leaves:
            other = lf.reserved_by
            if other is not None and other != name:
                self.cancel(other)  # superseded by a higher priority preemptor
        for lf in res.leaves:
            self._set_leaf(lf, lf.group, name)
        self._reservations[name] = res

    def _resume_reservation(
        self, request: GroupRequest, res: _Reservation, pending: tuple[Instance, ...]
    ) -> Decision | None:
        if res.pending != pending or res.priority != request.priority:
            self.cancel(request.name)
            return None
        occupants = list(dict.fromkeys(lf.group for lf in res.leaves if lf.group is not None))
        if not occupants:
            return Decision(
                "place", res.placements, reason=self._place_reason(request, res.placements, len(pending))
            )
        if all(self._groups[g].priority < res.priority for g in occupants):
            return Decision("preempt", victims=tuple(occupants), reason=res.reason)
        self.cancel(request.name)
        return None

    # ------------------------------------------------------------------ reasons
    def _wait_reason(
        self, request: GroupRequest, pending: tuple[Instance, ...], option: dict[str, str]
    ) -> str:
        vc, p = request.virtual_cluster, request.priority
        parts: list[str] = []
        for (pinned, sku), items in self._items(request, pending, option).items():
            scope: str | None = ALL_VCS if request.opportunistic and pinned is None else vc
            key: PoolKey = (scope, pinned, sku)
            segs = self._pool_segments.get(key, [])
            healthy = [s for s in segs if s.node.address not in self._unhealthy]
            free = sum(s.free for s in healthy)
            total = self._pool_leaves.get(key, 0)
            where = "the cluster" if scope == ALL_VCS else f"VC {vc}"
            cell_kind = f"{sku} leaf cells" + (f" of pinned cell {pinned}" if pinned else "")
            needs = {it[2] for it in items}
            if request.gang and len(items) > 1 and len(needs) == 1:
                n = needs.pop()
                slots = sum(s.free // n for s in healthy)
                parts.append(
                    f"Gang of {len(items)} tasks needs {len(items)} nodes with {n} free leaf "
                    f"cell{'s' if n != 1 else ''} each in {where}; {slots} available."
                    if self._pool_max.get(key, 0) < 2 * n
                    else f"Gang of {len(items)} tasks needs {len(items)} slots of {n} free leaf cell(s) "
                    f"on one "
                    f"node each in {where}; {slots} available."
                )
            parts.append(f"Waiting for resources: {where} has {free} of {total} {cell_kind} free")
            users: dict[str, int] = defaultdict(int)
            reservers: dict[str, int] = defaultdict(int)
            for s in segs:
                for lf in s.leaves:
                    if lf.group is not None and lf.group != request.name:
                        users[lf.group] += 1
                    elif lf.group is None and lf.reserved_by not in (None, request.name):
                        reservers[lf.reserved_by] += 1  # type: ignore[index]
            if request.opportunistic:
                parts[-1] += "; opportunistic jobs never preempt."
            else:
                blocking = [g for g in users if self._groups[g].priority >= p]
                if blocking:
                    who = ", ".join(_who(self._groups[g]) for g in blocking[:5])
                    more = f" and {len(blocking) - 5} more" if len(blocking) > 5 else ""
                    parts[-1] += f"; used by {who}{more} which this job ({_self_label(p)}) cannot preempt."
                else:
                    parts[-1] += "."
            for r, n in reservers.items():
                parts.append(f"{n} cell(s) reserved for preempting job {r} (priority {self._prio(r)}).")
            bad = sorted({s.node.address for s in segs if s.node.address in self._unhealthy})
            if bad:
                parts.append("; ".join(f"node {b} unhealthy" for b in bad[:5]) + ".")
        return " ".join(parts)

    # ------------------------------------------------------------------ state changes
    def _set_leaf(self, lf: Cell, group: str | None, reserved_by: str | None) -> None:
        seg = lf.segment
        assert seg is not None
        was_free = lf.group is None and lf.reserved_by is None
        st = self._stats[lf.vc if lf.vc in self._stats else None]
        if lf.group is not None:
            st["used"] -= 1
            if self._groups[lf.group].priority < 0:
                st["opportunistic_used"] -= 1
        elif lf.reserved_by is not None:
            st["reserved"] -= 1
        lf.group, lf.reserved_by = group, reserved_by
        if group is not None:
            st["used"] += 1
            if self._groups[group].priority < 0:
                st["opportunistic_used"] += 1
        elif reserved_by is not None:
            st["reserved"] += 1
        is_free = group is None and reserved_by is None
        if was_free != is_free:
            old = seg.free
            seg.free += 1 if is_free else -1
            if seg.node.address not in self._unhealthy:
                for idx in seg.index:
                    idx.move(seg, old, seg.free)

    def allocate(self, name: str, request: GroupRequest, placements: Sequence[TaskPlacement]) -> None:
        """Commit placements (HiveD AddAllocatedPod); also rebuilds state after a restart.

        Accepts any physically consistent placement (known node, existing leaf indices, GPUs that
        match the leaves).  Raises PlatformError when a leaf is used by another group or the
        placement is inconsistent; re-allocating an identical instance is a no-op.  Reservations
        that overlap are dropped (the other preemptor schedules again).
        """
        resolved: list[tuple[TaskPlacement, list[Cell]]] = []
        taken: set[int] = set()
        g = self._groups.get(name)
        for pl in placements:
            node = self.topo.nodes.get(pl.node)
            if node is None:
                raise PlatformError(f"allocate {name}: unknown node {pl.node!r}")
            if not pl.leaf_cell_indices:
                raise PlatformError(f"allocate {name}: {pl.task_role}[{pl.index}] has no leaf cells")
            by_index = {lf.index: lf for lf in node.leaves}
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
                raise PlatformError(
                    f"allocate {name}: GPUs {pl.gpus} do not match leaf cells {pl.leaf_cell_indices}"
                )
            key = (pl.task_role, pl.index)
            if g is not None and key in g.placements:
                if g.placements[key].node == pl.node and set(g.placements[key].leaf_cell_indices) == set(
                    pl.leaf_cell_indices
                ):
                    continue
                raise PlatformError(
                    f"allocate {name}: {pl.task_role}[{pl.index}] is already placed elsewhere"
                )
            for lf in leaves:
                if lf.group is not None:
                    raise PlatformError(
                        f"allocate {name}: leaf cell {lf.index} of node {pl.node} "
                        f"is already used by {lf.group}"
                    )
            resolved.append((pl, leaves))
        self.cancel(name)
        if g is None:
            g = self._groups[name] = _Group(request)
        else:
            g.request = request
        for pl, leaves in resolved:
            for lf in leaves:
                if lf.reserved_by is not None and lf.reserved_by != name:
                    self.cancel(lf.reserved_by)
            key = (pl.task_role, pl.index)
            g.placements[key] = pl
            g.leaves[key] = leaves
            for lf in leaves:
                self._set_leaf(lf, name, None)

    def release(self, name: str, tasks: Sequence[tuple[str, int]] | None = None) -> None:
        """Free the group's cells, all or the given instances (HiveD DeleteAllocatedPod).
        Releasing everything also drops the group's reservation.  Idempotent."""
        g = self._groups.get(name)
        if tasks is None:
            self.cancel(name)
        if g is None:
            return
        keys = list(g.placements) if tasks is None else [tuple(t) for t in tasks]
        for key in keys:
            if key not in g.placements:
                continue
            for lf in g.leaves.pop(key):  # type: ignore[call-overload]
                self._set_leaf(lf, None, lf.reserved_by)
            del g.placements[key]  # type: ignore[arg-type]
        if not g.placements:
            del self._groups[name]

    def cancel(self, name: str) -> None:
        """Drop the reservation (Preempting state) of a group that no longer waits.  Idempotent."""
        res = self._reservations.pop(name, None)
        if res is None:
            return
        for lf in res.leaves:
            if lf.reserved_by == name:
                self._set_leaf(lf, lf.group, None)

    def set_node_health(self, node: str, healthy: bool) -> None:
        """Mark a node (un)healthy: an unhealthy node gets no new placements; existing ones stay and
        its cells stay counted in quota."""
        if node not in self.topo.nodes:
            raise ValidationError("node", f"unknown node {node!r}")
        if healthy == (node not in self._unhealthy):
            return
        if healthy:
            self._unhealthy.discard(node)
            for seg in self._node_segments[node]:
                for idx in seg.index:
                    idx.move(seg, 0, seg.free)
        else:
            self._unhealthy.add(node)
            for seg in self._node_segments[node]:
                for idx in seg.index:
                    idx.move(seg, seg.free, 0)

    # ------------------------------------------------------------------ queries
    def nodes(self) -> dict[str, NodeInfo]:
        """Node name -> NodeInfo (leaf cells, GPUs, sku) from the physical config."""
        out = {}
        for name, node in self.topo.nodes.items():
            sku = node.leaves[0].sku if node.leaves else ""
            gpus = len(node.leaves) * (self._skus[sku].gpu if sku else 0)
            out[name] = NodeInfo(name, len(node.leaves), gpus, sku)
        return out

    def group_of(self, name: str) -> list[TaskPlacement]:
        """The group's committed placements (empty if unknown)."""
        g = self._groups.get(name)
        return list(g.placements.values()) if g else []

    def groups(self) -> dict[str, GroupRequest]:
        """Groups holding cells, by name."""
        return {n: g.request for n, g in self._groups.items()}

    def status(self) -> dict:
        """JSON-able snapshot: ``virtualClusters`` {vc: {quota, used, free, reserved,
        opportunisticUsed}} (leaf cells; ``(unbound)`` for unbound cells), ``nodes`` {node: {leafCells,
        healthy, used: {group: leaf cells}}}, ``reservations`` {group: {priority, victims, cells}}."""
        vcs = {}
        for v, st in self._stats.items():
            if v is None and st["quota"] == 0:
                continue
            vcs[v if v is not None else "(unbound)"] = {
                "quota": st["quota"],
                "used": st["used"],
                "free": st["quota"] - st["used"] - st["reserved"],
                "reserved": st["reserved"],
                "opportunisticUsed": st["opportunistic_used"],
            }
        nodes: dict[str, dict] = {
            n: {"leafCells": len(c.leaves), "healthy": n not in self._unhealthy, "used": {}}
            for n, c in self.topo.nodes.items()
        }
        for gname, g in self._groups.items():
            for pl in g.placements.values():
                used = nodes[pl.node]["used"]
                used[gname] = used.get(gname, 0) + len(pl.leaf_cell_indices)
        res = {
            n: {
                "priority": r.priority,
                "victims": list(dict.fromkeys(lf.group for lf in r.leaves if lf.group)),
                "cells": [f"{lf.segment.node.address}/{lf.index}" for lf in r.leaves],  # type: ignore[union-attr]
            }
            for n, r in self._reservations.items()
        }
        return {"virtualClusters": vcs, "nodes": nodes, "reservations": res}
