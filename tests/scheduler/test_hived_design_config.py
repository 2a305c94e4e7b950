"""HivedScheduler on HiveD's own design config (``hived_design/hivedscheduler.yaml``, unmodified):
nodes in several chains and the GPU addresses the config gives."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.builders import healthy_scheduler

from apiary.scheduler import GroupRequest, HivedScheduler, TaskRequest

DESIGN = Path(__file__).resolve().parent / "hived_design" / "hivedscheduler.yaml"


@pytest.fixture
def sched() -> HivedScheduler:
    return healthy_scheduler(DESIGN)


def pod(name: str, vc: str, sku: str, gpus: int, priority: int = 1) -> GroupRequest:
    return GroupRequest(name, vc, priority, True, (TaskRequest("p", 1, gpus, 0.0, 0, sku_type=sku),))


def test_a_node_in_two_chains_is_one_node_with_both_leaf_types(sched) -> None:
    info = sched.nodes()["1.0.0.2"]
    assert (info.leaf_cells, info.gpus, info.sku_type) == (10, 10, "CT1+DGX1-P100")
    # Its CT1 GPUs are 8 and 9 (the config's addresses), its P100 GPUs 0-7 (defaults).
    d = sched.schedule(pod("ct1", "VC2", "CT1", 2))
    assert d.kind == "place"
    assert {(p.node, p.gpus) for p in d.placements} <= {("0.0.0.0", (0, 1)), ("0.0.0.1", (0, 1)), ("1.0.0.2", (8, 9))}
    sched.set_node_health("1.0.0.2", False)
    assert sched.status()["nodes"]["1.0.0.2"]["healthy"] is False


def test_a_task_gets_the_gpu_addresses_the_config_gives_and_whole_sub_cells(sched) -> None:
    """1.0.0.0 lists its sockets and switches out of order with explicit GPU addresses: a 7-GPU pod
    gets socket 1 (GPUs 1, 3, 4, 7) plus three GPUs of socket 0 in tree order (0, 2, 6), as HiveD
    gives; numbering the leaves in tree order would have said GPUs 0-6."""
    for other in ("1.0.0.1", "1.0.0.2"):
        sched.set_node_health(other, False)
    d = sched.schedule(pod("p7", "VC2", "DGX1-P100", 7))
    assert d.kind == "place", d.reason
    (p,) = d.placements
    assert p.node == "1.0.0.0" and sorted(p.gpus) == [0, 1, 2, 3, 4, 6, 7]
    sched.allocate("p7", pod("p7", "VC2", "DGX1-P100", 7), d.placements)
    sched.check_invariants()
