"""Clusters for the simulator: a machine list as a HiveD config, VC quotas for a trace, private VC clusters.

**Machine list -> cluster** (:func:`machines_to_cluster`).  One sku type ``GPU`` (1 GPU, 4 CPUs,
16 GiB per leaf cell); for every distinct GPU count ``g`` a node-level cell type ``NODE-<g>GPU``
(``g`` leaf cells) and a pool cell type ``POOL-<g>GPU`` holding all machines with ``g`` GPUs, in
file order; the machine id is the node's ``cellAddress``.  Philly's 552 machines become
``POOL-8GPU`` (231 nodes) and ``POOL-2GPU`` (321 nodes), 2,490 GPUs.

**Quota rule** (:func:`derive_quotas`), in whole node cells, per pool separately:

1. Each VC's share is its share of the trace's GPU time (``duration x gpus`` summed over its jobs).
2. Each pool's nodes are apportioned by share with the largest-remainder method (floor of
   ``share x nodes``, then the leftover nodes to the largest fractional parts, ties by VC name), so
   every pool's quotas sum to exactly its node count.
3. Minimum: a VC gets at least the cells its largest job needs, if possible: a job of ``n`` GPUs
   needs ``ceil(n / g_max)`` cells of the largest node size ``g_max`` when ``n`` exceeds every smaller
   node size, else one cell of any pool that fits it.  Missing cells are taken one at a time from the
   VC holding the most cells above its own minimum in that pool (ties: the larger holding, then the
   VC name).  When no VC has a spare cell the minimum is not met and the VC's too-large jobs are
   counted ``rejected`` at submission (as OpenPAI rejects jobs larger than their VC).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apiary.errors import ValidationError
from apiary.spec.cluster import ClusterConfig

SKU = "GPU"


@dataclass(frozen=True)
class Machine:
    name: str
    gpus: int


def load_machines(path: str | Path) -> list[Machine]:
    """Read a machine list CSV: a ``machineId`` column and a ``number of GPUs`` column (header names are
    matched ignoring case and spaces; other columns, such as ``single GPU mem`` or a leading index,
    are ignored).  Machines with 0 GPUs are skipped."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise ValidationError("machines", f"{path} is empty")
    header = [h.strip().lower().replace(" ", "") for h in rows[0]]
    try:
        i_name = header.index("machineid")
        i_gpus = next(i for i, h in enumerate(header) if h in ("numberofgpus", "gpus", "num_gpus"))
    except (ValueError, StopIteration):
        raise ValidationError(
            "machines", f"{path}: need columns machineId and 'number of GPUs', got {rows[0]}"
        ) from None
    out = []
    for n, row in enumerate(rows[1:], start=2):
        if not row or not "".join(row).strip():
            continue
        try:
            gpus = int(float(row[i_gpus]))
        except (ValueError, IndexError):
            raise ValidationError("machines", f"{path} line {n}: bad GPU count in {row}") from None
        if gpus > 0:
            out.append(Machine(row[i_name].strip(), gpus))
    if not out:
        raise ValidationError("machines", f"{path}: no machine with GPUs")
    return out


def node_type(g: int) -> str:
    return f"NODE-{g}GPU"


def pool_type(g: int) -> str:
    return f"POOL-{g}GPU"


def machines_to_cluster(
    machines: Iterable[Machine], quotas: Mapping[str, Mapping[int, int]] | None = None
) -> ClusterConfig:
    """The HiveD config of ``machines`` (see the module docstring); ``quotas`` {vc: {node GPUs: cells}}
    become ``virtualClusters`` (VCs with no cells are left out)."""
    by_size: dict[int, list[str]] = {}
    for m in machines:
        by_size.setdefault(m.gpus, []).append(m.name)
    sizes = sorted(by_size, reverse=True)
    cell_types: dict = {}
    physical = []
    for g in sizes:
        cell_types[node_type(g)] = {"childCellType": SKU, "childCellNumber": g, "isNodeLevel": True}
        cell_types[pool_type(g)] = {"childCellType": node_type(g), "childCellNumber": len(by_size[g])}
        physical.append({"cellType": pool_type(g), "cellChildren": [{"cellAddress": n} for n in by_size[g]]})
    vcs = {}
    for vc, cells in sorted((quotas or {}).items()):
        vcells = [
            {"cellType": f"{pool_type(g)}.{node_type(g)}", "cellNumber": n}
            for g, n in sorted(cells.items(), reverse=True)
            if n > 0
        ]
        if vcells:
            vcs[vc] = {"virtualCells": vcells}
    data = {
        "physicalCluster": {
            "skuTypes": {SKU: {"gpu": 1, "cpu": 4, "memory": "16Gi"}},
            "cellTypes": cell_types,
            "physicalCells": physical,
        },
        "virtualClusters": vcs,
    }
    return ClusterConfig.from_dict(data)


