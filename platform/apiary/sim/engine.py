"""The discrete-event shell behind ``apiary sim``: a simulated clock, an event heap, simulated node
agents, and scheduling passes over the real scheduler. The job lifecycle is not here: every job is a
:class:`~apiary.lifecycle.reducer.JobRecord` driven by :func:`apiary.lifecycle.reducer.step`, the
same core the live control plane runs, and its scheduler operations are applied at once.

Events at one instant apply in this order: task completions, node failures and recoveries,
arrivals. Then scheduling passes run the way :meth:`apiary.control.plane.ControlPlane.cycle` does:
every job with instances to place, highest priority first, then by submission time, then in arrival
order, asks ``scheduler.schedule(GroupRequest)``; the answer goes into the core as :class:`Placed`,
:class:`Waiting` or, for the victims, :class:`Preempted`. After each pass the simulated agents act,
as a node agent does between two cycles: runs placed in the pass start now (and will exit 0 after
the job's duration), runs told to stop exit now (a run never started exits without starting). Passes
repeat until nothing changes. In replay mode (``record=False``) an agent reports a run's start
together with its exit (both edges in one report, as ``STATES.md`` allows): one lifecycle step per run
instead of two, and no scheduling decision depends on when a start is reported.

Skipping, which never changes a decision (it only avoids asking questions whose answer is known),
in replay mode only (``record=False``); with ``record=True`` (scenarios) every waiting job is asked
in every pass after any change, as the live cycle does:

* only queues (VCs) touched since the last pass are visited;
* a job is skipped when an earlier ``wait`` in the same *scope* had a dominated shape (no more
  tasks, no more GPUs per task) at a priority >= its own and nothing was released in that scope
  since (an allocation only shrinks what is free).  Scopes: for ``hived`` a guaranteed job's VC
  (VC safety: its fit depends on its VC's cells only) and ``*`` for opportunistic jobs; for
  ``quota`` the VC (quota counters) and ``*`` (nodes); for ``fifo`` ``*``.
* a cheap counter check (the job's GPUs vs. the GPUs its VC has left, or the cluster for ``fifo``
  and opportunistic jobs) runs before ``schedule()``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from apiary.errors import ApiaryError
from apiary.lifecycle import Desired, JobState, TaskState
from apiary.lifecycle.reducer import (
    Allocate,
    Cancel,
    Downgraded,
    Effects,
    Instance,
    JobPolicy,
    JobRecord,
    NodeLost,
    Placed,
    Preempted,
    Release,
    RunReported,
    TaskRecord,
    Waiting,
    step,
    submit,
)
from apiary.scheduler.types import GroupRequest, SchedulerAlgorithm, TaskPlacement

FINISH, NODE, ARRIVE = 0, 1, 2
ALL = "*"


@dataclass(eq=False)
class SimJob:
    """One job of a replay or scenario: its lifecycle :attr:`record` (None before it arrives) plus
    what the simulator needs around it.  ``shape`` (tasks, GPUs per task) marks a uniform gang job
    whose fit is monotone in the shape (what the skip rule needs); None = never skipped.
    ``duration``: seconds each run takes once started (then it exits 0)."""

    id: str
    vc: str
    priority: int
    gang: bool
    policy: JobPolicy
    duration: float
    submit: float
    user: str = "user"
    name: str = ""
    priority_class: str = ""
    shape: tuple[int, int] | None = None
    gpus: int = 0
    seq: int = 0
    record: JobRecord | None = None
    rejected: str | None = None
    first_start: float | None = None
    finish: float | None = None
    preemptions: int = 0
    reasons: list[str] = field(default_factory=list)
    attempts: list[dict] = field(default_factory=list)
    events: list[tuple[float, str, dict]] = field(default_factory=list)
    reserving: bool = False
    qid: int = -1

    @property
    def request(self) -> GroupRequest:
        return self.policy.request

    @property
    def state(self) -> str:
        """``PENDING`` before arrival, ``REJECTED``, or the record's OpenPAI job state."""
        if self.rejected is not None:
            return "REJECTED"
        return self.record.state.value if self.record is not None else "PENDING"

    @property
    def pending(self) -> list[Instance]:
        return self.record.pending() if self.record is not None else []


