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
    monkeypatch.setattr(h.plane.agents, "assignments", lambda node, s=None: reads.append(node) or real(node, s))
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


def test_a_long_polls_answer_reads_runs_and_faults_in_one_session(h: Harness,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    h.plane.inject_fault(CAROL, 0, xid=79)
    job = h.submit(0, **{"defaults.virtualCluster": "default"})
    h.cycle()
    assert h.task(job)["node"] == CAROL
    opened: list[object] = []
    real = h.plane.cache.sessions
    monkeypatch.setattr(h.plane.cache, "sessions", lambda: opened.append(1) or real())
    answer = h.plane.assignments_answer(CAROL)
    assert [a["desired"] for a in answer["assignments"]] == ["RUN"] and len(answer["faults"]) == 1
    assert len(opened) == 1  # not a session for the runs and another for the faults


def test_a_running_tasks_output_is_stored_without_a_write_transaction(h: Harness,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    job = h.submit(0, **{"defaults.virtualCluster": "default"})
    h.cycle()
    run_id = h.plane.assignments_answer(CAROL)["assignments"][0]["runId"]
    h.report(CAROL, [h.status(run_id, "running")])
    works: list[str] = []
    real = h.plane.cache.work
    monkeypatch.setattr(h.plane.cache, "work", lambda why: works.append(why) or real(why))
    chunk = [(run_id, "stdout", 0, b"epoch 1\n")]
    answer = h.plane.node_report(CAROL, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=[],
                                 logs=chunk)
    assert answer == {"ack": [], "logs": [8]} and works == []  # read where the run is, write no row
    assert h.plane.read_logs(job) == "epoch 1\n"
    answer = h.plane.node_report(DAN, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=[],
                                 logs=[(run_id, "stdout", 8, b"forged\n")])
    assert answer == {"ack": [], "logs": [None]} and h.plane.read_logs(job) == "epoch 1\n"  # not DAN's run


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


def queue_reports(h: Harness, reports: list[tuple[str, str]]) -> tuple[list[threading.Thread], dict]:
    """Start one thread per ``(node, address)`` report while the caller holds the plane's lock, and
    wait until all are queued for the group commit. Returns the threads and ``{index: answer or error}``."""
    out: dict[int, object] = {}

    def send(i: int, node: str, address: str) -> None:
        try:
            out[i] = h.plane.node_report(node, gpus=1, simulated_gpus=True, address=address, agent_id="t", runs=[])
        except Exception as e:
            out[i] = e

    threads = []
    for i, (node, address) in enumerate(reports):
        threads.append(threading.Thread(target=send, args=(i, node, address)))
        threads[-1].start()
        for _ in range(200):  # queued in order, so a node's second report comes after its first
            if len(h.plane.nodes.reports) == i + 1:
                break
            threads[-1].join(0.02)
    assert len(h.plane.nodes.reports) == len(reports)
    return threads, out


def stored_address(h: Harness, node: str) -> str | None:
    from sqlalchemy import select

    from apiary.store import Node

    with h.sessions() as s:
        return s.scalar(select(Node.address).where(Node.name == node))


def test_reports_queued_behind_the_lock_share_one_commit_and_a_nodes_second_report_the_next(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    works: list[str] = []
    real = h.plane.cache.work
    monkeypatch.setattr(h.plane.cache, "work", lambda why: works.append(why) or real(why))
    with h.plane.cache.lock:  # a cycle holds it while three reports with new facts arrive
        threads, out = queue_reports(h, [(CAROL, "198.18.0.7"), (DAN, "198.18.0.8"), (CAROL, "198.18.0.9")])
    for t in threads:
        t.join(10)
    assert out == {0: {"ack": []}, 1: {"ack": []}, 2: {"ack": []}}
    assert works.count("node report") == 2  # CAROL and DAN together, then CAROL's second report alone
    assert stored_address(h, CAROL) == "198.18.0.9" and stored_address(h, DAN) == "198.18.0.8"
    assert len(h.plane.nodes.reports) == 0


def test_a_report_that_fails_in_a_batch_is_refused_alone(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    real = h.plane.nodes._write_report

    def write(w, p, *args):
        if p.node == DAN:
            raise ValueError("DAN's report is bad")
        return real(w, p, *args)

    monkeypatch.setattr(h.plane.nodes, "_write_report", write)
    with h.plane.cache.lock:
        threads, out = queue_reports(h, [(CAROL, "198.18.0.7"), (DAN, "198.18.0.8")])
    for t in threads:
        t.join(10)
    assert out[0] == {"ack": []} and isinstance(out[1], ValueError)
    assert stored_address(h, CAROL) == "198.18.0.7" and stored_address(h, DAN) != "198.18.0.8"


def test_an_idle_nodes_kept_answer_is_read_without_the_store_until_its_generation_moves(h: Harness) -> None:
    assert h.plane.kept_assignments(CAROL) is None  # nothing kept yet: the poll takes a worker thread
    first = h.plane.assignments_answer(CAROL)
    assert h.plane.kept_assignments(CAROL) == first
    h.plane.inject_fault(CAROL, 0, xid=79)  # bumps the generation
    assert h.plane.kept_assignments(CAROL) is None
