"""``load_jobs`` / ``write_jobs``: a job's rows read as values and written back with Core.

Only the columns a step changed are written (a row nothing changed gets no UPDATE), new rows are
inserted, a placement allocated and released in the same transaction is stored released, and a
job written once in a transaction refuses a second write (its stored values are stale by then).
On SQLite here and on PostgreSQL with the ``postgres`` mark.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import event, select
from tests.support.builders import job_text

from apiary.control import ControlPlane
from apiary.lifecycle.reducer import Allocate, Release
from apiary.scheduler.types import TaskPlacement
from apiary.spec.cluster import load_cluster_config
from apiary.store import Job, Placement, Task, make_engine, migrate, session_factory
from apiary.store.records import load_jobs, write_jobs
from apiary.store.unit import UnitOfWork

LAB6 = Path(__file__).resolve().parents[2] / "examples" / "lab6"


def _check(url: str, logs: Path) -> None:
    engine = make_engine(url)
    migrate(engine)
    sessions = session_factory(engine)
    plane = ControlPlane(sessions, load_cluster_config(LAB6 / "hived-config-one-vc.yaml"), logs, clock=lambda: 100.0)
    statements: list[str] = []
    try:
        ids = [plane.submit(job_text(6, name=f"c{i}"), "bob")["id"] for i in range(2)]
        policy_of = plane.cache.policy_of
        event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2].split()[0].upper()))
        with UnitOfWork(sessions, "test") as uow:
            loaded = load_jobs(uow.s, [*ids, "bob~nobody"], policy_of)
            assert sorted(loaded) == sorted(ids)
            statements.clear()
            write_jobs(uow.s, loaded.values(), 101.0)  # nothing changed: nothing written
            assert statements == []
            with pytest.raises(RuntimeError, match="already written"):
                write_jobs(uow.s, [loaded[ids[0]]], 101.0)
        with UnitOfWork(sessions, "test") as uow:
            job = load_jobs(uow.s, [ids[0]], policy_of)[ids[0]]
            task = job.record.tasks[("train", 0)]
            task.exit_phrase = "written"
            job.record.waiting_reason = "changed"
            here = TaskPlacement("train", 0, "node-a", (0,), (0,))
            gone = TaskPlacement("train", 1, "node-a", (1,), (1,))
            job.ops = [Allocate(ids[0], 0, None, (here, gone)), Release(ids[0], 0, (("train", 1),))]  # type: ignore[arg-type]
            statements.clear()
            write_jobs(uow.s, [job], 102.0)
            assert statements.count("UPDATE") == 2 and statements.count("INSERT") == 1
        with sessions() as s:
            assert s.scalar(select(Job.waiting_reason).where(Job.id == ids[0])) == "changed"
            assert s.scalar(select(Job.waiting_reason).where(Job.id == ids[1])) != "changed"
            phrases = dict(s.execute(select(Task.index, Task.exit_phrase).where(Task.job_id == ids[0])).all())
            assert phrases[0] == "written" and phrases[1] != "written"
            placed = dict(s.execute(select(Placement.index, Placement.released)
                                    .where(Placement.job_id == ids[0])).all())
            assert placed == {0: False, 1: True}
        with UnitOfWork(sessions, "test") as uow:  # the unreleased one is loaded, then released
            job = load_jobs(uow.s, [ids[0]], policy_of)[ids[0]]
            assert list(job.placements) == [(0, "train", 0)]
            job.release_placements()
            write_jobs(uow.s, [job], 103.0)
        with sessions() as s:
            assert set(s.scalars(select(Placement.released).where(Placement.job_id == ids[0]))) == {True}
    finally:
        engine.dispose()


def test_write_jobs_writes_what_changed(store_url: str, tmp_path: Path) -> None:
    _check(store_url, tmp_path / "logs")
