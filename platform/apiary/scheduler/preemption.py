"""Preemption: which running groups a waiting guaranteed group stops, and the cells it reserves.

The counterpart of the preemption half of HiveD's ``hived_algorithm.go`` (the ``Preempting`` state,
reservations, lazy preemption) with Apiary's own victim order (see :meth:`Preemption._plan_preemption`).

Rules and their sources:

* A guaranteed group preempts strictly lower priority groups of its VC and the opportunistic groups
  on its VC's cells; the preempted cells are *reserved* for it (HiveD "Preempting" state); a higher
  priority preemptor supersedes a lower one (HiveD: the lower one goes back to waiting).
* Lazy preemption (constructor ``lazy_preemption`` or ``GroupRequest.lazy_preemption`` of the
  victim): victims are first downgraded to opportunistic (``Decision.downgraded``) and stopped only
  when the preemptor really needs their cells (HiveD ``lazyPreemptionEnable``).
* Victim choice (a deliberate difference from HiveD): Apiary stops the fewest, cheapest victims:
  opportunistic (and lazily downgraded) groups before guaranteed ones, lower priority first, the most
  recently started first (least work lost), then by name; the shortest prefix of that order that lets
  the group fit, then without the victims the fit does not need.  HiveD instead places the group as
  if lower priorities were free, packing across priorities (``crossPriorityPack``: the node with the
  most leaf cells in use that has room at the group's priority) and stops whatever runs on the cells
  it picks there, whatever their age or priority below its own.

Units: leaf cells.  Errors: none of its own (requests are validated before planning).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

from apiary.scheduler.allocation import CellAllocation, Group, Reservation, who
from apiary.scheduler.cells import BOUND, Cell, PoolKey, Segment
from apiary.scheduler.placement import FIT_CANDIDATES, Fit, Instance, ItemGroups, Source, fit_items
from apiary.scheduler.types import Decision, GroupRequest

Room = dict[PoolKey, dict[Segment, list[Cell]]]  # pool -> segment -> its available leaves, tree order


class _VictimSearch:
    """One planning pass of a preemption over a VC's bound cells as they are: the free room, the
    candidate victims in the order they are taken, and the fits tried with a prefix of that order.

    Work is proportional to the candidates, not to the VC: free room comes from the pools' indexes
    (the fullest segments), victims from the VC's lower-priority groups and the index of
    opportunistic groups in its cells, each read through its own leaves."""

    def __init__(
        self, sched: Preemption, request: GroupRequest, item_groups: ItemGroups, need: dict[tuple[str | None, str], int]
    ) -> None:
        self.s = sched
        self.name, self.p, self.vc = request.name, request.priority, request.virtual_cluster
        self.item_groups = item_groups
        self.need = need
        self.keys: dict[PoolKey, tuple[str | None, str]] = {(self.vc, pin, sku): (pin, sku) for pin, sku in item_groups}
        self.base: Room = {key: {} for key in self.keys}  # free room
        self.base_n: dict[PoolKey, int] = dict.fromkeys(self.keys, 0)
        self.order: list[str] = []  # victims in the order they are taken (grows a bucket at a time)
        self.buckets: list[Callable[[], list[str]]] = []
        self.n_cands = 0
        self.victim_leaves: dict[str, Room] = {}
        # cum[key][k]: leaves of ``key`` that order[:k] holds (order grows only at its end)
        self.cum: dict[PoolKey, list[int]] = {key: [0] for key in self.keys}
        self._collect_free_room()
        self._collect_victims()

    # -- step 1: room that is free at the request's priority
    def _usable(self, lf: Cell) -> bool:
        r = lf.reserved_by
        return r is None or r == self.name or self.s._prio(r) < self.p

    def _add_room(self, seg: Segment) -> None:
        room = self.base[seg.pool]
        if seg not in room and seg.node.bad == 0:
            lv = room[seg] = sorted(
                (lf for lf in seg.leaves if lf.group is None and self._usable(lf)), key=lambda c: c.order
            )
            self.base_n[seg.pool] += len(lv)

    def _collect_free_room(self) -> None:
        """The fullest segments of each pool (where the index says there is room), and the cells
        lower-priority preemptors of the VC reserved."""
        for key in self.keys:
            idx = self.s._index.get(key)
            if idx is not None:
                for seg in idx.fullest(FIT_CANDIDATES):
                    self._add_room(seg)
        for r_name, res in self.s._reservations.items():
            if r_name != self.name and res.vc == self.vc and res.priority < self.p:
                for lf in res.leaves:
                    if lf.segment is not None and lf.segment.pool in self.keys:
                        self._add_room(lf.segment)

    # -- step 2: the victims, in the order they are taken
    def _recent_first(self, names: Iterable[str]) -> list[str]:
        groups = self.s._groups
        return [g for _, g in sorted((-groups[g].seq, g) for g in names)]

    def _collect_victims(self) -> None:
        """Opportunistic groups in the VC's cells, then each lower priority upwards, most recently
        started first; each bucket is sorted only when the search reaches it."""
        oppo = self.s._oppo_in.get(self.vc, {})
        self.buckets.append(lambda: self._recent_first(g for g in oppo if g != self.name))
        self.n_cands = sum(1 for g in oppo if g != self.name)
        by_prio = self.s._groups_prio[self.vc]
        for prio in sorted(q for q in by_prio if 0 <= q < self.p):
            names = by_prio[prio]
            self.n_cands += len(names)
            self.buckets.append(partial(self._recent_first, names))

    def leaves_of(self, g: str) -> Room:
        """The leaves victim ``g`` would free, by pool and segment (read once)."""
        out = self.victim_leaves.get(g)
        if out is None:
            out = self.victim_leaves[g] = {}
            for lv in self.s._groups[g].leaves.values():
                for lf in lv:
                    seg = lf.segment
                    if seg is None or seg.pool not in self.keys or seg.node.bad or not self._usable(lf):
                        continue
                    out.setdefault(seg.pool, {}).setdefault(seg, []).append(lf)
                    self._add_room(seg)
        return out

    def prefix(self, k: int) -> list[str]:
        """The first ``k`` victims of the order (their leaves read when first reached)."""
        while len(self.order) < k and self.buckets:
            self.order.extend(self.buckets.pop(0)())
        first = next(iter(self.cum.values()))
        for g in self.order[len(first) - 1 : k]:
            held = self.leaves_of(g)
            for key, c in self.cum.items():
                c.append(c[-1] + sum(len(lv) for lv in held.get(key, {}).values()))
        return self.order[:k]

    # -- step 3: fits with victims' leaves freed
    def try_fit(self, chosen: Sequence[str], held: dict[PoolKey, int] | None = None) -> Fit | None:
        """A fit with the leaves of ``chosen`` freed; ``held``: their leaf count per pool when the
        caller knows it (a prefix of the order)."""
        out: Fit = {}
        for key, (pin, sku) in self.keys.items():
            v = held[key] if held is not None else sum(
                len(lv) for g in chosen for lv in self.leaves_of(g).get(key, {}).values()
            )
            if self.base_n[key] + v < self.need[(pin, sku)]:
                return None
        for key, (pin, sku) in self.keys.items():
            room = self.base[key]
            avail = {s: v for s, v in room.items() if v}  # shared: a fit does not change them
            grown: dict[Segment, list[Cell]] = {}
            for g in chosen:
                for s, lv in self.leaves_of(g).get(key, {}).items():
                    if s not in grown:
                        avail[s] = grown[s] = [*room.get(s, ())]
                    grown[s].extend(lv)
            for lv in grown.values():
                lv.sort(key=lambda c: c.order)
            r = fit_items(self.item_groups[(pin, sku)], Source(avail=avail), gang=True)
            if r is None:
                return None
            out.update(r)
        return out

    def try_prefix(self, k: int) -> Fit | None:
        chosen = self.prefix(k)
        return self.try_fit(chosen, {key: c[len(chosen)] for key, c in self.cum.items()})

    def shortest_prefix(self) -> tuple[int, Fit] | None:
        """The shortest prefix of the order that fits, and its fit: gallop (1, 2, 4, ...), then
        bisect (a fit only gets easier with more victims); None when even all of them do not."""
        lo, hi = 0, 1
        while True:
            if hi >= self.n_cands:
                hi = self.n_cands
                fit = self.try_prefix(hi)
                if fit is None:
                    return None
                break
            fit = self.try_prefix(hi)
            if fit is not None:
                break
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # order[:lo] does not fit, order[:hi] does
            mid = (lo + hi) // 2
            r = self.try_prefix(mid)
            if r is not None:
                hi, fit = mid, r
            else:
                lo = mid
        return hi, fit

    def minimize(self, k: int, fit: Fit) -> tuple[list[str], Fit]:
        """Victims of ``order[:k]`` the fit needs: only those whose leaves it uses, then dropping,
        latest taken first, each one the rest can do without."""
        holders = {lf.group for _, lv in fit.values() for lf in lv if lf.group is not None}
        chosen = [g for g in self.order[:k] if g in holders]
        for g in list(reversed(chosen[:-1])):
            trial = [x for x in chosen if x != g]
            r = self.try_fit(trial)
            if r is not None:
                chosen, fit = trial, r
        return chosen, fit

    def run(self) -> tuple[list[str], Fit] | None:
        """The victims to stop and the fit they make possible (no victims: it fits already)."""
        fit = self.try_fit(())
        if fit is not None:
            return [], fit
        found = self.shortest_prefix()
        if found is None:
            return None
        return self.minimize(*found)


class Preemption(CellAllocation):
    """Reservations and victim planning on top of the cell state."""

    def _vc_free(self, vc: str, sku: str) -> int:
        """Leaves of ``vc``'s quota in ``sku`` (non-pinned) not used by its guaranteed groups nor reserved."""
        return self._pool_leaves.get((vc, None, sku), 0) - self._used_sku[(vc, sku)]

    def _preemptable(self, vc: str, priority: int) -> int:
        return sum(n for p, n in self._used_prio[vc].items() if p < priority)

    def _reserved_lower(self, vc: str, priority: int) -> int:
        return sum(len(r.leaves) for r in self._reservations.values() if r.vc == vc and r.priority < priority)

    # ------------------------------------------------------------------ preemption
    def _prio(self, name: str) -> int:
        if name in self._reservations:
            return self._reservations[name].priority
        if name in self._groups:
            return self._groups[name].priority
        return -1

    def _lazy_ok(self, g: Group) -> bool:
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
        (:meth:`_cell_key`: no opportunistic use, then the fewest leaf cells in use, then the most
        recently started occupants).  Victims are taken in this order until the group fits:
        opportunistic (and lazily downgraded) groups before guaranteed ones, lower priority first,
        the most recently started first (least work lost, as Kueue's preemptor orders candidates),
        then by name; a final pass drops victims the fit does not need.  This order is Apiary's, not
        HiveD's: HiveD packs across priorities (the node with the most leaf cells in use that has
        room at the request's priority) and stops what runs on the cells it picks there (see the
        module docstring).
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
        item_groups: ItemGroups,
        need: dict[tuple[str | None, str], int],
        tent: list[Cell],
    ) -> Decision | None:
        """One planning pass over the VC's bound cells as they are (see :meth:`_plan_preemption` and
        :class:`_VictimSearch`): the decision, or None when no victims make the group fit."""
        found = _VictimSearch(self, request, item_groups, need).run()
        if found is None:
            return None
        chosen, fit = found
        lazy = self._lazy_victims(chosen)
        if lazy:  # lazy preemption: downgrade first, kill only if still needed (schedule re-plans)
            for g in lazy:
                self._downgrade(g)
            return Decision("wait", victims=(), reason="lazy", downgraded=tuple(lazy))
        return self._preempt_or_place(request, pending, chosen, fit, tent)

    def _lazy_victims(self, chosen: Sequence[str]) -> list[str]:
        """The guaranteed victims lazy preemption downgrades instead of stopping.  A group on pinned
        cells cannot run on as opportunistic (pinned cells are their VC's alone): it is stopped
        outright, as HiveD names it a victim."""
        return [
            g
            for g in chosen
            if self._groups[g].priority >= 0
            and self._lazy_ok(self._groups[g])
            and not any(lf.pinned_cell_id is not None for lv in self._groups[g].leaves.values() for lf in lv)
        ]

    def _preempt_or_place(
        self, request: GroupRequest, pending: tuple[Instance, ...], chosen: Sequence[str], fit: Fit, tent: list[Cell]
    ) -> Decision:
        """``preempt`` (reserving the fit's cells) when the fit uses a victim's cells, else ``place``."""
        name, vc = request.name, request.virtual_cluster
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
        names = ", ".join(who(self._groups[g]) for g in victims)
        n_cells = sum(1 for lf in leaves if lf.group)
        reason = f"Preempting {names} to free {n_cells} cell{'s' if n_cells != 1 else ''} in VC {vc}."
        self._reserve(name, Reservation(request.priority, pending, placements, leaves, reason, vc))
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

    def _reserve(self, name: str, res: Reservation) -> None:
        self._cancel(name)
        for lf in res.leaves:
            other = lf.reserved_by
            if other is not None and other != name:
                self._cancel(other)  # superseded by a higher priority preemptor
        for lf in res.leaves:
            self._set_leaf(lf, lf.group, name)
        self._reservations[name] = res

    def _resume_reservation(
        self, request: GroupRequest, res: Reservation, pending: tuple[Instance, ...]
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
