"""Cell allocation: the scheduler's state and the buddy allocator that binds virtual cells lazily.

The counterpart of HiveD's ``cell_allocation.go`` (buddy allocation, binding and unbinding virtual
cells, choosing the physical cell to bind) and of the cell bookkeeping in ``hived_algorithm.go``
(allocating and releasing leaf cells).  :class:`CellAllocation` holds every piece of state the
scheduler keeps; the layers above it (:mod:`~apiary.scheduler.preemption`,
:mod:`~apiary.scheduler.intra_vc`, :mod:`~apiary.scheduler.inspection`,
:mod:`~apiary.scheduler.hived`) add behaviour, not state.

Rules and their sources:

* Virtual cells bind LAZILY (HiveD paper section 4.2; doc/design/state-machine.md): when first used, by
  buddy allocation, and unbind when no guaranteed group uses them and nothing is reserved in them.  The
  safety invariant of :class:`~apiary.scheduler.cells.Chain` is checked on every binding; a binding
  that would break it is refused.
* The physical cell to bind (:meth:`CellAllocation._cell_key`): one holding a healthy cell of the
  wanted level first (HiveD ``getUsablePhysicalCells`` skips bad nodes), then the lowest free level
  (``getLowestFreeCellLevel``: buddy, keep big cells whole), then one no opportunistic group uses,
  then the fewest leaf cells in use (HiveD: fewer opportunistic pods first, to reduce preemption),
  beside the previous binding, then the most recently started occupants, then config order.  HiveD
  takes the first of its free list among equals; Apiary takes config order (the free list's order
  depends on the history of splits and merges, which HiveD's tests pod8 and pod24 reach).

Units: leaf cells.  Errors: PlatformError for an allocation the state cannot take.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from apiary.errors import PlatformError, ValidationError
from apiary.scheduler.cells import (
    ALL_VCS,
    BOUND,
    FREE,
    INSIDE,
    SPLIT,
    BucketIndex,
    Cell,
    Chain,
    PoolKey,
    Segment,
    Topology,
    build_topology,
    check_initial_assignment,
)
from apiary.scheduler.placement import Fit, Instance, Item
from apiary.scheduler.sizing import leaf_cells_needed
from apiary.scheduler.types import GroupRequest, TaskPlacement, TaskRequest, priority_label
from apiary.spec.cluster import ClusterConfig

#: free-list entries looked at per level when choosing a physical cell to bind
_BIND_SCAN = 32


def unknown_vc_message(vc: str, valid: Sequence[str]) -> str:
    """``unknown virtual cluster 'vc3'; did you mean 'vc1'? (valid: vc1, vc2)``: the closest match
    (difflib's similarity ratio >= 0.6, as ``get_close_matches``; the first in ``valid``'s order among
    equals) and every valid name, sorted."""
    ratios = [(difflib.SequenceMatcher(None, vc, v).ratio(), -i, v) for i, v in enumerate(valid)]
    best = max(ratios, default=(0.0, 0, ""))
    hint = f"; did you mean {best[2]!r}?" if best[0] >= 0.6 else ""
    names = ", ".join(sorted(valid)) or "none"
    return f"unknown virtual cluster {vc!r}{hint} (valid: {names})"


@dataclass
class Group:
    """A group holding leaf cells: its request, placements and leaves per (task role, index)."""

    request: GroupRequest
    placements: dict[Instance, TaskPlacement] = field(default_factory=dict)
    leaves: dict[Instance, list[Cell]] = field(default_factory=dict)
    priority: int = 0  # effective: -1 once downgraded by lazy preemption
    seq: int = 0  # allocation order (no clock here): a higher seq started more recently


@dataclass
class Reservation:
    """The cells a preempting group holds (HiveD "Preempting"): its priority, the instances and
    placements it waits for, the reserved leaves, the reason shown while it waits, its VC and the
    victims lazy preemption downgraded."""

    priority: int
    pending: tuple[Instance, ...]
    placements: tuple[TaskPlacement, ...]
    leaves: list[Cell]
    reason: str
    vc: str
    downgraded: tuple[str, ...] = ()


def self_label(priority: int) -> str:
    """A priority as a waiting reason names the waiting job's own: ``"prod, 100"``, ``"priority 7"``."""
    lab = priority_label(priority)
    return lab if lab.startswith("priority") or priority < 0 else f"{lab}, {priority}"


def who(g: Group) -> str:
    """A group as a reason names it: ``"job-1 (prod, priority 100)"``, ``"job-2 (opportunistic)"``."""
    if g.priority < 0:
        return f"{g.request.name} (opportunistic)"
    lab = priority_label(g.priority)
    return (
        f"{g.request.name} ({lab}, priority {g.priority})"
        if not lab.startswith("priority")
        else (f"{g.request.name} ({lab})")
    )


class CellAllocation:
    """The cells of one :class:`~apiary.spec.cluster.ClusterConfig` and who uses them: the buddy
    allocator per chain, the VCs' bound and unbound virtual cells, the pool segments and their
    indexes, the groups holding leaf cells and the reservations of preempting groups.

    Construction builds the cell tree and checks that every VC's virtual cells fit (raises
    ValidationError naming the VC and level on an impossible assignment).  ``lazy_preemption``: the
    default for groups whose request does not say.
    """

    def __init__(self, config: ClusterConfig, lazy_preemption: bool = False) -> None:
        self.config = config
        self.lazy_preemption = lazy_preemption
        self.topo: Topology = build_topology(config)
        check_initial_assignment(self.topo, config)
        self._skus = config.physical_cluster.sku_types
        self._sku_order = list(self._skus)
        self._vcs = list(config.virtual_clusters)
        self._groups: dict[str, Group] = {}
        self._reservations: dict[str, Reservation] = {}
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
        return any(CellAllocation._has_clean(ch, level) for ch in c.children)

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

    def _bind_budget(self, vc: str, sku: str, items: Sequence[Item]) -> int:
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


    def _items(
        self, request: GroupRequest, pending: Iterable[Instance], option: dict[str, str]
    ) -> dict[tuple[str | None, str], list[Item]]:
        """Pending instances grouped by (pinned id, sku)."""
        out: dict[tuple[str | None, str], list[Item]] = defaultdict(list)
        for tr, i in pending:
            t = request.task(tr)
            sku = option[tr]
            out[(t.pinned_cell_id, sku)].append((tr, i, self._leaf_need(t, sku)))
        return out

    def _placements(self, fit: Fit) -> tuple[TaskPlacement, ...]:
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
                if lf.all_segment is not None:
                    lf.all_segment.oppo -= 1
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
                if lf.all_segment is not None:
                    lf.all_segment.oppo += 1
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

