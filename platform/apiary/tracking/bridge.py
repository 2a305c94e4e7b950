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
job.submitted       flow run (RUNNING "Submitted", then the state of :mod:`~apiary.tracking.states`)
                    unless the job came with ``flowRunId`` (a flow engine runs that one: the
                    bridge attaches to it, adds the job's tags and never ends it); task run
                    ``queue`` (Running, named "Waiting")
job.waiting         flow run Waiting (the reason); ``queue`` for that attempt opened if needed
job.placed          ``queue`` Completed with the placement (taskRole/index -> node, GPUs)
task.started        flow run Running (first time); task run ``run-<taskRole>`` Running
task.exited         instance output shipped as logs (``[train/0] ...``); ``run-<taskRole>`` ends
                    Completed (all exit 0) or Failed once every placed instance of the role exited
job.preempted       open task runs of the attempt Cancelled; flow run AwaitingRetry (the cause)
job.retry           open task runs of older attempts Failed; flow run AwaitingRetry; ``queue@N``
                    opened for the new attempt
job.stop_requested  logged
job.completed       open task runs closed; the flow run (if the bridge owns it) Completed /
                    Failed / Cancelled for SUCCEEDED / FAILED / STOPPED; a markdown summary
                    artifact (key ``job-<user>-<name>``: every instance's node, GPUs, exit code)
==================  ===========================================================================

Every event is also a log line of the run (logger ``apiary.events``). Task runs of attempt
N > 0 carry the suffix ``@N`` (``run-train@1``) and the tag ``attempt:N``.

How it writes: a batch of events (up to ``batch_size``) is first recorded in the jobs' records,
then written flow-run states first: each touched job's run is created or set to the state it
has now, once per batch however many events it had (``concurrency`` jobs at a time); then the
batch's task run changes go in ONE ``POST /events`` as ``prefect.task-run.*`` events (the way
Prefect's own task engine reports task runs: the server's task run recorder writes them), its
log rows in one ``POST /logs/`` per 500; finished jobs' summary artifacts wait in the state
file until a pass has caught up with the events. Towards Apiary a batch costs two requests too:
its finished instances' output is read in one ``POST /api/v2/logs/query`` (while the flow runs
are written) and its new flow runs' ids are recorded in one ``PUT /api/v2/flowRuns`` (with the
task runs and logs): a step waiting on one server never holds back the other's. A plain job
costs one to three flow-run requests (one when the bridge first sees it over; created
"Submitted", Running and final when it sees each step) and a share of two bulk requests, plus its
summary, where one request per step cost ~14.

Idempotence: ``state_path`` (JSON, replaced atomically) holds the cursor (every event with
``seq <= cursor`` is done) and per job its record: the last seq done, its flow run id, open task
runs and log offsets. A batch is all or nothing: when a write fails transiently its records are
restored and it is done again. Task run ids are ``uuid5(job id, seq, step)`` and each task run
state's id is derived from its task run and state, so the recorder stores it once; flow runs are
created with the idempotency key ``apiary:<job id>:<submitted seq>`` (the API does not take a
flow run id). A restarted bridge, or one that repeats a batch, neither duplicates nor loses runs;
log lines are at-least-once.

