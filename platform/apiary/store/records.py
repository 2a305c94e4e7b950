"""Between the store's rows and the lifecycle's records (:mod:`apiary.lifecycle.reducer`).

:func:`load_jobs` reads each job's row, its current attempt, the latest run of each instance and
its unreleased placements into a :class:`LoadedJob`: a fresh :class:`~apiary.lifecycle.reducer.JobRecord`
plus the values of the rows it came from. The caller runs lifecycle steps on the record and hands each
step's :class:`~apiary.lifecycle.reducer.Effects` to :meth:`LoadedJob.absorb`; :func:`write_jobs`
then puts every change into the session's transaction (records into their rows, new attempts and runs as new
rows, ``Allocate``/``Release`` operations as placement rows, events). Nothing is committed here: the
caller commits, and only then applies the scheduler operations. A failed commit leaves nothing in
memory to undo, because the record is rebuilt from the store for every transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import Row, RowMapping, Table, Update, bindparam, insert, select, update
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

__all__ = ["LoadedJob", "attempt_record", "insert_new_jobs", "load_job", "load_jobs", "task_record", "write_jobs",
           "write_waits"]


def task_record(m: RowMapping) -> TaskRecord:
    """The lifecycle record of one task row read with Core, by column name (a Row's ``index`` is
    ``tuple.index``); enums restored from their stored strings."""
    return TaskRecord(
        task_role=m["task_role"], index=m["index"], attempt=m["attempt"], task_attempt=m["task_attempt"],
        state=TaskState(m["state"]), node=m["node"], gpus=tuple(m["gpus"] or ()), desired=Desired(m["desired"]),
        stop_reason=m["stop_reason"], run_id=m["run_id"], exit_code=m["exit_code"], exit_phrase=m["exit_phrase"],
        pid=m["pid"], placed_at=m["placed_at"], started=m["started"], finished=m["finished"], latest=m["latest"],
    )


def attempt_record(m: RowMapping) -> AttemptRecord:
    """The lifecycle record of one attempt row read with Core, by column name."""
    return AttemptRecord(
        index=m["index"], created=m["created"], launched=m["launched"], finished=m["finished"],
        outcome=AttemptOutcome(m["outcome"]) if m["outcome"] else None, exit_code=m["exit_code"],
        reason=m["reason"], preempted_by=m["preempted_by"],
    )


def _task_columns(rec: TaskRecord, gpus: list | None) -> dict[str, object]:
    """The task row's columns its lifecycle record owns (``gpus``: what the row should hold)."""
    return dict(
        attempt=rec.attempt, task_role=rec.task_role, index=rec.index, task_attempt=rec.task_attempt,
        state=rec.state.value, node=rec.node, gpus=gpus, desired=rec.desired.value, stop_reason=rec.stop_reason,
        run_id=rec.run_id, exit_code=rec.exit_code, exit_phrase=rec.exit_phrase, pid=rec.pid,
        placed_at=rec.placed_at, started=rec.started, finished=rec.finished, latest=rec.latest,
    )


def _job_columns(rec: JobRecord) -> dict[str, object]:
    """The job row's columns its lifecycle record owns."""
    return dict(
        state=rec.state.value, execution_type=rec.execution_type.value, attempt=rec.attempt.index,
        retries_user=rec.retries_user, retries_platform=rec.retries_platform, launch_time=rec.launch_time,
        completion_time=rec.completion_time, exit_code=rec.exit_code, exit_phrase=rec.exit_phrase,
        waiting_reason=rec.waiting_reason,
    )


def _attempt_columns(rec: AttemptRecord) -> dict[str, object]:
    """The attempt row's columns its lifecycle record owns."""
    return dict(
        created=rec.created, launched=rec.launched, finished=rec.finished,
        outcome=rec.outcome.value if rec.outcome is not None else None, exit_code=rec.exit_code,
        reason=rec.reason, preempted_by=rec.preempted_by,
    )


_JOBS, _ATTEMPTS, _TASKS, _EVENTS, _PLACEMENTS = (
    cast(Table, m.__table__) for m in (Job, Attempt, Task, Event, Placement))
