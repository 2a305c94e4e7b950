"""The scheduling cycle: who of the queue is placed, preempts or waits, one decision at a time.

Kueue's scheduler, over the plane's cache (:class:`apiary.control.cache.PlaneCache`). A cycle
decides on a snapshot of the queue and takes the plane's lock for a slice of it at a time
(:data:`LOCK_SLICE_S`), so submissions and node reports are not blocked behind a long queue. The
snapshot re-reads from the store only the jobs committed since the last one (the whole queue every
:data:`QUEUE_REREAD_S` and whenever memory is in doubt), and takes new jobs as their submission
wrote them (``PlaneCache.submitted``), and a job that waits is not asked again while neither it
nor the scheduler's state changed (the answer would be the same): a long queue on a full cluster
costs each cycle the new jobs only. First wait reasons are committed in batches
(:data:`WAIT_BATCH`). Every decision is committed through a :class:`~apiary.control.work.Work` and
applied to the scheduler only after its commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from apiary.control.cache import PlaneCache
from apiary.errors import UserError
from apiary.lifecycle import JobState, TaskState
from apiary.lifecycle.reducer import Downgraded, Placed, Preempted, Waiting
from apiary.scheduler import Decision
from apiary.store.models import Attempt, Job, Task
from apiary.store.records import write_waits
from apiary.store.unit import UnitOfWork, reading

logger = logging.getLogger(__name__)

#: Most first-cycle wait reasons one scheduling cycle commits in one transaction (lock held
#: meanwhile, so it also bounds how long a submission can wait for the lock behind them).
WAIT_BATCH = 32
#: How long a scheduling cycle holds the plane's lock for one slice of its queue (seconds).
LOCK_SLICE_S = 0.002
#: A scheduling cycle reads the whole queue from the store at least this often (seconds); in
#: between it reads only the jobs committed since its last snapshot (see SchedulingCycle._snapshot).
QUEUE_REREAD_S = 5.0


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


#: What a plain "wait" was decided on: (scheduler state version, attempt, pending instances, reason).
WaitKey = tuple[int, int, tuple[tuple[str, int], ...], str | None]


@dataclass(frozen=True, slots=True)
class Head:
    """One job of a cycle's snapshot: what it still had to place when the snapshot was taken."""

    job_id: str
    attempt: int
    pending: tuple[tuple[str, int], ...]
    reason: str | None


