"""HiveD shapes: lazy binding with buddy split/merge, VC safety against fragmentation, inter-VC and
lazy preemption, gang without head-of-line blocking, bad nodes (doomed cells), reconfiguration."""

from __future__ import annotations

import pytest

from apiary.errors import ValidationError
from apiary.scheduler import GroupRequest, HivedScheduler, TaskRequest
from apiary.spec.cluster import load_cluster_config

# 8-GPU node = 2 sockets x 2 PCIe switches x 2 GPUs; racks of 2 nodes
DGX = """
physicalCluster:
  skuTypes:
    GPU: {gpu: 1, cpu: 2, memory: 4096Mi}
  cellTypes:
    PCIE: {childCellType: GPU, childCellNumber: 2}
    SOCKET: {childCellType: PCIE, childCellNumber: 2}
    NODE: {childCellType: SOCKET, childCellNumber: 2, isNodeLevel: true}
    RACK: {childCellType: NODE, childCellNumber: 2}
  physicalCells:
  - cellType: RACK
    cellChildren: [{cellAddress: a}, {cellAddress: b}]
  - cellType: RACK
    cellChildren: [{cellAddress: c}, {cellAddress: d}]
virtualClusters:
  big: {virtualCells: [{cellType: RACK.NODE, cellNumber: 1}]}
  small: {virtualCells: [{cellType: RACK.NODE.SOCKET.PCIE, cellNumber: 4}]}
"""


def req(name, vc, instances=1, gpu=1, prio=100, gang=True, lazy=None):
    return GroupRequest(name, vc, prio, gang, (TaskRequest("w", instances, gpu, 1, 1024),), lazy_preemption=lazy)


def run(s: HivedScheduler, r: GroupRequest):
    d = s.schedule(r)
    if d.kind == "place":
        s.allocate(r.name, r, d.placements)
    s.check_invariants()
    return d


@pytest.fixture
def dgx() -> HivedScheduler:
    return HivedScheduler(load_cluster_config(DGX))


def test_fragmentation_never_takes_a_vcs_guaranteed_node(dgx):
    # "small" spreads four 2-GPU jobs and opportunistic jobs fill every other GPU...
    for i in range(4):
        assert run(dgx, req(f"s{i}", "small", gpu=2)).kind == "place"
    # buddy allocation packs small's PCIe cells into one node instead of fragmenting four
    assert {p.node for i in range(4) for p in dgx.group_of(f"s{i}")} == {"a"}
    for i in range(24):
        assert run(dgx, req(f"o{i}", "small", prio=-1)).kind == "place"
    # ...yet big's guaranteed 8-GPU node is still there: it preempts opportunistic jobs on one node
    d = dgx.schedule(req("b", "big", gpu=8))
    assert d.kind == "preempt" and len(d.victims) == 8
    assert all(v.startswith("o") for v in d.victims)
    for v in d.victims:
        dgx.release(v)
    assert run(dgx, req("b", "big", gpu=8)).kind == "place"


def test_buddy_split_and_merge(dgx):
    assert dgx.status()["physical"]["RACK"] == {"5": 2}  # levels: RACK 5 .. GPU 1
    run(dgx, req("x", "small", gpu=2))
    # one rack split down to a PCIe cell: free rack, node, socket, PCIe buddies remain
    assert dgx.status()["physical"]["RACK"] == {"5": 1, "4": 1, "3": 1, "2": 1}
    dgx.release("x")
    dgx.check_invariants()
    assert dgx.status()["physical"]["RACK"] == {"5": 2}  # merged back


def test_illegal_assignment_names_vc_and_level():
    bad = DGX.replace(
        "small: {virtualCells: [{cellType: RACK.NODE.SOCKET.PCIE, cellNumber: 4}]}",
        "small: {virtualCells: [{cellType: RACK, cellNumber: 2}]}",
    )
    with pytest.raises(ValidationError) as e:
        HivedScheduler(load_cluster_config(bad))
    # highest levels are assigned first: small's two racks take the cluster, big's node does not fit
    assert e.value.field == "virtualClusters.big.virtualCells[0]"
    assert "VC big" in e.value.message and "level 4" in e.value.message


