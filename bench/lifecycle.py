"""Lifecycle benchmarks of the embedded platform (what ``apiary up`` runs).

Three measurements, each on its own fresh :class:`~apiary.embedded.Embedded` in a temporary
APIARY home, on loopback, with a generated HiveD cluster config of simulated nodes:

* :func:`measure_start_latency`: submit -> first task process spawned, on an idle cluster,
  one job at a time.
* :func:`measure_concurrent`: peak RSS of the platform's processes while N short 1-GPU jobs
  run at once, each mirrored to a Prefect flow run by the bridge.
* :func:`measure_queued_submissions`: the rate of submissions while a full cluster's queue grows to
  500 jobs (every submission wakes the scheduling loop, whose cycles walk the whole queue).

Every wait is bounded; the platform is always stopped in ``finally``.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import psutil

from apiary.client import ApiaryClient
from apiary.embedded import Embedded

logger = logging.getLogger("bench.lifecycle")

#: The user every benchmark submits as (created by start_platform, group default: every VC).
BENCH_USER = "bench"
#: The benchmarks measure throughput, not the per-user rate limiter: lift it far above any rate
#: they reach (the defaults, 600 calls/min and 3,600 submissions/h, would refuse them).
UNLIMITED = {"APIARY_RATE_CALLS": "10000000/minute", "APIARY_RATE_SUBMITS": "10000000/hour"}

FINAL_STATES = ("SUCCEEDED", "FAILED", "STOPPED")
# Processes summed for the RSS figure: (supervisor child, whether its descendants count).
# The agent's descendants are the tasks themselves (bash wrapper, bash script, the user's sleep),
# so only the agent process is counted; every other child counts with its whole process tree.
RSS_CHILDREN = (("control-plane", True), ("agent", False), ("prefect-bridge", True), ("prefect-serve", True))


# ---------------------------------------------------------------------- inputs
def cluster_config(nodes: int, gpus_per_node: int) -> str:
    """A HiveD config: ``nodes`` nodes of ``gpus_per_node`` GPUs, 3 cell levels (GPU -> node ->
    pool), one pool holding every node, one VC ``default`` owning all of them."""
    children = "\n".join(f"            - cellAddress: bench-node-{i:03d}" for i in range(nodes))
    return f"""\
hivedscheduler:
  config: |
    physicalCluster:
      skuTypes:
        GPU:
          gpu: 1
          cpu: 2
          memory: 4096Mi
      cellTypes:
        GPU-NODE:
          childCellType: GPU
          childCellNumber: {gpus_per_node}
          isNodeLevel: true
        GPU-NODE-POOL:
          childCellType: GPU-NODE
          childCellNumber: {nodes}
      physicalCells:
        - cellType: GPU-NODE-POOL
          cellChildren:
{children}
    virtualClusters:
      default:
        virtualCells:
          - cellType: GPU-NODE-POOL.GPU-NODE
            cellNumber: {nodes}
"""


def job_yaml(name: str, command: str, image: str = "python:3.11-slim") -> str:
    """An OpenPAI v2 job: one task role, one instance, 1 GPU, running ``command`` (in ``image``
    where the runtime runs containers)."""
    return f"""\
protocolVersion: 2
name: {name}
type: job
prerequisites:
  - protocolVersion: 2
    name: bench_image
    type: dockerimage
    uri: {image}
taskRoles:
  main:
    instances: 1
    dockerImage: bench_image
    resourcePerInstance:
      cpu: 1
      memoryMB: 1024
      gpu: 1
    commands:
      - {command}
defaults:
  virtualCluster: default
