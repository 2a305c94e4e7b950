"""What keeps a control plane answering thousands of agents: a bare heartbeat never waits for the
plane's lock, an idle node's long poll is answered from memory per generation, and a node found
lost is not read from the store again every cycle."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tests.support.plane import CAROL, DAN, Harness

from apiary.control.nodes import HEARTBEAT_PERSIST_S


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path, "one-vc")


def beat(h: Harness, node: str, **changes) -> bool:
    facts = {"gpus": 1, "simulated_gpus": True, "address": "127.0.0.1", "agent_id": "t", **changes}
    return h.plane.bare_heartbeat(node, **facts)


def test_a_bare_heartbeat_is_taken_while_another_thread_holds_the_plane_lock(h: Harness) -> None:
    heard = h.plane.cache.heard[CAROL]
    h.tick(1)
    taken: list[bool] = []
    with h.plane.cache.lock:  # a scheduling cycle or a commit holds it
        t = threading.Thread(target=lambda: taken.append(beat(h, CAROL)))
        t.start()
        t.join(10)
        assert not t.is_alive() and taken == [True]  # answered without waiting for the lock
    assert h.plane.cache.heartbeats[CAROL] == h.clock()
    assert h.plane.cache.heard[CAROL] >= heard


def stored_beat(h: Harness, node: str) -> float | None:
    from sqlalchemy import select

    from apiary.store import Node

    with h.sessions() as s:
        return s.scalar(select(Node.last_heartbeat).where(Node.name == node))


def test_a_heartbeat_that_changes_a_stored_fact_goes_through_the_store(h: Harness) -> None:
    commits = h.fault.commits
    assert beat(h, CAROL)
    assert h.fault.commits == commits  # memory only
    assert not beat(h, CAROL, address="198.18.0.9")  # a new address: the node's row must say it
    assert not beat(h, CAROL, faults_applied=4)  # newly applied faults leave the store's queue
    h.tick(HEARTBEAT_PERSIST_S)
    assert beat(h, CAROL)  # the stored time is due, yet the beat stays in memory: the batch writes it
    assert h.fault.commits == commits
    assert h.plane.nodes.persist_heartbeats() == 1  # CAROL's only: DAN has not beaten since
    assert stored_beat(h, CAROL) == h.clock() and h.fault.commits == commits + 1
    assert h.plane.nodes.persist_heartbeats() == 0
    h.tick(h.node_lost_after_s + 1)
    h.report(CAROL)
    h.cycle()  # DAN is lost
    assert not beat(h, DAN)  # an unhealthy node's report makes it healthy again: a write


def test_an_idle_nodes_long_poll_reads_the_store_once_per_generation(h: Harness,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    real = h.plane.agents.assignments
    monkeypatch.setattr(h.plane.agents, "assignments", lambda node: reads.append(node) or real(node))
    first = h.plane.assignments_answer(CAROL)
    assert first["assignments"] == [] and reads == [CAROL]
    assert h.plane.assignments_answer(CAROL) == first and reads == [CAROL]  # kept: no store read

    fault = h.plane.inject_fault(CAROL, 0, xid=79)  # a queued fault bumps the generation
    answer = h.plane.assignments_answer(CAROL)
    assert answer["generation"] > first["generation"] and [f["id"] for f in answer["faults"]] == [fault["id"]]

    job = h.submit(0, **{"defaults.virtualCluster": "default"})
    h.cycle()  # placed on CAROL: the placement bumps the generation
    assert h.task(job)["node"] == CAROL
    busy = h.plane.assignments_answer(CAROL)
    assert [a["desired"] for a in busy["assignments"]] == ["RUN"]
    run_id = busy["assignments"][0]["runId"]
    n = len(reads)
    h.plane.assignments_answer(CAROL)
    assert len(reads) == n + 1  # an answer with runs is read afresh every time

    h.report(CAROL, [h.status(run_id, "exited", 0)])  # the run ends without a new generation
    assert h.job(job)["state"] == "SUCCEEDED"
    assert h.plane.assignments_answer(CAROL)["assignments"] == []  # never the kept answer with the run


def test_a_lost_node_is_read_from_the_store_once(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    works: list[str] = []
    real = h.plane.cache.work
    monkeypatch.setattr(h.plane.cache, "work", lambda why: works.append(why) or real(why))
    h.tick(h.node_lost_after_s + 1)
    h.report(CAROL)  # DAN falls silent
    h.plane.nodes.check_lost_nodes()
    assert works.count("node lost") == 1
    assert {n["name"]: n["healthy"] for n in h.plane.list_nodes()}[DAN] is False
    for _ in range(3):
        h.tick(1)
        h.plane.nodes.check_lost_nodes()
    assert works.count("node lost") == 1  # settled: nothing more to do until DAN reports

    h.report(DAN)  # back, then silent again past the grace: lost once more
    assert {n["name"]: n["healthy"] for n in h.plane.list_nodes()}[DAN] is True
    h.tick(h.node_lost_after_s + 1)
    h.report(CAROL)
    h.plane.nodes.check_lost_nodes()
    assert works.count("node lost") == 2
    assert {n["name"]: n["healthy"] for n in h.plane.list_nodes()}[DAN] is False


def test_a_report_waiting_for_the_lock_already_counts_as_heard(h: Harness) -> None:
    h.tick(h.node_lost_after_s + 1)
    before = h.plane.cache.heard[DAN]
    with h.plane.cache.lock:  # a long commit holds it; DAN's report (a new address: a write) waits
        t = threading.Thread(target=lambda: h.plane.node_report(
            DAN, gpus=1, simulated_gpus=True, address="198.18.0.9", agent_id="t", runs=[]))
        t.start()
        deadline = 100
        while h.plane.cache.heard[DAN] == before and deadline:
            t.join(0.05)
            deadline -= 1
        assert h.plane.cache.heard[DAN] > before and t.is_alive()  # heard, still waiting
        h.report(CAROL)
    t.join(10)
    h.plane.nodes.check_lost_nodes()
    assert {n["name"]: n["healthy"] for n in h.plane.list_nodes()}[DAN] is True