#: One INSERT statement per table, built once (its compiled form is cached by the statement).
_INSERTS = {table: insert(table) for table in (_JOBS, _ATTEMPTS, _TASKS, _EVENTS, _PLACEMENTS)}
#: The columns a loaded job's row is read with: all but its tags, which no lifecycle step reads.
_JOB_READ = select(*(c for c in _JOBS.c if c.name != "tags"))
_PLACEMENT_READ = select(_PLACEMENTS.c.id, _PLACEMENTS.c.job_id, _PLACEMENTS.c.attempt, _PLACEMENTS.c.task_role,
                         _PLACEMENTS.c.index)
#: A row's primary key columns, by table: what an UPDATE of a loaded row names it by.
_KEYS: dict[Table, tuple[str, ...]] = {_JOBS: ("id",), _ATTEMPTS: ("job_id", "index"), _TASKS: ("id",)}
_UPDATES: dict[tuple[Table, tuple[str, ...]], Update] = {}


def _update_statement(table: Table, columns: tuple[str, ...]) -> Update:
    """``UPDATE table SET columns WHERE key``, with bound parameters ``k_<key>`` and ``v_<column>``,
    built once per table and set of columns (the names differ from the columns': SQLAlchemy
    reserves those for its own SET parameters)."""
    stmt = _UPDATES.get((table, columns))
    if stmt is None:
        stmt = (update(table)
                .where(*(table.c[k] == bindparam("k_" + k) for k in _KEYS[table]))
                .values({c: bindparam("v_" + c) for c in columns}))
        _UPDATES[(table, columns)] = stmt
    return stmt


@dataclass
class LoadedJob:
    """A job's record and the values of the rows it maps to, for one transaction (see the module
    docstring).

    ``row``: the job row as read (its columns but ``tags``). ``attempts`` / ``tasks``: every
    record seen in this transaction with the stored values of its row's columns (None: created by
    a step, inserted by :func:`write_jobs`); a task's include its ``id``. ``placements``:
    (attempt, taskRole, index) -> the id of the unreleased placement row.
    """

    record: JobRecord
    row: Row
    attempts: list[tuple[AttemptRecord, dict[str, object] | None]]
    tasks: list[tuple[TaskRecord, dict[str, object] | None]]
    placements: dict[tuple[int, str, int], int]
    events: list[tuple[float, str, dict]] = field(default_factory=list)
    ops: list = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    written: bool = False

    def absorb(self, fx: Effects, now: float) -> None:
        """Remember what a step on :attr:`record` at ``now`` created, its events and its operations."""
        if fx.new_attempt is not None:
            self.attempts.append((fx.new_attempt, None))
        self.tasks.extend((t, None) for t in fx.new_tasks)
        self.events.extend((now, type_, data) for type_, data in fx.events)
        self.ops.extend(fx.ops)

    def release_placements(self) -> None:
        """Mark every unreleased placement row of the job released (written by :func:`write_jobs`)."""
        self.released.extend(self.placements.values())
        self.placements.clear()


def _changed(values: dict[str, object], stored: Mapping[Any, Any]) -> dict[str, object]:
    """The columns of ``values`` that differ from the stored ones: an UPDATE sets only those, and a
    row nothing changed is not written at all."""
    return {k: v for k, v in values.items() if stored[k] != v}


def _releases(op: Release, key: tuple[int, str, int]) -> bool:
    """Whether ``op`` frees the placement of ``key`` (attempt, taskRole, index)."""
    return key[0] == op.attempt and (op.instances is None or (key[1], key[2]) in op.instances)


