"""Between the store's rows and the lifecycle's records (:mod:`apiary.lifecycle.reducer`).

:func:`load_job` reads a job's row, its current attempt, the latest run of each instance and its
unreleased placements into a :class:`LoadedJob`: a fresh :class:`~apiary.lifecycle.reducer.JobRecord`
plus the rows it came from. The caller runs lifecycle steps on the record and hands each step's
:class:`~apiary.lifecycle.reducer.Effects` to :meth:`LoadedJob.absorb`; :meth:`LoadedJob.write`
then puts every change into the session (records into their rows, new attempts and runs as new
rows, ``Allocate``/``Release`` operations as placement rows, events). Nothing is committed here: the
caller commits, and only then applies the scheduler operations. A failed commit leaves nothing in
memory to undo, because the record is rebuilt from the store for every transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

from sqlalchemy import Table, bindparam, insert, select, update
from sqlalchemy.orm import Session

from apiary.lifecycle import AttemptOutcome, Desired, ExecutionType, JobState, TaskState
from apiary.lifecycle.reducer import (
    Allocate,
    AttemptRecord,
    Effects,
    JobPolicy,
    JobRecord,
    Release,
    TaskRecord,
    waiting_event,
)
from apiary.store.models import Attempt, Event, Job, Placement, Task

__all__ = ["LoadedJob", "attempt_record", "insert_new_jobs", "load_job", "load_jobs", "task_record", "write_waits"]


def task_record(row: Task) -> TaskRecord:
    """The lifecycle record of one task row (enums restored from their stored strings)."""
    return TaskRecord(
        task_role=row.task_role, index=row.index, attempt=row.attempt, task_attempt=row.task_attempt,
        state=TaskState(row.state), node=row.node, gpus=tuple(row.gpus or ()), desired=Desired(row.desired),
        stop_reason=row.stop_reason, run_id=row.run_id, exit_code=row.exit_code, exit_phrase=row.exit_phrase,
        pid=row.pid, placed_at=row.placed_at, started=row.started, finished=row.finished, latest=row.latest,
    )


def attempt_record(row: Attempt) -> AttemptRecord:
    return AttemptRecord(
        index=row.index, created=row.created, launched=row.launched, finished=row.finished,
        outcome=AttemptOutcome(row.outcome) if row.outcome else None, exit_code=row.exit_code,
        reason=row.reason, preempted_by=row.preempted_by,
    )


def _update(row: object, **values: object) -> None:
    """Set the attributes whose value differs: a row nothing changed stays clean, so the flush skips
    it instead of comparing every column. (For a new row an attribute not set is None already.)"""
    for name, value in values.items():
        if getattr(row, name) != value:
            setattr(row, name, value)


def _task_columns(rec: TaskRecord, gpus: list | None) -> dict[str, object]:
    """The task row's columns its lifecycle record owns (``gpus``: what the row should hold)."""
    return dict(
        attempt=rec.attempt, task_role=rec.task_role, index=rec.index, task_attempt=rec.task_attempt,
        state=rec.state.value, node=rec.node, gpus=gpus, desired=rec.desired.value, stop_reason=rec.stop_reason,
        run_id=rec.run_id, exit_code=rec.exit_code, exit_phrase=rec.exit_phrase, pid=rec.pid,
        placed_at=rec.placed_at, started=rec.started, finished=rec.finished, latest=rec.latest,
    )


def _write_task(rec: TaskRecord, row: Task) -> None:
    # Without a node the record carries no GPUs: the row keeps the ones it holds.
    _update(row, **_task_columns(rec, list(rec.gpus) if rec.node is not None else row.gpus))


def _job_columns(rec: JobRecord) -> dict[str, object]:
    """The job row's columns its lifecycle record owns."""
    return dict(
        state=rec.state.value, execution_type=rec.execution_type.value, attempt=rec.attempt.index,
        retries_user=rec.retries_user, retries_platform=rec.retries_platform, launch_time=rec.launch_time,
        completion_time=rec.completion_time, exit_code=rec.exit_code, exit_phrase=rec.exit_phrase,
        waiting_reason=rec.waiting_reason,
    )


