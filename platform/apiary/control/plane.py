"""The control plane: accepts jobs, runs scheduling cycles, tracks tasks and nodes.

It is the only writer of the store and the only reader of the scheduler. The job lifecycle itself
(what a task exit, a stop, a preemption or a lost node does to a job) is not here: it is the pure
core :mod:`apiary.lifecycle.reducer`, which the simulator drives too. This module is the shell
around it:

* every change is one transaction (:class:`apiary.control.work.Work`): load the job's record from the
  store, run the core, write, commit, and only after the commit apply the scheduler operations and
  wake the nodes. When the commit fails nothing was applied; when applying fails the scheduler is
  rebuilt from the store (:meth:`ControlPlane.recover` does the same after a restart);
* one re-entrant lock orders the transactions and guards the scheduler, which is not thread-safe;
  every read of scheduler state goes through a method here that takes it;
* a scheduling cycle decides on a snapshot of the queue and takes the lock for a slice of it at a
  time (LOCK_SLICE_S), so submissions and node reports are not blocked behind a long queue. The
  snapshot re-reads from the store only the jobs committed since the last one (the whole queue every
  QUEUE_REREAD_S and whenever memory is in doubt), and a job that waits is not asked again while
  neither it nor the scheduler's state changed (the answer would be the same): a long queue on a
  full cluster costs each cycle the new jobs only. First wait reasons are committed in batches.

Who owns which fact: the store owns jobs, attempts, tasks, placements, events, nodes (health,
cordon, last heartbeat, metrics URL) and queued faults. Memory holds caches rebuilt from it: the
scheduler's allocations and node health, parsed specs, the exact time of each node's last
heartbeat, and the nodes' assignment generations (which only wake long polls).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml
from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from apiary import gcpolicy
from apiary.control.config import check_cluster_config
from apiary.control.intake import Intake, PendingSubmission, flow_run_holders, flow_run_taken
from apiary.control.nodes import HEARTBEAT_PERSIST_S, MAX_QUEUED_FAULTS, schedulable
from apiary.control.views import iso, job_json, latest_tasks, simulated_nodes
from apiary.control.work import NodeHealth, Work, store_errors
from apiary.errors import (
    ApiaryError,
    ConflictError,
    ForbiddenError,
    NotFoundError,
    TooManyRequestsError,
    UnavailableError,
    UserError,
    ValidationError,
)
from apiary.lifecycle import JobState, TaskState
from apiary.lifecycle.reducer import (
    Allocate,
    Cancel,
    Downgraded,
    Effects,
    JobPolicy,
    JobRecord,
    NodeLost,
    Placed,
    Preempted,
    Reconfigured,
    Release,
    RunReported,
    SchedulerOp,
    StopRequested,
    Waiting,
    job_policy,
    run_id_for,
    submit,
)
from apiary.runtime.env import build_task_env
from apiary.runtime.probes import parse_probes, probes_to_wire
from apiary.scheduler import Decision, HivedScheduler, TaskPlacement
from apiary.spec.cluster import ClusterConfig
from apiary.spec.job import JobSpec, parse_job
from apiary.spec.templating import render
from apiary.store.models import Alert, AlertAction, Attempt, Event, Job, Node, NodeFault, Placement, Task
from apiary.store.records import insert_new_jobs

logger = logging.getLogger(__name__)

USER_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenPAI user names: letters, digits, _ and -
ACTIVE_TASK_STATES = (TaskState.STARTING.value, TaskState.RUNNING.value)
#: Most first-cycle wait reasons one scheduling cycle commits in one transaction (lock held
#: meanwhile, so it also bounds how long a submission can wait for the lock behind them).
WAIT_BATCH = 32
#: How long a scheduling cycle holds the plane's lock for one slice of its queue (seconds).
LOCK_SLICE_S = 0.002
#: A scheduling cycle reads the whole queue from the store at least this often (seconds); in
#: between it reads only the jobs committed since its last snapshot (see ControlPlane._snapshot).
QUEUE_REREAD_S = 5.0

__all__ = ["ControlPlane", "CycleResult", "run_id_for"]


@dataclass
class CycleResult:
    """What one scheduling cycle decided (``POST /api/v2/scheduler/cycle`` returns it)."""

    placed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)
    duration_ms: float = 0.0

    def to_dict(self) -> dict:
        return {
            "placed": self.placed,
            "preempted": self.preempted,
            "waiting": self.waiting,
            "durationMs": round(self.duration_ms, 3),
        }


@dataclass(frozen=True, slots=True)
class _Seen:
    """What a node's committed row says, kept to skip writing bare heartbeats that change nothing:
    the agent's facts, healthy, the heartbeat time written last and the fault high-water mark."""

    info: tuple
    healthy: bool
    beat: float
    faults_applied: int | None = None


#: What a plain "wait" was decided on: (scheduler state version, attempt, pending instances, reason).
_WaitKey = tuple[int, int, tuple[tuple[str, int], ...], str | None]


@dataclass(frozen=True, slots=True)
class _Head:
    """One job of a cycle's snapshot: what it still had to place when the snapshot was taken."""

    job_id: str
    attempt: int
    pending: tuple[tuple[str, int], ...]
    reason: str | None


