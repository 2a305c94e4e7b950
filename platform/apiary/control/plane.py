"""The control plane: accepts jobs, runs scheduling cycles, tracks tasks, decides retries.

It is the only writer of the store. Every public method takes the one lock and runs one
transaction, so the API threads, the scheduling-loop thread and node reports never interleave
half-done changes. The scheduler (:mod:`apiary.scheduler`) is pure and in memory; the store is
the truth it is rebuilt from after a restart (:meth:`ControlPlane.recover`).

A job attempt moves like this (numbers are the steps of :meth:`cycle` and :meth:`report`):

1. submit: job WAITING, attempt 0, one WAITING task per instance.
2. cycle: the scheduler places pending instances (tasks STARTING, placements committed) or
   says why the job waits, or names victims to preempt.
3. report RUNNING from the node's agent: task RUNNING, job RUNNING.
4. report exited: task final; the completion policy may decide the attempt's outcome and stop
   the other tasks; a stop, a preemption or a lost node decide it too.
5. when every task of a decided attempt has ended: release its cells, then SUCCEEDED, FAILED,
   STOPPED or a retry (new attempt, back to 1's WAITING tasks).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from apiary.errors import ConflictError, NotFoundError, UserError, ValidationError
from apiary.lifecycle import (
    EXIT_NODE_LOST,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    JobState,
    RoleCompletion,
    RoleOutcome,
    TaskState,
    check_job_transition,
    check_task_transition,
    classify_exit,
    decide_retry,
    evaluate_completion,
    task_retry,
)
from apiary.runtime.env import build_task_env
from apiary.runtime.probes import parse_probes, probes_to_wire
from apiary.scheduler import GroupRequest, HivedScheduler, TaskPlacement
from apiary.scheduler.requests import group_request
from apiary.spec.cluster import ClusterConfig, load_cluster_config
from apiary.spec.job import JobSpec, parse_job
from apiary.store.models import Attempt, Event, Job, Node, Placement, Task

logger = logging.getLogger(__name__)

USER_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenPAI user names: letters, digits, _ and -
ACTIVE_TASK_STATES = (TaskState.STARTING.value, TaskState.RUNNING.value)
FINAL_TASK_STATES = {s.value for s in TaskState if s.is_final}
# Exit code recorded for a task whose process vanished with no exit code (its wrapper was killed
# with it): OpenPAI's 137 ContainerSigKillReceived, a transient platform failure.
EXIT_LOST_PROCESS = 137


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


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int((ts % 1) * 1000):03d}Z"


def run_id_for(job_id: str, attempt: int, task_role: str, index: int, task_attempt: int) -> str:
    """The node-side idempotency key of one task run: ``alice~mnist.a0.train.0.t0``."""
    return f"{job_id}.a{attempt}.{task_role}.{index}.t{task_attempt}"


class ControlPlane:
    """Apiary's control plane over one store and one cluster config.

    ``clock`` returns unix seconds; tests inject it. ``on_nodes_changed`` is called (outside no
    lock guarantees; keep it cheap and thread-safe) with the names of nodes whose assignments
    changed, so long-polling agents wake up.
    """

    def __init__(
        self,
        sessions: sessionmaker,
        cluster: ClusterConfig,
        logs_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
        node_lost_after_s: float = 30.0,
        config_path: Path | None = None,
        lazy_preemption: bool = False,
    ) -> None:
        self._sessions = sessions
        self.cluster = cluster
        # Lazy preemption (HiveD): a victim is first downgraded to opportunistic and only
        # stopped if a preemptor really needs its cells.
        self.scheduler = HivedScheduler(cluster, lazy_preemption=lazy_preemption)
        self.config_path = config_path  # where an applied config is saved (``home/cluster.yaml``)
        self.logs_dir = Path(logs_dir)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.RLock()
        self._specs: dict[str, JobSpec] = {}
        self._heartbeats: dict[str, float] = {}
        self._node_info: dict[str, tuple] = {}  # last (gpus, simulated, address, agent id) stored per node
        self._healthy: dict[str, bool] = {}
        self.metrics_urls: dict[str, str] = {}  # node -> its agent's /metrics URL, as last reported
        self.faults: dict[str, list[dict]] = {}  # node -> injected simulated-GPU faults, in order
        self._fault_seq = 0
        self._node_lost_after_s = node_lost_after_s
        self.wake = threading.Event()  # set when a cycle is worth running now
        self.on_nodes_changed: Callable[[set[str]], None] = lambda nodes: None
        self._changed_nodes: set[str] = set()
        self.generation: dict[str, int] = {}
        self.recover()

    # ------------------------------------------------------------------ helpers
    def _spec(self, job: Job) -> JobSpec:
        spec = self._specs.get(job.id)
        if spec is None:
            spec = self._specs[job.id] = parse_job(job.spec_yaml)
        return spec

    def _request(self, job_id: str, spec: JobSpec, pending: Sequence[tuple[str, int]] | None = None) -> GroupRequest:
        return group_request(job_id, spec, pending)

    def _event(self, s: Session, job_id: str, type_: str, **data) -> None:
        s.add(Event(time=self._clock(), job_id=job_id, type=type_, data=data))

    def _set_job_state(self, job: Job, new: JobState) -> None:
        old = JobState(job.state) if job.state else None
        if old == new:
            return
        check_job_transition(old, new)
        job.state = new.value

    def _set_task_state(self, task: Task, new: TaskState) -> None:
        old = TaskState(task.state) if task.state else None
        if old == new:
            return
        check_task_transition(old, new)
        task.state = new.value

    def _touch(self, *nodes: str | None) -> None:
        """Note that these nodes' assignments change with the current transaction."""
        self._changed_nodes.update(n for n in nodes if n)

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

    def _get_job(self, s: Session, job_id: str) -> Job:
        job = s.get(Job, job_id)
        if job is None:
            raise NotFoundError(f"Job {job_id} not found.")
        return job

    def _latest_tasks(self, s: Session, job: Job, attempt: int | None = None) -> list[Task]:
        a = job.attempt if attempt is None else attempt
        return list(
            s.scalars(
                select(Task)
                .where(Task.job_id == job.id, Task.attempt == a, Task.latest.is_(True))
                .order_by(Task.task_role, Task.index)
            )
        )

    # ------------------------------------------------------------------ recovery
    def recover(self) -> None:
        """Rebuild the scheduler's allocations from unreleased placements (after a restart).

        Nodes start unhealthy until their agent reports (nothing is placed on a node nobody
        runs), except that placements already on them are kept; every known node gets a fresh
        heartbeat grace period so a control-plane restart never declares nodes lost.
        """
        now = self._clock()
        with self._lock, self._sessions() as s:
            for node in self.scheduler.nodes():
                self.scheduler.set_node_health(node, False)
            for node in s.scalars(select(Node)):
                self._heartbeats[node.name] = now
            by_job: dict[str, list[Placement]] = {}
            for p in s.scalars(select(Placement).where(Placement.released.is_(False))):
                by_job.setdefault(p.job_id, []).append(p)
            for job_id, placements in by_job.items():
                job = s.get(Job, job_id)
                spec = self._spec(job)
                tps = [
                    TaskPlacement(
                        task_role=p.task_role,
                        index=p.index,
                        node=p.node,
                        leaf_cell_indices=tuple(p.leaf_cells),
                        gpus=tuple(p.gpus),
                    )
                    for p in placements
                ]
                self.scheduler.allocate(job_id, self._request(job_id, spec), tps)
            if by_job:
                logger.info("recovered placements jobs=%d", len(by_job))
        self.wake.set()

    # ------------------------------------------------------------------ jobs
    def submit(self, text: str | bytes, user: str, *, flow_run_id: str | None = None) -> dict:
        """Accept a job (OpenPAI protocol v2 YAML). Returns its JSON once committed (durable).

        Raises ValidationError (bad YAML/field, bad user), QuotaExceededError (gang job larger
        than its VC), ConflictError (``user~name`` exists).
        """
        if not USER_PATTERN.match(user or ""):
            raise ValidationError("user", f"invalid user name {user!r}: use letters, digits, '_' or '-'")
        spec = parse_job(text)
        for role in spec.task_roles:
            spec.render_commands(role)  # unknown <% $parameters.x %> references fail now, not at launch
        job_id = f"{user}~{spec.name}"
        self.scheduler.validate(self._request(job_id, spec))
        now = self._clock()
        with self._lock, self._sessions() as s:
            if s.get(Job, job_id) is not None:
                raise ConflictError(f"Job name {spec.name} already exists for user {user}.")
            job = Job(
                id=job_id,
                user=user,
                name=spec.name,
                virtual_cluster=spec.virtual_cluster,
                priority_class=spec.priority_class,
                priority=spec.priority,
                gang=spec.gang,
                spec_yaml=text.decode() if isinstance(text, bytes) else text,
                state=None,
                execution_type="START",
                attempt=0,
                retries_user=0,
                retries_platform=0,
                submission_time=now,
                flow_run_id=flow_run_id,
                waiting_reason="Waiting for the next scheduling cycle.",
            )
            self._set_job_state(job, JobState.WAITING)
            s.add(job)
            s.flush()
            self._new_attempt(s, job, spec, 0)
            self._event(
                s,
                job_id,
                "job.submitted",
                user=user,
                name=spec.name,
                virtualCluster=spec.virtual_cluster,
                priorityClass=spec.priority_class,
                flowRunId=flow_run_id,
            )
            s.commit()
            self._specs[job_id] = spec
            logger.info("accepted job=%s vc=%s priority=%s", job_id, spec.virtual_cluster, spec.priority_class)
            result = self._job_json(s, job)
        self.wake.set()
        return result

    def _new_attempt(self, s: Session, job: Job, spec: JobSpec, index: int) -> None:
        s.add(Attempt(job_id=job.id, index=index, created=self._clock()))
        for role, tr in spec.task_roles.items():
            for i in range(tr.instances):
                t = Task(job_id=job.id, attempt=index, task_role=role, index=i, task_attempt=0, latest=True)
                self._set_task_state(t, TaskState.WAITING)
                s.add(t)

    def stop(self, job_id: str) -> dict:
        """OpenPAI's ``executionType: STOP``. Idempotent; a finished job is returned unchanged."""
        with self._lock, self._sessions() as s:
            job = self._get_job(s, job_id)
            if not JobState(job.state).is_final and job.execution_type != "STOP":
                job.execution_type = "STOP"
                self._event(s, job_id, "job.stop_requested")
                attempt = s.get(Attempt, (job.id, job.attempt))
                # A stop overrides a pending preemption or failure (the job must not retry), but
                # not a success the completion policy already decided.
                if attempt.outcome != "SUCCEEDED":
                    attempt.outcome = "STOPPED"
                    attempt.exit_code = EXIT_STOPPED
                    attempt.reason = "Stopped by the user."
                self._stop_attempt(s, job, "user-stop")
                self.scheduler.cancel(job_id)
                self._maybe_finish_attempt(s, job)
                s.commit()
            result = self._job_json(s, job)
        self._flush_notifications()
        self.wake.set()
        return result

    def tag_job(self, job_id: str, tag: str) -> dict:
        """Add ``tag`` to the job's tags (OpenPAI alert handler's tag-jobs). Idempotent."""
        with self._lock, self._sessions() as s:
            job = self._get_job(s, job_id)
            if tag not in (job.tags or []):
                job.tags = [*(job.tags or []), tag]
                self._event(s, job_id, "job.tagged", tag=tag)
                s.commit()
            return self._job_json(s, job)

    def reconfigure(self, source: str | bytes) -> dict:
        """Apply a changed HiveD cluster config with jobs running (HiveD's reconfiguration).

        Jobs whose cells still exist and whose VC still has quota keep running untouched; every
        other job's attempt is stopped and retried as a platform retry, with the scheduler's
        explanation as its reason. Returns ``{"kept": [job], "stopped": {job: reason}}``.
        Raises ValidationError (nothing changes) for an illegal config.
        """
        config = load_cluster_config(source)
        text = source.decode() if isinstance(source, bytes) else source
        with self._lock, self._sessions() as s:
            dropped = self.scheduler.reconfigure(config)
            self.cluster = config
            stopped: dict[str, str] = {}
            for job_id, why in sorted(dropped.items()):
                job = s.get(Job, job_id)
                if job is None or JobState(job.state).is_final:
                    continue
                attempt = s.get(Attempt, (job.id, job.attempt))
                if attempt.outcome is None:
                    attempt.outcome = "RECONFIGURED"
                    attempt.exit_code = EXIT_PREEMPTED
                    attempt.reason = f"Cluster config changed: {why}."
                    self._event(s, job.id, "job.preempted", attempt=job.attempt, by="cluster-config",
                                reason=attempt.reason)
                self._stop_attempt(s, job, "reconfigured")
                self._maybe_finish_attempt(s, job)
                stopped[job_id] = why
            kept = sorted(set(self.scheduler.status()["groups"]) - set(stopped))
            s.commit()
            if self.config_path is not None:
                self.config_path.write_text(text)  # a restart comes back with the applied config
            logger.info("cluster config applied kept=%d stopped=%d", len(kept), len(stopped))
        self._flush_notifications()
        self.wake.set()
        return {"kept": kept, "stopped": stopped}

    def set_flow_run(self, job_id: str, flow_run_id: str) -> None:
        with self._lock, self._sessions() as s:
            job = self._get_job(s, job_id)
            job.flow_run_id = flow_run_id
            s.commit()

    def get_job(self, job_id: str) -> dict:
        with self._sessions() as s:
            return self._job_json(s, self._get_job(s, job_id))

    def list_jobs(
        self, *, user: str | None = None, virtual_cluster: str | None = None, state: str | None = None
    ) -> list[dict]:
        with self._sessions() as s:
            q = select(Job).order_by(Job.submission_time, Job.id)
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
            simulated = self._simulated_nodes(s)
            return [
                self._job_json(s, j, [t for t in tasks.get(j.id, []) if t.attempt == j.attempt], simulated)
                for j in jobs
            ]

    def _simulated_nodes(self, s: Session) -> set[str]:
        return set(s.scalars(select(Node.name).where(Node.simulated_gpus.is_(True))))

    def _job_json(self, s: Session, job: Job, tasks: list[Task] | None = None,
                  simulated: set[str] | None = None) -> dict:
        tasks = self._latest_tasks(s, job) if tasks is None else tasks
        simulated = self._simulated_nodes(s) if simulated is None else simulated
        return {
            "id": job.id,
            "name": job.name,
            "user": job.user,
            "virtualCluster": job.virtual_cluster,
            "priorityClass": job.priority_class,
            "priority": job.priority,
            "gang": job.gang,
            "state": job.state,
            "executionType": job.execution_type,
            "attempt": job.attempt,
            "retries": job.retries_user + job.retries_platform,
            "retryDetails": {"user": job.retries_user, "platform": job.retries_platform},
            "submissionTime": _iso(job.submission_time),
            "launchTime": _iso(job.launch_time),
            "completionTime": _iso(job.completion_time),
            "exitCode": job.exit_code,
            "exitPhrase": job.exit_phrase,
            "waitingReason": job.waiting_reason,
            "flowRunId": job.flow_run_id,
            "tags": list(job.tags or []),
            "tasks": [
                {
                    "taskRole": t.task_role,
                    "index": t.index,
                    "attempt": t.attempt,
                    "taskAttempt": t.task_attempt,
                    "state": t.state,
                    "node": t.node,
                    "gpus": list(t.gpus or []),
                    # The node advertises the cluster config's GPUs without having them.
                    "simulatedGpus": t.node in simulated if t.node else None,
                    "exitCode": t.exit_code,
                    "exitPhrase": t.exit_phrase,
                    "startTime": _iso(t.started),
                    "completionTime": _iso(t.finished),
                }
                for t in tasks
            ],
        }

    def events(self, after: int = 0, limit: int = 500, job_id: str | None = None) -> list[dict]:
        with self._sessions() as s:
            q = select(Event).where(Event.seq > after).order_by(Event.seq).limit(min(max(limit, 1), 5000))
            if job_id:
                q = q.where(Event.job_id == job_id)
            return [
                {"seq": e.seq, "time": e.time, "jobId": e.job_id, "type": e.type, "data": e.data}
                for e in s.scalars(q)
            ]

    # ------------------------------------------------------------------ scheduling
    def cycle(self) -> CycleResult:
        """One scheduling cycle (Kueue-style numbered steps). Safe to call from any thread."""
        t0 = time.perf_counter()
        result = CycleResult()
        with self._lock, self._sessions() as s:
            # 1. Lost nodes first, so their tasks' cells are not counted as busy below.
            self._check_lost_nodes(s)
            # 2. Heads: every job with instances still to place, highest priority first, then FIFO.
            jobs = list(
                s.scalars(
                    select(Job)
                    .where(Job.state.in_([JobState.WAITING.value, JobState.RUNNING.value]))
                    .where(Job.execution_type == "START")
                    .order_by(Job.priority.desc(), Job.submission_time, Job.id)
                )
            )
            waiting_tasks: dict[str, list[Task]] = {}
            for t in s.scalars(select(Task).where(Task.state == TaskState.WAITING.value, Task.latest.is_(True))):
                waiting_tasks.setdefault(t.job_id, []).append(t)
            for job in jobs:
                pending_tasks = [t for t in waiting_tasks.get(job.id, []) if t.attempt == job.attempt]
                if not pending_tasks:
                    continue
                attempt = s.get(Attempt, (job.id, job.attempt))
                if attempt.outcome is not None:
                    continue  # the attempt is ending; its retry will be scheduled afresh
                spec = self._spec(job)
                pending = [(t.task_role, t.index) for t in pending_tasks]
                # 3. Nominate: ask the pure scheduler for this group. A job the current config
                # cannot take any more (its VC was removed) waits with the reason; it never stops
                # the cycle for the others.
                try:
                    decision = self.scheduler.schedule(self._request(job.id, spec, pending))
                except UserError as e:
                    why = f"Cannot be scheduled with the current cluster config: {e.message}"
                    self._set_waiting_reason(s, job, why)
                    result.waiting[job.id] = job.waiting_reason
                    continue
                # 4. Admit: commit its decision.
                for victim in decision.downgraded:
                    self._event(s, victim, "job.downgraded", by=job.id,
                                reason=f"Downgraded to opportunistic by {job.id} (lazy preemption).")
                if decision.kind == "place" and decision.placements:
                    self._place(s, job, spec, pending_tasks, decision.placements)
                    result.placed.append(job.id)
                    if len(decision.placements) < len(pending_tasks):
                        self._set_waiting_reason(s, job, decision.reason or "Waiting for resources for the rest.")
                        result.waiting[job.id] = job.waiting_reason
                elif decision.kind == "preempt":
                    for victim in decision.victims:
                        if self._preempt(s, victim, by=job.id):
                            result.preempted.append(victim)
                    self._set_waiting_reason(s, job, decision.reason)
                    result.waiting[job.id] = decision.reason
                else:
                    self._set_waiting_reason(s, job, decision.reason)
                    result.waiting[job.id] = decision.reason
            s.commit()
        self._flush_notifications()
        result.duration_ms = (time.perf_counter() - t0) * 1000
        return result

    def _set_waiting_reason(self, s: Session, job: Job, reason: str) -> None:
        if reason and job.waiting_reason != reason:
            job.waiting_reason = reason
            self._event(s, job.id, "job.waiting", attempt=job.attempt, reason=reason)

    def _place(
        self, s: Session, job: Job, spec: JobSpec, pending: list[Task], placements: Sequence[TaskPlacement]
    ) -> None:
        now = self._clock()
        by_key = {(t.task_role, t.index): t for t in pending}
        self.scheduler.allocate(job.id, self._request(job.id, spec), placements)
        for p in placements:
            task = by_key[(p.task_role, p.index)]
            s.add(
                Placement(
                    job_id=job.id,
                    attempt=job.attempt,
                    task_role=p.task_role,
                    index=p.index,
                    node=p.node,
                    leaf_cells=list(p.leaf_cell_indices),
                    gpus=list(p.gpus),
                    created=now,
                )
            )
            task.node = p.node
            task.gpus = list(p.gpus)
            task.placed_at = now
            task.run_id = run_id_for(job.id, job.attempt, task.task_role, task.index, task.task_attempt)
            self._set_task_state(task, TaskState.STARTING)
            self._touch(p.node)
        if len(placements) == len(pending):
            job.waiting_reason = None
        self._event(
            s,
            job.id,
            "job.placed",
            attempt=job.attempt,
            placements=[
                {"taskRole": p.task_role, "index": p.index, "node": p.node, "gpus": list(p.gpus)} for p in placements
            ],
        )
        logger.info("placed job=%s attempt=%d tasks=%d", job.id, job.attempt, len(placements))

    def _preempt(self, s: Session, victim_id: str, *, by: str) -> bool:
        """Decide the victim's attempt as PREEMPTED and stop its tasks. False if already decided."""
        job = s.get(Job, victim_id)
        if job is None or JobState(job.state).is_final:
            return False
        attempt = s.get(Attempt, (job.id, job.attempt))
        if attempt.outcome is not None:
            return False
        attempt.outcome = "PREEMPTED"
        attempt.exit_code = EXIT_PREEMPTED
        attempt.preempted_by = by
        attempt.reason = f"Preempted by {by}."
        self._event(s, job.id, "job.preempted", attempt=job.attempt, by=by, reason=attempt.reason)
        logger.info("preempting job=%s by=%s", job.id, by)
        self._stop_attempt(s, job, "preempted")
        self._maybe_finish_attempt(s, job)
        return True

    def _stop_attempt(self, s: Session, job: Job, reason: str) -> None:
        """Ask every live task of the current attempt to end; unplaced ones end at once."""
        for t in self._latest_tasks(s, job):
            if t.state == TaskState.WAITING.value:
                t.finished = self._clock()
                self._set_task_state(t, TaskState.STOPPED)
            elif t.state in ACTIVE_TASK_STATES and t.desired != "STOP":
                t.desired = "STOP"
                t.stop_reason = reason
                self._touch(t.node)

    # ------------------------------------------------------------------ nodes
    def node_report(self, node: str, *, gpus: int, simulated_gpus: bool, address: str, agent_id: str,
                    runs: Iterable[dict], metrics_url: str | None = None) -> dict:
        """Apply an agent's heartbeat and run statuses (``TaskStatus`` dicts). Idempotent.

        Returns ``{"ack": [run_id]}``: runs whose final status is recorded (the agent may forget them).
        Raises NotFoundError for a node the cluster config does not declare. A bare heartbeat from
        a known healthy node touches only memory (agents send one every 2 s per node; committing
        each one and waking the scheduler for it cost a third of a core at 128 nodes).
        """
        if node not in self.scheduler.nodes():
            raise NotFoundError(f"Node {node} is not in the cluster config.")
        runs = list(runs)
        info = (gpus, simulated_gpus, address, agent_id)
        now = self._clock()
        with self._lock:
            self._heartbeats[node] = now
            if metrics_url:
                self.metrics_urls[node] = metrics_url
            if not runs and self._node_info.get(node) == info and self._healthy.get(node):
                return {"ack": []}
            ack: list[str] = []
            woke = False
            with self._sessions() as s:
                row = s.get(Node, node)
                if row is None:
                    row = Node(name=node)
                    s.add(row)
                if not row.healthy:
                    logger.info("node=%s healthy again", node)
                row.gpus, row.simulated_gpus, row.address, row.agent_id = info
                row.healthy = True
                row.last_heartbeat = now
                if not self._healthy.get(node):
                    woke = True
                self._node_info[node] = info
                self._healthy[node] = True
                if not row.cordoned:
                    self.scheduler.set_node_health(node, True)
                for run in runs:
                    if self._apply_run(s, node, run):
                        ack.append(run["run_id"])
                woke = woke or bool(runs)
                s.commit()
        self._flush_notifications()
        if woke:
            self.wake.set()
        return {"ack": ack}

    def cordon(self, node: str, cordoned: bool = True) -> dict:
        """Cordon (no new placements; running tasks keep going until they end) or uncordon a node,
        as ``kubectl cordon`` does. Idempotent. Raises NotFoundError for an unknown node."""
        if node not in self.scheduler.nodes():
            raise NotFoundError(f"Node {node} is not in the cluster config.")
        with self._lock, self._sessions() as s:
            row = s.get(Node, node)
            if row is None:
                row = Node(name=node, healthy=False)
                s.add(row)
            if row.cordoned != cordoned:
                logger.info("node=%s %s", node, "cordoned" if cordoned else "uncordoned")
            row.cordoned = cordoned
            self.scheduler.set_node_health(node, bool(self._healthy.get(node)) and not cordoned)
            s.commit()
        self.wake.set()
        return next(n for n in self.list_nodes() if n["name"] == node)

    def _apply_run(self, s: Session, node: str, run: dict) -> bool:
        task = s.scalars(select(Task).where(Task.run_id == run["run_id"])).first()
        if task is None or task.node != node:
            return True  # unknown to us: the agent should stop and forget it
        if task.state in FINAL_TASK_STATES:
            return True
        job = s.get(Job, task.job_id)
        if run.get("started_at") and task.state == TaskState.STARTING.value:
            task.started = run["started_at"]
            task.pid = run.get("pid")
            self._set_task_state(task, TaskState.RUNNING)
            self._event(
                s, job.id, "task.started", attempt=task.attempt, taskRole=task.task_role, index=task.index,
                node=node, gpus=list(task.gpus or []),
            )
            attempt = s.get(Attempt, (job.id, task.attempt))
            if attempt.launched is None:
                attempt.launched = task.started
            if job.launch_time is None:
                job.launch_time = task.started
            if job.state == JobState.WAITING.value and task.attempt == job.attempt:
                self._set_job_state(job, JobState.RUNNING)
        if run.get("state") != "exited":
            return False
        code = run.get("exit_code")
        if code is None:
            code = EXIT_LOST_PROCESS if run.get("lost") else EXIT_STOPPED
        self._task_exited(s, job, task, int(code), run.get("finished_at") or self._clock())
        return True

    def _task_exited(self, s: Session, job: Job, task: Task, code: int, finished: float) -> None:
        info = classify_exit(code)
        task.exit_code = code
        task.exit_phrase = info.phrase
        task.finished = finished
        if task.started is None:
            task.started = finished
        spec = self._spec(job)
        if task.desired == "STOP":
            self._set_task_state(task, TaskState.STOPPED)
        elif code == 0:
            if task.state == TaskState.STARTING.value:
                self._set_task_state(task, TaskState.RUNNING)
            self._set_task_state(task, TaskState.SUCCEEDED)
        else:
            self._set_task_state(task, TaskState.FAILED)
        self._event(
            s, job.id, "task.exited", attempt=task.attempt, taskRole=task.task_role, index=task.index,
            exitCode=code, phrase=info.phrase, state=task.state,
        )
        attempt = s.get(Attempt, (job.id, task.attempt))
        tr = spec.task_roles[task.task_role]
        if (
            task.state == TaskState.FAILED.value
            and not spec.gang  # OpenPAI honours taskRetryCount only without gang allocation
            and attempt.outcome is None
            and task_retry(code, task_retries=task.task_attempt, task_retry_count=tr.task_retry_count)
        ):
            # OpenPAI's taskRetryCount: run the instance again in place, on the same cells.
            task.latest = False
            again = Task(
                job_id=job.id, attempt=task.attempt, task_role=task.task_role, index=task.index,
                task_attempt=task.task_attempt + 1, node=task.node, gpus=task.gpus, placed_at=self._clock(),
                latest=True,
            )
            again.run_id = run_id_for(job.id, task.attempt, task.task_role, task.index, again.task_attempt)
            self._set_task_state(again, TaskState.WAITING)
            self._set_task_state(again, TaskState.STARTING)
            s.add(again)
            self._touch(task.node)
            return
        self._release(s, job, task.attempt, [(task.task_role, task.index)])
        self._touch(task.node)
        s.flush()
        if attempt.outcome is None and task.attempt == job.attempt:
            self._evaluate_completion(s, job, spec)
        self._maybe_finish_attempt(s, job)

    def _release(self, s: Session, job: Job, attempt: int, instances: Sequence[tuple[str, int]] | None) -> None:
        q = select(Placement).where(
            Placement.job_id == job.id, Placement.attempt == attempt, Placement.released.is_(False)
        )
        rows = [p for p in s.scalars(q) if instances is None or (p.task_role, p.index) in set(instances)]
        for p in rows:
            p.released = True
        if rows:
            self.scheduler.release(job.id, [(p.task_role, p.index) for p in rows])

    def _evaluate_completion(self, s: Session, job: Job, spec: JobSpec) -> None:
        tasks = self._latest_tasks(s, job)
        roles = {
            role: RoleCompletion(
                instances=tr.instances,
                min_failed=tr.completion.min_failed_instances,
                min_succeeded=tr.completion.min_succeeded_instances,
            )
            for role, tr in spec.task_roles.items()
        }
        outcomes = {}
        for role in roles:
            mine = [t for t in tasks if t.task_role == role]
            outcomes[role] = RoleOutcome(
                succeeded=sum(t.state == TaskState.SUCCEEDED.value for t in mine),
                failed=sum(t.state == TaskState.FAILED.value for t in mine),
                finished=sum(t.state in FINAL_TASK_STATES for t in mine),
            )
        verdict = evaluate_completion(roles, outcomes)
        if verdict is None:
            return
        attempt = s.get(Attempt, (job.id, job.attempt))
        attempt.outcome = verdict
        if verdict == "SUCCEEDED":
            attempt.exit_code = 0
            attempt.reason = "Completion policy met: enough task instances succeeded."
        else:
            failed = [t for t in tasks if t.state == TaskState.FAILED.value]
            last = max(failed, key=lambda t: t.finished or 0) if failed else None
            attempt.exit_code = last.exit_code if last else 1
            attempt.reason = (
                f"Task {last.task_role}/{last.index} failed with exit code {last.exit_code} ({last.exit_phrase})."
                if last else "Completion policy: the job failed."
            )
        self._stop_attempt(s, job, "completion")

    def _maybe_finish_attempt(self, s: Session, job: Job) -> None:
        """Step 5: once the decided attempt has no live task, end the job or retry it."""
        attempt = s.get(Attempt, (job.id, job.attempt))
        if attempt.outcome is None or attempt.finished is not None:
            return
        tasks = self._latest_tasks(s, job)
        if any(t.state not in FINAL_TASK_STATES for t in tasks):
            return
        now = self._clock()
        attempt.finished = now
        self._release(s, job, job.attempt, None)
        self.scheduler.release(job.id)
        outcome, code = attempt.outcome, attempt.exit_code
        if outcome == "SUCCEEDED":
            return self._complete(s, job, JobState.SUCCEEDED, 0)
        if outcome == "STOPPED":
            return self._complete(s, job, JobState.STOPPED, EXIT_STOPPED)
        platform = outcome in ("PREEMPTED", "NODE_LOST", "RECONFIGURED")
        decision = decide_retry(
            code if code is not None else 1,
            user_retries=job.retries_user,
            job_retry_count=self._spec(job).job_retry_count,
            platform_cause=platform,
        )
        if not decision.retry:
            return self._complete(s, job, JobState.FAILED, code)
        if decision.kind == "user":
            job.retries_user += 1
        else:
            job.retries_platform += 1
        job.attempt += 1
        self._new_attempt(s, job, self._spec(job), job.attempt)
        self._set_job_state(job, JobState.WAITING)
        reason = attempt.reason or decision.reason
        job.waiting_reason = f"Retrying ({decision.kind} retry): {reason} Waiting for the next scheduling cycle."
        self._event(
            s, job.id, "job.retry", attempt=job.attempt, kind=decision.kind, reason=f"{reason} {decision.reason}",
            exitCode=code,
        )
        logger.info("retry job=%s attempt=%d kind=%s", job.id, job.attempt, decision.kind)
        self.wake.set()

    def _complete(self, s: Session, job: Job, state: JobState, code: int | None) -> None:
        self._set_job_state(job, state)
        job.completion_time = self._clock()
        job.exit_code = code
        job.exit_phrase = classify_exit(code).phrase if code is not None else None
        job.waiting_reason = None
        self.scheduler.cancel(job.id)
        self._event(s, job.id, "job.completed", state=state.value, exitCode=code, attempt=job.attempt)
        logger.info("completed job=%s state=%s exit=%s", job.id, state.value, code)

    def _check_lost_nodes(self, s: Session) -> None:
        now = self._clock()
        for name, seen in list(self._heartbeats.items()):
            if now - seen <= self._node_lost_after_s:
                continue
            row = s.get(Node, name)
            if row is None or not row.healthy:
                continue
            row.healthy = False
            self._healthy[name] = False
            self.scheduler.set_node_health(name, False)
            logger.warning("node=%s lost: no report for %.0f s", name, now - seen)
            for t in s.scalars(select(Task).where(Task.node == name, Task.state.in_(ACTIVE_TASK_STATES))):
                job = s.get(Job, t.job_id)
                attempt = s.get(Attempt, (job.id, t.attempt))
                if attempt.outcome is None:
                    attempt.outcome = "NODE_LOST"
                    attempt.exit_code = EXIT_NODE_LOST
                    attempt.reason = f"Node {name} was lost."
                # The task is gone with its node; record it failed so the attempt can end.
                t.desired = "STOP" if t.desired == "STOP" else "RUN"
                if t.state == TaskState.STARTING.value:
                    self._set_task_state(t, TaskState.RUNNING)
                decided = t.attempt
                self._task_exited(s, job, t, EXIT_NODE_LOST, now)
                # _task_exited may already have ended the attempt and created the retry; only
                # the lost attempt's other tasks are to be stopped, never the new attempt's.
                if job.attempt == decided and not JobState(job.state).is_final:
                    self._stop_attempt(s, job, "node-lost")
                    self._maybe_finish_attempt(s, job)

    def assignments(self, node: str) -> list[dict]:
        """The task runs ``node`` should be running now, with everything needed to launch them.

        Each item: ``{"runId", "desired": "RUN"|"STOP", "launch": TaskLaunch fields}``. A run absent
        from the list must not run on the node.
        """
        with self._sessions() as s:
            tasks = list(s.scalars(select(Task).where(Task.node == node, Task.state.in_(ACTIVE_TASK_STATES))))
            out = []
            for t in tasks:
                job = s.get(Job, t.job_id)
                spec = self._spec(job)
                out.append({
                    "runId": t.run_id, "desired": t.desired, "launch": self._launch(s, job, t),
                    "probes": probes_to_wire(*parse_probes(spec.extras, t.task_role)),
                    # For the node's task metrics (apiary_task_*{job,user,virtual_cluster,task_role,index}).
                    "labels": {"job": job.id, "user": job.user, "virtual_cluster": job.virtual_cluster,
                               "task_role": t.task_role, "index": str(t.index)},
                })
            return out

    def _launch(self, s: Session, job: Job, task: Task) -> dict:
        spec = self._spec(job)
        tr = spec.task_roles[task.task_role]
        addresses = {n.name: n.address for n in s.scalars(select(Node))}
        host_ips = {
            (t.task_role, t.index): addresses.get(t.node, "127.0.0.1")
            for t in self._latest_tasks(s, job, task.attempt)
            if t.node
        }
        node_row = s.get(Node, task.node)
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
            simulated_gpus=bool(node_row and node_row.simulated_gpus),
        )
        image = next(
            (p.uri for p in (spec.prerequisites or []) if p.type == "dockerimage" and p.name == tr.docker_image), None
        )
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
        }

    def list_nodes(self) -> list[dict]:
        status = self.scheduler.nodes()
        with self._sessions() as s:
            rows = {n.name: n for n in s.scalars(select(Node))}
            used: dict[str, int] = {}
            for p in s.scalars(select(Placement).where(Placement.released.is_(False))):
                used[p.node] = used.get(p.node, 0) + len(p.gpus)
        out = []
        for name, info in status.items():
            row = rows.get(name)
            out.append(
                {
                    "name": name,
                    "gpus": row.gpus if row else info.gpus,
                    "simulatedGpus": bool(row.simulated_gpus) if row else None,
                    "healthy": bool(row.healthy) if row else False,
                    "ready": row is not None and bool(row.healthy),
                    "cordoned": bool(row.cordoned) if row else False,
                    "address": row.address if row else None,
                    "skuType": info.sku_type,
                    "gpusUsed": used.get(name, 0),
                    "lastHeartbeat": _iso(self._heartbeats.get(name)),
                    "metricsUrl": self.metrics_urls.get(name),
                }
            )
        return out

    # ------------------------------------------------------------------ metrics and faults
    def metrics_snapshot(self) -> dict:
        """What :class:`~apiary.monitoring.PlatformCollector` renders on a scrape: job counts per VC
        and state, waiting jobs, preemptions per VC, VC cells, nodes, agent heartbeats. A few
        aggregate queries; no lock (reads a consistent snapshot of committed state)."""
        from sqlalchemy import func

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
        status = self.scheduler.status()
        vc_cells = {
            vc: {"used": v.get("used", 0), "free": v.get("free", 0), "opportunistic": v.get("opportunisticUsed", 0),
                 "bad": v.get("badCells", 0)}
            for vc, v in status.get("virtualClusters", {}).items()
        }
        heartbeats = [{"service": "node-agent", "instance": n, "timestamp": t} for n, t in self._heartbeats.items()]
        return {"now": self._clock(), "jobs": jobs, "waiting_jobs": waiting, "preemptions": preemptions,
                "vc_cells": vc_cells, "nodes": nodes, "heartbeats": heartbeats}

    def inject_fault(self, node: str, gpu: int, **fault) -> dict:
        """Queue a simulated-GPU fault (DCGM error injection) or ``clear=True`` for ``node``'s agent,
        which applies it to its simulated GPUs on its next long poll. Raises NotFoundError for an
        unknown node, ValidationError for a GPU index the node does not have."""
        info = self.scheduler.nodes().get(node)
        if info is None:
            raise NotFoundError(f"Node {node} is not in the cluster config.")
        if not 0 <= gpu < info.gpus:
            raise ValidationError("gpu", f"node {node} has GPUs 0..{info.gpus - 1}, not {gpu}")
        with self._lock:
            self._fault_seq += 1
            item = {"id": self._fault_seq, "gpu": gpu, **{k: v for k, v in fault.items() if v is not None}}
            self.faults.setdefault(node, []).append(item)
            self._touch(node)
        self._flush_notifications()
        logger.info("fault queued node=%s %s", node, item)
        return item

    # ------------------------------------------------------------------ logs
    def _log_file(self, run_id: str, stream: str) -> Path:
        return self.logs_dir / f"{run_id}.{stream}.log"

    def append_log(self, run_id: str, stream: str, offset: int, data: bytes) -> int:
        """Store bytes ``[offset, offset+len(data))`` of a run's stream; overlaps are skipped, so
        agents may resend after a failure (idempotent). Returns the stored size."""
        if stream not in ("stdout", "stderr"):
            raise ValidationError("stream", "must be stdout or stderr")
        path = self._log_file(run_id, stream)
        size = path.stat().st_size if path.exists() else 0
        if offset + len(data) > size:
            with path.open("ab") as f:
                f.write(data[max(size - offset, 0):])
            size = offset + len(data) if offset <= size else size + len(data)
        return size

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
