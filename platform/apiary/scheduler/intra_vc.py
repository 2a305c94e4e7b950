"""Intra-VC scheduling: placing a guaranteed group inside its VC's cells, and why a group waits.

The counterpart of HiveD's ``intra_vc_scheduler.go``: a guaranteed group (priority 0..1000) uses only
cells bound to its own VC's virtual cells, even when other VCs are idle (HiveD paper section 3, user
manual "VC Safety").  It first tries the VC's bound cells, then binds more of the VC's virtual cells
(:meth:`~apiary.scheduler.allocation.CellAllocation._bind_some`) while the group does not fit, and
only when that fails plans a preemption (:mod:`~apiary.scheduler.preemption`).  Placement inside the
cells is :func:`~apiary.scheduler.placement.fit_items` (best fit, lowest common ancestor).

Units: leaf cells.  Errors: none of its own (requests are validated before scheduling).
"""

from __future__ import annotations

from apiary.scheduler.allocation import self_label, who
from apiary.scheduler.cells import ALL_VCS, BOUND, Cell, PoolKey
from apiary.scheduler.placement import Fit, Instance, Item, Source, best_option, combine, fit_items
from apiary.scheduler.preemption import Preemption
from apiary.scheduler.types import Decision, GroupRequest


class IntraVCScheduler(Preemption):
    """Guaranteed groups inside their VC (placement, then preemption) and waiting reasons."""

    def _fit_bound(self, request: GroupRequest, key: PoolKey, items: list[Item], tent: list[Cell]) -> Fit | None:
        """Fit ``items`` into the VC's bound cells, binding more virtual cells (recorded in ``tent``)
        while they do not fit and the VC has some left."""
        _, pinned, sku = key
        vc = request.virtual_cluster  # the key's VC, typed as a VC name
        need = sum(it[2] for it in items)
        want = need if request.gang else min(it[2] for it in items)
        idx = self._index.get(key)
        r = None
        if idx is not None and idx.total >= want:
            r = fit_items(items, Source(index=idx), request.gang)
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
            r2 = fit_items(items, Source(index=idx), request.gang)
            if r2 is not None and (r is None or len(r2) > len(r)):
                r = r2
            if r is not None and len(r) == len(items):
                break
        return r

    def _short(self, request: GroupRequest, groups: dict[tuple[str | None, str], list[Item]]) -> bool:
        """True when even preemption cannot make room for the whole gang (counters only, no search)."""
        vc, p = request.virtual_cluster, request.priority
        for (pinned, sku), items in groups.items():
            n = sum(it[2] for it in items)
            if pinned is None:
                room = self._vc_free(vc, sku) + self._preemptable(vc, p) + self._reserved_lower(vc, p)
            else:
                room = self._pool_leaves.get((vc, pinned, sku), 0)
            if n > room:
                return True
        return False

    def _schedule_guaranteed(
        self, request: GroupRequest, pending: tuple[Instance, ...], options: list[dict[str, str]]
    ) -> Decision:
        """Place ``pending`` of a guaranteed group in its VC, else plan a preemption, else wait."""
        vc = request.virtual_cluster
        tent: list[Cell] = []

        def fit_option(option: dict[str, str]) -> Fit | None:
            groups = self._items(request, pending, option)
            if request.gang and self._short(request, groups):
                return None
            return combine(request, groups, lambda key, items: self._fit_bound(request, (vc, *key), items, tent))

        try:
            best = best_option(request, options, fit_option)
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
                    listed = ", ".join(who(self._groups[g]) for g in blocking)
                    more = f" and {n_block - len(blocking)} more" if n_block > len(blocking) else ""
                    parts[-1] += f"; used by {listed}{more} which this job ({self_label(p)}) cannot preempt."
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