def write_jobs(s: Session, jobs: Iterable[LoadedJob], now: float) -> None:
    """Put the changes of loaded jobs into ``s``'s transaction (no commit): the changed columns of
    their job, attempt and task rows, new attempt, task, placement and event rows, released
    placements. SQLAlchemy Core on the session's connection, not the ORM's unit of work: the rows
    are read as values (:func:`load_jobs`), so there is no identity map to keep, and the unit of
    work's flush of a report's few changed columns cost more than the statements (py-spy on the
    control plane under a job stream at 5,000 nodes: the ORM loads and flushes were 85 % of node
    reports' time). One executemany per table and set of changed columns, and one per table of
    new rows (psycopg pipelines an executemany's statements in one round trip; a multi-row
    ``VALUES`` statement built per call cost the client more: bench/README.md); updates go first,
    then inserts in the order the steps made them (task and event ids keep that order), as the
    ORM's flush did. Raises RuntimeError for a
    job written before (its stored values are no longer the row's)."""
    updates: dict[tuple[Table, tuple[str, ...]], list[dict[str, object]]] = {}
    inserts: dict[Table, list[dict[str, object]]] = {t: [] for t in (_ATTEMPTS, _TASKS, _PLACEMENTS, _EVENTS)}
    released: list[int] = []

    def change(table: Table, key: dict[str, object], values: dict[str, object]) -> None:
        if values:
            params = {"k_" + k: v for k, v in key.items()}
            params.update(("v_" + c, v) for c, v in values.items())
            updates.setdefault((table, tuple(values)), []).append(params)

    for loaded in jobs:
        if loaded.written:
            raise RuntimeError(f"job {loaded.record.id} was already written in this transaction")
        loaded.written = True
        rec = loaded.record
        change(_JOBS, {"id": rec.id}, _changed(_job_columns(rec), loaded.row._mapping))
        for a, stored in loaded.attempts:
            if stored is None:
                inserts[_ATTEMPTS].append(_attempt_values(rec.id, a))
            else:
                change(_ATTEMPTS, {"job_id": rec.id, "index": a.index}, _changed(_attempt_columns(a), stored))
        for t, stored in loaded.tasks:
            if stored is None:
                inserts[_TASKS].append(_task_values(rec.id, t))
            else:
                # Without a node the record carries no GPUs: the row keeps the ones it holds.
                gpus = list(t.gpus) if t.node is not None else stored["gpus"]
                change(_TASKS, {"id": stored["id"]}, _changed(_task_columns(t, gpus), stored))  # type: ignore[arg-type]
        pending: dict[tuple[int, str, int], dict[str, object]] = {}  # placed in this transaction
        for op in loaded.ops:
            if isinstance(op, Allocate):
                for p in op.placements:
                    row = dict(job_id=rec.id, attempt=op.attempt, task_role=p.task_role, index=p.index,
                               node=p.node, leaf_cells=list(p.leaf_cell_indices), gpus=list(p.gpus),
                               created=now, released=False)
                    inserts[_PLACEMENTS].append(row)
                    pending[(op.attempt, p.task_role, p.index)] = row
            elif isinstance(op, Release):
                for key in [k for k in loaded.placements if _releases(op, k)]:
                    released.append(loaded.placements.pop(key))
                for key in [k for k in pending if _releases(op, k)]:
                    pending.pop(key)["released"] = True
        loaded.ops = []
        released.extend(loaded.released)
        loaded.released = []
        inserts[_EVENTS].extend(dict(time=t_, job_id=rec.id, type=type_, data=data)
                                for t_, type_, data in loaded.events)
        loaded.events = []
    conn = s.connection()
    for (table, columns), params in updates.items():
        conn.execute(_update_statement(table, columns), params)
    if released:
        conn.execute(update(_PLACEMENTS).where(_PLACEMENTS.c.id.in_(sorted(released))).values(released=True))
    for table, rows in inserts.items():
        if rows:
            conn.execute(_INSERTS[table], rows)


_ATTEMPT_OWNED = tuple(_attempt_columns(AttemptRecord(index=0, created=0.0)))
_TASK_OWNED = ("id", *_task_columns(TaskRecord(task_role="", index=0, attempt=0), None))


def load_job(s: Session, job_id: str, policy_of: Callable[[Any], JobPolicy]) -> LoadedJob | None:
    """The job ``job_id`` as a fresh record with its rows' values, or None if there is no such job.
    ``policy_of`` gives the job's :class:`JobPolicy` from its row (anything with ``id`` and
    ``spec_yaml``; the control plane caches them by job id)."""
    return load_jobs(s, [job_id], policy_of).get(job_id)


