"""The job lifecycle as one pure reducer: ``step(job, input, now) -> Effects``.

This module is the only place that decides what happens to a job: when a task's exit ends an
attempt, what the completion policy concludes, whether an attempt is retried, what a stop, a
preemption, a lost node or a cluster reconfiguration does. Two shells drive it:

* the control plane (:mod:`apiary.control`), which loads a :class:`JobRecord` from the store,
  runs :func:`step`, writes the changed record, the events and the placement changes in one
  transaction, and only after the commit applies the scheduler operations and wakes the nodes;
* the simulator (:mod:`apiary.sim`), which keeps the records in memory and applies the same
  operations to its scheduler at once.

So the what-if simulator runs the live platform's logic, not a copy of it.

Purity: no I/O, no clock (``now`` is an argument, unix or simulated seconds), no threads, no
randomness. :func:`step` mutates the :class:`JobRecord` it is given (and its task and attempt
records) in place and returns what else must happen; a caller that must not see a change before
its commit passes a record it can throw away (the control plane builds a fresh one per
transaction from the store).

Inputs (each a small frozen dataclass): :class:`Placed`, :class:`Waiting`, :class:`Preempted`,
:class:`Downgraded`, :class:`Reconfigured`, :class:`StopRequested`, :class:`RunReported`,
:class:`NodeLost`. A new job is made with :func:`submit`.

Rules and their sources: the completion policy and the retry decisions are
:func:`apiary.lifecycle.policy.evaluate_completion`, :func:`~apiary.lifecycle.policy.decide_retry`
and :func:`~apiary.lifecycle.policy.task_retry` (OpenPAI's protocol and FrameworkController); exit
codes are classified by OpenPAI's exit spec (:mod:`apiary.lifecycle.exitspec`); every state change
goes through the transition tables of :mod:`apiary.lifecycle.states` (``STATES.md``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

from apiary.lifecycle.exitspec import EXIT_NODE_LOST, EXIT_PREEMPTED, EXIT_STOPPED, classify_exit
from apiary.lifecycle.policy import RoleCompletion, RoleOutcome, decide_retry, evaluate_completion, task_retry
from apiary.lifecycle.states import (
    AttemptOutcome,
    Desired,
    ExecutionType,
    JobState,
    TaskState,
    check_job_transition,
    check_task_transition,
)
from apiary.scheduler.types import GroupRequest, TaskPlacement

if TYPE_CHECKING:  # the reducer needs a spec only in job_policy(); keep the import graph small
    from apiary.spec.job import JobSpec

__all__ = [
    "ACTIVE_TASK_STATES",
    "EXIT_LOST_PROCESS",
    "Allocate",
    "AttemptRecord",
    "Cancel",
    "Downgraded",
    "Effects",
    "Input",
    "Instance",
    "JobPolicy",
    "JobRecord",
    "NodeLost",
    "Placed",
    "Preempted",
    "Reconfigured",
    "Release",
    "RunReported",
    "SchedulerOp",
    "StopRequested",
    "TaskRecord",
    "Waiting",
    "job_policy",
    "run_id_for",
    "step",
    "submit",
    "waiting_event",
]

#: ``(taskRole, index)``: one task instance of a job.
Instance: TypeAlias = tuple[str, int]

#: Task states whose run holds cells on a node (placed and not ended).
ACTIVE_TASK_STATES = frozenset({TaskState.STARTING, TaskState.RUNNING})

#: Exit code recorded for a run whose process vanished without an exit code (its wrapper was killed
#: with it): OpenPAI's 137 ContainerSigKillReceived, a transient platform failure.
EXIT_LOST_PROCESS = 137

_WAIT_FIRST = "Waiting for the next scheduling cycle."


@functools.lru_cache(maxsize=4096)
def _outcome(succeeded: int, failed: int, finished: int) -> RoleOutcome:
    """A role's counts, shared (immutable; few distinct triples): one is built per task exit."""
    return RoleOutcome(succeeded, failed, finished)


def run_id_for(job_id: str, attempt: int, task_role: str, index: int, task_attempt: int) -> str:
    """The node-side idempotency key of one task run: ``alice~mnist.a0.train.0.t0``."""
    return f"{job_id}.a{attempt}.{task_role}.{index}.t{task_attempt}"


_RUN_TAIL = re.compile(r"a[0-9]+\.[A-Za-z_][A-Za-z0-9_]*\.[0-9]+\.t[0-9]+")


