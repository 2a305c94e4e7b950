"""One transaction of the control plane: lifecycle steps on records, one commit, then apply.

:class:`Work` is a :class:`apiary.store.unit.UnitOfWork` that runs :func:`apiary.lifecycle.reducer.step`.
It loads each job it touches as a fresh record (:func:`apiary.store.records.load_job`), runs the
steps, writes records, events and placement changes into its session, commits, and only then hands
the scheduler operations, the touched nodes and the changed jobs to its ``apply`` callback (the
plane's cache applies them, bumps the nodes' generations and wakes the scheduling loop): memory never
claims what the store does not hold. When the commit fails nothing is applied and ``rebuild`` runs
(deciding the change may have left tentative state in the scheduler, e.g. cells reserved for a
preemption the store never recorded); when applying fails, the applier rebuilds from the store.

Kueue's ``scheduler.admit`` assumes the workload in its cache first and forgets it when the API
write fails; Apiary applies only after the commit instead, so there is nothing to forget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from apiary.lifecycle.reducer import Effects, Input, JobPolicy, SchedulerOp, step
from apiary.store.models import Job
from apiary.store.records import LoadedJob, load_job, load_jobs, write_jobs
from apiary.store.unit import Sessions, UnitOfWork, store_errors

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """Set the scheduler's health of ``node`` to ``schedulable`` (after the commit that changed its row)."""

    node: str
    schedulable: bool


@dataclass(frozen=True, slots=True)
class Committed:
    """What one committed :class:`Work` changed, for its applier: the scheduler operations in
    order, the nodes whose assignments changed, the jobs written, and whether a scheduling cycle
    is worth running now."""

    ops: tuple[SchedulerOp | NodeHealth, ...]
    touched: frozenset[str]
    jobs: frozenset[str]
    wake: bool


#: Applies a committed change to memory (called after the commit, in the committing thread).
Applier = Callable[[Committed], None]


class Work(UnitOfWork):
    """Steps, writes and one commit at ``now``; see the module docstring.

    ``policy_of`` gives a stored job's policy (cached by the caller), ``apply`` receives the
    :class:`Committed` change after a successful commit, ``rebuild`` runs when the commit (or
    writing the records before it) fails. Use it as a context manager (``with Work(...) as w``):
    unlike a plain unit of work it commits only when :meth:`commit` is called (leaving the block
    without it rolls back: nothing was decided), and the exit rolls back and calls ``rebuild`` when
    :meth:`commit` raised. Not thread-safe: the caller holds the plane's lock from the first
    :meth:`load` to :meth:`commit`.
    """

    def __init__(self, sessions: Sessions, what: str, now: float, *, policy_of: Callable[[Job], JobPolicy],
                 apply: Applier, rebuild: Callable[[], None]) -> None:
        super().__init__(sessions, what)
        self.now = now
        self.jobs: dict[str, LoadedJob] = {}
        self.ops: list[SchedulerOp | NodeHealth] = []
        self.touched: set[str] = set()
        self.changed: set[str] = set()  # jobs written without a record (new rows)
        self.wake = False
        self._policy_of = policy_of
        self._apply = apply
        self._rebuild = rebuild
        self._committing = False

    def load(self, job_id: str) -> LoadedJob | None:
        """The job's record for this transaction (loaded once), or None if it does not exist."""
        loaded = self.jobs.get(job_id)
        if loaded is None:
            loaded = load_job(self.s, job_id, self._policy_of)
            if loaded is None:
                return None
            self.jobs[job_id] = loaded
        return loaded

    def load_many(self, job_ids: list[str]) -> None:
        """Load the records of ``job_ids`` not loaded yet in one go (:func:`load_jobs`); :meth:`load`
        then answers from them."""
        missing = [j for j in job_ids if j not in self.jobs]
        if missing:
            self.jobs.update(load_jobs(self.s, missing, self._policy_of))

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
        """Queue the scheduler's health of ``node`` (applied after the commit)."""
        self.ops.append(NodeHealth(node, schedulable))  # not "touched": the node's runs do not change
        self.wake = True

    def commit(self) -> None:
        """Write every record, commit, then apply (see the module docstring). Raises ConflictError or
        UnavailableError (nothing applied, the session rolled back, ``rebuild`` run) when the store
        refuses."""
        self._committing = True
        self.on_failure(self._rebuild)
        with store_errors(self.what):
            write_jobs(self.s, self.jobs.values(), self.now)
        change = Committed(tuple(self.ops), frozenset(self.touched), frozenset(self.jobs) | self.changed, self.wake)
        self.after_commit(lambda: self._apply(change))
        super().commit()

    def __enter__(self) -> Work:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None and not self._committing:  # nothing to commit: roll back, apply nothing
            try:
                self.s.rollback()
            finally:
                self.s.close()
            return
        super().__exit__(exc_type, exc, tb)
