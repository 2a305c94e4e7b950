"""The Prefect side of the bridge: flow runs created, attached, moved and ended; task run events.

:class:`FlowRunWriter` owns the bridge's one
:class:`~prefect.client.orchestration.PrefectClient` and writes what a batch recorded
(:mod:`apiary.tracking.recorder`) for one job at a time:

* :meth:`FlowRunWriter.flush_run`: create the job's flow run (idempotency key
  ``apiary:<job id>:<submitted seq>``), attach to the run it came with, or set the state the job
  should show (the states of :mod:`apiary.tracking.states`);
* :meth:`FlowRunWriter.settle`: end an attached run whose job ended when the flow engine that
  ran it did not (it died with a restart of the platform), in the job's final state;
* :meth:`FlowRunWriter.watch_cancels`: the UI's Cancel stops the job;
* :func:`task_event`: the ``prefect.task-run.*`` event of one task run state change.

Errors: transient ones (:func:`apiary.tracking.transient.is_transient`) propagate, so the
bridge redoes the batch; a 4xx from Prefect is logged and the state dropped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from apiary.tracking import states
from apiary.tracking.ledger import Ledger
from apiary.tracking.recorder import NAMESPACE, spec_dict
from apiary.tracking.source import JobEventSource
from apiary.tracking.states import StateSpec
from apiary.tracking.transient import is_transient

logger = logging.getLogger(__name__)

__all__ = [
    "EVENT_TASK_RUN_EXCLUDE",
    "FLOW_NAME",
    "JOB_DEPLOYMENT",
    "FlowRunWriter",
    "busy_retry",
    "task_event",
    "to_state",
]

FLOW_NAME = "apiary-job"
#: The deployment every bridge-made flow run belongs to: a run with a deployment gets the UI's
#: Cancel and Retry buttons, and ``flows/serve.py`` serves it (Retry re-runs the job as a clone).
JOB_DEPLOYMENT = "job"
_BUSY_STATUS = {429, 503}
_BUSY_DELAYS_S = (0.1, 0.2, 0.4, 0.8)


async def busy_retry(call: Callable[[], Awaitable[Any]]) -> Any:
    """``await call()``, retried in place while the server answers "busy" (429, 503).

    A SQLite-backed Prefect server answers 503 when its database is locked (seen even with one
    writer, next to the server's own services). The client's own retry sleeps 2**n s, so this
    retries after 0.1-0.8 s instead; every write of the bridge is safe to repeat.
    """
    for delay in _BUSY_DELAYS_S:
        try:
            return await call()
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code not in _BUSY_STATUS:
                raise
            logger.debug("server busy; retrying delay_s=%s", delay)
        await asyncio.sleep(delay)
    return await call()


def to_state(spec: StateSpec) -> Any:
    """The Prefect state object of a :class:`~apiary.tracking.states.StateSpec`."""
    from prefect.states import State, StateType

    return State(type=StateType(spec.type), name=spec.name, message=spec.message)


class FlowRunWriter:
    """Writes flow runs for the jobs of ``ledger`` through ``client`` (a PrefectClient).

    ``settle_after_s``: how long after its job ended an attached run may stay unfinished before
    the bridge ends it (the engine that follows the job polls it every second and ends the run
    itself when it is alive). ``links`` collects the flow run ids created since it was last
    emptied (job id -> run id), for Apiary.
    """

    def __init__(self, client: Any, ledger: Ledger, source: JobEventSource, *, settle_after_s: float = 30.0) -> None:
        self.client = client
        self.ledger = ledger
        self.source = source
        self.settle_after_s = settle_after_s
        self.links: dict[str, str] = {}
        self._flow_id: uuid.UUID | None = None
        self._deployment_id: uuid.UUID | None = None

    async def flow(self) -> uuid.UUID:
        """Id of flow ``apiary-job`` (created if missing)."""
        if self._flow_id is None:
            self._flow_id = await self.client.create_flow_from_name(FLOW_NAME)
        return self._flow_id

    async def job_deployment(self) -> uuid.UUID:
        """Id of deployment ``apiary-job/job``; registered here when ``flows/serve.py`` has not yet
        (serve's own registration later updates the same deployment: Prefect upserts by name)."""
        from prefect.exceptions import ObjectNotFound

        if self._deployment_id is None:
            try:
                dep = await self.client.read_deployment_by_name(f"{FLOW_NAME}/{JOB_DEPLOYMENT}")
                self._deployment_id = dep.id
            except ObjectNotFound:
                self._deployment_id = await self.client.create_deployment(
                    flow_id=await self.flow(),
                    name=JOB_DEPLOYMENT,
                    tags=["apiary"],
                    description="Apiary jobs submitted by the CLI or REST API (runs are made by Apiary's "
                    "bridge). Retry on a finished run re-runs its job as a new job.",
                )
        return self._deployment_id

    # ------------------------------------------------------------------ one job's flow run

    async def flush_run(self, job_id: str, job: dict) -> None:
        """Create the job's flow run, attach to the one it came with, or set its wanted state.

        A new run is created with the idempotency key ``apiary:<job id>:<submitted seq>`` in the
        job's first state (RUNNING "Submitted", see :mod:`apiary.tracking.states`), and moved to
        the wanted state in a second request when that differs. A bridge-made run is set with
        ``force`` (Prefect's rules refuse e.g. Running -> Pending, which a preemption is). A run
        a flow engine owns (started from the UI) gets only non-final states, and none once it is
        final or cancelling: the engine ends it (or :meth:`settle`). A 4xx answer is logged and
        the state dropped.
        """
        from prefect.exceptions import ObjectNotFound

        try:
            if not job.get("flowRunId"):
                await self._attach_or_create(job_id, job)
            wanted, fid = job.get("want"), job.get("flowRunId")
            if not wanted or not fid:
                return
            spec = StateSpec(**wanted)
            if not job.get("owned", True):
                try:
                    run = await self.client.read_flow_run(uuid.UUID(fid))
                except ObjectNotFound:
                    run = None
                if spec.final or run is None or run.state is None or run.state.is_final() or run.state.is_cancelling():
                    job.pop("want", None)
                    return
            if wanted != job.get("shown"):
                await self.client.set_flow_run_state(uuid.UUID(fid), to_state(spec), force=True)
                job["shown"] = wanted
            job.pop("want", None)
        except Exception as exc:
            if is_transient(exc):
                raise
            logger.error("flow run state dropped job=%s want=%s error=%r", job_id, job.get("want"), exc)
            job.pop("want", None)

    async def _attach_or_create(self, job_id: str, job: dict) -> None:
        from prefect.client.schemas.actions import FlowRunCreate
        from prefect.exceptions import ObjectNotFound
        from prefect.states import to_state_create

        tags, given = job.get("tags") or ["apiary"], job.get("given")
        if given:
            try:
                run = await self.client.read_flow_run(uuid.UUID(given))
                # A run started from the UI has the deployment's tags only: add user:, vc:, priority:.
                if not set(tags) <= set(run.tags or []):
                    await self.client.update_flow_run(run.id, tags=sorted(set(run.tags or []) | set(tags)))
                job["flowRunId"], job["owned"] = given, False
                return
            except (ObjectNotFound, ValueError):
                logger.warning("job=%s names flow run id=%s that Prefect lacks; creating one", job_id, given)
        sub = job.get("submitted") or {}
        first = states.submitted(job.get("user"), sub.get("vc"), sub.get("priority"))
        wanted = job.get("want")
        if wanted and wanted["type"] != "PENDING":
            # Already running or over when first seen (a short job, or a bridge catching up):
            # created in that state, one request. Only a waiting job needs "Submitted" first,
            # so that its run has started and is never shown "late" (apiary.tracking.states).
            first = StateSpec(**wanted)
        create = FlowRunCreate(
            flow_id=await self.flow(),
            deployment_id=await self.job_deployment(),
            name=job_id,
            parameters={"job_id": job_id},
            tags=tags,
            labels={"apiary.job": job_id, "apiary.user": job.get("user") or job_id.split("~")[0]},
            state=to_state_create(to_state(first)),
            idempotency_key=f"apiary:{job_id}:{sub.get('seq', 0)}",
        )
        # create_flow_run() takes no idempotency key; this is the same POST with one.
        resp = await self.client.request("POST", "/flow_runs/", json=create.model_dump(mode="json", exclude_unset=True))
        fid = str(resp.json()["id"])
        self.links[job_id] = fid  # told to Apiary for the whole batch at once
        job["flowRunId"], job["owned"], job["shown"] = fid, True, spec_dict(first)

    # ------------------------------------------------------------------ attached runs left behind

    async def settle(self, now: float | None = None) -> None:
        """End the attached runs that their flow engine left unfinished.

        A run started from the Prefect form is run by a flow engine in ``prefect-serve``, which
        follows its job and ends the run with the job's state. A restart of the platform ends that
        process, and nothing else would end the run: it stayed Running for good. So a job that
        ended ``settle_after_s`` ago (unix seconds, the event's time) whose attached run is not
        final yet gets its final state from the bridge (the job's, from the state table; forced,
        so a Cancelling run becomes Cancelled). A run that is final already is left as it is.
        """
        from prefect.exceptions import ObjectNotFound

        now = time.time() if now is None else now
        for job_id, job in list(self.ledger.jobs.items()):
            pending = job.get("settle")
            if not pending or now - float(pending.get("endedAt") or 0) < self.settle_after_s:
                continue
            fid, final = job.get("flowRunId"), job.get("final")
            if not fid or not final or job.get("owned", True):  # a run the bridge made ended with its job
                job.pop("settle", None)
                continue
            try:
                run = await self.client.read_flow_run(uuid.UUID(fid))
                if run.state is None or not run.state.is_final():
                    logger.info("flow run %s of job=%s left %s by its engine: ending it %s", fid, job_id,
                                run.state.name if run.state else None, final["name"])
                    end = to_state(StateSpec(**final))
                    await busy_retry(functools.partial(self.client.set_flow_run_state, uuid.UUID(fid), end, force=True))
            except ObjectNotFound:
                logger.warning("flow run %s of job=%s is gone from Prefect", fid, job_id)
            except Exception as exc:
                if is_transient(exc):
                    raise
                logger.error("flow run %s of job=%s not ended error=%r", fid, job_id, exc)
            job.pop("settle", None)

    # ------------------------------------------------------------------ Cancel in the UI

    async def watch_cancels(self, since: datetime) -> None:
        """Cancel in the UI stops the job.

        Reads the runs of flow ``apiary-job`` that are Cancelling, or that became Cancelled after
        ``since`` (a flow engine's runner cancels its own runs), and asks Apiary to stop each
        unfinished job attached to them; the job's end (STOPPED) then makes the run Cancelled.
        A Cancelling run whose job had already ended gets the job's final state back.
        """
        from prefect.client.schemas.filters import (
            FlowFilter,
            FlowFilterName,
            FlowRunFilter,
            FlowRunFilterEndTime,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType

        flows = FlowFilter(name=FlowFilterName(any_=[FLOW_NAME]))
        cancelling = await self.client.read_flow_runs(
            flow_filter=flows,
            limit=200,
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLING]))
            ),
        )
        cancelled = await self.client.read_flow_runs(
            flow_filter=flows,
            limit=200,
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLED])),
                end_time=FlowRunFilterEndTime(after_=since - timedelta(seconds=30)),
            ),
        )
        if not cancelling and not cancelled:
            return
        by_run = self.ledger.by_flow_run()
        for run in [*cancelling, *cancelled]:
            jobs = by_run.get(str(run.id), [])
            live = [(j, job) for j, job in jobs if not job.get("done")]
            for job_id, job in live:
                if not job.get("stopAsked"):
                    logger.info("flow run %s cancelled in Prefect: stopping job=%s", run.id, job_id)
                    await self.source.stop(job_id)
                    job["stopAsked"] = True
                    job["stoppedBy"] = "Cancel in the Prefect UI"
            if not live and jobs and run.state is not None and run.state.is_cancelling():
                job_id, job = jobs[-1]
                if job.get("owned", True) and job.get("final"):
                    await self.client.set_flow_run_state(run.id, to_state(StateSpec(**job["final"])), force=True)


