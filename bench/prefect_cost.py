"""What one mirrored job costs a Prefect server, by request strategy (a profiling aid, not in run.py).

Starts a private PostgreSQL (tests/pg.py) or uses SQLite, then for each strategy a fresh Prefect
server (``apiary.tracking.prefect_server.start_prefect_server``) and writes ``--jobs`` synthetic
jobs into it the way a bridge would, with ``--concurrency`` jobs in flight and jobs taken in
chunks of ``--chunk`` (what one event batch of the bridge holds). Nothing of Apiary runs: this
isolates the Prefect side. It prints, per strategy, the requests per job, jobs/s, and CPU
milliseconds per job of the server, of PostgreSQL and of the client (this process).

Strategies (the requests of one plain job, ``submitted -> placed -> started -> exited(0) ->
completed``):

* ``current``: what ``PrefectBridge`` sent before it batched its writes (the run created RUNNING
  "Submitted", a batch's flow run states coalesced, ~1.9 set_state per job, event lines flushed
  once per job per batch, ~3 log requests per job, one request per task run change): flow run
  (Pending), task runs ``submit`` (Completed) and ``queue`` (Running) created, ``queue`` closed,
  ``placement`` created, a table artifact, ``run-main`` created, flow run Running, one stdout log
  row, ``run-main`` closed, ``complete`` created, a markdown artifact, the event log lines (one
  request per job), flow run Completed: 14 requests.
* ``states``: flow run states only: created Pending, Running, Completed (3 requests).
* ``states-running``: created directly Running, then Completed (2 requests: a job already running
  when the bridge first sees it).
* ``states-final``: created directly Completed (1 request: a job already over when first seen).
* ``events``: about what the bridge sends now: ``states`` plus every task run state as a Prefect
  event (``prefect.task-run.*``, as Prefect's own task engine reports task runs; the server's task
  run recorder writes them), all events of a chunk in ONE ``POST /api/events``, all log rows of a
  chunk (every job's) in ONE ``POST /api/logs/``, the summary artifact only (3 + 1 per job + 2 per
  chunk).
* ``events-nosummary``: ``events`` without the artifact.
* ``bridge-final``: what the bridge sends for a job it first sees over (most jobs once the rate is
  high enough that a batch spans a job's life): the run created directly Completed (1 request),
  its two task runs (``queue``, ``run-main``) as one event each in their last state, six log
  rows (events and output lines), all of a chunk batched as above, and the summary artifact
  (1 + 1 per job + 2 per chunk): the floor of what one mirrored job costs the server today.
* ``bridge-final-nosummary``: ``bridge-final`` without the summary artifact (what the artifact's
  request costs is the difference).

    .venv/bin/python bench/prefect_cost.py --jobs 300 --concurrency 2 --concurrency 8 \
        --strategy current --strategy states --strategy events
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil

BENCH_DIR = Path(__file__).resolve().parent
for p in (str(BENCH_DIR.parent / "platform"), str(BENCH_DIR)):
    if p not in sys.path:
        sys.path.insert(0, p)

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="prefect-cost-client-"))

import lifecycle  # noqa: E402  (bench/, on sys.path above)


@dataclass
class _TaskShape:
    """The attributes ``PrefectClient.create_task_run`` reads from a ``prefect.Task`` (there is no
    Python function to wrap)."""

    task_key: str
    tags: list[str] = field(default_factory=list)
    version: str | None = None
    retries: int = 0
    retry_delay_seconds: int = 0
    retry_jitter_factor: float | None = None


STRATEGIES = (
    "current", "states", "states-running", "states-final", "events", "events-nosummary", "bridge-final",
    "bridge-final-nosummary",
)


_cpu = lifecycle.cpu_seconds


def _tree(pid: int | None) -> list[psutil.Process]:
    return [] if pid is None else lifecycle._tree(pid, True)


async def mirror(api: str, strategy: str, jobs: int, concurrency: int, chunk: int) -> float:
    """Write ``jobs`` synthetic jobs; returns the wall time."""
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.actions import ArtifactCreate, FlowRunCreate
    from prefect.client.schemas.objects import TaskRun
    from prefect.states import Completed, Pending, Running, State, StateType, to_state_create

    from apiary.tracking.flowruns import EVENT_TASK_RUN_EXCLUDE

    async with PrefectClient(api=api) as client:
        flow_id = await client.create_flow_from_name("apiary-job")
        stamp = uuid.uuid4().hex[:6]
        sem = asyncio.Semaphore(concurrency)
        tags = ["apiary", "user:bench", "vc:default"]

        def now() -> str:
            return datetime.now(UTC).isoformat()

        async def create_flow_run(job: str, state=None) -> uuid.UUID:
            create = FlowRunCreate(
                flow_id=flow_id,
                name=job,
                parameters={},
                tags=tags,
                labels={"apiary.job": job, "apiary.user": "bench"},
                state=to_state_create(state or Pending(message="submitted")),
                idempotency_key=f"apiary:{job}:1",
            )
            resp = await client.request("POST", "/flow_runs/", json=create.model_dump(mode="json", exclude_unset=True))
            return uuid.UUID(resp.json()["id"])

        async def task(fr: uuid.UUID, job: str, step: str, state) -> uuid.UUID:
            tid = uuid.uuid5(uuid.NAMESPACE_URL, f"{job}#{step}")
            await client.create_task_run(
                _TaskShape(task_key=f"apiary.{step}", tags=[*tags, "attempt:0"]),
                fr,
                dynamic_key=f"1:{step}",
                id=tid,
                name=step,
                state=state,
            )
            return tid

        def artifact(fr: uuid.UUID, tid: uuid.UUID | None, job: str, kind: str) -> dict:
            a = ArtifactCreate(
                key=f"{kind}-{job.replace('~', '-')}",
                type="markdown",
                description=f"{kind} of {job}",
                data=f"# {job}: SUCCEEDED\n\n| attempt | taskRole | index | node | gpus | exitCode |\n"
                "|---|---|---|---|---|---|\n| 0 | main | 0 | bench-node-001 | [0] | 0 |",
                flow_run_id=fr,
                task_run_id=tid,
            )
            return a.model_dump(mode="json", exclude_unset=True)

        def log(fr: uuid.UUID, msg: str) -> dict:
            return {
                "name": "apiary.events",
                "level": 20,
                "message": msg,
                "timestamp": now(),
                "flow_run_id": str(fr),
                "task_run_id": None,
            }

        def task_event(fr: uuid.UUID, job: str, step: str, stype: str, name: str, msg: str) -> dict:
            tid = uuid.uuid5(uuid.NAMESPACE_URL, f"{job}#{step}")
            state = State(type=StateType(stype), name=name, message=msg)
            tr = TaskRun(
                id=tid,
                name=step,
                flow_run_id=fr,
                task_key=f"apiary.{step}",
                dynamic_key=f"1:{step}",
                tags=[*tags, "attempt:0"],
                state=state,
            )
            return {
                "id": str(uuid.uuid4()),
                "occurred": state.timestamp.isoformat(),
                "event": f"prefect.task-run.{name}",
                "resource": {
                    "prefect.resource.id": f"prefect.task-run.{tid}",
                    "prefect.resource.name": step,
                    "prefect.state-message": msg,
                    "prefect.state-name": name,
                    "prefect.state-timestamp": state.timestamp.isoformat(),
                    "prefect.state-type": stype,
                    "prefect.orchestration": "client",
                },
                "related": [{"prefect.resource.id": f"prefect.flow-run.{fr}", "prefect.resource.role": "flow-run"}]
                + [{"prefect.resource.id": f"prefect.tag.{t}", "prefect.resource.role": "tag"} for t in sorted(tags)],
                "payload": {
                    "intended": {"from": None, "to": stype},
                    "initial_state": None,
                    "validated_state": {"type": stype, "name": name, "message": msg, "state_details": {}, "data": None},
                    "task_run": tr.model_dump(mode="json", exclude_none=True, exclude=EVENT_TASK_RUN_EXCLUDE),
                },
            }

        async def job_current(job: str) -> None:
            async with sem:
                fr = await create_flow_run(job)
                await task(fr, job, "submit", Completed(message="submitted"))
                q = await task(fr, job, "queue", Running(name="Waiting", message="waiting"))
                await client.set_task_run_state(q, Completed(message="placed"), force=True)
                pl = await task(fr, job, "placement", Completed(message="placed"))
                await client.request("POST", "/artifacts/", json=artifact(fr, pl, job, "placement"))
                rm = await task(fr, job, "run-main", Running(message="main running"))
                await client.set_flow_run_state(fr, Running(message="main/0 started"), force=True)
                await client.create_logs([log(fr, "[main/0] hi")])
                await client.set_task_run_state(rm, Completed(message="exit 0"), force=True)
                cp = await task(fr, job, "complete", Completed(message="SUCCEEDED"))
                await client.request("POST", "/artifacts/", json=artifact(fr, cp, job, "job"))
                await client.create_logs([log(fr, f"event {i}") for i in range(5)])
                await client.set_flow_run_state(fr, Completed(message="job SUCCEEDED"), force=True)

        async def job_states(job: str) -> uuid.UUID:
            async with sem:
                fr = await create_flow_run(job)
                await client.set_flow_run_state(fr, Running(message="main/0 started"), force=True)
                await client.set_flow_run_state(fr, Completed(message="job SUCCEEDED"), force=True)
                return fr

        async def job_coalesced(job: str) -> uuid.UUID:
            async with sem:
                # Already complete when first seen: one request.
                if strategy in ("states-final", "bridge-final", "bridge-final-nosummary"):
                    return await create_flow_run(job, Completed(message="job SUCCEEDED"))
                fr = await create_flow_run(job, Running(message="main/0 started"))
                await client.set_flow_run_state(fr, Completed(message="job SUCCEEDED"), force=True)
                return fr

        t0 = time.monotonic()
        for start in range(0, jobs, chunk):
            names = [f"bench~{stamp}-{i:05d}" for i in range(start, min(jobs, start + chunk))]
            if strategy == "current":
                await asyncio.gather(*(job_current(j) for j in names))
                continue
            if strategy in ("states-running", "states-final"):
                await asyncio.gather(*(job_coalesced(j) for j in names))
                continue
            if strategy.startswith("bridge-final"):
                # What the bridge sends for a job it first sees over (most of them at 50 jobs/s): the
                # run created final, its two task runs in their last states, its log rows, a summary.
                frs = await asyncio.gather(*(job_coalesced(j) for j in names))
                events = []
                logs = []
                for job, fr in zip(names, frs, strict=True):
                    events += [task_event(fr, job, "queue", "COMPLETED", "Completed", "placed"),
                               task_event(fr, job, "run-main", "COMPLETED", "Completed", "exit 0")]
                    logs += [log(fr, "[main/0] hi"), *(log(fr, f"event {i}") for i in range(5))]
                await client.request("POST", "/events", json=events)
                await client.create_logs(logs)
                if strategy == "bridge-final-nosummary":
                    continue

                async def final_summary(job: str, fr: uuid.UUID) -> None:
                    async with sem:
                        await client.request("POST", "/artifacts/", json=artifact(fr, None, job, "job"))

                await asyncio.gather(*(final_summary(j, f) for j, f in zip(names, frs, strict=True)))
                continue
            frs = await asyncio.gather(*(job_states(j) for j in names))
            if strategy == "states":
                continue
            events: list[dict] = []
            logs: list[dict] = []
            for job, fr in zip(names, frs, strict=True):
                events += [
                    task_event(fr, job, "submit", "COMPLETED", "Completed", "submitted"),
                    task_event(fr, job, "queue", "RUNNING", "Waiting", "waiting"),
                    task_event(fr, job, "queue", "COMPLETED", "Completed", "placed"),
                    task_event(fr, job, "placement", "COMPLETED", "Completed", "placed"),
                    task_event(fr, job, "run-main", "RUNNING", "Running", "main running"),
                    task_event(fr, job, "run-main", "COMPLETED", "Completed", "exit 0"),
                    task_event(fr, job, "complete", "COMPLETED", "Completed", "SUCCEEDED"),
                ]
                logs += [log(fr, "[main/0] hi"), *(log(fr, f"event {i}") for i in range(5))]
            await client.request("POST", "/events", json=events)
            await client.create_logs(logs)
            if strategy == "events":

                async def summary(job: str, fr: uuid.UUID) -> None:
                    async with sem:
                        await client.request("POST", "/artifacts/", json=artifact(fr, None, job, "job"))

                await asyncio.gather(*(summary(j, f) for j, f in zip(names, frs, strict=True)))
        return time.monotonic() - t0


async def count_task_runs(api: str, state_type: str | None = None) -> int:
    from prefect.client.orchestration import PrefectClient

    body = {"task_runs": {"state": {"type": {"any_": [state_type]}}}} if state_type else {}
    async with PrefectClient(api=api) as c:
        return int((await c.request("POST", "/task_runs/count", json=body)).json())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--concurrency", type=int, action="append")
    ap.add_argument("--strategy", choices=STRATEGIES, action="append")
    ap.add_argument("--database", choices=("postgresql", "sqlite"), default="postgresql")
    ap.add_argument("--server-env", action="append", default=[], help="KEY=VALUE for the Prefect server (repeatable)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import prefect_lag

    from apiary.tracking.prefect_server import start_prefect_server

    pg = prefect_lag.Postgres() if args.database == "postgresql" else None
    settings = dict(kv.split("=", 1) for kv in args.server_env)
    try:
        for strategy in args.strategy or ["current", "states", "events"]:
            for conc in args.concurrency or [2, 8]:
                home = Path(tempfile.mkdtemp(prefix="prefect-cost-"))
                db = None
                if pg is not None:
                    from sqlalchemy.engine import make_url

                    from apiary.tracking.prefect_server import prefect_database_url

                    apiary_url = pg.database(f"cost_{strategy.replace('-', '_')}_{conc}_{int(time.time())}")
                    db = prefect_database_url(apiary_url)
                    pg._pg.create_database(pg.url, make_url(db).database)
                with prefect_lag.Trace(True) as trace:
                    srv = start_prefect_server(home, database_url=db, timeout_s=120, settings=settings)
                try:
                    time.sleep(3)
                    server = _tree(srv.pid)
                    pgp = _tree(pg.pid()) if pg else []
                    me = [psutil.Process()]
                    # The server's idle CPU (its services' loops), subtracted below.
                    i0 = _cpu(server)
                    time.sleep(5)
                    idle_per_s = (_cpu(server) - i0) / 5
                    c0 = (_cpu(server), _cpu(pgp), _cpu(me, children=False))
                    t0, w0 = time.monotonic(), time.time()
                    wall = asyncio.run(mirror(srv.api_url, strategy, args.jobs, conc, args.chunk))
                    # Wait for the task run recorder (it may lag behind the requests), then 6 s more:
                    # it and the event persister flush every 5 s. Its CPU counts for the strategy.
                    per_job = 2 if strategy.startswith("bridge-final") else 5
                    want = 0 if strategy.startswith("states") else per_job * args.jobs
                    deadline = time.monotonic() + 120
                    while asyncio.run(count_task_runs(srv.api_url)) < want and time.monotonic() < deadline:
                        time.sleep(1)
                    recorded_after = time.monotonic() - t0
                    time.sleep(6)
                    span = time.monotonic() - t0
                    server, pgp = _tree(srv.pid), (_tree(pg.pid()) if pg else [])
                    c1 = (_cpu(server), _cpu(pgp), _cpu(me, children=False))
                    w1 = time.time()
                    tr = asyncio.run(count_task_runs(srv.api_url))
                    done = asyncio.run(count_task_runs(srv.api_url, "COMPLETED"))
                    n = args.jobs
                    reqs = [r for r in trace.requests(w0, w1) if "/health" not in r[2]]
                    by: dict[str, int] = {}
                    for r in reqs:
                        by[f"{r[1]} {r[2]}"] = by.get(f"{r[1]} {r[2]}", 0) + 1
                    server_ms = (c1[0] - c0[0] - idle_per_s * span) * 1000 / n
                    print(
                        f"{args.database} strategy={strategy:<17} concurrency={conc:<2} jobs={n} wall={wall:6.1f}s "
                        f"jobs/s={n / wall:6.1f} requests/job={len(reqs) / n:5.2f} cpu ms/job: server="
                        f"{server_ms:5.0f} (idle {idle_per_s * 1000:.0f} ms/s subtracted) "
                        f"postgres={(c1[1] - c0[1]) * 1000 / n:4.0f} client={(c1[2] - c0[2]) * 1000 / n:4.0f}; "
                        f"server-side ms/request p50="
                        f"{sorted(r[4] for r in reqs)[len(reqs) // 2] * 1000 if reqs else 0:.1f}; "
                        f"task runs recorded {tr} ({tr / n:.1f}/job, {done} Completed) after {recorded_after:.1f} s"
                        f"{' ' + str(settings) if settings else ''}",
                        flush=True,
                    )
                    print("    " + ", ".join(f"{k}: {v / n:.2f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])))
                finally:
                    srv.stop()
    finally:
        if pg is not None:
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