def job_of_run(run_id: str) -> str | None:
    """The job id :func:`run_id_for` built ``run_id`` from, or None when ``run_id`` does not have
    its shape. Read from the right: a task role is an identifier (``IDENTIFIER_PATTERN`` of
    apiary.spec.job) and the rest are numbers, so the last four dot-separated parts are never part
    of the job id, whatever it holds."""
    parts = run_id.rsplit(".", 4)
    if len(parts) != 5 or not parts[0] or not _RUN_TAIL.fullmatch(".".join(parts[1:])):
        return None
    return parts[0]


# ----------------------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class JobPolicy:
    """What the lifecycle needs of a job's spec, fixed at submission.

    ``request``: the job's affinity group (all instances; :func:`apiary.scheduler.requests.group_request`).
    ``roles``: task role -> instances and completion policy. ``job_retry_count``: OpenPAI
    ``jobRetryCount``. ``task_retry_counts``: task role -> ``taskRetryCount`` (honoured only when the job
    is not gang-allocated, as in OpenPAI).
    """

    request: GroupRequest
    roles: Mapping[str, RoleCompletion]
    job_retry_count: int = 0
    task_retry_counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def gang(self) -> bool:
        return self.request.gang

    def instances(self) -> list[Instance]:
        """Every instance of the job, role by role in spec order, then by index."""
        return [(role, i) for role, rc in self.roles.items() for i in range(rc.instances)]


def job_policy(job_id: str, spec: JobSpec) -> JobPolicy:
    """The :class:`JobPolicy` of an OpenPAI job: the one definition the control plane and the
    simulator share (its request is exactly what the scheduler is asked for this job)."""
    from apiary.scheduler.requests import group_request

    return JobPolicy(
        request=group_request(job_id, spec),
        roles={
            role: RoleCompletion(
                instances=tr.instances,
                min_failed=tr.completion.min_failed_instances,
                min_succeeded=tr.completion.min_succeeded_instances,
            )
            for role, tr in spec.task_roles.items()
        },
        job_retry_count=spec.job_retry_count,
        task_retry_counts={role: tr.task_retry_count for role, tr in spec.task_roles.items()},
    )


@dataclass(slots=True, eq=False)
class TaskRecord:
    """One run of one task instance in one attempt (OpenPAI's task attempt).

    Times are seconds (the caller's clock). ``gpus``: GPU indices on ``node``. ``latest``: False once a
    newer run of the same instance replaced it (an in-place retry).
    """

    task_role: str
    index: int
    attempt: int
    task_attempt: int = 0
    state: TaskState = TaskState.WAITING
    node: str | None = None
    gpus: tuple[int, ...] = ()
    desired: Desired = Desired.RUN
    stop_reason: str | None = None
    run_id: str | None = None
    exit_code: int | None = None
    exit_phrase: str | None = None
    pid: int | None = None
    placed_at: float | None = None
    started: float | None = None
    finished: float | None = None
    latest: bool = True

    @property
    def key(self) -> Instance:
        return (self.task_role, self.index)


@dataclass(slots=True, eq=False)
class AttemptRecord:
    """One attempt of a job. ``outcome`` is decided first (completion policy, stop, preemption, node
    loss, reconfiguration); the attempt is ``finished`` only once none of its tasks is alive."""

    index: int
    created: float
    launched: float | None = None
    finished: float | None = None
    outcome: AttemptOutcome | None = None
    exit_code: int | None = None
    reason: str | None = None
    preempted_by: str | None = None


@dataclass(slots=True, eq=False)
class JobRecord:
    """A job as the lifecycle sees it: its current attempt and the latest run of each instance.

    ``tasks`` maps every instance of the current attempt to its latest run. ``state`` is OpenPAI's job
    state; ``waiting_reason`` the sentence users see while it waits.
    """

    id: str
    user: str
    policy: JobPolicy
    state: JobState
    attempt: AttemptRecord
    tasks: dict[Instance, TaskRecord]
    submission_time: float
    execution_type: ExecutionType = ExecutionType.START
    retries_user: int = 0
    retries_platform: int = 0
    launch_time: float | None = None
    completion_time: float | None = None
    exit_code: int | None = None
    exit_phrase: str | None = None
    waiting_reason: str | None = None

    def pending(self) -> list[Instance]:
        """Instances of the current attempt still to place (tasks ``WAITING``), in key order."""
        return [k for k, t in self.tasks.items() if t.state is TaskState.WAITING]

    def schedulable(self) -> bool:
        """True while the scheduler should be asked for this job: not stopped, attempt undecided,
        something still to place."""
        if self.execution_type is not ExecutionType.START or self.attempt.outcome is not None:
            return False
        if self.state.is_final:
            return False
        for t in self.tasks.values():  # a loop, not any(): asked for every queue entry of a replay
            if t.state is TaskState.WAITING:
                return True
        return False


