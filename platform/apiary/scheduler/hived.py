"""HiveD scheduling semantics for OpenPAI jobs, as a pure algorithm.

Rules and their sources:

* VC safety: a guaranteed group (priority 0..1000) uses only cells bound to its own VC's virtual cells,
  even when other VCs are idle (HiveD paper section 3, user manual "VC Safety").  Virtual cells bind
  LAZILY (paper section 4.2; doc/design/state-machine.md): when first used, by buddy allocation, and
  unbind when freed; the safety invariant of :class:`~apiary.scheduler.cells.Chain` is checked on every
  binding (a binding that would break it is refused; :meth:`HivedScheduler.check_invariants` verifies
  the whole state and raises PlatformError on any violation).
* Opportunistic groups (priority -1) use any free unpinned cell of the cluster (unbound cells first, so
  they stay away from guaranteed jobs), never preempt, and are preempted by guaranteed groups that need
  the cell (user manual "Opportunistic Job"; inter-VC preemption).
* Intra-VC preemption: a guaranteed group preempts strictly lower priority groups of its VC; the
  preempted cells are *reserved* for it (HiveD "Preempting" state); a higher priority preemptor
  supersedes a lower one.  Lazy preemption (constructor ``lazy_preemption`` or
  ``GroupRequest.lazy_preemption`` of the victim): victims are first downgraded to opportunistic
  (``Decision.downgraded``) and killed only when the preemptor really needs their cells.
* Gang: all pending instances at once or none (OpenPAI ``extras.gangAllocation``, HiveD affinity
  group); incremental groups place as many as fit.  A waiting gang reserves nothing unless it
  preempts, so it never blocks smaller jobs (no head-of-line blocking).
* Each task on one node; pack by best fit and keep a group under its lowest common ancestor cell
  (HiveD topology-aware placement).
* Leaf cells per task = max(ceil(gpu/sku.gpu), ceil(cpu/sku.cpu), ceil(memory/sku.memory)), >= 1
  (OpenPAI rest-server; :func:`~apiary.scheduler.sizing.leaf_cells_needed`); a gang job larger
  than its VC is rejected with OpenPAI's message.
* Bad nodes (unhealthy or cordoned) get no new placements; bindings prefer healthy cells;
  ``status()`` reports per VC the virtual cells that only bad hardware can satisfy ("doomed").

Units: leaf cells (``gpu`` GPUs each), MiB, cores.  Errors: ValidationError / QuotaExceededError for
requests, PlatformError for inconsistent allocations or a broken invariant.

No I/O, clock, threads or randomness: every call is a deterministic function of the call history.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import islice
from typing import Any

from apiary.errors import PlatformError, QuotaExceededError, ValidationError
from apiary.scheduler.cells import (
    ALL_VCS,
    BOUND,
    FREE,
    INSIDE,
    SPLIT,
    STATE_NAMES,
    BucketIndex,
    Cell,
    Chain,
    PoolKey,
    Segment,
    Topology,
    build_topology,
    check_initial_assignment,
)
from apiary.scheduler.sizing import leaf_cells_needed
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

#: segments considered by a multi-node fit (the fullest ones); bounds the cost of one search
_FIT_CANDIDATES = 256
#: free-list entries looked at per level when choosing a physical cell to bind
_BIND_SCAN = 32


@dataclass
class _Group:
    request: GroupRequest
    placements: dict[Instance, TaskPlacement] = field(default_factory=dict)
    leaves: dict[Instance, list[Cell]] = field(default_factory=dict)
    priority: int = 0  # effective: -1 once downgraded by lazy preemption
    seq: int = 0  # allocation order (no clock here): a higher seq started more recently


@dataclass
class _Reservation:
    priority: int
    pending: tuple[Instance, ...]
    placements: tuple[TaskPlacement, ...]
    leaves: list[Cell]
    reason: str
    vc: str
    downgraded: tuple[str, ...] = ()


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
    """Available leaves for a fit: a live BucketIndex of free leaves (``index``) or, without one,
    an explicit overlay ``avail`` (segment -> its available leaves).  A fit reads counts first
    (:meth:`counts`) and the leaves (:meth:`leaves`) only of the segments it picks: listing the
    leaves of every candidate segment cost more than the rest of the fit."""

    def __init__(
        self,
        index: BucketIndex | None = None,
        avail: dict[Segment, list[Cell]] | None = None,
    ) -> None:
        self.index = index
        self.avail: dict[Segment, list[Cell]] = avail if avail is not None else {}

    def best_fit(self, need: int) -> Segment | None:
        if self.index is not None:
            return self.index.best_fit(need)
        best: Segment | None = None
        best_n = 0
        for seg, lv in self.avail.items():
            n = len(lv)
            if n >= need and (best is None or n < best_n or (n == best_n and seg.order < best.order)):
                best, best_n = seg, n
        return best

    def leaves(self, seg: Segment) -> list[Cell]:
        """The available leaves of ``seg``, in tree order."""
        if self.index is None:
            return self.avail[seg]
        return seg.free_leaves()

    def counts(self) -> dict[Segment, int]:
        """Candidate segment -> available leaves (with an index: the fullest :data:`_FIT_CANDIDATES`
        segments), in segment order."""
        if self.index is None:
            return {seg: len(self.avail[seg]) for seg in sorted(self.avail, key=lambda s: s.order)}
        segs = self.index.fullest(_FIT_CANDIDATES)
        segs.sort(key=lambda s: s.order)
        return {seg: seg.free for seg in segs}

    def total(self) -> int:
        if self.index is None:
            return sum(len(v) for v in self.avail.values())
        return self.index.total


def _pick_leaves(node: Cell, avail: list[Cell], need: int) -> list[Cell]:
    """``need`` leaves of ``avail`` (one node), packed into the lowest, fullest sub-cell."""
    if not node.internal:
        return sorted(avail, key=lambda c: c.order)[:need]
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


def _greedy(items: Sequence[_Item], avail: dict[Segment, int], src: _Source, partial: bool) -> _Fit | None:
    """Best-fit each item (largest first) onto segments (``avail``: segment -> available leaves,
    in segment order; the leaves come from ``src``); same node preferred for the next item."""
    if not avail:
        return {} if partial else None
    maxc = max(avail.values())
    buckets: list[deque[Segment]] = [deque() for _ in range(maxc + 1)]
    for seg, n in avail.items():
        buckets[n].append(seg)
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
        pool = src.leaves(seg)
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
        pool = src.leaves(seg)
        out: _Fit = {}
        for it in sorted(items, key=lambda it: (-it[2], it[0], it[1])):
            picked = _pick_leaves(seg.node, pool, it[2])
            ids = {id(c) for c in picked}
            pool = [c for c in pool if id(c) not in ids]
            out[(it[0], it[1])] = (seg, picked)
        return out
    if len(items) == 1:
        return None
    avail = src.counts()
    # lowest common ancestor first: try every ancestor level above the node, fullest cell first
    depth = 1
    while True:
        members: dict[Cell, dict[Segment, int]] = {}
        agg: dict[Cell, int] = defaultdict(int)
        any_anc = False
        for s, n in avail.items():
            anc: Cell | None = s.node
            for _ in range(depth):
                anc = anc.parent if anc is not None else None
            if anc is None:
                continue
            any_anc = True
            members.setdefault(anc, {})[s] = n
            agg[anc] += n
        if not any_anc:
            break
        for anc in sorted((a for a in agg if agg[a] >= total), key=lambda a: (agg[a], a.order)):
            r = _greedy(items, members[anc], src, partial=False)
            if r is not None:
                return r
        depth += 1
    # Across the top-level cells of one chain, never across chains: HiveD schedules a group within one
    # chain's cells (its cluster view is per chain), so a gang is never split over two hierarchies.
    chains: dict[str, dict[Segment, int]] = {}
    for s, n in avail.items():
        chains.setdefault(s.node.chain, {})[s] = n
    for part in chains.values():
        r = _greedy(items, part, src, partial=False)
        if r is not None:
            return r
    if gang:
        return None
    r = _greedy(items, avail, src, partial=True)  # an incremental group places what fits, anywhere
    return r or None


_ItemGroups = dict[tuple[str | None, str], list[_Item]]  # (pinned cell id, sku) -> items


def _combine(
    request: GroupRequest,
    groups: _ItemGroups,
    fit_one: Callable[[tuple[str | None, str], list[_Item]], _Fit | None],
) -> _Fit | None:
    """Fit every (pinned cell, sku) group of one placement option with ``fit_one(key, items)``:
    all or nothing for a gang (None when one group does not fit), whatever fits otherwise."""
    fit: _Fit = {}
    for key, items in groups.items():
        r = fit_one(key, items)
        if not r:
            if request.gang:
                return None
            continue
        fit.update(r)
    return fit


class HivedScheduler:
    """HiveD semantics over one :class:`~apiary.spec.cluster.ClusterConfig`.

    Implements :class:`~apiary.scheduler.types.SchedulerAlgorithm`.  Construction builds the cell
    tree and checks that every VC's virtual cells fit (raises ValidationError naming the VC and level
    on an impossible assignment).  ``lazy_preemption``: default for groups whose request does not say.
    """

    def __init__(self, config: ClusterConfig, lazy_preemption: bool = False) -> None:
        self.config = config
        self.lazy_preemption = lazy_preemption
        self.topo: Topology = build_topology(config)
        check_initial_assignment(self.topo, config)
        self._skus = config.physical_cluster.sku_types
        self._sku_order = list(self._skus)
        self._vcs = list(config.virtual_clusters)
        self._groups: dict[str, _Group] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._plans: dict[str, tuple[tuple[TaskPlacement, ...], list[Cell]]] = {}
        self._unhealthy: set[str] = set()
        self._maybe_unbind: dict[Cell, None] = {}
        self._index: dict[PoolKey, BucketIndex] = {}
        self._pool_segs: dict[PoolKey, dict[Segment, None]] = defaultdict(dict)
        self._pool_max: dict[PoolKey, int] = defaultdict(int)  # largest one-node allocation
        self._pool_leaves: dict[PoolKey, int] = defaultdict(int)  # capacity (quota) in leaves
        # virtual cells: vc -> (chain, level) -> unbound count; vc -> bound cells
        self._unbound: dict[str, dict[tuple[str, int], int]] = {v: defaultdict(int) for v in self._vcs}
        self._vcell_total: dict[str, dict[tuple[str, int], int]] = {v: defaultdict(int) for v in self._vcs}
        self._bound: dict[str, dict[Cell, None]] = {v: {} for v in self._vcs}
        # usage counters per VC (leaves): guaranteed used by priority, reserved, opportunistic (by job VC)
        self._used_prio: dict[str, dict[int, int]] = {v: defaultdict(int) for v in self._vcs}
        self._groups_prio: dict[str, dict[int, dict[str, None]]] = {v: defaultdict(dict) for v in self._vcs}
        self._reserved: dict[str, int] = defaultdict(int)
        self._oppo_used: dict[str, int] = defaultdict(int)
        # vc -> opportunistic groups using leaves of cells bound to vc -> how many: the candidates a
        # preemption in vc may stop besides vc's own lower-priority groups (found without a scan)
        self._oppo_in: dict[str, dict[str, int]] = defaultdict(dict)
        self._used_sku: dict[tuple[str, str], int] = defaultdict(int)  # (vc, sku) guaranteed used+reserved
        self._seg_order = 0
        self._alloc_seq = 0  # numbers groups in allocation order (victims: most recently started first)
        self._chains_of_sku: dict[str, list[Chain]] = defaultdict(list)
        for name, chain in self.topo.chains.items():
            self._chains_of_sku[self.topo.chain_sku[name]].append(chain)
        node_leaves = {name: 0 for name in self.topo.chains}
        for node in self.topo.node_cells():
            node_leaves[node.chain] = max(node_leaves[node.chain], len(node.leaves))
        self._node_level = {node.chain: node.level for node in self.topo.node_cells()}  # chain -> node level
        for vc_name, vc in config.virtual_clusters.items():
            for vcell in vc.virtual_cells:
                lv = self.topo.levels[vcell.leaf_type]
                chain = self.topo.chains[vcell.chain]
                sku = self.topo.chain_sku[vcell.chain]
                self._unbound[vc_name][(vcell.chain, lv)] += vcell.cell_number
                self._vcell_total[vc_name][(vcell.chain, lv)] += vcell.cell_number
                key: PoolKey = (vc_name, None, sku)
                self._pool_leaves[key] += vcell.cell_number * chain.leaves_at[lv]
                one_node = min(chain.leaves_at[lv], node_leaves[vcell.chain])
                self._pool_max[key] = max(self._pool_max[key], one_node)
        for pid, cell in self.topo.pinned.items():
            owner = self.topo.pinned_vc.get(pid)
            if owner is None:
                continue
            key = (owner, pid, cell.sku)
            self._pool_leaves[key] += len(cell.leaves)
            per_node: dict[str, int] = defaultdict(int)
            for lf in cell.leaves:
                per_node[lf.node_name] += 1
            self._pool_max[key] = max(self._pool_max[key], *per_node.values())
        for node in self.topo.node_cells():
            for lf in node.leaves:
                if lf.pinned_cell_id is None:
                    seg = self._seg(node, (ALL_VCS, None, lf.sku))
                    seg.leaves[lf] = None
                    lf.all_segment = seg
                    self._seg_free(seg, 1)
                    self._pool_leaves[seg.pool] += 1
                    self._pool_max[seg.pool] = max(self._pool_max[seg.pool], len(seg.leaves))
                seg = self._seg(node, (lf.vc, lf.pinned_cell_id, lf.sku))
                seg.leaves[lf] = None
                lf.segment = seg
                self._seg_free(seg, 1)
        self._vc_skus: dict[str, list[str]] = {
            v: [s for s in self._sku_order if any(k[0] == v and k[2] == s for k in self._pool_leaves)]
            for v in self._vcs
        }
        self._cluster_skus = [s for s in self._sku_order if self._pool_leaves.get((ALL_VCS, None, s))]

    # ------------------------------------------------------------------ segments
    def _seg(self, node: Cell, pool: PoolKey, cell: Cell | None = None) -> Segment:
        """The segment of ``pool`` on ``node``; with ``cell`` (a VC's bound cell below node level) the
        segment of that cell alone: a task must fit inside one of its VC's cells (HiveD treats a
        top-level virtual cell below node level as a node of its own), so two bound sockets of one
        node are two segments, never one 8-GPU place."""
        key = pool if cell is None else (*pool, id(cell))
        seg = node.segs.get(key)
        if seg is None:
            seg = node.segs[key] = Segment(node, pool, self._seg_order)
            self._seg_order += 1
            idx = self._index.get(pool)
            if idx is None:
                idx = self._index[pool] = BucketIndex()
            seg.index.append(idx)
            self._pool_segs[pool][seg] = None
        return seg

    def _seg_free(self, seg: Segment, delta: int) -> None:
        old = seg.free
        seg.free += delta
        if seg.node.bad == 0:
            for idx in seg.index:
                idx.move(seg, old, seg.free)

    def _move_leaf(self, lf: Cell, vc: str | None, cell: Cell | None = None) -> None:
        old = lf.segment
        assert old is not None and lf.node is not None
        free = lf.group is None and lf.reserved_by is None
        del old.leaves[lf]
        if free:
            self._seg_free(old, -1)
        if lf.group is not None and lf.pinned_cell_id is None and self._groups[lf.group].priority < 0:
            if lf.vc is not None:
                self._oppo_count(lf.vc, lf.group, -1)
            if vc is not None:
                self._oppo_count(vc, lf.group, 1)
        lf.vc = vc
        seg = self._seg(lf.node, (vc, lf.pinned_cell_id, lf.sku), cell)
        seg.leaves[lf] = None
        lf.segment = seg
        if free:
            self._seg_free(seg, 1)

    # ------------------------------------------------------------------ buddy binding
    @staticmethod
    def _free_ancestor(c: Cell) -> Cell | None:
        """The FREE cell at or above ``c`` if ``c`` can be bound (free or inside a free cell)."""
        x: Cell | None = c
        while x is not None:
            if x.state == FREE:
                return x
            if x.state != INSIDE:
                return None
            x = x.parent
        return None

    def _bind(self, c: Cell, vc: str) -> bool:
        """Bind one unbound virtual cell of ``vc`` (c's chain and level) to ``c``; False (state
        unchanged) when ``c`` is not bindable, ``vc`` has no such virtual cell, or VC safety would
        break."""
        key = (c.chain, c.level)
        if self._unbound[vc].get(key, 0) <= 0:
            return False
        f = self._free_ancestor(c)
        if f is None:
            return False
        chain = self.topo.chains[c.chain]
        chain.remove_free(f)
        path: list[Cell] = []  # c and its ancestors below f
        y: Cell | None = c
        while y is not None and y is not f:
            path.append(y)
            y = y.parent
        # split f down to c: every cell on the way becomes SPLIT, its other children FREE
        x = f
        for nxt in reversed(path):
            x.state = SPLIT
            x.free_children = 0
            for ch in x.children:
                if ch is not nxt:
                    chain.add_free(ch)
            x = nxt
        c.state = BOUND
        c.vc = vc
        c.hold = 0
        chain.D[c.level] -= len(c.leaves)
        self._unbound[vc][key] -= 1
        self._bound[vc][c] = None
        if chain.violation() is not None:
            self._unbind(c)
            return False
        sub_node = c if c.node is not None and c.level < c.node.level else None
        for lf in c.leaves:
            self._move_leaf(lf, vc, sub_node)
            if lf.group is not None and self._groups[lf.group].priority >= 0:
                c.hold += 1
            elif lf.reserved_by is not None:
                c.hold += 1
        return True

    def _unbind(self, c: Cell) -> None:
        """Return a bound cell to the buddy system (merging free buddies)."""
        vc = c.vc
        assert vc is not None and c.state == BOUND
        chain = self.topo.chains[c.chain]
        for lf in c.leaves:
            if lf.vc == vc:
                self._move_leaf(lf, None)
        del self._bound[vc][c]
        self._unbound[vc][(c.chain, c.level)] += 1
        chain.D[c.level] += len(c.leaves)
        c.vc = None
        c.hold = 0
        self._maybe_unbind.pop(c, None)
        chain.add_free(c)
        p = c.parent
        while p is not None and p.state == SPLIT and p.free_children == len(p.children):
            for ch in p.children:
                chain.remove_free(ch)
                ch.state = INSIDE
            chain.add_free(p)
            p = p.parent

    def _gc(self) -> None:
        """Lazy unbinding: bound cells no longer used by a guaranteed group nor reserved."""
        while self._maybe_unbind:
            c = next(iter(self._maybe_unbind))
            del self._maybe_unbind[c]
            if c.state == BOUND and c.hold == 0:
                self._unbind(c)

    def _cell_key(self, c: Cell, want: int, hint: Cell | None) -> tuple[bool, int, bool, int, int]:
        """Order of cells to bind: those holding a healthy level-``want`` cell first, then the lowest
        free level (buddy: keep big cells whole), then unused ones (binding a used cell means
        preempting the opportunistic work on it), beside ``hint``; among used cells, the cheapest to
        preempt: fewest leaf cells in use, then (:meth:`_by_cost`) the most recently started
        occupants (least work lost); then config order."""
        clean = self._has_clean(c, want)
        near = 0 if hint is not None and c.parent is hint else 1
        return (not clean, c.level, c.used > 0, c.used, near)

    def _by_cost(self, cells: list[Cell], key: Callable[[Cell], tuple[Any, ...]]) -> Iterator[Cell]:
        """``cells`` ordered by ``key``, then among used cells with equal keys by the most recently
        started occupant first (:meth:`_recency` scans leaves, so only ties pay for it, and only
        those the caller reaches: the order is produced lazily), then by config order."""
        keyed = sorted(((key(c), c.order, c) for c in cells), key=lambda t: (t[0], t[1]))
        i = 0
        while i < len(keyed):
            j = i + 1
            while j < len(keyed) and keyed[j][0] == keyed[i][0]:
                j += 1
            run = [t[2] for t in keyed[i:j]]
            if j - i > 1 and run[0].used:
                run.sort(key=lambda c: (-self._recency(c), c.order))
            yield from run
            i = j

    @staticmethod
    def _has_clean(c: Cell, level: int) -> bool:
        """True when ``c`` is or holds a level-``level`` cell with no leaf on an unhealthy node."""
        if c.bad == 0:
            return True
        if c.level <= level or c.bad >= len(c.leaves):
            return False
        return any(HivedScheduler._has_clean(ch, level) for ch in c.children)

    def _recency(self, c: Cell) -> int:
        """The allocation order of the most recently started group using a leaf of ``c`` (0: none).
        Above node level 0: the tie it breaks is between nodes, which the descent reaches anyway, and
        scanning a rack's leaves on every binding cost more than the rest of scheduling."""
        if c.node is None:
            return 0
        return max((self._groups[lf.group].seq for lf in c.leaves if lf.group is not None), default=0)

    def _bind_candidates(self, chain: Chain, lv: int, hint: Cell | None) -> Iterator[Cell]:
        """Physical level-``lv`` cells to try binding, best first: healthy, lowest free level (buddy),
        no opportunistic job on them, beside ``hint``. Lazy: the caller usually binds the first one,
        and descending from a free rack to its cheapest node is most of the cost."""
        tops: list[Cell] = []
        for m in range(lv, chain.top + 1):
            n = 0
            for c in chain.free[m]:
                tops.append(c)
                n += 1
                if n >= _BIND_SCAN:
                    break
        for c in islice(self._by_cost(tops, lambda c: self._cell_key(c, lv, hint)), 8):
            while c.level > lv:  # down to a healthy cell if there is one, the cheapest to preempt
                c = next(self._by_cost(c.children, lambda x: (not self._has_clean(x, lv), x.used)))
            yield c

    def _bind_some(self, vc: str, sku: str, need: int, min_item: int, max_item: int, hint: Cell | None) -> Cell | None:
        """Bind one more virtual cell of ``vc`` for ``need`` leaves of ``sku`` (items of ``min_item`` to
        ``max_item`` leaves, each on one node); the bound cell or None.

        A VC may own virtual cells of several chains with the same sku (e.g. a pool of 8-GPU nodes and a
        pool of 2-GPU nodes), and of several levels.  Only cells that can hold an item are useful (an item
        fits inside one cell, and on one node), and cells that hold the largest item come first: binding
        small cells for big items would spend the search's bindings on cells no item can use and make a
        gang that fits wait."""
        big: list[tuple[Chain, int]] = []
        small: list[tuple[Chain, int]] = []
        for (chain_name, lv), n in self._unbound[vc].items():
            if n <= 0 or self.topo.chain_sku[chain_name] != sku:
                continue
            chain = self.topo.chains[chain_name]
            per_item = min(chain.leaves_at[lv], self._node_leaves(chain_name))
            if per_item < min_item:
                continue
            (big if per_item >= max_item else small).append((chain, lv))
        for options in (big, small):
            if not options:
                continue
            whole = [o for o in options if o[0].leaves_at[o[1]] >= need]
            if whole:
                options = sorted(whole, key=lambda o: (o[1], o[0].name))
            else:
                options = sorted(options, key=lambda o: (-o[1], o[0].name))
            for chain, lv in options:
                for c in self._bind_candidates(chain, lv, hint):
                    if self._bind(c, vc):
                        return c
        return None

    def _bind_budget(self, vc: str, sku: str, items: Sequence[_Item]) -> int:
        """How many virtual cells a fit of ``items`` may bind: each item on cells of the smallest unit
        (virtual cell or node, whichever is smaller) of ``vc``'s chains of ``sku``, plus slack."""
        units = [
            min(self.topo.chains[ch].leaves_at[lv], self._node_leaves(ch))
            for (ch, lv), n in self._unbound[vc].items()
            if n > 0 and self.topo.chain_sku[ch] == sku
        ]
        unit = max(min(units, default=1), 1)
        return sum(-(-it[2] // unit) for it in items) + 4

    # ------------------------------------------------------------------ request helpers
    def _leaf_need(self, task: TaskRequest, sku: str) -> int:
        return leaf_cells_needed(task, self._skus[sku])

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
            raise ValidationError("defaults.virtualCluster", f"unknown virtual cluster {vc!r}")
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

    def _vc_free(self, vc: str, sku: str) -> int:
        """Leaves of ``vc``'s quota in ``sku`` (non-pinned) not used by its guaranteed groups nor reserved."""
        return self._pool_leaves.get((vc, None, sku), 0) - self._used_sku[(vc, sku)]

    def _preemptable(self, vc: str, priority: int) -> int:
        return sum(n for p, n in self._used_prio[vc].items() if p < priority)

    def _fit_bound(self, request: GroupRequest, key: PoolKey, items: list[_Item], tent: list[Cell]) -> _Fit | None:
        """Fit ``items`` into the VC's bound cells, binding more virtual cells (recorded in ``tent``)
        while they do not fit and the VC has some left."""
        _, pinned, sku = key
        vc = request.virtual_cluster  # the key's VC, typed as a VC name
        need = sum(it[2] for it in items)
        want = need if request.gang else min(it[2] for it in items)
        idx = self._index.get(key)
        r = None
        if idx is not None and idx.total >= want:
            r = _fit(items, _Source(index=idx), request.gang)
        if pinned is not None or (r is not None and len(r) == len(items)):
            return r
        if request.gang and need > self._vc_free(vc, sku):
            return None
        hint: Cell | None = None
        max_item = max(it[2] for it in items)
        min_item = min(it[2] for it in items)
        for _ in range(self._bind_budget(vc, sku, items)):
            idx = self._index.get(key)
            have = idx.total if idx is not None else 0
            c = self._bind_some(vc, sku, max(need - have, max_item), min_item, max_item, hint)
            if c is None:
                break
            tent.append(c)
            hint = c.parent
            idx = self._index[key]
            if idx.total < want:
                continue
            r2 = _fit(items, _Source(index=idx), request.gang)
            if r2 is not None and (r is None or len(r2) > len(r)):
                r = r2
            if r is not None and len(r) == len(items):
                break
        return r

    def _schedule_guaranteed(
        self, request: GroupRequest, pending: tuple[Instance, ...], options: list[dict[str, str]]
    ) -> Decision:
        vc, p = request.virtual_cluster, request.priority
        best: _Fit | None = None
        tent: list[Cell] = []
        try:
            for option in options:
                groups = self._items(request, pending, option)
                # quick capacity check: no search when even preemption cannot make room
                if request.gang:
                    short = False
                    for (pinned, sku), items in groups.items():
                        n = sum(it[2] for it in items)
                        if pinned is None:
                            room = self._vc_free(vc, sku) + self._preemptable(vc, p) + self._reserved_lower(vc, p)
                        else:
                            room = self._pool_leaves.get((vc, pinned, sku), 0)
                        if n > room:
                            short = True
                    if short:
                        continue
                fit = _combine(request, groups, lambda key, items: self._fit_bound(request, (vc, *key), items, tent))
                if fit is None:
                    continue
                if request.gang:
                    best = fit
                    break
                if fit and (best is None or len(fit) > len(best)):
                    best = fit
            if best:
                pl = self._placements(best)
                used = {id(lf) for _, lv in best.values() for lf in lv}
                plan = [c for c in tent if any(id(lf) in used for lf in c.leaves)]
                self._plans[request.name] = (pl, plan)
                return Decision("place", pl, reason=self._place_reason(request, pl, len(pending)))
            target = pending if request.gang else pending[:1]
            for option in options:
                d = self._plan_preemption(request, target, option, tent)
                if d is not None:
                    return d
            return Decision("wait", reason=self._wait_reason(request, pending, options[0]))
        finally:
            for c in reversed(tent):  # tentative bindings: kept only where a reservation holds them
                if c.state == BOUND and c.hold == 0:
                    self._unbind(c)

    def _reserved_lower(self, vc: str, priority: int) -> int:
        return sum(len(r.leaves) for r in self._reservations.values() if r.vc == vc and r.priority < priority)

    def _schedule_oppo(
        self, request: GroupRequest, pending: tuple[Instance, ...], options: list[dict[str, str]]
    ) -> Decision:
        best: _Fit | None = None
        def fit_anywhere(key: tuple[str | None, str], items: list[_Item]) -> _Fit | None:
            pinned, sku = key
            scopes: list[str | None] = [request.virtual_cluster] if pinned is not None else [None, ALL_VCS]
            for scope in scopes:
                idx = self._index.get((scope, pinned, sku))
                if idx is not None and (r := _fit(items, _Source(index=idx), request.gang)):
                    return r
            return None

        for option in options:
            fit = _combine(request, self._items(request, pending, option), fit_anywhere)
            if fit is None:
                continue
            if request.gang:
                best = fit
                break
            if fit and (best is None or len(fit) > len(best)):
                best = fit
        if best:
            pl = self._placements(best)
            return Decision("place", pl, reason=self._place_reason(request, pl, len(pending)))
        return Decision("wait", reason=self._wait_reason(request, pending, options[0]))

    # ------------------------------------------------------------------ preemption
    def _prio(self, name: str) -> int:
        if name in self._reservations:
            return self._reservations[name].priority
        if name in self._groups:
            return self._groups[name].priority
        return -1

    def _lazy_ok(self, g: _Group) -> bool:
        flag = getattr(g.request, "lazy_preemption", None)
        return self.lazy_preemption if flag is None else bool(flag)

    def _plan_preemption(
        self, request: GroupRequest, pending: tuple[Instance, ...], option: dict[str, str], tent: list[Cell]
    ) -> Decision | None:
        """Plan a preemption that lets ``pending`` of ``request`` run: the victims and the cells to
        reserve, a ``place`` when no victim is needed after all, or None.

        The plan searches the VC's bound cells; when they cannot hold the group even with every
        lower-priority group gone, it binds one more of the VC's unbound virtual cells (recorded in
        ``tent``) and plans again, so a preemption that needs a bound cell (holding the victim) plus
        an unbound one is found (HiveD does the same; without it a higher-priority gang starved while
        a lower-priority job of its own VC ran).  Cells to bind are chosen cheapest to preempt first
        (:meth:`_cell_key`: no opportunistic use, then the fewest opportunistic leaf cells in use, then
        the most recently started occupants).  Victims are taken in this order until the group fits:
        opportunistic (and lazily downgraded) groups before guaranteed ones, lower priority first,
        the most recently started first (least work lost; Kueue and HiveD order victims the same
        way), then by name; a final pass drops victims the fit does not need.
        """
        vc = request.virtual_cluster
        item_groups = self._items(request, pending, option)
        need = {(pin, sku): sum(it[2] for it in items) for (pin, sku), items in item_groups.items()}
        for (pin, sku), n in need.items():  # counters first: no scan when preemption cannot help
            if pin is None and n > self._vc_free(vc, sku) + self._preemptable(vc, request.priority) + \
                    self._reserved_lower(vc, request.priority):
                return None
        unpinned = [(sku, items) for (pin, sku), items in item_groups.items() if pin is None]
        for _ in range(sum(self._bind_budget(vc, sku, items) for sku, items in unpinned) + 1):
            d = self._plan_preemption_once(request, pending, item_groups, need, tent)
            if d is not None:
                return d
            grown = False
            for sku, items in unpinned:  # the VC's bound cells are not enough: bind one more
                sizes = [it[2] for it in items]
                c = self._bind_some(vc, sku, need[(None, sku)], min(sizes), max(sizes), None)
                if c is not None:
                    tent.append(c)
                    grown = True
                    break
            if not grown:
                return None
        return None

    def _plan_preemption_once(
        self,
        request: GroupRequest,
        pending: tuple[Instance, ...],
        item_groups: _ItemGroups,
        need: dict[tuple[str | None, str], int],
        tent: list[Cell],
    ) -> Decision | None:
        """One planning pass over the VC's bound cells as they are (see :meth:`_plan_preemption`).

        Work is proportional to the candidates, not to the VC: free room comes from the pools'
        indexes (the fullest segments), victims from the VC's lower-priority groups and the index of
        opportunistic groups in its cells, each read through its own leaves. The shortest prefix of
        the victim order that fits is found by galloping and bisection (a fit only gets easier with
        more victims), so a plan costs a few fits however many candidates there are."""
        name, p, vc = request.name, request.priority, request.virtual_cluster
        keys: dict[PoolKey, tuple[str | None, str]] = {(vc, pin, sku): (pin, sku) for pin, sku in item_groups}
        base: dict[PoolKey, dict[Segment, list[Cell]]] = {key: {} for key in keys}  # free room, tree order
        base_n: dict[PoolKey, int] = dict.fromkeys(keys, 0)

        def usable(lf: Cell) -> bool:
            r = lf.reserved_by
            return r is None or r == name or self._prio(r) < p

        def add_room(seg: Segment) -> None:
            room = base[seg.pool]
            if seg not in room and seg.node.bad == 0:
                lv = room[seg] = sorted((lf for lf in seg.leaves if lf.group is None and usable(lf)),
                                        key=lambda c: c.order)
                base_n[seg.pool] += len(lv)

        for key in keys:  # 1. free room: the fullest segments (where the index says there is any)
            idx = self._index.get(key)
            if idx is not None:
                for seg in idx.fullest(_FIT_CANDIDATES):
                    add_room(seg)
        for r_name, res in self._reservations.items():  # cells lower-priority preemptors reserved
            if r_name != name and res.vc == vc and res.priority < p:
                for lf in res.leaves:
                    if lf.segment is not None and lf.segment.pool in keys:
                        add_room(lf.segment)
        # 2. victims: the VC's lower-priority groups and the opportunistic groups in its cells, in
        # the order they are taken (see _plan_preemption). The order is produced a bucket at a time
        # (opportunistic, then each priority upwards): the search usually stops in the first.
        groups = self._groups

        def recent_first(names: Iterable[str]) -> list[str]:
            return [g for _, g in sorted((-groups[g].seq, g) for g in names)]

        buckets: list[Callable[[], list[str]]] = [
            lambda: recent_first(g for g in self._oppo_in.get(vc, {}) if g != name)
        ]
        n_cands = sum(1 for g in self._oppo_in.get(vc, {}) if g != name)
        for prio in sorted(q for q in self._groups_prio[vc] if 0 <= q < p):
            names = self._groups_prio[vc][prio]
            n_cands += len(names)
            buckets.append(partial(recent_first, names))
        order: list[str] = []
        victim_leaves: dict[str, dict[PoolKey, dict[Segment, list[Cell]]]] = {}
        # cum[key][k]: leaves of ``key`` that order[:k] holds (order grows only at its end)
        cum: dict[PoolKey, list[int]] = {key: [0] for key in keys}

        def leaves_of(g: str) -> dict[PoolKey, dict[Segment, list[Cell]]]:
            out = victim_leaves.get(g)
            if out is None:
                out = victim_leaves[g] = {}
                for lv in groups[g].leaves.values():
                    for lf in lv:
                        seg = lf.segment
                        if seg is None or seg.pool not in keys or seg.node.bad or not usable(lf):
                            continue
                        out.setdefault(seg.pool, {}).setdefault(seg, []).append(lf)
                        add_room(seg)
            return out

        def prefix(k: int) -> list[str]:
            while len(order) < k and buckets:
                order.extend(buckets.pop(0)())
            for g in order[len(cum[next(iter(cum))]) - 1:k]:  # read victims' leaves only when reached
                held = leaves_of(g)
                for key, c in cum.items():
                    c.append(c[-1] + sum(len(lv) for lv in held.get(key, {}).values()))
            return order[:k]

        def try_fit(chosen: Sequence[str], held: dict[PoolKey, int] | None = None) -> _Fit | None:
            """A fit with the leaves of ``chosen`` freed; ``held``: their leaf count per pool when
            the caller knows it (a prefix of ``order``)."""
            out: _Fit = {}
            for key, (pin, sku) in keys.items():
                v = held[key] if held is not None else sum(
                    len(lv) for g in chosen for lv in leaves_of(g).get(key, {}).values()
                )
                if base_n[key] + v < need[(pin, sku)]:
                    return None
            for key, (pin, sku) in keys.items():
                room = base[key]
                avail = {s: v for s, v in room.items() if v}  # shared: a fit does not change them
                grown: dict[Segment, list[Cell]] = {}
                for g in chosen:
                    for s, lv in leaves_of(g).get(key, {}).items():
                        if s not in grown:
                            avail[s] = grown[s] = [*room.get(s, ())]
                        grown[s].extend(lv)
                for lv in grown.values():
                    lv.sort(key=lambda c: c.order)
                r = _fit(item_groups[(pin, sku)], _Source(avail=avail), gang=True)
                if r is None:
                    return None
                out.update(r)
            return out

        def try_prefix(k: int) -> _Fit | None:
            chosen = prefix(k)
            return try_fit(chosen, {key: c[len(chosen)] for key, c in cum.items()})

        fit = try_fit(())
        chosen: list[str] = []
        if fit is None:
            # The shortest prefix of the order that fits: gallop (1, 2, 4, ...), then bisect.
            lo, hi = 0, 1
            while True:
                if hi >= n_cands:
                    hi = n_cands
                    fit = try_prefix(hi)
                    if fit is None:
                        return None
                    break
                fit = try_prefix(hi)
                if fit is not None:
                    break
                lo, hi = hi, hi * 2
            while hi - lo > 1:  # order[:lo] does not fit, order[:hi] does
                mid = (lo + hi) // 2
                r = try_prefix(mid)
                if r is not None:
                    hi, fit = mid, r
                else:
                    lo = mid
            # minimality: the fit uses the leaves of some of the chosen groups only, and stays a fit
            # without the others; then drop, latest taken first, each victim the rest can do without
            holders = {lf.group for _, lv in fit.values() for lf in lv if lf.group is not None}
            chosen = [g for g in order[:hi] if g in holders]
            for g in list(reversed(chosen[:-1])):
                trial = [x for x in chosen if x != g]
                r = try_fit(trial)
                if r is not None:
                    chosen, fit = trial, r
        # A group on pinned cells cannot run on as opportunistic (pinned cells are their VC's alone):
        # it is stopped outright, as HiveD names it a victim.
        lazy = [g for g in chosen if self._groups[g].priority >= 0 and self._lazy_ok(self._groups[g])
                and not any(lf.pinned_cell_id is not None for lv in self._groups[g].leaves.values() for lf in lv)]
        if lazy:  # lazy preemption: downgrade first, kill only if still needed (schedule re-plans)
            for g in lazy:
                self._downgrade(g)
            return Decision("wait", victims=(), reason="lazy", downgraded=tuple(lazy))
        placements = self._placements(fit)
        leaves = [lf for _, lv in fit.values() for lf in lv]
        occupied = {lf.group for lf in leaves if lf.group}
        victims = [g for g in chosen if g in occupied]
        if not victims:  # lower-priority reservations on these cells are superseded at allocate()
            # plan only the tentative cells these leaves are in, as the direct placement does: a
            # planned cell that no leaf uses would be bound at allocate() and never released
            used = {id(lf) for lf in leaves}
            plan = [c for c in tent if c.state == BOUND and any(id(lf) in used for lf in c.leaves)]
            self._plans[name] = (placements, plan)
            return Decision("place", placements, reason=self._place_reason(request, placements, len(pending)))
        who = ", ".join(_who(self._groups[g]) for g in victims)
        n_cells = sum(1 for lf in leaves if lf.group)
        reason = f"Preempting {who} to free {n_cells} cell{'s' if n_cells != 1 else ''} in VC {vc}."
        self._reserve(name, _Reservation(p, pending, placements, leaves, reason, vc))
        return Decision("preempt", victims=tuple(victims), reason=reason)

    def _downgrade(self, name: str) -> None:
        """Lazy preemption: the group runs on as opportunistic; its VC quota is free again."""
        g = self._groups[name]
        leaves = [lf for lv in g.leaves.values() for lf in lv]
        for lf in leaves:
            self._set_leaf(lf, None, lf.reserved_by)
        self._groups_prio[g.request.virtual_cluster][g.priority].pop(name, None)
        g.priority = -1
        self._groups_prio[g.request.virtual_cluster][-1][name] = None
        for lf in leaves:
            self._set_leaf(lf, name, lf.reserved_by)

    def _reserve(self, name: str, res: _Reservation) -> None:
        self._cancel(name)
        for lf in res.leaves:
            other = lf.reserved_by
            if other is not None and other != name:
                self._cancel(other)  # superseded by a higher priority preemptor
        for lf in res.leaves:
            self._set_leaf(lf, lf.group, name)
        self._reservations[name] = res

    def _resume_reservation(
        self, request: GroupRequest, res: _Reservation, pending: tuple[Instance, ...]
    ) -> Decision | None:
        if res.pending != pending or res.priority != request.priority or any(lf.bad for lf in res.leaves):
            # changed, or a reserved cell's node went bad: HiveD deletes the preempting group then
            self.cancel(request.name)
            return None
        occupants = list(dict.fromkeys(lf.group for lf in res.leaves if lf.group is not None))
        if not occupants:
            return Decision("place", res.placements, reason=self._place_reason(request, res.placements, len(pending)))
        if all(self._groups[g].priority < res.priority for g in occupants):
            return Decision("preempt", victims=tuple(occupants), reason=res.reason, downgraded=res.downgraded)
        self.cancel(request.name)
        return None

    # ------------------------------------------------------------------ reasons
    def _wait_reason(self, request: GroupRequest, pending: tuple[Instance, ...], option: dict[str, str]) -> str:
        """The waiting reason, from counters (no scan of cells)."""
        vc, p = request.virtual_cluster, request.priority
        parts: list[str] = []
        for (pinned, sku), items in self._items(request, pending, option).items():
            scope: str = ALL_VCS if request.opportunistic and pinned is None else vc
            key: PoolKey = (scope, pinned, sku)
            total = self._pool_leaves.get(key, 0)
            idx = self._index.get(key)
            if scope == ALL_VCS:
                free = idx.total if idx is not None else 0
            elif pinned is None:
                free = self._vc_free(vc, sku)
            else:
                free = idx.total if idx is not None else 0
            where = "the cluster" if scope == ALL_VCS else f"VC {vc}"
            cell_kind = f"{sku} leaf cells" + (f" of pinned cell {pinned}" if pinned else "")
            needs = {it[2] for it in items}
            if request.gang and len(items) > 1 and len(needs) == 1:
                n = needs.pop()
                slots = 0
                if idx is not None:
                    slots = sum(len(b) * (k // n) for k, b in enumerate(idx.buckets))
                if scope != ALL_VCS and pinned is None:
                    for (chain_name, lv), cnt in self._unbound[vc].items():
                        chain = self.topo.chains[chain_name]
                        if cnt <= 0 or self.topo.chain_sku[chain_name] != sku:
                            continue
                        nl = self._node_leaves(chain_name)
                        per = (
                            (chain.leaves_at[lv] // nl) * (nl // n)
                            if chain.leaves_at[lv] >= nl
                            else (chain.leaves_at[lv] // n)
                        )
                        slots += cnt * per
                parts.append(
                    f"Gang of {len(items)} tasks needs {len(items)} nodes with {n} free leaf "
                    f"cell{'s' if n != 1 else ''} each in {where}; {slots} available."
                    if self._pool_max.get(key, 0) < 2 * n
                    else f"Gang of {len(items)} tasks needs {len(items)} slots of {n} free leaf cell(s) "
                    f"on one node each in {where}; {slots} available."
                )
            parts.append(f"Waiting for resources: {where} has {free} of {total} {cell_kind} free")
            if request.opportunistic:
                parts[-1] += "; opportunistic jobs never preempt."
            else:
                blocking: list[str] = []
                n_block = 0
                for prio, names in self._groups_prio[vc].items():
                    if prio >= p:
                        n_block += len(names) - (request.name in names)
                        for g in names:
                            if g != request.name and len(blocking) < 5:
                                blocking.append(g)
                if blocking:
                    who = ", ".join(_who(self._groups[g]) for g in blocking)
                    more = f" and {n_block - len(blocking)} more" if n_block > len(blocking) else ""
                    parts[-1] += f"; used by {who}{more} which this job ({_self_label(p)}) cannot preempt."
                else:
                    parts[-1] += "."
            for r, res in self._reservations.items():
                if r != request.name and res.vc == vc and not request.opportunistic:
                    parts.append(
                        f"{len(res.leaves)} cell(s) reserved for preempting job {r} (priority {res.priority})."
                    )
            if self._unhealthy:
                chains = {c.name for c in self._chains_of_sku.get(sku, [])}
                bad = sorted(n for n in self._unhealthy if any(c.chain in chains for c in self.topo.nodes[n]))
                if bad:
                    parts.append("; ".join(f"node {b} unhealthy" for b in bad[:5]) + ".")
        return " ".join(parts)

    def _node_leaves(self, chain: str) -> int:
        lv = self._node_level.get(chain, 1)
        return self.topo.chains[chain].leaves_at[lv] or 1

    # ------------------------------------------------------------------ state changes
    def _set_leaf(self, lf: Cell, group: str | None, reserved_by: str | None) -> None:
        old_g, old_r = lf.group, lf.reserved_by
        was_free = old_g is None and old_r is None
        pinned = lf.pinned_cell_id is not None
        old_h = 0
        if old_g is not None:
            g = self._groups[old_g]
            if g.priority >= 0:
                old_h = 1
                self._used_prio[g.request.virtual_cluster][g.priority] -= 1
            else:
                self._oppo_used[g.request.virtual_cluster] -= 1
                if lf.vc is not None and not pinned:
                    self._oppo_count(lf.vc, old_g, -1)
            if group is None:
                x: Cell | None = lf
                while x is not None:
                    x.used -= 1
                    x = x.parent
        if old_r is not None:
            old_h = 1
            if old_g is None:
                self._reserved[lf.vc or ""] -= 1
        lf.group, lf.reserved_by = group, reserved_by
        new_h = 0
        if group is not None:
            g = self._groups[group]
            if g.priority >= 0:
                new_h = 1
                self._used_prio[g.request.virtual_cluster][g.priority] += 1
            else:
                self._oppo_used[g.request.virtual_cluster] += 1
                if lf.vc is not None and not pinned:
                    self._oppo_count(lf.vc, group, 1)
            if old_g is None:
                x = lf
                while x is not None:
                    x.used += 1
                    x = x.parent
        if reserved_by is not None:
            new_h = 1
            if group is None:
                self._reserved[lf.vc or ""] += 1
        if new_h != old_h and lf.vc is not None and not pinned:
            self._used_sku[(lf.vc, lf.sku)] += new_h - old_h
            root = lf.bound_root()
            if root is not None:
                root.hold += new_h - old_h
                if root.hold == 0:
                    self._maybe_unbind[root] = None
        is_free = group is None and reserved_by is None
        if was_free != is_free:
            d = 1 if is_free else -1
            seg = lf.segment
            if seg is None:  # every leaf gets its segment when the scheduler is built
                raise PlatformError(f"leaf cell {lf.index} of node {lf.node_name} has no segment")
            self._seg_free(seg, d)
            if lf.all_segment is not None:
                self._seg_free(lf.all_segment, d)

    def _oppo_count(self, vc: str, group: str, delta: int) -> None:
        inside = self._oppo_in[vc]
        n = inside.get(group, 0) + delta
        if n:
            inside[group] = n
        else:
            inside.pop(group, None)

    def _ancestor_at(self, lf: Cell, level: int) -> Cell | None:
        x: Cell | None = lf
        while x is not None and x.level < level:
            x = x.parent
        return x if x is not None and x.level == level else None

    def _cover(self, name: str, vc: str, leaves: list[Cell], plan: list[Cell]) -> list[Cell]:
        """Bind virtual cells of ``vc`` so every leaf is in a cell bound to ``vc``; the new bindings.
        Uses ``plan`` (from schedule) first, then the lowest level that binds.  PlatformError (nothing
        changed) when impossible."""
        new: list[Cell] = []
        try:
            for c in plan:
                if c.state == BOUND and c.vc == vc:
                    continue
                if self._bind(c, vc):
                    new.append(c)
            for lf in leaves:
                if lf.pinned_cell_id is not None:
                    if lf.vc != vc:
                        raise PlatformError(
                            f"allocate {name}: pinned leaf cell {lf.index} of {lf.node} is not VC {vc}'s"
                        )
                    continue
                root = lf.bound_root()
                if root is not None:
                    if root.vc != vc:
                        raise PlatformError(
                            f"allocate {name}: leaf cell {lf.index} of node {lf.node_name} "
                            f"is bound to VC {root.vc}"
                        )
                    continue
                levels = sorted(lv for (ch, lv), n in self._unbound[vc].items() if ch == lf.chain and n > 0)
                # prefer the lowest level whose cell holds all the group's uncovered leaves of this chain,
                # then all of this node's, then any (keeps replay after a restart close to schedule's plan)
                rest = [
                    x for x in leaves if x.chain == lf.chain and x.bound_root() is None and x.pinned_cell_id is None
                ]
                on_node = [x for x in rest if x.node is lf.node]
                cands = [(lv, self._ancestor_at(lf, lv)) for lv in levels]
                ranked = sorted(
                    (a for _, a in cands if a is not None),
                    key=lambda a: (
                        not all(self._ancestor_at(x, a.level) is a for x in rest),
                        not all(self._ancestor_at(x, a.level) is a for x in on_node),
                        a.level,
                    ),
                )
                for a in ranked:
                    if self._bind(a, vc):
                        new.append(a)
                        break
                else:
                    raise PlatformError(
                        f"allocate {name}: VC {vc} has no free virtual cell (quota) that can be bound to leaf "
                        f"cell {lf.index} of node {lf.node_name} without breaking VC safety"
                    )
        except PlatformError:
            for c in reversed(new):
                if c.state == BOUND and c.hold == 0:
                    self._unbind(c)
            raise
        return new

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
            g = self._groups[name] = _Group(request, priority=request.priority, seq=self._alloc_seq)
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

    def _cancel(self, name: str) -> None:
        res = self._reservations.pop(name, None)
        if res is None:
            return
        for lf in res.leaves:
            if lf.reserved_by == name:
                self._set_leaf(lf, lf.group, None)

    def cancel(self, name: str) -> None:
        """Drop the reservation (Preempting state) of a group that no longer waits.  Idempotent."""
        self._plans.pop(name, None)
        self._cancel(name)
        self._gc()

    def set_node_health(self, node: str, healthy: bool) -> None:
        """Mark a node (un)healthy (or cordoned): an unhealthy node gets no new placements; existing
        ones stay and its cells stay counted in quota.  Free virtual cells bind to healthy cells
        first; see ``status()['virtualClusters'][vc]['doomedBadCells']``."""
        cells = self.topo.nodes.get(node)
        if cells is None:
            raise ValidationError("node", f"unknown node {node!r}")
        if healthy == (node not in self._unhealthy):
            return
        if healthy:
            self._unhealthy.discard(node)
        else:
            self._unhealthy.add(node)
        for cell in cells:  # one node-level cell per chain the node is in
            n = len(cell.leaves)
            if healthy:
                for c in cell.internal or [cell]:
                    c.bad = 0
                for lf in cell.leaves:
                    lf.bad = 0
                for a in cell.ancestors():
                    a.bad -= n
                for seg in cell.segs.values():
                    for idx in seg.index:
                        idx.move(seg, 0, seg.free)
            else:
                for seg in cell.segs.values():
                    for idx in seg.index:
                        idx.move(seg, seg.free, 0)
                for c in cell.internal or [cell]:
                    c.bad = len(c.leaves)
                for lf in cell.leaves:
                    lf.bad = 1
                for a in cell.ancestors():
                    a.bad += n

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

    def _doomed(self) -> dict[str, dict[tuple[str, int], int]]:
        """Per VC and (chain, level): unbound virtual cells only bad hardware can satisfy now.

        Per VC, as HiveD does (``tryBindDoomedBadCell``): a VC's free virtual cells are doomed when that
        VC alone has more of them (at a level and above) than the chain has healthy free cells; the
        other VCs' demand does not count against it (each would take the healthy cells first)."""
        out: dict[str, dict[tuple[str, int], int]] = {v: {} for v in self._vcs}
        if not self._unhealthy:
            return out
        by_chain: dict[str, dict[Cell, None]] = defaultdict(dict)
        for n in self._unhealthy:
            for cell in self.topo.nodes[n]:
                f = self._free_ancestor(cell)
                if f is not None:
                    by_chain[f.chain][f] = None
        for chain_name, frees in by_chain.items():
            chain = self.topo.chains[chain_name]
            H = list(chain.F)

            def clean(c: Cell, H: list[int] = H) -> None:
                for ch in c.children:
                    if ch.bad == 0:
                        H[ch.level] += len(ch.leaves)
                    elif ch.level > 1 and ch.bad < len(ch.leaves):
                        clean(ch)

            for f in frees:
                H[f.level] -= len(f.leaves)
                clean(f)
            for v in self._vcs:
                sh = sd = lost = 0
                for lv in range(chain.top, 0, -1):
                    dv = self._unbound[v].get((chain_name, lv), 0) * chain.leaves_at[lv]
                    sh += H[lv]
                    sd += dv
                    deficit = sd - sh - lost
                    if deficit > 0 and dv > 0:
                        cells = min(-(-deficit // chain.leaves_at[lv]), dv // chain.leaves_at[lv])
                        lost += cells * chain.leaves_at[lv]
                        out[v][(chain_name, lv)] = cells
        return out

    def status(self, vc: str | None = None) -> dict[str, Any]:
        """JSON-able snapshot (cost O(nodes + groups), no cell scan).

        ``virtualClusters`` {vc: {quota, used, free, reserved, opportunisticUsed (leaf cells; used =
        by its guaranteed groups, opportunisticUsed = by its opportunistic groups anywhere),
        badCells (its bound leaves on unhealthy nodes), doomedBadCells (virtual cells only bad
        hardware can satisfy), cells: {"<chain>/<level>": {total, bound, free}}}}, ``physical``
        {chain: {level: free cells}}, ``nodes`` {node: {leafCells, healthy, used: {group: leaves}}},
        ``groups`` {group: {vc, priority, downgraded, placements}}, ``reservations`` {group:
        {priority, victims, cells}}.  ``vc`` restricts VCs, groups, nodes and reservations to one VC.
        """
        doomed = self._doomed()
        vcs = {}
        for v in self._vcs if vc is None else [vc]:
            if v not in self._unbound:
                raise ValidationError("vc", f"unknown virtual cluster {v!r}")
            quota = sum(n for k, n in self._pool_leaves.items() if k[0] == v)
            used = sum(self._used_prio[v].values())
            reserved = self._reserved.get(v, 0)
            bad = sum(c.bad for c in self._bound[v])
            cells = {}
            for (chain_name, lv), total in self._vcell_total[v].items():
                free = self._unbound[v][(chain_name, lv)]
                cells[f"{chain_name}/{lv}"] = {"total": total, "bound": total - free, "free": free}
            vcs[v] = {
                "quota": quota,
                "used": used,
                "free": quota - used - reserved,
                "reserved": reserved,
                "opportunisticUsed": self._oppo_used.get(v, 0),
                "badCells": bad,
                "doomedBadCells": sum(doomed[v].values()),
                "cells": cells,
            }
        physical = {
            name: {str(lv): len(chain.free[lv]) for lv in range(chain.top, 0, -1) if chain.free[lv]}
            for name, chain in self.topo.chains.items()
        }
        groups = {
            n: {
                "vc": g.request.virtual_cluster,
                "priority": g.priority,
                "downgraded": g.priority < 0 <= g.request.priority,
                "placements": [
                    {"task": f"{p.task_role}[{p.index}]", "node": p.node, "leafCells": list(p.leaf_cell_indices)}
                    for p in g.placements.values()
                ],
            }
            for n, g in self._groups.items()
            if vc is None or g.request.virtual_cluster == vc
        }
        nodes: dict[str, dict[str, Any]] = {}
        if vc is None:
            nodes = {
                n: {"leafCells": sum(len(c.leaves) for c in cs), "healthy": n not in self._unhealthy, "used": {}}
                for n, cs in self.topo.nodes.items()
            }
        for gname in groups:
            for pl in self._groups[gname].placements.values():
                cs = self.topo.nodes[pl.node]
                leaf_cells = sum(len(c.leaves) for c in cs)
                row = nodes.setdefault(
                    pl.node, {"leafCells": leaf_cells, "healthy": pl.node not in self._unhealthy, "used": {}}
                )
                row["used"][gname] = row["used"].get(gname, 0) + len(pl.leaf_cell_indices)
        res = {
            n: {
                "priority": r.priority,
                "victims": list(dict.fromkeys(lf.group for lf in r.leaves if lf.group)),
                "cells": [f"{lf.node_name}/{lf.index}" for lf in r.leaves],
            }
            for n, r in self._reservations.items()
            if vc is None or r.vc == vc
        }
        return {"virtualClusters": vcs, "physical": physical, "nodes": nodes, "groups": groups, "reservations": res}

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Verify the whole state from scratch (O(cells); for tests and debugging).  Raises
        PlatformError naming the first violation: VC safety (free physical capacity per chain and
        level below the VCs' unbound virtual cells), a leaf given to two groups, a guaranteed group
        outside its VC's bound cells, counters or free lists out of sync."""

        def fail(msg: str) -> None:
            raise PlatformError(f"scheduler invariant broken: {msg}")

        for name, chain in self.topo.chains.items():
            lv = chain.violation()
            if lv is not None:
                fail(f"VC safety in chain {name} at level {lv}: free {chain.F} < unbound {chain.D}")
            F = [0] * (chain.top + 1)
            D = [0] * (chain.top + 1)
            for v in self._vcs:
                for (ch, lv2), n in self._unbound[v].items():
                    if ch == name:
                        if n < 0:
                            fail(f"VC {v} has {n} unbound cells at {ch}/{lv2}")
                        D[lv2] += n * chain.leaves_at[lv2]
            for lv2 in range(1, chain.top + 1):
                for c in chain.free[lv2]:
                    if c.state != FREE or c.level != lv2:
                        fail(f"{c} in free list {lv2} but {STATE_NAMES[c.state]}")
                    F[lv2] += len(c.leaves)
            if F != chain.F or D != chain.D:
                fail(f"chain {name} counters F={chain.F}/{F} D={chain.D}/{D}")
        for v in self._vcs:
            for key, total in self._vcell_total[v].items():
                nb = sum(1 for c in self._bound[v] if (c.chain, c.level) == key)
                if nb + self._unbound[v][key] != total:
                    fail(f"VC {v} {key}: {nb} bound + {self._unbound[v][key]} unbound != {total}")
            for c in self._bound[v]:
                if c.state != BOUND or c.vc != v:
                    fail(f"{c} listed bound to {v} but {STATE_NAMES[c.state]} {c.vc}")
                hold = sum(
                    1
                    for lf in c.leaves
                    if lf.reserved_by is not None or (lf.group is not None and self._groups[lf.group].priority >= 0)
                )
                if hold != c.hold or hold == 0:
                    fail(f"{c} hold {c.hold}, actual {hold} (a bound cell must be in use)")
                if any(lf.vc != v for lf in c.leaves):
                    fail(f"{c} bound to {v} has leaves of another VC")
        owner: dict[int, str] = {}
        for name, g in self._groups.items():
            for leaves in g.leaves.values():
                for lf in leaves:
                    if id(lf) in owner:
                        fail(f"leaf {lf.node}/{lf.index} used by {owner[id(lf)]} and {name}")
                    owner[id(lf)] = name
                    if lf.group != name:
                        fail(f"leaf {lf.node}/{lf.index} of {name} records {lf.group}")
                    if g.priority >= 0:
                        vc = g.request.virtual_cluster
                        if lf.vc != vc or (lf.pinned_cell_id is None and (lf.bound_root() or lf).vc != vc):
                            fail(f"guaranteed {name} of VC {vc} uses leaf {lf.node}/{lf.index} outside its cells")
                    elif lf.pinned_cell_id is not None:
                        fail(f"opportunistic {name} uses pinned leaf {lf.node}/{lf.index}")
        for node in self.topo.node_cells():
            for lf in node.leaves:
                if lf.group is not None and owner.get(id(lf)) != lf.group:
                    fail(f"leaf {node.address}/{lf.index} records unknown user {lf.group}")
                if lf.reserved_by is not None and (
                    lf.reserved_by not in self._reservations
                    or all(x is not lf for x in self._reservations[lf.reserved_by].leaves)
                ):
                    fail(f"leaf {node.address}/{lf.index} reserved by {lf.reserved_by} without a reservation")
            for seg in node.segs.values():
                free = sum(1 for lf in seg.leaves if lf.group is None and lf.reserved_by is None)
                if free != seg.free:
                    fail(f"segment {seg} free {seg.free}, actual {free}")
                for lf in seg.leaves:
                    if lf.segment is not seg and lf.all_segment is not seg:
                        fail(f"leaf {node.address}/{lf.index} listed in {seg}")
        for pool, idx in self._index.items():
            total = sum(s.free for s in self._pool_segs[pool] if s.node.bad == 0)
            if total != idx.total:
                fail(f"index {pool} total {idx.total}, actual {total}")
        inside: dict[str, dict[str, int]] = defaultdict(dict)
        for name, g in self._groups.items():
            if g.priority < 0:
                for lf in (x for lv in g.leaves.values() for x in lv):
                    if lf.vc is not None and lf.pinned_cell_id is None:
                        inside[lf.vc][name] = inside[lf.vc].get(name, 0) + 1
        for v in set(inside) | set(self._oppo_in):
            if inside.get(v, {}) != self._oppo_in.get(v, {}):
                fail(f"opportunistic groups in VC {v}'s cells {dict(self._oppo_in.get(v, {}))}, actual {inside[v]}")

    # ------------------------------------------------------------------ reconfiguration
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
                new._groups[name] = _Group(req, priority=-1)
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
                    new._groups[name] = _Group(req, priority=-1)
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
