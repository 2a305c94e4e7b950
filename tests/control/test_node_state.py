"""Durable node state, derived once: faults, cordons and health survive a control-plane restart, and
the node list and the scheduler always agree (``check_consistency`` runs after every harness step)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tests.support.plane import CAROL, DAN, Harness

from apiary.control.nodes import MAX_QUEUED_FAULTS
from apiary.errors import TooManyRequestsError
from apiary.monitoring import NodeExporter
from apiary.runtime.agent import NodeAgent


@pytest.fixture
def h1(tmp_path: Path) -> Harness:
    return Harness(tmp_path, "one-vc")


def agent_for(node: str) -> NodeAgent:
    """A real NodeAgent (no HTTP made) with simulated GPUs, to apply queued faults as it would."""
    agent = NodeAgent(node, "http://127.0.0.1:9", backend=None, client=httpx.AsyncClient(),  # type: ignore[arg-type]
                      gpus=1, simulated_gpus=True)
    agent.exporter = NodeExporter(node, lambda: [], gpus=1, simulated=True)
    return agent


def dbe(agent: NodeAgent) -> float:
    return agent.exporter.simulated._faults[0].ecc_dbe  # type: ignore[union-attr]


def test_a_fault_injected_after_a_restart_is_applied(h1: Harness) -> None:
    h = h1
    agent = agent_for(DAN)
    first = h.plane.inject_fault(DAN, 0, ecc_dbe=1)
    agent._apply_faults(h.plane.node_faults(DAN))
    assert dbe(agent) == 1 and agent.faults.applied == first["id"]

    h = h.restart()  # the agent keeps running, with its high-water mark
    assert h.plane.node_faults(DAN) == [first]  # still queued: the agent has not reported it applied
    second = h.plane.inject_fault(DAN, 0, ecc_dbe=2)
    assert second["id"] > first["id"]  # ids never start again at 1
    agent._apply_faults(h.plane.node_faults(DAN))
    assert dbe(agent) == 3  # the new fault applied, the old one not twice


def test_applied_faults_leave_the_queue_and_the_queue_is_bounded(h1: Harness) -> None:
    h = h1
    ids = [h.plane.inject_fault(CAROL, 0, xid=79)["id"] for _ in range(3)]
    assert [f["id"] for f in h.plane.node_faults(CAROL)] == ids
    h.plane.node_report(CAROL, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=[],
                        faults_applied=ids[1])
    assert [f["id"] for f in h.plane.node_faults(CAROL)] == ids[2:]
    for _ in range(MAX_QUEUED_FAULTS - 1):
        h.plane.inject_fault(CAROL, 0, temp=90.0)
    with pytest.raises(TooManyRequestsError, match=CAROL):
        h.plane.inject_fault(CAROL, 0, temp=95.0)
    assert len(h.plane.node_faults(DAN)) == 0  # per node


def test_a_cordon_survives_a_restart(h1: Harness) -> None:
    h = h1
    h.plane.cordon(DAN)
    h = h.restart()
    nodes = {n["name"]: n for n in h.plane.list_nodes()}
    assert nodes[DAN]["cordoned"] is True and nodes[DAN]["schedulable"] is False
    h.report_all()  # heartbeats after the restart do not undo it either
    first = h.submit(0, user="alice", defaults__virtualCluster="default")
    second = h.submit(0, user="bob", defaults__virtualCluster="default")
    result = h.cycle()
    assert result.placed == [first] and h.task(first)["node"] == CAROL
    assert second in result.waiting
    h.plane.cordon(DAN, False)
    assert h.cycle().placed == [second] and h.task(second)["node"] == DAN


def test_node_list_and_scheduler_agree_after_recover(h1: Harness) -> None:
    h = h1
    h.plane.cordon(CAROL)
    h.tick(31)
    h.report(CAROL)  # DAN falls silent
    h.cycle()  # DAN is lost
    nodes = {n["name"]: n for n in h.plane.list_nodes()}
    assert (nodes[DAN]["healthy"], nodes[DAN]["schedulable"]) == (False, False)
    assert (nodes[CAROL]["healthy"], nodes[CAROL]["schedulable"]) == (True, False)
    for plane_ in (h.plane, h.restart().plane):
        plane_.recover()
        assert plane_.check_consistency() == []
        nodes = {n["name"]: n for n in plane_.list_nodes()}
        health = {n: v["healthy"] for n, v in plane_.cluster_status()["nodes"].items()}
        assert health == {n: v["schedulable"] for n, v in nodes.items()} == {CAROL: False, DAN: False}


def test_a_healthy_node_stays_schedulable_across_a_restart_until_it_is_lost(h1: Harness) -> None:
    """Like a Kubernetes node's Ready condition: kept across a restart, lost after the grace period."""
    h = h1.restart()
    assert {n["name"]: n["schedulable"] for n in h.plane.list_nodes()} == {CAROL: True, DAN: True}
    job = h.submit(0, user="alice", defaults__virtualCluster="default")
    assert h.cycle().placed == [job]
    h.tick(31)
    h.report(CAROL)
    h.cycle()
    assert {n["name"]: n["schedulable"] for n in h.plane.list_nodes()} == {CAROL: True, DAN: False}