# ----------------------------------------------------------------------------------------- inputs
# Inputs and operations are NamedTuples: immutable values, and cheap to make (a replay makes one per
# run; a frozen dataclass took three times as long to build).
class Placed(NamedTuple):
    """The scheduler placed ``placements`` (a subset of the pending instances); ``reason`` explains
    why the rest still wait (incremental jobs)."""

    placements: tuple[TaskPlacement, ...]
    reason: str = ""


class Waiting(NamedTuple):
    """The job waits; ``reason`` is the scheduler's sentence (or why the config cannot take it)."""

    reason: str


class Preempted(NamedTuple):
    """The scheduler chose this job as a victim of ``by`` (HiveD preemption)."""

    by: str


class Downgraded(NamedTuple):
    """Lazy preemption: ``by`` turned this job opportunistic; it keeps running."""

    by: str


class Reconfigured(NamedTuple):
    """A new cluster config cannot hold this job's cells: ``reason`` says why."""

    reason: str


class StopRequested(NamedTuple):
    """The user set ``executionType: STOP``."""


class RunReported(NamedTuple):
    """A node agent's status of one run: started (``started_at``) and/or exited.

    ``exit_code`` None with ``exited``: killed without a code (``lost``: the process vanished, 137;
    otherwise a stop, -210).
    """

    node: str
    run_id: str
    exited: bool = False
    exit_code: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    pid: int | None = None
    lost: bool = False


class NodeLost(NamedTuple):
    """``node`` stopped heart-beating: its runs of this job are gone. Also a drain (an operator or
    a triage rule takes the node out: its runs are stopped and re-placed as platform retries, the
    way a lost node's are); ``reason`` then says so instead of "Node X was lost."."""

    node: str
    reason: str | None = None


Input: TypeAlias = Placed | Waiting | Preempted | Downgraded | Reconfigured | StopRequested | RunReported | NodeLost


# ----------------------------------------------------------------------------------------- effects
class Allocate(NamedTuple):
    """Give ``placements`` to attempt ``attempt`` of ``job`` (a placement row each; HiveD's
    AddAllocatedPod)."""

    job: str
    attempt: int
    request: GroupRequest
    placements: tuple[TaskPlacement, ...]


class Release(NamedTuple):
    """Free the cells of ``instances`` of attempt ``attempt`` (HiveD's DeleteAllocatedPod); None: every
    instance of the job, which also drops the group and its reservation."""

    job: str
    attempt: int
    instances: tuple[Instance, ...] | None


class Cancel(NamedTuple):
    """Drop the job's reservation (it no longer waits for the cells it was preempting for)."""

    job: str


SchedulerOp: TypeAlias = Allocate | Release | Cancel


@dataclass(slots=True)
class Effects:
    """What a :func:`step` asks its shell to do besides the record's own changes.

    ``events``: ``(type, data)`` to append to the job's history at ``now``. ``ops``: scheduler operations
    and placement changes, in order (the control plane applies them to the scheduler only after its
    commit). ``touched``: nodes whose agents must read their assignments again (a run to launch or
    to stop there; not a run the node itself reported over, which merely leaves its list).
    ``stopping``: placed runs this step told to stop (``desired`` became ``STOP``; their agents kill
    them). ``new_tasks``: task records this step created
    (a new attempt's tasks, or an in-place retry's run). ``new_attempt``: the attempt record this step
    created (the job's previous one is finished). ``ack``: a :class:`RunReported` is fully recorded (the
    agent may forget the run). ``wake``: the job now has something to schedule. ``decided``: a
    :class:`Preempted` / :class:`Reconfigured` decided the attempt's outcome.
    """

    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    ops: list[SchedulerOp] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)
    stopping: list[TaskRecord] = field(default_factory=list)
    new_tasks: list[TaskRecord] = field(default_factory=list)
    new_attempt: AttemptRecord | None = None
    ack: bool = False
    wake: bool = False
    decided: bool = False


