"""Mirror Apiary jobs into Prefect: one flow run per job, task runs per lifecycle step.

Apiary accepts, schedules and runs jobs itself; Prefect is kept off the launch path (a flow
engine per job costs ~1 s and ~1 MB each and a SQLite-backed server answered 503 at 50
concurrent flow runs). The :class:`PrefectBridge` reads Apiary's event log through a
:class:`~apiary.tracking.source.JobEventSource` and writes what happened to the Prefect API with
ONE :class:`~prefect.client.orchestration.PrefectClient`, in one process, with bounded
concurrency. When the Prefect server is down it keeps its cursor and catches up later.

What a job becomes (flow ``apiary-job``, flow run named after the job id ``user~name``) is
decided per typed event (:mod:`apiary.tracking.events`) by :mod:`apiary.tracking.recorder`, and
every flow run state comes from the one table of :mod:`apiary.tracking.states`. The modules:

* :mod:`~apiary.tracking.events`: the event reader (raw events -> typed events);
* :mod:`~apiary.tracking.recorder`: what each event does to its job's record and the batch;
* :mod:`~apiary.tracking.ledger`: the state file (cursor, run links, per-job records);
* :mod:`~apiary.tracking.flowruns`: the Prefect writes (flow runs, task run events, Cancel, settle);
* this module: the loop that reads, records and writes batch by batch.

A run a flow engine runs (the Prefect form's) is attached to, and ended by its engine; when the
engine is gone (a restart of ``apiary up`` ends the process that ran it) the bridge ends it in the
job's final state ``settle_after_s`` after the job ended (:meth:`FlowRunWriter.settle
<apiary.tracking.flowruns.FlowRunWriter.settle>`).

How it writes: a batch of events (up to ``batch_size``) is first recorded in the jobs' records,
then written flow-run states first: each touched job's run is created or set to the state it
has now, once per batch however many events it had (``concurrency`` jobs at a time); then the
batch's task run changes go in ONE ``POST /events`` as ``prefect.task-run.*`` events (the way
Prefect's own task engine reports task runs: the server's task run recorder writes them), its
log rows in one ``POST /logs/`` per 500; finished jobs' summary artifacts wait in the state
file until a batch finds the bridge not behind. Towards Apiary a batch costs two requests too:
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
import functools
import logging
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from apiary.errors import NotFoundError
from apiary.tracking.events import EventType, JobEvent, Submitted, read_event
from apiary.tracking.flowruns import (
    FLOW_NAME,
    JOB_DEPLOYMENT,
    FlowRunWriter,
    busy_retry,
    task_event,
)
from apiary.tracking.ledger import Ledger
from apiary.tracking.recorder import Out, Recorder, task_run_id
from apiary.tracking.source import JobEventSource
from apiary.tracking.transient import is_transient, together

logger = logging.getLogger(__name__)

__all__ = ["FLOW_NAME", "JOB_DEPLOYMENT", "PrefectBridge", "run_bridge", "task_run_id"]

_MAX_BATCH_LINES = 500
_MAX_BATCH_BYTES = 1_000_000


class PrefectBridge:
    """Replays Apiary job events into the Prefect API at ``prefect_api_url`` (``http://h:p/api``).

    ``source`` is the Apiary side (:class:`~apiary.tracking.source.JobEventSource`);
    ``state_path`` the JSON file that makes the bridge restartable
    (:class:`~apiary.tracking.ledger.Ledger`). ``concurrency`` bounds how many jobs are written
    at once (one HTTP connection each); ``catch_up_concurrency`` (default: the same) while the
    bridge is behind. On a PostgreSQL-backed server at 20 jobs/s, 4 at once kept the UI within
    0.6-1.6 s (p99) where 8 trailed by 1.9-4.9 s; at 50 jobs/s, behind, 8 trailed less (p99 61 s
    against 80, one run each; bench/README.md, "Fewer flow runs at once"). ``log_interval_s`` is
    how often the output of running instances is shipped (it is always shipped when they exit). ``client_retries`` is
    ``PREFECT_CLIENT_MAX_RETRIES`` for the bridge's requests: the client's own back-off is 2**n s,
    so it is kept low and the bridge backs off itself. ``settle_after_s``: how long an attached
    run (a flow engine's) may stay unfinished after its job ended before the bridge ends it.
    ``batch_size``: events read a batch; ``catch_up_batch_size`` after a read that filled its
    batch (the bridge is behind). A job whose events a batch holds from submission to its end gets
    its flow run created final, one request; split over batches it costs two or three (at 50 jobs/s
    with batches of 500, 0.99 state changes a job besides its creation). The API reads at most
    5,000 events a request.

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
        catch_up_concurrency: int | None = None,
        batch_size: int = 500,
        catch_up_batch_size: int = 4000,
        log_interval_s: float = 10.0,
        client_retries: int = 0,
        settle_after_s: float = 30.0,
    ) -> None:
        self.source = source
        self._settings_active = False
        self.prefect_api_url = prefect_api_url.rstrip("/")
        self.state_path = Path(state_path)
        self.concurrency = concurrency
        self.catch_up_concurrency = catch_up_concurrency or concurrency
        self.batch_size = batch_size
        self.catch_up_batch_size = max(batch_size, catch_up_batch_size)
        self._behind = False  # the last read filled its batch
        self.client_retries = client_retries
        self.settle_after_s = settle_after_s
        self.ledger = Ledger(self.state_path)
        self.recorder = Recorder(log_interval_s)
        self._client: Any = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._writer: FlowRunWriter | None = None
        self._down_since: float | None = None
        self._cancel_checked = 0.0  # monotonic time of the last look for Cancel clicks
        self._cancel_after: datetime | None = None  # Cancelled runs that ended after this were seen
        self.cancel_poll_s = 1.0

    @property
    def cursor(self) -> int:
        """Seq of the last event done; every event with a smaller or equal seq is mirrored."""
        return self.ledger.cursor

    @property
    def state(self) -> dict[str, Any]:
        """The state file's content (:class:`~apiary.tracking.ledger.Ledger`): version, cursor, jobs."""
        return self.ledger.data

    @property
    def new_links(self) -> dict[str, str]:
        """Job id -> flow run id of the runs the batch being written has created so far."""
        return dict(self._writer.links) if self._writer is not None else {}

    # ------------------------------------------------------------------ Prefect client

    async def _prefect(self) -> FlowRunWriter:
        from prefect.client.orchestration import PrefectClient
        from prefect.settings import PREFECT_API_AUTH_STRING

        loop = asyncio.get_running_loop()
        if self._client is not None and self._client_loop is not loop:
            self._client, self._writer = None, None  # bound to a loop that is gone (asyncio.run per call)
        if self._client is None or self._writer is None:
            # An explicit api= ignores the settings' auth: pass the basic auth apiary up gave us.
            client = PrefectClient(api=self.prefect_api_url, auth_string=PREFECT_API_AUTH_STRING.value())
            await client.__aenter__()
            self._client, self._client_loop = client, loop
            self._writer = FlowRunWriter(client, self.ledger, self.source, settle_after_s=self.settle_after_s)
        return self._writer

    async def aclose(self) -> None:
        """Close the Prefect client (the bridge may be used again afterwards)."""
        client, self._client, self._writer = self._client, None, None
        if client is not None and self._client_loop is asyncio.get_running_loop():
            with contextlib.suppress(Exception):
                await client.__aexit__(None, None, None)

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
                writer = await self._prefect()
                while True:
                    limit = self.catch_up_batch_size if self._behind else self.batch_size
                    events = await self.source.events(self.cursor, limit=limit)
                    self._behind = len(events) >= limit
                    if not events:
                        break
                    done += await self._process_batch(writer, events)
                    self.ledger.save()
                await self._flush_leftovers(writer)
                await self._flush_artifacts(writer)
                await writer.settle()
                await self._watch_cancels(writer)
                self.ledger.prune()
                self.ledger.save()
                self._mark_up()
            except Exception as exc:
                if not is_transient(exc):
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

    def _settings(self) -> Any:
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

    async def _process_batch(self, writer: FlowRunWriter, events: list[dict]) -> int:
        """Record one batch in the jobs' records, then write it to Prefect (:meth:`_flush`).

        All or nothing: when a write fails transiently the touched records are restored, the
        cursor stays, and the whole batch is done again on the next call (every write is safe to
        repeat: flow runs by idempotency key, task run states by event id; log lines may repeat).
        Returns the number of events processed.
        """
        out = Out()
        before: dict[str, str | None] = {}
        for raw in events:
            job_id = raw.get("jobId")
            if isinstance(job_id, str) and job_id not in before:
                before.update(self.ledger.snapshot([job_id]))
            try:
                await self._apply(read_event(raw), out)
            except Exception as exc:
                if is_transient(exc):
                    self.ledger.restore(before)
                    raise
                logger.error("event skipped seq=%s job=%s type=%s error=%r", raw.get("seq"), job_id, raw.get("type"),
                             exc)
                if isinstance(job_id, str) and job_id and isinstance(raw.get("seq"), int):
                    self.ledger.job(job_id)["lastSeq"] = raw["seq"]
        try:
            # Not behind (fewer events than a full batch): the summaries queued so far go out with
            # this batch. Under a steady stream a read rarely comes back empty, and waiting for one
            # held them back (at 20 jobs/s, 1,100 of 1,200 until the stream stopped).
            await self._flush(writer, out, summaries=not self._behind)
        except Exception as exc:
            if is_transient(exc):
                self.ledger.restore(before)
            raise
        self.ledger.cursor = events[-1]["seq"]
        return len(events)

    async def _apply(self, ev: JobEvent, out: Out) -> None:
        """Record one event in its job's record and ``out``; nothing is written to Prefect here.
        An event already recorded (``seq <= lastSeq``: a replay) changes nothing."""
        job = self.ledger.job(ev.job_id)
        if ev.seq <= job["lastSeq"]:
            return
        if job.get("done"):
            job["lastSeq"] = ev.seq
            return
        out.touched[ev.job_id] = job
        if not isinstance(ev.body, Submitted) and not job.get("submitted"):
            await self._bootstrap(job, ev, out)
        self.recorder.apply(out, job, ev)
        job["lastSeq"] = ev.seq

    async def _bootstrap(self, job: dict, ev: JobEvent, out: Out) -> None:
        """The bridge missed ``job.submitted`` (its state was lost): rebuild it from the job."""
        job_id = ev.job_id
        try:
            info = await self.source.job(job_id)
        except NotFoundError:
            info = {"user": job_id.split("~")[0], "name": job_id.split("~")[-1]}

        def text(key: str) -> str | None:
            return None if info.get(key) is None else str(info[key])

        body = Submitted(text("user"), text("name"), text("virtualCluster"), text("priorityClass"), text("flowRunId"))
        self.recorder.apply(out, job, JobEvent(0, ev.time, job_id, EventType.SUBMITTED, body))

    async def _flush_leftovers(self, writer: FlowRunWriter) -> None:
        """States a failed write left wanted, and the new output of running instances."""
        out = Out()
        for job_id, job in self.ledger.jobs.items():
            if job.get("want"):
                out.touched[job_id] = job
        self.recorder.collect_running_output(out, self.ledger.jobs)
        if not out.touched and not out.ships:
            return
        before = self.ledger.snapshot({*out.touched, *(s[0] for s in out.ships)})
        try:
            await self._flush(writer, out)
        except Exception as exc:
            if is_transient(exc):
                self.ledger.restore(before)
            raise

    async def _flush(self, writer: FlowRunWriter, out: Out, summaries: bool = False) -> None:
        """Read the batch's finished output from Apiary and write what the batch recorded, flow
        run states first.

        1. Each touched job's flow run: created (in the state the job has now, one request) or
           set to the wanted state; ``concurrency`` jobs at a time (``catch_up_concurrency``
           while behind). This is what the UI lists.
           Meanwhile the output of the instances ``out.ships`` names is read from Apiary
           (:meth:`_ship_output`): the two wait on different servers, so neither waits for the
           other.
        2. Then, at once: the new runs' ids to Apiary in one ``PUT /api/v2/flowRuns``; every task
           run change of the batch as ``prefect.task-run.*`` events in ONE ``POST /events`` (how
           Prefect's own task engine reports task runs; the server's task run recorder writes
           them); every log row in one ``POST /logs/`` per 500 rows.
        3. Summary artifacts of finished jobs are queued in the state file for
           :meth:`_flush_artifacts`; with ``summaries`` those queued by earlier batches go out in
           step 2.

        Every step runs to its end before a failure is raised (:func:`~apiary.tracking.transient.together`),
        so a batch that is redone never races a write of its first try.
        """
        sem = asyncio.Semaphore(self.catch_up_concurrency if self._behind else self.concurrency)
        client = writer.client

        async def one(job_id: str, job: dict) -> None:
            async with sem:
                await busy_retry(lambda: writer.flush_run(job_id, job))

        async def runs() -> None:
            await together(*(one(j, job) for j, job in out.touched.items()))

        writer.links = {}
        await together(runs(), self._ship_output(out))

        async def links() -> None:
            if not writer.links:
                return
            # The new runs' ids go to Apiary in one request, not one per job. A transient failure
            # redoes the batch, whose runs the idempotency keys bring back with the same ids.
            try:
                unknown = await self.source.set_flow_runs(dict(writer.links))
            except Exception as exc:
                if is_transient(exc):
                    raise
                # Refused for good: the runs stay mirrored, Apiary just does not show their ids.
                logger.error("flow run ids not recorded in Apiary jobs=%s error=%r", len(writer.links), exc)
                unknown = []
            if unknown:
                logger.warning("flow runs of jobs Apiary does not know: %s", ", ".join(unknown))

        async def task_runs() -> None:
            # A task run opened and closed in the same batch is sent once, in its last state (its
            # start time still says when it opened).
            last = {tr["id"]: (job, tr, ch) for job, tr, ch in out.task_changes if job.get("flowRunId")}
            events = [task_event(job, tr, ch) for job, tr, ch in last.values()]
            if events:
                await busy_retry(lambda: client.request("POST", "/events", json=events))

        async def logs() -> None:
            rows = [{**row, "flow_run_id": job["flowRunId"]} for job, row in out.logs if job.get("flowRunId")]
            for batch in _batches(rows):
                await busy_retry(functools.partial(client.create_logs, batch))

        async def queued_summaries() -> None:
            if summaries:
                await self._flush_artifacts(writer)

        await together(links(), task_runs(), logs(), queued_summaries())

        # Summaries go out with the next batch that finds the bridge not behind (or after the
        # pass): while it catches up the runs' states go first. Kept in the state file until sent.
        for job, a in out.artifacts:
            if job.get("flowRunId"):
                self.ledger.queue_artifact({**a, "flow_run_id": job["flowRunId"]})

    async def _flush_artifacts(self, writer: FlowRunWriter, most: int = 50) -> None:
        """Send up to ``most`` queued summary artifacts (``concurrency`` at a time), then forget
        them: a batch that finds the bridge not behind (fewer events than it asked for) sends a
        few, so they never hold back the next batch's states for long. Same request as
        client.create_artifact(), without its client-side "artifact created" event: that would
        open a second (websocket) connection."""
        chunk = self.ledger.artifacts(most)
        if not chunk:
            return
        sem = asyncio.Semaphore(self.concurrency)

        async def one(a: dict) -> None:
            async with sem:
                try:
                    await busy_retry(lambda: writer.client.request("POST", "/artifacts/", json=a))
                except Exception as exc:
                    if is_transient(exc):
                        raise
                    logger.error("summary artifact dropped key=%s error=%r", a.get("key"), exc)

        await asyncio.gather(*(one(a) for a in chunk))
        self.ledger.drop_artifacts(len(chunk))

    async def _watch_cancels(self, writer: FlowRunWriter) -> None:
        """Cancel in the UI stops the job (at most every ``cancel_poll_s``; see
        :meth:`~apiary.tracking.flowruns.FlowRunWriter.watch_cancels`)."""
        now = time.monotonic()
        if now - self._cancel_checked < self.cancel_poll_s:
            return
        self._cancel_checked = now
        since = self._cancel_after or datetime.now(UTC)
        self._cancel_after = datetime.now(UTC)
        await writer.watch_cancels(since)

    async def _ship_output(self, out: Out) -> None:
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
            self.recorder.take_output(out, *item, stream=stream, off=off, text=text)


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


async def run_bridge(api_url: str, prefect_api_url: str, state_path: Path, concurrency: int = 2,
                     catch_up_concurrency: int | None = None) -> None:
    """The ``prefect-bridge`` process of ``apiary up``: mirror ``api_url``'s jobs into
    ``prefect_api_url`` until cancelled (SIGTERM/SIGINT end it through asyncio.run).
    ``concurrency``: jobs written at once (2 for a SQLite-backed server, which answers 503 to
    more; ``apiary up`` gives a PostgreSQL-backed one 4, and 8 while behind:
    ``catch_up_concurrency``)."""
    from apiary.tracking.source import HttpEventSource

    bridge = PrefectBridge(HttpEventSource(api_url), prefect_api_url, Path(state_path), concurrency=concurrency,
                           catch_up_concurrency=catch_up_concurrency)
    await bridge.run_forever()