def task_event(job: dict, tr: dict, change: dict) -> dict:
    """The ``prefect.task-run.<State>`` event of one task run state change, as Prefect's task
    engine emits it (``prefect.orchestration: client``; the server's task run recorder turns it
    into the task run and its state). The event id is the state id, derived from the task run and
    the change, so a repeated batch records nothing twice."""
    from prefect.client.schemas.objects import State, StateType, TaskRun

    tid = uuid.UUID(tr["id"])
    at = datetime.fromtimestamp(change["time"] if change.get("time") is not None else time.time(), UTC)
    start = datetime.fromtimestamp(tr["start"], UTC) if tr.get("start") is not None else at
    final = change["type"] != "RUNNING"
    state = State(type=StateType(change["type"]), name=change["name"], message=change["message"], timestamp=at)
    tags = [*job.get("tags", ["apiary"]), f"attempt:{tr['attempt']}"]
    run = TaskRun(
        id=tid,
        name=tr["name"],
        flow_run_id=uuid.UUID(job["flowRunId"]),
        task_key=f"apiary.{tr['name'].split('@')[0]}",
        dynamic_key=tr["dynamicKey"],
        tags=tags,
        state=state,
        start_time=start,
        end_time=at if final else None,
        total_run_time=(at - start) if final else timedelta(0),
        run_count=1,
    )
    return {
        "id": str(uuid.uuid5(NAMESPACE, f"{tid}#{change['type']}#{change['name']}")),
        "occurred": at.isoformat(),
        "event": f"prefect.task-run.{change['name']}",
        "resource": {
            "prefect.resource.id": f"prefect.task-run.{tid}",
            "prefect.resource.name": tr["name"],
            "prefect.state-message": change["message"],
            "prefect.state-name": change["name"],
            "prefect.state-timestamp": at.isoformat(),
            "prefect.state-type": change["type"],
            "prefect.orchestration": "client",
        },
        "related": [
            {"prefect.resource.id": f"prefect.flow-run.{job['flowRunId']}", "prefect.resource.role": "flow-run"}
        ]
        + [{"prefect.resource.id": f"prefect.tag.{t}", "prefect.resource.role": "tag"} for t in sorted(tags)],
        "payload": {
            "intended": {"from": None, "to": change["type"]},
            "initial_state": None,
            "validated_state": {
                "type": change["type"],
                "name": change["name"],
                "message": change["message"],
                "state_details": {},
                "data": None,
            },
            "task_run": run.model_dump(mode="json", exclude_none=True, exclude=EVENT_TASK_RUN_EXCLUDE),
        },
    }


#: TaskRun fields the task run recorder fills itself (the exclusions of Prefect's own task engine).
EVENT_TASK_RUN_EXCLUDE = {
    "id",
    "created",
    "updated",
    "flow_run_id",
    "state_id",
    "state_type",
    "state_name",
    "state",
    "estimated_start_time_delta",
    "estimated_run_time",
}
