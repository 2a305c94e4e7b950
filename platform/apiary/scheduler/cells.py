"""The cell model: physical cell forest, buddy allocator with lazy VC binding, node segments.

HiveD (OSDI'20, "HiveD: Sharing a GPU Cluster for Deep Learning with Guarantees"; microsoft/hivedscheduler
doc/design/*.md) models the cluster as a forest of *cells*: a cell of level ``k`` has children of level
``k-1``; level 1 is the leaf cell (one sku, e.g. a GPU).  Each *chain* (the type of a top-level physical
cell) is one tree of cell types (e.g. RACK > NODE > SOCKET > PCIE > GPU).

Virtual clusters own *virtual cells* (counts per chain and level, from ``virtualCells``).  Binding is
LAZY: a virtual cell is bound to a physical cell of the same chain and level only while one of its
leaves is used by (or reserved for) a guaranteed group of the VC, and unbound when it is freed, so a
VC's free virtual cells can land on any physical cells.  Physical cells that are not bound are managed
by a per-chain buddy allocator (:class:`Chain`): per-level free lists of maximal free cells; binding a
level-``L`` cell takes a free level-``L`` cell or splits a higher one, unbinding merges buddies back.

Safety invariant (HiveD paper section 4, "VC safety"): for every chain and level ``L``, the leaves of
free physical cells of level ``>= L`` are at least the leaves of the VCs' unbound virtual cells of level
``>= L`` (``Chain.violation`` checks it in O(levels); a binding that would break it is refused).  With
buddy allocation it guarantees that every VC can always bind all its virtual cells, whatever other VCs
and opportunistic jobs do.

Cell states (see STATE-MACHINE.md): ``INSIDE`` (below a free or bound cell, or inside a pinned cell),
``FREE`` (maximal free cell, in its level's free list), ``SPLIT`` (some descendant bound; merges back),
``BOUND`` (bound to ``vc``), ``FIXED`` (incomplete or containing a pinned cell: permanently split),
``PINNED`` (a pinned cell: statically its VC's, never in the buddy system).

A *segment* is the part of one node that belongs to one pool ``(vc, pinned_cell_id, sku)`` (``vc`` None
= unbound leaves).  Segments change as cells bind and unbind.  :class:`BucketIndex` keeps a pool's
healthy segments bucketed by free leaf count so best fit is O(max leaves per node), not O(nodes).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from apiary.errors import ValidationError
from apiary.spec.cluster import ClusterConfig, PhysicalCell

PoolKey = tuple[str | None, str | None, str]  # (vc or None = unbound / "*" = all, pinned id, sku)
ALL_VCS = "*"

INSIDE, FREE, SPLIT, BOUND, FIXED, PINNED = range(6)
STATE_NAMES = ("Inside", "Free", "Split", "Bound", "Fixed", "Pinned")


class CellState(enum.Enum):
    """State of a leaf cell (HiveD doc/design/state-machine.md, usage part)."""

    FREE = "Free"
    USED = "Used"  # allocated to a group (HiveD: Used / Reserving when also reserved_by is set)
    RESERVED = "Reserved"  # free, but held for a preempting group


class Cell:
    """One physical cell.  ``level`` 1 = leaf.  Leaf-only fields: ``index`` (within its node),
    ``group`` (user), ``reserved_by`` (preemptor), ``segment`` (its pool segment), ``all_segment``."""

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
        "state",
        "vc",
        "free_children",
        "hold",
        "used",
        "bad",
        "index",
        "sku",
        "group",
        "reserved_by",
        "segment",
        "all_segment",
        "internal",
        "segs",
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
        self.state = INSIDE
        self.vc: str | None = None  # BOUND cell: its VC; leaf: the VC owning it now (bound or pinned)
        self.free_children = 0  # children in state FREE (merge when all are)
        self.hold = 0  # BOUND cell: leaves used by guaranteed groups or reserved
        self.used = 0  # leaves below used by any group
        self.bad = 0  # leaves below on unhealthy nodes
        self.index = -1
        self.sku = ""
        self.group: str | None = None
        self.reserved_by: str | None = None
        self.segment: Segment | None = None
        self.all_segment: Segment | None = None
        self.internal: list[Cell] = []  # node: its non-leaf descendants (incl. itself) if deeper than 1
        # node: its segments, by pool (and by the bound cell, for a VC cell below node level)
        self.segs: dict[tuple[str | int | None, ...], Segment] = {}

    @property
    def node_name(self) -> str:
        """The address of the node this cell is on ("" above node level)."""
        return self.node.address if self.node is not None else ""

    @property
    def complete(self) -> bool:
        return len(self.leaves) == self.nominal_leaves

    @property
    def leaf_state(self) -> CellState:
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

    def bound_root(self) -> Cell | None:
        """The BOUND cell at or above this cell, if any."""
        c: Cell | None = self
        while c is not None:
            if c.state == BOUND:
                return c
            if c.state != INSIDE:
                return None
            c = c.parent
        return None

    def __repr__(self) -> str:
        return f"Cell({self.cell_type}@{self.address})"


class Segment:
    """The leaves of one node that belong to one pool; ``free`` counts FREE leaves, ``oppo`` (kept for
    the cluster-wide pool only) the leaves opportunistic groups use."""

    __slots__ = ("node", "pool", "leaves", "free", "oppo", "order", "index")

    def __init__(self, node: Cell, pool: PoolKey, order: int) -> None:
        self.node = node
        self.pool = pool
        self.leaves: dict[Cell, None] = {}
        self.free = 0
        self.oppo = 0  # cluster-wide segment: leaves used by opportunistic groups (else 0)
        self.order = order
        self.index: list[BucketIndex] = []  # indices this segment is listed in while healthy

    def free_leaves(self, group: str | None = None) -> list[Cell]:
        """FREE leaves (and leaves reserved for ``group``), in tree order."""
        out = [lf for lf in self.leaves if lf.group is None and (lf.reserved_by is None or lf.reserved_by == group)]
        out.sort(key=lambda c: c.order)
        return out

    def __repr__(self) -> str:
        return f"Segment({self.node.address}, {self.pool})"


class BucketIndex:
    """Segments bucketed by free leaf count (insertion-ordered dicts keep it deterministic)."""

    __slots__ = ("buckets", "total")

    def __init__(self) -> None:
        self.buckets: list[dict[Segment, None]] = [{}]
        self.total = 0

    def move(self, seg: Segment, old: int, new: int) -> None:
        if old > 0:
            self.buckets[old].pop(seg, None)
        if new > 0:
            while len(self.buckets) <= new:
                self.buckets.append({})
            self.buckets[new][seg] = None
        self.total += new - old

    def best_fit(self, need: int) -> Segment | None:
        for k in range(max(need, 1), len(self.buckets)):
            for seg in self.buckets[k]:
                return seg
        return None

    def segments(self) -> Iterator[Segment]:
        for b in self.buckets[1:]:
            yield from b

    def fullest(self, limit: int) -> list[Segment]:
        """Up to ``limit`` segments, most free leaves first."""
        out: list[Segment] = []
        for b in reversed(self.buckets[1:]):
            for seg in b:
                out.append(seg)
                if len(out) >= limit:
                    return out
        return out

    def free_total(self) -> int:
        return self.total


class Chain:
    """The buddy allocator of one chain: free lists and the counters of the safety invariant.

    ``free[L]``: maximal free cells of level ``L``; ``F[L]``: their leaves; ``D[L]``: leaves of the
    VCs' unbound virtual cells of level ``L``; ``leaves_at[L]``: leaves of one full level-``L`` cell.
    """

    def __init__(self, name: str, top: int, leaves_at: list[int]) -> None:
        self.name = name
        self.top = top
        self.leaves_at = leaves_at
        self.free: list[dict[Cell, None]] = [{} for _ in range(top + 1)]
        self.F = [0] * (top + 1)
        self.D = [0] * (top + 1)

    def add_free(self, c: Cell) -> None:
        c.state = FREE
        self.free[c.level][c] = None
        self.F[c.level] += len(c.leaves)
        if c.parent is not None:
            c.parent.free_children += 1

    def remove_free(self, c: Cell) -> None:
        del self.free[c.level][c]
        self.F[c.level] -= len(c.leaves)
        if c.parent is not None:
            c.parent.free_children -= 1

    def violation(self) -> int | None:
        """The highest level where free capacity (levels >= L) < unbound demand (levels >= L)."""
        sf = sd = 0
        for lv in range(self.top, 0, -1):
            sf += self.F[lv]
            sd += self.D[lv]
            if sf < sd:
                return lv
        return None


@dataclass
class Topology:
    """The physical forest, chains, pinned cells and the node segments."""

    roots: list[Cell] = field(default_factory=list)
    # node name -> its node-level cells, one per chain it appears in (HiveD: a node may have several
    # leaf cell types, e.g. 8 P100 GPUs in one chain and 2 other GPUs in another)
    nodes: dict[str, list[Cell]] = field(default_factory=dict)
    cells_by_type: dict[tuple[str, str], list[Cell]] = field(default_factory=dict)  # (chain, type)
    pinned: dict[str, Cell] = field(default_factory=dict)
    pinned_vc: dict[str, str] = field(default_factory=dict)
    chains: dict[str, Chain] = field(default_factory=dict)
    levels: dict[str, int] = field(default_factory=dict)  # cell type -> level
    chain_sku: dict[str, str] = field(default_factory=dict)
    segment_count: int = 0

    def node_cells(self) -> Iterator[Cell]:
        """Every node-level cell, in config order."""
        for cells in self.nodes.values():
            yield from cells

    def node_leaves(self, name: str) -> list[Cell]:
        """The leaf cells of node ``name`` over all its chains, by device index."""
        return sorted((lf for c in self.nodes.get(name, ()) for lf in c.leaves), key=lambda lf: lf.index)


def type_levels(config: ClusterConfig) -> dict[str, int]:
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
    """Build the physical cell forest of ``config`` (already checked by the loader) and put every
    complete, unpinned maximal cell into its chain's free lists."""
    topo = Topology()
    levels = topo.levels = type_levels(config)
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
            topo.nodes.setdefault(address, []).append(cell)
        cell.node = node
        specs: list[PhysicalCell | None] = [*spec.cell_children] if spec is not None else []
        if node is not None:  # at or below node level: missing children are generated
            specs += [None] * (ct.child_cell_number - len(specs))
        for i, ch in enumerate(specs):
            if ch is not None and ch.cell_address is not None:
                addr = ch.cell_address
            elif node is None:
                addr = f"{address}/{i}"
            else:
                addr = ""  # below the node: a default address, given once the node is complete
            child = build(ch, ct.child_cell_type, chain, addr, cell, pinned, node)
            cell.children.append(child)
            cell.leaves.extend(child.leaves)
        cell.sku = cell.leaves[0].sku if cell.leaves else config.leaf_sku(t)
        return cell

    for i, spec in enumerate(config.physical_cluster.physical_cells):
        t = spec.cell_type or ""
        topo.roots.append(build(spec, t, t, spec.cell_address or f"{t}[{i}]", None, None, None))

    for name, node_cells in topo.nodes.items():
        seen: dict[int, str] = {}
        for node in node_cells:
            # A leaf's index is its device (GPU) index on the node: its cellAddress when the config
            # gives one, else its position in the node (HiveD's default: the leaf numbering of
            # pkg/api/config.go's inferPhysicalCellSpec).  Other cells below the node default to
            # their index among their siblings.
            _default_addresses(node)
            for i, lf in enumerate(node.leaves):
                lf.index = int(lf.address) if lf.address else i
                if not lf.address:
                    lf.address = str(lf.index)
                if lf.index in seen:
                    raise ValidationError(
                        "physicalCluster.physicalCells",
                        f"node {name!r}: leaf cell address {lf.index} is used by {seen[lf.index]} and {node.chain}",
                    )
                seen[lf.index] = node.chain
        for node in node_cells:
            if node.level <= 2:
                continue
            stack = [node]
            while stack:
                c = stack.pop()
                if c.level > 1:
                    node.internal.append(c)
                    stack.extend(c.children)
            node.internal.sort(key=lambda c: c.order)
    # Leaves stay in tree order (the config's order, ``Cell.order``), not by device index: packing
    # takes them in that order, so a task gets whole sub-cells (HiveD gives a 7-GPU task on a node
    # listed as sockets 1, 0 the GPUs [1, 3, 4, 7, 0, 2, 6]).

    # chains and the initial buddy state
    for root in topo.roots:
        if root.chain not in topo.chains:
            top = root.level
            leaves_at = [0] * (top + 1)
            for t in config.type_chain_below(root.chain):
                leaves_at[levels[t]] = config.leaf_count(t)
            topo.chains[root.chain] = Chain(root.chain, top, leaves_at)
            topo.chain_sku[root.chain] = config.leaf_sku(root.chain)
    pinned_cells = set(map(id, topo.pinned.values()))

    def has_pinned(c: Cell) -> bool:
        return any(lf.pinned_cell_id is not None for lf in c.leaves)

    def init(c: Cell, chain: Chain) -> None:
        if id(c) in pinned_cells:
            c.state = PINNED
            return
        if c.complete and c.leaves and not has_pinned(c):
            chain.add_free(c)
            return
        c.state = FIXED
        for ch in c.children:
            init(ch, chain)

    for root in topo.roots:
        init(root, topo.chains[root.chain])
    return topo