def test_gang_waiting_does_not_block_smaller_job(dgx):
    run(dgx, req("s0", "small", gpu=2))
    d = dgx.schedule(req("g", "small", instances=4, gpu=2))  # 8 GPUs > 6 left in small: waits
    assert d.kind == "wait"
    assert dgx.status()["reservations"] == {}
    assert run(dgx, req("s1", "small", gpu=2)).kind == "place"  # the smaller job goes ahead


def test_elastic_beyond_quota_runs_opportunistically(dgx):
    assert run(dgx, req("g", "small", instances=4, gpu=2)).kind == "place"  # the whole quota
    assert dgx.schedule(req("more", "small", gpu=2)).kind == "wait"
    assert run(dgx, req("more", "small", gpu=2, prio=-1)).kind == "place"  # beyond quota: oppo
    assert dgx.status()["virtualClusters"]["small"]["opportunisticUsed"] == 2


@pytest.mark.parametrize("lazy", [False, True])
def test_immediate_vs_lazy_preemption(lazy):
    s = HivedScheduler(load_cluster_config(DGX), lazy_preemption=lazy)
    assert run(s, req("low", "big", gpu=4, prio=10)).kind == "place"
    d = s.schedule(req("high", "big", gpu=8, prio=100))
    s.check_invariants()
    if not lazy:
        assert d.kind == "preempt" and d.victims == ("low",) and d.downgraded == ()
    else:
        # low runs on as opportunistic; big's node binds elsewhere: nobody is killed
        assert d.kind == "place" and d.victims == () and d.downgraded == ("low",)
        s.allocate("high", req("high", "big", gpu=8, prio=100), d.placements)
        s.check_invariants()
        assert s.downgraded() == ["low"]
        assert {p.node for p in s.group_of("high")}.isdisjoint({p.node for p in s.group_of("low")})


def test_inter_vc_preemption_of_opportunistic_jobs(dgx):
    for i in range(4):
        assert run(dgx, req(f"o{i}", "small", gpu=8, prio=-1)).kind == "place"
    d = dgx.schedule(req("b", "big", gpu=8))
    assert d.kind == "preempt" and len(d.victims) == 1
    assert dgx.status()["reservations"]["b"]["victims"] == list(d.victims)
    dgx.check_invariants()


def test_bad_nodes_bind_healthy_and_report_doomed(dgx):
    dgx.set_node_health("a", False)
    d = run(dgx, req("b", "big", gpu=8))
    assert d.placements[0].node != "a"
    dgx.release("b")
    for n in "bcd":
        dgx.set_node_health(n, False)
    st = dgx.status()["virtualClusters"]
    assert st["big"]["doomedBadCells"] == 1 and st["small"]["doomedBadCells"] >= 1
    assert "unhealthy" in dgx.schedule(req("x", "big", gpu=8)).reason
    for n in "abcd":
        dgx.set_node_health(n, True)
    assert dgx.status()["virtualClusters"]["big"]["doomedBadCells"] == 0


def test_running_group_keeps_cells_on_a_node_that_goes_bad(dgx):
    run(dgx, req("b", "big", gpu=8))
    node = dgx.group_of("b")[0].node
    dgx.set_node_health(node, False)
    assert dgx.group_of("b")[0].node == node
    dgx.check_invariants()


def test_reconfigure_keeps_what_fits_and_explains_the_rest(dgx):
    run(dgx, req("b", "big", gpu=8))
    run(dgx, req("s", "small", instances=2, gpu=2))
    same = dgx.reconfigure(load_cluster_config(DGX))
    assert same == {}
    dgx.check_invariants()
    shrunk = DGX.replace("RACK.NODE.SOCKET.PCIE, cellNumber: 4", "RACK.NODE.SOCKET.PCIE, cellNumber: 1")
    out = dgx.reconfigure(load_cluster_config(shrunk))
    assert list(out) == ["s"] and "VC small" in out["s"]
    assert dgx.group_of("b") and not dgx.group_of("s")
    dgx.check_invariants()


def test_status_per_vc_is_json_able(dgx):
    import json

    run(dgx, req("b", "big", gpu=8))
    st = dgx.status("big")
    json.dumps(st)
    assert list(st["virtualClusters"]) == ["big"] and list(st["groups"]) == ["b"]
    assert st["virtualClusters"]["big"]["cells"] == {"RACK/4": {"total": 1, "bound": 1, "free": 0}}
