"""Topology-aware placement: where the tasks of one group go among the segments that have room.

The counterpart of HiveD's ``topology_aware_scheduler.go``, as pure functions over segments (one node's
leaves of one pool, :class:`~apiary.scheduler.cells.Segment`); no scheduler state is changed here.

Rules and their sources:

* Guaranteed groups (:func:`fit_items`): the whole group on one node when one has room (best fit: the
  segment with the fewest free leaves that holds it), else under the lowest common ancestor cell that
  holds it (fullest first), else across the top-level cells of one chain; a task never spans nodes.
  Ties between segments with the same free count: for the whole group on one node, the one that has
  had that count longest (:class:`~apiary.scheduler.cells.BucketIndex` insertion order; config order
  on a fresh cluster); across nodes, the order the segments were created (config order for the
  unbound and cluster-wide pools, the order of first binding for a VC's pool).
  HiveD orders the VC's node-level cells by leaf cells in use, most first, and takes the first in its
  cell list among equals; for nodes of one size "fewest free" and "most used" are the same order.
* Opportunistic groups (:func:`opportunistic_fit`): HiveD's cluster view for opportunistic pods
  (``crossPriorityPack`` false): nodes with more leaf cells used by opportunistic groups first (pack
  opportunistic work together), then nodes with fewer leaf cells used by guaranteed groups (stay away
  from guaranteed work, which would preempt it), then config order (HiveD's stable sort over the
  physical cell list); tasks, smallest first, go to the first node in that order with room, the next
  task to the same node while it has room (HiveD ``findNodesForPods``).
* Inside one node (:func:`pick_leaves`): the lowest, fullest sub-cell that holds the task (HiveD
  ``findGpusInNode``: best affinity).

Units: leaf cells.  Errors: none (a fit that is impossible is None).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence

from apiary.scheduler.cells import BucketIndex, Cell, Segment
from apiary.scheduler.types import GroupRequest

Instance = tuple[str, int]  # (task role, index)
Item = tuple[str, int, int]  # (task_role, index, leaf cells needed)
Fit = dict[Instance, tuple[Segment, list[Cell]]]
ItemGroups = dict[tuple[str | None, str], list[Item]]  # (pinned cell id, sku) -> items

#: segments considered by a multi-node fit (the fullest ones); bounds the cost of one search
FIT_CANDIDATES = 256


class Source:
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
        """Candidate segment -> available leaves (with an index: the fullest :data:`FIT_CANDIDATES`
        segments), in segment order."""
        if self.index is None:
            return {seg: len(self.avail[seg]) for seg in sorted(self.avail, key=lambda s: s.order)}
        segs = self.index.fullest(FIT_CANDIDATES)
        segs.sort(key=lambda s: s.order)
        return {seg: seg.free for seg in segs}

    def total(self) -> int:
        if self.index is None:
            return sum(len(v) for v in self.avail.values())
        return self.index.total


def pick_leaves(node: Cell, avail: list[Cell], need: int) -> list[Cell]:
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


def take_leaves(seg: Segment, pool: list[Cell], items: Iterable[Item], out: Fit) -> None:
    """Give each of ``items`` (in the order given) its leaves out of ``pool`` (the available leaves of
    ``seg``, tree order) with :func:`pick_leaves`; records them in ``out``."""
    for it in items:
        picked = pick_leaves(seg.node, pool, it[2])
        ids = {id(c) for c in picked}
        pool = [c for c in pool if id(c) not in ids]
        out[(it[0], it[1])] = (seg, picked)


def greedy(items: Sequence[Item], avail: dict[Segment, int], src: Source, partial: bool) -> Fit | None:
    """Best-fit each item (largest first) onto segments (``avail``: segment -> available leaves,
    in segment order; the leaves come from ``src``); same node preferred for the next item."""
    if not avail:
        return {} if partial else None
    maxc = max(avail.values())
    buckets: list[deque[Segment]] = [deque() for _ in range(maxc + 1)]
    for seg, n in avail.items():
        buckets[n].append(seg)
    assigned: dict[Segment, list[Item]] = defaultdict(list)
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
    out: Fit = {}
    for seg, its in assigned.items():
        take_leaves(seg, src.leaves(seg), its, out)
    return out


def fit_items(items: Sequence[Item], src: Source, gang: bool) -> Fit | None:
    """Place ``items`` from ``src``: all of them (gang) or as many as fit (>= 1, else None)."""
    if not items:
        return {}
    total = sum(it[2] for it in items)
    if src.total() < (total if gang else min(it[2] for it in items)):
        return None
    seg = src.best_fit(total)  # the whole group on one node
    if seg is not None:
        out: Fit = {}
        take_leaves(seg, src.leaves(seg), sorted(items, key=lambda it: (-it[2], it[0], it[1])), out)
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
            r = greedy(items, members[anc], src, partial=False)
            if r is not None:
                return r
        depth += 1
    # Across the top-level cells of one chain, never across chains: HiveD schedules a group within one
    # chain's cells (its cluster view is per chain), so a gang is never split over two hierarchies.
    chains: dict[str, dict[Segment, int]] = {}
    for s, n in avail.items():
        chains.setdefault(s.node.chain, {})[s] = n
    for part in chains.values():
        r = greedy(items, part, src, partial=False)
        if r is not None:
            return r
    if gang:
        return None
    r = greedy(items, avail, src, partial=True)  # an incremental group places what fits, anywhere
    return r or None


def combine(
    request: GroupRequest,
    groups: ItemGroups,
    fit_one: Callable[[tuple[str | None, str], list[Item]], Fit | None],
) -> Fit | None:
    """Fit every (pinned cell, sku) group of one placement option with ``fit_one(key, items)``:
    all or nothing for a gang (None when one group does not fit), whatever fits otherwise."""
    fit: Fit = {}
    for key, items in groups.items():
        r = fit_one(key, items)
        if not r:
            if request.gang:
                return None
            continue
        fit.update(r)
    return fit


def best_option(
    request: GroupRequest, options: Iterable[dict[str, str]], fit_option: Callable[[dict[str, str]], Fit | None]
) -> Fit | None:
    """The placement of the best sku option: a gang takes the first option that fits whole; an
    incremental group the option that places the most instances (the first among equals).  None
    (or an empty fit) when no option places anything."""
    best: Fit | None = None
    for option in options:
        fit = fit_option(option)
        if fit is None:
            continue
        if request.gang:
            return fit
        if fit and (best is None or len(fit) > len(best)):
            best = fit
    return best


def opportunistic_key(seg: Segment) -> tuple[int, int, int]:
    """HiveD's node order for an opportunistic task (``crossPriorityPack`` false): leaf cells used by
    opportunistic groups, most first; then leaf cells used by guaranteed groups or reserved for a
    preemptor, fewest first; then config order.  ``seg`` is a node's segment of the cluster-wide pool."""
    return (-seg.oppo, len(seg.leaves) - seg.free - seg.oppo, seg.order)


