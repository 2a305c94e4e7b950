"""HiveD's rules where Apiary once differed, and a property test of the rules the scheduler documents.

* Opportunistic placement: on leaf cells no VC holds first (best fit); once every node is bound, in
  HiveD's cluster view order for opportunistic pods (``topology_aware_scheduler.go``,
  ``crossPriorityPack`` false): the node with the most leaf cells used by opportunistic groups, then
  the fewest used by guaranteed groups (or reserved), then config order, so a later guaranteed job of
  the owning VC is not blocked by it.
* Victims (Apiary's documented rule, a deliberate difference): only opportunistic groups and
  lower-priority groups of the preemptor's VC; opportunistic ones are taken before guaranteed ones.
* An unknown VC names the valid ones and the closest match.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from apiary.errors import UserError, ValidationError
from apiary.scheduler import Decision, GroupRequest, HivedScheduler, TaskRequest
from apiary.spec.cluster import load_cluster_config

FOUR_BY_FOUR = """
physicalCluster:
  skuTypes:
    GPU: {gpu: 1, cpu: 2, memory: 4096Mi}
  cellTypes:
    NODE: {childCellType: GPU, childCellNumber: 4, isNodeLevel: true}
    RACK: {childCellType: NODE, childCellNumber: 4}
  physicalCells:
  - cellType: RACK
    cellChildren: [{cellAddress: n1}, {cellAddress: n2}, {cellAddress: n3}, {cellAddress: n4}]
virtualClusters:
  a: {virtualCells: [{cellType: RACK.NODE, cellNumber: 2}]}
  b: {virtualCells: [{cellType: RACK.NODE, cellNumber: 2}]}
"""

# five nodes, one of them in no VC (opportunistic room that no VC's binding ever needs first)
FIVE = """
physicalCluster:
  skuTypes:
    GPU: {gpu: 1, cpu: 2, memory: 4096Mi}
  cellTypes:
    NODE: {childCellType: GPU, childCellNumber: 4, isNodeLevel: true}
    RACK: {childCellType: NODE, childCellNumber: 5}
  physicalCells:
  - cellType: RACK
    cellChildren: [{cellAddress: n1}, {cellAddress: n2}, {cellAddress: n3}, {cellAddress: n4}, {cellAddress: n5}]
virtualClusters:
  a: {virtualCells: [{cellType: RACK.NODE, cellNumber: 2}]}
  b: {virtualCells: [{cellType: RACK.NODE, cellNumber: 2}]}
"""

PROD, TEST, OPPO = 100, 10, -1


def req(name: str, vc: str, priority: int, instances: int = 1, gpu: int = 1, gang: bool = True) -> GroupRequest:
    task = TaskRequest("worker", instances, gpu, cpu=1, memory_mb=1024)
    return GroupRequest(name, vc, priority, gang, (task,))


def run(s: HivedScheduler, r: GroupRequest) -> Decision:
    """Schedule ``r`` and commit a placement at once (as the control plane does)."""
    d = s.schedule(r)
    if d.kind == "place":
        s.allocate(r.name, r, d.placements)
    return d


def test_opportunistic_job_goes_where_it_does_not_block_the_owning_vc() -> None:
    s = HivedScheduler(load_cluster_config(FOUR_BY_FOUR))
    for r in (req("a4", "a", PROD, gpu=4), req("a3", "a", PROD, gpu=3), req("b4", "b", PROD, gpu=4),
              req("b1", "b", PROD, gpu=1)):
        assert run(s, r).kind == "place", r.name
    node_of = {n: s.group_of(n)[0].node for n in ("a3", "b1")}
    assert run(s, req("o1", "b", OPPO)).kind == "place"
    # the node with the fewest guaranteed leaf cells in use (b1's: 1), not the fullest (a3's: 3)
    assert s.group_of("o1")[0].node == node_of["b1"]
    d = run(s, req("a1", "a", PROD))
    assert d.kind == "place" and d.victims == ()
    assert s.group_of("a1")[0].node == node_of["a3"]
    assert "o1" in s.groups()  # still running
    s.check_invariants()


def test_opportunistic_jobs_pack_together_before_avoiding_guaranteed_ones() -> None:
    """HiveD's first key: nodes already used by opportunistic groups come first."""
    s = HivedScheduler(load_cluster_config(FIVE))
    assert run(s, req("a2", "a", PROD, gpu=2)).kind == "place"
    assert run(s, req("o1", "b", OPPO)).kind == "place"
    first = s.group_of("o1")[0].node
    assert first != s.group_of("a2")[0].node  # no guaranteed use there
    assert run(s, req("o2", "b", OPPO)).kind == "place"
    assert s.group_of("o2")[0].node == first
    s.check_invariants()


def test_unknown_vc_names_the_valid_ones_and_the_closest() -> None:
    s = HivedScheduler(load_cluster_config(FOUR_BY_FOUR.replace("  a:", "  vc1:").replace("  b:", "  vc2:")))
    with pytest.raises(ValidationError) as e:
        s.validate(req("x", "vc3", PROD))
    assert e.value.field == "defaults.virtualCluster"
    assert "unknown virtual cluster 'vc3'; did you mean 'vc1'? (valid: vc1, vc2)" in str(e.value)
    with pytest.raises(ValidationError) as e2:
        s.status("zzz")
    assert "(valid: vc1, vc2)" in str(e2.value) and "did you mean" not in str(e2.value)


# ---------------------------------------------------------------- property test against the rules


