"""The cell model: physical cell tree, VC binding, node segments and free-cell indices.

HiveD (OSDI'20, "HiveD: Sharing a GPU Cluster for Deep Learning with Guarantees") models the cluster
as a forest of *cells*: a cell of level ``k`` has children of level ``k-1``; level 1 is the leaf cell
(one sku, e.g. a GPU).  Each chain (the type of a top-level physical cell) is one tree.  A VC owns
*virtual cells* which are bound to physical cells.  HiveD binds lazily and keeps the safety invariant
with buddy allocation; this module binds statically at construction (deterministic first-fit that
splits already-split cells first, highest level first) but keeps the shape HiveD needs: cells with
level, parent, children, a per-leaf state (Free / Used / Reserved, see STATE-MACHINE.md) and
per-(chain, level) lists of bindable cells, so lazy binding can replace :func:`bind_virtual_clusters`
without touching the scheduler's interface.

A *segment* is the part of one node that belongs to one pool ``(vc, pinned_cell_id, sku)``
(``vc`` None = unbound cells, usable only opportunistically).  Tasks are placed on one segment.
:class:`BucketIndex` keeps a pool's healthy segments bucketed by free leaf count so best fit
("the node with the fewest free cells that still fits") is O(max leaves per node), not O(nodes).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from apiary.errors import ValidationError
from apiary.spec.cluster import ClusterConfig, PhysicalCell

PoolKey = tuple[str | None, str | None, str]  # (vc or None = unbound / "*" = all, pinned id, sku)
ALL_VCS = "*"


class CellState(enum.Enum):
    """State of a leaf cell (HiveD doc/design/state-machine.md, simplified to static binding)."""

    FREE = "Free"
    USED = "Used"  # allocated to a group (HiveD: Used / Reserving when also reserved_by is set)
    RESERVED = "Reserved"  # free, but held for a preempting group


class Cell:
    """One physical cell.  ``level`` 1 = leaf.  Leaf-only fields: ``index`` (within its node),
    ``group`` (user), ``reserved_by`` (preemptor), ``segment``."""

    __slots__ = (
        "cell_type",
        "chain",
        "level",
        "address",
        "parent",
        "children",
        "is_node_level",
        "node",
        "order",
        "leaves",
        "nominal_leaves",
        "pinned_cell_id",
        "bound_leaves",
        "vc",
        "index",
        "sku",
        "group",
        "reserved_by",
        "segment",
        "internal",
    )

    def __init__(self, cell_type: str, chain: str, level: int, address: str, parent: Cell | None) -> None:
        self.cell_type = cell_type
        self.chain = chain
        self.level = level
        self.address = address
        self.parent = parent
        self.children: list[Cell] = []
        self.is_node_level = False
        self.node: Cell | None = None  # the node-level cell at or above (None above node level)
        self.order = 0  # DFS order, for determinism
        self.leaves: list[Cell] = []  # leaf cells below (self for a leaf)
        self.nominal_leaves = 0
        self.pinned_cell_id: str | None = None
        self.bound_leaves = 0  # leaves below bound to a VC or pinned
        self.vc: str | None = None  # leaf: the VC it is bound to
        self.index = -1
        self.sku = ""
        self.group: str | None = None
        self.reserved_by: str | None = None
        self.segment: Segment | None = None
        self.internal: list[Cell] = []  # node: its non-leaf descendants (incl. itself) if deeper than 1

    @property
    def complete(self) -> bool:
        return len(self.leaves) == self.nominal_leaves

    @property
    def state(self) -> CellState:
        if self.group is not None:
            return CellState.USED
        if self.reserved_by is not None:
            return CellState.RESERVED
        return CellState.FREE

    def ancestors(self) -> Iterator[Cell]:
        c = self.parent
        while c is not None:
            yield c
            c = c.parent

    def __repr__(self) -> str:
        return f"Cell({self.cell_type}@{self.address})"


class Segment:
    """The leaves of one node that belong to one pool; ``free`` counts FREE leaves."""

    __slots__ = ("node", "pool", "leaves", "free", "order", "index")

    def __init__(self, node: Cell, pool: PoolKey, order: int) -> None:
        self.node = node
        self.pool = pool
        self.leaves: list[Cell] = []
        self.free = 0
        self.order = order
        self.index: list[BucketIndex] = []  # indices this segment is listed in while healthy

    def free_leaves(self, group: str | None = None) -> list[Cell]:
        """FREE leaves (and leaves reserved for ``group``), by index."""
        return [
            lf
            for lf in self.leaves
            if lf.group is None and (lf.reserved_by is None or lf.reserved_by == group)
        ]

    def __repr__(self) -> str:
        return f"Segment({self.node.address}, {self.pool})"


class BucketIndex:
    """Segments bucketed by free leaf count (insertion-ordered dicts keep it deterministic)."""

    def __init__(self) -> None:
        self.buckets: list[dict[Segment, None]] = [{}]

    def move(self, seg: Segment, old: int, new: int) -> None:
        if old > 0:
            self.buckets[old].pop(seg, None)
        if new > 0:
            while len(self.buckets) <= new:
                self.buckets.append({})
            self.buckets[new][seg] = None

    def best_fit(self, need: int) -> Segment | None:
        for k in range(max(need, 1), len(self.buckets)):
            for seg in self.buckets[k]:
                return seg
        return None

    def segments(self) -> Iterator[Segment]:
        for b in self.buckets[1:]:
            yield from b

    def free_total(self) -> int:
        return sum(k * len(b) for k, b in enumerate(self.buckets))


@dataclass
class Topology:
    """The physical forest plus the static VC binding and the segments."""

    roots: list[Cell] = field(default_factory=list)
    nodes: dict[str, Cell] = field(default_factory=dict)
    cells_by_type: dict[tuple[str, str], list[Cell]] = field(default_factory=dict)  # (chain, type)
    pinned: dict[str, Cell] = field(default_factory=dict)
    pinned_vc: dict[str, str] = field(default_factory=dict)
    bindings: dict[str, list[tuple[str, Cell]]] = field(default_factory=dict)  # vc -> (path, cell)
    segments: list[Segment] = field(default_factory=list)


def _type_levels(config: ClusterConfig) -> dict[str, int]:
    levels = {s: 1 for s in config.physical_cluster.sku_types}
    types = config.physical_cluster.cell_types

    def level(t: str) -> int:
        if t not in levels:
            levels[t] = level(types[t].child_cell_type) + 1
        return levels[t]

    for t in types:
        level(t)
    return levels


def build_topology(config: ClusterConfig) -> Topology:
    """Build the physical cell forest of ``config`` (already checked by the loader)."""
    topo = Topology()
    levels = _type_levels(config)
    types = config.physical_cluster.cell_types
    counter = [0]

    def build(
        spec: PhysicalCell | None,
        t: str,
        chain: str,
        address: str,
        parent: Cell | None,
        pinned: str | None,
        node: Cell | None,
    ) -> Cell:
        cell = Cell(t, chain, levels[t], address, parent)
        cell.order = counter[0]
        counter[0] += 1
        cell.nominal_leaves = config.leaf_count(t)
        topo.cells_by_type.setdefault((chain, t), []).append(cell)
        if spec is not None and spec.pinned_cell_id is not None:
            pinned = spec.pinned_cell_id
            topo.pinned[pinned] = cell
        cell.pinned_cell_id = pinned
        if t in config.physical_cluster.sku_types:
            cell.sku = t
            cell.node = node
            cell.leaves = [cell]
            return cell
        ct = types[t]
        if ct.is_node_level:
            cell.is_node_level = True
            node = cell
            topo.nodes[address] = cell
        cell.node = node
        specs = list(spec.cell_children) if spec is not None else []
        if node is not None:  # at or below node level: missing children are generated
            specs += [None] * (ct.child_cell_number - len(specs))
        for i, ch in enumerate(specs):
            if ch is not None and ch.cell_address is not None:
                addr = ch.cell_address
            elif node is None:
                addr = f"{address}/{i}"
            else:
                addr = str(i)
            child = build(ch, ct.child_cell_type, chain, addr, cell, pinned, node)
            cell.children.append(child)
            cell.leaves.extend(child.leaves)
        cell.sku = cell.leaves[0].sku if cell.leaves else config.leaf_sku(t)
        return cell

    for i, spec in enumerate(config.physical_cluster.physical_cells):
        t = spec.cell_type or ""
        topo.roots.append(build(spec, t, t, spec.cell_address or f"{t}[{i}]", None, None, None))

    for node in topo.nodes.values():
        addrs = [lf.address for lf in node.leaves]
        # leaves directly under the node may carry their GPU index as cellAddress; deeper nodes
        # number their leaves in DFS order
        explicit = (
            node.level == 2 and all(a.isdigit() for a in addrs) and len({int(a) for a in addrs}) == len(addrs)
        )
        for i, lf in enumerate(node.leaves):
            lf.index = int(lf.address) if explicit else i
        node.leaves.sort(key=lambda c: c.index)
        if node.level > 2:
            stack = [node]
            while stack:
                c = stack.pop()
                if c.level > 1:
                    node.internal.append(c)
                    stack.extend(c.children)
            node.internal.sort(key=lambda c: c.order)
    return topo


def _mark_bound(cell: Cell, vc: str | None) -> None:
    """Bind ``cell`` (its whole subtree) to ``vc``; ancestors count the bound leaves."""
    stack = [cell]
    while stack:
        c = stack.pop()
        c.bound_leaves = len(c.leaves)
        if c.level == 1:
            c.vc = vc
        stack.extend(c.children)
    n = len(cell.leaves)
    a = cell.parent
    while a is not None:
        a.bound_leaves += n
        a = a.parent


def bind_virtual_clusters(topo: Topology, config: ClusterConfig) -> None:
    """Statically bind every VC's virtual cells and pinned cells to physical cells.

    Order: pinned cells first, then virtual cells highest level first; among free physical cells of
    the requested (chain, type), prefer ones under the lowest already-split ancestor (buddy-style:
    split a cell that is already split before splitting a whole one), then DFS order.  Raises
    ValidationError ``virtualClusters.<vc>.virtualCells[<i>]`` when too few remain.
    """
    for cell in topo.pinned.values():  # every pinned cell is out of the virtual-cell pool
        _mark_bound(cell, None)
    for vc_name, vc in config.virtual_clusters.items():
        topo.bindings.setdefault(vc_name, [])
        for pc in vc.pinned_cells:
            cell = topo.pinned[pc.pinned_cell_id]
            topo.pinned_vc[pc.pinned_cell_id] = vc_name
            for lf in cell.leaves:
                lf.vc = vc_name
            topo.bindings[vc_name].append((f"pinned:{pc.pinned_cell_id}", cell))

    levels = _type_levels(config)
    vc_order = {name: i for i, name in enumerate(config.virtual_clusters)}
    requests = [
        (vc_name, i, vcell)
        for vc_name, vc in config.virtual_clusters.items()
        for i, vcell in enumerate(vc.virtual_cells)
    ]
    requests.sort(key=lambda r: (-levels[r[2].leaf_type], vc_order[r[0]], r[1]))
    for vc_name, i, vcell in requests:
        chain, t = vcell.chain, vcell.leaf_type
        free = [c for c in topo.cells_by_type.get((chain, t), []) if c.bound_leaves == 0 and c.complete]
        if len(free) < vcell.cell_number:
            total = len(topo.cells_by_type.get((chain, t), []))
            raise ValidationError(
                f"virtualClusters.{vc_name}.virtualCells[{i}]",
                f"VC {vc_name} needs {vcell.cell_number} cell(s) of type {t} in chain {chain}, but only "
                f"{len(free)} of {total} physical {t} cell(s) are still unassigned",
            )

        def split_score(c: Cell) -> tuple[int, int]:
            for a in c.ancestors():
                if a.bound_leaves > 0:
                    return (a.level, c.order)
            return (1 << 30, c.order)

        free.sort(key=split_score)
        for c in free[: vcell.cell_number]:
            _mark_bound(c, vc_name)
            topo.bindings[vc_name].append((vcell.cell_type, c))

    order = 0
    for node in topo.nodes.values():
        by_pool: dict[PoolKey, Segment] = {}
        for lf in node.leaves:
            key: PoolKey = (lf.vc, lf.pinned_cell_id, lf.sku)
            seg = by_pool.get(key)
            if seg is None:
                seg = by_pool[key] = Segment(node, key, order)
                order += 1
                topo.segments.append(seg)
            seg.leaves.append(lf)
            lf.segment = seg
            seg.free += 1
