"""The control plane's memory: the scheduler and the caches rebuilt from the store, behind one lock.

Kueue splits its scheduler, its queue manager and its cache; this is Apiary's cache. It holds what
every service of the plane shares:

* one re-entrant lock (:attr:`PlaneCache.lock`) that orders the plane's transactions and guards the
  scheduler, which is not thread-safe;
* the scheduler (:class:`~apiary.scheduler.HivedScheduler`) holding the store's placements and node
  health, and its state version (:attr:`PlaneCache.version`, bumped by everything that changes what
  ``schedule()`` can answer);
* parsed specs and policies of stored jobs (immutable once accepted);
* nodes' memory: the exact time of each node's last report, what its committed row says, why its
  agent cannot record runs, and the nodes' assignment generations (which only wake long polls);
* the jobs committed since the scheduling cycle's last snapshot.

:meth:`PlaneCache.work` opens a :class:`~apiary.control.work.Work` whose commit is applied here
(:meth:`PlaneCache.apply`) and whose failed commit rebuilds the scheduler (:meth:`PlaneCache.rebuild`).
Who owns which fact: the store owns jobs, attempts, tasks, placements, events, nodes and queued
faults; everything here is rebuilt from it (:meth:`PlaneCache.build_scheduler`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from apiary import gcpolicy
from apiary.control.nodes import schedulable
from apiary.control.work import Committed, NodeHealth, Work
from apiary.errors import ApiaryError, NotFoundError
from apiary.lifecycle.reducer import Allocate, Cancel, JobPolicy, Release, SchedulerOp, job_policy
from apiary.scheduler import HivedScheduler, TaskPlacement
from apiary.spec.cluster import ClusterConfig
from apiary.spec.job import JobSpec, parse_job
from apiary.store.models import Job, Node, Placement
from apiary.store.unit import Sessions, reading

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Seen:
    """What a node's committed row says, kept to skip writing bare heartbeats that change nothing:
    the agent's facts ``(gpus, simulated, address, agent id, metrics URL)``, healthy, the heartbeat
    time written last (unix seconds) and the fault high-water mark."""

    info: tuple
    healthy: bool
    beat: float
    faults_applied: int | None = None


@dataclass(frozen=True, slots=True)
class Submitted:
    """A new job's place in the queue as its submission committed it: ``order`` is (-priority,
    submission time, arrival number), ``pending`` its instances ``(taskRole, index)`` in the order
    their task rows were inserted, ``reason`` its first waiting reason; attempt 0."""

    order: tuple[int, float, int]
    pending: tuple[tuple[str, int], ...]
    reason: str | None


class PlaneCache:
    """The shared memory of the plane's services; see the module docstring.

    ``clock`` returns unix seconds. ``on_nodes_changed`` is called (keep it cheap and thread-safe)
    with the names of nodes whose assignments changed, after the commit, so long-polling agents
    wake up. Fields are read and written with :attr:`lock` held unless said otherwise.
    """

    def __init__(self, sessions: Sessions, cluster: ClusterConfig, *, clock: Callable[[], float],
                 lazy_preemption: bool, node_lost_after_s: float) -> None:
        self.sessions = sessions
        self.cluster = cluster
        self.clock = clock
        #: Durations that decide (a node's silence) are measured on this clock: the monotonic one
        #: under the wall clock, so a stepped wall clock (NTP) never declares nodes lost early,
        #: before their agents fenced themselves (apiary.runtime.link); a test's fake clock drives both.
        self.elapsed: Callable[[], float] = time.monotonic if clock is time.time else clock
        #: Lazy preemption (HiveD): a victim is first downgraded to opportunistic and only stopped if
        #: a preemptor really needs its cells.
        self.lazy = lazy_preemption
        self.node_lost_after_s = node_lost_after_s
        self.lock = threading.RLock()
        self.scheduler = HivedScheduler(cluster, lazy_preemption=lazy_preemption)
        self.node_names = frozenset(self.scheduler.nodes())
        #: The scheduler's state version: bumped by an applied allocation, release, cancel or node
        #: health, a decision that reserved or downgraded cells, a rebuild, a new config.
        self.version = 0
        #: Jobs committed since the running cycle's snapshot (None: no cycle runs).
        self.cycle_changed: set[str] | None = None
        #: Jobs committed since the last snapshot (the next one reads only those again).
        self.queue_dirty: set[str] = set()
        #: True when the next snapshot must read the whole queue (at start, after a rebuild or config).
        self.reread_queue = True
        #: Jobs a submission committed since the last snapshot, as it wrote them (:class:`Submitted`):
        #: the snapshot takes these instead of reading the new rows back. Any later commit of such
        #: a job drops its entry (:meth:`apply`), so the snapshot reads that one from the store.
        self.submitted: dict[str, Submitted] = {}
        self.needs_rebuild = False
        self.heartbeats: dict[str, float] = {}  # node -> exact time of its last report (memory only)
        self.heard: dict[str, float] = {}  # node -> its last report on the elapsed clock (memory only)
        self.reported: dict[str, Seen] = {}  # node -> what its row says (a cache of committed facts)
        #: Nodes that may have simulated-GPU faults queued: every node with a ``node_faults`` row
        #: when the store was last read (:meth:`ClusterService.recover`), and each one a fault was
        #: queued for since (added before that commit). None: not read yet, any node may.
        self.faulted: set[str] | None = None
        #: node -> its ``heard`` value when it was found lost (unhealthy since; a report moves ``heard`` on).
        self.settled_lost: dict[str, float] = {}
        #: node -> (generation, its assignments answer): what the node's long poll read at that generation.
        self.answers: dict[str, tuple[int, dict]] = {}
        #: node -> (why its agent says it cannot record runs, when it said so): every report says it again.
        self.cannot_record: dict[str, tuple[str, float]] = {}
        self.generation: dict[str, int] = {}
        self.wake = threading.Event()  # set when a cycle is worth running now (thread-safe)
        self.on_nodes_changed: Callable[[set[str]], None] = lambda nodes: None
        self._changed_nodes: set[str] = set()
        self._specs: dict[str, JobSpec] = {}
        self._policies: dict[str, JobPolicy] = {}

    # ------------------------------------------------------------------ immutable facts of jobs
    def spec_of(self, job: Job) -> JobSpec:
        """The job's parsed spec (cached by job id; a stored spec is never refused on reload)."""
        spec = self._specs.get(job.id)
        if spec is None:
            # Stored jobs were accepted under the cap and rules of their day: never refuse one on reload.
            spec = self._specs[job.id] = parse_job(job.spec_yaml, max_instances=2**31, stored=True)
        return spec

    def policy_of(self, job: Job) -> JobPolicy:
        """The job's lifecycle policy (cached by job id)."""
        policy = self._policies.get(job.id)
        if policy is None:
            policy = self._policies[job.id] = job_policy(job.id, self.spec_of(job))
        return policy

    def cached_policy(self, job_id: str) -> JobPolicy | None:
        """The cached policy of ``job_id``, or None when it was never loaded."""
        return self._policies.get(job_id)

    def remember(self, job_id: str, spec: JobSpec, policy: JobPolicy) -> None:
        """Cache a committed submission's spec and policy."""
        self._specs[job_id], self._policies[job_id] = spec, policy

    # ------------------------------------------------------------------ nodes
    def known_node(self, node: str) -> None:
        """Raises NotFoundError when the cluster config does not declare ``node``."""
        if node not in self.node_names:
            raise NotFoundError(f"Node {node} is not in the cluster config.")

    def recording_problems(self) -> list[str]:
        """``"node N cannot record runs: why"`` for every node whose agent said so in its latest
        report, the node reporting within the lost-node grace; by node name. Thread-safe."""
        now = self.clock()
        with self.lock:
            items = sorted(self.cannot_record.items())
        return [f"node {node} cannot record runs: {why}" for node, (why, at) in items
                if now - at <= self.node_lost_after_s]

    # ------------------------------------------------------------------ commit, then apply
    def work(self, what: str) -> Work:
        """A :class:`Work` at the clock's now, applied here after its commit (lock held by the caller)."""
        return Work(self.sessions, what, self.clock(), policy_of=self.policy_of, apply=self.apply,
                    rebuild=self.rebuild)

    def apply(self, change: Committed) -> None:
        """Apply a committed change to memory: the scheduler operations (a failure rebuilds the
        scheduler from the store), the queue's dirty set, the nodes' generations, the loop's wake."""
        with self.lock:
            try:
                for op in change.ops:
                    self._apply_op(op)
            except Exception:  # memory no longer matches the store: rebuild it from the store
                logger.exception("applying a committed change to the scheduler failed; rebuilding it")
                self.rebuild()
            if self.cycle_changed is not None:
                self.cycle_changed |= change.jobs
            self.queue_dirty |= change.jobs
            for job_id in change.jobs & self.submitted.keys():
                del self.submitted[job_id]
            self._changed_nodes |= change.touched
        self.flush_notifications()
        if change.wake:
            self.wake.set()

    def _apply_op(self, op: SchedulerOp | NodeHealth) -> None:
        self.version += 1
        sched = self.scheduler
        if isinstance(op, Allocate):
            sched.allocate(op.job, op.request, op.placements)
        elif isinstance(op, Release):
            sched.release(op.job, None if op.instances is None else list(op.instances))
        elif isinstance(op, Cancel):
            sched.cancel(op.job)
        else:
            sched.set_node_health(op.node, op.schedulable)

    def flush_notifications(self) -> None:
        """After the commit: bump the touched nodes' generations and wake their long polls.

        Bumping before the commit would let an agent read the new generation with the old
        assignments and then sleep through the change.
        """
        with self.lock:
            if not self._changed_nodes:
                return
            changed, self._changed_nodes = self._changed_nodes, set()
            for n in changed:
                self.generation[n] = self.generation.get(n, 0) + 1
        try:
            self.on_nodes_changed(changed)
        except Exception:  # a broken listener must not break scheduling
            logger.exception("on_nodes_changed failed")

    # ------------------------------------------------------------------ rebuilding from the store
    def build_scheduler(self, config: ClusterConfig, s: Session) -> tuple[HivedScheduler, dict[str, str]]:
        """A scheduler for ``config`` holding the store's truth: every node's :func:`schedulable`,
        every unreleased placement (guaranteed jobs first, by priority). Returns it with
        ``{job: why}`` for the jobs whose placements it cannot hold."""
        sched = HivedScheduler(config, lazy_preemption=self.lazy)
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
            request = self.policy_of(job).request
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

    def install(self, scheduler: HivedScheduler, config: ClusterConfig | None = None) -> None:
        """Make ``scheduler`` (and ``config``, for a new cluster config) the plane's (lock held):
        a new state version, and the next snapshot reads the whole queue."""
        self.scheduler = scheduler
        if config is not None:
            self.cluster = config
            self.node_names = frozenset(scheduler.nodes())
        self.version += 1
        self.reread_queue = True
        self.needs_rebuild = False

    def rebuild(self) -> None:
        """Replace the scheduler by one rebuilt from the store (lock held). When the store cannot be
        read either, :attr:`needs_rebuild` asks the next scheduling cycle to try again."""
        try:
            with reading(self.sessions, "rebuild the scheduler") as s:
                sched, dropped = self.build_scheduler(self.cluster, s)
        except Exception:  # the store is unreadable too: try again at the next cycle
            logger.exception("rebuilding the scheduler from the store failed; retrying at the next cycle")
            self.needs_rebuild = True
            return
        if dropped:
            logger.error("rebuild: placements the scheduler cannot hold: %s", dropped)
        self.install(sched)
        gcpolicy.settle()  # the old cell tree is cyclic garbage, maybe frozen: collect it now