"""


def parse_iso(ts: str) -> float:
    """The API's ``2024-01-02T03:04:05.678Z`` (UTC, millisecond resolution) as unix seconds."""
    return datetime.strptime(ts.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``p`` in [0, 100]; ValueError when empty."""
    if not values:
        raise ValueError("no samples")
    return float(np.percentile(values, p))


# ---------------------------------------------------------------------- platform
@dataclass
class Platform:
    """A started Embedded in a temp home, with a client; :meth:`close` always stops it."""

    emb: Embedded
    client: ApiaryClient  # as user ``bench`` (group default: every VC), with bench_token
    tmp: tempfile.TemporaryDirectory
    startup_s: float = 0.0
    bench_token: str = ""

    def close(self) -> None:
        for name, child in self.emb.children.items():
            if child.restarts:
                try:
                    tail = child.log_path.read_bytes()[-600:].decode(errors="replace")
                except OSError:
                    tail = "<no log>"
                logger.warning("child %s restarted %d times; its log ends:\n%s", name, child.restarts, tail)
        try:
            self.client.close()
        finally:
            try:
                self.emb.stop()
            finally:
                defer_removal(self.tmp)


class Submitter:
    """``submit(i)`` submits bench job ``<prefix>-<i>`` (1 GPU, ``command``, as the user of
    ``token``: ``bench``) and returns its id, or None after logging a failure (the run goes on and
    counts it). Safe to call from a thread pool: one ApiaryClient per thread, all closed by
    :meth:`close`."""

    def __init__(self, api_url: str, token: str, prefix: str, command: str, width: int = 5) -> None:
        self.api_url, self.token, self.prefix, self.command, self.width = api_url, token, prefix, command, width
        self._local = threading.local()
        self._clients: list[ApiaryClient] = []
        self._lock = threading.Lock()

    def __call__(self, i: int) -> str | None:
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = ApiaryClient(self.api_url, timeout=120, token=self.token)
            with self._lock:
                self._clients.append(c)
        try:
            return c.submit(job_yaml(f"{self.prefix}-{i:0{self.width}d}", self.command))["id"]
        except Exception as e:  # counted and reported by the caller; the run goes on
            logger.warning("submit %d failed: %s", i, e)
            return None

    def close(self) -> None:
        with self._lock:
            for c in self._clients:
                c.close()
            self._clients.clear()


#: Directories of finished measurements, deleted when the bench process exits (defer_removal);
#: a TemporaryDirectory is kept here so that its finalizer does not delete it sooner.
_DEFERRED: list[tempfile.TemporaryDirectory | Path] = []


def _remove_deferred() -> None:
    while _DEFERRED:
        d = _DEFERRED.pop()
        shutil.rmtree(d if isinstance(d, Path) else d.name, ignore_errors=True)


def defer_removal(directory: tempfile.TemporaryDirectory | Path) -> None:
    """Delete ``directory`` when the bench process exits, not now.

    On a file system whose inode allocator skips recently deleted inodes (ext4 without a journal,
    this machine's root file system: the kernel's ``recently_deleted()``, inodes deleted in the
    last 60 s, 360 s while their table block is dirty), every file created steps over the inodes
    deleted shortly before in its block group. Removing a finished platform's home (tens of
    thousands of run records) therefore slowed the next measurement's task launches: an isolated
    launch's system CPU went from 1.7 to 5.1 ms right after 22,000 files were deleted
    (bench/README.md). Measurements pay for their own deletions, not their predecessor's."""
    if not _DEFERRED:
        atexit.register(_remove_deferred)
    _DEFERRED.append(directory)


def start_platform(
    nodes: int, gpus_per_node: int, *, prefect: bool, ready_timeout_s: float = 120.0, env: dict[str, str] | None = None,
    runtime: str = "process",
) -> Platform:
    """A started Embedded on a generated ``nodes`` x ``gpus_per_node`` cluster in a temp home, every
    node ready. ``env`` goes to its children (e.g. ``APIARY_DATABASE_URL`` for a PostgreSQL store)."""
    tmp = tempfile.TemporaryDirectory(prefix="apiary-bench-")
    root = Path(tmp.name)
    cfg = root / "cluster.yaml"
    cfg.write_text(cluster_config(nodes, gpus_per_node))
    workdir = root / "work"
    workdir.mkdir()
    emb = Embedded(home=root / "home", cluster=cfg, prefect=prefect, workdir=str(workdir),
                   env={**UNLIMITED, **(env or {})}, runtime=runtime)
    t0 = time.monotonic()
    client: ApiaryClient | None = None
    try:
        emb.start()
        emb.start_supervisor()
        admin = emb.client(timeout=60)
        admin.create_user(BENCH_USER)
        # The benchmarks submit thousands of jobs as one user: no expiry, and far above the
        # per-user rate limits (the children get APIARY_RATE_* from env).
        token = admin.create_token(BENCH_USER, description="bench", expires_in_s=None)["token"]
        admin.close()
        client = ApiaryClient(emb.api_url, timeout=60, token=token)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            ready = [n for n in client.nodes() if n.get("ready")]
            if len(ready) >= nodes:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(ready)}/{nodes} nodes ready after {ready_timeout_s} s")
            time.sleep(0.2)
    except BaseException:
        if client is not None:
            client.close()
        emb.stop()
        tmp.cleanup()
        raise
    return Platform(emb, client, tmp, time.monotonic() - t0, token)


