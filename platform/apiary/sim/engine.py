"""The discrete-event core behind ``apiary sim``: simulated clock and nodes, the real scheduler.

One code path for every policy: the engine holds the jobs and an event heap (task completions, node
failures and recoveries, arrivals, in that order at equal times) and, after the events of one
instant, runs scheduling passes the way :meth:`apiary.control.plane.ControlPlane.cycle` does: every
job with instances to place, highest priority first, then by submission time, asks
``scheduler.schedule(GroupRequest)`` and commits ``place`` with ``allocate``; ``preempt`` stops the
victims (their attempt ends at once as PREEMPTED, cells released, platform retry from scratch); the
next pass places the preemptor.  Passes repeat while something was released.

Skipping, which never changes a decision (it only avoids asking questions whose answer is known):

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
from apiary.lifecycle import EXIT_NODE_LOST, EXIT_PREEMPTED, RoleCompletion, RoleOutcome, decide_retry
from apiary.lifecycle import evaluate_completion as _evaluate
from apiary.scheduler.types import GroupRequest, SchedulerAlgorithm, TaskPlacement

FINISH, NODE, ARRIVE = 0, 1, 2
ALL = "*"
Instance = tuple[str, int]


@dataclass(eq=False)
class SimJob:
    """One job of a replay or scenario.  ``shape`` (tasks, GPUs per task) marks a uniform gang job
    whose fit is monotone in the shape (what the skip rule needs); None = never skipped."""

    id: str
    vc: str
    priority: int
    gang: bool
    request: GroupRequest
    duration: float
    submit: float
    shape: tuple[int, int] | None = None
    roles: dict[str, RoleCompletion] | None = None
    job_retry_count: int = 0
    gpus: int = 0
    seq: int = 0
    state: str = "PENDING"
    attempt: int = 0
    pending: list[Instance] = field(default_factory=list)
    running: dict[Instance, TaskPlacement] = field(default_factory=dict)
    succeeded: set[Instance] = field(default_factory=set)
    first_start: float | None = None
    finish: float | None = None
    retries_user: int = 0
    retries_platform: int = 0
    preemptions: int = 0
    reasons: list[str] = field(default_factory=list)
    attempts: list[dict] = field(default_factory=list)
    reject_reason: str | None = None
    reserving: bool = False
    qid: int = -1

    def all_instances(self) -> list[Instance]:
        return [(t.task_role, i) for t in self.request.tasks for i in range(t.instances)]


class Engine:
    """Replays jobs against one scheduler.  ``mode``: ``hived``, ``quota`` or ``fifo`` (the skip
    scopes, see the module docstring).  ``vc_quota``: GPUs per VC for the counter check.
    ``record``: keep per-attempt placements and waiting reasons (scenarios); it also turns the skip
    rules off, so every waiting job gets the scheduler's own waiting reason."""

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
        self.observer: Callable[[str, SimJob, list[TaskPlacement] | list[Instance] | None], None] | None = None
        self.node_tasks: dict[str, set[tuple[str, Instance]]] = {}

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
        if self.mode == "fifo":
            self._reset(ALL)
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
        self.dirty.add(key)
        if job.priority < 0:
            self.oppo_waiting += 1

    def _valid(self, entry) -> bool:
        job = entry[4]
        return entry[3] == job.qid and job.state in ("WAITING", "RUNNING") and bool(job.pending)

    def _dequeue(self, job: SimJob) -> None:
        job.qid = -1
        if job.priority < 0:
            self.oppo_waiting -= 1

    def waiting_entries(self, key: str):
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
                self.observer("step", None, None)  # type: ignore[arg-type]

    def _advance(self, t: float) -> None:
        if t > self.now:
            self.busy_gpu_s += self.busy * (t - self.now)
            if self.observer is not None:
                self.observer("advance", None, [t - self.now])  # type: ignore[arg-type]
            self.now = t

    def _set_busy(self, delta: int) -> None:
        self.busy += delta
        tl = self.timeline
        if tl[-1][0] == self.now:
            tl[-1] = (self.now, self.busy)
        else:
            tl.append((self.now, self.busy))

    # ------------------------------------------------------------------ events
    def _on_arrive(self, job: SimJob) -> None:
        try:
            self.sched.validate(job.request)
        except ApiaryError as e:
            job.state = "REJECTED"
            job.reject_reason = e.message if hasattr(e, "message") else str(e)
            return
        job.state = "WAITING"
        self._new_attempt(job)

    def _new_attempt(self, job: SimJob) -> None:
        job.pending = job.all_instances()
        job.running = {}
        job.succeeded = set()
        if self.record:
            job.attempts.append({"started": None, "finished": None, "placements": []})
        self._enqueue(job)
        if self.observer is not None:
            self.observer("queued", job, None)

    def _on_finish(self, job: SimJob, attempt: int, instances: tuple[Instance, ...]) -> None:
        if job.attempt != attempt or job.state not in ("RUNNING", "WAITING"):
            return
        done = [i for i in instances if i in job.running]
        if not done:
            return
        self._release(job, done)
        job.succeeded.update(done)
        verdict = self._completion(job)
        if verdict == "SUCCEEDED":
            self._end_attempt(job)
            job.state = "SUCCEEDED"
            job.finish = self.now
        elif verdict == "FAILED":  # not reachable with exit 0 tasks; kept for completeness
            self._end_attempt(job)
            self._retry(job, 1, platform=False)

    def _completion(self, job: SimJob) -> str | None:
        if job.roles is None:
            return "SUCCEEDED" if not job.pending and not job.running else None
        outcomes = {}
        for role in job.roles:
            n = sum(1 for r, _ in job.succeeded if r == role)
            outcomes[role] = RoleOutcome(succeeded=n, failed=0, finished=n)
        return _evaluate(job.roles, outcomes)

    def _on_node(self, node: str, healthy: bool) -> None:
        self.sched.set_node_health(node, healthy)
        self.healthy_gpus += self.node_gpus[node] * (1 if healthy else -1)
        if not healthy:
            victims = sorted({jid for jid, _ in self.node_tasks.get(node, ())}, key=lambda j: self.jobs[j].seq)
            for jid in victims:
                job = self.jobs[jid]
                reason = f"Node {node} was lost."
                if self.record:
                    job.reasons.append(f"Retrying (platform retry): {reason}")
                self._end_attempt(job)
                self._retry(job, EXIT_NODE_LOST, platform=True)
        self._reset_all()

    # ------------------------------------------------------------------ state changes
    def _start(self, job: SimJob, placements: tuple[TaskPlacement, ...]) -> None:
        self.sched.allocate(job.id, job.request, placements)
        keys = []
        gpus = 0
        for p in placements:
            key = (p.task_role, p.index)
            job.running[key] = p
            keys.append(key)
            gpus += len(p.gpus)
            self.node_tasks.setdefault(p.node, set()).add((job.id, key))
        placed = set(keys)
        job.pending = [i for i in job.pending if i not in placed]
        if job.first_start is None:
            job.first_start = self.now
        job.state = "RUNNING"
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
        heapq.heappush(self.events, (self.now + job.duration, FINISH, next(self._eseq), "finish",
                                     (job, job.attempt, tuple(keys))))
        if self.observer is not None:
            self.observer("start", job, list(placements))

    def _release(self, job: SimJob, instances: list[Instance] | None) -> None:
        keys = list(job.running) if instances is None else instances
        if not keys:
            if instances is None:
                self.sched.release(job.id)
            return
        gpus = 0
        for key in keys:
            p = job.running.pop(key)
            gpus += len(p.gpus)
            self.node_tasks[p.node].discard((job.id, key))
        self.sched.release(job.id, None if instances is None else keys)
        self._set_busy(-gpus)
        if job.priority >= 0:
            self.used[job.vc][job.priority] -= gpus
        self._released(job)
        if self.observer is not None:
            self.observer("release", job, keys)

    def _end_attempt(self, job: SimJob) -> None:
        """Stop every task of the current attempt (release its cells) and drop it from the queue."""
        self._release(job, None)
        self.sched.cancel(job.id)
        if job.reserving:
            job.reserving = False
            self._released(job)
        if job.qid >= 0:
            self._dequeue(job)
        job.pending = []
        if self.record and job.attempts:
            job.attempts[-1]["finished"] = self.now
        if self.observer is not None:
            self.observer("dequeued", job, None)

    def _retry(self, job: SimJob, code: int, *, platform: bool) -> None:
        d = decide_retry(code, user_retries=job.retries_user, job_retry_count=job.job_retry_count,
                         platform_cause=platform)
        if not d.retry:
            job.state = "FAILED"
            job.finish = self.now
            return
        if d.kind == "user":
            job.retries_user += 1
        else:
            job.retries_platform += 1
        job.attempt += 1
        job.state = "WAITING"
        self._new_attempt(job)

    def preempt(self, victim_id: str, by: str) -> bool:
        job = self.jobs.get(victim_id)
        if job is None or job.state not in ("RUNNING", "WAITING") or not job.running:
            return False
        job.preemptions += 1
        self.preemptions += 1
        if self.record:
            job.reasons.append(f"Retrying (platform retry): Preempted by {by}.")
        self._end_attempt(job)
        self._retry(job, EXIT_PREEMPTED, platform=True)
        return True

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> None:
        """Passes until nothing more changes (see the module docstring)."""
        for _ in range(10_000):
            if not self.dirty:
                return
            self._pass()
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
        pre, fit = self.scopes(job)
        if not self.record and not self._precheck(job):
            self._fail(pre, job)
            if self.record:
                self._reason(job, "Waiting for resources: not enough free GPUs in "
                             + ("the cluster." if pre == ALL else f"VC {job.vc}."))
            return "wait"
        pending = tuple(job.pending)
        req = job.request if len(pending) == len(job.all_instances()) else _with_pending(job.request, pending)
        d = self.sched.schedule(req)
        if d.kind == "place" and d.placements:
            self._start(job, d.placements)
            if job.pending:
                if self.record and d.reason:
                    self._reason(job, d.reason)
                return "placed-some"
            job.reserving = False
            return "placed-all"
        if d.kind == "preempt":
            job.reserving = True
            if self.record:
                self._reason(job, d.reason)
            for v in d.victims:
                self.preempt(v, by=job.id)
            return "preempt"
        if job.reserving:  # a dropped reservation freed cells
            job.reserving = False
            self._released(job)
        self._fail(fit, job)
        if self.record:
            self._reason(job, d.reason)
        return "wait"

    def _reason(self, job: SimJob, reason: str) -> None:
        if reason and (not job.reasons or job.reasons[-1] != reason):
            job.reasons.append(reason)


def _with_pending(request: GroupRequest, pending: tuple[Instance, ...]) -> GroupRequest:
    return GroupRequest(
        name=request.name,
        virtual_cluster=request.virtual_cluster,
        priority=request.priority,
        gang=request.gang,
        tasks=request.tasks,
        pending=pending,
    )
