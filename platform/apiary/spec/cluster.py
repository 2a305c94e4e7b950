"""HiveD cluster configuration: models and loader.

The wire format is HiveD's ``physicalCluster`` / ``virtualClusters`` config (microsoft/hivedscheduler
doc/user-manual.md, "Config"), either bare or inside OpenPAI's ``services-configuration.yaml``
wrapper::

    hivedscheduler:
      config: |
        physicalCluster: ...
        virtualClusters: ...

Concepts (HiveD user manual):

* ``skuTypes`` are the *leaf cells*: one resource unit in every dimension (``gpu`` count, ``cpu``
  cores, ``memory`` as a Kubernetes quantity such as ``4096Mi`` or ``16Gi``).  OpenPAI's configs
  give them; HiveD's own (``example/config/design/hivedscheduler.yaml``) do not: there every
  ``childCellType`` that is not a cell type is a leaf type of one GPU, and cpu and memory are not
  accounted.  A sku may likewise omit ``cpu`` or ``memory``.
* ``cellTypes`` build a tree of cell types: each type has ``childCellNumber`` children of
  ``childCellType`` (another cell type or a sku type); ``isNodeLevel`` marks the type that is one
  machine.  The top type of a ``physicalCells`` entry names a *chain*.
* ``physicalCells`` lists the real hardware; ``cellAddress`` of a node-level cell is the node name,
  of a cell below the node its index within the parent, and of a leaf cell its device index on the
  node (the GPU index a task gets).  Children may be omitted or ``null``: they are generated, and a
  leaf without an address gets its position in the node (HiveD's default).  One node may appear in
  several chains, one per leaf type (HiveD: "one node has multiple leaf cell types"), if its leaf
  addresses do not collide.  ``pinnedCellId`` pins a physical cell to a VC.
* ``virtualClusters`` give each VC a quota of cells by dotted type path inside a chain
  (``GPU-NODE-POOL.GPU-NODE``: cells of type GPU-NODE in chain GPU-NODE-POOL) and optional
  ``pinnedCells``.

:func:`load_cluster_config` raises :class:`~apiary.errors.ValidationError` whose ``field`` is the
dotted path of the offending field (``virtualClusters.vc1.virtualCells[0].cellType``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError
from pydantic.alias_generators import to_camel

from apiary.errors import ValidationError
from apiary.spec import safeyaml
from apiary.spec.suggest import did_you_mean, field_names_at

__all__ = [
    "CellType",
    "ClusterConfig",
    "PhysicalCell",
    "PhysicalCluster",
    "PinnedCell",
    "SkuType",
    "VirtualCell",
    "VirtualCluster",
    "load_cluster_config",
    "parse_memory_mb",
]

_QUANTITY = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTPE]i?|k|m)?\s*")  # fullmatch
_FACTORS = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def parse_memory_mb(quantity: str | int) -> int:
    """A Kubernetes memory quantity (``4096Mi``, ``16Gi``, ``1G``, bytes as a number) in MiB, rounded
    down.  Raises ``ValueError`` for anything else."""
    m = _QUANTITY.fullmatch(str(quantity))
    if not m:
        raise ValueError(f"not a memory quantity: {quantity!r} (use e.g. 4096Mi or 16Gi)")
    value = float(m.group(1)) * _FACTORS[m.group(2)]
    return int(math.floor(value / 2**20 + 1e-9))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=False)


class SkuType(_Model):
    """A leaf cell type: the resources of one leaf cell (HiveD ``skuTypes.<name>``).

    ``cpu`` (cores) or ``memory`` (a quantity) left out: that dimension is not accounted (a task's
    request for it does not cost cells), as in HiveD's own configs, which know only GPUs.
    """

    gpu: int = Field(0, ge=0)
    cpu: float | None = Field(None, gt=0)
    memory: str | None = None

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> Any:
        if isinstance(v, int | float) and not isinstance(v, bool):
            v = str(int(v))
        if isinstance(v, str):
            parse_memory_mb(v)
        return v

    @property
    def memory_mb(self) -> int | None:
        """Memory of one leaf cell in MiB; None when not accounted."""
        return parse_memory_mb(self.memory) if self.memory is not None else None


class CellType(_Model):
    """A composite cell type: ``child_cell_number`` cells of ``child_cell_type``."""

    child_cell_type: str
    child_cell_number: int = Field(ge=1)
    is_node_level: bool = False


def _str_or_none(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return v


class PhysicalCell(_Model):
    """One physical cell; ``cell_type`` may be omitted below the top (it is the parent's child type)."""

    cell_type: str | None = None
    cell_address: str | None = None
    pinned_cell_id: str | None = None
    cell_children: list[PhysicalCell] = Field(default_factory=list)

    @field_validator("cell_address", mode="before")
    @classmethod
    def _address(cls, v: Any) -> Any:
        return _str_or_none(v)

    @field_validator("cell_children", mode="before")
    @classmethod
    def _children(cls, v: Any) -> Any:
        return [] if v is None else v  # HiveD: "cellChildren: null # null, empty or not specified"


class PhysicalCluster(_Model):
    sku_types: dict[str, SkuType] = Field(default_factory=dict)
    cell_types: dict[str, CellType] = Field(default_factory=dict)
    physical_cells: list[PhysicalCell]

    @model_validator(mode="after")
    def _implicit_skus(self) -> PhysicalCluster:
        """HiveD's own configs have no ``skuTypes``: every child type that is not a cell type is a
        leaf type of one GPU (cpu and memory not accounted)."""
        if not self.sku_types:
            types = self.cell_types
            leaves = [ct.child_cell_type for ct in types.values() if ct.child_cell_type not in types]
            self.sku_types = {t: SkuType(gpu=1) for t in dict.fromkeys(leaves)}
            self.implicit_skus = True
        return self

    implicit_skus: bool = Field(False, exclude=True, description="sku types derived from the cell types")


class VirtualCell(_Model):
    """``cell_number`` cells (0 or more) of the dotted type path ``cell_type`` (``CHAIN.TYPE``) for one
    VC."""

    cell_type: str
    cell_number: int

    @property
    def chain(self) -> str:
        return self.cell_type.split(".")[0]

    @property
    def leaf_type(self) -> str:
        """The last component: the cell type the VC gets (named so for symmetry with HiveD)."""
        return self.cell_type.split(".")[-1]


class PinnedCell(_Model):
    pinned_cell_id: str


class VirtualCluster(_Model):
    virtual_cells: list[VirtualCell] = Field(default_factory=list)
    pinned_cells: list[PinnedCell] = Field(default_factory=list)


class ClusterConfig(_Model):
    """A whole HiveD config.  Build it with :func:`load_cluster_config` (which runs the semantic
    checks) or :meth:`from_dict`.

    HiveD's scheduler-service settings (``kubeApiServerAddress`` and the others of HiveD's
    ``pkg/api/config.go``) are accepted so that HiveD's own config files load unmodified; Apiary
    does not use them.
    """

    physical_cluster: PhysicalCluster
    virtual_clusters: dict[str, VirtualCluster] = Field(default_factory=dict)
    kube_api_server_address: str | None = None
    kube_config_file_path: str | None = None
    web_server_address: str | None = None
    force_pod_bind_threshold: int | None = None
    waiting_pod_scheduling_block_milli_sec: int | None = None
    quota_exclude_v_cs: list[str] | None = Field(None, alias="quotaExcludeVCs")

    # ---- helpers used by the scheduler -------------------------------------------------------
    def child_type(self, cell_type: str) -> str | None:
        ct = self.physical_cluster.cell_types.get(cell_type)
        return ct.child_cell_type if ct else None

    def is_leaf_type(self, cell_type: str) -> bool:
        return cell_type in self.physical_cluster.sku_types

    def leaf_count(self, cell_type: str) -> int:
        """Leaf cells in one full cell of ``cell_type``."""
        n = 1
        t: str | None = cell_type
        while t is not None and not self.is_leaf_type(t):
            ct = self.physical_cluster.cell_types[t]
            n *= ct.child_cell_number
            t = ct.child_cell_type
        return n

    def leaf_sku(self, cell_type: str) -> str:
        t = cell_type
        while not self.is_leaf_type(t):
            t = self.physical_cluster.cell_types[t].child_cell_type
        return t

    def type_chain_below(self, cell_type: str) -> list[str]:
        """``cell_type`` and all its descendant types down to the sku type, top first."""
        out = [cell_type]
        while not self.is_leaf_type(out[-1]):
            out.append(self.physical_cluster.cell_types[out[-1]].child_cell_type)
        return out

    def to_yaml(self) -> str:
        """The bare HiveD config as YAML (camelCase keys, ``None`` fields left out; derived sku types
        left out too, so a HiveD-style config stays one)."""
        data = self.model_dump(by_alias=True, exclude_none=True, mode="json")
        if self.physical_cluster.implicit_skus:
            data["physicalCluster"].pop("skuTypes", None)
        return yaml.safe_dump(data, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Any) -> ClusterConfig:
        """Validate a parsed bare config (shape and semantics); raises ValidationError."""
        try:
            cfg = cls.model_validate(data)
        except PydanticValidationError as e:
            err = e.errors()[0]
            message, loc = err["msg"], tuple(err["loc"])
            if err["type"] == "extra_forbidden" and loc and isinstance(loc[-1], str):
                message += did_you_mean(loc[-1], field_names_at(cls, loc[:-1]))
            raise ValidationError(loc_path(err["loc"]), message) from None
        _check_semantics(cfg)
        return cfg


def loc_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a field path: ``("layers", 0, "time_zone")`` ->
    ``layers[0].time_zone`` (the name a 4xx gives the field)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _check_semantics(cfg: ClusterConfig) -> None:
    pc = cfg.physical_cluster
    skus, types = pc.sku_types, pc.cell_types
    if not skus:
        raise ValidationError("physicalCluster.skuTypes", "at least one sku type is required")
    for name in types:
        if name in skus:
            raise ValidationError(f"physicalCluster.cellTypes.{name}", "name is also a sku type")
    for name, ct in types.items():
        if ct.child_cell_type not in types and ct.child_cell_type not in skus:
            raise ValidationError(
                f"physicalCluster.cellTypes.{name}.childCellType",
                f"{ct.child_cell_type!r} is neither a cell type nor a sku type",
            )
    # cycles and node levels
    for name in types:
        seen = [name]
        t = types[name].child_cell_type
        while t in types:
            if t in seen:
                raise ValidationError(
                    f"physicalCluster.cellTypes.{name}",
                    "cell type cycle: " + " -> ".join([*seen, t]),
                )
            seen.append(t)
            t = types[t].child_cell_type
        nodes = [s for s in seen if types[s].is_node_level]
        if len(nodes) > 1:
            raise ValidationError(
                f"physicalCluster.cellTypes.{name}",
                "more than one isNodeLevel type in chain: " + ", ".join(nodes),
            )

    if not pc.physical_cells:
        raise ValidationError("physicalCluster.physicalCells", "at least one physical cell is required")
    addresses: dict[tuple[str, str], str] = {}  # (node name, leaf type) -> path
    pinned: dict[str, str] = {}

    def walk(cell: PhysicalCell, expected: str | None, path: str, above_node: bool) -> None:
        t = cell.cell_type or expected
        if t is None:
            raise ValidationError(f"{path}.cellType", "a top-level physical cell needs cellType")
        if expected is not None and cell.cell_type is not None and cell.cell_type != expected:
            raise ValidationError(
                f"{path}.cellType", f"{cell.cell_type!r} but the parent's childCellType is {expected!r}"
            )
        if t not in types:
            if t in skus and expected is not None:
                if cell.cell_children:
                    raise ValidationError(f"{path}.cellChildren", f"leaf cell {t!r} has no children")
                if above_node:
                    raise ValidationError(f"{path}.cellType", f"leaf cell {t!r} is not under a node")
                if cell.cell_address is not None and not cell.cell_address.isdigit():
                    raise ValidationError(
                        f"{path}.cellAddress",
                        f"{cell.cell_address!r}: a leaf cell's address is its device index on the node (0, 1, ...)",
                    )
                _pin(cell, path)
                return
            raise ValidationError(f"{path}.cellType", f"unknown cell type {t!r}")
        ct = types[t]
        if (
            expected is None
            and not ct.is_node_level
            and not any(types[x].is_node_level for x in cfg.type_chain_below(t) if x in types)
        ):
            raise ValidationError(f"{path}.cellType", f"chain {t!r} has no isNodeLevel cell type")
        if ct.is_node_level:
            if not cell.cell_address:
                raise ValidationError(
                    f"{path}.cellAddress", "a node-level cell needs cellAddress (node name)"
                )
            # A node may appear once per leaf type (HiveD: one node with several leaf cell types).
            where = (cell.cell_address, cfg.leaf_sku(t))
            if where in addresses:
                raise ValidationError(
                    f"{path}.cellAddress",
                    f"node {cell.cell_address!r} with leaf type {where[1]!r} already at {addresses[where]}",
                )
            addresses[where] = path
        if len(cell.cell_children) > ct.child_cell_number:
            raise ValidationError(
                f"{path}.cellChildren",
                f"{len(cell.cell_children)} children but {t} has childCellNumber {ct.child_cell_number}",
            )
        if above_node and not ct.is_node_level and not cell.cell_children:
            raise ValidationError(
                f"{path}.cellChildren", f"cell of type {t!r} above node level lists no nodes"
            )
        _pin(cell, path)
        below = above_node and not ct.is_node_level
        for i, ch in enumerate(cell.cell_children):
            walk(ch, ct.child_cell_type, f"{path}.cellChildren[{i}]", below)

    def _pin(cell: PhysicalCell, path: str) -> None:
        if cell.pinned_cell_id is not None:
            if cell.pinned_cell_id in pinned:
                raise ValidationError(f"{path}.pinnedCellId", f"{cell.pinned_cell_id!r} used twice")
            pinned[cell.pinned_cell_id] = path

    for i, cell in enumerate(pc.physical_cells):
        walk(cell, None, f"physicalCluster.physicalCells[{i}]", True)

    # Children left out are generated: a few characters of childCellNumber must not make the
    # scheduler build more cells than any listed config could have.
    leaves = 0
    for i, cell in enumerate(pc.physical_cells):
        leaves += cfg.leaf_count(cell.cell_type or "")
        if leaves > MAX_LEAF_CELLS:
            raise ValidationError(
                f"physicalCluster.physicalCells[{i}]",
                f"the physical cluster has more than {MAX_LEAF_CELLS} leaf cells (childCellNumber multiplied down "
                "each chain), Apiary's maximum",
            )

    chains = {c.cell_type for c in pc.physical_cells}
    pinned_owner: dict[str, str] = {}
    for vc_name, vc in cfg.virtual_clusters.items():
        for i, vcell in enumerate(vc.virtual_cells):
            path = f"virtualClusters.{vc_name}.virtualCells[{i}]"
            if vcell.cell_number < 0:
                raise ValidationError(f"{path}.cellNumber", f"must be >= 0, got {vcell.cell_number}")
            parts = vcell.cell_type.split(".")
            if parts[0] not in chains:
                raise ValidationError(
                    f"{path}.cellType", f"{vcell.cell_type!r}: {parts[0]!r} is not a physical cell chain"
                )
            below = cfg.type_chain_below(parts[0])
            pos = 0
            for p in parts[1:]:
                if p not in below[pos + 1 :]:
                    raise ValidationError(
                        f"{path}.cellType", f"{vcell.cell_type!r}: no cell type {p!r} inside {parts[0]!r}"
                    )
                pos = below.index(p, pos + 1)
        for i, pcell in enumerate(vc.pinned_cells):
            path = f"virtualClusters.{vc_name}.pinnedCells[{i}].pinnedCellId"
            if pcell.pinned_cell_id not in pinned:
                raise ValidationError(path, f"unknown pinnedCellId {pcell.pinned_cell_id!r}")
            if pcell.pinned_cell_id in pinned_owner:
                raise ValidationError(
                    path,
                    f"{pcell.pinned_cell_id!r} is already pinned to VC {pinned_owner[pcell.pinned_cell_id]}",
                )
            pinned_owner[pcell.pinned_cell_id] = vc_name


def load_cluster_config(source: str | bytes | Path) -> ClusterConfig:
    """Load and check a HiveD config.

    ``source``: a :class:`~pathlib.Path` (read as UTF-8), YAML text (``str``/``bytes``), or a ``str``
    naming an existing file when it is one line without ``:``.  Accepts the bare config (HiveD's own
    ``hivedscheduler.yaml`` included), or OpenPAI's ``hivedscheduler: {config: "<yaml>"}`` wrapper.
    Raises ValidationError (field = dotted path) on broken YAML, unknown fields, undefined or cyclic
    cell types, VC paths that do not exist, ``cellNumber < 0``, unknown pinned cells, a non-numeric
    leaf address and the like. The YAML (file, text, and the wrapper's inner ``config`` string) is
    read with :func:`apiary.spec.safeyaml.load`: bytes must be UTF-8, and duplicate keys, nesting
    deeper than 64 levels, more than 100 aliases or :data:`CLUSTER_MAX_NODES` nodes are refused
    (``field`` ``config`` or ``hivedscheduler.config``).
    """
    text: str | bytes = source if not isinstance(source, Path) else _read(source)
    if isinstance(text, str) and "\n" not in text and ":" not in text and text.strip() and Path(text).is_file():
        text = _read(Path(text))
    data = _parse_yaml(text, "config")
    if isinstance(data, dict) and "hivedscheduler" in data:
        wrapper = data["hivedscheduler"]
        if not isinstance(wrapper, dict) or "config" not in wrapper:
            raise ValidationError("hivedscheduler.config", "missing")
        inner = wrapper["config"]
        data = _parse_yaml(inner, "hivedscheduler.config") if isinstance(inner, str) else inner
    if not isinstance(data, dict):
        raise ValidationError("config", "expected a mapping with physicalCluster and virtualClusters")
    return ClusterConfig.from_dict(data)


def _read(path: Path) -> bytes:
    """The file's bytes (decoded, strictly as UTF-8, by :func:`_parse_yaml`)."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValidationError("config", f"cannot read {path}: {e}") from None


#: Node limit for a cluster config (after alias expansion): Apiary's bound, 10x safeyaml's
#: default, because an operator may list every leaf cell of a large cluster (10,000 nodes of 8
#: GPUs, leaf addresses given, are ~300,000 nodes); depth and alias limits stay safeyaml's.
CLUSTER_MAX_NODES = 1_000_000


#: Leaf cells of the whole physical cluster, generated children included: Apiary's bound. A config
#: that lists every leaf cell has fewer than :data:`CLUSTER_MAX_NODES` of them, so generating
#: children adds nothing a listed config could not have; the scheduler builds 100,000 leaf cells
#: in about 2.6 s (measured), 1,000,000 in about 27 s, 2**70 never.
MAX_LEAF_CELLS = CLUSTER_MAX_NODES


def _parse_yaml(text: str | bytes, field: str) -> Any:
    """YAML via :func:`apiary.spec.safeyaml.load` (bounded; duplicate keys and non-UTF-8 refused).

    Raises ValidationError(field, ...) for anything that is not such YAML.
    """
    return safeyaml.load(text, field=field, what="config", max_nodes=CLUSTER_MAX_NODES)
