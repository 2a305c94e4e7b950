"""A waiting job is not asked again while nothing changed, and is asked at once when something did.

The scheduling cycle remembers each plain "wait" with a version of the scheduler's state (applied
allocations and releases, node health, reservations, rebuilds, configs bump it). These tests count
the scheduler's ``schedule`` calls and check that every change that can free cells for a waiting
job (a run that exits, a node uncordoned or healthy again, a restart) still gets it placed on the
next cycle; and that many first wait reasons committed together each get their reason and event.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.builders import job_text
from tests.support.plane import DAN, Harness


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


def counting(h: Harness) -> list[str]:
    """Record the job of every ``schedule`` call of the plane's current scheduler."""
    calls: list[str] = []
    sched = h.plane.scheduler
    inner = sched.schedule

    def schedule(request):
        calls.append(request.name)
        return inner(request)

    sched.schedule = schedule  # type: ignore[method-assign]
    return calls


def test_a_waiting_job_is_asked_once_then_again_when_its_cells_free(h: Harness) -> None:
    first = h.submit(0, name="holder")  # vc1 = hostname-dan, one GPU
    h.cycle()
    h.start(first)
    waiting = h.submit(0, name="waiter")
    calls = counting(h)
    h.cycle()
    assert calls == [waiting] and h.job(waiting)["state"] == "WAITING"
    reason = h.job(waiting)["waitingReason"]
    for _ in range(5):
        h.tick(1)
        h.cycle()
    assert calls == [waiting]  # nothing changed: the remembered answer
    assert h.job(waiting)["waitingReason"] == reason
    h.exit(first, 0)
    h.cycle()
    assert h.task(waiting)["node"] == DAN and len(calls) == 2


def test_uncordoning_the_node_places_the_waiting_job(h: Harness) -> None:
    h.plane.cordon(DAN, True)
    job = h.submit(0)
    h.cycle()
    h.cycle()
    assert h.task(job)["node"] is None
    h.plane.cordon(DAN, False)
    h.cycle()
    assert h.task(job)["node"] == DAN


def test_a_node_healthy_again_places_the_waiting_job(tmp_path: Path) -> None:
    h = Harness(tmp_path, report_nodes=False)
    h.report_all(except_=[DAN])
    job = h.submit(0)
    h.cycle()
    h.cycle()
    assert h.task(job)["node"] is None
    h.report(DAN)
    h.cycle()
    assert h.task(job)["node"] == DAN


def test_a_restarted_plane_asks_every_waiting_job_again(h: Harness) -> None:
    holder = h.submit(0, name="holder")
    h.cycle()
    h.start(holder)
    waiting = h.submit(0, name="waiter")
    h.cycle()
    h2 = h.restart()
    h2.report_all()
    calls = counting(h2)
    h2.cycle()
    assert waiting in calls


def test_many_first_wait_reasons_each_get_their_reason_and_one_event(h: Harness) -> None:
    holder = h.submit(0, name="holder")
    h.cycle()
    h.start(holder)
    jobs = [h.plane.submit(job_text(0, name=f"w{i:02d}"), "bob")["id"] for i in range(70)]  # > 2 batches
    h.cycle()
    for job in jobs:
        j = h.job(job)
        assert j["state"] == "WAITING" and j["waitingReason"], job
        assert len(h.events(job, "job.waiting")) >= 1


def test_a_submission_hands_the_cycle_the_head_the_store_would_give(h: Harness) -> None:
    """The snapshot takes a new job's head from its submission (PlaneCache.submitted) instead of
    reading the rows back: it must be exactly what the store's query reads, order key included."""
    holder = h.submit(0, name="holder")
    h.cycle()
    h.start(holder)
    two_roles = job_text(6, name="roles", extras__gangAllocation=False, taskRoles__eval={
        "instances": 3, "dockerImage": "pytorch_example", "resourcePerInstance": {"cpu": 1, "memoryMB": 512, "gpu": 1},
        "commands": ["true"]})
    ids = [h.plane.submit(two_roles, "bob")["id"], h.plane.submit(job_text(3, name="prod"), "bob")["id"],
           *(h.plane.submit(job_text(0, name=f"w{i}"), "bob")["id"] for i in range(3))]
    cache, cycle = h.plane.cache, h.plane.scheduling
    with cache.lock:
        handed = {j: cache.submitted[j] for j in ids}
        with h.sessions() as s:
            stored = cycle._heads(s, ids)
    assert {j: (e.order, e.pending, e.reason) for j, e in handed.items()} == {
        j: (order, head.pending, head.reason) for j, (order, head) in stored.items()}
    assert all(head.attempt == 0 for _, head in stored.values())
    assert len(handed[ids[0]].pending) == 5  # train x 2, eval x 3
    h.cycle()
    assert cache.submitted == {}  # consumed by the snapshot
    for job in ids:
        assert h.job(job)["waitingReason"] != "Waiting for the next scheduling cycle."


def test_a_job_changed_after_its_submission_is_read_from_the_store(h: Harness) -> None:
    holder = h.submit(0, name="holder")
    h.cycle()
    h.start(holder)
    job = h.submit(0, name="stopped-at-once")
    assert job in h.plane.cache.submitted
    h.plane.stop(job)
    assert job not in h.plane.cache.submitted  # the stop's commit dropped the submission's head
    calls = counting(h)
    h.cycle()
    assert job not in calls and h.job(job)["state"] == "STOPPED"