def _tree(pid: int, with_children: bool) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)] if with_children else [p]
    except psutil.Error:
        return []


def cpu_seconds(procs: list[psutil.Process], children: bool = True) -> float:
    """User + system CPU seconds of ``procs`` (and of their reaped children when ``children``);
    a process that is gone counts 0."""
    s = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        s += t.user + t.system + ((t.children_user + t.children_system) if children else 0.0)
    return s


def platform_processes(emb: Embedded) -> dict[str, list[psutil.Process]]:
    """The processes whose RSS is summed, by component (see :data:`RSS_CHILDREN`)."""
    out: dict[str, list[psutil.Process]] = {}
    for name, with_children in RSS_CHILDREN:
        child = emb.children.get(name)
        if child is not None and child.proc is not None and child.proc.poll() is None:
            out[name] = _tree(child.proc.pid, with_children)
    if emb.prefect_server is not None and emb.prefect_server.alive():
        out["prefect-server"] = _tree(emb.prefect_server.pid, True)
    return out


def rss_mb(emb: Embedded) -> tuple[float, dict[str, float]]:
    total = 0.0
    parts: dict[str, float] = {}
    seen: set[int] = set()
    for name, procs in platform_processes(emb).items():
        mb = 0.0
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                mb += p.memory_info().rss / 2**20
            except psutil.Error:
                pass
        parts[name] = mb
        total += mb
    return total, parts


