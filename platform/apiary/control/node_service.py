"""The node service: agents' reports and heartbeats, lost nodes, cordon and drain, simulated faults.

A node's durable state is its ``nodes`` row (health, last heartbeat, metrics URL), its cordons (one
per source, :class:`~apiary.store.models.NodeCordon`) and its queued faults; every change is one
:class:`~apiary.control.work.Work` committed before memory (the scheduler's node health, the nodes'
assignment generations) is touched. Bare heartbeats from a known
healthy node whose facts did not change are kept in memory and written at most every
:data:`~apiary.control.nodes.HEARTBEAT_PERSIST_S` (the plane's cache holds what each row says).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from apiary.control.cache import PlaneCache, Seen
from apiary.control.intake import Intake, Pending
from apiary.control.logs import check_chunks
from apiary.control.nodes import (
    ADMIN_CORDON,
    HEARTBEAT_PERSIST_S,
    MAX_CORDON_REASON,
    MAX_QUEUED_FAULTS,
    cordon_source,
    schedulable,
)
from apiary.errors import TooManyRequestsError, UnavailableError, ValidationError
from apiary.lifecycle import TaskState
from apiary.lifecycle.reducer import NodeLost, RunReported, job_of_run
from apiary.store.models import Event, Job, Node, NodeCordon, NodeFault, Placement, Task
from apiary.store.unit import UnitOfWork, reading

if TYPE_CHECKING:
    from apiary.control.work import Work
from apiary.timefmt import iso

logger = logging.getLogger(__name__)

#: Task states whose runs hold a node (an agent runs them).
ACTIVE_TASK_STATES = (TaskState.STARTING.value, TaskState.RUNNING.value)


#: Reports applied in one transaction at most (:meth:`NodeService.node_report`); as many as the
#: submissions' batch (:data:`~apiary.control.jobs.JobService.INTAKE_BATCH`).
REPORT_BATCH = 64
#: Run ids per query when a batch's runs are looked up (SQLite allows 32,766 parameters).
OWNER_CHUNK = 500

#: Stores a report's output chunks on ``node`` given where their runs are placed (run id -> node):
#: :meth:`apiary.control.logs.LogService.store_placed`.
StoreLogs = Callable[[str, Sequence[tuple[str, str, int, bytes]], Mapping[str, str | None]], list[int | None]]


@dataclass(eq=False, repr=False)
class PendingReport(Pending):
    """One agent's report waiting for its batch's commit (:class:`~apiary.control.intake.Pending`:
    ``answer`` ``{"ack": [...]}`` or ``error``). ``info``: ``(gpus, simulated_gpus, address,
    agent_id, metrics_url)``; ``now``: the plane's clock at arrival (epoch s); ``logs``: the
    output chunks ``(run id, stream, offset, bytes)`` it carries, stored before its runs' statuses
    are committed (the answer then has ``"logs"``: each chunk's stored size or None)."""

    node: str
    info: tuple[int, bool, str, str, str | None]
    runs: list[dict]
    faults_applied: int | None
    cannot_record: str | None
    now: float
    logs: Sequence[tuple[str, str, int, bytes]] = ()

    def __repr__(self) -> str:
        return f"the report of node {self.node}"


def read_node_faults(s: Session, node: str) -> list[dict]:
    """:meth:`NodeService.node_faults` read in the caller's session ``s`` (the agents' long poll
    reads them with the node's runs, in one transaction)."""
    return [{"id": f.id, "gpu": f.gpu, **f.fault}
            for f in s.scalars(select(NodeFault).where(NodeFault.node == node).order_by(NodeFault.id))]


class NodeService:
    """Nodes over the plane's ``cache``: reports, loss, cordon, drain, faults, listings."""

    def __init__(self, cache: PlaneCache, store_logs: StoreLogs) -> None:
        self.cache = cache
        self.store_logs = store_logs  # where the output chunks of reports go (:data:`StoreLogs`)
        self.reports: Intake[PendingReport] = Intake()  # reports waiting for a group commit
        self._persist_due = 0.0  # monotonic time of the next persist_heartbeats

    @property
    def node_lost_after_s(self) -> float:
        """The node-lost grace, seconds (``APIARY_NODE_LOST_AFTER_S``): a node whose agent has not
        reported for longer is lost (:meth:`check_lost_nodes`). Agents are told it with every
        answer (:data:`apiary.runtime.link.GRACE_HEADER`) and fence themselves before it ends."""
        return self.cache.node_lost_after_s

    def check_lost_nodes(self) -> None:
        """Nodes silent for longer than ``node_lost_after_s``: unhealthy, their runs failed (lock held).

        Each runs' task ends with -1001 PodNodeLost and its job is placed again (a platform
        retry). A late report of such a run from its node (the node was cut off, not dead; its
        agent fenced the run itself, :mod:`apiary.runtime.link`) is acknowledged and changes
        nothing: the task is final (:meth:`node_report`)."""
        now = self.cache.elapsed()
        settled = self.cache.settled_lost
        # A copy (dict.copy, one C call; list(items()) can see the size change): reports store into
        # ``heard`` without the lock (:meth:`hear`). A node found lost already at its current
        # silence is settled: no store read for it every cycle.
        heard = self.cache.heard.copy()
        lost = sorted(n for n, seen in heard.items()  # (a reconfig drops nodes)
                      if now - seen > self.cache.node_lost_after_s and n in self.cache.node_names
                      and settled.get(n) != seen)
        if not lost:
            return
        # The silences judged, from the same copy: a report arriving meanwhile moves ``heard`` past
        # them, so that node is judged again rather than settled at its new time.
        silent_since = {n: heard[n] for n in lost}
        with self.cache.work("node lost") as w:
            s = w.s
            for name in lost:
                row = s.get(Node, name)
                if row is None or not row.healthy:
                    continue
                row.healthy = False
                w.node_health(name, schedulable(row))
                logger.warning("node=%s lost: no report for %.0f s", name, now - self.cache.heard[name])
                job_ids = list(dict.fromkeys(s.scalars(  # in arrival order, as the simulator does
                    select(Task.job_id).join(Job, Job.id == Task.job_id)
                    .where(Task.node == name, Task.state.in_(ACTIVE_TASK_STATES))
                    .order_by(Job.submission_time, Job.submit_seq)
                )))
                for job_id in job_ids:
                    w.step(job_id, NodeLost(name))
            if w.ops:
                w.commit()
        settled.update(silent_since)  # unhealthy now (or already): nothing more to do until it reports
        for name in lost:
            if name in self.cache.reported:
                self.cache.reported[name] = replace(self.cache.reported[name], healthy=False)

    def hear(self, node: str) -> None:
        """Count a report from ``node``'s agent as heard now, on its arrival: before it waits for a
        worker thread or the plane's lock. A report queued behind commits is proof of life, and a
        node must not be declared lost while its report waits (under load that turned into more
        lost nodes, more writes and longer waits). Plain dict stores, no lock (as
        :meth:`bare_heartbeat`). Raises NotFoundError for a node the cluster config does not declare."""
        self.cache.known_node(node)
        self.cache.heartbeats[node] = self.cache.clock()
        self.cache.heard[node] = self.cache.elapsed()

    def tend(self) -> None:
        """The scheduling cycle's node work, step 1 (lock held): :meth:`persist_heartbeats` every
        tenth of :data:`~apiary.control.nodes.HEARTBEAT_PERSIST_S` (a row's time is then at most 1.1
        periods old; a store that refuses it is logged and retried, scheduling goes on), then
        :meth:`check_lost_nodes`."""
        if time.monotonic() >= self._persist_due:
            self._persist_due = time.monotonic() + HEARTBEAT_PERSIST_S / 10
            try:
                self.persist_heartbeats()
            except UnavailableError as e:
                logger.warning("node heartbeats not written: %s", e.message)
        self.check_lost_nodes()

    def persist_heartbeats(self) -> int:
        """Write the heartbeat time of every healthy node whose row's is older than
        :data:`~apiary.control.nodes.HEARTBEAT_PERSIST_S` (lock held; :meth:`tend` calls it), in one
        transaction of its own (memory is not in doubt when it fails, so no rebuild): one bulk UPDATE by primary key for
        the whole fleet, instead of one commit per node and minute (83 commits/s at 5,000 nodes,
        which queued every report and submission behind the plane's lock). Returns how many rows.
        Raises UnavailableError when the store cannot commit (memory keeps the old times: retried)."""
        due = {}
        for node, beat in self.cache.heartbeats.copy().items():  # (reports store into it without the lock)
            seen = self.cache.reported.get(node)
            if seen is not None and seen.healthy and beat - seen.beat >= HEARTBEAT_PERSIST_S:
                due[node] = beat
        if not due:
            return 0
        with UnitOfWork(self.cache.sessions, "node heartbeats") as uow:
            uow.s.execute(update(Node), [{"name": n, "last_heartbeat": t} for n, t in sorted(due.items())])
            uow.commit()
        for node, beat in due.items():
            seen = self.cache.reported.get(node)
            if seen is not None:
                self.cache.reported[node] = replace(seen, beat=max(seen.beat, beat))
        return len(due)

    def bare_heartbeat(self, node: str, *, gpus: int, simulated_gpus: bool, address: str, agent_id: str,
                       metrics_url: str | None = None, faults_applied: int | None = None) -> bool:
        """Take a report without runs, logs or trouble in memory only, without the plane's lock,
        when the node's row already says all it says (healthy, same facts, no newly applied
        faults; its heartbeat time reaches the row in :meth:`persist_heartbeats`' batch). True when
        taken (answer ``{"ack": []}``); False: the caller must send it through :meth:`node_report`.

        Taken, it is heard (:meth:`hear`): only plain dict stores (atomic under the GIL), so a
        heartbeat never waits behind a scheduling cycle or a commit that holds the lock; a loss check
        racing with it sees the previous report, as if this one had come a moment later. Raises
        NotFoundError for a node the cluster config does not declare."""
        self.cache.known_node(node)
        seen = self.cache.reported.get(node)
        if (seen is None or not seen.healthy or seen.info != (gpus, simulated_gpus, address, agent_id, metrics_url)
                or node in self.cache.cannot_record
                or (faults_applied is not None and faults_applied != seen.faults_applied)):
            return False
        self.hear(node)
        return True

    def node_report(self, node: str, *, gpus: int, simulated_gpus: bool, address: str, agent_id: str,
                    runs: Iterable[dict], metrics_url: str | None = None, faults_applied: int | None = None,
                    cannot_record: str | None = None, logs: Sequence[tuple[str, str, int, bytes]] = ()) -> dict:
        """Apply an agent's heartbeat and run statuses (``TaskStatus`` dicts). Idempotent.

        Returns ``{"ack": [run_id]}``: runs whose final status is recorded (the agent may forget
        them). ``faults_applied``: the agent's high-water mark of applied fault ids (those faults are
        deleted). ``cannot_record``: why the agent cannot record runs now (it launches nothing new
        meanwhile), None when it can; kept in memory for ``/healthz``
        (:func:`apiary.control.health.health_problems`). ``logs``: output chunks ``(run id, stream,
        offset, bytes)``, stored (:attr:`store_logs`) inside the report's transaction, after it read
        where their runs are placed and before its commit, so a run's output is stored before its
        exit is; the answer then has ``"logs"``: each chunk's stored size, or None for a chunk of a
        run not placed on ``node`` (left out, logged). Raises NotFoundError for a node the cluster
        config does not declare, ValidationError for a chunk's bad stream or offset,
        UnavailableError (503) when the store cannot commit or the disk
        refuses the output (the agent resends; chunks are idempotent). The node's row of a
        known healthy node whose facts did not change is written at most every
        :data:`~apiary.control.nodes.HEARTBEAT_PERSIST_S` (a bare heartbeat then touches only memory;
        a report with runs writes only the runs).

        Reports share transactions (group commit, :mod:`apiary.control.intake`): whoever takes the
        plane's lock applies every queued report, up to :data:`REPORT_BATCH`, in one commit. When a
        fleet registers at once, or comes back after a partition, that is one commit per batch
        rather than one per node, and a report's wait for the lock no longer grows with the count of
        reports queued ahead of it.
        """
        self.cache.known_node(node)
        check_chunks(logs)
        pending = PendingReport(node, (gpus, simulated_gpus, address, agent_id, metrics_url), list(runs),
                                faults_applied, cannot_record, self.cache.clock(), logs=list(logs))
        self.hear(node)  # before waiting for the lock (the API hears it before the worker thread too)
        self.reports.put(pending)
        with self.cache.lock:
            while not pending.done and self._commit_reports():
                pass
        return pending.result()

    def _commit_reports(self) -> bool:
        """Apply the queued reports (lock held): one transaction for a batch of up to
        :data:`REPORT_BATCH` with at most one report per node (a second one of a node, an agent's
        resend after a timeout, goes back to the queue for the next batch, so it sees the first
        one's effect). When the batch fails, each of its reports is applied alone, so one bad
        report is refused alone; a store that cannot commit refuses each (503, the agents resend).
        False if none was queued."""
        drained = self.reports.drain(REPORT_BATCH)
        if not drained:
            return False
        batch: list[PendingReport] = []
        later: list[PendingReport] = []
        nodes: set[str] = set()
        for p in drained:
            (later if p.node in nodes else batch).append(p)
            nodes.add(p.node)
        if later:
            self.reports.put_back(later)
        try:
            self._apply_reports(batch)
        except Exception as e:
            if len(batch) == 1:
                batch[0].settle(error=e)
            else:
                logger.warning("a batch of %d reports failed (%s: %s): applying each alone",
                               len(batch), type(e).__name__, e)
                for p in batch:
                    if not p.done:
                        try:
                            self._apply_reports([p])
                        except Exception as one:
                            p.settle(error=one)
        except BaseException as e:
            for p in batch:
                if not p.done:
                    p.settle(error=e)
            raise
        return True

    def _apply_reports(self, batch: list[PendingReport]) -> None:
        """One transaction for ``batch`` (one report per node, lock held); memory after the commit."""
        todo: list[tuple[PendingReport, Seen | None, bool, bool]] = []
        for p in batch:
            if p.cannot_record:
                if p.node not in self.cache.cannot_record:
                    logger.error("node=%s cannot record runs: %s", p.node, p.cannot_record)
                self.cache.cannot_record[p.node] = (p.cannot_record, p.now)
            elif self.cache.cannot_record.pop(p.node, None) is not None:
                logger.warning("node=%s can record runs again", p.node)
            seen = self.cache.reported.get(p.node)
            new_mark = p.faults_applied is not None and (seen is None or p.faults_applied != seen.faults_applied)
            # The node's row already says all this (healthy, same facts, a heartbeat written within
            # HEARTBEAT_PERSIST_S): leave it alone, whether or not the report carries runs.
            fresh = (not new_mark and seen is not None and seen.info == p.info and seen.healthy
                     and p.now - seen.beat < HEARTBEAT_PERSIST_S)
            if fresh and not p.runs and not p.logs:
                p.settle(answer={"ack": []})
                continue
            todo.append((p, seen, new_mark, fresh))
        if not todo:
            return
        if all(fresh and not p.runs for p, _seen, _mark, fresh in todo):
            # Only output from nodes whose rows need nothing (a long task's steady output): where
            # its runs are placed is read, and nothing is written to the store.
            with reading(self.cache.sessions, "node report") as s:
                found = self._owners(s, {run_id for p, *_ in todo for run_id, *_ in p.logs})
            placed = {run_id: where for run_id, (_job, where) in found.items()}
            for p, *_ in todo:
                p.settle(answer={"logs": self.store_logs(p.node, p.logs, placed), "ack": []})
            return
        answers: list[dict] = []
        with self.cache.work("node report") as w:
            owners = self._run_owners(w, [(run["run_id"], p.node) for p, *_ in todo for run in p.runs],
                                      {run_id for p, *_ in todo for run_id, *_ in p.logs})
            placed = {run_id: where for run_id, (_job, where) in owners.items()}
            for p, seen, new_mark, fresh in todo:
                answer: dict = {}
                if p.logs:
                    # Before the runs' exits are committed: the output is stored when the exit is seen.
                    answer["logs"] = self.store_logs(p.node, p.logs, placed)
                answer["ack"] = self._write_report(w, p, seen, new_mark, fresh, owners)
                answers.append(answer)
            w.commit()
        for (p, seen, _new_mark, fresh), answer in zip(todo, answers, strict=True):
            mark = p.faults_applied if p.faults_applied is not None else (seen.faults_applied if seen else None)
            self.cache.reported[p.node] = Seen(p.info, True, seen.beat if fresh and seen else p.now, mark)
            p.settle(answer=answer)

    @staticmethod
    def _run_owners(w: Work, runs: list[tuple[str, str]],
                    more: Iterable[str] = ()) -> dict[str, tuple[str, str | None]]:
        """Run id -> ``(job id, node)`` of the tasks that ``runs`` (``(run id, reporting node)``)
        and ``more`` (run ids whose output a report carries) belong to, and the jobs of ``runs``
        loaded into ``w``: a load per :data:`OWNER_CHUNK` jobs, not a load per run (at 5,000 nodes
        under a job stream, loading jobs one by one was half of the reports' time).

        A run id names its job (:func:`~apiary.lifecycle.reducer.job_of_run`), so the jobs are
        loaded first and the runs found among their tasks; only a run found there by none (an
        unknown one, one of an earlier try of its instance, output of a run not reported) is
        looked up by its run id, a query per :data:`OWNER_CHUNK`."""
        reported = {run_id for run_id, _ in runs}
        jobs = sorted({job for job in map(job_of_run, reported) if job is not None})
        for i in range(0, len(jobs), OWNER_CHUNK):
            w.load_many(jobs[i:i + OWNER_CHUNK])
        wanted = reported | set(more)
        owners: dict[str, tuple[str, str | None]] = {}
        for job_id in jobs:
            loaded = w.jobs.get(job_id)
            for t in loaded.record.tasks.values() if loaded is not None else ():
                if t.run_id in wanted:
                    owners[t.run_id] = (job_id, t.node)
        rest = wanted - owners.keys()
        if rest:
            found = NodeService._owners(w.s, rest)
            owners.update(found)
            extra = sorted({found[run_id][0] for run_id, node in runs
                            if run_id in found and found[run_id][1] == node} - w.jobs.keys())
            for i in range(0, len(extra), OWNER_CHUNK):
                w.load_many(extra[i:i + OWNER_CHUNK])
        return owners

    @staticmethod
    def _owners(s: Session, run_ids: Iterable[str]) -> dict[str, tuple[str, str | None]]:
        """Run id -> ``(job id, node)`` of the tasks with those run ids (unknown ones left out),
        read in ``s``, a query per :data:`OWNER_CHUNK` run ids."""
        owners: dict[str, tuple[str, str | None]] = {}
        unique = sorted(set(run_ids))
        for i in range(0, len(unique), OWNER_CHUNK):
            query = select(Task.run_id, Task.job_id, Task.node).where(Task.run_id.in_(unique[i:i + OWNER_CHUNK]))
            for run_id, job_id, node in s.execute(query):
                owners[run_id] = (job_id, node)
        return owners

    def _write_report(self, w: Work, p: PendingReport, seen: Seen | None, new_mark: bool, fresh: bool,
                      owners: dict[str, tuple[str, str | None]]) -> list[str]:
        """One report's rows in ``w``: the node's row unless ``fresh``, applied faults, its runs
        (``owners``: :meth:`_run_owners`). Returns the run ids to acknowledge."""
        s, node = w.s, p.node
        if not fresh:
            row = s.get(Node, node)
            if row is None:
                row = Node(name=node)
                s.add(row)
            was = schedulable(row) if row.healthy is not None else False
            if row.healthy is False:
                logger.info("node=%s healthy again", node)
            row.gpus, row.simulated_gpus, row.address, row.agent_id, row.metrics_url = p.info
            row.healthy = True
            row.last_heartbeat = p.now
            if schedulable(row) != was or seen is None or not seen.healthy:
                w.node_health(node, schedulable(row))
        if new_mark:  # the agent applied these: they leave the queue
            s.execute(delete(NodeFault).where(NodeFault.node == node, NodeFault.id <= p.faults_applied))
        ack: list[str] = []
        for run in p.runs:
            owner = owners.get(run["run_id"])
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
        w.wake = w.wake or bool(p.runs)
        return ack

    def cordon(self, node: str, cordoned: bool = True, *, source: str = ADMIN_CORDON, reason: str = "",
               by: str = "", every_source: bool = False) -> dict:
        """Set (``cordoned``) or remove ``source``'s cordon on ``node``, like a Kubernetes taint with
        that key: the node takes no new placements (running tasks keep going until they end) while
        it holds a cordon from any source, so removing one source's cordon leaves the others' in
        place. ``every_source`` (only with ``cordoned=False``): remove every cordon. Setting a
        source's cordon again keeps its time and takes the new ``reason`` (when one is given) and
        ``by``. ``source``: a :data:`~apiary.control.nodes.CORDON_SOURCE`; ``reason``: why, at most
        :data:`~apiary.control.nodes.MAX_CORDON_REASON` characters; ``by``: the principal or actor.
        Durable; idempotent. Returns the node's :meth:`list_nodes` entry. Raises NotFoundError for
        an unknown node, ValidationError naming ``source``, ``reason`` or ``all``."""
        cordon_source(source)
        if len(reason) > MAX_CORDON_REASON:
            raise ValidationError("reason", f"at most {MAX_CORDON_REASON} characters, not {len(reason)}")
        if every_source and cordoned:
            raise ValidationError("all", "removes every cordon: give it with value false only")
        self.cache.known_node(node)
        with self.cache.lock, self.cache.work("cordon") as w:
            s = w.s
            row = s.get(Node, node)
            if row is None:
                row = Node(name=node, healthy=False)
                s.add(row)
            if cordoned:
                held = next((c for c in row.cordons if c.source == source), None)
                if held is None:
                    row.cordons.append(NodeCordon(source=source, reason=reason, by=by[:200], at=self.cache.clock()))
                    logger.info("node=%s cordoned source=%s by=%s reason=%s", node, source, by, reason)
                else:
                    held.reason, held.by = reason or held.reason, by[:200]
            else:
                for c in [c for c in row.cordons if every_source or c.source == source]:
                    row.cordons.remove(c)
                    logger.info("node=%s uncordoned source=%s by=%s", node, c.source, by)
            w.node_health(node, schedulable(row))
            w.commit()
        return self.get_node(node)

    def jobs_on_node(self, node: str) -> list[str]:
        """Ids of the jobs with a live task on ``node``, in arrival order. Raises NotFoundError."""
        self.cache.known_node(node)
        with reading(self.cache.sessions, "read nodes") as s:
            return list(dict.fromkeys(s.scalars(
                select(Task.job_id).join(Job, Job.id == Task.job_id)
                .where(Task.node == node, Task.state.in_(ACTIVE_TASK_STATES))
                .order_by(Job.submission_time, Job.submit_seq))))

    def drain(self, node: str, reason: str | None = None, *, source: str = ADMIN_CORDON, by: str = "") -> list[str]:
        """``kubectl drain``: cordon ``node`` as ``source`` (:meth:`cordon`, ``reason`` or "drained"
        its reason, ``by`` its actor) and stop its jobs' runs there; each such job's attempt ends as
        if the node were lost (exit -1001 PodNodeLost, a platform failure that is always retried;
        ``reason``: the attempt's reason), so it is re-placed elsewhere as a platform retry and
        loses no user retry. The agent stops the runs (they leave the node's assignments). Returns
        the jobs moved. Durable, idempotent (a drained node has nothing left to move). Raises
        NotFoundError, ValidationError (as :meth:`cordon`)."""
        self.cordon(node, True, source=source, reason=(reason or "drained")[:MAX_CORDON_REASON], by=by)
        with self.cache.lock, self.cache.work("drain") as w:
            s = w.s
            job_ids = list(dict.fromkeys(s.scalars(
                select(Task.job_id).join(Job, Job.id == Task.job_id)
                .where(Task.node == node, Task.state.in_(ACTIVE_TASK_STATES))
                .order_by(Job.submission_time, Job.submit_seq))))
            for job_id in job_ids:
                w.step(job_id, NodeLost(node, reason or f"Node {node} was drained."))
            w.wake = True
            if w.ops or job_ids:
                w.commit()
        logger.info("node=%s drained jobs=%s", node, job_ids)
        return job_ids

    def node_events(self, node: str, limit: int = 10) -> list[dict]:
        """The newest ``limit`` events of the jobs with tasks on ``node`` (any attempt), newest first:
        an incident's evidence."""
        with reading(self.cache.sessions, "read nodes") as s:
            job_ids = select(Task.job_id).where(Task.node == node).distinct()
            rows = s.scalars(select(Event).where(Event.job_id.in_(job_ids)).order_by(Event.seq.desc()).limit(limit))
            return [{"seq": e.seq, "time": e.time, "jobId": e.job_id, "type": e.type} for e in rows]

    def get_node(self, node: str) -> dict:
        """``node``'s :meth:`list_nodes` entry. Raises NotFoundError for a node the cluster config
        does not declare."""
        self.cache.known_node(node)
        return next(n for n in self.list_nodes() if n["name"] == node)

    def list_nodes(self) -> list[dict]:
        """Every node of the cluster config: its row's facts, GPUs in use, last heartbeat, its
        ``cordons`` (``[{"source", "reason", "by", "at"}]``, ``at`` ISO 8601 UTC, oldest first),
        ``cordoned`` (it holds any) and ``schedulable`` (the one derivation the scheduler follows)."""
        with self.cache.lock:
            infos = self.cache.scheduler.nodes()
            beats = dict(self.cache.heartbeats)
        with reading(self.cache.sessions, "read nodes") as s:
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
                        "cordons": [{"source": c.source, "reason": c.reason, "by": c.by, "at": iso(c.at)}
                                    for c in row.cordons] if row else [],
                        "schedulable": schedulable(row),
                        "address": row.address if row else None,
                        "skuType": info.sku_type,
                        "gpusUsed": used.get(name, 0),
                        "lastHeartbeat": iso(beats.get(name, row.last_heartbeat if row else None)),
                        "metricsUrl": row.metrics_url if row else None,
                    }
                )
            return out

    def node_generation(self, node: str) -> int:
        """The node's assignment generation: bumped after every commit that changes what the node
        should run (the agents' long poll waits for a change of it). 0 for a node never touched."""
        return self.cache.generation.get(node, 0)

    def node_faults(self, node: str) -> list[dict]:
        """Simulated-GPU faults queued for ``node``'s agent, oldest first: ``{"id", "gpu", ...}``.
        Ids never repeat (not even across restarts), so the agent applies each once: those above its
        high-water mark. A fault stays queued until the agent reports it applied."""
        with reading(self.cache.sessions, "read nodes") as s:
            return read_node_faults(s, node)

    def inject_fault(self, node: str, gpu: int, **fault: object) -> dict:
        """Queue a simulated-GPU fault (DCGM error injection) or ``clear=True`` for ``node``'s agent,
        which applies it to its simulated GPUs on its next long poll. Durable. Returns the queued
        fault ``{"id", "gpu", ...}``. Raises NotFoundError for an unknown node, ValidationError for a
        GPU index the node does not have, TooManyRequestsError (429) when
        :data:`~apiary.control.nodes.MAX_QUEUED_FAULTS` already wait for the node."""
        self.cache.known_node(node)
        with self.cache.lock:
            info = self.cache.scheduler.nodes()[node]
        if not 0 <= gpu < info.gpus:
            raise ValidationError("gpu", f"node {node} has GPUs 0..{info.gpus - 1}, not {gpu}")
        data = {k: v for k, v in fault.items() if v is not None}
        with self.cache.lock, self.cache.work("inject fault") as w:
            s = w.s
            queued = s.scalar(select(func.count()).select_from(NodeFault).where(NodeFault.node == node)) or 0
            if queued >= MAX_QUEUED_FAULTS:
                raise TooManyRequestsError(f"{queued} faults already wait for node {node}'s agent; retry later.")
            if self.cache.faulted is not None:
                self.cache.faulted.add(node)  # before the commit: the long poll reads it from then on
            row = NodeFault(node=node, gpu=gpu, fault=data, created=self.cache.clock())
            s.add(row)
            w.touched.add(node)
            w.commit()
            item = {"id": row.id, "gpu": gpu, **data}
        logger.info("fault queued node=%s %s", node, item)
        return item