# ----------------------------------------------------------------------------------------- submit
def submit(
    job_id: str,
    user: str,
    policy: JobPolicy,
    now: float,
    *,
    name: str = "",
    priority_class: str = "",
    flow_run_id: str | None = None,
    events: bool = True,
) -> tuple[JobRecord, Effects]:
    """A newly accepted job: ``WAITING``, attempt 0, one ``WAITING`` task per instance, event
    ``job.submitted`` (unless ``events=False``, as in :func:`step`). The caller has validated the spec
    and the quota."""
    fx = Effects(wake=True)
    attempt = AttemptRecord(index=0, created=now)
    check_job_transition(None, JobState.WAITING)
    job = JobRecord(
        id=job_id, user=user, policy=policy, state=JobState.WAITING, attempt=attempt, tasks={},
        submission_time=now, waiting_reason=_WAIT_FIRST,
    )
    job.tasks = _new_tasks(job, fx)
    if events:
        fx.events.append((
            "job.submitted",
            {"user": user, "name": name, "virtualCluster": policy.request.virtual_cluster,
             "priorityClass": priority_class, "flowRunId": flow_run_id},
        ))
    return job, fx


def _new_tasks(job: JobRecord, fx: Effects) -> dict[Instance, TaskRecord]:
    tasks: dict[Instance, TaskRecord] = {}
    a = job.attempt.index
    for role, i in job.policy.instances():
        check_task_transition(None, TaskState.WAITING)
        t = TaskRecord(task_role=role, index=i, attempt=a)
        tasks[(role, i)] = t
        fx.new_tasks.append(t)
    return tasks


def waiting_event(attempt: int, reason: str) -> tuple[str, dict[str, Any]]:
    """The event of a job whose waiting reason becomes ``reason`` during ``attempt``: ``job.waiting``
    with ``{"attempt", "reason"}``. :class:`Waiting` emits it through :func:`step`; a writer that
    records many first wait reasons without loading each job's record writes the same event."""
    return "job.waiting", {"attempt": attempt, "reason": reason}


# ----------------------------------------------------------------------------------------- step
def step(job: JobRecord, inp: Input, now: float, *, events: bool = True) -> Effects:
    """Apply one input to ``job`` (mutated in place) at time ``now``; return the other effects.

    ``events=False``: leave ``Effects.events`` empty (a trace replay that keeps no history saves
    building them; nothing else changes). Raises :class:`~apiary.errors.InvalidTransitionError` if a
    rule would break a transition table (a bug, never a user error) and ``KeyError`` for a
    :class:`Placed` naming an instance the job does not have.
    """
    s = _Step(job, now, events)
    handler = _HANDLERS.get(type(inp))
    if handler is None:  # pragma: no cover - the Input union is closed
        raise TypeError(f"unknown lifecycle input {inp!r}")
    handler(s, inp)
    return s.fx


