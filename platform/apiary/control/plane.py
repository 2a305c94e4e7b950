"""The control plane: the composition root of the services that accept jobs, schedule them and
track tasks and nodes.

The job lifecycle itself (what a task exit, a stop, a preemption or a lost node does to a job) is
the pure core :mod:`apiary.lifecycle.reducer`, which the simulator drives too. Around it, split by
resource as Kueue splits its scheduler, queue manager and cache:

* :class:`~apiary.control.cache.PlaneCache`: the lock, the scheduler and every cache rebuilt from
  the store; it applies committed changes (:class:`~apiary.control.work.Work`: load the job's record,
  run the core, write, commit, and only after the commit apply the scheduler operations and wake
  the nodes; a failed commit applies nothing and rebuilds the scheduler);
* :class:`~apiary.control.jobs.JobService`: submit (group commit), stop, clone, tags, flow-run
  links, job reads and events;
* :class:`~apiary.control.cycle.SchedulingCycle`: the scheduling cycle;
* :class:`~apiary.control.node_service.NodeService`: reports, heartbeats, lost nodes, cordon,
  drain, faults, listings; :class:`~apiary.control.assignments.Assignments`: what each agent runs;
* :class:`~apiary.control.logs.LogService`: task logs;
* :class:`~apiary.control.cluster.ClusterService`: recovery, the consistency check, a new cluster
  config, status and metrics.

:class:`ControlPlane` builds them over one store and one cluster config and keeps the names the
API, the CLI's embedded platform and the tests call, each delegating to its service.

Who owns which fact: the store owns jobs, attempts, tasks, placements, events, nodes (health,
cordon, last heartbeat, metrics URL) and queued faults. Memory holds caches rebuilt from it: the
scheduler's allocations and node health, parsed specs, the exact time of each node's last
heartbeat, and the nodes' assignment generations (which only wake long polls).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from apiary.control.assignments import Assignments
from apiary.control.cache import PlaneCache
from apiary.control.cluster import ClusterService
from apiary.control.cycle import CycleResult, SchedulingCycle
from apiary.control.jobs import USER_PATTERN, JobService
from apiary.control.logs import LogService
from apiary.control.node_service import NodeService
from apiary.control.proxy import ProxyTargets
from apiary.lifecycle.reducer import run_id_for
from apiary.scheduler import HivedScheduler
from apiary.spec.cluster import ClusterConfig
from apiary.store.unit import Sessions

__all__ = ["USER_PATTERN", "ControlPlane", "CycleResult", "run_id_for"]


class ControlPlane:
    """Apiary's control plane over one store and one cluster config: builds the services (see the
    module docstring) and recovers their memory from the store.

    ``clock`` returns unix seconds; tests inject it. ``on_nodes_changed`` is called (keep it cheap and
    thread-safe) with the names of nodes whose assignments changed, after the commit, so long-polling
    agents wake up. ``node_lost_after_s``: seconds without a report before a node is lost;
    ``config_path``: where an applied cluster config is saved; ``lazy_preemption``: HiveD's lazy
    preemption; ``max_instances``: most task instances of one job (``APIARY_MAX_INSTANCES``).
    """

    def __init__(
        self,
        sessions: Sessions,
        cluster: ClusterConfig,
        logs_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
        node_lost_after_s: float = 30.0,
        config_path: Path | None = None,
        lazy_preemption: bool = False,
        max_instances: int = 1000,
    ) -> None:
        self.cache = PlaneCache(sessions, cluster, clock=clock, lazy_preemption=lazy_preemption,
                                node_lost_after_s=node_lost_after_s)
        self.jobs = JobService(self.cache, max_instances=max_instances)
        self.logs = LogService(self.cache, logs_dir)
        self.nodes = NodeService(self.cache, self.logs.store_placed)
        self.scheduling = SchedulingCycle(self.cache, self.nodes.tend)
        self.agents = Assignments(self.cache)
        self.proxy = ProxyTargets(self.cache, lambda: self.agents.instance_secrets)
        self.clusters = ClusterService(self.cache, config_path=config_path)
        # The names callers use, each its service's method.
        self.submit = self.jobs.submit
        self.stop = self.jobs.stop
        self.clone = self.jobs.clone
        self.tag_job = self.jobs.tag_job
        self.untag_job = self.jobs.untag_job
        self.set_flow_run = self.jobs.set_flow_run
        self.set_flow_runs = self.jobs.set_flow_runs
        self.get_job = self.jobs.get_job
        self.job_owner = self.jobs.job_owner
        self.list_jobs = self.jobs.list_jobs
        self.events = self.jobs.events
        self.cycle = self.scheduling.cycle
        self.node_report = self.nodes.node_report
        self.cordon = self.nodes.cordon
        self.drain = self.nodes.drain
        self.jobs_on_node = self.nodes.jobs_on_node
        self.node_events = self.nodes.node_events
        self.list_nodes = self.nodes.list_nodes
        self.node_generation = self.nodes.node_generation
        self.node_faults = self.nodes.node_faults
        self.inject_fault = self.nodes.inject_fault
        self.assignments = self.agents.assignments
        self.assignments_answer = self.agents.answer
        self.kept_assignments = self.agents.kept_answer
        self.bare_heartbeat = self.nodes.bare_heartbeat
        self.hear = self.nodes.hear
        self.append_log = self.logs.append_log
        self.append_logs = self.logs.append_logs
        self.read_logs = self.logs.read_logs
        self.read_logs_many = self.logs.read_logs_many
        self.recover = self.clusters.recover
        self.check_consistency = self.clusters.check_consistency
        self.reconfigure = self.clusters.reconfigure
        self.cluster_status = self.clusters.cluster_status
        self.metrics_snapshot = self.clusters.metrics_snapshot
        self.recover()

    @property
    def sessions(self) -> Sessions:
        """The store's session factory (for :class:`~apiary.store.unit.UnitOfWork` and ``reading``)."""
        return self.cache.sessions

    @property
    def scheduler(self) -> HivedScheduler:
        """The scheduler now (a rebuild or a new config replaces it); hold :attr:`lock` to use it."""
        return self.cache.scheduler

    @property
    def cluster(self) -> ClusterConfig:
        """The cluster config in force (``reconfigure`` replaces it)."""
        return self.cache.cluster

    @property
    def lock(self) -> threading.RLock:
        """The plane's re-entrant lock: orders its transactions and guards the scheduler."""
        return self.cache.lock

    @property
    def wake(self) -> threading.Event:
        """Set when a scheduling cycle is worth running now (the scheduling loop waits on it)."""
        return self.cache.wake

    @property
    def generation(self) -> dict[str, int]:
        """node -> its assignment generation (see :meth:`NodeService.node_generation`)."""
        return self.cache.generation

    @property
    def cannot_record(self) -> dict[str, tuple[str, float]]:
        """node -> (why its agent cannot record runs, when it said so), from the latest reports."""
        return self.cache.cannot_record

    @property
    def on_nodes_changed(self) -> Callable[[set[str]], None]:
        """Called after a commit with the nodes whose assignments changed (wakes long polls)."""
        return self.cache.on_nodes_changed

    @on_nodes_changed.setter
    def on_nodes_changed(self, listener: Callable[[set[str]], None]) -> None:
        self.cache.on_nodes_changed = listener

    @property
    def logs_dir(self) -> Path:
        """Where task logs are kept."""
        return self.logs.logs_dir

    @property
    def config_path(self) -> Path | None:
        """Where an applied cluster config is saved (``home/cluster.yaml``), or None."""
        return self.clusters.config_path

    @property
    def max_instances(self) -> int:
        """Most task instances one job may have, all roles together."""
        return self.jobs.max_instances

    def recording_problems(self) -> list[str]:
        """Why nodes' agents cannot record runs (``/healthz``; :meth:`PlaneCache.recording_problems`)."""
        return self.cache.recording_problems()