class SchedulingCycle:
    """Runs scheduling cycles over ``cache``; ``check_lost`` marks silent nodes lost, writing due
    heartbeat times first (step 1, called with the lock held). :meth:`cycle` is safe to call from
    any thread; cycles run one at a time."""

    def __init__(self, cache: PlaneCache, check_lost: Callable[[], None]) -> None:
        self.cache = cache
        self._check_lost = check_lost
        self._cycle_lock = threading.Lock()  # one cycle at a time; submissions and reports interleave
        # job -> (version, attempt, pending, reason) of its last plain "wait" (see :meth:`_cycle`).
        self._waits: dict[str, WaitKey] = {}
        # The queue as the last cycle's snapshot read it (job -> its order and head). None: read the
        # whole queue (at start, after a rebuild, every QUEUE_REREAD_S).
        self._queue: dict[str, tuple[tuple[int, float, int], Head]] | None = None
        self._queue_read_at = 0.0
        # The version at which the last cycle left every queued job's answer remembered (else None).
        self._settled: int | None = None

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
                with self.cache.lock:
                    self.cache.cycle_changed = None
        result.duration_ms = (time.perf_counter() - t0) * 1000
        return result

    def _cycle(self, result: CycleResult) -> None:
        with self.cache.lock:
            if self.cache.needs_rebuild:
                self.cache.rebuild()
            # 1. Lost nodes first, so their tasks' cells are not counted as busy below.
            self._check_lost()
            # 2. Heads: a snapshot of every job with instances to place, highest priority first, then
            # FIFO. Jobs committed after it are skipped this cycle (their change woke the next one).
            self.cache.cycle_changed = set()
            version = self.cache.version
            with reading(self.cache.sessions, "scheduling cycle") as s:
                heads, only_changed = self._snapshot(s)
            # A plain "wait" is remembered with the scheduler's state version: schedule() is a
            # deterministic function of that state and the request (apiary.scheduler.hived), so
            # while neither changed the answer is the same and the job is not asked again. When the
            # last cycle left every job of the queue remembered at the version there is now, only the
            # jobs committed since need deciding (only_changed); the others keep their answers.
            waits: dict[str, WaitKey] = self._waits if only_changed else {}
        new_waits: list[tuple[Head, str, int]] = []  # (head, new reason, version it was decided at)
        remaining = iter(heads)
        finished = False
        while not finished:
            # The lock is taken per slice of the queue, neither per head (a remembered wait costs
            # microseconds, the lock's hand-over to a waiting submission far more) nor for the whole
            # queue: submissions and node reports wait at most about LOCK_SLICE_S, plus one admission.
            with self.cache.lock:
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
                    settled = (not only_changed or version == self.cache.version) and all(
                        waits.get(h.job_id, (None,))[0] == self.cache.version or h.job_id in self.cache.queue_dirty
                        for h in heads
                    )
                    self._settled = self.cache.version if settled else None

    def _nominate(self, head: Head, result: CycleResult, waits: dict[str, WaitKey],
                  new_waits: list[tuple[Head, str, int]]) -> None:
        """Steps 3 and 4 of a cycle for one head (lock held)."""
        if head.job_id in (self.cache.cycle_changed or ()):
            return
        key = (self.cache.version, head.attempt, head.pending, head.reason)
        if self._waits.get(head.job_id) == key:
            waits[head.job_id] = key
            result.waiting[head.job_id] = head.reason or ""
            return
        # 3. Nominate: ask the pure scheduler. A job the current config cannot take any more
        # (its VC was removed) waits with the reason; it never stops the cycle for the others.
        policy = self.cache.cached_policy(head.job_id)
        if policy is None:
            with reading(self.cache.sessions, "scheduling cycle") as s:
                job = s.get(Job, head.job_id)
                if job is None:
                    return
                policy = self.cache.policy_of(job)
        try:
            decision = self.cache.scheduler.schedule(replace(policy.request, pending=head.pending))
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
        self.cache.version += 1  # cells reserved, a plan made or victims downgraded
        self._admit(head, decision, result)

    def _snapshot(self, s: Session) -> tuple[list[Head], bool]:
        """Step 2's snapshot, highest priority first, then FIFO (lock held), and whether it holds only
        the jobs committed since the last one (the last cycle settled every other job).

        The store is read for the jobs committed since the last snapshot only; the rest of the
        queue is the last snapshot's, which no commit has touched since. The whole queue is read
        instead at start, after a rebuild or a new config, and every QUEUE_REREAD_S.
        """
        now = time.monotonic()
        dirty = sorted(self.cache.queue_dirty)
        self.cache.queue_dirty = set()
        submitted, self.cache.submitted = self.cache.submitted, {}
        if self._queue is None or self.cache.reread_queue or now - self._queue_read_at >= QUEUE_REREAD_S:
            self.cache.reread_queue = False
            self._queue = self._heads(s)
            self._queue_read_at = now
            self._settled = None
        else:
            for job_id in dirty:
                self._queue.pop(job_id, None)
            # New jobs as their submission wrote them (PlaneCache.submitted); the rest from the store.
            unread: list[str] = []
            for job_id in dirty:
                new = submitted.get(job_id)
                if new is None:
                    unread.append(job_id)
                elif new.pending:
                    self._queue[job_id] = (new.order, Head(job_id, 0, new.pending, new.reason))
            for i in range(0, len(unread), 500):  # well under any database's bound-parameter limit
                self._queue.update(self._heads(s, unread[i:i + 500]))
            for job_id in dirty:
                if job_id not in self._queue:
                    self._waits.pop(job_id, None)  # it left the queue
        settled, self._settled = self._settled == self.cache.version, None  # until this cycle settles all again
        if settled:
            # Every other job is remembered at this version (see _cycle): only these need deciding.
            changed = [self._queue[j] for j in dirty if j in self._queue]
            return [head for _, head in sorted(changed, key=lambda kh: kh[0])], True
        return [head for _, head in sorted(self._queue.values(), key=lambda kh: kh[0])], False

    def _heads(self, s: Session, job_ids: list[str] | None = None) -> dict[str, tuple[tuple[int, float, int], Head]]:
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
        heads: dict[str, tuple[tuple[int, float, int], Head]] = {}
        current: tuple[str, int, str | None, tuple[int, float, int]] | None = None
        pending: list[tuple[str, int]] = []
        for job_id, attempt, reason, priority, submitted, seq, role, index in s.execute(q):
            if current is not None and current[0] != job_id:
                heads[current[0]] = (current[3], Head(current[0], current[1], tuple(pending), current[2]))
                pending = []
            current = (job_id, attempt, reason, (-priority, submitted, seq))
            pending.append((role, index))
        if current is not None:
            heads[current[0]] = (current[3], Head(current[0], current[1], tuple(pending), current[2]))
        return heads

    def _record_waits(self, new_waits: list[tuple[Head, str, int]], result: CycleResult,
                      waits: dict[str, WaitKey]) -> None:
        """Step 4 for plain waits with a new reason: ``new_waits`` (emptied) in one transaction (lock held).

        A job whose snapshot no longer holds (it changed since), or whose decision was made on a
        scheduler state that has changed since, is left out: the next cycle decides it afresh.
        Raises UnavailableError when the store cannot commit (nothing of the batch recorded).
        """
        changed = self.cache.cycle_changed or ()
        batch = [b for b in new_waits if b[2] == self.cache.version and b[0].job_id not in changed]
        new_waits.clear()
        if not batch:
            return
        # A plain UPDATE per job, not a Work that loads each job's record, attempt and tasks to
        # change one column: under the lock, with none of them changed since the snapshot, the
        # snapshot is what the store holds; write_waits still writes only where it is.
        with UnitOfWork(self.cache.sessions, "scheduling cycle") as uow:  # commits at the end of the block
            ids = write_waits(uow.s, [(h.job_id, h.attempt, h.reason, reason) for h, reason, _ in batch],
                              self.cache.clock())
        # After the commit: the snapshot's heads take their new reason here instead of being marked
        # changed for the next snapshot to read again (nothing else in memory holds a job's reason).
        kept = set(ids)
        queue = self._queue if self._queue is not None else {}
        for head, reason, version in batch:
            if head.job_id in kept:
                result.waiting[head.job_id] = reason
                waits[head.job_id] = (version, head.attempt, head.pending, reason)
                entry = queue.get(head.job_id)
                if entry is not None and entry[1] == head:
                    queue[head.job_id] = (entry[0], replace(head, reason=reason))

    def _admit(self, head: Head, decision: Decision, result: CycleResult) -> None:
        job_id = head.job_id
        with self.cache.work("scheduling cycle") as w:
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
            w.commit()
        if decision.kind == "place" and decision.placements:
            result.placed.append(job_id)
            logger.info("placed job=%s attempt=%d tasks=%d", job_id, head.attempt, len(decision.placements))
        for victim in preempted:
            logger.info("preempting job=%s by=%s", victim, job_id)
        result.preempted.extend(preempted)
        if rec.waiting_reason is not None and rec.pending():
            result.waiting[job_id] = rec.waiting_reason