class _Step:
    """One application of an input: the rules, numbered as in ARCHITECTURE.md's job lifecycle."""

    __slots__ = ("events", "fx", "job", "now")

    def __init__(self, job: JobRecord, now: float, events: bool = True) -> None:
        self.job = job
        self.now = now
        self.events = events
        self.fx = Effects()

    # ---------------------------------------------------------------- helpers
    def event(self, type_: str, **data: Any) -> None:
        if self.events:
            self.fx.events.append((type_, data))

    def set_job_state(self, new: JobState, *, retry: bool = False) -> None:
        old = self.job.state
        if old is new and not retry:  # a retry from WAITING is the edge WAITING -> WAITING (j3)
            return
        check_job_transition(old, new)
        self.job.state = new

    @staticmethod
    def set_task_state(task: TaskRecord, new: TaskState) -> None:
        old = task.state
        if old is new:
            return
        check_task_transition(old, new)
        task.state = new

    def set_waiting_reason(self, reason: str) -> None:
        job = self.job
        if reason and job.waiting_reason != reason:
            job.waiting_reason = reason
            if self.events:
                self.fx.events.append(waiting_event(job.attempt.index, reason))

    # ---------------------------------------------------------------- 2. placement (cycle, admit)
    def placed(self, inp: Placed) -> None:
        job = self.job
        a = job.attempt.index
        for p in inp.placements:
            t = job.tasks[(p.task_role, p.index)]
            t.node = p.node
            t.gpus = tuple(p.gpus)
            t.placed_at = self.now
            t.run_id = run_id_for(job.id, a, t.task_role, t.index, t.task_attempt)
            self.set_task_state(t, TaskState.STARTING)
            self.fx.touched.add(p.node)
        self.fx.ops.append(Allocate(job.id, a, job.policy.request, tuple(inp.placements)))
        rest = False
        for t in job.tasks.values():
            if t.state is TaskState.WAITING:
                rest = True
                break
        if not rest:
            job.waiting_reason = None
        if self.events:
            self.event(
                "job.placed", attempt=a,
                placements=[{"taskRole": p.task_role, "index": p.index, "node": p.node, "gpus": list(p.gpus)}
                            for p in inp.placements],
            )
        if rest:
            self.set_waiting_reason(inp.reason or "Waiting for resources for the rest.")

    # ---------------------------------------------------------------- 3./4. node reports
    def run_reported(self, r: RunReported) -> None:
        job = self.job
        task = None
        for t in job.tasks.values():
            if t.run_id == r.run_id:
                task = t
                break
        if task is None or task.node != r.node or task.state.is_final:
            self.fx.ack = True  # unknown here, another node's, or already recorded: forget it
            return
        started_at = r.started_at
        if started_at is None and r.exited and r.exit_code == 0:
            # A success with no recorded start (the agent died between starting the task and
            # recording it): the process ran, so it started; when is unknown, its end is the
            # closest bound. Recording the start first keeps the job's edges legal (WAITING ->
            # RUNNING -> SUCCEEDED; WAITING -> SUCCEEDED is none) and the job succeeds: it is never
            # run again. Any other code without a start is a launch failure's edge (STARTING ->
            # FAILED, the job WAITING -> FAILED or retried), decided by the code alone, as it would
            # be with a start.
            started_at = r.finished_at if r.finished_at is not None else self.now
        if started_at is not None and task.state is TaskState.STARTING:
            task.started = started_at
            task.pid = r.pid
            self.set_task_state(task, TaskState.RUNNING)
            if self.events:
                self.event("task.started", attempt=task.attempt, taskRole=task.task_role, index=task.index,
                           node=r.node, gpus=list(task.gpus))
            if job.attempt.launched is None:
                job.attempt.launched = task.started
            if job.launch_time is None:
                job.launch_time = task.started
            if job.state is JobState.WAITING:
                self.set_job_state(JobState.RUNNING)
        if not r.exited:
            return
        code = r.exit_code
        if code is None:
            code = EXIT_LOST_PROCESS if r.lost else EXIT_STOPPED
        self.task_exited(task, code, r.finished_at if r.finished_at is not None else self.now, reported=True)
        self.fx.ack = True

    def task_exited(self, task: TaskRecord, code: int, finished: float, *, reported: bool = False) -> None:
        """Record ``task``'s end with exit ``code`` at ``finished``. ``reported``: its own node said so
        (a :class:`RunReported`), so that node's agent already knows the run is over."""
        job = self.job
        info = classify_exit(code)
        task.exit_code = code
        task.exit_phrase = info.phrase
        task.finished = finished
        if task.started is None:
            task.started = finished
        if task.desired is Desired.STOP:
            self.set_task_state(task, TaskState.STOPPED)
        elif code == 0:
            if task.state is TaskState.STARTING:
                self.set_task_state(task, TaskState.RUNNING)
            self.set_task_state(task, TaskState.SUCCEEDED)
        else:
            self.set_task_state(task, TaskState.FAILED)
        if self.events:
            self.event("task.exited", attempt=task.attempt, taskRole=task.task_role, index=task.index,
                       exitCode=code, phrase=info.phrase, state=task.state.value)
        assert task.node is not None  # an ended run was placed
        if (
            task.state is TaskState.FAILED
            and not job.policy.gang  # OpenPAI honours taskRetryCount only without gang allocation
            and job.attempt.outcome is None
            and task_retry(code, task_retries=task.task_attempt,
                           task_retry_count=job.policy.task_retry_counts.get(task.task_role, 0))
        ):
            # OpenPAI's taskRetryCount: run the instance again in place, on the same cells.
            task.latest = False
            again = TaskRecord(task_role=task.task_role, index=task.index, attempt=task.attempt,
                               task_attempt=task.task_attempt + 1, node=task.node, gpus=task.gpus,
                               placed_at=self.now)
            again.run_id = run_id_for(job.id, task.attempt, task.task_role, task.index, again.task_attempt)
            check_task_transition(None, TaskState.WAITING)
            self.set_task_state(again, TaskState.STARTING)
            job.tasks[task.key] = again
            self.fx.new_tasks.append(again)
            self.fx.touched.add(task.node)
            return
        self.fx.ops.append(Release(job.id, task.attempt, (task.key,)))
        if not reported:
            # A run its node reported over needs no new read of the node's assignments (it just
            # leaves the list): waking that agent cost a long-poll answer per finished run. A run
            # ended here (node lost) wakes it so a returning agent stops the run at once.
            self.fx.touched.add(task.node)
        if job.attempt.outcome is None:
            self.evaluate_completion()
        self.maybe_finish_attempt()

    def evaluate_completion(self) -> None:
        job = self.job
        counts: dict[str, list[int]] = {role: [0, 0, 0] for role in job.policy.roles}
        for t in job.tasks.values():
            c = counts[t.task_role]
            if t.state is TaskState.SUCCEEDED:
                c[0] += 1
            elif t.state is TaskState.FAILED:
                c[1] += 1
            if t.state.is_final:
                c[2] += 1
        verdict = evaluate_completion(job.policy.roles, {r: _outcome(*c) for r, c in counts.items()})
        if verdict is None:
            return
        attempt = job.attempt
        if verdict == "SUCCEEDED":
            attempt.outcome = AttemptOutcome.SUCCEEDED
            attempt.exit_code = 0
            attempt.reason = "Completion policy met: enough task instances succeeded."
        else:
            attempt.outcome = AttemptOutcome.FAILED
            failed = [t for t in job.tasks.values() if t.state is TaskState.FAILED]
            last = max(failed, key=lambda t: t.finished or 0) if failed else None
            attempt.exit_code = last.exit_code if last else 1
            attempt.reason = (
                f"Task {last.task_role}/{last.index} failed with exit code {last.exit_code} ({last.exit_phrase})."
                if last else "Completion policy: the job failed."
            )
        self.stop_attempt("completion")

    # ---------------------------------------------------------------- 4. deciding an attempt
    def stop_attempt(self, reason: str) -> None:
        """Ask every live task of the current attempt to end; unplaced ones end at once."""
        for t in self.job.tasks.values():
            if t.state is TaskState.WAITING:
                t.finished = self.now
                self.set_task_state(t, TaskState.STOPPED)
            elif t.state in ACTIVE_TASK_STATES and t.desired is not Desired.STOP:
                t.desired = Desired.STOP
                t.stop_reason = reason
                self.fx.stopping.append(t)
                if t.node is not None:
                    self.fx.touched.add(t.node)

    def stop(self) -> None:
        job = self.job
        if job.state.is_final or job.execution_type is ExecutionType.STOP:
            return
        job.execution_type = ExecutionType.STOP
        self.event("job.stop_requested")
        attempt = job.attempt
        # A stop overrides a pending preemption or failure (the job must not retry), but not a
        # success the completion policy already decided.
        if attempt.outcome is not AttemptOutcome.SUCCEEDED:
            attempt.outcome = AttemptOutcome.STOPPED
            attempt.exit_code = EXIT_STOPPED
            attempt.reason = "Stopped by the user."
        self.stop_attempt("user-stop")
        self.fx.ops.append(Cancel(job.id))
        self.maybe_finish_attempt()

    def preempted(self, by: str) -> None:
        job = self.job
        if job.state.is_final or job.attempt.outcome is not None:
            return
        attempt = job.attempt
        attempt.outcome = AttemptOutcome.PREEMPTED
        attempt.exit_code = EXIT_PREEMPTED
        attempt.preempted_by = by
        attempt.reason = f"Preempted by {by}."
        self.fx.decided = True
        self.event("job.preempted", attempt=attempt.index, by=by, reason=attempt.reason)
        self.stop_attempt("preempted")
        self.maybe_finish_attempt()

    def reconfigured(self, why: str) -> None:
        job = self.job
        if job.state.is_final:
            return
        attempt = job.attempt
        if attempt.outcome is None:
            attempt.outcome = AttemptOutcome.RECONFIGURED
            attempt.exit_code = EXIT_PREEMPTED
            attempt.reason = f"Cluster config changed: {why}."
            self.fx.decided = True
            self.event("job.preempted", attempt=attempt.index, by="cluster-config", reason=attempt.reason)
        self.stop_attempt("reconfigured")
        self.maybe_finish_attempt()

    def node_lost(self, node: str, reason: str | None = None) -> None:
        job = self.job
        lost = sorted((t for t in job.tasks.values() if t.node == node and t.state in ACTIVE_TASK_STATES),
                      key=lambda t: t.key)
        for t in lost:
            if t.state not in ACTIVE_TASK_STATES or job.tasks.get(t.key) is not t:
                continue  # ended by an earlier task of this loop (the attempt was stopped)
            attempt = job.attempt
            if attempt.outcome is None:
                attempt.outcome = AttemptOutcome.NODE_LOST
                attempt.exit_code = EXIT_NODE_LOST
                attempt.reason = reason or f"Node {node} was lost."
            # The run is gone with its node; record it failed so the attempt can end.
            if t.state is TaskState.STARTING:
                self.set_task_state(t, TaskState.RUNNING)
            decided = t.attempt
            self.task_exited(t, EXIT_NODE_LOST, self.now)
            # task_exited may already have ended the attempt and created the retry; only the lost
            # attempt's other tasks are to be stopped, never the new attempt's.
            if job.attempt.index == decided and not job.state.is_final:
                self.stop_attempt("node-lost")
                self.maybe_finish_attempt()

    # ---------------------------------------------------------------- 5. ending an attempt
    def maybe_finish_attempt(self) -> None:
        """Once the decided attempt has no live task: release its cells, end the job or retry it."""
        job = self.job
        attempt = job.attempt
        if attempt.outcome is None or attempt.finished is not None:
            return
        for t in job.tasks.values():
            if not t.state.is_final:
                return
        attempt.finished = self.now
        # Releasing every instance covers this step's releases of single instances of the attempt (and
        # drops the group's reservation): one operation for the shell to apply.
        ops = self.fx.ops
        if ops:
            ops[:] = [op for op in ops
                      if not (isinstance(op, Release) and op.job == job.id and op.attempt == attempt.index)]
        ops.append(Release(job.id, attempt.index, None))
        outcome, code = attempt.outcome, attempt.exit_code
        if outcome is AttemptOutcome.SUCCEEDED:
            return self.complete(JobState.SUCCEEDED, 0)
        if outcome is AttemptOutcome.STOPPED:
            return self.complete(JobState.STOPPED, EXIT_STOPPED)
        decision = decide_retry(
            code if code is not None else 1,
            user_retries=job.retries_user,
            job_retry_count=job.policy.job_retry_count,
            platform_cause=outcome.platform_cause,
        )
        if not decision.retry:
            return self.complete(JobState.FAILED, code)
        if decision.kind == "user":
            job.retries_user += 1
        else:
            job.retries_platform += 1
        job.attempt = AttemptRecord(index=attempt.index + 1, created=self.now)
        self.fx.new_attempt = job.attempt
        job.tasks = _new_tasks(job, self.fx)
        self.set_job_state(JobState.WAITING, retry=True)
        reason = attempt.reason or decision.reason
        job.waiting_reason = f"Retrying ({decision.kind} retry): {reason} {_WAIT_FIRST}"
        self.event("job.retry", attempt=job.attempt.index, kind=decision.kind,
                   reason=f"{reason} {decision.reason}", exitCode=code)
        self.fx.wake = True

    def complete(self, state: JobState, code: int | None) -> None:
        job = self.job
        self.set_job_state(state)
        job.completion_time = self.now
        job.exit_code = code
        job.exit_phrase = classify_exit(code).phrase if code is not None else None
        job.waiting_reason = None  # (the Release of the whole attempt before this dropped any reservation)
        if self.events:
            self.event("job.completed", state=str(state), exitCode=code, attempt=job.attempt.index)


# One handler per input type (a dict, not an isinstance chain: a replay steps 82k jobs several times).
_HANDLERS: dict[type, Callable[[_Step, Any], None]] = {
    RunReported: _Step.run_reported,
    Placed: _Step.placed,
    Waiting: lambda s, i: s.set_waiting_reason(i.reason),
    Preempted: lambda s, i: s.preempted(i.by),
    NodeLost: lambda s, i: s.node_lost(i.node, i.reason),
    StopRequested: lambda s, i: s.stop(),
    Downgraded: lambda s, i: s.event(
        "job.downgraded", by=i.by, reason=f"Downgraded to opportunistic by {i.by} (lazy preemption)."),
    Reconfigured: lambda s, i: s.reconfigured(i.reason),
}
