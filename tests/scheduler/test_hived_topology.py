"""Deeper topologies: packing, affinity, pinned cells, sku types, illegal VC binding."""

from __future__ import annotations

import pytest

from apiary.errors import ValidationError
from apiary.scheduler import GroupRequest, HivedScheduler, TaskRequest
from apiary.spec.cluster import load_cluster_config

THREE_LEVEL = """
physicalCluster:
  skuTypes:
    V100: {gpu: 1, cpu: 4, memory: 16Gi}
    K80: {gpu: 2, cpu: 2, memory: 8Gi}
  cellTypes:
    V100-NODE: {childCellType: V100, childCellNumber: 8, isNodeLevel: true}
    V100-RACK: {childCellType: V100-NODE, childCellNumber: 2}
    V100-POD: {childCellType: V100-RACK, childCellNumber: 2}
    K80-NODE: {childCellType: K80, childCellNumber: 4, isNodeLevel: true}
  physicalCells:
  - cellType: V100-POD
    cellChildren:
    - cellChildren: [{cellAddress: n0}, {cellAddress: n1}]
    - cellChildren: [{cellAddress: n2}, {cellAddress: n3, pinnedCellId: pin-n3}]
  - cellType: K80-NODE
    cellAddress: k0
virtualClusters:
  a:
    virtualCells: [{cellType: V100-POD.V100-RACK, cellNumber: 1}]
  b:
    virtualCells:
    - {cellType: V100-POD.V100-RACK.V100-NODE, cellNumber: 1}
    - {cellType: K80-NODE, cellNumber: 1}
    pinnedCells: [{pinnedCellId: pin-n3}]
"""

AFFINITY = """
physicalCluster:
  skuTypes:
    GPU: {gpu: 1, cpu: 4, memory: 16Gi}
  cellTypes:
    SWITCH: {childCellType: GPU, childCellNumber: 2}
    NODE: {childCellType: SWITCH, childCellNumber: 2, isNodeLevel: true}
    RACK: {childCellType: NODE, childCellNumber: 2}
    POD: {childCellType: RACK, childCellNumber: 2}
  physicalCells:
  - cellType: POD
    cellChildren:
    - cellChildren: [{cellAddress: n0}, {cellAddress: n1}]
    - cellChildren: [{cellAddress: n2}, {cellAddress: n3}]
virtualClusters:
  all:
    virtualCells: [{cellType: POD, cellNumber: 1}]
"""


def req(name, vc, instances=1, gpu=1, cpu=1.0, mem=1024, prio=100, gang=True, sku=None, pinned=None):
    return GroupRequest(name, vc, prio, gang, (TaskRequest("w", instances, gpu, cpu, mem, sku, pinned),))


def place(s: HivedScheduler, r: GroupRequest) -> list[tuple[str, tuple[int, ...]]]:
    d = s.schedule(r)
    assert d.kind == "place", d.reason
    s.allocate(r.name, r, d.placements)
    return [(p.node, p.leaf_cell_indices) for p in d.placements]


@pytest.fixture
def three() -> HivedScheduler:
    return HivedScheduler(load_cluster_config(THREE_LEVEL))


def bound(s: HivedScheduler) -> dict[str, list[str]]:
    return {vc: sorted(c.address for c in cells) for vc, cells in s._bound.items()}


def test_lazy_binding_binds_on_first_use_and_unbinds_when_free(three):
    assert bound(three) == {"a": [], "b": []}  # nothing bound before use
    st = three.status()["virtualClusters"]
    assert st["a"]["quota"] == 16 and st["b"]["quota"] == 20
    place(three, req("x", "b", gpu=1, sku="V100"))
    assert bound(three) == {"a": [], "b": ["n2"]}  # buddy: the free node of the rack split by pin-n3
    place(three, req("y", "a", gpu=1))
    assert bound(three)["a"] == ["V100-POD[0]/0"]  # the rack that is still whole
    three.check_invariants()
    three.release("x")
    assert bound(three)["b"] == []
    three.check_invariants()


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(
            [(2, ("n0", (0, 1))), (6, ("n0", (2, 3, 4, 5, 6, 7))), (8, ("n1", tuple(range(8))))],
            id="best-fit-fills-a-node-first",
        ),
        pytest.param(
            [(3, ("n0", (0, 1, 2))), (8, ("n1", tuple(range(8)))), (5, ("n0", (3, 4, 5, 6, 7)))],
            id="eight-gpu-job-takes-the-empty-node",
        ),
    ],
)
def test_packing_in_vc_a(three, steps):
    for i, (gpu, expect) in enumerate(steps):
        assert place(three, req(f"j{i}", "a", gpu=gpu)) == [expect]


