"""Property test: random schedule/allocate/release sequences keep HiveD's invariants."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apiary.scheduler import GroupRequest, HivedScheduler, TaskRequest
from apiary.spec.cluster import load_cluster_config

CONFIG = """
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

submit = st.tuples(
    st.just("submit"),
    st.sampled_from(["v1", "v2"]),
    st.sampled_from([-1, 10, 100, 120]),
    st.integers(1, 3),  # instances
    st.integers(1, 2),  # gpu
    st.booleans(),  # gang
)
release = st.tuples(st.just("release"), st.integers(0, 30))
health = st.tuples(st.just("health"), st.sampled_from("abcde"), st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(submit, submit, release, health), max_size=40))
def test_random_sequences_keep_invariants(ops):
    s = HivedScheduler(load_cluster_config(CONFIG))
    leaf_vc = {(n, lf.index): lf.vc for n, node in s.topo.nodes.items() for lf in node.leaves}
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
                victim = names[op[1] % len(names)]
                s.release(victim)
        else:
            s.set_node_health(op[1], op[2])
        # one scheduling pass over the waiting groups, like the control loop
        for name in list(waiting):
            r = requests[name]
            d = s.schedule(r)
            if d.kind == "place":
                s.allocate(name, r, d.placements)
                if not r.gang and len(s.group_of(name)) < sum(t.instances for t in r.tasks):
                    continue
                waiting.remove(name)
            elif d.kind == "preempt":
                assert name not in d.victims
                for v in d.victims:
                    assert requests[v].priority < r.priority
                    s.release(v)
                    if v not in waiting:
                        waiting.append(v)
        # invariants
        seen: dict[tuple[str, int], str] = {}
        for g in s.groups():
            for p in s.group_of(g):
                assert len(p.leaf_cell_indices) == len(set(p.leaf_cell_indices))
                for i in p.leaf_cell_indices:
                    assert (p.node, i) not in seen, f"{(p.node, i)} used by {seen.get((p.node, i))} and {g}"
                    seen[(p.node, i)] = g
                    if requests[g].priority >= 0:
                        assert leaf_vc[(p.node, i)] == requests[g].virtual_cluster
        st_ = s.status()["virtualClusters"]
        assert sum(v["used"] for v in st_.values()) == len(seen)
    for name in list(s.groups()):
        s.release(name)
    for name in requests:
        s.cancel(name)
    for v in s.status()["virtualClusters"].values():
        assert v["used"] == 0 and v["reserved"] == 0 and v["free"] == v["quota"]
    assert all(not n["used"] for n in s.status()["nodes"].values())
