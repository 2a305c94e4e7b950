"""Decisions where Apiary disagreed with HiveD's own algorithm (microsoft/hivedscheduler, pkg/algorithm)
on identical request streams, pinned down with the decision HiveD makes.

The cluster (``tests/sim/scenarios/hived-parity/cluster.yaml``): four 4-GPU nodes ``node-0..3``, VCs
``vc-a`` and ``vc-b`` with two ``NODE`` cells each. The same situations run end to end through
``apiary sim scenario`` in ``tests/sim/test_scenario_files.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.builders import healthy_scheduler

from apiary.scheduler import Decision, GroupRequest, HivedScheduler, TaskRequest

CLUSTER = Path(__file__).resolve().parents[1] / "sim" / "scenarios" / "hived-parity" / "cluster.yaml"
TEST, PROD, OPPO = 10, 100, -1


@pytest.fixture
def sched() -> HivedScheduler:
    return healthy_scheduler(CLUSTER)


def gang(name: str, vc: str, priority: int, instances: int, gpus: int) -> GroupRequest:
    return GroupRequest(name, vc, priority, True, (TaskRequest("train", instances, gpus, 1.0, 1024),))


def run(s: HivedScheduler, request: GroupRequest) -> Decision:
    """Schedule; commit a placement as the control plane would."""
    d = s.schedule(request)
    if d.kind == "place":
        s.allocate(request.name, request, d.placements)
    s.check_invariants()
    return d


def test_a_gang_preempts_a_lower_priority_job_of_its_vc_across_a_bound_and_an_unbound_cell(sched) -> None:
    """Section 1: job 4 needs vc-a's bound node (where the test job runs) plus vc-a's unbound cell.
    HiveD preempts the test job; Apiary used to answer wait and starve the prod gang."""
    s = sched
    assert run(s, gang("j1", "vc-a", TEST, 1, 2)).kind == "place"
    assert run(s, gang("j2", "vc-b", PROD, 1, 4)).kind == "place"
    assert run(s, gang("j3", "vc-b", TEST, 1, 4)).kind == "place"
    j1_node = s.group_of("j1")[0].node
    d = run(s, gang("j4", "vc-a", PROD, 2, 4))
    assert (d.kind, d.victims) == ("preempt", ("j1",))
    # The reservation holds vc-a's two nodes for j4: nobody else, even an equal-priority job, gets them.
    assert run(s, gang("j5", "vc-a", PROD, 1, 1)).kind == "wait"
    s.release("j1")
    d = run(s, gang("j4", "vc-a", PROD, 2, 4))
    assert d.kind == "place"
    nodes = sorted(p.node for p in d.placements)
    assert j1_node in nodes and len(set(nodes)) == 2
    assert {p.node for p in s.group_of("j2")} | {p.node for p in s.group_of("j3")} == set(s.nodes()) - set(nodes)


def test_binding_a_cell_preempts_the_cheapest_opportunistic_work(sched) -> None:
    """Section 2: vc-a must bind a second node; both free nodes run opportunistic jobs (3 and 2 GPUs).
    HiveD binds the one with fewer opportunistic GPUs in use and stops the 2-GPU job."""
    s = sched
    run(s, gang("a1", "vc-a", TEST, 1, 4))
    run(s, gang("b1", "vc-b", PROD, 1, 3))
    run(s, gang("b2", "vc-b", OPPO, 1, 3))
    run(s, gang("a2", "vc-a", OPPO, 1, 2))
    assert {p.node for p in s.group_of("b2")} != {p.node for p in s.group_of("a2")}
    d = run(s, gang("a3", "vc-a", TEST, 1, 3))
    assert (d.kind, d.victims) == ("preempt", ("a2",))


def test_among_equally_cheap_cells_the_most_recently_started_work_is_preempted(sched) -> None:
    """Two free nodes, each with one 3-GPU opportunistic job: the newer job goes (less work lost)."""
    s = sched
    run(s, gang("a1", "vc-a", TEST, 1, 4))
    run(s, gang("b1", "vc-b", PROD, 1, 4))
    run(s, gang("old", "vc-b", OPPO, 1, 3))
    run(s, gang("new", "vc-b", OPPO, 1, 3))
    assert {p.node for p in s.group_of("old")} != {p.node for p in s.group_of("new")}
    d = run(s, gang("a2", "vc-a", TEST, 1, 2))
    assert (d.kind, d.victims) == ("preempt", ("new",))


def test_victims_inside_the_vc_are_the_lowest_priority_then_the_most_recent(sched) -> None:
    """Victims by priority, then the most recently started first, whatever their names."""
    s = sched
    run(s, gang("a-old", "vc-a", TEST, 1, 3))
    run(s, gang("z-new", "vc-a", TEST, 1, 3))
    run(s, gang("b", "vc-b", PROD, 2, 4))
    assert {p.node for p in s.group_of("a-old")} != {p.node for p in s.group_of("z-new")}
    assert run(s, gang("p", "vc-a", PROD, 1, 4)).victims == ("z-new",)
    s.release("z-new")
    run(s, gang("p", "vc-a", PROD, 1, 4))
    run(s, gang("low", "vc-a", 5, 1, 1))  # beside a-old, and lower than it
    d = run(s, gang("p2", "vc-a", PROD, 1, 4))
    assert d.victims == ("low", "a-old")