def load_jobs(s: Session, job_ids: Iterable[str], policy_of: Callable[[Any], JobPolicy]) -> dict[str, LoadedJob]:
    """:func:`load_job` for several jobs in four queries instead of four per job (a scheduling cycle
    recording a batch of waits, a batch of node reports). Jobs that do not exist are left out.
    Meant for a few dozen ids: each query lists them all. Rows are read as values with Core (see
    :func:`write_jobs`)."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    conn = s.connection()
    # By column name throughout (Row.index and Row.count are tuple's methods).
    rows = {r.id: r for r in conn.execute(_JOB_READ.where(_JOBS.c.id.in_(ids)))}
    if not rows:
        return {}
    found = sorted(rows)
    arows = {(a["job_id"], a["index"]): a
             for a in conn.execute(select(_ATTEMPTS).where(_ATTEMPTS.c.job_id.in_(found))).mappings()}
    trows: dict[str, list[RowMapping]] = {}
    for t in conn.execute(select(_TASKS).where(_TASKS.c.job_id.in_(found), _TASKS.c.latest.is_(True))
                          .order_by(_TASKS.c.id)).mappings():
        if t["attempt"] == rows[t["job_id"]].attempt:
            trows.setdefault(t["job_id"], []).append(t)
    prows: dict[str, list[RowMapping]] = {}
    placements = _PLACEMENT_READ.where(_PLACEMENTS.c.job_id.in_(found), _PLACEMENTS.c.released.is_(False))
    for p in conn.execute(placements).mappings():
        prows.setdefault(p["job_id"], []).append(p)
    return {
        job_id: _loaded(row, arows.get((job_id, row.attempt)), trows.get(job_id, []), prows.get(job_id, []),
                        policy_of)
        for job_id, row in rows.items()
    }


def _loaded(row: Row, arow: RowMapping | None, trows: list[RowMapping], prows: list[RowMapping],
            policy_of: Callable[[Any], JobPolicy]) -> LoadedJob:
    """A :class:`LoadedJob` from a job's row, its current attempt's row, that attempt's latest task
    rows (by id) and its unreleased placement rows."""
    job_id = row.id
    assert arow is not None, f"job {job_id} has no row for its attempt {row.attempt}"
    attempt = attempt_record(arow)
    tasks: list[tuple[TaskRecord, dict[str, object] | None]] = [(task_record(t), {c: t[c] for c in _TASK_OWNED})
                                                                 for t in trows]
    record = JobRecord(
        id=row.id, user=row.user, policy=policy_of(row), state=JobState(row.state), attempt=attempt,
        tasks={t.key: t for t, _ in tasks}, submission_time=row.submission_time,
        execution_type=ExecutionType(row.execution_type), retries_user=row.retries_user,
        retries_platform=row.retries_platform, launch_time=row.launch_time, completion_time=row.completion_time,
        exit_code=row.exit_code, exit_phrase=row.exit_phrase, waiting_reason=row.waiting_reason,
    )
    return LoadedJob(
        record=record, row=row, attempts=[(attempt, {c: arow[c] for c in _ATTEMPT_OWNED})], tasks=tasks,
        placements={(p["attempt"], p["task_role"], p["index"]): p["id"] for p in prows},
    )


def _job_values(record: JobRecord, fields: dict[str, object]) -> dict[str, object]:
    return dict(id=record.id, user=record.user, submission_time=record.submission_time, tags=None,
                **_job_columns(record), **fields)


def _attempt_values(job_id: str, a: AttemptRecord) -> dict[str, object]:
    return dict(job_id=job_id, index=a.index, **_attempt_columns(a))


def _task_values(job_id: str, t: TaskRecord) -> dict[str, object]:
    return dict(job_id=job_id, **_task_columns(t, list(t.gpus) if t.node is not None else None))


def insert_new_jobs(s: Session, jobs: list[tuple[JobRecord, Effects, dict[str, object]]],
                    now: float) -> list[tuple[Job, list[Task]]]:
    """The rows of jobs :func:`apiary.lifecycle.reducer.submit` just made (job, attempt, tasks,
    events), as one executemany per table instead of the ORM's unit of work: a submission
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
    it held) and one executemany of the events; nothing is committed here.

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
