"""A VC owning cells of two chains with one sku (a pool of 8-GPU nodes and a pool of 2-GPU nodes).

Regression: binding virtual cells for a multi-node gang used to take the 2-GPU pool's cells first (the
chain names sort before), spending the search's bindings on cells no 8-GPU task can use, so a gang of
3+ 8-GPU tasks waited on an empty cluster although its VC had enough free 8-GPU nodes.
"""

from __future__ import annotations

import pytest

from apiary.scheduler import GroupRequest, HivedScheduler, TaskRequest
from apiary.sim.cluster import Machine, machines_to_cluster

# (8-GPU nodes, 2-GPU nodes, quotas {vc: {node GPUs: cells}})
POOLS = {
    "even": (10, 10, {"a": {8: 5, 2: 5}, "b": {8: 5, 2: 5}}),
    "many-small": (10, 40, {"a": {8: 5, 2: 20}, "b": {8: 5, 2: 20}}),
    "uneven": (12, 30, {"a": {8: 5, 2: 25}, "b": {8: 7, 2: 5}}),
    "few-small": (10, 4, {"a": {8: 5, 2: 2}, "b": {8: 5, 2: 2}}),
}


def _scheduler(pool: str) -> tuple[HivedScheduler, dict[str, dict[int, int]]]:
    n8, n2, quotas = POOLS[pool]
    ms = [Machine(f"m{i}", 8) for i in range(n8)] + [Machine(f"s{i}", 2) for i in range(n2)]
    return HivedScheduler(machines_to_cluster(ms, quotas)), quotas


def _gang(name: str, vc: str, tasks: int, gpus: int = 8) -> GroupRequest:
    return GroupRequest(name, vc, 100, True, (TaskRequest("train", tasks, gpus, 0.0, 0),))


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("vc", ["a", "b"])
@pytest.mark.parametrize("tasks", [2, 3, 4, 5])
def test_big_gang_uses_big_nodes(pool: str, vc: str, tasks: int) -> None:
    s, _ = _scheduler(pool)
    req = _gang("j", vc, tasks)
    d = s.schedule(req)
    assert d.kind == "place", d.reason
    nodes = [p.node for p in d.placements]
    assert len(nodes) == tasks and len(set(nodes)) == tasks
    assert all(n.startswith("m") and len(p.leaf_cell_indices) == 8 for p in d.placements for n in [p.node])
    s.check_invariants()  # schedule leaves no tentative binding behind
    assert s.status(vc)["virtualClusters"][vc]["used"] == 0
    s.allocate("j", req, d.placements)
    s.check_invariants()
    st = s.status(vc)["virtualClusters"][vc]
    assert st["used"] == 8 * tasks
    assert st["cells"]["POOL-8GPU/2"]["bound"] == tasks
    assert st["cells"]["POOL-2GPU/2"]["bound"] == 0


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_both_vcs_fill_their_big_nodes(pool: str) -> None:
    s, quotas = _scheduler(pool)
    for vc in ("a", "b"):
        n = quotas[vc][8]
        req = _gang(f"{vc}-all", vc, n)
        d = s.schedule(req)
        assert d.kind == "place", d.reason
        s.allocate(req.name, req, d.placements)
        s.check_invariants()
        # one more 8-GPU task does not fit: the VC's 2-GPU cells cannot hold it
        more = _gang(f"{vc}-more", vc, 1)
        assert s.schedule(more).kind == "wait"
        s.check_invariants()
    s.release("a-all")
    s.check_invariants()
    assert s.status("a")["virtualClusters"]["a"]["used"] == 0


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("vc", ["a", "b"])
def test_gang_larger_than_big_pool_waits_without_leftovers(pool: str, vc: str) -> None:
    s, quotas = _scheduler(pool)
    n = quotas[vc][8] + 1
    if 8 * n > 8 * quotas[vc][8] + 2 * quotas[vc][2]:
        pytest.skip("rejected by quota, not a placement question")
    d = s.schedule(_gang("j", vc, n))
    assert d.kind == "wait"
    s.check_invariants()
    assert all(c["bound"] == 0 for c in s.status(vc)["virtualClusters"][vc]["cells"].values())


@pytest.mark.parametrize("vc", ["a", "b"])
def test_a_gang_stays_in_one_chain_and_an_incremental_job_uses_both_pools(vc: str) -> None:
    """HiveD schedules a group inside one chain's cells: a gang of 8-GPU and 2-GPU tasks that no single
    pool can hold waits (it used to be split over the two pools); without gang allocation the same
    tasks run in both pools."""
    s, quotas = _scheduler("even")
    n8 = quotas[vc][8]
    tasks = (TaskRequest("big", n8, 8, 0.0, 0), TaskRequest("small", 3, 2, 0.0, 0))
    d = s.schedule(GroupRequest("mix", vc, 100, True, tasks))
    assert d.kind == "wait", [p.node for p in d.placements]
    s.check_invariants()
    req = GroupRequest("mix", vc, 100, False, tasks)
    d = s.schedule(req)
    assert d.kind == "place", d.reason
    big = [p for p in d.placements if p.task_role == "big"]
    small = [p for p in d.placements if p.task_role == "small"]
    assert len({p.node for p in big}) == n8 and all(p.node.startswith("m") for p in big)
    assert len(small) == 3 and all(p.node.startswith("s") for p in small)
    s.allocate("mix", req, d.placements)
    s.check_invariants()