class ControlPlane:
    """Apiary's control plane over one store and one cluster config.

    ``clock`` returns unix seconds; tests inject it. ``on_nodes_changed`` is called (keep it cheap and
    thread-safe) with the names of nodes whose assignments changed, after the commit, so long-polling
    agents wake up.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        cluster: ClusterConfig,
        logs_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
        node_lost_after_s: float = 30.0,
        config_path: Path | None = None,
        lazy_preemption: bool = False,
        max_instances: int = 1000,
    ) -> None:
        self._sessions = sessions
        self.cluster = cluster
        # Lazy preemption (HiveD): a victim is first downgraded to opportunistic and only stopped if
        # a preemptor really needs its cells.
        self._lazy = lazy_preemption
        self.scheduler = HivedScheduler(cluster, lazy_preemption=lazy_preemption)
        self._node_names = frozenset(self.scheduler.nodes())
        self.config_path = config_path  # where an applied config is saved (``home/cluster.yaml``)
        self.logs_dir = Path(logs_dir)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.RLock()
        self._cycle_lock = threading.Lock()  # one cycle at a time; submissions and reports interleave
        self._cycle_changed: set[str] | None = None  # jobs committed since the running cycle's snapshot
        # The scheduler's state version: bumped (lock held) by everything that changes what
        # ``schedule()`` can answer: an applied allocation, release, cancel or node health, a
        # decision that reserved or downgraded cells, a rebuild, a new config.
        self._sched_version = 0
        # job -> (version, attempt, pending, reason) of its last plain "wait" (see :meth:`_cycle`).
        self._waits: dict[str, _WaitKey] = {}
        # The queue as the last cycle's snapshot read it (job -> its order and head), and the jobs
        # committed since (every Work commit names its jobs): the next snapshot reads only those
        # again. None: read the whole queue (at start, after a rebuild, every QUEUE_REREAD_S).
        self._queue: dict[str, tuple[tuple[int, float, int], _Head]] | None = None
        self._queue_read_at = 0.0
        self._queue_dirty: set[str] = set()
        # The version at which the last cycle left every queued job's answer remembered (else None).
        self._settled: int | None = None
        self._specs: dict[str, JobSpec] = {}
        self._policies: dict[str, JobPolicy] = {}
        self._intake = Intake()  # submissions waiting for a group commit (apiary.control.intake)
        self._next_seq: int | None = None  # the next submit_seq; None: read max + 1 from the store
        self._heartbeats: dict[str, float] = {}  # node -> exact time of its last report (memory only)
        self._reported: dict[str, _Seen] = {}  # node -> what its row says (a cache of committed facts)
        # node -> (why its agent says it cannot record runs, when it said so): memory only, every report
        # says it again (apiary.control.health reads it for /healthz).
        self.cannot_record: dict[str, tuple[str, float]] = {}
        self._node_lost_after_s = node_lost_after_s
        self.wake = threading.Event()  # set when a cycle is worth running now
        self.on_nodes_changed: Callable[[set[str]], None] = lambda nodes: None
        self._changed_nodes: set[str] = set()
        self.generation: dict[str, int] = {}
        self._needs_rebuild = False
        #: Most task instances one job may have, all roles together (``APIARY_MAX_INSTANCES``).
        self.max_instances = max_instances
        self.recover()

    @property
    def sessions(self) -> sessionmaker[Session]:
        """The store's session factory (the identity directory shares the store)."""
        return self._sessions

    # ------------------------------------------------------------------ caches of immutable facts
    def _spec(self, job: Job) -> JobSpec:
        spec = self._specs.get(job.id)
        if spec is None:
            # Stored jobs were accepted under the cap and rules of their day: never refuse one on reload.
            spec = self._specs[job.id] = parse_job(job.spec_yaml, max_instances=2**31, stored=True)
        return spec

    def _policy_of(self, job: Job) -> JobPolicy:
        policy = self._policies.get(job.id)
        if policy is None:
            policy = self._policies[job.id] = job_policy(job.id, self._spec(job))
        return policy

    # ------------------------------------------------------------------ commit, then apply
    def _after_commit(self, ops: list[SchedulerOp | NodeHealth], touched: set[str], jobs: set[str],
                      wake: bool) -> None:
        """Called by :meth:`Work.commit` once the store has the change: apply it to memory."""
        with self._lock:
            try:
                for op in ops:
                    self._apply(op)
            except Exception:  # memory no longer matches the store: rebuild it from the store
                logger.exception("applying a committed change to the scheduler failed; rebuilding it")
                self._rebuild()
            if self._cycle_changed is not None:
                self._cycle_changed |= jobs
            self._queue_dirty |= jobs
            self._changed_nodes |= touched
        self._flush_notifications()
        if wake:
            self.wake.set()

    def _apply(self, op: SchedulerOp | NodeHealth) -> None:
        self._sched_version += 1
        sched = self.scheduler
        if isinstance(op, Allocate):
            sched.allocate(op.job, op.request, op.placements)
        elif isinstance(op, Release):
            sched.release(op.job, None if op.instances is None else list(op.instances))
        elif isinstance(op, Cancel):
            sched.cancel(op.job)
        else:
            sched.set_node_health(op.node, op.schedulable)

    def _flush_notifications(self) -> None:
        """After the commit: bump the touched nodes' generations and wake their long polls.

        Bumping before the commit would let an agent read the new generation with the old
        assignments and then sleep through the change.
        """
        with self._lock:
            if not self._changed_nodes:
                return
            changed, self._changed_nodes = self._changed_nodes, set()
            for n in changed:
                self.generation[n] = self.generation.get(n, 0) + 1
        try:
            self.on_nodes_changed(changed)
        except Exception:  # a broken listener must not break scheduling
            logger.exception("on_nodes_changed failed")

    def _work(self, s: Session) -> Work:
        return Work(self, s, self._clock())

    # ------------------------------------------------------------------ recovery
    def _build_scheduler(self, config: ClusterConfig, s: Session) -> tuple[HivedScheduler, dict[str, str]]:
        """A scheduler for ``config`` holding the store's truth: every node's :func:`schedulable`,
        every unreleased placement (guaranteed jobs first, by priority). Returns it with
        ``{job: why}`` for the jobs whose placements it cannot hold."""
        sched = HivedScheduler(config, lazy_preemption=self._lazy)
        names = set(sched.nodes())
        rows = {r.name: r for r in s.scalars(select(Node)) if r.name in names}
        for name in names:
            sched.set_node_health(name, schedulable(rows.get(name)))
        by_job: dict[str, list[Placement]] = {}
        for p in s.scalars(select(Placement).where(Placement.released.is_(False)).order_by(Placement.id)):
            by_job.setdefault(p.job_id, []).append(p)
        jobs = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(list(by_job))))}
        dropped: dict[str, str] = {}
        order = sorted(by_job, key=lambda j: (jobs[j].priority < 0, -jobs[j].priority, jobs[j].submit_seq))
        for job_id in order:
            job = jobs[job_id]
            request = self._policy_of(job).request
            tps = [TaskPlacement(p.task_role, p.index, p.node, tuple(p.leaf_cells), tuple(p.gpus))
                   for p in by_job[job_id]]
            if request.virtual_cluster not in config.virtual_clusters:
                dropped[job_id] = f"VC {request.virtual_cluster} no longer exists"
                continue
            try:
                sched.allocate(job_id, request, tps)
            except ApiaryError as e:
                if request.priority < 0:
                    dropped[job_id] = f"no longer fits: {e.message}"
                    continue
                # A guaranteed job that lazy preemption downgraded runs as opportunistic: hold it so.
                try:
                    sched.allocate(job_id, replace(request, priority=-1), tps)
                except ApiaryError:
                    dropped[job_id] = f"no longer fits: {e.message}"
        return sched, dropped

    def _rebuild(self) -> None:
        """Replace the scheduler by one rebuilt from the store (lock held)."""
        try:
            with self._sessions() as s:
                sched, dropped = self._build_scheduler(self.cluster, s)
        except Exception:  # the store is unreadable too: try again at the next cycle
            logger.exception("rebuilding the scheduler from the store failed; retrying at the next cycle")
            self._needs_rebuild = True
            return
        if dropped:
            logger.error("rebuild: placements the scheduler cannot hold: %s", dropped)
        self.scheduler = sched
        self._sched_version += 1
        self._queue = None  # in doubt: the next cycle reads the whole queue again
        self._needs_rebuild = False
        gcpolicy.settle()  # the old cell tree is cyclic garbage, maybe frozen: collect it now

    def recover(self) -> None:
        """Rebuild memory from the store (at start, after a restart): the scheduler (allocations and
        node health from :func:`schedulable`), and a fresh heartbeat grace period for every known node,
        so a control-plane restart never declares nodes lost. A node keeps the health it had (its
        agent normally still runs); one that never reports again is lost after the grace period."""
        now = self._clock()
        with self._lock, self._sessions() as s:
            self.scheduler, dropped = self._build_scheduler(self.cluster, s)
            self._sched_version += 1
            self._queue = None
            self._needs_rebuild = False
            if dropped:
                logger.error("recover: placements the scheduler cannot hold: %s", dropped)
            self._reported.clear()
            for row in s.scalars(select(Node)):
                self._heartbeats[row.name] = now
                self._reported[row.name] = _Seen(
                    (row.gpus, row.simulated_gpus, row.address, row.agent_id, row.metrics_url),
                    bool(row.healthy), row.last_heartbeat or 0.0,
                )
            held = len(self.scheduler.groups())
            if held:
                logger.info("recovered placements jobs=%d", held)
        self.wake.set()

    def check_consistency(self) -> list[str]:
        """Differences between the store and the scheduler; [] when they agree.

        Compares every committed, unreleased placement with the scheduler's allocations (job, task
        instance, node, leaf cells) both ways, and every node's :func:`schedulable` with the
        scheduler's node health. Each item is a sentence naming the job or node.
        """
        problems: list[str] = []
        with self._lock, self._sessions() as s:
            store: dict[str, dict[tuple[str, int], tuple[str, tuple[int, ...]]]] = {}
            for p in s.scalars(select(Placement).where(Placement.released.is_(False))):
                store.setdefault(p.job_id, {})[(p.task_role, p.index)] = (p.node, tuple(sorted(p.leaf_cells)))
            mem = {
                name: {(p.task_role, p.index): (p.node, tuple(sorted(p.leaf_cell_indices)))
                       for p in self.scheduler.group_of(name)}
                for name in self.scheduler.groups()
            }
            for job_id in sorted(set(store) | set(mem)):
                a, b = store.get(job_id, {}), mem.get(job_id, {})
                if a != b:
                    problems.append(f"job {job_id}: store holds {sorted(a.items())}, scheduler {sorted(b.items())}")
            rows = {r.name: r for r in s.scalars(select(Node))}
            health = {n: v["healthy"] for n, v in self.scheduler.status()["nodes"].items()}
            for name in sorted(self._node_names):
                if health.get(name) != schedulable(rows.get(name)):
                    problems.append(f"node {name}: schedulable {schedulable(rows.get(name))} in the store, "
                                    f"{health.get(name)} in the scheduler")
        return problems

    # ------------------------------------------------------------------ jobs
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
        self._intake.put(pending)
        with self._lock:
            # Group commit (apiary.control.intake): the first submitter to get the lock commits every
            # queued submission, so ours may already be answered by the time we get here.
            while not pending.done and self._commit_intake():
                pass
        return pending.result()  # RuntimeError if it was drained but never settled (a bug)

    #: Most submissions committed in one transaction (one multi-row INSERT per table).
    INTAKE_BATCH = 64

    def _commit_intake(self) -> bool:
        """Commit the queued submissions (lock held): one transaction for a batch of up to
        :data:`INTAKE_BATCH`, each settled with its job's JSON or its error. A name already taken
        (in the store or earlier in the batch) refuses that submission only; a store that cannot
        commit refuses the batch (nothing of it was accepted or applied). False if none was queued."""
        batch = self._intake.drain(self.INTAKE_BATCH)
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

        New jobs are rows only, with no scheduler operation, so the commit goes without a
        :class:`Work`: multi-row inserts (:func:`insert_new_jobs`), the commit, then memory (the
        specs, the queue's dirty set, a wake for the scheduling loop)."""
        with self._sessions() as s:
            now = self._clock()
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
                    self.scheduler.validate(p.policy.request)
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
                    s.commit()
            except ConflictError:
                s.rollback()
                self._next_seq = None
                if len(accepted) == 1:
                    accepted[0].settle(error=self._name_taken(accepted[0]))
                raise
            except Exception:
                s.rollback()
                self._next_seq = None  # re-read from the store: the failed batch's numbers are free again
                raise
        self._next_seq += len(accepted)
        for p in accepted:
            self._specs[p.job_id], self._policies[p.job_id] = p.spec, p.policy
        self._after_commit([], set(), {p.job_id for p in accepted}, True)
        for p, (row, tasks) in zip(accepted, rows, strict=True):
            logger.info("accepted job=%s vc=%s priority=%s", p.job_id, p.spec.virtual_cluster, p.spec.priority_class)
            # The answer is the rows as inserted: no query. A new job's tasks have no node yet.
            p.settle(answer=job_json(s, row, tasks, simulated=set()))

    @staticmethod
    def _name_taken(p: PendingSubmission) -> ConflictError:
        return ConflictError(f"Job name {p.spec.name} already exists for user {p.user}.")

    def stop(self, job_id: str) -> dict:
        """OpenPAI's ``executionType: STOP``. Idempotent; a finished job is returned unchanged.
        Raises NotFoundError, UnavailableError (the store cannot commit)."""
        with self._lock, self._sessions() as s:
            w = self._work(s)
            loaded = w.load(job_id)
            if loaded is None:
                raise NotFoundError(f"Job {job_id} not found.")
            w.step(job_id, StopRequested())
            w.commit("stop")
            return job_json(s, loaded.row)

    def tag_job(self, job_id: str, tag: str) -> dict:
        """Add ``tag`` to the job's tags (OpenPAI alert handler's tag-jobs). Idempotent."""
        with self._lock, self._sessions() as s, store_errors("tag job"):
            job = self._get_job(s, job_id)
            if tag not in (job.tags or []):
                job.tags = [*(job.tags or []), tag]
                s.add(Event(time=self._clock(), job_id=job_id, type="job.tagged", data={"tag": tag}))
                s.commit()
            return job_json(s, job)

    def reconfigure(self, source: str | bytes) -> dict:
        """Apply a changed HiveD cluster config with jobs running (HiveD's reconfiguration).

        Jobs whose cells still exist and whose VC still has quota keep running untouched; a job with lazy
        preemption that its VC can no longer hold runs on as opportunistic (event ``job.downgraded``);
        every other job's attempt is stopped and retried as a platform retry, with the reason. Its cells
        are released at once (the new config does not hold them). Returns ``{"kept": [job], "stopped":
        {job: reason}}``. Raises ValidationError (nothing changes) for an illegal config, the same
        checks ``apiary up`` runs (:func:`apiary.control.config.check_cluster_config`).
        """
        config = check_cluster_config(source)
        text = source.decode() if isinstance(source, bytes) else source
        with self._lock, self._sessions() as s:
            new, dropped = self.scheduler.reconfigured(config)
            w = self._work(s)
            # Jobs the new config keeps only as opportunistic run on (HiveD's lazy preemption).
            for job_id in sorted(set(new.downgraded()) - set(self.scheduler.downgraded()) - set(dropped)):
                w.step(job_id, Downgraded(by="cluster-config"))
            stopped: dict[str, str] = {}
            for job_id, why in sorted(dropped.items()):
                loaded = w.load(job_id)
                if loaded is None or loaded.record.state.is_final:
                    continue
                w.step(job_id, Reconfigured(why))
                stopped[job_id] = why
                for prow in loaded.placements.values():
                    prow.released = True
                loaded.placements.clear()
            kept = sorted(set(new.groups()) - set(stopped))
            staged = None
            if self.config_path is not None:  # a restart must come back with the applied config
                staged = self.config_path.with_name(self.config_path.name + ".new")
                staged.write_text(text)
            w.commit("reconfigure")
            if staged is not None and self.config_path is not None:
                staged.replace(self.config_path)
            # The steps' releases went to the old scheduler; the new one never held the stopped jobs.
            self.scheduler, self.cluster = new, config
            self._sched_version += 1
            self._queue = None
            self._node_names = frozenset(new.nodes())
            gcpolicy.settle()  # the old cell tree is cyclic garbage, maybe frozen: collect it now
            logger.info("cluster config applied kept=%d stopped=%d", len(kept), len(stopped))
        self.wake.set()
        return {"kept": kept, "stopped": stopped}

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
        with self._lock, self._sessions() as s, store_errors("set flow runs"):
            known = set(s.scalars(select(Job.id).where(Job.id.in_(list(links)))))
            holders = flow_run_holders(s, {links[j] for j in known})
            for job_id in sorted(known):
                held = holders.setdefault(links[job_id], set())
                if held - {job_id}:
                    raise flow_run_taken(links[job_id], held - {job_id})
                held.add(job_id)
            if known:
                s.execute(update(Job), [{"id": j, "flow_run_id": links[j]} for j in sorted(known)])
            s.commit()
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
        with self._sessions() as s:
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
        with self._sessions() as s:
            return job_json(s, self._get_job(s, job_id))

    def job_owner(self, job_id: str) -> tuple[str, str]:
        """``(user, virtual cluster)`` of a job, for access checks. Raises NotFoundError."""
        with self._sessions() as s:
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
        with self._sessions() as s:
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
        with self._sessions() as s:
            q = select(Event).where(Event.seq > after).order_by(Event.seq).limit(min(max(limit, 1), 5000))
            if job_id:
                q = q.where(Event.job_id == job_id)
            if user:
                q = q.where(Event.job_id.startswith(f"{user}~", autoescape=True))
            return [
                {"seq": e.seq, "time": e.time, "jobId": e.job_id, "type": e.type, "data": e.data}
                for e in s.scalars(q)
            ]

    # ------------------------------------------------------------------ scheduling
    def cycle(self) -> CycleResult:
        """One scheduling cycle (Kueue-style numbered steps). Safe to call from any thread; cycles run
        one at a time, and the plane's lock is taken per step, not for the whole queue.

        Raises UnavailableError when the store cannot commit (nothing of the failed step applied).
        """
        t0 = time.perf_counter()
        result = CycleResult()
        with self._cycle_lock:
            try:
                self._cycle(result)
            finally:
                with self._lock:
                    self._cycle_changed = None
        result.duration_ms = (time.perf_counter() - t0) * 1000
        return result

    def _cycle(self, result: CycleResult) -> None:
        with self._lock:
            if self._needs_rebuild:
                self._rebuild()
            # 1. Lost nodes first, so their tasks' cells are not counted as busy below.
            self._check_lost_nodes()
            # 2. Heads: a snapshot of every job with instances to place, highest priority first, then
            # FIFO. Jobs committed after it are skipped this cycle (their change woke the next one).
            self._cycle_changed = set()
            version = self._sched_version
            with self._sessions() as s:
                heads, only_changed = self._snapshot(s)
            # A plain "wait" is remembered with the scheduler's state version: schedule() is a
            # deterministic function of that state and the request (apiary.scheduler.hived), so
            # while neither changed the answer is the same and the job is not asked again. When the
            # last cycle left every job of the queue remembered at the version there is now, only the
            # jobs committed since need deciding (only_changed); the others keep their answers.
            waits: dict[str, _WaitKey] = self._waits if only_changed else {}
        new_waits: list[tuple[_Head, str, int]] = []  # (head, new reason, version it was decided at)
        remaining = iter(heads)
        finished = False
        while not finished:
            # The lock is taken per slice of the queue, neither per head (a remembered wait costs
            # microseconds, the lock's hand-over to a waiting submission far more) nor for the whole
            # queue: submissions and node reports wait at most about LOCK_SLICE_S, plus one admission.
            with self._lock:
                until = time.perf_counter() + LOCK_SLICE_S
                for head in remaining:
                    self._nominate(head, result, waits, new_waits)
                    if time.perf_counter() >= until:
                        break
                else:
                    finished = True
                    self._record_waits(new_waits, result, waits)
                    self._waits = waits
                    if only_changed:  # the result names every waiting job, decided now or before
                        for job_id, key in waits.items():
                            result.waiting.setdefault(job_id, key[3] or "")
                    # Settled: every job of the queue has its answer remembered at the current
                    # version, or was committed since the snapshot (the next one reads it again).
                    settled = (not only_changed or version == self._sched_version) and all(
                        waits.get(h.job_id, (None,))[0] == self._sched_version or h.job_id in self._queue_dirty
                        for h in heads
                    )
                    self._settled = self._sched_version if settled else None

    def _nominate(self, head: _Head, result: CycleResult, waits: dict[str, _WaitKey],
                  new_waits: list[tuple[_Head, str, int]]) -> None:
        """Steps 3 and 4 of a cycle for one head (lock held)."""
        if head.job_id in (self._cycle_changed or ()):
            return
        key = (self._sched_version, head.attempt, head.pending, head.reason)
        if self._waits.get(head.job_id) == key:
            waits[head.job_id] = key
            result.waiting[head.job_id] = head.reason or ""
            return
        # 3. Nominate: ask the pure scheduler. A job the current config cannot take any more
        # (its VC was removed) waits with the reason; it never stops the cycle for the others.
        policy = self._policies.get(head.job_id)
        if policy is None:
            with self._sessions() as s:
                job = s.get(Job, head.job_id)
                if job is None:
                    return
                policy = self._policy_of(job)
        try:
            decision = self.scheduler.schedule(replace(policy.request, pending=head.pending))
        except UserError as e:
            decision = Decision("wait", reason=f"Cannot be scheduled with the current cluster config: "
                                               f"{e.message}")
        if decision.kind == "wait" and not decision.downgraded:
            if decision.reason == head.reason:
                result.waiting[head.job_id] = decision.reason  # nothing new to write
                waits[head.job_id] = key
            else:
                # 4a. Only the reason is new (a job's first cycle): written with others in one
                # transaction, one commit for up to WAIT_BATCH jobs instead of one each.
                new_waits.append((head, decision.reason, key[0]))
                if len(new_waits) >= WAIT_BATCH:
                    self._record_waits(new_waits, result, waits)
            return
        # 4. Admit: commit the decision, then apply it; the waits decided before it first, at the
        # version they were decided at.
        self._record_waits(new_waits, result, waits)
        self._sched_version += 1  # cells reserved, a plan made or victims downgraded
        self._admit(head, decision, result)

    def _snapshot(self, s: Session) -> tuple[list[_Head], bool]:
        """Step 2's snapshot, highest priority first, then FIFO (lock held), and whether it holds only
        the jobs committed since the last one (the last cycle settled every other job).

        The store is read for the jobs committed since the last snapshot only; the rest of the
        queue is the last snapshot's, which no commit has touched since. The whole queue is read
        instead at start, after a rebuild or a new config, and every QUEUE_REREAD_S.
        """
        now = time.monotonic()
        dirty = sorted(self._queue_dirty)
        self._queue_dirty = set()
        if self._queue is None or now - self._queue_read_at >= QUEUE_REREAD_S:
            self._queue = self._heads(s)
            self._queue_read_at = now
            self._settled = None
        else:
            for job_id in dirty:
                self._queue.pop(job_id, None)
            for i in range(0, len(dirty), 500):  # well under any database's bound-parameter limit
                self._queue.update(self._heads(s, dirty[i:i + 500]))
            for job_id in dirty:
                if job_id not in self._queue:
                    self._waits.pop(job_id, None)  # it left the queue
        settled, self._settled = self._settled == self._sched_version, None  # until this cycle settles all again
        if settled:
            # Every other job is remembered at this version (see _cycle): only these need deciding.
            changed = [self._queue[j] for j in dirty if j in self._queue]
            return [head for _, head in sorted(changed, key=lambda kh: kh[0])], True
        return [head for _, head in sorted(self._queue.values(), key=lambda kh: kh[0])], False

    def _heads(self, s: Session, job_ids: list[str] | None = None) -> dict[str, tuple[tuple[int, float, int], _Head]]:
        """Every job with instances to place (or those of ``job_ids``): job -> (order, head), the
        order being (-priority, submission time, arrival number)."""
        q = (
            select(Job.id, Job.attempt, Job.waiting_reason, Job.priority, Job.submission_time, Job.submit_seq,
                   Task.task_role, Task.index)
            .join(Task, (Task.job_id == Job.id) & (Task.attempt == Job.attempt))
            .join(Attempt, (Attempt.job_id == Job.id) & (Attempt.index == Job.attempt))
            .where(Job.state.in_([JobState.WAITING.value, JobState.RUNNING.value]), Job.execution_type == "START",
                   Attempt.outcome.is_(None), Task.latest.is_(True), Task.state == TaskState.WAITING.value)
            .order_by(Job.id, Task.id)
        )
        if job_ids is not None:
            q = q.where(Job.id.in_(job_ids))
        heads: dict[str, tuple[tuple[int, float, int], _Head]] = {}
        current: tuple[str, int, str | None, tuple[int, float, int]] | None = None
        pending: list[tuple[str, int]] = []
        for job_id, attempt, reason, priority, submitted, seq, role, index in s.execute(q):
            if current is not None and current[0] != job_id:
                heads[current[0]] = (current[3], _Head(current[0], current[1], tuple(pending), current[2]))
                pending = []
            current = (job_id, attempt, reason, (-priority, submitted, seq))
            pending.append((role, index))
        if current is not None:
            heads[current[0]] = (current[3], _Head(current[0], current[1], tuple(pending), current[2]))
        return heads

    def _record_waits(self, new_waits: list[tuple[_Head, str, int]], result: CycleResult,
                      waits: dict[str, _WaitKey]) -> None:
        """Step 4 for plain waits with a new reason: ``new_waits`` (emptied) in one transaction (lock held).

        A job whose snapshot no longer holds (it changed since), or whose decision was made on a
        scheduler state that has changed since, is left out: the next cycle decides it afresh.
        Raises UnavailableError when the store cannot commit (nothing of the batch recorded).
        """
        batch = [b for b in new_waits if b[2] == self._sched_version and b[0].job_id not in (self._cycle_changed or ())]
        new_waits.clear()
        if not batch:
            return
        written: list[tuple[_Head, str, int]] = []
        with self._sessions() as s:
            w = self._work(s)
            w.load_many([head.job_id for head, _, _ in batch])
            for head, reason, version in batch:
                loaded = w.load(head.job_id)
                if loaded is None:
                    continue
                rec = loaded.record
                if not rec.schedulable() or rec.attempt.index != head.attempt or tuple(rec.pending()) != head.pending:
                    continue
                w.step(head.job_id, Waiting(reason))
                written.append((head, reason, version))
            if not written:
                return
            w.commit("scheduling cycle")
        for head, reason, version in written:
            result.waiting[head.job_id] = reason
            waits[head.job_id] = (version, head.attempt, head.pending, reason)

    def _admit(self, head: _Head, decision: Decision, result: CycleResult) -> None:
        job_id = head.job_id
        with self._sessions() as s:
            w = self._work(s)
            loaded = w.load(job_id)
            if loaded is None:
                return
            rec = loaded.record
            if not rec.schedulable() or rec.attempt.index != head.attempt or tuple(rec.pending()) != head.pending:
                return  # changed since the snapshot; the next cycle sees it afresh
            for victim in decision.downgraded:
                w.step(victim, Downgraded(by=job_id))
            preempted: list[str] = []
            if decision.kind == "place" and decision.placements:
                w.step(job_id, Placed(decision.placements, decision.reason))
            elif decision.kind == "preempt":
                for victim in decision.victims:
                    fx = w.step(victim, Preempted(by=job_id))
                    if fx is not None and fx.decided:
                        preempted.append(victim)
                w.step(job_id, Waiting(decision.reason))
            else:
                w.step(job_id, Waiting(decision.reason))
            w.commit("scheduling cycle")
        if decision.kind == "place" and decision.placements:
            result.placed.append(job_id)
            logger.info("placed job=%s attempt=%d tasks=%d", job_id, head.attempt, len(decision.placements))
        for victim in preempted:
            logger.info("preempting job=%s by=%s", victim, job_id)
        result.preempted.extend(preempted)
        if rec.waiting_reason is not None and rec.pending():
            result.waiting[job_id] = rec.waiting_reason

    def _check_lost_nodes(self) -> None:
        """Nodes silent for longer than ``node_lost_after_s``: unhealthy, their runs failed (lock held)."""
        now = self._clock()
        lost = sorted(n for n, seen in self._heartbeats.items()
                      if now - seen > self._node_lost_after_s and n in self._node_names)  # (a reconfig drops nodes)
        if not lost:
            return
        with self._sessions() as s:
            w = self._work(s)
            for name in lost:
                row = s.get(Node, name)
                if row is None or not row.healthy:
                    continue
                row.healthy = False
                w.node_health(name, schedulable(row))
                logger.warning("node=%s lost: no report for %.0f s", name, now - self._heartbeats[name])
                job_ids = list(dict.fromkeys(s.scalars(  # in arrival order, as the simulator does
                    select(Task.job_id).join(Job, Job.id == Task.job_id)
                    .where(Task.node == name, Task.state.in_(ACTIVE_TASK_STATES))
                    .order_by(Job.submission_time, Job.submit_seq)
                )))
                for job_id in job_ids:
                    w.step(job_id, NodeLost(name))
            if not w.ops:
                return
            w.commit("node lost")
            for name in lost:
                if name in self._reported:
                    self._reported[name] = replace(self._reported[name], healthy=False)

    # ------------------------------------------------------------------ nodes
    def _known_node(self, node: str) -> None:
        if node not in self._node_names:
            raise NotFoundError(f"Node {node} is not in the cluster config.")

    def node_report(self, node: str, *, gpus: int, simulated_gpus: bool, address: str, agent_id: str,
                    runs: Iterable[dict], metrics_url: str | None = None, faults_applied: int | None = None,
                    cannot_record: str | None = None) -> dict:
        """Apply an agent's heartbeat and run statuses (``TaskStatus`` dicts). Idempotent.

        Returns ``{"ack": [run_id]}``: runs whose final status is recorded (the agent may forget
        them). ``faults_applied``: the agent's high-water mark of applied fault ids (those faults are
        deleted). ``cannot_record``: why the agent cannot record runs now (it launches nothing new
        meanwhile), None when it can; kept in memory for ``/healthz``
        (:func:`apiary.control.health.health_problems`). Raises NotFoundError for a node the cluster
        config does not declare,
        UnavailableError (503) when the store cannot commit (the agent resends). The node's row of a
        known healthy node whose facts did not change is written at most every
        :data:`~apiary.control.nodes.HEARTBEAT_PERSIST_S` (a bare heartbeat then touches only memory;
        a report with runs writes only the runs).
        """
        self._known_node(node)
        runs = list(runs)
        now = self._clock()
        info = (gpus, simulated_gpus, address, agent_id, metrics_url)
        with self._lock:
            self._heartbeats[node] = now
            if cannot_record:
                if node not in self.cannot_record:
                    logger.error("node=%s cannot record runs: %s", node, cannot_record)
                self.cannot_record[node] = (cannot_record, now)
            elif self.cannot_record.pop(node, None) is not None:
                logger.warning("node=%s can record runs again", node)
            seen = self._reported.get(node)
            new_mark = faults_applied is not None and (seen is None or faults_applied != seen.faults_applied)
            # The node's row already says all this (healthy, same facts, a heartbeat written within
            # HEARTBEAT_PERSIST_S): leave it alone, whether or not the report carries runs.
            fresh = (not new_mark and seen is not None and seen.info == info and seen.healthy
                     and now - seen.beat < HEARTBEAT_PERSIST_S)
            if fresh and not runs:
                return {"ack": []}
            ack: list[str] = []
            with self._sessions() as s:
                w = self._work(s)
                if not fresh:
                    row = s.get(Node, node)
                    if row is None:
                        row = Node(name=node, cordoned=False)
                        s.add(row)
                    was = schedulable(row) if row.healthy is not None else False
                    if row.healthy is False:
                        logger.info("node=%s healthy again", node)
                    row.gpus, row.simulated_gpus, row.address, row.agent_id, row.metrics_url = info
                    row.healthy = True
                    row.last_heartbeat = now
                    if schedulable(row) != was or seen is None or not seen.healthy:
                        w.node_health(node, schedulable(row))
                if new_mark:  # the agent applied these: they leave the queue
                    s.execute(delete(NodeFault).where(NodeFault.node == node, NodeFault.id <= faults_applied))
                for run in runs:
                    owner = s.execute(select(Task.job_id, Task.node).where(Task.run_id == run["run_id"])).first()
                    if owner is None:
                        ack.append(run["run_id"])  # unknown to us: the agent should stop and forget it
                        continue
                    job_id = owner[0]
                    if owner[1] != node:  # a run placed elsewhere: never let this node decide it
                        logger.warning("refused report node=%s run=%s: the run is placed on %s",
                                       node, run["run_id"], owner[1])
                        ack.append(run["run_id"])
                        continue
                    fx = w.step(job_id, RunReported(
                        node=node, run_id=run["run_id"], exited=run.get("state") == "exited",
                        exit_code=run.get("exit_code"), started_at=run.get("started_at"),
                        finished_at=run.get("finished_at"), pid=run.get("pid"), lost=bool(run.get("lost")),
                    ))
                    if fx is not None and fx.ack:
                        ack.append(run["run_id"])
                w.wake = w.wake or bool(runs)
                w.commit("node report")
            mark = faults_applied if faults_applied is not None else (seen.faults_applied if seen else None)
            self._reported[node] = _Seen(info, True, seen.beat if fresh and seen else now, mark)
        return {"ack": ack}

    def cordon(self, node: str, cordoned: bool = True) -> dict:
        """Cordon (no new placements; running tasks keep going until they end) or uncordon a node,
        as ``kubectl cordon`` does. Durable. Idempotent. Raises NotFoundError for an unknown node."""
        self._known_node(node)
        with self._lock, self._sessions() as s:
            w = self._work(s)
            row = s.get(Node, node)
            if row is None:
                row = Node(name=node, healthy=False)
                s.add(row)
            if bool(row.cordoned) != cordoned:
                logger.info("node=%s %s", node, "cordoned" if cordoned else "uncordoned")
            row.cordoned = cordoned
            w.node_health(node, schedulable(row))
            w.commit("cordon")
        return next(n for n in self.list_nodes() if n["name"] == node)

    def jobs_on_node(self, node: str) -> list[str]:
        """Ids of the jobs with a live task on ``node``, in arrival order. Raises NotFoundError."""
        self._known_node(node)
        with self._sessions() as s:
            return list(dict.fromkeys(s.scalars(
                select(Task.job_id).join(Job, Job.id == Task.job_id)
                .where(Task.node == node, Task.state.in_(ACTIVE_TASK_STATES))
                .order_by(Job.submission_time, Job.submit_seq))))

    def drain(self, node: str, reason: str | None = None) -> list[str]:
        """``kubectl drain``: cordon ``node`` and stop its jobs' runs there; each such job's attempt
        ends as if the node were lost (exit -1001 PodNodeLost, a platform failure that is always
        retried), so it is re-placed elsewhere as a platform retry and loses no user retry. The
        agent stops the runs (they leave the node's assignments). Returns the jobs moved. Durable,
        idempotent (a drained node has nothing left to move). Raises NotFoundError."""
        self.cordon(node, True)
        with self._lock, self._sessions() as s:
            w = self._work(s)
            job_ids = list(dict.fromkeys(s.scalars(
                select(Task.job_id).join(Job, Job.id == Task.job_id)
                .where(Task.node == node, Task.state.in_(ACTIVE_TASK_STATES))
                .order_by(Job.submission_time, Job.submit_seq))))
            for job_id in job_ids:
                w.step(job_id, NodeLost(node, reason or f"Node {node} was drained."))
            w.wake = True
            if w.ops or job_ids:
                w.commit("drain")
        logger.info("node=%s drained jobs=%s", node, job_ids)
        return job_ids

    def untag_job(self, job_id: str, tag: str) -> dict:
        """Remove ``tag`` from the job's tags (the undo of :meth:`tag_job`). Idempotent."""
        with self._lock, self._sessions() as s, store_errors("untag job"):
            job = self._get_job(s, job_id)
            if tag in (job.tags or []):
                job.tags = [t for t in (job.tags or []) if t != tag]
                s.add(Event(time=self._clock(), job_id=job_id, type="job.untagged", data={"tag": tag}))
                s.commit()
            return job_json(s, job)

    def node_events(self, node: str, limit: int = 10) -> list[dict]:
        """The newest ``limit`` events of the jobs with tasks on ``node`` (any attempt), newest first:
        an incident's evidence."""
        with self._sessions() as s:
            job_ids = select(Task.job_id).where(Task.node == node).distinct()
            rows = s.scalars(select(Event).where(Event.job_id.in_(job_ids)).order_by(Event.seq.desc()).limit(limit))
            return [{"seq": e.seq, "time": e.time, "jobId": e.job_id, "type": e.type} for e in rows]

    def assignments(self, node: str) -> list[dict]:
        """The task runs ``node`` should be running now, with everything needed to launch them.

        Each item: ``{"runId", "desired": "RUN"|"STOP", "launch": TaskLaunch fields, "probes", "labels"}``.
        A run absent from the list must not run on the node.
        """
        # An agent reads this after every change to its node (a run placed or told to stop): one
        # query for the node's runs with their jobs and placements, one for the nodes they name,
        # and the attempt's other runs only for a job of more than one instance (their hosts).
        with self._sessions() as s:
            rows = list(s.execute(
                select(Task, Job, Placement.leaf_cells)
                .join(Job, Job.id == Task.job_id)
                .outerjoin(Placement, and_(Placement.job_id == Task.job_id, Placement.attempt == Task.attempt,
                                           Placement.task_role == Task.task_role, Placement.index == Task.index))
                .where(Task.node == node, Task.state.in_(ACTIVE_TASK_STATES))
                .order_by(Task.id)
            ).tuples())
            peers: dict[tuple[str, int], list[Task]] = {}
            for t, job, _ in rows:
                if (job.id, t.attempt) not in peers:
                    single = sum(r.instances for r in self._spec(job).task_roles.values()) == 1
                    peers[(job.id, t.attempt)] = [t] if single else latest_tasks(s, job, t.attempt)
            names = {p.node for ps in peers.values() for p in ps if p.node} | {node}
            nodes = {name: (address, simulated) for name, address, simulated in s.execute(
                select(Node.name, Node.address, Node.simulated_gpus).where(Node.name.in_(names)))}
            out = []
            for t, job, leaf_cells in rows:
                spec = self._spec(job)
                out.append({
                    "runId": t.run_id, "desired": t.desired,
                    "launch": self._launch(job, t, peers[(job.id, t.attempt)], nodes, leaf_cells),
                    "probes": probes_to_wire(*parse_probes(spec.extras, t.task_role)),
                    # For the node's task metrics (apiary_task_*{job,user,virtual_cluster,task_role,index}).
                    "labels": {"job": job.id, "user": job.user, "virtual_cluster": job.virtual_cluster,
                               "task_role": t.task_role, "index": str(t.index)},
                })
            return out

    def _launch(self, job: Job, task: Task, peers: list[Task], nodes: dict[str, tuple[str | None, bool | None]],
                leaf_cells: list | None) -> dict:
        """``task``'s launch fields: ``peers`` are its attempt's latest runs (itself included),
        ``nodes`` maps node name -> (address, simulated GPUs) for them, ``leaf_cells`` its placement's."""
        spec = self._spec(job)
        tr = spec.task_roles[task.task_role]
        # A node that never told its address (no row, or none in it) is taken to be this host.
        host_ips = {(t.task_role, t.index): (nodes[t.node][0] if t.node in nodes else None) or "127.0.0.1"
                    for t in peers if t.node}
        env = build_task_env(
            job_id=job.id,
            user=job.user,
            job_name=job.name,
            task_roles={r: x.instances for r, x in spec.task_roles.items()},
            host_ips=host_ips,
            ports=None,
            task_role=task.task_role,
            index=task.index,
            gpus=list(task.gpus or []),
            attempt=task.attempt,
            simulated_gpus=bool(task.node in nodes and nodes[task.node][1]),
        )
        prereq = next(
            (p for p in (spec.prerequisites or []) if p.type == "dockerimage" and p.name == tr.docker_image), None
        )
        image = prereq.uri if prereq is not None else None
        auth = getattr(prereq, "auth", None)
        image_auth = None
        if prereq is not None and auth is not None:
            # The schema asks for the password as a <% $secrets.x %> reference: resolved here, for
            # the one agent that runs the task (the assignments route serves a node its own runs only).
            context = spec.template_context(task.task_role)
            image_auth = {k: render(v, context, f"prerequisites.{prereq.name}.auth.{k}")
                          for k, v in auth.model_dump(exclude_none=True).items()}
        return {
            "run_id": task.run_id,
            "job_id": job.id,
            "user": job.user,
            "job_name": job.name,
            "task_role": task.task_role,
            "index": task.index,
            "commands": spec.render_commands(task.task_role),
            "env": env,
            "gpus": list(task.gpus or []),
            "image": image,
            "cpu": tr.resource_per_instance.cpu,
            "memory_mb": tr.resource_per_instance.memory_mb,
            "virtual_cluster": job.virtual_cluster,
            "leaf_cells": list(leaf_cells) if leaf_cells is not None else [],
            "image_auth": image_auth,
            "ports": dict(tr.resource_per_instance.ports or {}),
            "probes": probes_to_wire(*parse_probes(spec.extras, task.task_role)),
        }

    def list_nodes(self) -> list[dict]:
        """Every node of the cluster config: its row's facts, GPUs in use, last heartbeat, and
        ``schedulable`` (the one derivation the scheduler follows)."""
        with self._lock:
            infos = self.scheduler.nodes()
            beats = dict(self._heartbeats)
        with self._sessions() as s:
            rows = {n.name: n for n in s.scalars(select(Node))}
            used: dict[str, int] = {}
            for p in s.scalars(select(Placement).where(Placement.released.is_(False))):
                used[p.node] = used.get(p.node, 0) + len(p.gpus)
        out = []
        for name, info in infos.items():
            row = rows.get(name)
            out.append(
                {
                    "name": name,
                    "gpus": row.gpus if row else info.gpus,
                    "simulatedGpus": bool(row.simulated_gpus) if row else None,
                    "healthy": bool(row.healthy) if row else False,
                    "ready": row is not None and bool(row.healthy),
                    "cordoned": bool(row.cordoned) if row else False,
                    "schedulable": schedulable(row),
                    "address": row.address if row else None,
                    "skuType": info.sku_type,
                    "gpusUsed": used.get(name, 0),
                    "lastHeartbeat": iso(beats.get(name, row.last_heartbeat if row else None)),
                    "metricsUrl": row.metrics_url if row else None,
                }
            )
        return out

    def cluster_status(self, vc: str | None = None) -> dict:
        """The scheduler's view (``HivedScheduler.status``), read under the plane's lock: VCs (quota /
        used / free / opportunistic / bad cells per level), nodes, groups' placements, reservations;
        ``vc`` narrows it to one virtual cluster. Raises NotFoundError for an unknown VC."""
        with self._lock:
            if vc is not None and vc not in self.cluster.virtual_clusters:
                raise NotFoundError(f"Virtual cluster {vc} not found.")
            return self.scheduler.status(vc)

    def node_generation(self, node: str) -> int:
        """The node's assignment generation: bumped after every commit that changes what the node
        should run (the agents' long poll waits for a change of it). 0 for a node never touched."""
        return self.generation.get(node, 0)

    # ------------------------------------------------------------------ metrics and faults
    def metrics_snapshot(self) -> dict:
        """What :class:`~apiary.monitoring.PlatformCollector` renders on a scrape: job counts per VC
        and state, waiting jobs, preemptions per VC, VC cells, nodes, agent heartbeats. A few
        aggregate queries over committed state, and the scheduler's status under the lock."""
        with self._sessions() as s:
            jobs: dict[str, dict[str, int]] = {
                vc: {st.value: 0 for st in JobState} for vc in self.cluster.virtual_clusters
            }
            for vc, state, n in s.execute(select(Job.virtual_cluster, Job.state, func.count()).group_by(
                    Job.virtual_cluster, Job.state)):
                jobs.setdefault(vc, {})[state] = n
            waiting = [
                {"job": j, "user": u, "virtual_cluster": vc, "submitted_at": t}
                for j, u, vc, t in s.execute(select(Job.id, Job.user, Job.virtual_cluster, Job.submission_time)
                                             .where(Job.state == JobState.WAITING.value))
            ]
            preemptions: dict[str, int] = {}
            for vc, n in s.execute(select(Job.virtual_cluster, func.count()).join(Event, Event.job_id == Job.id)
                                   .where(Event.type == "job.preempted").group_by(Job.virtual_cluster)):
                preemptions[vc] = n
            nodes = [{"node": n.name, "healthy": bool(n.healthy), "cordoned": bool(n.cordoned)}
                     for n in s.scalars(select(Node))]
        status = self.cluster_status()
        vc_cells = {
            vc: {"used": v.get("used", 0), "free": v.get("free", 0), "opportunistic": v.get("opportunisticUsed", 0),
                 "bad": v.get("badCells", 0)}
            for vc, v in status.get("virtualClusters", {}).items()
        }
        with self._lock:
            beats = dict(self._heartbeats)
        heartbeats = [{"service": "node-agent", "instance": n, "timestamp": t} for n, t in beats.items()]
        return {"now": self._clock(), "jobs": jobs, "waiting_jobs": waiting, "preemptions": preemptions,
                "vc_cells": vc_cells, "nodes": nodes, "heartbeats": heartbeats}

    def node_faults(self, node: str) -> list[dict]:
        """Simulated-GPU faults queued for ``node``'s agent, oldest first: ``{"id", "gpu", ...}``.
        Ids never repeat (not even across restarts), so the agent applies each once: those above its
        high-water mark. A fault stays queued until the agent reports it applied."""
        with self._sessions() as s:
            return [{"id": f.id, "gpu": f.gpu, **f.fault}
                    for f in s.scalars(select(NodeFault).where(NodeFault.node == node).order_by(NodeFault.id))]

    def inject_fault(self, node: str, gpu: int, **fault: object) -> dict:
        """Queue a simulated-GPU fault (DCGM error injection) or ``clear=True`` for ``node``'s agent,
        which applies it to its simulated GPUs on its next long poll. Durable. Returns the queued
        fault ``{"id", "gpu", ...}``. Raises NotFoundError for an unknown node, ValidationError for a
        GPU index the node does not have, TooManyRequestsError (429) when
        :data:`~apiary.control.nodes.MAX_QUEUED_FAULTS` already wait for the node."""
        self._known_node(node)
        with self._lock:
            info = self.scheduler.nodes()[node]
        if not 0 <= gpu < info.gpus:
            raise ValidationError("gpu", f"node {node} has GPUs 0..{info.gpus - 1}, not {gpu}")
        data = {k: v for k, v in fault.items() if v is not None}
        with self._lock, self._sessions() as s:
            queued = s.scalar(select(func.count()).select_from(NodeFault).where(NodeFault.node == node)) or 0
            if queued >= MAX_QUEUED_FAULTS:
                raise TooManyRequestsError(f"{queued} faults already wait for node {node}'s agent; retry later.")
            row = NodeFault(node=node, gpu=gpu, fault=data, created=self._clock())
            s.add(row)
            w = self._work(s)
            w.touched.add(node)
            w.commit("inject fault")
            item = {"id": row.id, "gpu": gpu, **data}
        logger.info("fault queued node=%s %s", node, item)
        return item

    # ------------------------------------------------------------------ alerts (written for apiary.ops)
    def record_alert(self, **fields: object) -> Alert:
        """Store one received alert (the :class:`~apiary.store.models.Alert` columns as keywords);
        returns the committed row."""
        with self._lock, self._sessions() as s, store_errors("record alert"):
            row = Alert(**fields)
            s.add(row)
            s.commit()
            return row

    def claim_alert_action(self, *, fingerprint: str, starts_at: str, alertname: str, action: str,
                           target: str) -> bool:
        """Claim the run of ``action`` on ``target`` for one firing alert: True if the caller should run
        it (first time, or the earlier run failed), False if it already ran or is running."""
        with self._lock, self._sessions() as s, store_errors("claim alert action"):
            existing = s.scalars(select(AlertAction).filter_by(
                fingerprint=fingerprint, starts_at=starts_at, action=action, target=target)).first()
            if existing is not None:
                if existing.status != "failed":
                    return False
                existing.status, existing.time = "running", self._clock()
            else:
                s.add(AlertAction(fingerprint=fingerprint, starts_at=starts_at, alertname=alertname, action=action,
                                  target=target, status="running", detail="", time=self._clock()))
            s.commit()
            return True

    def finish_alert_action(self, *, fingerprint: str, starts_at: str, action: str, target: str, status: str,
                            detail: str) -> None:
        """Record the outcome (``ok`` / ``failed``) of a claimed alert action."""
        with self._lock, self._sessions() as s, store_errors("finish alert action"):
            row = s.scalars(select(AlertAction).filter_by(
                fingerprint=fingerprint, starts_at=starts_at, action=action, target=target)).one()
            row.status, row.detail, row.time = status, detail, self._clock()
            s.commit()

    def recent_alerts(self, limit: int = 100) -> list[dict]:
        """Newest stored alerts first."""
        with self._sessions() as s:
            rows = s.scalars(select(Alert).order_by(Alert.id.desc()).limit(limit))
            return [{"alertname": r.alertname, "status": r.status, "severity": r.severity, "labels": r.labels,
                     "annotations": r.annotations, "startsAt": r.starts_at, "fingerprint": r.fingerprint}
                    for r in rows]

    def recent_alert_actions(self, limit: int = 100) -> list[dict]:
        """Newest alert action runs first."""
        with self._sessions() as s:
            rows = s.scalars(select(AlertAction).order_by(AlertAction.id.desc()).limit(limit))
            return [{"alertname": r.alertname, "action": r.action, "target": r.target, "status": r.status,
                     "detail": r.detail, "time": r.time} for r in rows]

    # ------------------------------------------------------------------ logs
    def _log_file(self, run_id: str, stream: str) -> Path:
        return self.logs_dir / f"{run_id}.{stream}.log"

    def append_log(self, run_id: str, stream: str, offset: int, data: bytes, *, node: str | None = None) -> int:
        """Store bytes ``[offset, offset+len(data))`` of a run's stream; overlaps are skipped, so
        agents may resend after a failure (idempotent). Returns the stored size. ``node``: the
        sending agent's node; a run not placed there is refused (ForbiddenError). Raises
        ValidationError (bad stream or offset), UnavailableError when the disk refuses the write
        (the agent resends)."""
        if stream not in ("stdout", "stderr"):
            raise ValidationError("stream", "must be stdout or stderr")
        if offset < 0:
            raise ValidationError("offset", "must be >= 0")
        if node is not None:
            with self._sessions() as s:
                placed = s.scalar(select(Task.node).where(Task.run_id == run_id))
            if placed != node:
                logger.warning("refused log node=%s run=%s: the run is placed on %s", node, run_id, placed)
                raise ForbiddenError(f"Run {run_id} is not placed on node {node}.")
        return self._write_log(run_id, stream, offset, data)

    def append_logs(self, node: str, chunks: Sequence[tuple[str, str, int, bytes]]) -> list[int | None]:
        """:meth:`append_log` for each ``(run id, stream, offset, bytes)`` a node report carries,
        with one query for where the runs are placed. A chunk of a run not placed on ``node`` is
        left out (None, logged) rather than refusing the report: the heartbeat and statuses with
        it still count. Returns each chunk's stored size, in order. Raises ValidationError (bad
        stream or offset) and UnavailableError (disk) as append_log does, before or while writing;
        chunks are idempotent, so the agent resends the report."""
        for _run, stream, offset, _data in chunks:
            if stream not in ("stdout", "stderr"):
                raise ValidationError("logs.stream", "must be stdout or stderr")
            if offset < 0:
                raise ValidationError("logs.offset", "must be >= 0")
        if not chunks:
            return []
        with self._sessions() as s:
            q = select(Task.run_id, Task.node).where(Task.run_id.in_({run for run, *_ in chunks}))
            placed: dict[str, str | None] = {run: where for run, where in s.execute(q)}
        sizes: list[int | None] = []
        for run_id, stream, offset, data in chunks:
            if placed.get(run_id) != node:
                logger.warning("refused log node=%s run=%s: the run is placed on %s", node, run_id, placed.get(run_id))
                sizes.append(None)
                continue
            sizes.append(self._write_log(run_id, stream, offset, data))
        return sizes

    def _write_log(self, run_id: str, stream: str, offset: int, data: bytes) -> int:
        path = self._log_file(run_id, stream)
        size = path.stat().st_size if path.exists() else 0
        if offset + len(data) > size:
            try:
                with path.open("ab") as f:
                    f.write(data[max(size - offset, 0):])
            except OSError as e:
                raise UnavailableError(f"cannot store the log of {run_id}: {e.strerror or e}; retry later.") from e
            size = offset + len(data) if offset <= size else size + len(data)
        return size

    def read_logs_many(self, reads: Iterable[tuple[str, str, int, int, str, int]]) -> list[str | None]:
        """:meth:`read_logs` for each ``(job id, task role, index, attempt, stream, offset)``, in
        order; None for a read whose job or task role does not exist (the others still answer)."""
        out: list[str | None] = []
        for job_id, role, index, attempt, stream, offset in reads:
            try:
                out.append(self.read_logs(job_id, task_role=role, index=index, attempt=attempt, stream=stream,
                                          offset=offset))
            except (NotFoundError, ValidationError):
                out.append(None)
        return out

    def read_logs(
        self, job_id: str, *, task_role: str | None = None, index: int = 0, attempt: int | None = None,
        stream: str = "stdout", offset: int = 0,
    ) -> str:
        """A task instance's log text (all its runs in the attempt, oldest first), from ``offset`` bytes."""
        if stream not in ("stdout", "stderr", "all"):
            raise ValidationError("stream", "must be stdout, stderr or all")
        with self._sessions() as s:
            job = self._get_job(s, job_id)
            spec = self._spec(job)
            role = task_role or next(iter(spec.task_roles))
            if role not in spec.task_roles:
                raise ValidationError("taskRole", f"job {job_id} has no task role {role!r}")
            q = select(Task).where(Task.job_id == job.id, Task.task_role == role, Task.index == index)
            if attempt is not None:
                q = q.where(Task.attempt == attempt)
            runs = [t.run_id for t in s.scalars(q.order_by(Task.attempt, Task.task_attempt)) if t.run_id]
        streams = ("stdout", "stderr") if stream == "all" else (stream,)
        data = b""
        for run in runs:
            for st in streams:
                p = self._log_file(run, st)
                if p.exists():
                    data += p.read_bytes()
        return data[offset:].decode("utf-8", errors="replace")
