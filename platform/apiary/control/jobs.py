"""The job service: submit (with the intake's group commit), stop, clone, tag, flow-run links, reads.

Every write is one transaction of the plane: a submission batch through a
:class:`~apiary.store.unit.UnitOfWork` (new jobs are rows only, with no scheduler operation), every
lifecycle change through a :class:`~apiary.control.work.Work`; memory (the cached specs, the queue's
dirty set, the scheduling loop's wake) is touched only after the commit.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping

import yaml
from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from apiary.control.cache import PlaneCache, Submitted
from apiary.control.intake import Intake, PendingSubmission, flow_run_holders, flow_run_taken
from apiary.control.views import job_json, simulated_nodes
from apiary.control.work import Committed
from apiary.errors import ConflictError, NotFoundError, ValidationError
from apiary.lifecycle.reducer import Effects, JobRecord, StopRequested, job_policy, submit
from apiary.spec.job import JobSpec, parse_job
from apiary.spec.storage import StorageRequest
from apiary.store.models import Event, Job, Task
from apiary.store.records import insert_new_jobs
from apiary.store.unit import UnitOfWork, reading, store_errors

logger = logging.getLogger(__name__)

USER_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenPAI user names: letters, digits, _ and -


class JobService:
    """Jobs over the plane's ``cache``; ``max_instances`` caps the task instances of one job, all
    roles together (``APIARY_MAX_INSTANCES``)."""

    #: Most submissions committed in one transaction (one executemany per table).
    INTAKE_BATCH = 64

    def __init__(self, cache: PlaneCache, *, max_instances: int = 1000) -> None:
        self.cache = cache
        self.max_instances = max_instances
        # Submissions waiting for a group commit (apiary.control.intake).
        self.intake: Intake[PendingSubmission] = Intake()
        self._next_seq: int | None = None  # the next submit_seq; None: read max + 1 from the store

    def submit(self, text: str | bytes, user: str, *, flow_run_id: str | None = None,
               authorize: Callable[[JobSpec], None] | None = None) -> dict:
        """Accept a job (OpenPAI protocol v2 YAML). Returns its JSON once committed (durable).

        ``authorize`` sees the parsed spec before anything is written and raises to refuse it (the
        API checks the caller's virtual-cluster grants there). ``flow_run_id`` attaches the job to
        that Prefect flow run; it must be attached to no other job (:meth:`set_flow_runs`). Raises
        ValidationError (bad YAML/field, bad user, more than ``max_instances`` instances),
        QuotaExceededError (gang job larger than its VC), ConflictError (``user~name`` exists),
        ConflictFlowRunError (the flow run is another job's), UnavailableError (503: the store
        cannot commit; nothing was accepted), and whatever ``authorize`` raises.
        """
        return self._submit(text, user, flow_run_id=flow_run_id, authorize=authorize)

    def _submit(self, text: str | bytes, user: str, *, flow_run_id: str | None = None,
                authorize: Callable[[JobSpec], None] | None = None, shares_flow_run_of: str | None = None) -> dict:
        """:meth:`submit`; ``shares_flow_run_of`` names the job whose flow run this one may share
        (:meth:`clone`'s source)."""
        if not USER_PATTERN.fullmatch(user or ""):
            raise ValidationError("user", f"invalid user name {user!r}: use letters, digits, '_' or '-'")
        spec = parse_job(text, max_instances=self.max_instances)
        for role in spec.task_roles:
            spec.render_commands(role)  # unknown <% $parameters.x %> references fail now, not at launch
        job_id = f"{user}~{spec.name}"
        policy = job_policy(job_id, spec)
        pending = PendingSubmission(job_id, user, spec, policy, text.decode() if isinstance(text, bytes) else text,
                                    flow_run_id, authorize, shares_flow_run_of)
        self.intake.put(pending)
        with self.cache.lock:
            # Group commit (apiary.control.intake): the first submitter to get the lock commits every
            # queued submission, so ours may already be answered by the time we get here.
            while not pending.done and self._commit_intake():
                pass
        return pending.result()  # RuntimeError if it was drained but never settled (a bug)

    def _commit_intake(self) -> bool:
        """Commit the queued submissions (lock held): one transaction for a batch of up to
        :data:`INTAKE_BATCH`, each settled with its job's JSON or its error. A name already taken
        (in the store or earlier in the batch) refuses that submission only; a store that cannot
        commit refuses the batch (nothing of it was accepted or applied). False if none was queued."""
        batch = self.intake.drain(self.INTAKE_BATCH)
        if not batch:
            return False
        try:
            self._commit_batch(batch)
        except ConflictError:
            # A name in the batch is taken in the store (the insert says so; no query asks first,
            # as clashes are rare): decide each submission alone, so only that one is refused.
            for p in batch:
                if not p.done:
                    try:
                        self._commit_batch([p])
                    except Exception as e:
                        if not p.done:  # a taken name was settled with OpenPAI's message already
                            p.settle(error=e)
        except BaseException as e:  # every drained submission is answered, whatever happened
            for p in batch:
                if not p.done:
                    p.settle(error=e)
            if not isinstance(e, Exception):
                raise
        return True

    def _commit_batch(self, batch: list[PendingSubmission]) -> None:
        """One transaction for ``batch``. Raises ConflictError when a job id is taken in the store
        (for a batch of one, that submission is settled with OpenPAI's message first).

        New jobs are rows only, with no scheduler operation, so the batch is a plain
        :class:`~apiary.store.unit.UnitOfWork`: batched inserts (:func:`insert_new_jobs`), the
        commit, then memory (the arrival numbers, the specs, the queue's dirty set, a wake for the
        scheduling loop). When the commit fails nothing of that is applied and the arrival numbers
        are read from the store again."""
        with UnitOfWork(self.cache.sessions, "submit") as uow:
            s = uow.s
            uow.on_failure(self._forget_seq)  # re-read from the store: the failed batch's numbers are free again
            now = self.cache.clock()
            if self._next_seq is None:
                self._next_seq = (s.scalar(select(func.max(Job.submit_seq))) or 0) + 1
            accepted: list[PendingSubmission] = []
            new: list[tuple[JobRecord, Effects, dict[str, object]]] = []
            ids: set[str] = set()
            holders = flow_run_holders(s, {p.flow_run_id for p in batch if p.flow_run_id})
            for p in batch:
                try:
                    # Under the lock (the scheduler's VC cells change with every allocation), and an
                    # unknown VC is a 400 naming the field before any 403 of ``authorize``.
                    self.cache.scheduler.validate(p.policy.request)
                    if p.authorize is not None:
                        p.authorize(p.spec)
                except Exception as e:
                    p.settle(error=e)
                    continue
                if p.job_id in ids:  # the same name twice in one batch: the later one is refused
                    p.settle(error=self._name_taken(p))
                    continue
                if p.flow_run_id:
                    held = holders.setdefault(p.flow_run_id, set())
                    # Its own id among them: the name is taken, which the insert answers.
                    if held and p.job_id not in held and p.shares_flow_run_of not in held:
                        p.settle(error=flow_run_taken(p.flow_run_id, held))
                        continue
                    held.add(p.job_id)
                ids.add(p.job_id)
                spec = p.spec
                record, fx = submit(p.job_id, p.user, p.policy, now, name=spec.name,
                                    priority_class=spec.priority_class, flow_run_id=p.flow_run_id)
                new.append((record, fx, dict(
                    submit_seq=self._next_seq + len(accepted), name=spec.name, virtual_cluster=spec.virtual_cluster,
                    priority_class=spec.priority_class, priority=spec.priority, gang=spec.gang, spec_yaml=p.text,
                    flow_run_id=p.flow_run_id,
                )))
                accepted.append(p)
            if not accepted:
                return
            try:
                with store_errors("submit"):
                    rows = insert_new_jobs(s, new, now)  # the job rows go in first: a taken id fails here
                uow.after_commit(lambda: self._accepted(accepted, [record for record, _, _ in new]))
                uow.commit()
            except ConflictError:
                if len(accepted) == 1:
                    accepted[0].settle(error=self._name_taken(accepted[0]))
                raise
            for p, (row, tasks) in zip(accepted, rows, strict=True):
                logger.info("accepted job=%s vc=%s priority=%s", p.job_id, p.spec.virtual_cluster,
                            p.spec.priority_class)
                # The answer is the rows as inserted: no query. A new job's tasks have no node yet.
                p.settle(answer=job_json(s, row, tasks, simulated=set()))

    def _forget_seq(self) -> None:
        self._next_seq = None

    def _accepted(self, accepted: list[PendingSubmission], records: list[JobRecord]) -> None:
        """After a submission batch's commit: the arrival numbers, the cached specs, the queue (the
        new jobs' heads as written, so the next snapshot need not read them back)."""
        assert self._next_seq is not None
        first_seq = self._next_seq
        self._next_seq += len(accepted)
        for p in accepted:
            self.cache.remember(p.job_id, p.spec, p.policy)
        self.cache.apply(Committed((), frozenset(), frozenset(p.job_id for p in accepted), True))
        for i, (p, record) in enumerate(zip(accepted, records, strict=True)):
            # The order and instances the snapshot's query reads for it (Job.priority, submission_time,
            # submit_seq; its WAITING tasks in insertion order).
            order = (-p.spec.priority, record.submission_time, first_seq + i)
            self.cache.submitted[p.job_id] = Submitted(order, tuple(record.pending()), record.waiting_reason)

    @staticmethod
    def _name_taken(p: PendingSubmission) -> ConflictError:
        return ConflictError(f"Job name {p.spec.name} already exists for user {p.user}.")

    def stop(self, job_id: str) -> dict:
        """OpenPAI's ``executionType: STOP``. Idempotent; a finished job is returned unchanged.
        Raises NotFoundError, UnavailableError (the store cannot commit)."""
        with self.cache.lock, self.cache.work("stop") as w:
            loaded = w.load(job_id)
            if loaded is None:
                raise NotFoundError(f"Job {job_id} not found.")
            w.step(job_id, StopRequested())
            w.commit()
            return job_json(w.s, self._get_job(w.s, job_id))  # the row as committed

    def tag_job(self, job_id: str, tag: str) -> dict:
        """Add ``tag`` to the job's tags (OpenPAI alert handler's tag-jobs). Idempotent."""
        with self.cache.lock, UnitOfWork(self.cache.sessions, "tag job") as uow:
            job = self._get_job(uow.s, job_id)
            if tag not in (job.tags or []):
                job.tags = [*(job.tags or []), tag]
                uow.s.add(Event(time=self.cache.clock(), job_id=job_id, type="job.tagged", data={"tag": tag}))
            uow.commit()
            return job_json(uow.s, job)

    def set_flow_run(self, job_id: str, flow_run_id: str) -> None:
        """Record the Prefect flow run of a job. Idempotent. Raises NotFoundError,
        ConflictFlowRunError (:meth:`set_flow_runs`)."""
        if self.set_flow_runs({job_id: flow_run_id}):
            raise NotFoundError(f"Job {job_id} not found.")

    def set_flow_runs(self, links: Mapping[str, str]) -> list[str]:
        """Record the Prefect flow runs of several jobs (job id -> flow run id) in one transaction:
        the bridge sends each batch's new runs at once. Idempotent. Returns the job ids that name
        no job (left out), sorted.

        A flow run follows one job: a link naming a flow run that another job holds (or that
        another link of ``links`` names) raises ConflictFlowRunError and nothing is recorded. Only
        a clone shares its source's run (:meth:`clone`, Retry in the Prefect UI); a link never
        moves a run between jobs. Raises UnavailableError when the store cannot commit."""
        if not links:
            return []
        # The lock: a lifecycle step writes whole job rows (apiary.store.records) under it, and
        # must not write back a flow run id it loaded before this one. It also orders this check
        # against submissions' (_commit_batch), so two jobs cannot take one free run at once.
        with self.cache.lock, UnitOfWork(self.cache.sessions, "set flow runs") as uow:
            s = uow.s
            known = set(s.scalars(select(Job.id).where(Job.id.in_(list(links)))))
            holders = flow_run_holders(s, {links[j] for j in known})
            for job_id in sorted(known):
                held = holders.setdefault(links[job_id], set())
                if held - {job_id}:
                    raise flow_run_taken(links[job_id], held - {job_id})
                held.add(job_id)
            if known:
                s.execute(update(Job), [{"id": j, "flow_run_id": links[j]} for j in sorted(known)])
        return sorted(set(links) - known)

    def _get_job(self, s: Session, job_id: str) -> Job:
        job = s.get(Job, job_id)
        if job is None:
            raise NotFoundError(f"Job {job_id} not found.")
        return job

    def clone(self, job_id: str, *, flow_run_id: str | None = None,
              authorize: Callable[[JobSpec], None] | None = None) -> dict:
        """Submit a copy of ``job_id`` (same user, same spec, secrets included) as a new job named
        ``<name>-retry<N>`` with the smallest free N: the Retry button of a finished job's flow run.
        A chain of retries stays flat (``x-retry1`` -> ``x-retry2``). ``flow_run_id`` attaches the
        copy to that flow run: a free one, or the one ``job_id`` is attached to (Retry runs the copy
        in the source's run, which keeps its link too; a run is shared only along a job's copies).
        Returns the new job's JSON; raises NotFoundError and :meth:`submit`'s errors
        (ConflictFlowRunError for a run another job holds)."""
        with reading(self.cache.sessions, "read jobs") as s:
            job = self._get_job(s, job_id)
            user, name, text = job.user, job.name, job.spec_yaml
            base = re.sub(r"-retry\d+$", "", name)
            taken = set(s.scalars(select(Job.name).where(Job.user == user, Job.name.like(f"{base}-retry%"))))
        n = next(i for i in range(1, len(taken) + 2) if f"{base}-retry{i}" not in taken)
        doc = yaml.safe_load(text)
        doc["name"] = f"{base}-retry{n}"
        return self._submit(yaml.safe_dump(doc, sort_keys=False), user, flow_run_id=flow_run_id, authorize=authorize,
                            shares_flow_run_of=job_id)

    def get_job(self, job_id: str) -> dict:
        """The job's JSON (:func:`~apiary.control.views.job_json`). Raises NotFoundError."""
        with reading(self.cache.sessions, "read jobs") as s:
            return job_json(s, self._get_job(s, job_id))

    def storage_requests(self, job_id: str) -> tuple[StorageRequest, ...] | None:
        """The storage configs job ``job_id`` names (:meth:`JobSpec.storage_requests`; None: its
        user's defaults). Raises NotFoundError."""
        with reading(self.cache.sessions, "read jobs") as s:
            return self.cache.spec_of(self._get_job(s, job_id)).storage_requests()

    def job_owner(self, job_id: str) -> tuple[str, str]:
        """``(user, virtual cluster)`` of a job, for access checks. Raises NotFoundError."""
        with reading(self.cache.sessions, "read jobs") as s:
            row = s.execute(select(Job.user, Job.virtual_cluster).where(Job.id == job_id)).first()
        if row is None:
            raise NotFoundError(f"Job {job_id} not found.")
        return row[0], row[1]

    def list_jobs(
        self, *, user: str | None = None, virtual_cluster: str | None = None, state: str | None = None,
        visible_to: tuple[str, frozenset[str]] | None = None,
    ) -> list[dict]:
        """Jobs in arrival order, filtered; ``visible_to=(user, vcs)`` keeps only that user's jobs
        and the jobs of those virtual clusters (what a non-admin may see)."""
        with reading(self.cache.sessions, "read jobs") as s:
            q = select(Job).order_by(Job.submission_time, Job.submit_seq)
            if visible_to is not None:
                q = q.where(or_(Job.user == visible_to[0], Job.virtual_cluster.in_(sorted(visible_to[1]))))
            if user:
                q = q.where(Job.user == user)
            if virtual_cluster:
                q = q.where(Job.virtual_cluster == virtual_cluster)
            if state:
                q = q.where(Job.state == state.upper())
            jobs = list(s.scalars(q))
            tasks: dict[str, list[Task]] = {}
            for t in s.scalars(select(Task).where(Task.latest.is_(True)).order_by(Task.task_role, Task.index)):
                tasks.setdefault(t.job_id, []).append(t)
            simulated = simulated_nodes(s)
            return [
                job_json(s, j, [t for t in tasks.get(j.id, []) if t.attempt == j.attempt], simulated) for j in jobs
            ]

    def events(self, after: int = 0, limit: int = 500, job_id: str | None = None,
               user: str | None = None) -> list[dict]:
        """Events after seq ``after``, oldest first, at most ``limit`` (clamped to 1..5000);
        ``job_id`` or ``user`` narrow them to one job or one user's jobs."""
        with reading(self.cache.sessions, "read jobs") as s:
            q = select(Event).where(Event.seq > after).order_by(Event.seq).limit(min(max(limit, 1), 5000))
            if job_id:
                q = q.where(Event.job_id == job_id)
            if user:
                q = q.where(Event.job_id.startswith(f"{user}~", autoescape=True))
            return [
                {"seq": e.seq, "time": e.time, "jobId": e.job_id, "type": e.type, "data": e.data}
                for e in s.scalars(q)
            ]

    def untag_job(self, job_id: str, tag: str) -> dict:
        """Remove ``tag`` from the job's tags (the undo of :meth:`tag_job`). Idempotent."""
        with self.cache.lock, UnitOfWork(self.cache.sessions, "untag job") as uow:
            job = self._get_job(uow.s, job_id)
            if tag in (job.tags or []):
                job.tags = [t for t in (job.tags or []) if t != tag]
                uow.s.add(Event(time=self.cache.clock(), job_id=job_id, type="job.untagged", data={"tag": tag}))
            uow.commit()
            return job_json(uow.s, job)
