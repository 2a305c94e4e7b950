"""How far the Prefect UI trails Apiary: the ``prefect`` benchmarks (bench/run.py --only prefect).

Two measurements, each on its own fresh :class:`~apiary.embedded.Embedded` (Prefect server,
bridge and serve included) in a temporary APIARY home, on loopback, with a generated simulated
cluster big enough that the tiny jobs (1 GPU, ``echo hi``) do not queue:

* :func:`measure_lag`: jobs submitted at a steady rate (20/s for 60 s); for every job, the time
  from an Apiary state change (its event's ``time`` in ``GET /api/v2/events``) to the matching
  Prefect flow run state's ``timestamp`` (the server's clock when it recorded the state, read
  from the state history, ``PrefectClient.read_flow_run_states``). Transitions: the first
  ``task.started`` -> the flow run's first state named ``Running`` (or terminal, if the bridge
  went straight there), and ``job.completed`` -> its first terminal state (``COMPLETED`` /
  ``FAILED`` / ``CANCELLED`` / ``CRASHED``); ``job.submitted`` -> the flow run's first state (RUNNING
  "Submitted", apiary.tracking.states) is recorded too but not pooled.
* :func:`measure_catch_up`: N jobs (1,000) submitted as fast as 8 threads can; from just before
  the first submission until every one of their flow runs is in a terminal state (the latest
  terminal state ``timestamp``, server clock; same machine, same clock).

The store (Apiary's) and Prefect's server run on ``database``: ``"postgresql"`` (a private
PostgreSQL server on loopback started here with tests/pg.py; Apiary on database ``<name>``,
Prefect on ``<name>_prefect``, as ``Embedded`` derives it) or ``"sqlite"`` (the zero-setup
default: both SQLite files in the home).

Measured alongside (:class:`CpuMeter`): CPU seconds of each platform process tree over the
measured phase. With ``trace=True`` the Prefect server also records every HTTP request it
served (bench/prefect_trace/sitecustomize.py): counts per endpoint and server-side latency.

Every wait is bounded; a transition whose Prefect state never showed up by the end counts with
the lag it had reached then (a lower bound) and is reported in ``missing``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import importlib.util
import json
import logging
import os
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import psutil

import lifecycle
from apiary.client import ApiaryClient
from apiary.tracking import states as tracking_states

logger = logging.getLogger("bench.prefect")

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
TRACE_HOOK_DIR = BENCH_DIR / "prefect_trace"
FLOW_NAME = "apiary-job"
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
#: The name of the flow run state an Apiary job that started shows (type RUNNING, like the first
#: state "Submitted" that the run gets when Apiary accepts the job).
RUNNING_NAME = tracking_states.running("").name
POOLED = ("running", "final")  # the transitions ui_lag_* is computed over
DATABASES = ("postgresql", "sqlite")

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


# ---------------------------------------------------------------------- PostgreSQL
def _pg_module():
    """tests/pg.py (the test suite's private-server helper), loaded by path."""
    spec = importlib.util.spec_from_file_location("apiary_bench_pg", REPO_ROOT / "tests" / "pg.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Postgres:
    """A private PostgreSQL server on loopback (tests/pg.py) for one benchmark run; :meth:`stop` ends it."""

    def __init__(self) -> None:
        self._pg = _pg_module()
        t0 = time.monotonic()
        # Its directory is removed when the bench exits (lifecycle.defer_removal says why).
        self.url, self._stop = self._pg.start_postgres(remove_dir=lifecycle.defer_removal)
        self.startup_s = time.monotonic() - t0
        from sqlalchemy.engine import make_url

        self.port = make_url(self.url).port

    def database(self, name: str) -> str:
        """URL of a new, empty database ``name``."""
        return self._pg.create_database(self.url, name)

    def pid(self) -> int | None:
        """The postmaster's pid (its backends are its children)."""
        for p in psutil.process_iter(["name", "cmdline"]):
            cmd = p.info.get("cmdline") or []
            if cmd and cmd[0].endswith("postgres") and "-p" in cmd and str(self.port) in cmd:
                return p.pid
        return None

    def stop(self) -> None:
        self._stop()


# ---------------------------------------------------------------------- CPU accounting
class CpuMeter:
    """CPU seconds (user + system) of each platform component between :meth:`start` and :meth:`stop`.

    Components are :func:`lifecycle.platform_processes` (control-plane tree, the agent process
    alone, prefect-bridge / prefect-serve / Prefect server trees) plus ``postgres`` (postmaster
    and backends) and ``bench`` (this process: submitters and pollers). A tree's time includes
    its reaped children (``children_user`` / ``children_system``), so backends and processes
    that ended in between count; the agent's children are the task processes and do not.
    """

    def __init__(self, emb, pg_pid: int | None) -> None:
        self.emb = emb
        self.pg_pid = pg_pid
        self.t0 = 0.0
        self.wall_s = 0.0
        self.start_cpu: dict[str, float] = {}
        self.cpu_s: dict[str, float] = {}

    def _procs(self) -> dict[str, tuple[list[psutil.Process], bool]]:
        out: dict[str, tuple[list[psutil.Process], bool]] = {
            name: (procs, name != "agent") for name, procs in lifecycle.platform_processes(self.emb).items()
        }
        if self.pg_pid is not None:
            out["postgres"] = (lifecycle._tree(self.pg_pid, True), True)
        out["bench"] = ([psutil.Process()], False)
        return out

    def snapshot(self) -> dict[str, float]:
        return {name: lifecycle.cpu_seconds(procs, kids) for name, (procs, kids) in self._procs().items()}

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.start_cpu = self.snapshot()

    def stop(self) -> None:
        self.wall_s = time.monotonic() - self.t0
        end = self.snapshot()
        self.cpu_s = {k: max(0.0, v - self.start_cpu.get(k, 0.0)) for k, v in end.items()}

    def to_dict(self) -> dict:
        return {
            "wall_s": round(self.wall_s, 1),
            "cpu_s": {k: round(v, 1) for k, v in sorted(self.cpu_s.items())},
            "cpu_share_of_one_core": {k: round(v / self.wall_s, 3) for k, v in sorted(self.cpu_s.items())}
            if self.wall_s
            else {},
        }


#: The processes ``cpu_ms_per_job`` counts: the platform's, not the bench's own client.
PLATFORM_PARTS = ("control-plane", "agent", "prefect-bridge", "prefect-serve", "prefect-server", "postgres")


class WindowMeter:
    """CPU seconds of :class:`CpuMeter`'s processes over a fixed window of a run (its steady
    part: after the ramp-up, before the tail), snapshotted by a timer thread at ``t0 + start_s``
    and ``t0 + end_s`` (monotonic ``t0``), with the wall-clock times of both snapshots so that the
    jobs finished inside the window can be counted afterwards."""

    def __init__(self, meter: CpuMeter, start_s: float, end_s: float) -> None:
        self.meter, self.start_s, self.end_s = meter, start_s, end_s
        self.snaps: list[tuple[float, dict[str, float]]] = []
        self._thread: threading.Thread | None = None

    def start(self, t0: float) -> None:
        def run() -> None:
            for at in (self.start_s, self.end_s):
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self.snaps.append((time.time(), self.meter.snapshot()))

        self._thread = threading.Thread(target=run, name="window-meter", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def result(self, finished_at: dict[str, float]) -> dict:
        """Per job CPU over the window. ``finished_at`` maps a job to when it was final in BOTH
        Apiary and Prefect (the later of ``job.completed``'s time and its flow run's first terminal
        state's timestamp); the jobs counted are those whose time falls inside the window."""
        if len(self.snaps) < 2:
            return {}
        (w0, a), (w1, b) = self.snaps
        cpu = {k: max(0.0, b[k] - a.get(k, 0.0)) for k in b}
        jobs = sum(1 for t in finished_at.values() if w0 <= t < w1)
        platform = sum(cpu.get(k, 0.0) for k in PLATFORM_PARTS)
        return {
            "window_s": round(w1 - w0, 1),
            "jobs_final": jobs,
            "cpu_ms_per_job": round(platform * 1000 / jobs, 1) if jobs else None,
            "by_process_ms_per_job": {k: round(v * 1000 / jobs, 1) for k, v in sorted(cpu.items())} if jobs else {},
            "cores_used": round(platform / (w1 - w0), 2) if w1 > w0 else None,
        }


def finished_both(events: list[dict], states: dict[str, list[tuple[str, str, float]]]) -> dict[str, float]:
    """Job id -> the later of its ``job.completed`` time and its flow run's first terminal state
    (jobs missing either are left out)."""
    done = {ev["jobId"]: float(ev["time"]) for ev in events if ev["type"] == "job.completed"}
    out: dict[str, float] = {}
    for j, t_apiary in done.items():
        t_pf = next((t for typ, _name, t in states.get(j, []) if typ in TERMINAL), None)
        if t_pf is not None:
            out[j] = max(t_apiary, t_pf)
    return out


# ---------------------------------------------------------------------- request trace
class Trace:
    """Turns the Prefect server's request trace on for the platforms started inside ``with``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.dir: Path | None = None
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> Trace:
        if self.enabled:
            self.dir = Path(tempfile.mkdtemp(prefix="apiary-prefect-trace-"))
            for k, v in {
                "APIARY_BENCH_PREFECT_TRACE": str(self.dir),
                "PYTHONPATH": os.pathsep.join(x for x in (str(TRACE_HOOK_DIR), os.environ.get("PYTHONPATH")) if x),
            }.items():
                self._saved[k] = os.environ.get(k)
                os.environ[k] = v
        return self

    def __exit__(self, *exc: object) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def requests(self, t_from: float, t_to: float) -> list[list]:
        """Requests that started in [t_from, t_to] (unix s)."""
        rows: list[list] = []
        if self.dir is None:
            return rows
        for f in self.dir.glob("requests-*.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if t_from <= r[0] <= t_to:
                    rows.append(r)
        return rows


def summarize_requests(rows: list[list], jobs: int, wall_s: float) -> dict:
    """Per endpoint (``METHOD /path``): count, per job, server-side p50 / p99 / total seconds."""
    by: dict[str, list[float]] = defaultdict(list)
    errors: dict[str, int] = defaultdict(int)
    for _t, method, path, status, dt in rows:
        key = f"{method} {path}"
        by[key].append(dt)
        if status >= 400:
            errors[key] += 1
    total = sum(len(v) for v in by.values())
    busy = sum(sum(v) for v in by.values())
    out: dict = {
        "requests": total,
        "requests_per_job": round(total / jobs, 2) if jobs else None,
        "requests_per_s": round(total / wall_s, 1) if wall_s else None,
        "server_busy_s": round(busy, 1),
        "endpoints": {},
    }
    for key, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        out["endpoints"][key] = {
            "count": len(v),
            "per_job": round(len(v) / jobs, 2) if jobs else None,
            "p50_ms": round(lifecycle.percentile(v, 50) * 1000, 1),
            "p99_ms": round(lifecycle.percentile(v, 99) * 1000, 1),
            "total_s": round(sum(v), 1),
            "errors": errors.get(key, 0),
        }
    return out


# ---------------------------------------------------------------------- Prefect reads
#: Prefect API URL -> its basic auth (``user:password``; apiary up protects its server).
_AUTH: dict[str, str | None] = {}


def _prefect_client(api: str):
    from prefect.client.orchestration import PrefectClient

    return PrefectClient(api=api, auth_string=_AUTH.get(api))


async def _read_runs(api: str) -> dict[str, object]:
    """Every flow run of flow ``apiary-job``, by name (= job id), with its current state."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    flows = FlowFilter(name=FlowFilterName(any_=[FLOW_NAME]))
    runs: dict[str, object] = {}
    async with _prefect_client(api) as c:
        offset = 0
        while True:
            page = await c.read_flow_runs(flow_filter=flows, sort=FlowRunSort.NAME_ASC, limit=200, offset=offset)
            for r in page:
                runs[r.name] = r
            if len(page) < 200:
                return runs
            offset += len(page)


async def _read_states(api: str, run_ids: list, concurrency: int = 4) -> dict:
    """State history of each flow run id: ``{id: [(type, name, timestamp unix s), ...]}`` oldest first."""
    sem = asyncio.Semaphore(concurrency)
    out: dict = {}
    async with _prefect_client(api) as c:

        async def one(rid) -> None:
            async with sem:
                states = await c.read_flow_run_states(rid)
            out[rid] = [(s.type.value, s.name, s.timestamp.timestamp()) for s in states]

        await asyncio.gather(*(one(r) for r in run_ids))
    return {k: sorted(v, key=lambda x: x[2]) for k, v in out.items()}


def read_flow_runs(api: str) -> dict[str, object]:
    return asyncio.run(_read_runs(api))


def read_states(api: str, run_ids: list) -> dict:
    return asyncio.run(_read_states(api, run_ids))


def _count(api: str) -> tuple[int, int]:
    return lifecycle.count_flow_runs(api, _AUTH.get(api))


# ---------------------------------------------------------------------- helpers
def stats(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "p50_s": round(lifecycle.percentile(values, 50), 3),
        "p99_s": round(lifecycle.percentile(values, 99), 3),
        "max_s": round(max(values), 3),
    }


class EventFeed:
    """Apiary's event log (``GET /api/v2/events``), read incrementally: cheap to poll."""

    def __init__(self, client: ApiaryClient) -> None:
        self.client = client
        self.events: list[dict] = []
        self.after = 0

    def poll(self) -> list[dict]:
        new: list[dict] = []
        while True:
            page = self.client.events(after=self.after, limit=1000)
            if not page:
                break
            new.extend(page)
            self.after = page[-1]["seq"]
            if len(page) < 1000:
                break
        self.events.extend(new)
        return new


def wait_jobs_final(feed: EventFeed, ids: set[str], timeout_s: float) -> tuple[float, dict[str, int]]:
    """Follow the event log until every job of ``ids`` has its ``job.completed``; returns
    (unix time seen, final states). Polls every 0.5 s (incremental reads: the job list of a
    thousand jobs would cost the control plane more than the benchmark measures)."""
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    for ev in feed.events:
        if ev["type"] == "job.completed" and ev["jobId"] in ids:
            states[ev["jobId"]] = str((ev.get("data") or {}).get("state"))
    while True:
        for ev in feed.poll():
            if ev["type"] == "job.completed" and ev["jobId"] in ids:
                states[ev["jobId"]] = str((ev.get("data") or {}).get("state"))
        if len(states) >= len(ids) or time.monotonic() > deadline:
            counts: dict[str, int] = defaultdict(int)
            for st in states.values():
                counts[st] += 1
            if len(states) < len(ids):
                counts["NOT_FINAL"] = len(ids) - len(states)
            return time.time(), dict(counts)
        time.sleep(0.5)


def wait_prefect_final(api: str, n: int, timeout_s: float, stall_s: float, what: str) -> tuple[int, int, bool]:
    """Poll Prefect every 2 s until ``n`` flow runs of ``apiary-job`` are terminal; bounded by
    ``timeout_s`` and by ``stall_s`` without progress. Returns (flow runs, terminal, complete)."""
    deadline = time.monotonic() + timeout_s
    last, last_change, last_log = None, time.monotonic(), time.monotonic()
    runs = final = 0
    while True:
        try:
            runs, final = _count(api)
        except Exception as e:  # busy server: try again until the deadline
            logger.warning("%s: counting flow runs failed: %r", what, e)
        if runs >= n and final >= n:
            return runs, final, True
        now = time.monotonic()
        if (runs, final) != last:
            last, last_change = (runs, final), now
        if now - last_log >= 20:
            last_log = now
            logger.info("%s: %d/%d flow runs, %d terminal", what, runs, n, final)
        if now > deadline or now - last_change > stall_s:
            logger.warning("%s: Prefect not caught up: %d flow runs, %d terminal of %d", what, runs, final, n)
            return runs, final, False
        time.sleep(2.0)


def _platform(db: str, nodes: int, gpus_per_node: int, pg: Postgres | None, tag: str) -> lifecycle.Platform:
    env: dict[str, str] = {}
    if db == "postgresql":
        assert pg is not None
        env["APIARY_DATABASE_URL"] = pg.database(f"bench_{tag}_{int(time.time())}")
    elif db != "sqlite":
        raise ValueError(f"database={db!r}: one of {DATABASES}")
    return lifecycle.start_platform(nodes, gpus_per_node, prefect=True, env=env)


def _prefect_api(emb) -> str:
    api = emb.prefect_server.api_url if emb.prefect_server else emb.prefect_api_url
    _AUTH[api] = emb.prefect_auth_string
    return api


# ---------------------------------------------------------------------- UI lag at a steady rate
@dataclass
class LagResult:
    database: str
    rate_per_s: float
    duration_s: float
    jobs: int = 0
    submitted: int = 0
    submit_errors: int = 0
    achieved_rate_per_s: float = 0.0
    states: dict[str, int] = field(default_factory=dict)
    lags: dict[str, list[float]] = field(default_factory=dict)
    missing: dict[str, int] = field(default_factory=dict)
    prefect_complete: bool = False
    apiary_final_after_s: float = 0.0
    prefect_final_after_s: float | None = None
    cpu: dict = field(default_factory=dict)
    steady: dict = field(default_factory=dict)
    requests: dict = field(default_factory=dict)
    startup_s: float = 0.0
    job_s: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        pooled = [x for k in POOLED for x in self.lags.get(k, [])]
        d = {
            "ui_lag_p50_s": round(lifecycle.percentile(pooled, 50), 3) if pooled else None,
            "ui_lag_p99_s": round(lifecycle.percentile(pooled, 99), 3) if pooled else None,
            "ui_lag_max_s": round(max(pooled), 3) if pooled else None,
            "ui_lag_samples": len(pooled),
            "ui_lag_missing": sum(self.missing.get(k, 0) for k in POOLED),
            "ui_lag_by_transition": {
                k: {**stats(v), "missing": self.missing.get(k, 0)} for k, v in sorted(self.lags.items())
            },
            "ui_lag_jobs": self.submitted,
            "ui_lag_rate_per_s": self.rate_per_s,
            "ui_lag_achieved_rate_per_s": round(self.achieved_rate_per_s, 2),
            "ui_lag_duration_s": self.duration_s,
            "ui_lag_apiary_final_after_s": round(self.apiary_final_after_s, 1),
            "ui_lag_prefect_final_after_s": None
            if self.prefect_final_after_s is None
            else round(self.prefect_final_after_s, 1),
            "ui_lag_complete": self.prefect_complete,
        }
        if self.cpu:
            d["ui_lag_cpu"] = self.cpu
        if self.steady:
            d["cpu_ms_per_job"] = self.steady.get("cpu_ms_per_job")
            d["ui_lag_steady"] = self.steady
        if self.job_s:
            d["ui_lag_job_s"] = stats(self.job_s)
        if self.requests:
            d["ui_lag_requests"] = self.requests
        return d


def job_lags(events: list[dict], states: dict[str, list[tuple[str, str, float]]], t_end: float) -> tuple[dict, dict]:
    """Per transition, each job's lag (Prefect state timestamp - Apiary event time) and how many
    never reached Prefect (their lag is ``t_end`` - event time, a lower bound).

    ``events`` are Apiary events (any order of jobs, each job's in seq order); ``states`` maps job
    id to its flow run's state history ``(type, name, timestamp)`` oldest first (absent: no flow
    run). Transitions (apiary.tracking.states is the mapping): ``created`` job.submitted -> the
    run's first state (RUNNING "Submitted"); ``running`` the first task.started -> the first state
    named "Running" or terminal (a bridge that coalesces a batch's states may go straight to the
    terminal one); ``final`` job.completed -> the first terminal state."""
    per_job: dict[str, dict[str, float]] = defaultdict(dict)
    for ev in events:
        j, kind, t = ev["jobId"], ev["type"], float(ev["time"])
        if kind == "job.submitted":
            per_job[j].setdefault("created", t)
        elif kind == "task.started":
            per_job[j].setdefault("running", t)
        elif kind == "job.completed":
            per_job[j]["final"] = t
    lags: dict[str, list[float]] = defaultdict(list)
    missing: dict[str, int] = defaultdict(int)
    for j, ts in per_job.items():
        hist = states.get(j, [])
        seen = {
            "created": next((t for _typ, _name, t in hist), None),
            "running": next(
                (t for typ, name, t in hist if (typ == "RUNNING" and name == RUNNING_NAME) or typ in TERMINAL), None
            ),
            "final": next((t for typ, _name, t in hist if typ in TERMINAL), None),
        }
        for k, t_ev in ts.items():
            t_pf = seen[k]
            if t_pf is None:
                missing[k] += 1
                lags[k].append(t_end - t_ev)
            else:
                lags[k].append(t_pf - t_ev)
    return dict(lags), dict(missing)


def job_durations(events: list[dict]) -> list[float]:
    """Each job's time in Apiary, seconds from its ``job.submitted`` to its ``job.completed``
    event (event times; jobs without both are left out)."""
    start: dict[str, float] = {}
    out: list[float] = []
    for ev in events:
        if ev["type"] == "job.submitted":
            start.setdefault(ev["jobId"], float(ev["time"]))
        elif ev["type"] == "job.completed" and ev["jobId"] in start:
            out.append(float(ev["time"]) - start[ev["jobId"]])
    return out


def measure_lag(
    rate_per_s: float = 20.0,
    duration_s: float = 60.0,
    *,
    database: str = "postgresql",
    nodes: int = 32,
    gpus_per_node: int = 8,
    command: str = "echo hi",
    submit_threads: int = 8,
    settle_s: float = 5.0,
    finish_timeout_s: float = 300.0,
    prefect_timeout_s: float = 600.0,
    stall_s: float = 120.0,
    trace: bool = False,
) -> LagResult:
    """Submit ``rate_per_s`` x ``duration_s`` 1-GPU ``command`` jobs at a steady pace (job i is
    handed to a pool of ``submit_threads`` client threads at t0 + i / rate), then wait until every
    job is final in Apiary and every flow run terminal in Prefect (bounded), and compute each
    job's lags (:func:`job_lags`) from the event log and the flow runs' state histories."""
    res = LagResult(database=database, rate_per_s=rate_per_s, duration_s=duration_s)
    n = int(round(rate_per_s * duration_s))
    res.jobs = n
    pg = Postgres() if database == "postgresql" else None
    try:
        with Trace(trace) as tr:
            plat = _platform(database, nodes, gpus_per_node, pg, "lag")
            try:
                res.startup_s = plat.startup_s
                emb = plat.emb
                api = _prefect_api(emb)
                logger.info("lag[%s]: platform up in %.1f s; prefect %s", database, plat.startup_s, api)
                time.sleep(settle_s)
                meter = CpuMeter(emb, pg.pid() if pg else None)
                submit = lifecycle.Submitter(emb.api_url, plat.bench_token, f"lag-{int(time.time())}", command)

                # The steady window: a quarter of the run in (ramp-up over) to 10 s before its end.
                window = WindowMeter(meter, duration_s * 0.25, max(duration_s * 0.5, duration_s - 10.0))
                meter.start()
                t_wall0 = time.time()
                t0 = time.monotonic()
                window.start(t0)
                with cf.ThreadPoolExecutor(submit_threads, thread_name_prefix="submit") as pool:
                    futs = []
                    for i in range(n):
                        delay = t0 + i / rate_per_s - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)
                        futs.append(pool.submit(submit, i))
                    ids = [x for x in (f.result() for f in futs) if x]
                submit_s = time.monotonic() - t0
                submit.close()
                res.submitted, res.submit_errors = len(ids), n - len(ids)
                if not ids:
                    raise RuntimeError(f"lag[{database}]: every one of {n} submissions failed")
                res.achieved_rate_per_s = len(ids) / submit_s if submit_s else 0.0
                logger.info(
                    "lag[%s]: %d jobs submitted in %.1f s (%.1f/s)",
                    database,
                    len(ids),
                    submit_s,
                    res.achieved_rate_per_s,
                )
                feed = EventFeed(plat.client)
                t_final, res.states = wait_jobs_final(feed, set(ids), finish_timeout_s)
                res.apiary_final_after_s = t_final - t_wall0
                logger.info("lag[%s]: Apiary final after %.1f s %s", database, res.apiary_final_after_s, res.states)
                _runs, _final, res.prefect_complete = wait_prefect_final(
                    api, len(ids), prefect_timeout_s, stall_s, f"lag[{database}]"
                )
                t_end = time.time()
                meter.stop()
                res.cpu = meter.to_dict()
                # Read both sides after the fact; the state timestamps are the server's own.
                wanted = set(ids)
                feed.poll()
                events = [e for e in feed.events if e["jobId"] in wanted]
                runs = {name: r for name, r in read_flow_runs(api).items() if name in wanted}
                hist = read_states(api, [r.id for r in runs.values()])
                by_job = {name: hist.get(r.id, []) for name, r in runs.items()}
                res.lags, res.missing = job_lags(events, by_job, t_end)
                res.job_s = job_durations(events)
                window.join()
                res.steady = window.result(finished_both(events, by_job))
                finals = [t for h in by_job.values() for typ, _name, t in h if typ in TERMINAL]
                if res.prefect_complete and finals:
                    res.prefect_final_after_s = max(finals) - t_wall0
            finally:
                plat.close()
            if trace:  # read after the server stopped: it flushes its trace on exit
                res.requests = summarize_requests(tr.requests(t_wall0, t_end), len(ids), t_end - t_wall0)
    finally:
        if pg is not None:
            pg.stop()
    return res


# ---------------------------------------------------------------------- catch-up of a burst
@dataclass
class CatchUpResult:
    database: str
    jobs: int
    submitted: int = 0
    submit_errors: int = 0
    submit_s: float = 0.0
    apiary_final_after_s: float = 0.0
    catch_up_s: float | None = None
    observed_s: float | None = None
    complete: bool = False
    flow_runs: int = 0
    terminal: int = 0
    states: dict[str, int] = field(default_factory=dict)
    cpu: dict = field(default_factory=dict)
    requests: dict = field(default_factory=dict)
    startup_s: float = 0.0

    def to_dict(self) -> dict:
        d = {
            f"catch_up_{self.jobs}_s": None if self.catch_up_s is None else round(self.catch_up_s, 1),
            "catch_up_jobs": self.submitted,
            "catch_up_complete": self.complete,
            "catch_up_flow_runs": self.flow_runs,
            "catch_up_terminal": self.terminal,
            "catch_up_submit_s": round(self.submit_s, 1),
            "catch_up_apiary_final_after_s": round(self.apiary_final_after_s, 1),
            "catch_up_jobs_per_s": round(self.terminal / self.catch_up_s, 2) if self.catch_up_s else None,
        }
        if self.cpu:
            d["catch_up_cpu"] = self.cpu
        if self.requests:
            d["catch_up_requests"] = self.requests
        return d


def measure_catch_up(
    jobs: int = 1000,
    *,
    database: str = "postgresql",
    nodes: int = 32,
    gpus_per_node: int = 8,
    command: str = "echo hi",
    submit_threads: int = 8,
    settle_s: float = 5.0,
    finish_timeout_s: float = 300.0,
    prefect_timeout_s: float = 900.0,
    stall_s: float = 120.0,
    trace: bool = False,
) -> CatchUpResult:
    """Submit ``jobs`` 1-GPU ``command`` jobs as fast as ``submit_threads`` threads can; the figure
    is the latest terminal flow run state timestamp minus the unix time just before the first
    submission, once every job has a terminal flow run (bounded: ``prefect_timeout_s``, or
    ``stall_s`` without progress; then the figure is the time given up at, a lower bound, and
    ``complete`` is false)."""
    res = CatchUpResult(database=database, jobs=jobs)
    pg = Postgres() if database == "postgresql" else None
    try:
        with Trace(trace) as tr:
            plat = _platform(database, nodes, gpus_per_node, pg, "catchup")
            try:
                res.startup_s = plat.startup_s
                emb = plat.emb
                api = _prefect_api(emb)
                logger.info("catch_up[%s]: platform up in %.1f s", database, plat.startup_s)
                time.sleep(settle_s)
                meter = CpuMeter(emb, pg.pid() if pg else None)
                submit = lifecycle.Submitter(emb.api_url, plat.bench_token, f"burst-{int(time.time())}", command)

                meter.start()
                t_wall0 = time.time()
                t0 = time.monotonic()
                with cf.ThreadPoolExecutor(submit_threads, thread_name_prefix="submit") as pool:
                    ids = [x for x in pool.map(submit, range(jobs)) if x]
                res.submit_s = time.monotonic() - t0
                submit.close()
                res.submitted, res.submit_errors = len(ids), jobs - len(ids)
                if not ids:
                    raise RuntimeError(f"catch_up[{database}]: every one of {jobs} submissions failed")
                logger.info("catch_up[%s]: %d jobs submitted in %.1f s", database, len(ids), res.submit_s)
                t_final, res.states = wait_jobs_final(EventFeed(plat.client), set(ids), finish_timeout_s)
                res.apiary_final_after_s = t_final - t_wall0
                logger.info(
                    "catch_up[%s]: Apiary final after %.1f s %s", database, res.apiary_final_after_s, res.states
                )
                res.flow_runs, res.terminal, res.complete = wait_prefect_final(
                    api, len(ids), prefect_timeout_s, stall_s, f"catch_up[{database}]"
                )
                t_end = time.time()
                res.observed_s = t_end - t_wall0
                meter.stop()
                res.cpu = meter.to_dict()
                wanted = set(ids)
                finals = [
                    r.state.timestamp.timestamp()
                    for name, r in read_flow_runs(api).items()
                    if name in wanted and r.state is not None and r.state.type.value in TERMINAL
                ]
                if res.complete and finals:
                    res.catch_up_s = max(finals) - t_wall0
                else:
                    res.catch_up_s = t_end - t_wall0  # a lower bound: not every flow run got there
            finally:
                plat.close()
            if trace:  # read after the server stopped: it flushes its trace on exit
                res.requests = summarize_requests(tr.requests(t_wall0, t_end), len(ids), t_end - t_wall0)
    finally:
        if pg is not None:
            pg.stop()
    return res


def method(section: dict) -> str:
    """One sentence per metric of the ``prefect`` section."""
    out = []
    db = section.get("database", "postgresql")
    store = (
        "Apiary's store and Prefect's server both on a private PostgreSQL server on loopback (tests/pg.py; "
        "Prefect on database '<apiary db>_prefect' with asyncpg, as Embedded derives it)"
        if db == "postgresql"
        else "Apiary's store and Prefect's server both on SQLite files in the home (the zero-setup default)"
    )
    if "ui_lag_p99_s" in section:
        out.append(
            f"ui_lag_p50_s/p99_s/max_s: {section.get('ui_lag_jobs')} 1-GPU 'echo hi' jobs submitted at "
            f"{section.get('ui_lag_rate_per_s')}/s for {section.get('ui_lag_duration_s')} s (job i handed to 8 "
            "REST client threads at t0 + i/rate) to a fresh embedded platform with Prefect (server, bridge, serve) "
            f"on a generated {section.get('nodes', 32)}-node x 8-GPU simulated cluster, {store}; per job, for the "
            "first task.started event -> the flow run's first state named 'Running' (or terminal, when the bridge "
            "went straight there) and the "
            "job.completed event -> its first terminal state (COMPLETED/FAILED/CANCELLED/CRASHED), lag = the "
            "Prefect state's timestamp (server clock, from the flow run's state history, "
            "PrefectClient.read_flow_run_states) minus the Apiary event's time "
            "(control-plane clock, GET /api/v2/events; same machine), pooled over both transitions, median / 99th "
            "percentile (linear interpolation) / max, read after every flow run was terminal (bounded at 600 s, or "
            "120 s without progress; a state that never appeared counts with the lag it had reached then and is in "
            "ui_lag_missing). ui_lag_by_transition also gives job.submitted -> first flow run state (created)."
        )
    if section.get("cpu_ms_per_job") is not None:
        out.append(
            "cpu_ms_per_job: the platform's processes (control-plane, agent, prefect-bridge, prefect-serve, "
            "prefect-server, postgres; not the bench) together, CPU seconds over the run's steady window (from a "
            "quarter of the submission time to 10 s before its end: 15-50 s of a 60 s run; snapshots by a timer "
            "thread) divided by the jobs whose later of job.completed and first terminal flow run state fell in "
            "that window (ui_lag_steady: window, jobs counted, the same per process, cores used). A platform that "
            "falls behind finishes fewer jobs in the window, so its figure rises with the backlog."
        )
    for rate_key in sorted(k for k in section if k.startswith("rate_") and isinstance(section[k], dict)):
        out.append(f"{rate_key}: the same UI lag run (keys as above) at {rate_key[5:]} jobs/s.")
    key = next((k for k in section if k.startswith("catch_up_") and k.endswith("_s") and k[9:-2].isdigit()), None)
    if key is not None:
        out.append(
            f"{key}: {section.get('catch_up_jobs')} 1-GPU 'echo hi' jobs submitted as fast as 8 REST client threads "
            f"could to a fresh platform of the same shape ({store}); from just before the first submission until "
            "every job's flow run was in a terminal state: the latest terminal state timestamp (server clock) "
            "minus the unix time before the first submission (catch_up_complete false: not all got there within "
            "900 s / 120 s without progress, and the figure is the time given up at, a lower bound)."
        )
    if any(k.endswith("_cpu") for k in section):
        out.append(
            "*_cpu: CPU seconds (user+system, reaped children included) of each process tree from the first "
            "submission until Prefect caught up (or gave up): control-plane, the agent process alone, "
            "prefect-bridge, prefect-serve, prefect-server, postgres (postmaster and backends), bench (this "
            "process); cpu_share_of_one_core = cpu_s / wall_s."
        )
    if any(k.endswith("_requests") for k in section):
        out.append(
            "*_requests (--prefect-profile): every HTTP request the Prefect server served over the same span, "
            "recorded by an ASGI middleware (bench/prefect_trace/sitecustomize.py): count and per job by "
            "endpoint (UUIDs replaced by {id}), server-side time from entering the app to the last response "
            "byte, p50/p99/total; requests of every client (bridge, serve, the benchmark's own polling every 2 s)."
        )
    return " ".join(out)