def _node_view(s: HivedScheduler) -> dict[str, dict[str, int]]:
    """Per node, from the public status only: leaf cells, used by opportunistic groups, used by
    guaranteed groups or reserved (``held``), free."""
    st_ = s.status()
    prio = {g: v["priority"] for g, v in st_["groups"].items()}
    reserved: dict[str, set[str]] = {}
    for r in st_["reservations"].values():
        for cell in r["cells"]:
            node, idx = cell.rsplit("/", 1)
            reserved.setdefault(node, set()).add(idx)
    used_cells: dict[str, set[str]] = {}
    for g in st_["groups"].values():
        for p in g["placements"]:
            used_cells.setdefault(p["node"], set()).update(str(i) for i in p["leafCells"])
    out = {}
    for node, row in st_["nodes"].items():
        oppo = sum(n for g, n in row["used"].items() if prio[g] < 0)
        guar = sum(n for g, n in row["used"].items() if prio[g] >= 0)
        res_free = len(reserved.get(node, set()) - used_cells.get(node, set()))
        out[node] = {
            "leaves": row["leafCells"],
            "oppo": oppo,
            "held": guar + res_free,
            "free": row["leafCells"] - oppo - guar - res_free,
            "healthy": int(row["healthy"]),
        }
    return out


submit = st.tuples(
    st.just("submit"),
    st.sampled_from(["a", "b"]),
    st.sampled_from([OPPO, OPPO, TEST, PROD]),
    st.integers(1, 2),  # instances
    st.sampled_from([1, 1, 2, 3, 4]),  # gpu
)
step = st.one_of(
    submit,
    submit,
    submit,
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("health"), st.sampled_from(["n1", "n2", "n3", "n4", "n5"]), st.booleans()),
)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([FIVE, FOUR_BY_FOUR]), st.lists(step, min_size=8, max_size=40))
@example(  # the reproduction: an opportunistic job once every node is bound
    FOUR_BY_FOUR,
    [("submit", "a", PROD, 1, 4), ("submit", "a", PROD, 1, 3), ("submit", "b", PROD, 1, 4),
     ("submit", "b", PROD, 1, 1), ("submit", "b", OPPO, 1, 1), ("submit", "a", PROD, 1, 1)],
)
@example(  # preemption of opportunistic and lower-priority work
    FOUR_BY_FOUR,
    [("submit", "a", OPPO, 2, 4), ("submit", "b", TEST, 1, 4), ("submit", "b", TEST, 1, 2),
     ("submit", "b", PROD, 2, 4), ("submit", "a", PROD, 1, 4)],
)
def test_random_sequences_follow_the_documented_rules(config: str, steps: list[tuple[Any, ...]]) -> None:
    s = HivedScheduler(load_cluster_config(config))
    order = list(s.nodes())  # config order
    running: list[str] = []
    waiting: dict[str, GroupRequest] = {}
    n = 0
    for op in steps:
        if op[0] == "submit":
            n += 1
            r = req(f"g{n}", op[1], op[2], instances=op[3], gpu=op[4])
            try:
                s.validate(r)
            except UserError:
                continue
            waiting[r.name] = r
        elif op[0] == "release" and running:
            name = running.pop(op[1] % len(running))
            s.release(name)
        elif op[0] == "health" and op[1] in order:
            s.set_node_health(op[1], op[2])
        for name, r in list(waiting.items()):
            before = _node_view(s)
            groups_before = {g: s.status()["groups"][g] for g in running}
            d = s.schedule(r)
            if d.kind == "place":
                if r.opportunistic and len(d.placements) == 1:
                    need = len(d.placements[0].leaf_cell_indices)
                    room = {node: v for node, v in before.items() if v["healthy"] and v["free"] >= need}
                    chosen = d.placements[0].node
                    # every VC cell of this config is one node, bound while it holds guaranteed work
                    unbound = {node: v for node, v in room.items() if v["held"] == 0}
                    event("opportunistic: unbound room" if unbound else "opportunistic: every node with room bound")
                    if unbound:  # cells no VC holds first, best fit
                        assert chosen in unbound and before[chosen]["free"] == min(v["free"] for v in unbound.values())
                    else:  # then HiveD's opportunistic node order
                        cands = [(-v["oppo"], v["held"], order.index(node)) for node, v in room.items()]
                        got = (-before[chosen]["oppo"], before[chosen]["held"], order.index(chosen))
                        assert got == min(cands), (chosen, before)
                s.allocate(name, r, d.placements)
                running.append(name)
                del waiting[name]
            elif d.kind == "preempt":
                assert not r.opportunistic, "opportunistic groups never preempt"
                for v in d.victims:
                    g = groups_before[v]
                    # only opportunistic groups and lower priorities of the preemptor's own VC
                    assert g["priority"] < 0 or (g["vc"] == r.virtual_cluster and g["priority"] < r.priority), v
                assert d.victims and len(set(d.victims)) == len(d.victims)
                event("preempt")
                for v in d.victims:  # the control plane stops them
                    s.release(v)
                    running.remove(v)
            s.check_invariants()
        status = s.status()
        for vc, row in status["virtualClusters"].items():
            assert 0 <= row["used"] + row["reserved"] <= row["quota"], (vc, row)
        cells: dict[tuple[str, int], str] = {}
        for g, row in status["groups"].items():
            for p in row["placements"]:
                for i in p["leafCells"]:
                    assert (p["node"], i) not in cells, (p["node"], i, g)
                    cells[(p["node"], i)] = g