class RssSampler:
    """Samples :func:`rss_mb` every ``period_s`` in a thread; keeps the peak and its breakdown."""

    def __init__(self, emb: Embedded, period_s: float = 0.2) -> None:
        self.emb = emb
        self.period_s = period_s
        self.peak = 0.0
        self.peak_parts: dict[str, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total, parts = rss_mb(self.emb)
            self.samples += 1
            if total > self.peak:
                self.peak, self.peak_parts = total, parts
            self._stop.wait(self.period_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# ---------------------------------------------------------------------- start latency
@dataclass
class LatencyResult:
    samples: list[float] = field(default_factory=list)
    observed: list[float] = field(default_factory=list)  # client: before POST -> startTime seen
    prefect: bool = True
    nodes: int = 0
    gpus_per_node: int = 0

    def to_dict(self) -> dict:
        return {
            "start_latency_p50_s": round(statistics.median(self.samples), 4),
            "start_latency_p99_s": round(percentile(self.samples, 99), 4),
            "start_latency_samples": len(self.samples),
        }


def _wait_started(client: ApiaryClient, job_id: str, timeout_s: float, poll_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(job_id)
        tasks = job.get("tasks") or []
        if tasks and tasks[0].get("startTime"):
            return job
        if job["state"] in FINAL_STATES:
            raise RuntimeError(f"job {job_id} ended {job['state']} without a task start: {job}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} has no started task after {timeout_s} s (state {job['state']})")
        time.sleep(poll_s)


def measure_start_latency(
    samples: int = 100,
    *,
    nodes: int = 16,
    gpus_per_node: int = 8,
    prefect: bool = True,
    warmup: int = 2,
    settle_s: float = 5.0,
    per_job_timeout_s: float = 60.0,
    poll_s: float = 0.02,
) -> LatencyResult:
    """Submit ``samples`` 1-GPU ``sleep 0.2`` jobs one at a time; each latency is the task's
    agent-recorded spawn time (task JSON ``startTime``) minus the job's ``submissionTime``
    (control-plane clock at acceptance; same machine, same clock). The next job is submitted only
    once the previous one's task has started, so the cluster is idle apart from at most one
    finishing ``sleep 0.2``. ``warmup`` jobs are run first and not counted."""
    res = LatencyResult(prefect=prefect, nodes=nodes, gpus_per_node=gpus_per_node)
    plat = start_platform(nodes, gpus_per_node, prefect=prefect)
    try:
        logger.info("start_latency: platform up in %.1f s (prefect=%s)", plat.startup_s, prefect)
        time.sleep(settle_s)  # let the Prefect children finish importing / registering
        stamp = int(time.time())
        for i in range(warmup + samples):
            name = f"lat-{stamp}-{i:04d}"
            t_client = time.time()
            job = plat.client.submit(job_yaml(name, "sleep 0.2"))
            started = _wait_started(plat.client, job["id"], per_job_timeout_s, poll_s)
            t_seen = time.time()
            start = parse_iso(started["tasks"][0]["startTime"])
            if i < warmup:
                continue
            res.samples.append(start - parse_iso(started["submissionTime"]))
            res.observed.append(t_seen - t_client)
        return res
    finally:
        plat.close()


# ---------------------------------------------------------------------- concurrent footprint
@dataclass
class ConcurrentResult:
    jobs: int
    nodes: int
    gpus_per_node: int
    sleep_s: float
    peak_rss_mb: float = 0.0
    peak_parts: dict[str, float] = field(default_factory=dict)
    peak_running: int = 0
    flow_runs: int = 0
    flow_runs_final: int = 0
    submit_s: float = 0.0
    all_final_s: float = 0.0
    bridge_caught_up_s: float | None = None
    states: dict[str, int] = field(default_factory=dict)
    submit_errors: int = 0
    restarts: dict[str, int] = field(default_factory=dict)
    rss_samples: int = 0

    def to_dict(self) -> dict:
        return {
            "concurrent_1000_rss_mb": round(self.peak_rss_mb, 1),
            "concurrent_jobs": self.jobs,
            "concurrent_peak_running": self.peak_running,
            "flow_runs_created": self.flow_runs,
        }


def count_flow_runs(prefect_api_url: str, auth_string: str | None = None) -> tuple[int, int]:
    """(flow runs of flow ``apiary-job``, those of them in a final state) via Prefect's client;
    ``auth_string``: the server's basic auth (``Embedded.prefect_auth_string``)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    flows = FlowFilter(name=FlowFilterName(any_=["apiary-job"]))
    final = FlowRunFilter(
        state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED])
        )
    )

    async def go() -> tuple[int, int]:
        async with get_client() as c:
            return await c.count_flow_runs(flow_filter=flows), await c.count_flow_runs(
                flow_filter=flows, flow_run_filter=final
            )

    with temporary_settings(updates={PREFECT_API_URL: prefect_api_url, PREFECT_API_AUTH_STRING: auth_string}):
        return asyncio.run(go())


def measure_concurrent(
    jobs: int = 1000,
    *,
    nodes: int = 128,
    gpus_per_node: int = 8,
    sleep_s: float = 60.0,  # longer than submitting 1,000 jobs takes (~25 s), so all run at once
    submit_threads: int = 8,
    rss_period_s: float = 0.2,
    list_period_s: float = 1.0,
    finish_timeout_s: float = 600.0,
    bridge_timeout_s: float = 300.0,
    stall_s: float = 90.0,
    settle_s: float = 5.0,
) -> ConcurrentResult:
    """Submit ``jobs`` 1-GPU ``sleep <sleep_s>`` jobs as fast as ``submit_threads`` threads can
    through the API on a prefect=True Embedded; sample the platform's RSS (:func:`rss_mb`) every
    ``rss_period_s`` from just before the first submission until the bridge has caught up (or
    ``bridge_timeout_s``); count RUNNING tasks from ``GET /api/v2/jobs?state=RUNNING`` every
    ``list_period_s``; at the end count flow runs of ``apiary-job`` in Prefect."""
    res = ConcurrentResult(jobs=jobs, nodes=nodes, gpus_per_node=gpus_per_node, sleep_s=sleep_s)
    plat = start_platform(nodes, gpus_per_node, prefect=True)
    emb = plat.emb
    prefect_api = emb.prefect_server.api_url if emb.prefect_server else emb.prefect_api_url
    try:
        logger.info("concurrent: platform up in %.1f s", plat.startup_s)
        time.sleep(settle_s)
        submit = Submitter(emb.api_url, plat.bench_token, f"conc-{int(time.time())}", f"sleep {sleep_s:g}", width=4)

        with RssSampler(emb, rss_period_s) as sampler:
            t0 = time.monotonic()
            with cf.ThreadPoolExecutor(submit_threads, thread_name_prefix="submit") as pool:
                ids = [x for x in pool.map(submit, range(jobs)) if x]
            res.submit_s = time.monotonic() - t0
            res.submit_errors = jobs - len(ids)
            submit.close()
            logger.info("concurrent: %d jobs submitted in %.1f s", len(ids), res.submit_s)
            # Running count and completion, from the job list.
            deadline = t0 + finish_timeout_s
            wanted = set(ids)
            while True:
                running = plat.client.list(state="RUNNING")
                n = sum(1 for j in running for t in j["tasks"] if t["state"] == "RUNNING")
                res.peak_running = max(res.peak_running, n)
                if not running:
                    states: dict[str, int] = {}
                    for j in plat.client.list():
                        if j["id"] in wanted:
                            states[j["state"]] = states.get(j["state"], 0) + 1
                    res.states = states
                    if sum(states.get(s, 0) for s in FINAL_STATES) >= len(wanted):
                        break
                if time.monotonic() > deadline:
                    logger.warning("concurrent: jobs not all final after %.0f s", finish_timeout_s)
                    break
                time.sleep(list_period_s)
            res.all_final_s = time.monotonic() - t0
            logger.info("concurrent: all final after %.1f s (peak running %d)", res.all_final_s, res.peak_running)
            # The bridge catches up: every job a flow run, and every flow run final.
            # Bounded by bridge_timeout_s, and by stall_s without any progress (a bridge that is
            # crash-looping or wedged would otherwise hold the run for the whole timeout).
            deadline = time.monotonic() + bridge_timeout_s
            last, last_change = None, time.monotonic()
            last_log = time.monotonic()
            while True:
                try:
                    res.flow_runs, res.flow_runs_final = count_flow_runs(prefect_api, emb.prefect_auth_string)
                except Exception as e:  # Prefect busy: try again until the deadline
                    logger.warning("counting flow runs failed: %r", e)
                if res.flow_runs >= len(ids) and res.flow_runs_final >= len(ids):
                    res.bridge_caught_up_s = time.monotonic() - t0
                    break
                now = time.monotonic()
                if now - last_log >= 30:
                    last_log = now
                    logger.info("concurrent: %d flow runs, %d final", res.flow_runs, res.flow_runs_final)
                if (res.flow_runs, res.flow_runs_final) != last:
                    last, last_change = (res.flow_runs, res.flow_runs_final), now
                if now > deadline or now - last_change > stall_s:
                    logger.warning(
                        "bridge not caught up (%.0f s, %.0f s without progress): %d flow runs, %d final",
                        now - (deadline - bridge_timeout_s),
                        now - last_change,
                        res.flow_runs,
                        res.flow_runs_final,
                    )
                    break
                time.sleep(2.0)
        res.peak_rss_mb, res.peak_parts, res.rss_samples = sampler.peak, sampler.peak_parts, sampler.samples
        res.restarts = {name: c.restarts for name, c in emb.children.items()}
        return res
    finally:
        plat.close()


# ---------------------------------------------------------------------- submissions behind a queue
@dataclass
class QueuedResult:
    jobs: int
    shallow: list[float] = field(default_factory=list)  # submit latencies, queue depth 0..49
    deep: list[float] = field(default_factory=list)  # submit latencies, queue depth jobs-100..jobs-1
    cycles_ms_p50: float | None = None

    def to_dict(self) -> dict:
        return {
            "submit_per_s_queue_0_50": round(len(self.shallow) / sum(self.shallow), 1),
            f"submit_per_s_queue_{self.jobs - 100}_{self.jobs}": round(len(self.deep) / sum(self.deep), 1),
            f"submit_p99_s_queue_{self.jobs - 100}_{self.jobs}": round(percentile(self.deep, 99), 4),
        }


def measure_queued_submissions(jobs: int = 500, *, nodes: int = 2) -> QueuedResult:
    """Fill a ``nodes`` x 1-GPU cluster with ``sleep 600`` jobs, then submit ``jobs`` more 1-GPU jobs
    one at a time from one client (they all queue: the cluster stays full). Each latency is the
    client's wall time of one ``POST /api/v2/jobs`` (acceptance is a commit); the rates are
    submissions / summed latency over the first 50 and the last 100 submissions. Prefect is off:
    this measures the control plane's lock, not the bridge."""
    res = QueuedResult(jobs=jobs)
    plat = start_platform(nodes, 1, prefect=False)
    try:
        stamp = int(time.time())
        for i in range(nodes):
            plat.client.submit(job_yaml(f"hold-{stamp}-{i}", "sleep 600"))
        for i in range(jobs):
            t0 = time.perf_counter()
            plat.client.submit(job_yaml(f"q-{stamp}-{i:04d}", "sleep 1"))
            dt = time.perf_counter() - t0
            if i < 50:
                res.shallow.append(dt)
            elif i >= jobs - 100:
                res.deep.append(dt)
        return res
    finally:
        plat.close()
