"""Mirror Apiary jobs into Prefect: one flow run per job, task runs per lifecycle step.

Apiary accepts, schedules and runs jobs itself; Prefect is kept off the launch path (a flow
engine per job costs ~1 s and ~1 MB each and a SQLite-backed server answered 503 at 50
concurrent flow runs). The :class:`PrefectBridge` reads Apiary's event log through a
:class:`~apiary.tracking.source.JobEventSource` and writes what happened to the Prefect API with
ONE :class:`~prefect.client.orchestration.PrefectClient`, in one process, with bounded
concurrency. When the Prefect server is down it keeps its cursor and catches up later.

What a job becomes (flow ``apiary-job``, flow run named after the job id ``user~name``):

==================  ===========================================================================
event               Prefect
==================  ===========================================================================
job.submitted       flow run (Pending) unless the job came with ``flowRunId`` (a flow engine runs
                    that one: the bridge attaches to it and never sets its state); task runs
                    ``submit`` (Completed) and ``queue`` (Running, named "Waiting")
job.waiting         ``queue`` for that attempt opened if needed; reason logged
job.placed          ``queue`` Completed; task run ``placement`` (Completed) and a table artifact
                    (key ``placement-<user>-<name>``: attempt, taskRole, index, node, gpus)
task.started        flow run Running (first time); task run ``run-<taskRole>`` Running
task.exited         instance output shipped as logs (``[train/0] ...``); ``run-<taskRole>`` ends
                    Completed (all exit 0) or Failed once every placed instance of the role exited
job.preempted       open runs of the attempt Cancelled (message: by, reason)
job.retry           open runs of older attempts Failed; task run ``retry@N`` (Completed, message
                    kind/reason/exitCode); ``queue@N`` opened for the new attempt
job.stop_requested  logged
job.completed       open runs closed; task run ``complete`` and the flow run (if the bridge owns
                    it) Completed / Failed / Cancelled for SUCCEEDED / FAILED / STOPPED; a
                    markdown summary artifact
==================  ===========================================================================

Task runs of attempt N > 0 carry the suffix ``@N`` (``run-train@1``) and the tag ``attempt:N``.

Idempotence: ``state_path`` (JSON, replaced atomically) holds the cursor (every event with
``seq <= cursor`` is done), per job the last seq done, its flow run id, open task run ids and
log offsets. Task run ids are ``uuid5(job id, seq, step)``; flow runs are created with the
idempotency key ``apiary:<job id>:<submitted seq>`` (the API does not take a flow run id), so a
restarted bridge, or one that replays events after a crash, neither duplicates nor loses
runs. Logs are at-least-once: output shipped just before a crash may be shipped again.

Cost, measured here (SQLite Prefect server, 2 CPUs): ~10-16 ms per request at p50, ~25
requests for a plain job; 0.19-0.3 s per job of 5 events, 0.5-0.7 s per job of 16 events
with a retry. The server stalls ~2.3 s now and then on its SQLite lock and answers 503;
concurrency above 2 does not help on SQLite (it does on PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from apiary.errors import ApiaryError, NotFoundError, PlatformError
from apiary.tracking import states
from apiary.tracking.source import JobEventSource
from apiary.tracking.states import StateSpec

logger = logging.getLogger(__name__)

__all__ = ["FLOW_NAME", "JOB_DEPLOYMENT", "PrefectBridge", "run_bridge", "task_run_id"]

FLOW_NAME = "apiary-job"
#: The deployment every bridge-made flow run belongs to: a run with a deployment gets the UI's
#: Cancel and Retry buttons, and ``flows/serve.py`` serves it (Retry re-runs the job as a clone).
JOB_DEPLOYMENT = "job"
STATE_VERSION = 1
_NAMESPACE = uuid.UUID("6f1c1f3e-5b7a-4c0e-9a51-0a61a2b1e001")
# One log row is capped so a runaway line cannot exceed the API's request limits.
_MAX_LINE_CHARS = 8_000
_MAX_BATCH_LINES = 500
_MAX_BATCH_BYTES = 1_000_000
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_BUSY_STATUS = {429, 503}


def task_run_id(job_id: str, seq: int, step: str) -> uuid.UUID:
    """Deterministic task run id for the task run ``step`` created by event ``seq`` of ``job_id``."""
    return uuid.uuid5(_NAMESPACE, f"{job_id}#{seq}#{step}")


@dataclass
class _TaskShape:
    """The attributes ``PrefectClient.create_task_run`` reads from a ``prefect.Task``.

    The bridge has no Python function to wrap, so it passes this instead of a Task.
    """

    task_key: str
    tags: list[str] = field(default_factory=list)
    version: str | None = None
    retries: int = 0
    retry_delay_seconds: int = 0
    retry_jitter_factor: float | None = None


class _Transient(Exception):
    """Prefect or Apiary is unreachable or overloaded; retry the event later."""


def _is_transient(exc: BaseException) -> bool:
    # PlatformError: Apiary answered 5xx (UnavailableError: 503 or unreachable); try again later.
    if isinstance(exc, _Transient | PlatformError | httpx.TransportError | OSError | asyncio.TimeoutError):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code in _TRANSIENT_STATUS
    return False


def _iso(t: float | None) -> str:
    return datetime.fromtimestamp(t if t is not None else time.time(), UTC).isoformat()


def _artifact_key(job_id: str, prefix: str) -> str:
    # Artifact keys allow only lowercase letters, digits and dashes.
    return f"{prefix}-" + re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-")


def _suffix(attempt: int) -> str:
    return f"@{attempt}" if attempt else ""


class PrefectBridge:
    """Replays Apiary job events into the Prefect API at ``prefect_api_url`` (``http://h:p/api``).

    ``source`` is the Apiary side (:class:`~apiary.tracking.source.JobEventSource`);
    ``state_path`` the JSON file that makes the bridge restartable. ``concurrency`` bounds how
    many jobs are written at once (one HTTP connection each). ``log_interval_s`` is how often
    the output of running instances is shipped (it is always shipped when they exit).
    ``client_retries`` is ``PREFECT_CLIENT_MAX_RETRIES`` for the bridge's requests: the
    client's own back-off is 2**n s, so it is kept low and the bridge backs off itself.

    Never raises for an unreachable Prefect or Apiary: :meth:`sync_once` stops, keeps the
    cursor and returns; a malformed event or a 4xx from Prefect is logged and skipped.
    """

    def __init__(
        self,
        source: JobEventSource,
        prefect_api_url: str,
        state_path: Path,
        *,
        concurrency: int = 2,
        batch_size: int = 500,
        log_interval_s: float = 10.0,
        client_retries: int = 0,
    ) -> None:
        self.source = source
        self._settings_active = False
        self.prefect_api_url = prefect_api_url.rstrip("/")
        self.state_path = Path(state_path)
        self.concurrency = concurrency
        self.batch_size = batch_size
        self.log_interval_s = log_interval_s
        self.client_retries = client_retries
        self.state: dict[str, Any] = self._load()
        self._client: Any = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._flow_id: uuid.UUID | None = None
        self._down_since: float | None = None
        self._log_polled: dict[str, float] = {}
        self._pending_logs: dict[str, list[dict]] = {}
        self._deployment_id: uuid.UUID | None = None
        self._cancel_checked = 0.0  # monotonic time of the last look for Cancel clicks
        self._cancel_after: datetime | None = None  # Cancelled runs that ended after this were seen
        self.cancel_poll_s = 1.0

    # ------------------------------------------------------------------ state file

    @property
    def cursor(self) -> int:
        """Seq of the last event done; every event with a smaller or equal seq is mirrored."""
        return int(self.state["cursor"])

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return {"version": STATE_VERSION, "cursor": 0, "jobs": {}}
        if data.get("version") != STATE_VERSION:
            raise ApiaryError(f"bridge state {self.state_path} has version={data.get('version')}")
        return data

    def _save(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".bridge-", dir=self.state_path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.state, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.state_path)  # atomic: readers see the old or the new file
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # ------------------------------------------------------------------ Prefect client

    async def _prefect(self) -> Any:
        from prefect.client.orchestration import PrefectClient

        loop = asyncio.get_running_loop()
        if self._client is not None and self._client_loop is not loop:
            self._client = None  # bound to a loop that is gone (asyncio.run per call)
        if self._client is None:
            client = PrefectClient(api=self.prefect_api_url)
            await client.__aenter__()
            self._client, self._client_loop, self._flow_id, self._deployment_id = client, loop, None, None
        return self._client

    async def aclose(self) -> None:
        """Close the Prefect client (the bridge may be used again afterwards)."""
        client, self._client = self._client, None
        if client is not None and self._client_loop is asyncio.get_running_loop():
            with contextlib.suppress(Exception):
                await client.__aexit__(None, None, None)

    async def _flow(self, client: Any) -> uuid.UUID:
        if self._flow_id is None:
            self._flow_id = await client.create_flow_from_name(FLOW_NAME)
        return self._flow_id

    async def _job_deployment(self, client: Any) -> uuid.UUID:
        """Id of deployment ``apiary-job/job``; registered here when ``flows/serve.py`` has not yet
        (serve's own registration later updates the same deployment: Prefect upserts by name)."""
        from prefect.exceptions import ObjectNotFound

        if self._deployment_id is None:
            try:
                dep = await client.read_deployment_by_name(f"{FLOW_NAME}/{JOB_DEPLOYMENT}")
                self._deployment_id = dep.id
            except ObjectNotFound:
                self._deployment_id = await client.create_deployment(
                    flow_id=await self._flow(client), name=JOB_DEPLOYMENT, tags=["apiary"],
                    description="Apiary jobs submitted by the CLI or REST API (runs are made by Apiary's "
                                "bridge). Retry on a finished run re-runs its job as a new job.",
                )
        return self._deployment_id

    # ------------------------------------------------------------------ main loop

    async def sync_once(self) -> int:
        """Mirror every pending event; return how many were processed (done or skipped).

        Stops early, without raising, when Prefect or Apiary is unreachable; the cursor then
        stays at the last event done and the next call resumes from there.
        """
        done = 0
        # run_forever enters these settings once: rebuilding them on every poll was 84% of the
        # bridge's CPU (py-spy, bench concurrent run).
        with self._settings() if not self._settings_active else contextlib.nullcontext():
            try:
                client = await self._prefect()
                while True:
                    events = await self.source.events(self.cursor, limit=self.batch_size)
                    if not events:
                        break
                    n, complete = await self._process_batch(client, events)
                    done += n
                    self._save()
                    if not complete:
                        raise _Transient("batch stopped at a transient error")
                for job in list(self.state["jobs"].values()):
                    if job.get("want"):
                        await self._flush_state(client, job)
                for flow_run_id in list(self._pending_logs):
                    await self._flush_logs(client, flow_run_id)
                await self._watch_cancels(client)
                await self._poll_running_logs(client)
                self._prune()
                self._save()
                self._mark_up()
            except Exception as exc:
                if not _is_transient(exc):
                    raise
                self._mark_down(exc)
        return done

    async def run_forever(self, poll_s: float = 0.5, max_backoff_s: float = 5.0) -> None:
        """Call :meth:`sync_once` every ``poll_s`` seconds until cancelled.

        Backs off (doubling, capped at ``max_backoff_s``) while Prefect or Apiary is down and
        logs unexpected errors instead of raising them.
        """
        delay = poll_s
        try:
            with self._settings():
                self._settings_active = True
                while True:
                    try:
                        await self.sync_once()
                    except asyncio.CancelledError:
                        raise
                    except Exception:
                        logger.exception("bridge sync failed; retrying delay_s=%.1f", delay)
                        self._down_since = self._down_since or time.time()
                    delay = poll_s if self._down_since is None else min(max(delay * 2, poll_s), max_backoff_s)
                    await asyncio.sleep(delay)
        finally:
            self._settings_active = False
            await self.aclose()

    def _settings(self):
        """Prefect settings for this bridge's client: its own retry count (the client's built-in
        retry sleeps 2^n s; the bridge retries transient errors itself with short delays)."""
        from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

        return temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: self.client_retries})

    def _mark_down(self, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.time()
            logger.warning("prefect or apiary unreachable; backing off cursor=%s error=%r", self.cursor, exc)
        else:
            logger.debug("still unreachable cursor=%s error=%r", self.cursor, exc)

    def _mark_up(self) -> None:
        if self._down_since is not None:
            logger.info("reachable again after down_s=%.1f cursor=%s", time.time() - self._down_since, self.cursor)
            self._down_since = None

    async def _process_batch(self, client: Any, events: list[dict]) -> tuple[int, bool]:
        """Process one batch, jobs in parallel, each job's events in order.

        Returns (events processed, whether all were); advances the cursor to just before the
        first event that failed transiently.
        """
        by_job: dict[str, list[dict]] = {}
        for ev in events:
            by_job.setdefault(ev["jobId"], []).append(ev)
        sem = asyncio.Semaphore(self.concurrency)
        failed: list[int] = []
        counts: list[int] = []

        async def run_job(job_events: list[dict]) -> None:
            async with sem:
                n = 0
                for ev in job_events:
                    try:
                        if not await self._apply_retrying(client, ev):
                            continue  # already mirrored (replay after a partial batch)
                    except Exception as exc:
                        if _is_transient(exc):
                            failed.append(ev["seq"])
                            logger.debug("event deferred seq=%s job=%s error=%r", ev["seq"], ev["jobId"], exc)
                            break
                        logger.error(
                            "event skipped seq=%s job=%s type=%s error=%r", ev["seq"], ev["jobId"], ev["type"], exc
                        )
                        self._job(ev["jobId"])["lastSeq"] = ev["seq"]
                    n += 1
                counts.append(n)
                job = self.state["jobs"].get(job_events[0]["jobId"], {})
                try:
                    if job.get("want"):
                        await self._flush_state(client, job)
                    await self._flush_logs(client, job.get("flowRunId"))
                except Exception:  # transient only; the events are done, the state and lines stay queued
                    failed.append(job_events[-1]["seq"] + 1)

        await asyncio.gather(*(run_job(evs) for evs in by_job.values()))
        self.state["cursor"] = (min(failed) - 1) if failed else events[-1]["seq"]
        return sum(counts), not failed

    async def _apply_retrying(self, client: Any, ev: dict) -> bool:
        """:meth:`_apply`, retried in place while the server answers "busy".

        A SQLite-backed Prefect server answers 503 when its database is locked (seen here
        even with one writer, next to the server's own services). The client's own retry
        sleeps 2**n s, so the bridge retries after 0.1-0.8 s instead; handlers are safe to
        replay (deterministic ids, offsets and open/closed marks updated after success).
        """
        for delay in self._BUSY_DELAYS_S:
            try:
                return await self._apply(client, ev)
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code not in _BUSY_STATUS:
                    raise
                logger.debug("server busy; retrying seq=%s delay_s=%s", ev["seq"], delay)
            await asyncio.sleep(delay)
        return await self._apply(client, ev)

    _BUSY_DELAYS_S = (0.1, 0.2, 0.4, 0.8)

    # ------------------------------------------------------------------ per-job state

    def _job(self, job_id: str) -> dict[str, Any]:
        return self.state["jobs"].setdefault(
            job_id,
            {"flowRunId": None, "owned": True, "lastSeq": 0, "done": False, "running": False,
             "open": {}, "inst": {}, "logOff": {}, "user": None},
        )

    def _prune(self) -> None:
        """Finished jobs whose events are all behind the cursor shrink to a tombstone."""
        for job_id, job in self.state["jobs"].items():
            if job.get("done") and job["lastSeq"] <= self.cursor and "inst" in job:
                self.state["jobs"][job_id] = {"flowRunId": job["flowRunId"], "lastSeq": job["lastSeq"], "done": True,
                                              "owned": job.get("owned", True), "final": job.get("final"),
                                              **({"want": job["want"]} if job.get("want") else {})}

    # ------------------------------------------------------------------ event handlers

    async def _apply(self, client: Any, ev: dict) -> bool:
        """Mirror one event; False if it was already mirrored (replayed)."""
        job_id, seq, kind = ev["jobId"], int(ev["seq"]), ev["type"]
        job = self._job(job_id)
        if seq <= job["lastSeq"]:
            return False  # replayed after a crash or a partial batch: already mirrored
        if job.get("done"):
            job["lastSeq"] = seq
            return True
        if kind != "job.submitted" and not job["flowRunId"]:
            await self._bootstrap(client, job_id, job, ev)
        handler = getattr(self, "_on_" + kind.replace(".", "_"), None)
        if handler is None:
            logger.info("event type not mirrored seq=%s job=%s type=%s", seq, job_id, kind)
            await self._log(client, job, ev, f"{kind} {ev.get('data') or {}}")
        else:
            await handler(client, job_id, job, ev, ev.get("data") or {})
        job["lastSeq"] = seq
        return True

    async def _bootstrap(self, client: Any, job_id: str, job: dict, ev: dict) -> None:
        """The bridge missed ``job.submitted`` (its state was lost): rebuild it from the job."""
        try:
            info = await self.source.job(job_id)
        except NotFoundError:
            info = {"user": job_id.split("~")[0], "name": job_id.split("~")[-1]}
        data = {k: info.get(k) for k in ("user", "name", "virtualCluster", "priorityClass", "flowRunId")}
        await self._on_job_submitted(client, job_id, job, {**ev, "seq": 0, "type": "job.submitted"}, data)

    async def _on_job_submitted(self, client: Any, job_id: str, job: dict, ev: dict, d: dict) -> None:
        from prefect.client.schemas.actions import FlowRunCreate
        from prefect.exceptions import ObjectNotFound
        from prefect.states import to_state_create

        seq, t = ev["seq"], ev.get("time")
        user = d.get("user") or job_id.split("~")[0]
        job["user"] = user
        tags = self._tags(d, user)
        given = d.get("flowRunId")
        if given:
            try:
                run = await client.read_flow_run(uuid.UUID(str(given)))
                job["flowRunId"], job["owned"] = str(given), False
                # A run started from the UI has the deployment's tags only: add user:, vc:, priority:.
                if not set(tags) <= set(run.tags or []):
                    await client.update_flow_run(run.id, tags=sorted(set(run.tags or []) | set(tags)))
            except (ObjectNotFound, ValueError):
                logger.warning("job=%s names flow run id=%s that Prefect lacks; creating one", job_id, given)
        if not job["flowRunId"]:
            first = states.submitted(user, d.get("virtualCluster"), d.get("priorityClass"))
            create = FlowRunCreate(
                flow_id=await self._flow(client),
                deployment_id=await self._job_deployment(client),
                name=job_id,
                parameters={"job_id": job_id},
                tags=tags,
                labels={"apiary.job": job_id, "apiary.user": user},
                state=to_state_create(_state(first)),
                idempotency_key=f"apiary:{job_id}:{seq}",
            )
            # create_flow_run() takes no idempotency key; this is the same POST with one.
            resp = await client.request(
                "POST", "/flow_runs/", json=create.model_dump(mode="json", exclude_unset=True)
            )
            job["flowRunId"], job["owned"] = str(resp.json()["id"]), True
            await self.source.set_flow_run(job_id, job["flowRunId"])
        job.setdefault("tags", tags)
        self._want(job, states.waiting("waiting for placement"))
        await self._task(client, job_id, job, ev, "submit", "submit", "COMPLETED",
                         f"submitted at {_iso(t)} user={user} priorityClass={d.get('priorityClass')}")
        await self._open(client, job_id, job, ev, "queue:0", "queue", "Waiting", "waiting for placement")
        await self._log(client, job, ev, f"job.submitted user={user} virtualCluster={d.get('virtualCluster')} "
                                         f"priorityClass={d.get('priorityClass')} flowRunId={job['flowRunId']}")

    async def _on_job_waiting(self, client: Any, job_id: str, job: dict, ev: dict, d: dict) -> None:
        attempt = int(d.get("attempt", 0))
        key = f"queue:{attempt}"
        if key not in job["open"]:
            await self._open(client, job_id, job, ev, key, f"queue{_suffix(attempt)}", "Waiting",
                             f"waiting: {d.get('reason')}", attempt)
        self._want(job, states.waiting(d.get("reason"), job.get("retryCause")))
        await self._log(client, job, ev, f"job.waiting attempt={attempt} reason={d.get('reason')}")

    async def _on_job_placed(self, client: Any, job_id: str, job: dict, ev: dict, d: dict) -> None:
        from prefect.client.schemas.actions import ArtifactCreate

        attempt = int(d.get("attempt", 0))
        placements = list(d.get("placements") or [])
        where = ", ".join(f"{p['taskRole']}/{p['index']}->{p['node']}{p.get('gpus')}" for p in placements)
        await self._close(client, job, f"queue:{attempt}", "COMPLETED", f"placed: {where}")
        for p in placements:
            inst = job["inst"].setdefault(f"{attempt}/{p['taskRole']}/{p['index']}", {})
            inst.update({"node": p.get("node"), "gpus": p.get("gpus")})
        step = f"placement{_suffix(attempt)}"
        tr = await self._task(client, job_id, job, ev, step, step, "COMPLETED", f"attempt {attempt}: {where}", attempt)
        rows = [
            {"attempt": attempt, "taskRole": p["taskRole"], "index": p["index"], "node": p.get("node"),
             "gpus": ",".join(str(g) for g in p.get("gpus") or [])}
            for p in placements
        ]
        await self._artifact(client, ArtifactCreate(
            key=_artifact_key(job_id, "placement"), type="table", data=rows,
            description=f"Placement of {job_id}, attempt {attempt}",
            flow_run_id=uuid.UUID(job["flowRunId"]), task_run_id=tr,
        ))
        await self._log(client, job, ev, f"job.placed attempt={attempt} {where}")

    async def _on_task_started(self, client: Any, job_id: str, job: dict, ev: dict, d: dict) -> None:
        attempt, role, index = int(d.get("attempt", 0)), d["taskRole"], int(d["index"])
        if not job["running"]:
            where = f"{role}/{index} started on {d.get('node')}" + (f" (attempt {attempt})" if attempt else "")
            self._want(job, states.running(where))
        job["running"] = True
        job.pop("retryCause", None)
        inst = job["inst"].setdefault(f"{attempt}/{role}/{index}", {})
        inst.update({"started": True, "node": d.get("node"), "gpus": d.get("gpus")})
        key = f"run:{role}:{attempt}"
        if key not in job["open"] and key not in job.setdefault("closed", []):
            await self._open(client, job_id, job, ev, key, f"run-{role}{_suffix(attempt)}", "Running",
                             f"{role} running", attempt)
        await self._log(client, job, ev, f"task.started attempt={attempt} {role}/{index} "
                                         f"node={d.get('node')} gpus={d.get('gpus')}")

    async def _on_task_exited(self, client: Any, job_id: str, job: dict, ev: dict, d: dict) -> None:
        attempt, role, index = int(d.get("attempt", 0)), d["taskRole"], int(d["index"])
        code = d.get("exitCode")
        inst = job["inst"].setdefault(f"{attempt}/{role}/{index}", {})
        inst.update({"started": True, "exit": code})
        await self._ship_instance(client, job_id, job, attempt, role, index, final=True, t=ev.get("time"))
        await self._log(client, job, ev, f"task.exited attempt={attempt} {role}/{index} exitCode={code} "
                                         f"phrase={d.get('phrase')}")
        mine = [v for k, v in job["inst"].items() if k.startswith(f"{attempt}/{role}/")]
        if all("exit" in v for v in mine):
            codes = [v["exit"] for v in mine]
            ok = all(c == 0 for c in codes)
            await self._close(client, job, f"run:{role}:{attempt}", "COMPLETED" if ok else "FAILED",
                              f"{role}: {len(codes)} instance(s) exited, exit codes {codes}")

    async def _on_job_preempted(self, client: Any, job_id: str, job: dict, ev: dict, d: dict) -> None:
        attempt = int(d.get("attempt", 0))
        msg = f"preempted by {d.get('by')}: {d.get('reason')}"
        await self._end_attempts(client, job_id, job, attempt + 1, "CANCELLED", msg, ev.get("time"))
        job["retryCause"] = f"attempt {attempt} {msg}"
        job["running"] = False
        self._want(job, states.awaiting_retry(job["retryCause"]))
        await self._log(client, job, ev, f"job.preempted attempt={attempt} by={d.get('by')} reason={d.get('reason')}",
                        level=logging.WARNING)

    async def _on_job_retry(self, client: Any, job_id: str, job: dict, ev: dict, d: dict) -> None:
        attempt = int(d.get("attempt", 0))
        msg = f"attempt {attempt - 1} failed ({d.get('kind')}): {d.get('reason')} exitCode={d.get('exitCode')}"
        await self._end_attempts(client, job_id, job, attempt, "FAILED", msg, ev.get("time"))
        job["retryCause"] = (f"{d.get('kind')} retry, attempt {attempt}: {d.get('reason')} "
                             f"(exit code {d.get('exitCode')})")
        job["running"] = False
        self._want(job, states.awaiting_retry(job["retryCause"]))
        await self._task(client, job_id, job, ev, f"retry@{attempt}", f"retry@{attempt}", "COMPLETED",
                         f"retry kind={d.get('kind')} reason={d.get('reason')} exitCode={d.get('exitCode')}", attempt)
        key = f"queue:{attempt}"
        if key not in job["open"]:
            await self._open(client, job_id, job, ev, key, f"queue{_suffix(attempt)}", "Waiting",
                             "waiting for placement after retry", attempt)
        await self._log(client, job, ev, f"job.retry attempt={attempt} kind={d.get('kind')} "
                                         f"reason={d.get('reason')} exitCode={d.get('exitCode')}",
                        level=logging.WARNING)

    async def _on_job_stop_requested(self, client: Any, job_id: str, job: dict, ev: dict, d: dict) -> None:
        job.setdefault("stoppedBy", (ev.get("data") or {}).get("by") or "a stop request")
        await self._log(client, job, ev, "job.stop_requested", level=logging.WARNING)

    async def _on_job_completed(self, client: Any, job_id: str, job: dict, ev: dict, d: dict) -> None:
        from prefect.client.schemas.actions import ArtifactCreate

        apiary_state = str(d.get("state", "FAILED")).upper()
        end = states.final(apiary_state, d.get("exitCode"), d.get("attempt"), job.get("stoppedBy"))
        ptype, msg = end.type, end.message
        await self._end_attempts(client, job_id, job, 10**9, ptype, msg, ev.get("time"))
        tr = await self._task(client, job_id, job, ev, "complete", "complete", ptype, msg)
        retries = [k for k in job["inst"] if not k.startswith("0/")]
        table = "\n".join(
            f"| {k.split('/')[0]} | {k.split('/')[1]} | {k.split('/')[2]} | {v.get('node')} | {v.get('gpus')} "
            f"| {v.get('exit')} |"
            for k, v in sorted(job["inst"].items())
        )
        await self._artifact(client, ArtifactCreate(
            key=_artifact_key(job_id, "job"), type="markdown",
            description=f"Summary of {job_id}",
            data=(f"# {job_id}: {apiary_state}\n\nexit code `{d.get('exitCode')}`, attempt {d.get('attempt')}, "
                  f"{len({k.split('/')[0] for k in retries})} retried attempt(s)\n\n"
                  "| attempt | taskRole | index | node | gpus | exitCode |\n|---|---|---|---|---|---|\n" + table),
            flow_run_id=uuid.UUID(job["flowRunId"]), task_run_id=tr,
        ))
        await self._log(client, job, ev, f"job.completed {msg}",
                        level=logging.INFO if apiary_state == "SUCCEEDED" else logging.ERROR)
        job["final"] = _spec_dict(end)
        if job["owned"]:  # an attached run ends when its flow returns the same state (flows/job.py)
            self._want(job, end)
        job["done"] = True

    # ------------------------------------------------------------------ flow run state

    @staticmethod
    def _want(job: dict, spec: StateSpec) -> None:
        """The flow run state a job should show now (:mod:`apiary.tracking.states`). Set once per
        job per batch (:meth:`_flush_state`): one request however many events the batch held."""
        job["want"] = _spec_dict(spec)

    async def _flush_state(self, client: Any, job: dict) -> None:
        """Set the job's wanted flow run state.

        A bridge-made run is set with ``force`` (Prefect's rules refuse e.g. Running -> Pending,
        which a preemption is). A run a flow engine owns (started from the UI) gets only
        non-final states, and none once it is final or cancelling: the engine ends it.
        """
        from prefect.exceptions import ObjectNotFound

        want, fid = job.get("want"), job.get("flowRunId")
        if not want or not fid:
            return
        spec = StateSpec(**want)
        if not job.get("owned", True):
            try:
                run = await client.read_flow_run(uuid.UUID(fid))
            except ObjectNotFound:
                run = None
            if spec.final or run is None or run.state is None or run.state.is_final() or run.state.is_cancelling():
                job.pop("want", None)
                return
        await client.set_flow_run_state(uuid.UUID(fid), _state(spec), force=True)
        job.pop("want", None)

    async def _watch_cancels(self, client: Any) -> None:
        """Cancel in the UI stops the job (at most every ``cancel_poll_s``).

        Reads the runs of flow ``apiary-job`` that are Cancelling, or that became Cancelled since
        the last look (a flow engine's runner cancels its own runs), and asks Apiary to stop each
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

        now = time.monotonic()
        if now - self._cancel_checked < self.cancel_poll_s:
            return
        self._cancel_checked = now
        since = self._cancel_after or datetime.now(UTC)
        self._cancel_after = datetime.now(UTC)
        flows = FlowFilter(name=FlowFilterName(any_=[FLOW_NAME]))
        cancelling = await client.read_flow_runs(flow_filter=flows, limit=200, flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLING]))))
        cancelled = await client.read_flow_runs(flow_filter=flows, limit=200, flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLED])),
            end_time=FlowRunFilterEndTime(after_=since - timedelta(seconds=30))))
        by_run: dict[str, list[tuple[str, dict]]] = {}
        for job_id, job in self.state["jobs"].items():
            if job.get("flowRunId"):
                by_run.setdefault(job["flowRunId"], []).append((job_id, job))
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
                    await client.set_flow_run_state(run.id, _state(StateSpec(**job["final"])), force=True)

    # ------------------------------------------------------------------ building blocks

    @staticmethod
    def _tags(d: dict, user: str) -> list[str]:
        tags = ["apiary", f"user:{user}"]
        if d.get("virtualCluster"):
            tags.append(f"vc:{d['virtualCluster']}")
        if d.get("priorityClass"):
            tags.append(f"priority:{d['priorityClass']}")
        return tags

    async def _create_task_run(self, client: Any, job_id: str, job: dict, ev: dict, step: str, name: str,
                               state: Any, attempt: int) -> uuid.UUID:
        tid = task_run_id(job_id, int(ev["seq"]), step)
        shape = _TaskShape(task_key=f"apiary.{name.split('@')[0]}",
                           tags=[*job.get("tags", ["apiary"]), f"attempt:{attempt}"])
        await client.create_task_run(shape, uuid.UUID(job["flowRunId"]), dynamic_key=f"{ev['seq']}:{step}",
                                     id=tid, name=name, state=state)
        return tid

    async def _task(self, client: Any, job_id: str, job: dict, ev: dict, step: str, name: str, ptype: str,
                    message: str, attempt: int = 0) -> uuid.UUID:
        """A task run that happens at once: created directly in its final state (one request)."""
        from prefect.states import State, StateType

        return await self._create_task_run(client, job_id, job, ev, step, name,
                                           State(type=StateType(ptype), message=message), attempt)

    async def _open(self, client: Any, job_id: str, job: dict, ev: dict, key: str, name: str, state_name: str,
                    message: str, attempt: int = 0) -> None:
        from prefect.states import Running

        tid = await self._create_task_run(client, job_id, job, ev, key, name,
                                          Running(name=state_name, message=message), attempt)
        job["open"][key] = str(tid)

    async def _close(self, client: Any, job: dict, key: str, ptype: str, message: str) -> None:
        from prefect.states import State, StateType

        tid = job["open"].get(key)
        if tid is None:
            return
        await client.set_task_run_state(uuid.UUID(tid), State(type=StateType(ptype), message=message), force=True)
        del job["open"][key]
        if key.startswith("run:"):
            job.setdefault("closed", []).append(key)

    async def _end_attempts(self, client: Any, job_id: str, job: dict, before: int, ptype: str, message: str,
                            t: float | None) -> None:
        """Ship output and close every open task run of attempts ``< before``.

        A role run whose instances all exited 0 still ends Completed.
        """
        for key, inst in list(job["inst"].items()):
            attempt, role, index = key.split("/")
            if int(attempt) < before and inst.get("started") and not inst.get("shipped"):
                await self._ship_instance(client, job_id, job, int(attempt), role, int(index), final=True, t=t)
        for key in list(job["open"]):
            attempt = int(key.rsplit(":", 1)[1])
            if attempt >= before:
                continue
            if key.startswith("run:") and ptype != "COMPLETED":
                role = key.split(":")[1]
                mine = [v for k, v in job["inst"].items() if k.startswith(f"{attempt}/{role}/")]
                if mine and all(v.get("exit") == 0 for v in mine):
                    await self._close(client, job, key, "COMPLETED", f"{role}: all instances exited 0")
                    continue
            await self._close(client, job, key, ptype, message)

    async def _log(self, client: Any, job: dict, ev: dict, message: str, level: int = logging.INFO) -> None:
        """Queue one event line for the flow run's logs; :meth:`_flush_logs` sends them."""
        self._pending_logs.setdefault(job["flowRunId"], []).append({
            "name": "apiary.events", "level": level, "message": message,
            "timestamp": _iso(ev.get("time")), "flow_run_id": job["flowRunId"], "task_run_id": None,
        })

    async def _flush_logs(self, client: Any, flow_run_id: str | None) -> None:
        """Send queued event lines of one flow run in one request.

        Event lines are batched per job and batch (they cost one request each otherwise, on a
        SQLite server about 20 ms); they live in memory until sent, so a crash of the bridge
        can lose some (the task run states carry the same facts).
        """
        if not flow_run_id:
            return
        rows = self._pending_logs.pop(flow_run_id, None)
        if not rows:
            return
        try:
            for batch in _batches(rows):
                await client.create_logs(batch)
        except Exception as exc:
            if not _is_transient(exc):
                logger.error("event log lines dropped flow_run=%s lines=%s error=%r", flow_run_id, len(rows), exc)
                return
            self._pending_logs.setdefault(flow_run_id, [])[:0] = rows  # keep them for the next try
            raise

    async def _artifact(self, client: Any, artifact: Any) -> None:
        # Same request as client.create_artifact(), without the client-side "artifact created"
        # event: that would start a second (websocket) connection to PREFECT_API_URL.
        await client.request("POST", "/artifacts/", json=artifact.model_dump(mode="json", exclude_unset=True))

    async def _ship_instance(self, client: Any, job_id: str, job: dict, attempt: int, role: str, index: int,
                             final: bool, t: float | None = None) -> int:
        """Ship one instance's new stdout/stderr to the flow run's logs; return lines shipped.

        Lines are prefixed ``[role/index]`` (stderr lines come from logger ``apiary.job.stderr``).
        While running only complete lines are shipped (the offset stops at the last newline);
        ``final`` ships the rest too.
        """
        run_tid = job["open"].get(f"run:{role}:{attempt}")
        rows: list[dict] = []
        new_offsets: dict[str, int] = {}
        stamp = _iso(t)
        for stream in ("stdout", "stderr"):
            okey = f"{attempt}/{role}/{index}/{stream}"
            off = int(job["logOff"].get(okey, 0))
            text = await self.source.logs(job_id, role, index, attempt, stream, offset=off)
            if not final:
                cut = text.rfind("\n")
                text = text[: cut + 1] if cut >= 0 else ""
            if not text:
                continue
            new_offsets[okey] = off + len(text.encode())
            prefix = f"[{role}/{index}]" + (f"@{attempt}" if attempt else "")
            for line in text.splitlines():
                rows.append({
                    "name": f"apiary.job.{stream}", "level": logging.INFO,
                    "message": f"{prefix} {line[:_MAX_LINE_CHARS]}", "timestamp": stamp,
                    "flow_run_id": job["flowRunId"], "task_run_id": run_tid,
                })
        for batch in _batches(rows):
            await client.create_logs(batch)
        job["logOff"].update(new_offsets)
        if final:
            job["inst"].setdefault(f"{attempt}/{role}/{index}", {})["shipped"] = True
        return len(rows)

    async def _poll_running_logs(self, client: Any) -> None:
        """Ship complete output lines of running instances, at most every ``log_interval_s``."""
        now = time.monotonic()
        todo = []
        for job_id, job in self.state["jobs"].items():
            if job.get("done") or not job.get("running"):
                continue
            if now - self._log_polled.get(job_id, 0.0) < self.log_interval_s:
                continue
            self._log_polled[job_id] = now
            for key, inst in job["inst"].items():
                if inst.get("started") and "exit" not in inst:
                    attempt, role, index = key.split("/")
                    todo.append((job_id, job, int(attempt), role, int(index)))
        sem = asyncio.Semaphore(self.concurrency)

        async def one(item: tuple) -> None:
            async with sem:
                await self._ship_instance(client, item[0], item[1], item[2], item[3], item[4], final=False)

        await asyncio.gather(*(one(i) for i in todo))


def _spec_dict(spec: StateSpec) -> dict[str, str]:
    return {"type": spec.type, "name": spec.name, "message": spec.message}


def _state(spec: StateSpec) -> Any:
    """The Prefect state object of a :class:`~apiary.tracking.states.StateSpec`."""
    from prefect.states import State, StateType

    return State(type=StateType(spec.type), name=spec.name, message=spec.message)


def _batches(rows: Iterable[dict]) -> Iterable[list[dict]]:
    batch: list[dict] = []
    size = 0
    for row in rows:
        n = len(row["message"]) + 200
        if batch and (len(batch) >= _MAX_BATCH_LINES or size + n > _MAX_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(row)
        size += n
    if batch:
        yield batch


async def run_bridge(api_url: str, prefect_api_url: str, state_path: Path) -> None:
    """The ``prefect-bridge`` process of ``apiary up``: mirror ``api_url``'s jobs into
    ``prefect_api_url`` until cancelled (SIGTERM/SIGINT end it through asyncio.run)."""
    from apiary.tracking.source import HttpEventSource

    bridge = PrefectBridge(HttpEventSource(api_url), prefect_api_url, Path(state_path))
    await bridge.run_forever()
