"""``write_waits``: a waiting reason is written only where the job is still what the cycle saw.

The scheduling cycle records first wait reasons with one conditional UPDATE per job instead of
loading each job's record. These tests write against a stale view (another reason, another
attempt, a stopped job) and check nothing is written for those, while the others get the reason
and exactly one ``job.waiting`` event; on SQLite here and on PostgreSQL (where ``IS NOT DISTINCT
FROM`` compares the reasons) with the ``postgres`` mark.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from tests.support.builders import job_text

from apiary.control import ControlPlane
from apiary.spec.cluster import load_cluster_config
from apiary.store import Event, Job, make_engine, migrate, session_factory
from apiary.store.records import write_waits
from apiary.store.unit import UnitOfWork

LAB6 = Path(__file__).resolve().parents[2] / "examples" / "lab6"
FIRST = "Waiting for the next scheduling cycle."


def _check(url: str, logs: Path) -> None:
    engine = make_engine(url)
    migrate(engine)
    sessions = session_factory(engine)
    plane = ControlPlane(sessions, load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"), logs, clock=lambda: 100.0)
    try:
        ids = [plane.submit(job_text(0, name=f"w{i}"), "bob")["id"] for i in range(4)]
        plane.stop(ids[3])
        with UnitOfWork(sessions, "test") as uow:
            written = write_waits(uow.s, [
                (ids[0], 0, FIRST, "Waiting for resources."),
                (ids[1], 0, "an older reason", "Waiting for resources."),  # the reason changed since
                (ids[2], 1, FIRST, "Waiting for resources."),  # another attempt
                (ids[3], 0, FIRST, "Waiting for resources."),  # stopped meanwhile
                ("bob~nobody", 0, FIRST, "Waiting for resources."),
            ], 101.0)
        assert written == [ids[0]]
        with sessions() as s:
            reasons = dict(s.execute(select(Job.id, Job.waiting_reason)).all())
            waits = list(s.execute(select(Event.job_id, Event.time, Event.data).where(Event.type == "job.waiting")))
        assert reasons[ids[0]] == "Waiting for resources."
        assert all(reasons[j] != "Waiting for resources." for j in ids[1:])
        assert waits == [(ids[0], 101.0, {"attempt": 0, "reason": "Waiting for resources."})]
        # A job whose reason is NULL is matched by a NULL "old" reason (IS NOT DISTINCT FROM).
        with UnitOfWork(sessions, "test") as uow:
            uow.s.execute(Job.__table__.update().where(Job.id == ids[1]).values(waiting_reason=None))
        with UnitOfWork(sessions, "test") as uow:
            assert write_waits(uow.s, [(ids[1], 0, None, "Waiting.")], 102.0) == [ids[1]]
    finally:
        engine.dispose()


def test_write_waits_writes_only_jobs_still_as_seen(store_url: str, tmp_path: Path) -> None:
    _check(store_url, tmp_path / "logs")
