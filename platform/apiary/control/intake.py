"""Group commit: concurrent submissions (and, the same way, agents' reports) share one transaction.

A submission is parsed outside the plane's lock, then queued here. Whoever takes the plane's lock
next drains the whole queue, runs the checks that read the scheduler (virtual cluster, sizes) and
the caller's grant, and commits every accepted submission in one transaction (one fsync on SQLite
with ``synchronous=FULL``, one round trip on PostgreSQL), then answers each.
A caller whose submission was committed by another thread finds it answered once it holds the
lock. This is the classic group commit of databases (PostgreSQL's ``commit_delay``, MySQL's binlog
group commit); nobody waits on a timer, so a lone submission is committed at once.

Not a backend: in-process only, and nothing here is durable until the batch's commit returns.

Also here: the rule for flow run links that submissions and ``set_flow_runs`` share
(:func:`flow_run_holders`, :func:`flow_run_taken`): a Prefect flow run follows one job, and
its copies (Retry); whoever attaches a job to a run another job holds would get that run's
state, tags and log lines, and a Cancel of it would stop both.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from apiary.errors import ConflictFlowRunError
from apiary.store.models import Job

if TYPE_CHECKING:
    from apiary.lifecycle.reducer import JobPolicy
    from apiary.spec.job import JobSpec


@dataclass(eq=False, kw_only=True)
class Pending:
    """An item queued for a group commit: ``answer`` once applied, or ``error``, what refused it.
    Exactly one of them is set when ``done``; both are written only by the thread that holds the
    plane's lock."""

    answer: dict | None = None
    error: BaseException | None = None
    done: bool = False

    def settle(self, answer: dict | None = None, error: BaseException | None = None) -> None:
        self.answer, self.error, self.done = answer, error, True

    def result(self) -> dict:
        """The answer; raises the error that refused the item. Only after ``done``."""
        if not self.done:
            raise RuntimeError(f"{self!r} was never committed nor refused")
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer


@dataclass(eq=False, repr=False)
class PendingSubmission(Pending):
    """One parsed submission waiting for its batch's checks and commit.

    ``answer`` is the job's JSON once committed; ``error`` what refused it (ConflictError for a
    taken name, UnavailableError when the store cannot commit, or what a check raised).
    """

    job_id: str
    user: str
    spec: JobSpec
    policy: JobPolicy
    text: str
    flow_run_id: str | None
    #: Raises to refuse the spec (the API's virtual-cluster grant check); called under the plane's lock.
    authorize: Callable[[JobSpec], None] | None = None
    #: The job whose flow run this submission may share (a clone's source: Retry in the Prefect UI
    #: re-runs a job as a copy attached to the same run); None: ``flow_run_id`` must be free.
    shares_flow_run_of: str | None = None

    def __repr__(self) -> str:
        return f"submission {self.job_id}"


P = TypeVar("P")


class Intake(Generic[P]):
    """The queue of items (:class:`PendingSubmission`, an agent's pending report) waiting for a
    commit. Thread-safe; ``put``, ``put_back`` and ``drain`` never block beyond a short internal lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[P] = []

    def put(self, pending: P) -> None:
        with self._lock:
            self._queue.append(pending)

    def put_back(self, items: list[P]) -> None:
        """Return drained ``items`` to the front of the queue, in their order (the next batch takes them first)."""
        with self._lock:
            self._queue[:0] = items

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)

    def items(self) -> list[P]:
        """The queued items, oldest first (a copy)."""
        with self._lock:
            return list(self._queue)

    def drain(self, limit: int) -> list[P]:
        """Up to ``limit`` queued items, oldest first, removed from the queue."""
        with self._lock:
            batch, self._queue = self._queue[:limit], self._queue[limit:]
        return batch


def flow_run_holders(session: Session, flow_run_ids: set[str]) -> dict[str, set[str]]:
    """Flow run id -> the ids of the jobs attached to it, for the ids in ``flow_run_ids`` that
    some job holds (one query; none for an empty set)."""
    if not flow_run_ids:
        return {}
    held: dict[str, set[str]] = {}
    query = select(Job.flow_run_id, Job.id).where(Job.flow_run_id.in_(sorted(flow_run_ids)))
    for run, job_id in session.execute(query):
        held.setdefault(run, set()).add(job_id)
    return held


def flow_run_taken(flow_run_id: str, holders: set[str]) -> ConflictFlowRunError:
    """The 409 for attaching a job to ``flow_run_id``, which the jobs ``holders`` are attached to.
    Only admins and the Prefect bridge attach runs, and they may see every job: the message names it."""
    return ConflictFlowRunError(f"Flow run {flow_run_id} is attached to job {', '.join(sorted(holders))} already; "
                                f"a flow run follows one job and the copies Retry makes of it.")
