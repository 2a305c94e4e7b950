"""What each typed job event becomes in Prefect, recorded in the job's ledger record and a batch.

The :class:`Recorder` applies one :class:`~apiary.tracking.events.JobEvent` to its job's record
(:mod:`apiary.tracking.ledger`) and collects in an :class:`Out` what the batch must write: the
flow run state the job should show now (from :mod:`apiary.tracking.states`, the one table),
task run changes, log rows, output to read, summary artifacts. It does no I/O; the bridge
(:mod:`apiary.tracking.bridge`) writes the batch. One handler per event type, chosen by the
body's class in :data:`_HANDLERS`, never by the event's name.

==================  ===========================================================================
event               Prefect
==================  ===========================================================================
job.submitted       flow run (RUNNING "Submitted", then the state of :mod:`~apiary.tracking.states`)
                    unless the job came with ``flowRunId`` (a flow engine runs that one: the
                    bridge attaches to it and adds the job's tags; it ends it only if the engine
                    did not, see ``settle``); task run ``queue`` (Running, named "Waiting")
job.waiting         flow run Waiting (the reason); ``queue`` for that attempt opened if needed
job.placed          ``queue`` Completed with the placement (taskRole/index -> node, GPUs)
task.started        flow run Running (first time); task run ``run-<taskRole>`` Running
task.exited         instance output shipped as logs (``[train/0] ...``); ``run-<taskRole>`` ends
                    Completed (all exit 0) or Failed once every placed instance of the role exited
job.preempted       open task runs of the attempt Cancelled; flow run AwaitingRetry (the cause)
job.retry           open task runs of older attempts Failed; flow run AwaitingRetry; ``queue@N``
                    opened for the new attempt
job.stop_requested  logged
job.completed       open task runs closed; the flow run Completed / Failed / Cancelled for
                    SUCCEEDED / FAILED / STOPPED (an attached run: marked ``settle``, so the
                    bridge ends it when its engine has not); a markdown summary artifact (key
                    ``job-<user>-<name>``: every instance's node, GPUs, exit code)
==================  ===========================================================================

Every event is also a log line of the run (logger ``apiary.events``). Task runs of attempt
N > 0 carry the suffix ``@N`` (``run-train@1``) and the tag ``attempt:N``.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from apiary.lifecycle.states import JobState
from apiary.tracking import states
from apiary.tracking.events import (
    Completed,
    JobEvent,
    OtherEvent,
    Placed,
    Preempted,
    Retry,
    StopRequested,
    Submitted,
    TaskExited,
    TaskStarted,
    Waiting,
)
from apiary.tracking.ledger import suffix
from apiary.tracking.states import StateSpec

__all__ = ["NAMESPACE", "Out", "Recorder", "spec_dict", "task_run_id"]

NAMESPACE = uuid.UUID("6f1c1f3e-5b7a-4c0e-9a51-0a61a2b1e001")
# One log row is capped so a runaway line cannot exceed the API's request limits.
MAX_LINE_CHARS = 8_000


def task_run_id(job_id: str, seq: int, step: str) -> uuid.UUID:
    """Deterministic task run id for the task run ``step`` created by event ``seq`` of ``job_id``."""
    return uuid.uuid5(NAMESPACE, f"{job_id}#{seq}#{step}")


def spec_dict(spec: StateSpec) -> dict[str, str]:
    """A :class:`~apiary.tracking.states.StateSpec` as the ledger keeps it."""
    return {"type": spec.type, "name": spec.name, "message": spec.message}


def iso(t: float | None) -> str:
    """ISO 8601 UTC of unix seconds ``t`` (now when None)."""
    return datetime.fromtimestamp(t if t is not None else time.time(), UTC).isoformat()


def _artifact_key(job_id: str, prefix: str) -> str:
    # Artifact keys allow only lowercase letters, digits and dashes.
    return f"{prefix}-" + re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-")


@dataclass
class Out:
    """What one batch writes to Prefect, collected while its events are recorded."""

    touched: dict[str, dict] = field(default_factory=dict)  # job id -> record: flow run to create/update
    task_changes: list[tuple[dict, dict, dict]] = field(default_factory=list)  # (job, task run, state change)
    logs: list[tuple[dict, dict]] = field(default_factory=list)  # (job, log row without flow_run_id)
    artifacts: list[tuple[dict, dict]] = field(default_factory=list)  # (job, ArtifactCreate json)
    ships: list[tuple] = field(default_factory=list)  # instance output to read from Apiary


class Recorder:
    """Applies typed events to job records (see the module docstring for what each becomes).

    ``log_interval_s``: how often the output of running instances is shipped
    (:meth:`collect_running_output`); it is always shipped when they exit.
    """

    def __init__(self, log_interval_s: float = 10.0) -> None:
        self.log_interval_s = log_interval_s
        self._log_polled: dict[str, float] = {}

    def apply(self, out: Out, job: dict, ev: JobEvent) -> None:
        """Record ``ev`` in ``job`` (its record) and ``out``."""
        handler = _HANDLERS.get(type(ev.body))
        if handler is None:
            data = ev.body.data if isinstance(ev.body, OtherEvent) else {}
            logging.getLogger(__name__).info("event type not mirrored seq=%s job=%s type=%s", ev.seq, ev.job_id,
                                             ev.type)
            self.log(out, job, ev, f"{ev.type} {dict(data)}")
            return
        handler(self, out, ev.job_id, job, ev)

    # ------------------------------------------------------------------ handlers

    def submitted(self, out: Out, job_id: str, job: dict, ev: JobEvent) -> None:
        b = ev.body
        assert isinstance(b, Submitted)
        user = b.user or job_id.split("~")[0]
        job["user"] = user
        job["tags"] = _tags(b, user)
        job["submitted"] = {"seq": ev.seq, "vc": b.virtual_cluster, "priority": b.priority_class}
        if b.flow_run_id:
            job["given"] = b.flow_run_id  # a flow engine runs it: attach when flushing
        else:
            # "Submitted" until Apiary says more: Waiting comes with job.waiting (a job the
            # scheduler places at once never waits), Running with task.started.
            want(job, states.submitted(user, b.virtual_cluster, b.priority_class))
        self.open(out, job_id, job, ev, "queue:0", "queue", "Waiting", "waiting for placement")
        self.log(out, job, ev,
                 f"job.submitted user={user} virtualCluster={b.virtual_cluster} priorityClass={b.priority_class}")

    def waiting(self, out: Out, job_id: str, job: dict, ev: JobEvent) -> None:
        b = ev.body
        assert isinstance(b, Waiting)
        key = f"queue:{b.attempt}"
        if key not in job["open"]:
            self.open(out, job_id, job, ev, key, f"queue{suffix(b.attempt)}", "Waiting", f"waiting: {b.reason}",
                      b.attempt)
        want(job, states.waiting(b.reason, job.get("retryCause")))
        self.log(out, job, ev, f"job.waiting attempt={b.attempt} reason={b.reason}")

    def placed(self, out: Out, job_id: str, job: dict, ev: JobEvent) -> None:
        b = ev.body
        assert isinstance(b, Placed)
        where = ", ".join(f"{p.task_role}/{p.index}->{p.node}{p.gpus}" for p in b.placements)
        self.close(out, job, ev, f"queue:{b.attempt}", "COMPLETED", f"placed: {where}")
        for p in b.placements:
            inst = job["inst"].setdefault(f"{b.attempt}/{p.task_role}/{p.index}", {})
            inst.update({"node": p.node, "gpus": p.gpus})
        self.log(out, job, ev, f"job.placed attempt={b.attempt} {where}")

    def task_started(self, out: Out, job_id: str, job: dict, ev: JobEvent) -> None:
        b = ev.body
        assert isinstance(b, TaskStarted)
        attempt, role, index = b.attempt, b.task_role, b.index
        if not job["running"]:
            where = f"{role}/{index} started on {b.node}" + (f" (attempt {attempt})" if attempt else "")
            want(job, states.running(where))
        job["running"] = True
        job.pop("retryCause", None)
        inst = job["inst"].setdefault(f"{attempt}/{role}/{index}", {})
        inst.update({"started": True, "node": b.node, "gpus": b.gpus})
        key = f"run:{role}:{attempt}"
        if key not in job["open"] and key not in job.setdefault("closed", []):
            self.open(out, job_id, job, ev, key, f"run-{role}{suffix(attempt)}", "Running", f"{role} running", attempt)
        self.log(out, job, ev, f"task.started attempt={attempt} {role}/{index} node={b.node} gpus={b.gpus}")

    def task_exited(self, out: Out, job_id: str, job: dict, ev: JobEvent) -> None:
        b = ev.body
        assert isinstance(b, TaskExited)
        attempt, role, index = b.attempt, b.task_role, b.index
        inst = job["inst"].setdefault(f"{attempt}/{role}/{index}", {})
        inst.update({"started": True, "exit": b.exit_code})
        self.ship(out, job_id, job, attempt, role, index, ev.time)
        self.log(out, job, ev, f"task.exited attempt={attempt} {role}/{index} exitCode={b.exit_code} phrase={b.phrase}")
        mine = [v for k, v in job["inst"].items() if k.startswith(f"{attempt}/{role}/")]
        if all("exit" in v for v in mine):
            codes = [v["exit"] for v in mine]
            ok = all(c == 0 for c in codes)
            self.close(out, job, ev, f"run:{role}:{attempt}", "COMPLETED" if ok else "FAILED",
                       f"{role}: {len(codes)} instance(s) exited, exit codes {codes}")

    def preempted(self, out: Out, job_id: str, job: dict, ev: JobEvent) -> None:
        b = ev.body
        assert isinstance(b, Preempted)
        msg = f"preempted by {b.by}: {b.reason}"
        self.end_attempts(out, job_id, job, ev, b.attempt + 1, "CANCELLED", msg)
        job["retryCause"] = f"attempt {b.attempt} {msg}"
        job["running"] = False
        want(job, states.awaiting_retry(job["retryCause"]))
        self.log(out, job, ev, f"job.preempted attempt={b.attempt} by={b.by} reason={b.reason}", level=logging.WARNING)

    def retry(self, out: Out, job_id: str, job: dict, ev: JobEvent) -> None:
        b = ev.body
        assert isinstance(b, Retry)
        attempt = b.attempt
        msg = f"attempt {attempt - 1} failed ({b.kind}): {b.reason} exitCode={b.exit_code}"
        self.end_attempts(out, job_id, job, ev, attempt, "FAILED", msg)
        job["retryCause"] = f"{b.kind} retry, attempt {attempt}: {b.reason} (exit code {b.exit_code})"
        job["running"] = False
        want(job, states.awaiting_retry(job["retryCause"]))
        key = f"queue:{attempt}"
        if key not in job["open"]:
            self.open(out, job_id, job, ev, key, f"queue{suffix(attempt)}", "Waiting",
                      f"waiting for placement after {b.kind} retry: {b.reason}", attempt)
        self.log(out, job, ev, f"job.retry attempt={attempt} kind={b.kind} reason={b.reason} exitCode={b.exit_code}",
                 level=logging.WARNING)

    def stop_requested(self, out: Out, job_id: str, job: dict, ev: JobEvent) -> None:
        b = ev.body
        assert isinstance(b, StopRequested)
        job.setdefault("stoppedBy", b.by or "a stop request")
        self.log(out, job, ev, "job.stop_requested", level=logging.WARNING)

    def completed(self, out: Out, job_id: str, job: dict, ev: JobEvent) -> None:
        b = ev.body
        assert isinstance(b, Completed)
        end = states.final(b.state, b.exit_code, b.attempt, job.get("stoppedBy"))
        self.end_attempts(out, job_id, job, ev, 10**9, end.type, end.message)
        retries = [k for k in job["inst"] if not k.startswith("0/")]
        table = "\n".join(
            f"| {k.split('/')[0]} | {k.split('/')[1]} | {k.split('/')[2]} | {v.get('node')} | {v.get('gpus')} "
            f"| {v.get('exit')} |"
            for k, v in sorted(job["inst"].items())
        )
        # One artifact per job, at its end: where every instance of every attempt ran and how it
        # exited (an artifact costs a request per job; the placement is in the logs meanwhile).
        # The JSON of Prefect's ArtifactCreate with the fields set.
        out.artifacts.append((job, {
            "key": _artifact_key(job_id, "job"),
            "type": "markdown",
            "description": f"Summary of {job_id}",
            "data": (f"# {job_id}: {b.state.value}\n\nexit code `{b.exit_code}`, attempt {b.attempt}, "
                     f"{len({k.split('/')[0] for k in retries})} retried attempt(s)\n\n"
                     "| attempt | taskRole | index | node | gpus | exitCode |\n|---|---|---|---|---|---|\n" + table),
        }))
        self.log(out, job, ev, f"job.completed {end.message}",
                 level=logging.INFO if b.state is JobState.SUCCEEDED else logging.ERROR)
        job["final"] = spec_dict(end)
        # A run the bridge made ends here. An attached run (the job came with one; the run may not
        # be attached yet when the whole job is in one batch) is left to its flow, which returns
        # the same state (flows/job.py): the final state is dropped for it when flushed. If its
        # engine is gone (a restart of the platform ended the process that ran it), the bridge's
        # settle pass ends it (FlowRunWriter.settle).
        want(job, end)
        if job.get("given") or not job["owned"]:
            job["settle"] = {"endedAt": ev.time if ev.time is not None else time.time()}
        job["done"] = True

    # ------------------------------------------------------------------ building blocks

    def open(self, out: Out, job_id: str, job: dict, ev: JobEvent, key: str, name: str, state_name: str,
             message: str, attempt: int = 0) -> None:
        """A task run that starts now (Running, named ``state_name``); :meth:`close` ends it."""
        tr = {
            "id": str(task_run_id(job_id, ev.seq, key)),
            "name": name,
            "dynamicKey": f"{ev.seq}:{key}",
            "attempt": attempt,
            "start": ev.time,
        }
        job["open"][key] = tr
        out.task_changes.append((job, tr, {"type": "RUNNING", "name": state_name, "message": message,
                                           "time": ev.time}))

    def close(self, out: Out, job: dict, ev: JobEvent, key: str, ptype: str, message: str) -> None:
        """End the open task run ``key`` in Prefect state type ``ptype`` (nothing if not open)."""
        tr = job["open"].pop(key, None)
        if tr is None:
            return
        out.task_changes.append((job, tr, {"type": ptype, "name": states.FINAL_NAMES[ptype], "message": message,
                                           "time": ev.time}))
        if key.startswith("run:"):
            job.setdefault("closed", []).append(key)

    def end_attempts(self, out: Out, job_id: str, job: dict, ev: JobEvent, before: int, ptype: str,
                     message: str) -> None:
        """Ship output and close every open task run of attempts ``< before``.

        A role run whose instances all exited 0 still ends Completed.
        """
        for key, inst in list(job["inst"].items()):
            attempt, role, index = key.split("/")
            if int(attempt) < before and inst.get("started") and not inst.get("shipped"):
                self.ship(out, job_id, job, int(attempt), role, int(index), ev.time)
        for key in list(job["open"]):
            attempt = int(key.rsplit(":", 1)[1])
            if attempt >= before:
                continue
            if key.startswith("run:") and ptype != "COMPLETED":
                role = key.split(":")[1]
                mine = [v for k, v in job["inst"].items() if k.startswith(f"{attempt}/{role}/")]
                if mine and all(v.get("exit") == 0 for v in mine):
                    self.close(out, job, ev, key, "COMPLETED", f"{role}: all instances exited 0")
                    continue
            self.close(out, job, ev, key, ptype, message)

    @staticmethod
    def log(out: Out, job: dict, ev: JobEvent, message: str, level: int = logging.INFO) -> None:
        """One event line for the flow run's logs (sent with the batch)."""
        out.logs.append((job, {"name": "apiary.events", "level": level, "message": message,
                               "timestamp": iso(ev.time), "task_run_id": None}))

    @staticmethod
    def ship(out: Out, job_id: str, job: dict, attempt: int, role: str, index: int, t: float | None) -> None:
        """Ship the rest of one exited instance's output with this batch."""
        tr = job["open"].get(f"run:{role}:{attempt}") or {}
        out.ships.append((job_id, job, attempt, role, index, True, t, tr.get("id")))
        job["inst"].setdefault(f"{attempt}/{role}/{index}", {})["shipped"] = True

    @staticmethod
    def take_output(out: Out, job_id: str, job: dict, attempt: int, role: str, index: int, final: bool,
                    t: float | None, task_run: str | None, *, stream: str, off: int, text: str) -> None:
        """An instance stream's new text (read from byte ``off``) as log rows, prefixed
        ``[role/index]`` (stderr lines come from logger ``apiary.job.stderr``). While running only
        complete lines are taken (the offset stops at the last newline); ``final`` takes the rest
        too. Offsets advance in the job's record, which the batch restores if its writes fail."""
        if not final:
            cut = text.rfind("\n")
            text = text[: cut + 1] if cut >= 0 else ""
        if not text:
            return
        job["logOff"][f"{attempt}/{role}/{index}/{stream}"] = off + len(text.encode())
        prefix = f"[{role}/{index}]" + (f"@{attempt}" if attempt else "")
        stamp = iso(t)
        for line in text.splitlines():
            out.logs.append((job, {"name": f"apiary.job.{stream}", "level": logging.INFO,
                                   "message": f"{prefix} {line[:MAX_LINE_CHARS]}", "timestamp": stamp,
                                   "task_run_id": task_run}))

    def collect_running_output(self, out: Out, jobs: Mapping[str, dict]) -> None:
        """Name in ``out.ships`` the running instances whose complete output lines are due (at most
        every ``log_interval_s`` per job)."""
        now = time.monotonic()
        for job_id, job in jobs.items():
            if job.get("done") or not job.get("running") or not job.get("flowRunId"):
                continue
            if now - self._log_polled.get(job_id, 0.0) < self.log_interval_s:
                continue
            self._log_polled[job_id] = now
            for key, inst in job["inst"].items():
                if inst.get("started") and "exit" not in inst:
                    attempt, role, index = key.split("/")
                    tr = job["open"].get(f"run:{role}:{attempt}") or {}
                    out.ships.append((job_id, job, int(attempt), role, int(index), False, None, tr.get("id")))


def want(job: dict, spec: StateSpec) -> None:
    """The flow run state a job should show now (:mod:`apiary.tracking.states`). Set once per job
    per batch when flushed: one request however many events the batch held."""
    job["want"] = spec_dict(spec)


def _tags(b: Submitted, user: str) -> list[str]:
    tags = ["apiary", f"user:{user}"]
    if b.virtual_cluster:
        tags.append(f"vc:{b.virtual_cluster}")
    if b.priority_class:
        tags.append(f"priority:{b.priority_class}")
    return tags


_Handler = Callable[[Recorder, Out, str, dict, JobEvent], None]
#: The event body's class -> what it does to the job's record (see the module docstring).
_HANDLERS: Mapping[type, _Handler] = {
    Submitted: Recorder.submitted,
    Waiting: Recorder.waiting,
    Placed: Recorder.placed,
    TaskStarted: Recorder.task_started,
    TaskExited: Recorder.task_exited,
    Preempted: Recorder.preempted,
    Retry: Recorder.retry,
    StopRequested: Recorder.stop_requested,
    Completed: Recorder.completed,
}
