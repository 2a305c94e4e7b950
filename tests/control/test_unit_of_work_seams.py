"""The plane's one commit path: a :class:`~apiary.control.work.Work` applies what it committed once,
applies nothing and rebuilds when the store refuses, and leaves no trace when it is not committed;
the intake's batch commits through a unit of work and forgets nothing but what failed.

The store is real (SQLite); :class:`tests.support.plane.FlakySession` makes chosen commits fail the
way a full disk makes SQLite fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select
from tests.support.builders import job_text
from tests.support.plane import CAROL, Harness

from apiary.control.work import Committed, NodeHealth, Work
from apiary.errors import UnavailableError
from apiary.lifecycle.reducer import StopRequested
from apiary.store.models import Job, NodeFault

DISK_FULL = "database or disk is full"


class Recorder:
    """Stands in for the plane's cache: what was applied, how often it was rebuilt."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.applied: list[Committed] = []
        self.rebuilds = 0

    def apply(self, change: Committed) -> None:
        self.applied.append(change)

    def rebuild(self) -> None:
        self.rebuilds += 1

    def work(self, what: str = "test") -> Work:
        return Work(self.h.sessions, what, self.h.clock(), policy_of=self.h.plane.cache.policy_of,
                    apply=self.apply, rebuild=self.rebuild)


def _faults(h: Harness) -> int:
    with h.sessions() as s:
        return s.scalar(select(func.count()).select_from(NodeFault)) or 0


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path, "one-vc")


def test_a_committed_work_is_applied_once_with_what_it_changed(h: Harness) -> None:
    job = h.submit(0, user="alice", defaults__virtualCluster="default")
    rec = Recorder(h)
    with rec.work() as w:
        w.node_health(CAROL, False)
        w.touched.add(CAROL)
        w.step(job, StopRequested())
        w.commit()
        assert len(rec.applied) == 1  # at the commit, not at the block's end
    assert rec.rebuilds == 0 and len(rec.applied) == 1
    change = rec.applied[0]
    assert NodeHealth(CAROL, False) in change.ops and change.touched == {CAROL} and job in change.jobs
    assert change.wake
    assert h.plane.get_job(job)["executionType"] == "STOP"  # the step's record was written and committed


def test_a_refused_commit_applies_nothing_writes_nothing_and_rebuilds(h: Harness) -> None:
    job = h.submit(0, user="alice", defaults__virtualCluster="default")
    rec = Recorder(h)
    h.fault.failing = True
    with pytest.raises(UnavailableError, match=DISK_FULL), rec.work() as w:
        w.s.add(NodeFault(node=CAROL, gpu=0, fault={"xid": 79}, created=h.clock()))
        w.step(job, StopRequested())
        w.node_health(CAROL, False)
        w.commit()
    h.fault.failing = False
    assert rec.applied == [] and rec.rebuilds == 1
    assert _faults(h) == 0 and h.plane.get_job(job)["executionType"] == "START"


def test_a_work_left_without_commit_writes_and_applies_nothing(h: Harness) -> None:
    job = h.submit(0, user="alice", defaults__virtualCluster="default")
    rec = Recorder(h)
    with rec.work() as w:
        w.s.add(NodeFault(node=CAROL, gpu=0, fault={"xid": 79}, created=h.clock()))
        w.step(job, StopRequested())
    assert rec.applied == [] and rec.rebuilds == 0
    assert _faults(h) == 0 and h.plane.get_job(job)["executionType"] == "START"


def test_an_exception_inside_a_work_before_its_commit_rolls_back_without_a_rebuild(h: Harness) -> None:
    rec = Recorder(h)
    with pytest.raises(RuntimeError, match="refused"), rec.work() as w:
        w.s.add(NodeFault(node=CAROL, gpu=0, fault={"xid": 79}, created=h.clock()))
        raise RuntimeError("refused")
    assert rec.applied == [] and rec.rebuilds == 0 and _faults(h) == 0


def test_a_refused_submission_batch_is_not_accepted_and_the_next_one_numbers_on(h: Harness) -> None:
    first = h.submit(0, user="alice", defaults__virtualCluster="default")
    h.fault.failing = True
    with pytest.raises(UnavailableError, match=DISK_FULL):
        h.plane.submit(job_text(0, name="lost", **{"defaults.virtualCluster": "default"}), "bob")
    h.fault.failing = False
    with h.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 1  # nothing of the batch is stored
    assert h.cycle().placed == [first]  # and nothing of it is queued in memory either
    second = h.plane.submit(job_text(0, name="lost", **{"defaults.virtualCluster": "default"}), "bob")["id"]
    with h.sessions() as s:
        seqs = {j: n for j, n in s.execute(select(Job.id, Job.submit_seq))}
    assert seqs[second] == seqs[first] + 1  # the refused batch's arrival number is free again
    assert h.plane.check_consistency() == []