def _write_job(rec: JobRecord, row: Job) -> None:
    _update(row, **_job_columns(rec))


def _attempt_columns(rec: AttemptRecord) -> dict[str, object]:
    """The attempt row's columns its lifecycle record owns."""
    return dict(
        created=rec.created, launched=rec.launched, finished=rec.finished,
        outcome=rec.outcome.value if rec.outcome is not None else None, exit_code=rec.exit_code,
        reason=rec.reason, preempted_by=rec.preempted_by,
    )


def _write_attempt(rec: AttemptRecord, row: Attempt) -> None:
    _update(row, **_attempt_columns(rec))


@dataclass
class LoadedJob:
    """A job's record and the rows it maps to, for one transaction (see the module docstring).

    ``attempts`` / ``tasks``: every record seen in this transaction with its row (None: created by a
    step, inserted by :meth:`write`). ``placements``: (attempt, taskRole, index) -> unreleased row.
    """

    record: JobRecord
    row: Job
    attempts: list[tuple[AttemptRecord, Attempt | None]]
    tasks: list[tuple[TaskRecord, Task | None]]
    placements: dict[tuple[int, str, int], Placement]
    events: list[tuple[float, str, dict]] = field(default_factory=list)
    ops: list = field(default_factory=list)

    def absorb(self, fx: Effects, now: float) -> None:
        """Remember what a step on :attr:`record` at ``now`` created, its events and its operations."""
        if fx.new_attempt is not None:
            self.attempts.append((fx.new_attempt, None))
        self.tasks.extend((t, None) for t in fx.new_tasks)
        self.events.extend((now, type_, data) for type_, data in fx.events)
        self.ops.extend(fx.ops)

    def write(self, s: Session, now: float) -> None:
        """Put the record's changes, new rows, placement changes and events into ``s`` (no commit)."""
        rec = self.record
        _write_job(rec, self.row)
        for i, (a, arow) in enumerate(self.attempts):
            if arow is None:
                arow = Attempt(job_id=rec.id, index=a.index)
                s.add(arow)
                self.attempts[i] = (a, arow)
            _write_attempt(a, arow)
        for i, (t, trow) in enumerate(self.tasks):
            if trow is None:
                trow = Task(job_id=rec.id)
                s.add(trow)
                self.tasks[i] = (t, trow)
            _write_task(t, trow)
        for op in self.ops:
            if isinstance(op, Allocate):
                for p in op.placements:
                    prow = Placement(job_id=rec.id, attempt=op.attempt, task_role=p.task_role, index=p.index,
                                     node=p.node, leaf_cells=list(p.leaf_cell_indices), gpus=list(p.gpus),
                                     created=now, released=False)
                    s.add(prow)
                    self.placements[(op.attempt, p.task_role, p.index)] = prow
            elif isinstance(op, Release):
                for key, prow in list(self.placements.items()):
                    if key[0] == op.attempt and (op.instances is None or (key[1], key[2]) in op.instances):
                        prow.released = True
                        del self.placements[key]
        self.ops = []
        for t_, type_, data in self.events:
            s.add(Event(time=t_, job_id=rec.id, type=type_, data=data))
        self.events = []


def load_job(s: Session, job_id: str, policy_of: Callable[[Job], JobPolicy]) -> LoadedJob | None:
    """The job ``job_id`` as a fresh record with its rows, or None if there is no such job.
    ``policy_of`` gives the job's :class:`JobPolicy` (the control plane caches them by job id)."""
    row = s.get(Job, job_id)
    if row is None:
        return None
    arow = s.get(Attempt, (job_id, row.attempt))
    trows = list(s.scalars(
        select(Task).where(Task.job_id == job_id, Task.attempt == row.attempt, Task.latest.is_(True))
        .order_by(Task.id)
    ))
    prows = list(s.scalars(select(Placement).where(Placement.job_id == job_id, Placement.released.is_(False))))
    return _loaded(row, arow, trows, prows, policy_of)


