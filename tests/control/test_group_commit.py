"""Concurrent submissions share one transaction (apiary.control.intake), and each still gets its own
answer: its job, or the error that refused it alone.

The batch is formed for certain: the test holds the plane's lock, starts the submitting threads
(each parses and queues its job, then waits for the lock), polls until all are queued, and lets go.
Commits are counted on the engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pytest
from sqlalchemy import event
from tests.support.builders import job_text
from tests.support.plane import Harness

from apiary.errors import ConflictError, UnavailableError


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


def commits(h: Harness) -> list[int]:
    """A one-item list counting the engine's commits from now on."""
    n = [0]

    @event.listens_for(h.engine, "commit")
    def count(_conn) -> None:
        n[0] += 1

    return n


queued: list[str] = []  # the job ids in the order the last submit_together queued them


def submit_together(h: Harness, texts: list[tuple[str, str]], *, before_release: Callable[[], None] = lambda: None,
                    timeout_s: float = 30.0) -> list[dict | BaseException]:
    """Submit ``(text, user)`` pairs from one thread each while the test holds the plane's lock, so
    all are queued before any commit; returns each one's answer or error, in order."""
    out: list[dict | BaseException | None] = [None] * len(texts)

    def one(i: int, text: str, user: str) -> None:
        try:
            out[i] = h.plane.submit(text, user)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out[i] = e

    plane = h.plane
    queued.clear()
    threads = [threading.Thread(target=one, args=(i, t, u)) for i, (t, u) in enumerate(texts)]
    with plane.lock:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        while len(plane.jobs.intake) < len(texts):  # each has parsed its job and waits for the lock
            assert time.monotonic() < deadline, f"only {len(plane.jobs.intake)} of {len(texts)} queued"
            time.sleep(0.005)
        before_release()
        queued.extend(p.job_id for p in plane.jobs.intake.items())
    for t in threads:
        t.join(timeout_s)
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def test_queued_submissions_commit_in_one_transaction_each_with_its_answer(h: Harness) -> None:
    n = commits(h)
    texts = [(job_text(0, name=f"batch-{i}"), "alice") for i in range(5)]
    out = submit_together(h, texts)
    assert n[0] == 1  # one transaction for all five
    ids = [o["id"] for o in out if isinstance(o, dict)]
    assert ids == [f"alice~batch-{i}" for i in range(5)]  # each thread got its own job back
    for job_id in ids:  # durable and in memory
        assert h.job(job_id)["state"] == "WAITING"
        assert h.event_types(job_id) == ["job.submitted"]
    # FIFO among equals follows the order they were queued in (submit_seq), not thread start order.
    order = [j["id"] for j in h.plane.list_jobs() if j["id"].startswith("alice~batch-")]
    assert order == queued
    h.plane.check_consistency()
    h.cycle()
    assert h.task(ids[0])["node"] is not None  # the scheduler knows them (the first fits vc1)


def test_a_name_taken_twice_in_one_batch_refuses_only_the_second(h: Harness) -> None:
    texts = [(job_text(0, name="same"), "alice"), (job_text(0, name="other"), "alice"),
             (job_text(0, name="same"), "alice")]
    out = submit_together(h, texts)
    assert isinstance(out[0], dict) and isinstance(out[1], dict)
    assert isinstance(out[2], ConflictError)
    assert "Job name same already exists for user alice." in str(out[2].message)
    assert len(h.event_types("alice~same")) == 1


def test_a_name_already_in_the_store_refuses_only_that_submission(h: Harness) -> None:
    h.submit(0, name="taken")
    texts = [(job_text(0, name="new-1"), "alice"), (job_text(0, name="taken"), "alice"),
             (job_text(0, name="new-2"), "alice")]
    out = submit_together(h, texts)
    assert isinstance(out[1], ConflictError) and "Job name taken already exists" in out[1].message
    assert [o["id"] for o in (out[0], out[2]) if isinstance(o, dict)] == ["alice~new-1", "alice~new-2"]
    assert h.event_types("alice~taken") == ["job.submitted"]  # the first one is untouched
    h.plane.check_consistency()


def test_a_store_that_cannot_commit_refuses_the_whole_batch_and_applies_nothing(h: Harness) -> None:
    texts = [(job_text(0, name=f"lost-{i}"), "alice") for i in range(3)]
    out = submit_together(h, texts, before_release=lambda: setattr(h.fault, "failing", True))
    h.fault.failing = False
    assert all(isinstance(o, UnavailableError) for o in out)
    assert not [j for j in h.plane.list_jobs() if j["id"].startswith("alice~lost-")]
    h.plane.check_consistency()
    # Nothing was taken: the same names go in once the store accepts writes again.
    again = submit_together(h, texts)
    assert [o["id"] for o in again if isinstance(o, dict)] == [f"alice~lost-{i}" for i in range(3)]


@pytest.mark.parametrize(("config", "n"), [("two-vcs", 0), ("two-vcs", 4), ("one-vc", 6)])  # gang, oppo, 2 instances
def test_the_inserted_rows_load_back_as_the_record_the_reducer_made(tmp_path: Path, config: str, n: int) -> None:
    """insert_new_jobs writes rows without the ORM's unit of work: what it stored must read back
    (load_job) as exactly the record apiary.lifecycle.reducer.submit returned, every task too."""
    from apiary.lifecycle.reducer import job_policy, submit
    from apiary.spec.job import parse_job
    from apiary.store.records import load_job

    h = Harness(tmp_path, config)
    text = job_text(n, name=f"roundtrip-{n}")
    answer = h.plane.submit(text, "alice", flow_run_id="run-1")
    spec = parse_job(text)
    policy = job_policy(answer["id"], spec)
    expected, _ = submit(answer["id"], "alice", policy, h.clock(), name=spec.name,
                         priority_class=spec.priority_class, flow_run_id="run-1")
    with h.sessions() as s:
        loaded = load_job(s, answer["id"], h.plane.cache.policy_of)
    assert loaded is not None
    assert asdict(loaded.record) == asdict(expected)  # the records compare by identity: by fields here
    assert len(loaded.tasks) == len(expected.tasks) == (2 if n == 6 else 1)
    assert answer == h.job(answer["id"])  # the answer built from the inserted values is what a read says
