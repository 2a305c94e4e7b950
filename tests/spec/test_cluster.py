"""HiveD cluster config loader: Lab 6 configs, wrapper, round trip and error fields."""

from __future__ import annotations

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
            "cellNumber: 0",
            "virtualClusters.default.virtualCells[0].cellNumber",
            id="cell-number-zero",
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
