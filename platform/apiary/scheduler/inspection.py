"""Inspection: the scheduler's JSON status, the virtual cells only bad hardware can satisfy, and a
from-scratch check of every invariant (for tests and debugging).

Read-only over :class:`~apiary.scheduler.allocation.CellAllocation`'s state; the counterpart of HiveD's
status API (``GetAllVirtualClustersStatus``, ``GetPhysicalClusterStatus``) and of its doomed-bad-cell
bookkeeping (``tryBindDoomedBadCell``).

Units: leaf cells.  Errors: ValidationError for an unknown VC; PlatformError for a broken invariant.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from apiary.errors import PlatformError, ValidationError
from apiary.scheduler.allocation import unknown_vc_message
from apiary.scheduler.cells import BOUND, FREE, STATE_NAMES, Cell
from apiary.scheduler.intra_vc import IntraVCScheduler


class Inspection(IntraVCScheduler):
    """Status, doomed cells and the invariant check."""

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
                raise ValidationError("vc", unknown_vc_message(v, self._vcs))
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
                oppo = sum(
                    1
                    for lf in seg.leaves
                    if lf.all_segment is seg and lf.group is not None and self._groups[lf.group].priority < 0
                )
                if oppo != seg.oppo:
                    fail(f"segment {seg} opportunistic {seg.oppo}, actual {oppo}")
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