class Engine:
    """Replays jobs against one scheduler.  ``mode``: ``hived``, ``quota`` or ``fifo`` (the skip
    scopes, see the module docstring).  ``vc_quota``: GPUs per VC for the counter check.
    ``record``: keep every job's events, per-attempt placements and waiting reasons (scenarios), and
    ask every waiting job in every pass (no skip rules)."""

    def __init__(
        self,
        scheduler: SchedulerAlgorithm,
        mode: str,
        *,
        vc_quota: dict[str, int] | None = None,
        record: bool = False,
    ) -> None:
        self.sched = scheduler
        self.mode = mode
        self.record = record
        self.vc_quota = dict(vc_quota or {})
        self.total_gpus = sum(n.gpus for n in scheduler.nodes().values())
        self.node_gpus = {n: i.gpus for n, i in scheduler.nodes().items()}
        self.healthy_gpus = self.total_gpus
        self.events: list = []
        self._eseq = itertools.count()
        self._qid = itertools.count()
        self.jobs: dict[str, SimJob] = {}
        self.queues: dict[str, dict[tuple | None, list]] = {}
        self.dirty: set[str] = set()
        self.failures: dict[str, list[tuple[int, int, int]]] = {}
        self.used: dict[str, dict[int, int]] = {}  # vc -> priority -> GPUs in use (guaranteed jobs)
        self.oppo_waiting = 0
        self.busy = 0
        self.now = 0.0
        self.busy_gpu_s = 0.0
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self.preemptions = 0
        self.observer: Callable[[str, SimJob | None, list | None], None] | None = None
        # The cluster's side of the placements (the live platform's placement rows): job -> instance ->
        # placement, and node -> (job, instance) running there.
        self.running: dict[str, dict[Instance, TaskPlacement]] = {}
        self.node_tasks: dict[str, set[tuple[str, Instance]]] = {}
        # The simulated agents' pending work: runs to start and runs to kill after the current pass.
        self._to_start: list[tuple[SimJob, str, str]] = []
        self._to_kill: dict[str, tuple[SimJob, str]] = {}
        self._changed = False  # record mode: something changed since the last pass (ask everyone again)

    # ------------------------------------------------------------------ inputs
    def submit(self, job: SimJob, at: float) -> None:
        job.seq = len(self.jobs)
        self.jobs[job.id] = job
        heapq.heappush(self.events, (at, ARRIVE, next(self._eseq), "arrive", job))

    def node_event(self, at: float, node: str, healthy: bool) -> None:
        heapq.heappush(self.events, (at, NODE, next(self._eseq), "node", (node, healthy)))

    # ------------------------------------------------------------------ scopes
    def queue_key(self, job: SimJob) -> str:
        return ALL if self.mode == "fifo" else job.vc

    def scopes(self, job: SimJob) -> tuple[str, str]:
        """(counter-check scope, schedule scope)."""
        if self.mode == "fifo" or job.priority < 0:
            return ALL, ALL
        if self.mode == "quota":
            return job.vc, ALL
        return job.vc, job.vc

    def _reset(self, scope: str) -> None:
        if self.failures.get(scope):
            self.failures[scope] = []
        if scope == ALL:
            if self.mode != "hived" or self.oppo_waiting:
                self.dirty.update(k for k, qs in self.queues.items() if any(qs.values()))
        else:
            self.dirty.add(scope)

    def _reset_all(self) -> None:
        self.failures.clear()
        self.dirty.update(self.queues)

    def _released(self, job: SimJob) -> None:
        if self.record or self.mode == "fifo":
            self._reset_all() if self.record else self._reset(ALL)
        elif job.priority < 0 and self.mode == "hived":
            self._reset_all()
        else:
            self._reset(job.vc)
            self._reset(ALL)

    def _dominated(self, job: SimJob) -> bool:
        if job.shape is None or not job.gang or self.record:
            return False
        k, g = job.shape
        p = job.priority
        for scope in set(self.scopes(job)):
            for fk, fg, fp in self.failures.get(scope, ()):
                if fk <= k and fg <= g and fp >= p:
                    return True
        return False

    def _fail(self, scope: str, job: SimJob) -> None:
        if job.shape is not None and job.gang:
            self.failures.setdefault(scope, []).append((job.shape[0], job.shape[1], job.priority))

    def _precheck(self, job: SimJob) -> bool:
        need = job.gpus if job.gang else 1
        if self.mode == "fifo" or job.priority < 0:
            return need <= self.healthy_gpus - self.busy
        if job.vc not in self.vc_quota:
            return True
        used = self.used.get(job.vc)
        held = sum(n for p, n in used.items() if p >= job.priority) if used else 0
        return need <= self.vc_quota[job.vc] - held

    # ------------------------------------------------------------------ queue
    def _enqueue(self, job: SimJob) -> None:
        job.qid = next(self._qid)
        key = self.queue_key(job)
        shape = job.shape if job.gang else None
        heapq.heappush(self.queues.setdefault(key, {}).setdefault(shape, []),
                       (-job.priority, job.submit, job.seq, job.qid, job))
        if self.record:
            self._reset_all()
        else:
            self.dirty.add(key)
        if job.priority < 0:
            self.oppo_waiting += 1

    def _valid(self, entry: tuple) -> bool:
        job = entry[4]
        return entry[3] == job.qid and job.record is not None and job.record.schedulable()

    def _dequeue(self, job: SimJob) -> None:
        if job.qid < 0:
            return
        job.qid = -1
        if job.priority < 0:
            self.oppo_waiting -= 1

    def waiting_entries(self, key: str) -> dict[tuple | None, list]:
        """The valid queue entries of ``key`` per shape heap (for observers)."""
        return self.queues.get(key, {})

    # ------------------------------------------------------------------ run
    def run(self, until: float | None = None) -> None:
        ev = self.events
        while ev:
            t = ev[0][0]
            if until is not None and t > until:
                break
            self._advance(t)
            while ev and ev[0][0] == t:
                _, _, _, kind, payload = heapq.heappop(ev)
                if kind == "finish":
                    self._on_finish(*payload)
                elif kind == "arrive":
                    self._on_arrive(payload)
                else:
                    self._on_node(*payload)
            self.schedule()
            if self.observer is not None:
                self.observer("step", None, None)

    def _advance(self, t: float) -> None:
        if t > self.now:
            self.busy_gpu_s += self.busy * (t - self.now)
            if self.observer is not None:
                self.observer("advance", None, [t - self.now])
            self.now = t

    def _set_busy(self, delta: int) -> None:
        self.busy += delta
        tl = self.timeline
        if tl[-1][0] == self.now:
            tl[-1] = (self.now, self.busy)
        else:
            tl.append((self.now, self.busy))

    # ------------------------------------------------------------------ the core and its effects
    def _step(self, job: SimJob, inp: Placed | Waiting | Preempted | Downgraded | NodeLost | RunReported) -> Effects:
        assert job.record is not None
        fx = step(job.record, inp, self.now, events=self.record)
        self._effects(job, fx)
        return fx

    def _effects(self, job: SimJob, fx: Effects) -> None:
        """Apply a step's effects to the simulated cluster: scheduler operations at once (there is no
        store to commit first), the agents' work for after the pass, queue and statistics."""
        rec = job.record
        assert rec is not None
        for op in fx.ops:
            if isinstance(op, Allocate):
                self._allocate(job, op)
            elif isinstance(op, Release):
                self._release(job, op)
            elif isinstance(op, Cancel):
                self.sched.cancel(job.id)
                if job.reserving:
                    job.reserving = False
                    self._released(job)
        for t in fx.stopping:  # runs told to stop: their agents kill them after the pass
            if t.run_id:
                self._to_kill.setdefault(t.run_id, (job, t.node or ""))
        for t in fx.new_tasks:  # a run retried in place (taskRetryCount) starts again on its cells
            if t.state is TaskState.STARTING and t.run_id and t.node:
                self._to_start.append((job, t.run_id, t.node))
        if self.record:
            if fx.events:
                self._changed = True
            for type_, data in fx.events:
                job.events.append((self.now, type_, data))
            if rec.waiting_reason and (not job.reasons or job.reasons[-1] != rec.waiting_reason):
                job.reasons.append(rec.waiting_reason)
        if fx.decided:  # a Preempted input decided the attempt (the sim has no reconfiguration)
            job.preemptions += 1
            self.preemptions += 1
        if fx.new_attempt is not None:
            if self.record and job.attempts:
                job.attempts[-1]["finished"] = self.now
            self._new_attempt(job)
        elif rec.state.is_final and job.finish is None:
            job.finish = self.now
            if self.record and job.attempts:
                job.attempts[-1]["finished"] = self.now
        if job.qid >= 0 and not rec.schedulable():
            self._dequeue(job)

    def _new_attempt(self, job: SimJob) -> None:
        if self.record:
            job.attempts.append({"started": None, "finished": None, "placements": []})
        self._enqueue(job)
        if self.observer is not None:
            self.observer("queued", job, None)

    def _allocate(self, job: SimJob, op: Allocate) -> None:
        placements = op.placements
        self.sched.allocate(job.id, op.request, placements)
        mine = self.running.setdefault(job.id, {})
        gpus = 0
        rec = job.record
        assert rec is not None
        runs: list[tuple[str, str]] = []
        for p in placements:
            key = (p.task_role, p.index)
            mine[key] = p
            gpus += len(p.gpus)
            self.node_tasks.setdefault(p.node, set()).add((job.id, key))
            run_id = rec.tasks[key].run_id
            assert run_id is not None
            if self.record:
                self._to_start.append((job, run_id, p.node))
            else:
                runs.append((run_id, p.node))
        if runs:  # replay mode: the runs start now; their agents report start and exit together
            heapq.heappush(self.events, (self.now + job.duration, FINISH, next(self._eseq), "finish",
                                         (job, tuple(runs), self.now)))
        if job.first_start is None:
            job.first_start = self.now
        self._set_busy(gpus)
        if job.priority >= 0:
            u = self.used.setdefault(job.vc, {})
            u[job.priority] = u.get(job.priority, 0) + gpus
        if self.record:
            att = job.attempts[-1]
            if att["started"] is None:
                att["started"] = self.now
            att["placements"].extend(
                {"taskRole": p.task_role, "index": p.index, "node": p.node,
                 "leafCellIndices": list(p.leaf_cell_indices)} for p in placements
            )
        if self.observer is not None:
            self.observer("start", job, list(placements))

    def _release(self, job: SimJob, op: Release) -> None:
        mine = self.running.get(job.id, {})
        keys = list(mine) if op.instances is None else [k for k in op.instances if k in mine]
        self.sched.release(job.id, None if op.instances is None else keys)
        if not keys:
            return
        gpus = 0
        for key in keys:
            p = mine.pop(key)
            gpus += len(p.gpus)
            self.node_tasks[p.node].discard((job.id, key))
        if not mine:
            self.running.pop(job.id, None)
        self._set_busy(-gpus)
        if job.priority >= 0:
            self.used[job.vc][job.priority] -= gpus
        self._released(job)
        if self.observer is not None:
            self.observer("release", job, keys)

    # ------------------------------------------------------------------ events
    def _on_arrive(self, job: SimJob) -> None:
        try:
            self.sched.validate(job.request)
        except ApiaryError as e:
            job.rejected = e.message
            return
        job.record, fx = submit(job.id, job.user, job.policy, self.now, name=job.name,
                                priority_class=job.priority_class, events=self.record)
        if self.record:
            self._changed = True
            for type_, data in fx.events:
                job.events.append((self.now, type_, data))
            job.reasons.append(job.record.waiting_reason or "")
        self._new_attempt(job)

    def _on_finish(self, job: SimJob, run_ids: tuple[tuple[str, str], ...], started: float | None) -> None:
        for run_id, node in run_ids:
            if job.record is None or job.record.state.is_final:
                return
            self._step(job, RunReported(node=node, run_id=run_id, exited=True, exit_code=0, started_at=started,
                                        finished_at=self.now))

    def _on_node(self, node: str, healthy: bool) -> None:
        self.sched.set_node_health(node, healthy)
        self.healthy_gpus += self.node_gpus[node] * (1 if healthy else -1)
        if not healthy:
            victims = sorted({jid for jid, _ in self.node_tasks.get(node, ())},
                             key=lambda j: (self.jobs[j].submit, self.jobs[j].seq))
            for jid in victims:
                self._step(self.jobs[jid], NodeLost(node))
        self._reset_all()

    # ------------------------------------------------------------------ the simulated agents
    def _agents(self) -> bool:
        """What the node agents do between two passes; True if they did anything."""
        if not self._to_start and not self._to_kill:
            return False
        starts, self._to_start = self._to_start, []
        finishes: dict[int, tuple[SimJob, list[tuple[str, str]]]] = {}
        for job, run_id, node in starts:
            t = _run(job, run_id)
            if t is None or t.state is not TaskState.STARTING or t.desired is not Desired.RUN:
                continue  # told to stop before it started: the kill below reports it
            self._step(job, RunReported(node=node, run_id=run_id, started_at=self.now, pid=0))
            finishes.setdefault(id(job), (job, []))[1].append((run_id, node))
        for job, runs in finishes.values():
            heapq.heappush(self.events, (self.now + job.duration, FINISH, next(self._eseq), "finish",
                                         (job, tuple(runs), None)))
        kills, self._to_kill = self._to_kill, {}
        for run_id, (job, node) in kills.items():
            t = _run(job, run_id)
            if t is None or t.state not in (TaskState.STARTING, TaskState.RUNNING):
                continue
            # Replay mode reports a run's start with its end: it started when it was placed.
            started = t.started if self.record else t.placed_at
            self._step(job, RunReported(node=node, run_id=run_id, exited=True, exit_code=None,
                                        started_at=started, finished_at=self.now))
        return True

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> None:
        """Passes, each followed by the agents' work, until nothing more changes. In record mode a
        change anywhere makes the next pass ask every waiting job again (as the live cycle does)."""
        for _ in range(100_000):
            if self.record and self._changed:
                self._changed = False
                self._reset_all()
            if self.dirty:
                self._pass()
            acted = self._agents()
            if not acted and not self.dirty and not (self.record and self._changed):
                return
        raise RuntimeError("scheduling did not settle")  # pragma: no cover

    def _pass(self) -> None:
        keys, self.dirty = self.dirty, set()
        cand: list = []
        for key in keys:
            for shape, h in self.queues.get(key, {}).items():
                while h and not self._valid(h[0]):
                    heapq.heappop(h)
                if h:
                    cand.append((h[0][:4], key, shape))
        heapq.heapify(cand)
        deferred: list = []
        while cand:
            _, key, shape = heapq.heappop(cand)
            h = self.queues[key][shape]
            while h and not self._valid(h[0]):
                heapq.heappop(h)
            if not h:
                continue
            job = h[0][4]
            if self._dominated(job):
                continue
            outcome = self._try(job)
            if outcome == "wait" and job.shape is not None and job.gang:
                continue  # this heap is now dominated for the rest of the pass
            entry = heapq.heappop(h)
            if outcome == "placed-all":
                self._dequeue(job)
            elif self._valid(entry):
                deferred.append((key, shape, entry))
            if h:
                cand_entry = h[0]
                heapq.heappush(cand, (cand_entry[:4], key, shape))
        for key, shape, entry in deferred:
            if self._valid(entry):
                heapq.heappush(self.queues[key][shape], entry)

    def _try(self, job: SimJob) -> str:
        rec = job.record
        assert rec is not None
        pre, fit = self.scopes(job)
        if not self.record and not self._precheck(job):
            self._fail(pre, job)
            return "wait"
        pending = tuple(rec.pending())
        req = job.request if len(pending) == len(rec.tasks) else with_pending(job.request, pending)
        d = self.sched.schedule(req)
        if self.record:
            for victim in d.downgraded:
                self._step(self.jobs[victim], Downgraded(by=job.id))
        if d.kind == "place" and d.placements:
            self._step(job, Placed(d.placements, d.reason))
            if rec.pending():
                return "placed-some"
            job.reserving = False
            return "placed-all"
        if d.kind == "preempt":
            job.reserving = True
            for v in d.victims:
                self._step(self.jobs[v], Preempted(by=job.id))
            if self.record:
                self._step(job, Waiting(d.reason))
            return "preempt"
        if job.reserving:  # a dropped reservation freed cells
            job.reserving = False
            self._released(job)
        self._fail(fit, job)
        if self.record:
            self._step(job, Waiting(d.reason))
        return "wait"


def _run(job: SimJob, run_id: str) -> TaskRecord | None:
    """The task record of run ``run_id`` if it is still the latest run of its instance."""
    assert job.record is not None
    for t in job.record.tasks.values():
        if t.run_id == run_id:
            return t
    return None


def with_pending(request: GroupRequest, pending: tuple[Instance, ...]) -> GroupRequest:
    """``request`` narrowed to the ``pending`` instances (a gang's tasks still to place), other
    fields unchanged."""
    return GroupRequest(
        name=request.name,
        virtual_cluster=request.virtual_cluster,
        priority=request.priority,
        gang=request.gang,
        tasks=request.tasks,
        pending=pending,
    )


__all__ = ["ALL", "Engine", "SimJob", "JobState"]