def opportunistic_fit(items: Sequence[Item], index: BucketIndex, gang: bool) -> Fit | None:
    """Place opportunistic ``items`` over the healthy segments of a cluster-wide pool (``index``) in
    :func:`opportunistic_key` order, as HiveD's ``findNodesForPods`` does: the tasks, smallest first,
    each on the first node in that order with room, staying on a node while it has room, one chain per
    group.  All of them (gang; where that walk finds none, :func:`fit_items` is asked, which also
    searches under common ancestors) or as many as fit (>= 1, else None)."""
    if not items:
        return {}
    need_min = min(it[2] for it in items)
    if index.total < (sum(it[2] for it in items) if gang else need_min):
        return None
    if len(items) == 1:
        best: Segment | None = None
        best_key: tuple[int, int, int] | None = None
        for k in range(need_min, len(index.buckets)):
            for seg in index.buckets[k]:
                key = opportunistic_key(seg)
                if best_key is None or key < best_key:
                    best, best_key = seg, key
        if best is None:
            return None
        out: Fit = {}
        take_leaves(best, best.free_leaves(), items, out)
        return out
    segs = sorted(
        (seg for k in range(need_min, len(index.buckets)) for seg in index.buckets[k]), key=opportunistic_key
    )
    order = sorted(items, key=lambda it: (it[2], it[0], it[1]))
    chains = list(dict.fromkeys(seg.node.chain for seg in segs))
    for chain in chains:
        assigned = _walk([s for s in segs if s.node.chain == chain], order, gang)
        if assigned is not None:
            out = {}
            for seg, its in assigned.items():
                take_leaves(seg, seg.free_leaves(), its, out)
            return out
    if gang:
        return fit_items(items, Source(index=index), gang=True)
    return None


def _walk(segs: Sequence[Segment], order: Sequence[Item], gang: bool) -> dict[Segment, list[Item]] | None:
    """HiveD's ``findNodesForPods`` over ``segs`` (in preference order) for ``order`` (smallest task
    first): a gang's tasks go to consecutive choices, a task that does not fit the current node moves
    on to the next; None when a gang does not fit.  An incremental group takes, per task, the first
    node with room, and None only when none fits."""
    assigned: dict[Segment, list[Item]] = defaultdict(list)
    if gang:
        i, picked = 0, 0
        for seg in segs:
            while i < len(order) and seg.free - picked >= order[i][2]:
                assigned[seg].append(order[i])
                picked += order[i][2]
                i += 1
            if i == len(order):
                return assigned
            picked = 0
        return None
    room = {seg: seg.free for seg in segs}
    for it in order:
        for seg in segs:
            if room[seg] >= it[2]:
                room[seg] -= it[2]
                assigned[seg].append(it)
                break
    return assigned or None
