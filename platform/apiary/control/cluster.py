"""The cluster as a whole: recovery from the store, the consistency check, a new cluster config,
the scheduler's status and the metrics snapshot.

:meth:`ClusterService.recover` rebuilds the plane's memory from the store after a restart;
:meth:`ClusterService.check_consistency` says where memory and store disagree (the tests assert it
after every step); :meth:`ClusterService.reconfigure` applies a changed HiveD config with jobs
running, through one :class:`~apiary.control.work.Work`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import func, select

from apiary import gcpolicy
from apiary.control.cache import PlaneCache, Seen
from apiary.control.config import check_cluster_config
from apiary.control.nodes import schedulable
from apiary.errors import NotFoundError
from apiary.lifecycle import JobState
from apiary.lifecycle.reducer import Downgraded, Reconfigured
from apiary.store.models import Event, Job, Node, NodeFault, Placement
from apiary.store.unit import reading

logger = logging.getLogger(__name__)


class ClusterService:
    """Cluster-wide operations over the plane's ``cache``; ``config_path`` is where an applied
    config is saved (``home/cluster.yaml``; None: not saved)."""

    def __init__(self, cache: PlaneCache, *, config_path: Path | None = None) -> None:
        self.cache = cache
        self.config_path = config_path

    def recover(self) -> None:
        """Rebuild memory from the store (at start, after a restart): the scheduler (allocations and
        node health from :func:`schedulable`), and a fresh heartbeat grace period for every known node,
        so a control-plane restart never declares nodes lost. A node keeps the health it had (its
        agent normally still runs); one that never reports again is lost after the grace period."""
        now = self.cache.clock()
        with self.cache.lock, reading(self.cache.sessions, "recover") as s:
            sched, dropped = self.cache.build_scheduler(self.cache.cluster, s)
            self.cache.install(sched)
            if dropped:
                logger.error("recover: placements the scheduler cannot hold: %s", dropped)
            self.cache.reported.clear()
            self.cache.settled_lost.clear()
            self.cache.answers.clear()
            self.cache.faulted = set(s.scalars(select(NodeFault.node).distinct()))
            heard = self.cache.elapsed()
            for row in s.scalars(select(Node)):
                self.cache.heartbeats[row.name] = now
                self.cache.heard[row.name] = heard
                self.cache.reported[row.name] = Seen(
                    (row.gpus, row.simulated_gpus, row.address, row.agent_id, row.metrics_url),
                    bool(row.healthy), row.last_heartbeat or 0.0,
                )
            held = len(self.cache.scheduler.groups())
            if held:
                logger.info("recovered placements jobs=%d", held)
        self.cache.wake.set()

    def check_consistency(self) -> list[str]:
        """Differences between the store and the scheduler; [] when they agree.

        Compares every committed, unreleased placement with the scheduler's allocations (job, task
        instance, node, leaf cells) both ways, and every node's :func:`schedulable` with the
        scheduler's node health. Each item is a sentence naming the job or node.
        """
        problems: list[str] = []
        with self.cache.lock, reading(self.cache.sessions, "check consistency") as s:
            store: dict[str, dict[tuple[str, int], tuple[str, tuple[int, ...]]]] = {}
            for p in s.scalars(select(Placement).where(Placement.released.is_(False))):
                store.setdefault(p.job_id, {})[(p.task_role, p.index)] = (p.node, tuple(sorted(p.leaf_cells)))
            mem = {
                name: {(p.task_role, p.index): (p.node, tuple(sorted(p.leaf_cell_indices)))
                       for p in self.cache.scheduler.group_of(name)}
                for name in self.cache.scheduler.groups()
            }
            for job_id in sorted(set(store) | set(mem)):
                a, b = store.get(job_id, {}), mem.get(job_id, {})
                if a != b:
                    problems.append(f"job {job_id}: store holds {sorted(a.items())}, scheduler {sorted(b.items())}")
            rows = {r.name: r for r in s.scalars(select(Node))}
            health = {n: v["healthy"] for n, v in self.cache.scheduler.status()["nodes"].items()}
            for name in sorted(self.cache.node_names):
                if health.get(name) != schedulable(rows.get(name)):
                    problems.append(f"node {name}: schedulable {schedulable(rows.get(name))} in the store, "
                                    f"{health.get(name)} in the scheduler")
        return problems

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
        with self.cache.lock, self.cache.work("reconfigure") as w:
            new, dropped = self.cache.scheduler.reconfigured(config)
            # Jobs the new config keeps only as opportunistic run on (HiveD's lazy preemption).
            for job_id in sorted(set(new.downgraded()) - set(self.cache.scheduler.downgraded()) - set(dropped)):
                w.step(job_id, Downgraded(by="cluster-config"))
            stopped: dict[str, str] = {}
            for job_id, why in sorted(dropped.items()):
                loaded = w.load(job_id)
                if loaded is None or loaded.record.state.is_final:
                    continue
                w.step(job_id, Reconfigured(why))
                stopped[job_id] = why
                loaded.release_placements()
            kept = sorted(set(new.groups()) - set(stopped))
            staged = None
            if self.config_path is not None:  # a restart must come back with the applied config
                staged = self.config_path.with_name(self.config_path.name + ".new")
                staged.write_text(text)
            w.commit()
            if staged is not None and self.config_path is not None:
                staged.replace(self.config_path)
            # The steps' releases went to the old scheduler; the new one never held the stopped jobs.
            self.cache.install(new, config)
            gcpolicy.settle()  # the old cell tree is cyclic garbage, maybe frozen: collect it now
            logger.info("cluster config applied kept=%d stopped=%d", len(kept), len(stopped))
        self.cache.wake.set()
        return {"kept": kept, "stopped": stopped}

    def cluster_status(self, vc: str | None = None) -> dict:
        """The scheduler's view (``HivedScheduler.status``), read under the plane's lock: VCs (quota /
        used / free / opportunistic / bad cells per level), nodes, groups' placements, reservations;
        ``vc`` narrows it to one virtual cluster. Raises NotFoundError for an unknown VC."""
        with self.cache.lock:
            if vc is not None and vc not in self.cache.cluster.virtual_clusters:
                raise NotFoundError(f"Virtual cluster {vc} not found.")
            return self.cache.scheduler.status(vc)

    def metrics_snapshot(self) -> dict:
        """What :class:`~apiary.monitoring.PlatformCollector` renders on a scrape: job counts per VC
        and state, waiting jobs, preemptions per VC, VC cells, nodes, agent heartbeats. A few
        aggregate queries over committed state, and the scheduler's status under the lock."""
        with reading(self.cache.sessions, "read the cluster") as s:
            jobs: dict[str, dict[str, int]] = {
                vc: {st.value: 0 for st in JobState} for vc in self.cache.cluster.virtual_clusters
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
        with self.cache.lock:
            beats = dict(self.cache.heartbeats)
        heartbeats = [{"service": "node-agent", "instance": n, "timestamp": t} for n, t in beats.items()]
        return {"now": self.cache.clock(), "jobs": jobs, "waiting_jobs": waiting, "preemptions": preemptions,
                "vc_cells": vc_cells, "nodes": nodes, "heartbeats": heartbeats}