def _largest_remainder(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    s = sum(weights.values())
    if total <= 0 or s <= 0:
        return {k: 0 for k in weights}
    exact = {k: total * w / s for k, w in weights.items()}
    out = {k: math.floor(v) for k, v in exact.items()}
    left = total - sum(out.values())
    for k in sorted(weights, key=lambda k: (-(exact[k] - out[k]), k))[:left]:
        out[k] += 1
    return out


def min_cells(largest_job: int, sizes: list[int]) -> dict[int, int]:
    """The cells a VC needs for its largest job of ``largest_job`` GPUs: {node GPUs: cells} (see rule 3)."""
    sizes = sorted(sizes)
    if largest_job <= 0:
        return {}
    for g in sizes:
        if largest_job <= g:
            return {g: 1}
    gmax = sizes[-1]
    return {gmax: math.ceil(largest_job / gmax)}


def derive_quotas(
    gpu_time: Mapping[str, float], largest_job: Mapping[str, int], nodes_by_size: Mapping[int, int]
) -> dict[str, dict[int, int]]:
    """VC quotas {vc: {node GPUs: cells}} by the documented rule (module docstring)."""
    vcs = sorted(set(gpu_time) | set(largest_job))
    sizes = sorted(nodes_by_size, reverse=True)
    weights = {v: max(float(gpu_time.get(v, 0.0)), 0.0) for v in vcs}
    if sum(weights.values()) <= 0:
        weights = {v: 1.0 for v in vcs}
    quotas = {v: {g: 0 for g in sizes} for v in vcs}
    for g in sizes:
        for v, n in _largest_remainder(nodes_by_size[g], weights).items():
            quotas[v][g] = n
    mins = {v: min_cells(largest_job.get(v, 0), sizes) for v in vcs}

    def need_met(v: str) -> bool:
        if not mins[v]:
            return True
        ((g, n),) = mins[v].items()
        if n == 1:
            return any(quotas[v][s] >= 1 for s in sizes if s >= g)
        return quotas[v][g] >= n

    def can_give(u: str, g: int) -> bool:
        if quotas[u][g] <= 0:
            return False
        quotas[u][g] -= 1
        ok = need_met(u)
        quotas[u][g] += 1
        return ok

    for v in sorted(vcs, key=lambda v: (-weights[v], v)):
        if not mins[v]:
            continue
        ((g, _),) = mins[v].items()
        while not need_met(v):
            donors = [u for u in vcs if u != v and need_met(u) and can_give(u, g)]
            if not donors:
                break
            d = max(donors, key=lambda u: (quotas[u][g], u))
            quotas[d][g] -= 1
            quotas[v][g] += 1
    return quotas


def vc_gpus(config: ClusterConfig) -> dict[str, int]:
    """Each VC's quota in GPUs (virtual cells x leaf cells x sku GPUs)."""
    out = {}
    skus = config.physical_cluster.sku_types
    for v, vc in config.virtual_clusters.items():
        n = 0
        for c in vc.virtual_cells:
            t = c.leaf_type
            n += c.cell_number * config.leaf_count(t) * skus[config.leaf_sku(t)].gpu
        out[v] = n
    return out


def private_cluster(config: ClusterConfig, vc: str) -> ClusterConfig | None:
    """A cluster made of exactly ``vc``'s virtual cells (same cell types, so the same topology), owned
    by one VC of the same name; nodes are named ``<vc>/<cell type>/<i>``.  None when the VC has no
    virtual cells (pinned cells are not modelled)."""
    pc = config.physical_cluster
    vcs = config.virtual_clusters.get(vc)
    if vcs is None or not vcs.virtual_cells:
        return None
    types = {k: v.model_dump(by_alias=True) for k, v in pc.cell_types.items()}
    counter = [0]

    def build(t: str) -> dict:
        ct = pc.cell_types[t]
        if ct.is_node_level:
            counter[0] += 1
            return {"cellType": t, "cellAddress": f"{vc}/{t}/{counter[0] - 1}"}
        return {"cellType": t, "cellChildren": [build(ct.child_cell_type) for _ in range(ct.child_cell_number)]}

    def has_node_level(t: str) -> bool:
        return any(x in pc.cell_types and pc.cell_types[x].is_node_level for x in config.type_chain_below(t))

    physical = []
    vcells: list[dict[str, Any]] = []
    for c in vcs.virtual_cells:
        t = c.leaf_type
        chain = t
        if config.is_leaf_type(t) or not has_node_level(t):
            chain = f"{t}-PRIVATE-NODE"
            types[chain] = {"childCellType": t, "childCellNumber": 1, "isNodeLevel": True}
            for _ in range(c.cell_number):
                counter[0] += 1
                physical.append({"cellType": chain, "cellAddress": f"{vc}/{chain}/{counter[0] - 1}"})
        else:
            for _ in range(c.cell_number):
                physical.append(build(t))
        vcells.append({"cellType": chain, "cellNumber": c.cell_number})
    merged: dict[str, int] = {}
    for vcell in vcells:
        merged[vcell["cellType"]] = merged.get(vcell["cellType"], 0) + vcell["cellNumber"]
    data = {
        "physicalCluster": {
            "skuTypes": {k: v.model_dump(by_alias=True) for k, v in pc.sku_types.items()},
            "cellTypes": types,
            "physicalCells": physical,
        },
        "virtualClusters": {vc: {"virtualCells": [{"cellType": k, "cellNumber": n} for k, n in merged.items()]}},
    }
    return ClusterConfig.from_dict(data)
