"""Property test: random submit / finish / fail-node / recover-node / reload sequences keep HiveD's
invariants (VC safety via check_invariants, one group per leaf cell, everything free at the end)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apiary.errors import PlatformError, UserError
from apiary.scheduler import GroupRequest, HivedScheduler, TaskRequest
from apiary.spec.cluster import load_cluster_config

FLAT = """
physicalCluster:
  skuTypes:
    GPU: {gpu: 1, cpu: 2, memory: 4096Mi}
  cellTypes:
    NODE: {childCellType: GPU, childCellNumber: 2, isNodeLevel: true}
    RACK: {childCellType: NODE, childCellNumber: 5}
  physicalCells:
  - cellType: RACK
    cellChildren: [{cellAddress: a}, {cellAddress: b}, {cellAddress: c}, {cellAddress: d}, {cellAddress: e}]
virtualClusters:
  v1: {virtualCells: [{cellType: RACK.NODE, cellNumber: 2}]}
  v2: {virtualCells: [{cellType: RACK.NODE, cellNumber: 2}]}
"""

# DGX-style: node = 2 sockets x 2 PCIe switches x 2 GPUs; racks of 2 nodes
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
  - cellType: RACK
    cellChildren: [{cellAddress: e}]
virtualClusters:
  v1: {virtualCells: [{cellType: RACK, cellNumber: 1}, {cellType: RACK.NODE.SOCKET, cellNumber: 1}]}
  v2: {virtualCells: [{cellType: RACK.NODE, cellNumber: 1}, {cellType: RACK.NODE.SOCKET.PCIE, cellNumber: 2}]}
"""

submit = st.tuples(
    st.just("submit"),
    st.sampled_from(["v1", "v2"]),
    st.sampled_from([-1, 10, 100, 120]),
    st.integers(1, 3),  # instances
    st.sampled_from([1, 2, 4, 8]),  # gpu
    st.booleans(),  # gang
)
release = st.tuples(st.just("release"), st.integers(0, 30))
health = st.tuples(st.just("health"), st.sampled_from("abcde"), st.booleans())
reload = st.tuples(st.just("reload"), st.booleans())


def _run(config: str, ops, lazy: bool, shrink: str) -> None:
    s = HivedScheduler(load_cluster_config(config), lazy_preemption=lazy)
    s.check_invariants()
    requests: dict[str, GroupRequest] = {}
    waiting: list[str] = []
    for k, op in enumerate(ops):
        if op[0] == "submit":
            _, vc, prio, inst, gpu, gang = op
            r = GroupRequest(f"u~j{k}", vc, prio, gang, (TaskRequest("t", inst, gpu, 2.0 * gpu, 1024),))
            try:
                s.validate(r)
            except Exception:
                continue
            requests[r.name] = r
            waiting.append(r.name)
        elif op[0] == "release":
            names = sorted(s.groups())
            if names:
                s.release(names[op[1] % len(names)])
        elif op[0] == "health":
            s.set_node_health(op[1], op[2]) if op[1] in s.nodes() else None
        else:  # reload: the same config, or one VC slightly smaller
            cfg = load_cluster_config(config if op[1] else config.replace("cellNumber: 2", "cellNumber: 1"))
            try:
                dropped = s.reconfigure(cfg)
            except Exception:  # the changed config itself may be illegal; state unchanged
                dropped = {}
            if op[1]:
                assert dropped == {}
            for name in dropped:
                if name not in waiting:
                    waiting.append(name)
        s.check_invariants()
        # one scheduling pass over the waiting groups, like the control loop
        for name in list(waiting):
            r = requests[name]
            try:
                d = s.schedule(r)
            except UserError:  # a reload made the request too big for its VC
                waiting.remove(name)
                continue
            s.check_invariants()
            if d.kind == "place":
                s.allocate(name, r, d.placements)
                s.check_invariants()
                if not r.gang and len(s.group_of(name)) < sum(t.instances for t in r.tasks):
                    continue
                waiting.remove(name)
            elif d.kind == "preempt":
                assert name not in d.victims
                for v in d.victims:
                    assert requests[v].priority < r.priority or v in s.downgraded()
                    s.release(v)
                    s.check_invariants()
                    if v not in waiting:
                        waiting.append(v)
        seen: dict[tuple[str, int], str] = {}
        for g in s.groups():
            for p in s.group_of(g):
                for i in p.leaf_cell_indices:
                    assert (p.node, i) not in seen, f"{(p.node, i)} used by {seen.get((p.node, i))} and {g}"
                    seen[(p.node, i)] = g
    for name in list(s.groups()):
        s.release(name)
    for name in requests:
        s.cancel(name)
    s.check_invariants()
    for v in s.status()["virtualClusters"].values():
        assert v["used"] == 0 and v["reserved"] == 0 and v["free"] == v["quota"]
        assert all(c["bound"] == 0 for c in v["cells"].values())
    assert all(not n["used"] for n in s.status()["nodes"].values())


OPS = st.lists(st.one_of(submit, submit, submit, release, health, reload), max_size=40)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.booleans())
def test_random_sequences_keep_invariants_flat(ops, lazy):
    _run(FLAT, ops, lazy, "")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.booleans())
def test_random_sequences_keep_invariants_dgx(ops, lazy):
    _run(DGX, ops, lazy, "")


def test_check_invariants_detects_a_broken_state():
    s = HivedScheduler(load_cluster_config(FLAT))
    chain = s.topo.chains["RACK"]
    chain.D[2] += 100  # pretend a VC wants far more than exists
    with pytest.raises(PlatformError, match="VC safety"):
        s.check_invariants()