def _default_addresses(node: Cell) -> None:
    """Give the cells below ``node`` without a configured address their index among their siblings."""
    stack = [node]
    while stack:
        c = stack.pop()
        for i, ch in enumerate(c.children):
            if not ch.address and ch.level > 1:
                ch.address = str(i)
            stack.append(ch)


def check_initial_assignment(topo: Topology, config: ClusterConfig) -> None:
    """Add every VC's virtual cells to the chains' demand; raise ValidationError naming the VC, the
    virtual cell entry and the level when the safety invariant cannot hold (HiveD rejects such a
    config at start).  Highest levels first, then VC and entry order."""
    vc_order = {name: i for i, name in enumerate(config.virtual_clusters)}
    requests = [
        (vc_name, i, vcell)
        for vc_name, vc in config.virtual_clusters.items()
        for i, vcell in enumerate(vc.virtual_cells)
    ]
    requests.sort(key=lambda r: (-topo.levels[r[2].leaf_type], vc_order[r[0]], r[1]))
    for vc_name, i, vcell in requests:
        chain = topo.chains[vcell.chain]
        lv = topo.levels[vcell.leaf_type]
        chain.D[lv] += vcell.cell_number * chain.leaves_at[lv]
        bad = chain.violation()
        if bad is not None:
            have = sum(chain.F[k] for k in range(bad, chain.top + 1)) // chain.leaves_at[bad]
            want = sum(chain.D[k] for k in range(bad, chain.top + 1)) // chain.leaves_at[bad]
            raise ValidationError(
                f"virtualClusters.{vc_name}.virtualCells[{i}]",
                f"VC {vc_name} does not fit: {vcell.cell_number} cell(s) of type {vcell.leaf_type} in chain "
                f"{vcell.chain}; at level {bad} the VCs need {want} cell(s) but only {have} physical cell(s) "
                f"of that level are available",
            )
    for vc_name, vc in config.virtual_clusters.items():
        for pc in vc.pinned_cells:
            cell = topo.pinned[pc.pinned_cell_id]
            topo.pinned_vc[pc.pinned_cell_id] = vc_name
            for lf in cell.leaves:
                lf.vc = vc_name