def test_gang_two_full_nodes_stays_in_vc_rack(three):
    assert sorted(place(three, req("g", "a", instances=2, gpu=8))) == [
        ("n0", tuple(range(8))),
        ("n1", tuple(range(8))),
    ]
    assert three.schedule(req("h", "a")).kind == "wait"


def test_affinity_prefers_one_rack_and_packs_within_node():
    s = HivedScheduler(load_cluster_config(AFFINITY))
    assert place(s, req("one", "all")) == [("n0", (0,))]
    # two GPUs: the other switch of n0 (leaves 2,3), not 1+2 across switches
    assert place(s, req("two", "all", gpu=2)) == [("n0", (2, 3))]
    # 2 x 4 GPUs: n1 (rack 0) alone cannot host both; rack 1 (n2, n3) can
    assert sorted(place(s, req("gang", "all", instances=2, gpu=4))) == [
        ("n2", (0, 1, 2, 3)),
        ("n3", (0, 1, 2, 3)),
    ]
    # both instances of a small gang share one node
    assert place(s, req("pair", "all", instances=2, gpu=1)) == [("n1", (0,)), ("n1", (1,))]


def test_pinned_cell_only_for_jobs_naming_it(three):
    assert place(three, req("free", "b", gpu=8)) == [("n2", tuple(range(8)))]
    assert three.schedule(req("more", "b", gpu=1, sku="V100")).kind == "wait"  # n3 is pinned
    assert place(three, req("pin", "b", gpu=8, pinned="pin-n3")) == [("n3", tuple(range(8)))]
    with pytest.raises(ValidationError, match="not in VC a"):
        three.validate(req("x", "a", pinned="pin-n3"))


def test_sku_type_selects_leaf_type_and_gpu_indices(three):
    d = three.schedule(req("k", "b", gpu=4, sku="K80"))
    assert d.kind == "place"
    (p,) = d.placements
    assert (p.node, p.leaf_cell_indices, p.gpus) == ("k0", (0, 1), (0, 1, 2, 3))
    assert place(three, req("v", "b", gpu=1)) == [("n2", (0,))]  # no skuType: first sku of the VC


@pytest.mark.parametrize(
    "gpu, cpu, mem, leaves",
    [
        pytest.param(1, 1, 1024, 1, id="one-gpu"),
        pytest.param(0, 1, 1024, 1, id="cpu-only-at-least-one"),
        pytest.param(1, 10, 1024, 3, id="cpu-10-of-4-per-leaf"),
        pytest.param(1, 1, 40000, 3, id="memory-40000-of-16384-per-leaf"),
        pytest.param(3, 1, 1024, 3, id="three-gpus"),
    ],
)
def test_leaf_cells_per_task_follow_openpai_rule(three, gpu, cpu, mem, leaves):
    d = three.schedule(req("r", "a", gpu=gpu, cpu=cpu, mem=mem))
    assert len(d.placements[0].leaf_cell_indices) == leaves


@pytest.mark.parametrize(
    "vcs, field",
    [
        pytest.param(
            "x: {virtualCells: [{cellType: V100-POD.V100-RACK, cellNumber: 3}]}",
            "virtualClusters.x.virtualCells[0]",
            id="three-racks-of-two",
        ),
        pytest.param(
            "x: {virtualCells: [{cellType: V100-POD, cellNumber: 1}]}\n"
            "y: {virtualCells: [{cellType: V100-POD.V100-RACK.V100-NODE, cellNumber: 1}]}",
            "virtualClusters.y.virtualCells[0]",
            id="pod-taken-by-another-vc",
        ),
    ],
)
def test_illegal_vc_assignment_names_the_vc(vcs, field):
    cfg = (
        THREE_LEVEL.split("virtualClusters:")[0]
        + "virtualClusters:\n"
        + "\n".join("  " + line for line in vcs.splitlines())
    )
    cfg = cfg.replace(", pinnedCellId: pin-n3", "")
    with pytest.raises(ValidationError) as e:
        HivedScheduler(load_cluster_config(cfg))
    assert e.value.field == field
    assert f"VC {field.split('.')[1]}" in e.value.message
