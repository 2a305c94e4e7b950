"""One transaction of the control plane: lifecycle steps on records, one commit, then apply.

:class:`Work` is the shell around :func:`apiary.lifecycle.reducer.step`. It loads each job it
touches as a fresh record (:func:`apiary.store.records.load_job`), runs the steps, writes records,
events and placement changes into its session, commits, and only then applies the scheduler
operations, bumps the touched nodes' generations and wakes the scheduling loop (Kueue's rule: the
cache never claims what the store does not hold). When the commit fails nothing was applied, so
memory still agrees with the store; when applying fails, the plane rebuilds its scheduler from the
store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from apiary.lifecycle.reducer import Effects, Input, SchedulerOp, step
from apiary.store.records import LoadedJob, load_job, load_jobs
from apiary.store.unit import store_errors

if TYPE_CHECKING:
    from apiary.control.plane import ControlPlane

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """Set the scheduler's health of ``node`` to ``schedulable`` (after the commit that changed its row)."""

    node: str
    schedulable: bool


class Work:
    """Steps, writes and one commit on ``session`` for ``plane`` at ``now``; see the module docstring.

    Not thread-safe: the caller holds the plane's lock from the first :meth:`load` to :meth:`commit`.
    """

    def __init__(self, plane: ControlPlane, session: Session, now: float) -> None:
        self.plane = plane
        self.s = session
        self.now = now
        self.jobs: dict[str, LoadedJob] = {}
        self.ops: list[SchedulerOp | NodeHealth] = []
        self.touched: set[str] = set()
        self.wake = False

    def load(self, job_id: str) -> LoadedJob | None:
        """The job's record for this transaction (loaded once), or None if it does not exist."""
        loaded = self.jobs.get(job_id)
        if loaded is None:
            loaded = load_job(self.s, job_id, self.plane._policy_of)
            if loaded is None:
                return None
            self.jobs[job_id] = loaded
        return loaded

    def load_many(self, job_ids: list[str]) -> None:
        """Load the records of ``job_ids`` not loaded yet in one go (:func:`load_jobs`); :meth:`load`
        then answers from them."""
        missing = [j for j in job_ids if j not in self.jobs]
        if missing:
            self.jobs.update(load_jobs(self.s, missing, self.plane._policy_of))

    def adopt(self, loaded: LoadedJob) -> None:
        """Take a job created in this transaction (a submission)."""
        self.jobs[loaded.record.id] = loaded
        self.wake = True

    def step(self, job_id: str, inp: Input) -> Effects | None:
        """Run one lifecycle input on the job; None if there is no such job."""
        loaded = self.load(job_id)
        if loaded is None:
            return None
        fx = step(loaded.record, inp, self.now)
        loaded.absorb(fx, self.now)
        self.ops.extend(fx.ops)
        self.touched |= fx.touched
        self.wake = self.wake or fx.wake or bool(fx.ops)
        return fx

    def node_health(self, node: str, schedulable: bool) -> None:
        self.ops.append(NodeHealth(node, schedulable))  # not "touched": the node's runs do not change
        self.wake = True

    def commit(self, what: str) -> None:
        """Write every record, commit, then apply (see the module docstring). Raises ConflictError or
        UnavailableError (nothing applied, the session rolled back) when the store refuses."""
        try:
            with store_errors(what):
                for loaded in self.jobs.values():
                    loaded.write(self.s, self.now)
                self.s.commit()
        except Exception:
            self.s.rollback()
            # Nothing of this transaction was applied; but deciding it may have left tentative state in
            # the scheduler (a reservation for a preemption the store never recorded): rebuild it.
            self.plane._rebuild()
            raise
        self.plane._after_commit(self.ops, self.touched, set(self.jobs), self.wake)