Cost, measured (bench/prefect_cost.py, PostgreSQL-backed server, 2 CPUs): a flow run request
costs the server ~20 ms of CPU; on a SQLite-backed server it stalls ~2.3 s now and then on its
lock and answers 503 (the bridge retries after 0.1-0.8 s); concurrency above 2 does not help on
SQLite (it does on PostgreSQL). See bench/README.md, "prefect numbers".
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
STATE_VERSION = 2
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
        self._deployment_id: uuid.UUID | None = None
        self._cancel_checked = 0.0  # monotonic time of the last look for Cancel clicks
        self._links: dict[str, str] = {}  # job id -> flow run id created by the current _flush
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
        if data.get("version") == 1:  # open task runs were bare ids; a job's "submitted" was implied
            for job in data.get("jobs", {}).values():
                job["open"] = {k: _v1_open(k, v) for k, v in (job.get("open") or {}).items()}
                if job.get("flowRunId"):
                    job.setdefault("submitted", {})
            data["version"] = STATE_VERSION
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
        from prefect.settings import PREFECT_API_AUTH_STRING

        loop = asyncio.get_running_loop()
        if self._client is not None and self._client_loop is not loop:
            self._client = None  # bound to a loop that is gone (asyncio.run per call)
        if self._client is None:
            # An explicit api= ignores the settings' auth: pass the basic auth apiary up gave us.
            client = PrefectClient(api=self.prefect_api_url, auth_string=PREFECT_API_AUTH_STRING.value())
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
                    flow_id=await self._flow(client),
                    name=JOB_DEPLOYMENT,
                    tags=["apiary"],
                    description="Apiary jobs submitted by the CLI or REST API (runs are made by Apiary's "
                    "bridge). Retry on a finished run re-runs its job as a new job.",
                )
        return self._deployment_id

    # ------------------------------------------------------------------ main loop

    async def sync_once(self) -> int:
        """Mirror every pending event; return how many were processed (done or skipped).

        Stops early, without raising, when Prefect or Apiary is unreachable; the cursor then
        stays at the last batch done and the next call resumes from there.
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
                    done += await self._process_batch(client, events)
                    self._save()
                await self._flush_leftovers(client)
                await self._flush_artifacts(client)
                await self._watch_cancels(client)
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

    async def _process_batch(self, client: Any, events: list[dict]) -> int:
        """Record one batch in the jobs' records, then write it to Prefect (:meth:`_flush`).

        All or nothing: when a write fails transiently the touched records are restored, the
        cursor stays, and the whole batch is done again on the next call (every write is safe to
        repeat: flow runs by idempotency key, task run states by event id; log lines may repeat).
        Returns the number of events processed.
        """
        out = _Out()
        before: dict[str, str | None] = {}
        for ev in events:
            job_id = ev["jobId"]
            if job_id not in before:
                old = self.state["jobs"].get(job_id)
                before[job_id] = None if old is None else json.dumps(old)
            try:
                await self._apply(ev, out)
            except Exception as exc:
                if _is_transient(exc):
                    self._restore(before)
                    raise
                logger.error("event skipped seq=%s job=%s type=%s error=%r", ev["seq"], job_id, ev["type"], exc)
                self._job(job_id)["lastSeq"] = ev["seq"]
        try:
            await self._flush(client, out)
        except Exception as exc:
            if _is_transient(exc):
                self._restore(before)
            raise
        self.state["cursor"] = events[-1]["seq"]
        return len(events)

    def _restore(self, before: dict[str, str | None]) -> None:
        for job_id, old in before.items():
            if old is None:
                self.state["jobs"].pop(job_id, None)
            else:
                self.state["jobs"][job_id] = json.loads(old)

    async def _flush_leftovers(self, client: Any) -> None:
        """States a failed write left wanted, and the new output of running instances."""
        out = _Out()
        for job_id, job in self.state["jobs"].items():
            if job.get("want"):
                out.touched[job_id] = job
        self._collect_running_output(out)
        if not out.touched and not out.ships:
            return
        before: dict[str, str | None] = {
            j: json.dumps(self.state["jobs"][j]) for j in {*out.touched, *(s[0] for s in out.ships)}
        }
        try:
            await self._flush(client, out)
        except Exception as exc:
            if _is_transient(exc):
                self._restore(before)
            raise

    async def _flush(self, client: Any, out: _Out) -> None:
        """Read the batch's finished output from Apiary and write what the batch recorded, flow
        run states first.

        1. Each touched job's flow run: created (in the state the job has now, one request) or
           set to the wanted state; ``concurrency`` jobs at a time. This is what the UI lists.
           Meanwhile the output of the instances ``out.ships`` names is read from Apiary
           (:meth:`_ship_output`): the two wait on different servers, so neither waits for the
           other.
        2. Then, at once: the new runs' ids to Apiary in one ``PUT /api/v2/flowRuns``; every task
           run change of the batch as ``prefect.task-run.*`` events in ONE ``POST /events`` (how
           Prefect's own task engine reports task runs; the server's task run recorder writes
           them); every log row in one ``POST /logs/`` per 500 rows.
        3. Summary artifacts of finished jobs are queued in the state file for
           :meth:`_flush_artifacts`.

        Every step runs to its end before a failure is raised (:func:`_together`), so a batch that
        is redone never races a write of its first try.
        """
        sem = asyncio.Semaphore(self.concurrency)

        async def one(job_id: str, job: dict) -> None:
            async with sem:
                await self._busy_retry(lambda: self._flush_run(client, job_id, job))

        async def runs() -> None:
            await _together(*(one(j, job) for j, job in out.touched.items()))

        self._links = {}
        await _together(runs(), self._ship_output(out))

        async def links() -> None:
            if not self._links:
                return
            # The new runs' ids go to Apiary in one request, not one per job. A transient failure
            # redoes the batch, whose runs the idempotency keys bring back with the same ids.
            try:
                unknown = await self.source.set_flow_runs(dict(self._links))
            except Exception as exc:
                if _is_transient(exc):
                    raise
                # Refused for good: the runs stay mirrored, Apiary just does not show their ids.
                logger.error("flow run ids not recorded in Apiary jobs=%s error=%r", len(self._links), exc)
                unknown = []
            if unknown:
                logger.warning("flow runs of jobs Apiary does not know: %s", ", ".join(unknown))

        async def task_runs() -> None:
            # A task run opened and closed in the same batch is sent once, in its last state (its
            # start time still says when it opened).
            last = {tr["id"]: (job, tr, ch) for job, tr, ch in out.task_changes if job.get("flowRunId")}
            events = [self._task_event(job, tr, ch) for job, tr, ch in last.values()]
            if events:
                await self._busy_retry(lambda: client.request("POST", "/events", json=events))

        async def logs() -> None:
            rows = [{**row, "flow_run_id": job["flowRunId"]} for job, row in out.logs if job.get("flowRunId")]
            for batch in _batches(rows):
                await self._busy_retry(lambda b=batch: client.create_logs(b))

        await _together(links(), task_runs(), logs())

        # Summaries wait until a pass has caught up with the events (sync_once): under load the
        # runs' states go first. They are kept in the state file until sent.
        for job, a in out.artifacts:
            if job.get("flowRunId"):
                self.state.setdefault("artifacts", []).append({**a, "flow_run_id": job["flowRunId"]})

    async def _flush_artifacts(self, client: Any, most: int = 50) -> None:
        """Send up to ``most`` queued summary artifacts (``concurrency`` at a time), then forget
        them: a pass that caught up with the events sends a few, so they never hold back the next
        batch's states for long. Same request as client.create_artifact(), without its
        client-side "artifact created" event: that would open a second (websocket) connection."""
        chunk = (self.state.get("artifacts") or [])[:most]
        if not chunk:
            return
        sem = asyncio.Semaphore(self.concurrency)

        async def one(a: dict) -> None:
            async with sem:
                try:
                    await self._busy_retry(lambda: client.request("POST", "/artifacts/", json=a))
                except Exception as exc:
                    if _is_transient(exc):
                        raise
                    logger.error("summary artifact dropped key=%s error=%r", a.get("key"), exc)

        await asyncio.gather(*(one(a) for a in chunk))
        del self.state["artifacts"][: len(chunk)]

    async def _busy_retry(self, call: Any) -> Any:
        """``await call()``, retried in place while the server answers "busy".

        A SQLite-backed Prefect server answers 503 when its database is locked (seen here
        even with one writer, next to the server's own services). The client's own retry
        sleeps 2**n s, so the bridge retries after 0.1-0.8 s instead; every write is safe to
        repeat.
        """
        for delay in self._BUSY_DELAYS_S:
            try:
                return await call()
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code not in _BUSY_STATUS:
                    raise
                logger.debug("server busy; retrying delay_s=%s", delay)
            await asyncio.sleep(delay)
        return await call()

    _BUSY_DELAYS_S = (0.1, 0.2, 0.4, 0.8)

    # ------------------------------------------------------------------ per-job state

    def _job(self, job_id: str) -> dict[str, Any]:
        return self.state["jobs"].setdefault(
            job_id,
            {
                "flowRunId": None,
                "owned": True,
                "lastSeq": 0,
                "done": False,
                "running": False,
                "open": {},
                "inst": {},
                "logOff": {},
                "user": None,
            },
        )

    def _prune(self) -> None:
        """Finished jobs whose events are all behind the cursor shrink to a tombstone."""
        for job_id, job in self.state["jobs"].items():
            if job.get("done") and job["lastSeq"] <= self.cursor and "inst" in job and not job.get("want"):
                self.state["jobs"][job_id] = {
                    "flowRunId": job["flowRunId"],
                    "lastSeq": job["lastSeq"],
                    "done": True,
                    "owned": job.get("owned", True),
                    "final": job.get("final"),
                }

    # ------------------------------------------------------------------ event handlers

    async def _apply(self, ev: dict, out: _Out) -> None:
        """Record one event in its job's record and ``out``; nothing is written to Prefect here.
        An event already recorded (``seq <= lastSeq``: a replay) changes nothing."""
        job_id, seq, kind = ev["jobId"], int(ev["seq"]), ev["type"]
        job = self._job(job_id)
        if seq <= job["lastSeq"]:
            return
        if job.get("done"):
            job["lastSeq"] = seq
            return
        out.touched[job_id] = job
        if kind != "job.submitted" and not job.get("submitted"):
            await self._bootstrap(job_id, job, ev, out)
        handler = getattr(self, "_on_" + kind.replace(".", "_"), None)
        if handler is None:
            logger.info("event type not mirrored seq=%s job=%s type=%s", seq, job_id, kind)
            self._log(out, job, ev, f"{kind} {ev.get('data') or {}}")
        else:
            handler(out, job_id, job, ev, ev.get("data") or {})
        job["lastSeq"] = seq

    async def _bootstrap(self, job_id: str, job: dict, ev: dict, out: _Out) -> None:
        """The bridge missed ``job.submitted`` (its state was lost): rebuild it from the job."""
        try:
            info = await self.source.job(job_id)
        except NotFoundError:
            info = {"user": job_id.split("~")[0], "name": job_id.split("~")[-1]}
        data = {k: info.get(k) for k in ("user", "name", "virtualCluster", "priorityClass", "flowRunId")}
        self._on_job_submitted(out, job_id, job, {**ev, "seq": 0, "type": "job.submitted"}, data)

    def _on_job_submitted(self, out: _Out, job_id: str, job: dict, ev: dict, d: dict) -> None:
        user = d.get("user") or job_id.split("~")[0]
        job["user"] = user
        job["tags"] = self._tags(d, user)
        job["submitted"] = {"seq": ev["seq"], "vc": d.get("virtualCluster"), "priority": d.get("priorityClass")}
        if d.get("flowRunId"):
            job["given"] = str(d["flowRunId"])  # a flow engine runs it: attach in _flush_run
        else:
            # "Submitted" until Apiary says more: Waiting comes with job.waiting (a job the
            # scheduler places at once never waits), Running with task.started.
            self._want(job, states.submitted(user, d.get("virtualCluster"), d.get("priorityClass")))
        self._open(out, job_id, job, ev, "queue:0", "queue", "Waiting", "waiting for placement")
        self._log(
            out,
            job,
            ev,
            f"job.submitted user={user} virtualCluster={d.get('virtualCluster')} "
            f"priorityClass={d.get('priorityClass')}",
        )

    def _on_job_waiting(self, out: _Out, job_id: str, job: dict, ev: dict, d: dict) -> None:
        attempt = int(d.get("attempt", 0))
        key = f"queue:{attempt}"
        if key not in job["open"]:
            self._open(
                out, job_id, job, ev, key, f"queue{_suffix(attempt)}", "Waiting", f"waiting: {d.get('reason')}", attempt
            )
        self._want(job, states.waiting(d.get("reason"), job.get("retryCause")))
        self._log(out, job, ev, f"job.waiting attempt={attempt} reason={d.get('reason')}")

    def _on_job_placed(self, out: _Out, job_id: str, job: dict, ev: dict, d: dict) -> None:
        attempt = int(d.get("attempt", 0))
        placements = list(d.get("placements") or [])
        where = ", ".join(f"{p['taskRole']}/{p['index']}->{p['node']}{p.get('gpus')}" for p in placements)
        self._close(out, job, ev, f"queue:{attempt}", "COMPLETED", f"placed: {where}")
        for p in placements:
            inst = job["inst"].setdefault(f"{attempt}/{p['taskRole']}/{p['index']}", {})
            inst.update({"node": p.get("node"), "gpus": p.get("gpus")})
        self._log(out, job, ev, f"job.placed attempt={attempt} {where}")

    def _on_task_started(self, out: _Out, job_id: str, job: dict, ev: dict, d: dict) -> None:
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
            self._open(
                out, job_id, job, ev, key, f"run-{role}{_suffix(attempt)}", "Running", f"{role} running", attempt
            )
        self._log(
            out, job, ev, f"task.started attempt={attempt} {role}/{index} node={d.get('node')} gpus={d.get('gpus')}"
        )

    def _on_task_exited(self, out: _Out, job_id: str, job: dict, ev: dict, d: dict) -> None:
        attempt, role, index = int(d.get("attempt", 0)), d["taskRole"], int(d["index"])
        code = d.get("exitCode")
        inst = job["inst"].setdefault(f"{attempt}/{role}/{index}", {})
        inst.update({"started": True, "exit": code})
        self._ship(out, job_id, job, attempt, role, index, ev.get("time"))
        self._log(
            out, job, ev, f"task.exited attempt={attempt} {role}/{index} exitCode={code} phrase={d.get('phrase')}"
        )
        mine = [v for k, v in job["inst"].items() if k.startswith(f"{attempt}/{role}/")]
        if all("exit" in v for v in mine):
            codes = [v["exit"] for v in mine]
            ok = all(c == 0 for c in codes)
            self._close(
                out,
                job,
                ev,
                f"run:{role}:{attempt}",
                "COMPLETED" if ok else "FAILED",
                f"{role}: {len(codes)} instance(s) exited, exit codes {codes}",
            )

    def _on_job_preempted(self, out: _Out, job_id: str, job: dict, ev: dict, d: dict) -> None:
        attempt = int(d.get("attempt", 0))
        msg = f"preempted by {d.get('by')}: {d.get('reason')}"
        self._end_attempts(out, job_id, job, ev, attempt + 1, "CANCELLED", msg)
        job["retryCause"] = f"attempt {attempt} {msg}"
        job["running"] = False
        self._want(job, states.awaiting_retry(job["retryCause"]))
        self._log(
            out,
            job,
            ev,
            f"job.preempted attempt={attempt} by={d.get('by')} reason={d.get('reason')}",
            level=logging.WARNING,
        )

    def _on_job_retry(self, out: _Out, job_id: str, job: dict, ev: dict, d: dict) -> None:
        attempt = int(d.get("attempt", 0))
        msg = f"attempt {attempt - 1} failed ({d.get('kind')}): {d.get('reason')} exitCode={d.get('exitCode')}"
        self._end_attempts(out, job_id, job, ev, attempt, "FAILED", msg)
        job["retryCause"] = (
            f"{d.get('kind')} retry, attempt {attempt}: {d.get('reason')} (exit code {d.get('exitCode')})"
        )
        job["running"] = False
        self._want(job, states.awaiting_retry(job["retryCause"]))
        key = f"queue:{attempt}"
        if key not in job["open"]:
            self._open(
                out,
                job_id,
                job,
                ev,
                key,
                f"queue{_suffix(attempt)}",
                "Waiting",
                f"waiting for placement after {d.get('kind')} retry: {d.get('reason')}",
                attempt,
            )
        self._log(
            out,
            job,
            ev,
            f"job.retry attempt={attempt} kind={d.get('kind')} reason={d.get('reason')} exitCode={d.get('exitCode')}",
            level=logging.WARNING,
        )

    def _on_job_stop_requested(self, out: _Out, job_id: str, job: dict, ev: dict, d: dict) -> None:
        job.setdefault("stoppedBy", d.get("by") or "a stop request")
        self._log(out, job, ev, "job.stop_requested", level=logging.WARNING)

    def _on_job_completed(self, out: _Out, job_id: str, job: dict, ev: dict, d: dict) -> None:
        from prefect.client.schemas.actions import ArtifactCreate

        apiary_state = str(d.get("state", "FAILED")).upper()
        end = states.final(apiary_state, d.get("exitCode"), d.get("attempt"), job.get("stoppedBy"))
        self._end_attempts(out, job_id, job, ev, 10**9, end.type, end.message)
        retries = [k for k in job["inst"] if not k.startswith("0/")]
        table = "\n".join(
            f"| {k.split('/')[0]} | {k.split('/')[1]} | {k.split('/')[2]} | {v.get('node')} | {v.get('gpus')} "
            f"| {v.get('exit')} |"
            for k, v in sorted(job["inst"].items())
        )
        # One artifact per job, at its end: where every instance of every attempt ran and how it
        # exited (an artifact costs a request per job; the placement is in the logs meanwhile).
        out.artifacts.append(
            (
                job,
                ArtifactCreate(
                    key=_artifact_key(job_id, "job"),
                    type="markdown",
                    description=f"Summary of {job_id}",
                    data=(
                        f"# {job_id}: {apiary_state}\n\nexit code `{d.get('exitCode')}`, attempt {d.get('attempt')}, "
                        f"{len({k.split('/')[0] for k in retries})} retried attempt(s)\n\n"
                        "| attempt | taskRole | index | node | gpus | exitCode |\n|---|---|---|---|---|---|\n" + table
                    ),
                ).model_dump(mode="json", exclude_unset=True),
            )
        )
        self._log(
            out,
            job,
            ev,
            f"job.completed {end.message}",
            level=logging.INFO if apiary_state == "SUCCEEDED" else logging.ERROR,
        )
        job["final"] = _spec_dict(end)
        if job["owned"]:  # an attached run ends when its flow returns the same state (flows/job.py)
            self._want(job, end)
        job["done"] = True

    # ------------------------------------------------------------------ flow run state

    @staticmethod
    def _want(job: dict, spec: StateSpec) -> None:
        """The flow run state a job should show now (:mod:`apiary.tracking.states`). Set once per
        job per batch (:meth:`_flush_run`): one request however many events the batch held."""
        job["want"] = _spec_dict(spec)

    async def _flush_run(self, client: Any, job_id: str, job: dict) -> None:
        """Create the job's flow run, attach to the one it came with, or set its wanted state.

        A new run is created with the idempotency key ``apiary:<job id>:<submitted seq>`` in the
        job's first state (RUNNING "Submitted", see :mod:`apiary.tracking.states`), and moved to
        the wanted state in a second request when that differs. A bridge-made run is set with
        ``force`` (Prefect's rules refuse e.g. Running -> Pending, which a preemption is). A run
        a flow engine owns (started from the UI) gets only non-final states, and none once it is
        final or cancelling: the engine ends it. A 4xx answer is logged and the state dropped.
        """
        from prefect.exceptions import ObjectNotFound

        try:
            if not job.get("flowRunId"):
                await self._attach_or_create(client, job_id, job)
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
            if want != job.get("shown"):
                await client.set_flow_run_state(uuid.UUID(fid), _state(spec), force=True)
                job["shown"] = want
            job.pop("want", None)
        except Exception as exc:
            if _is_transient(exc):
                raise
            logger.error("flow run state dropped job=%s want=%s error=%r", job_id, job.get("want"), exc)
            job.pop("want", None)

    async def _attach_or_create(self, client: Any, job_id: str, job: dict) -> None:
        from prefect.client.schemas.actions import FlowRunCreate
        from prefect.exceptions import ObjectNotFound
        from prefect.states import to_state_create

        tags, given = job.get("tags") or ["apiary"], job.get("given")
        if given:
            try:
                run = await client.read_flow_run(uuid.UUID(given))
                # A run started from the UI has the deployment's tags only: add user:, vc:, priority:.
                if not set(tags) <= set(run.tags or []):
                    await client.update_flow_run(run.id, tags=sorted(set(run.tags or []) | set(tags)))
                job["flowRunId"], job["owned"] = given, False
                return
            except (ObjectNotFound, ValueError):
                logger.warning("job=%s names flow run id=%s that Prefect lacks; creating one", job_id, given)
        sub = job.get("submitted") or {}
        first = states.submitted(job.get("user"), sub.get("vc"), sub.get("priority"))
        want = job.get("want")
        if want and want["type"] != "PENDING":
            # Already running or over when first seen (a short job, or a bridge catching up):
            # created in that state, one request. Only a waiting job needs "Submitted" first,
            # so that its run has started and is never shown "late" (apiary.tracking.states).
            first = StateSpec(**want)
        create = FlowRunCreate(
            flow_id=await self._flow(client),
            deployment_id=await self._job_deployment(client),
            name=job_id,
            parameters={"job_id": job_id},
            tags=tags,
            labels={"apiary.job": job_id, "apiary.user": job.get("user") or job_id.split("~")[0]},
            state=to_state_create(_state(first)),
            idempotency_key=f"apiary:{job_id}:{sub.get('seq', 0)}",
        )
        # create_flow_run() takes no idempotency key; this is the same POST with one.
        resp = await client.request("POST", "/flow_runs/", json=create.model_dump(mode="json", exclude_unset=True))
        fid = str(resp.json()["id"])
        self._links[job_id] = fid  # told to Apiary for the whole batch at once (_flush)
        job["flowRunId"], job["owned"], job["shown"] = fid, True, _spec_dict(first)

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
        cancelling = await client.read_flow_runs(
            flow_filter=flows,
            limit=200,
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLING]))
            ),
        )
        cancelled = await client.read_flow_runs(
            flow_filter=flows,
            limit=200,
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLED])),
                end_time=FlowRunFilterEndTime(after_=since - timedelta(seconds=30)),
            ),
        )
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

    def _open(
        self,
        out: _Out,
        job_id: str,
        job: dict,
        ev: dict,
        key: str,
        name: str,
        state_name: str,
        message: str,
        attempt: int = 0,
    ) -> None:
        """A task run that starts now (Running, named ``state_name``); :meth:`_close` ends it."""
        seq = int(ev["seq"])
        tr = {
            "id": str(task_run_id(job_id, seq, key)),
            "name": name,
            "dynamicKey": f"{seq}:{key}",
            "attempt": attempt,
            "start": ev.get("time"),
        }
        job["open"][key] = tr
        out.task_changes.append(
            (job, tr, {"type": "RUNNING", "name": state_name, "message": message, "time": ev.get("time")})
        )

    def _close(self, out: _Out, job: dict, ev: dict, key: str, ptype: str, message: str) -> None:
        tr = job["open"].pop(key, None)
        if tr is None:
            return
        out.task_changes.append(
            (
                job,
                tr,
                {
                    "type": ptype,
                    "name": states.FINAL_NAMES[ptype],
                    "message": message,
                    "time": ev.get("time"),
                },
            )
        )
        if key.startswith("run:"):
            job.setdefault("closed", []).append(key)

    def _end_attempts(self, out: _Out, job_id: str, job: dict, ev: dict, before: int, ptype: str, message: str) -> None:
        """Ship output and close every open task run of attempts ``< before``.

        A role run whose instances all exited 0 still ends Completed.
        """
        for key, inst in list(job["inst"].items()):
            attempt, role, index = key.split("/")
            if int(attempt) < before and inst.get("started") and not inst.get("shipped"):
                self._ship(out, job_id, job, int(attempt), role, int(index), ev.get("time"))
        for key in list(job["open"]):
            attempt = int(key.rsplit(":", 1)[1])
            if attempt >= before:
                continue
            if key.startswith("run:") and ptype != "COMPLETED":
                role = key.split(":")[1]
                mine = [v for k, v in job["inst"].items() if k.startswith(f"{attempt}/{role}/")]
                if mine and all(v.get("exit") == 0 for v in mine):
                    self._close(out, job, ev, key, "COMPLETED", f"{role}: all instances exited 0")
                    continue
            self._close(out, job, ev, key, ptype, message)

    def _task_event(self, job: dict, tr: dict, change: dict) -> dict:
        """The ``prefect.task-run.<State>`` event of one task run state change, as Prefect's task
        engine emits it (``prefect.orchestration: client``; the server's task run recorder turns
        it into the task run and its state). The event id is the state id, derived from the task
        run and the change, so a repeated batch records nothing twice."""
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
            "id": str(uuid.uuid5(_NAMESPACE, f"{tid}#{change['type']}#{change['name']}")),
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
                "task_run": run.model_dump(mode="json", exclude_none=True, exclude=_EVENT_TASK_RUN_EXCLUDE),
            },
        }

    def _log(self, out: _Out, job: dict, ev: dict, message: str, level: int = logging.INFO) -> None:
        """One event line for the flow run's logs (sent with the batch, :meth:`_flush`)."""
        out.logs.append(
            (
                job,
                {
                    "name": "apiary.events",
                    "level": level,
                    "message": message,
                    "timestamp": _iso(ev.get("time")),
                    "task_run_id": None,
                },
            )
        )

    def _ship(self, out: _Out, job_id: str, job: dict, attempt: int, role: str, index: int, t: float | None) -> None:
        """Ship the rest of one exited instance's output with this batch."""
        tr = job["open"].get(f"run:{role}:{attempt}") or {}
        out.ships.append((job_id, job, attempt, role, index, True, t, tr.get("id")))
        job["inst"].setdefault(f"{attempt}/{role}/{index}", {})["shipped"] = True

    async def _ship_output(self, out: _Out) -> None:
        """Read the new output of every instance ``out.ships`` names from Apiary into ``out.logs``:
        both streams of all of them in one request (per 200 streams), not two requests each."""
        # An instance named twice (its run retried in place within the batch) is read once: the
        # read covers every run of the attempt.
        latest = {(item[0], item[2], item[3], item[4]): item for item in out.ships}
        reads = [
            (item, stream, int(item[1]["logOff"].get(f"{item[2]}/{item[3]}/{item[4]}/{stream}", 0)))
            for item in latest.values()
            for stream in ("stdout", "stderr")
        ]
        if not reads:
            return
        texts = await self.source.logs_many(
            [(item[0], item[3], item[4], item[2], stream, off) for item, stream, off in reads])
        for (item, stream, off), text in zip(reads, texts, strict=True):
            self._take_output(out, *item, stream=stream, off=off, text=text)

    def _take_output(
        self,
        out: _Out,
        job_id: str,
        job: dict,
        attempt: int,
        role: str,
        index: int,
        final: bool,
        t: float | None,
        task_run: str | None,
        *,
        stream: str,
        off: int,
        text: str,
    ) -> None:
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
        stamp = _iso(t)
        for line in text.splitlines():
            out.logs.append(
                (
                    job,
                    {
                        "name": f"apiary.job.{stream}",
                        "level": logging.INFO,
                        "message": f"{prefix} {line[:_MAX_LINE_CHARS]}",
                        "timestamp": stamp,
                        "task_run_id": task_run,
                    },
                )
            )

    def _collect_running_output(self, out: _Out) -> None:
        """Name in ``out.ships`` the running instances whose complete output lines are due (at most
        every ``log_interval_s`` per job)."""
        now = time.monotonic()
        for job_id, job in self.state["jobs"].items():
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


@dataclass
class _Out:
    """What one batch writes to Prefect, collected while its events are recorded."""

    touched: dict[str, dict] = field(default_factory=dict)  # job id -> record: flow run to create/update
    task_changes: list[tuple[dict, dict, dict]] = field(default_factory=list)  # (job, task run, state change)
    logs: list[tuple[dict, dict]] = field(default_factory=list)  # (job, log row without flow_run_id)
    artifacts: list[tuple[dict, dict]] = field(default_factory=list)  # (job, ArtifactCreate json)
    ships: list[tuple] = field(default_factory=list)  # instance output to read from Apiary


# TaskRun fields the task run recorder fills itself (the exclusions of Prefect's own task engine).
_EVENT_TASK_RUN_EXCLUDE = {
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


def _v1_open(key: str, task_run: str) -> dict[str, Any]:
    """An open task run of a version 1 state file (``key`` ``queue:<attempt>`` or
    ``run:<role>:<attempt>`` -> its id) as version 2 records it. The name is the one it was created
    with; its start time was not kept, so its end is recorded as its start."""
    parts = key.split(":")
    attempt = int(parts[-1])
    name = "queue" if parts[0] == "queue" else f"run-{parts[1]}"
    return {"id": task_run, "name": name + _suffix(attempt), "dynamicKey": key, "attempt": attempt}


def _spec_dict(spec: StateSpec) -> dict[str, str]:
    return {"type": spec.type, "name": spec.name, "message": spec.message}


def _state(spec: StateSpec) -> Any:
    """The Prefect state object of a :class:`~apiary.tracking.states.StateSpec`."""
    from prefect.states import State, StateType

    return State(type=StateType(spec.type), name=spec.name, message=spec.message)


async def _together(*aws: Any) -> list[Any]:
    """Await all of ``aws`` concurrently and let every one finish, then raise the first
    non-transient failure, else the first failure (``asyncio.gather`` would raise at once and
    leave the others running). Returns their results in order."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise next((f for f in failures if not _is_transient(f)), failures[0])
    return results


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


async def run_bridge(api_url: str, prefect_api_url: str, state_path: Path, concurrency: int = 2) -> None:
    """The ``prefect-bridge`` process of ``apiary up``: mirror ``api_url``'s jobs into
    ``prefect_api_url`` until cancelled (SIGTERM/SIGINT end it through asyncio.run).
    ``concurrency``: jobs written at once (2 for a SQLite-backed server, which answers 503 to
    more; ``apiary up`` gives a PostgreSQL-backed one 8)."""
    from apiary.tracking.source import HttpEventSource

    bridge = PrefectBridge(HttpEventSource(api_url), prefect_api_url, Path(state_path), concurrency=concurrency)
    await bridge.run_forever()