def test_heartbeats_are_persisted_at_most_every_few_seconds(h1: Harness) -> None:
    from sqlalchemy import select

    from apiary.control.nodes import HEARTBEAT_PERSIST_S
    from apiary.store import Node

    def stored() -> float | None:
        with h1.sessions() as s:
            return s.scalar(select(Node.last_heartbeat).where(Node.name == CAROL))

    t0 = stored()
    commits = h1.fault.commits
    h1.tick(1)
    h1.report(CAROL)
    assert stored() == t0 and h1.fault.commits == commits  # memory only
    h1.tick(HEARTBEAT_PERSIST_S)
    h1.report(CAROL)
    assert stored() == h1.clock()


def test_a_report_with_runs_writes_the_runs_and_leaves_a_fresh_node_row_alone(h1: Harness) -> None:
    from sqlalchemy import select

    from apiary.control.nodes import HEARTBEAT_PERSIST_S
    from apiary.store import Node

    def stored() -> float | None:
        with h1.sessions() as s:
            return s.scalar(select(Node.last_heartbeat).where(Node.name == CAROL))

    job = h1.submit(0, **{"defaults.virtualCluster": "default"})
    h1.cycle()
    assert h1.task(job)["node"] == CAROL  # the one-vc config's first node
    (a,) = h1.plane.assignments(CAROL)
    t0 = stored()
    h1.tick(1)
    h1.report(CAROL, [h1.status(a["runId"], "running")])
    assert h1.task(job)["state"] == "RUNNING"  # the run is recorded...
    assert stored() == t0  # ...the node's row, which says the same, is not rewritten
    h1.tick(HEARTBEAT_PERSIST_S)
    h1.report(CAROL, [h1.status(a["runId"], "exited", 0)])
    assert h1.job(job)["state"] == "SUCCEEDED" and stored() == h1.clock()  # due again: written with the runs


def test_a_wall_clock_step_does_not_declare_a_silent_node_lost(tmp_path: Path) -> None:
    """Node loss is measured on the monotonic clock under the wall clock: an NTP step of the wall
    clock by an hour declares no node lost (its agent, counting on its own monotonic clock, has not
    fenced its runs), while real silence past the grace does."""
    import time

    from tests.support.plane import LAB6

    from apiary.control.plane import ControlPlane
    from apiary.spec.cluster import load_cluster_config
    from apiary.store import make_engine, migrate, session_factory

    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs", clock=time.time, node_lost_after_s=30.0)
    for node in (CAROL, DAN):
        plane.node_report(node, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=[])
    stepped = time.time() + 3600.0
    plane.cache.clock = lambda: stepped  # the wall clock jumps an hour ahead
    plane.nodes.check_lost_nodes()
    assert {n["name"]: n["healthy"] for n in plane.list_nodes()} == {CAROL: True, DAN: True}
    plane.cache.heard[DAN] -= 31.0  # DAN really silent past the grace (the monotonic clock's view)
    plane.nodes.check_lost_nodes()
    assert {n["name"]: n["healthy"] for n in plane.list_nodes()} == {CAROL: True, DAN: False}
    engine.dispose()


def test_the_long_poll_carries_the_faults_queued_before_a_restart_and_after(h1: Harness) -> None:
    """The poll reads a node's faults only for nodes that may have some (the plane's ``faulted``,
    read from the store at recovery): a fault queued before a restart still reaches its agent, one
    queued after reaches it at once, and a node without any gets none."""
    h = h1
    first = h.plane.inject_fault(DAN, 0, ecc_dbe=1)
    assert h.plane.assignments_answer(DAN)["faults"] == [first]
    h = h.restart()
    assert h.plane.cache.faulted == {DAN}
    assert h.plane.assignments_answer(DAN)["faults"] == [first]
    assert h.plane.assignments_answer(CAROL)["faults"] == []
    second = h.plane.inject_fault(CAROL, 0, xid=79)
    assert h.plane.assignments_answer(CAROL)["faults"] == [second]
