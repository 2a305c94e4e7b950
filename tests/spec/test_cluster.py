"""HiveD cluster config loader: Lab 6 configs, wrapper, round trip and error fields."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.builders import LAB6  # examples/lab6: Lab 6's files, copied unmodified

from apiary.errors import ValidationError
from apiary.spec.cluster import ClusterConfig, load_cluster_config, parse_memory_mb

BASE = """
physicalCluster:
  skuTypes:
    GPU: {gpu: 1, cpu: 2, memory: 4096Mi}
  cellTypes:
    NODE: {childCellType: GPU, childCellNumber: 2, isNodeLevel: true}
    POOL: {childCellType: NODE, childCellNumber: 2}
  physicalCells:
  - cellType: POOL
    cellChildren: [{cellAddress: n0}, {cellAddress: n1}]
virtualClusters:
  default:
    virtualCells: [{cellType: POOL.NODE, cellNumber: 2}]
"""


@pytest.mark.parametrize("name", ["one-vc", "two-vcs"])
def test_lab6_configs_load_and_round_trip(name):
    cfg = load_cluster_config(LAB6 / f"hived-config-{name}.yaml")
    assert isinstance(cfg, ClusterConfig)
    assert load_cluster_config(cfg.to_yaml()) == cfg
    assert load_cluster_config(str(LAB6 / f"hived-config-{name}.yaml")) == cfg


def test_two_vcs_shape():
    cfg = load_cluster_config(LAB6 / "hived-config-two-vcs.yaml")
    assert list(cfg.virtual_clusters) == ["default", "vc1"]
    assert cfg.physical_cluster.sku_types["GPU-C"].memory_mb == 4096
    assert cfg.virtual_clusters["vc1"].virtual_cells[0].cell_type == "GPU-D-NODE-POOL.GPU-D-NODE"
    assert cfg.leaf_count("GPU-C-NODE-POOL") == 1


def test_bare_and_bytes_and_dict_wrapper():
    assert load_cluster_config(BASE.encode()) == load_cluster_config(BASE)
    import yaml

    wrapped = yaml.safe_dump({"hivedscheduler": {"config": yaml.safe_load(BASE)}})
    assert load_cluster_config(wrapped) == load_cluster_config(BASE)


@pytest.mark.parametrize(
    "quantity, mb",
    [("4096Mi", 4096), ("16Gi", 16384), ("1Ti", 1048576), (str(2**30), 1024), ("1G", 953)],
)
def test_memory_quantities(quantity, mb):
    assert parse_memory_mb(quantity) == mb


@pytest.mark.parametrize(
    "old, new, field",
    [
        pytest.param(
            "childCellType: GPU,",
            "childCellType: TPU,",
            "physicalCluster.cellTypes.NODE.childCellType",
            id="undefined-child-type",
        ),
        pytest.param(
            "POOL: {childCellType: NODE",
            "POOL: {childCellType: POOL",
            "physicalCluster.cellTypes.POOL",
            id="cycle",
        ),
        pytest.param(
            "cellType: POOL.NODE,",
            "cellType: POOL.RACK,",
            "virtualClusters.default.virtualCells[0].cellType",
            id="vc-path-missing",
        ),
        pytest.param(
            "cellType: POOL.NODE,",
            "cellType: RACK.NODE,",
            "virtualClusters.default.virtualCells[0].cellType",
            id="vc-chain-missing",
        ),
        pytest.param(
            "cellNumber: 2",
            "cellNumber: -1",
            "virtualClusters.default.virtualCells[0].cellNumber",
            id="cell-number-negative",  # 0 is allowed: HiveD's reconfiguration tests use it
        ),
        pytest.param(
            "- cellType: POOL",
            "- cellType: RACK",
            "physicalCluster.physicalCells[0].cellType",
            id="unknown-physical-type",
        ),
        pytest.param(
            "memory: 4096Mi", "memory: lots", "physicalCluster.skuTypes.GPU.memory", id="bad-memory"
        ),
        pytest.param("cpu: 2,", "cpu: 2, disk: 1,", "physicalCluster.skuTypes.GPU.disk", id="extra-field"),
        pytest.param(
            "{cellAddress: n1}",
            "{cellAddress: n0}",
            "physicalCluster.physicalCells[0].cellChildren[1].cellAddress",
            id="duplicate-node",
        ),
        pytest.param(
            "{cellAddress: n1}",
            "{pinnedCellId: p}",
            "physicalCluster.physicalCells[0].cellChildren[1].cellAddress",
            id="node-without-address",
        ),
        pytest.param("physicalCluster:", "physicalCluster: [", "config", id="broken-yaml"),
    ],
)
def test_errors_name_the_field(old, new, field):
    assert old in BASE
    with pytest.raises(ValidationError) as e:
        load_cluster_config(BASE.replace(old, new))
    assert e.value.field == field, e.value.message


def test_unknown_pinned_cell_in_vc():
    text = BASE + "    pinnedCells: [{pinnedCellId: nope}]\n"
    with pytest.raises(ValidationError) as e:
        load_cluster_config(text)
    assert e.value.field == "virtualClusters.default.pinnedCells[0].pinnedCellId"


def test_wrapper_without_config():
    with pytest.raises(ValidationError) as e:
        load_cluster_config("hivedscheduler: {}\n")
    assert e.value.field == "hivedscheduler.config"


# ---------------------------------------------------------------------------------------------
# HiveD's own configs (issue "scheduler parity with HiveD"): its design config loads unmodified.
HIVED_DESIGN = Path(__file__).resolve().parents[1] / "scheduler" / "hived_design" / "hivedscheduler.yaml"


def test_hived_design_config_loads_unmodified():
    cfg = load_cluster_config(HIVED_DESIGN)
    pc = cfg.physical_cluster
    # No skuTypes in HiveD's format: each leaf type is one GPU, cpu and memory not accounted.
    assert pc.implicit_skus and set(pc.sku_types) == {"CT1", "DGX1-P100", "DGX1-V100", "DGX2-V100",
                                                       "IB-DGX2-V100-V100"}
    assert all((s.gpu, s.cpu, s.memory) == (1, None, None) for s in pc.sku_types.values())
    assert cfg.kube_api_server_address == "http://10.10.10.10:8080"  # accepted, not used
    # cellChildren: null is "no children listed"; node 1.0.0.2 appears in two chains.
    p100 = pc.physical_cells[3].cell_children[0]
    assert (p100.cell_address, p100.cell_children) == ("1.0.0.2", [])
    # A round trip keeps it a HiveD-style config (no derived skuTypes written out).
    again = load_cluster_config(cfg.to_yaml())
    assert "skuTypes" not in cfg.to_yaml() and again.physical_cluster.sku_types == pc.sku_types


@pytest.mark.parametrize(
    ("old", "new", "field", "words"),
    [
        pytest.param("- cellAddress: 9  # GPU Index", "- cellAddress: 7  # GPU Index",
                     "physicalCluster.physicalCells", "leaf cell address 7", id="leaf-address-in-two-chains"),
        pytest.param("- cellAddress: 9  # GPU Index", "- cellAddress: gpu9",
                     "physicalCluster.physicalCells[2].cellChildren[1].cellAddress", "device index",
                     id="leaf-address-not-a-number"),
        pytest.param("  - cellType: CT1-NODE\n    cellAddress: 0.0.0.1",
                     "  - cellType: CT1-NODE\n    cellAddress: 0.0.0.0",
                     "physicalCluster.physicalCells[1].cellAddress", "leaf type 'CT1'", id="node-twice-in-one-chain"),
    ],
)
def test_hived_style_node_errors_name_the_field(old, new, field, words):
    from apiary.scheduler import HivedScheduler

    text = HIVED_DESIGN.read_text()
    assert old in text
    with pytest.raises(ValidationError) as e:
        HivedScheduler(load_cluster_config(text.replace(old, new)))
    assert e.value.field == field and words in e.value.message, e.value.message


def test_a_sku_without_cpu_or_memory_does_not_account_them():
    from apiary.scheduler.sizing import leaf_cells_needed
    from apiary.scheduler.types import TaskRequest
    from apiary.spec.cluster import SkuType

    assert leaf_cells_needed(TaskRequest("t", 1, 2, 64.0, 10**6), SkuType(gpu=1)) == 2
    assert leaf_cells_needed(TaskRequest("t", 1, 1, 8.0, 1024), SkuType(gpu=1, cpu=2)) == 4


@pytest.mark.parametrize(("old", "new", "field", "meant"), [
    pytest.param("cpu: 2,", "cpus: 2,", "physicalCluster.skuTypes.GPU.cpus", "cpu", id="sku"),
    pytest.param("{cellAddress: n1}", "{celAddress: n1}", "physicalCluster.physicalCells[0].cellChildren[1].celAddress",
                 "cellAddress", id="a-cell-in-a-list-of-a-recursive-model"),
])
def test_a_typo_d_field_offers_the_close_field_names(old: str, new: str, field: str, meant: str) -> None:
    assert old in BASE
    with pytest.raises(ValidationError) as e:
        load_cluster_config(BASE.replace(old, new, 1))
    assert e.value.field == field and e.value.message.endswith(f"did you mean {meant!r}?"), e.value.message