def load_jobs(s: Session, job_ids: Iterable[str], policy_of: Callable[[Job], JobPolicy]) -> dict[str, LoadedJob]:
    """:func:`load_job` for several jobs in four queries instead of four per job (a scheduling cycle
    recording a batch of waits). Jobs that do not exist are left out. Meant for a few dozen ids:
    each query lists them all."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    rows = {r.id: r for r in s.scalars(select(Job).where(Job.id.in_(ids)))}
    if not rows:
        return {}
    found = sorted(rows)
    arows = {(a.job_id, a.index): a for a in s.scalars(select(Attempt).where(Attempt.job_id.in_(found)))}
    trows: dict[str, list[Task]] = {}
    for t in s.scalars(select(Task).where(Task.job_id.in_(found), Task.latest.is_(True)).order_by(Task.id)):
        if t.attempt == rows[t.job_id].attempt:
            trows.setdefault(t.job_id, []).append(t)
    prows: dict[str, list[Placement]] = {}
    for p in s.scalars(select(Placement).where(Placement.job_id.in_(found), Placement.released.is_(False))):
        prows.setdefault(p.job_id, []).append(p)
    return {
        job_id: _loaded(row, arows.get((job_id, row.attempt)), trows.get(job_id, []), prows.get(job_id, []),
                        policy_of)
        for job_id, row in rows.items()
    }


def _loaded(row: Job, arow: Attempt | None, trows: list[Task], prows: list[Placement],
            policy_of: Callable[[Job], JobPolicy]) -> LoadedJob:
    """A :class:`LoadedJob` from a job's row, its current attempt's row, that attempt's latest task
    rows (by id) and its unreleased placement rows."""
    job_id = row.id
    assert arow is not None, f"job {job_id} has no row for its attempt {row.attempt}"
    attempt = attempt_record(arow)
    tasks: list[tuple[TaskRecord, Task | None]] = [(task_record(t), t) for t in trows]
    record = JobRecord(
        id=row.id, user=row.user, policy=policy_of(row), state=JobState(row.state), attempt=attempt,
        tasks={t.key: t for t, _ in tasks}, submission_time=row.submission_time,
        execution_type=ExecutionType(row.execution_type), retries_user=row.retries_user,
        retries_platform=row.retries_platform, launch_time=row.launch_time, completion_time=row.completion_time,
        exit_code=row.exit_code, exit_phrase=row.exit_phrase, waiting_reason=row.waiting_reason,
    )
    return LoadedJob(
        record=record, row=row, attempts=[(attempt, arow)], tasks=tasks,
        placements={(p.attempt, p.task_role, p.index): p for p in prows},
    )


def _job_values(record: JobRecord, fields: dict[str, object]) -> dict[str, object]:
    return dict(id=record.id, user=record.user, submission_time=record.submission_time, tags=None,
                **_job_columns(record), **fields)


def _attempt_values(job_id: str, a: AttemptRecord) -> dict[str, object]:
    return dict(job_id=job_id, index=a.index, **_attempt_columns(a))


def _task_values(job_id: str, t: TaskRecord) -> dict[str, object]:
    return dict(job_id=job_id, **_task_columns(t, list(t.gpus) if t.node is not None else None))


_JOBS, _ATTEMPTS, _TASKS, _EVENTS = (cast(Table, m.__table__) for m in (Job, Attempt, Task, Event))
#: One INSERT statement per table, built once (its compiled form is cached by the statement).
_INSERTS = {table: insert(table) for table in (_JOBS, _ATTEMPTS, _TASKS, _EVENTS)}


def insert_new_jobs(s: Session, jobs: list[tuple[JobRecord, Effects, dict[str, object]]],
                    now: float) -> list[tuple[Job, list[Task]]]:
    """The rows of jobs :func:`apiary.lifecycle.reducer.submit` just made (job, attempt, tasks,
    events), as one multi-row INSERT per table instead of the ORM's unit of work: a submission
    creates rows only, and the unit of work's bookkeeping on them cost more than the inserts (bench/thresholds.yaml asks
    200 submissions/s of one process). ``jobs``: each job's
    record, its submit effects and the job row's fields the record does not carry (name,
    spec_yaml, ...). Returns for each job, in order, detached rows holding the inserted values
    (the answer's job and tasks; not in the session). Raises IntegrityError for a taken job id
    (the job rows go first) and ValueError for effects a submission cannot have (scheduler
    operations). Nothing is committed here."""
    job_rows: list[dict[str, object]] = []
    attempt_rows: list[dict[str, object]] = []
    task_rows: list[dict[str, object]] = []
    event_rows: list[dict[str, object]] = []
    out: list[tuple[Job, list[Task]]] = []
    for record, fx, fields in jobs:
        if fx.ops:
            raise ValueError(f"a new job has no scheduler operations, got {fx.ops!r}")
        jv = _job_values(record, fields)
        job_rows.append(jv)
        attempt_rows.append(_attempt_values(record.id, record.attempt))  # the record's first attempt
        if fx.new_attempt is not None:
            attempt_rows.append(_attempt_values(record.id, fx.new_attempt))
        tvs = [_task_values(record.id, t) for t in fx.new_tasks]
        task_rows.extend(tvs)
        event_rows.extend(dict(time=now, job_id=record.id, type=type_, data=data) for type_, data in fx.events)
        out.append((Job(**jv), sorted((Task(**tv) for tv in tvs), key=lambda t: (t.task_role, t.index))))
    # Core on the session's connection (its transaction): the ORM's bulk INSERT path would still
    # process every row for the identity map it does not need here.
    conn = s.connection()
    for table, rows in ((_JOBS, job_rows), (_ATTEMPTS, attempt_rows), (_TASKS, task_rows), (_EVENTS, event_rows)):
        if rows:  # the job rows first: a taken id fails before anything else is written
            conn.execute(_INSERTS[table], rows)
    return out


#: :func:`write_waits`' statement, built once (its compiled form is cached; building the expression
#: for each job cost more than running it).
_WRITE_WAIT = (
    update(_JOBS)
    .where(_JOBS.c.id == bindparam("w_job"), _JOBS.c.attempt == bindparam("w_attempt"),
           _JOBS.c.state.in_((JobState.WAITING.value, JobState.RUNNING.value)),
           _JOBS.c.execution_type == ExecutionType.START.value,
           _JOBS.c.waiting_reason.is_not_distinct_from(bindparam("w_old")))
    .values(waiting_reason=bindparam("w_reason"))
)


def write_waits(s: Session, waits: Iterable[tuple[str, int, str | None, str]], now: float) -> list[str]:
    """Record new waiting reasons without loading the jobs: for each ``(job_id, attempt, old reason,
    new reason)``, the job's row takes the new reason only where it still is what the caller saw (a
    job asked of the scheduler: ``START``, ``WAITING`` or ``RUNNING``, at ``attempt``, with ``old``
    as its reason), and then gets the ``job.waiting`` event a :class:`~apiary.lifecycle.reducer.Waiting`
    step writes (:func:`~apiary.lifecycle.reducer.waiting_event`). Returns the ids written, in
    order; a job that changed meanwhile is left out. One UPDATE per job (its row count says whether
    it held) and one multi-row INSERT of the events; nothing is committed here.

    The scheduling cycle records a new job's first wait reason this way: loading each job's record,
    attempt and tasks to apply a step that changes one column cost more than the write
    (bench/README.md, ``api``)."""
    conn = s.connection()
    written: list[str] = []
    events: list[dict[str, object]] = []
    for job_id, attempt, old, reason in waits:
        params = {"w_job": job_id, "w_attempt": attempt, "w_old": old, "w_reason": reason}
        if conn.execute(_WRITE_WAIT, params).rowcount != 1:
            continue
        type_, data = waiting_event(attempt, reason)
        events.append(dict(time=now, job_id=job_id, type=type_, data=data))
        written.append(job_id)
    if events:
        conn.execute(_INSERTS[_EVENTS], events)
    return written
