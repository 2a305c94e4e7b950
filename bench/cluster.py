"""Cluster benchmark: one control plane against N hollow nodes (kubemark-style, apiary.runtime.hollow).

:func:`measure_hollow` starts, on loopback of this one machine:

* a private PostgreSQL server (tests/pg.py: the replicated control plane's store; fsync off, as the
  other benchmarks run it) or, with ``database="sqlite"``, the control plane's SQLite file;
* ``apiary control-plane`` as a subprocess, in a temporary home with a generated HiveD cluster of N
  nodes x 8 GPUs (bench/scheduler.py's ``cluster_config``: racks of 40 nodes, 4 VCs owning 40/30/20/10 %),
  whose bootstrap writes one agent token per node into ``home/credentials``;
* N hollow node agents in ``processes`` subprocesses (``python -m apiary.cli.hollow --shard K/M``),
  every node heartbeating and long-polling as a real agent does;

then measures, in phases: the control plane's CPU while idle, then under a stream of 1-GPU
``sleep`` jobs at a fixed rate, then the submission rate of 4 clients submitting as fast as they can
(the hollow nodes beating all along); and afterwards reads the hollow agents' own latencies and the
``job.placed`` events. Everything is stopped in ``finally``. Runs alone too (prints, writes nothing):

    .venv/bin/python bench/cluster.py --nodes 1000 [--processes 1] [--sqlite] [--profile FILE]
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import yaml

_BENCH = Path(__file__).resolve().parent
REPO_ROOT = _BENCH.parent
for _p in (str(REPO_ROOT / "platform"), str(_BENCH)):  # run alone: python bench/cluster.py
    if _p not in sys.path:
        sys.path.insert(0, _p)

from apiary.client import ApiaryClient  # noqa: E402
from apiary.errors import ApiaryError  # noqa: E402
from apiary.runtime.hollow import BARE, RUNS  # noqa: E402

logger = logging.getLogger("bench.cluster")

GPUS_PER_NODE = 8
BENCH_USER = "bench"
#: The benchmark submits far faster than the per-user limits allow (600 calls/min by default).
UNLIMITED = {"APIARY_RATE_CALLS": "10000000/minute", "APIARY_RATE_SUBMITS": "10000000/hour"}
IDLE_S = 20.0
STREAM_RATE, STREAM_S = 20.0, 30.0
JOB_SLEEP_S = 5.0
BURST_JOBS, BURST_CLIENTS = 400, 4
SUBMIT_TIMEOUT_S = 30.0  # a submission not answered by then counts as an error
BURST_MAX_S = 30.0  # no burst submission starts later than this
SETTLE_S = 5.0  # after every node is ready, before the idle window: the start-up storm passes
#: The fleet's agent settings (APIARY_AGENT_HEARTBEAT_S / APIARY_AGENT_LONG_POLL_S): Kubernetes' kubelet
#: renews its node lease every 10 s (a quarter of the 40 s lease), and its watches last minutes; the
#: assignments API allows a 60 s long poll. A 2 s heartbeat (the one-machine default) from 5,000 nodes
#: is 2,500 reports/s, more than this 2-core machine can send and answer at once.
HEARTBEAT_S, LONG_POLL_S = 10.0, 60.0
#: APIARY_NODE_LOST_AFTER_S: kube-controller-manager's --node-monitor-grace-period (40 s).
NODE_LOST_AFTER_S = 40.0


def percentile(values: list[float], p: float) -> float | None:
    """Linear-interpolation percentile (numpy's default) of ``values``, ``p`` in [0, 100]; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(values_s: list[float], p: float) -> float | None:
    v = percentile(values_s, p)
    return None if v is None else round(v * 1000, 1)


def cluster_yaml(nodes: int) -> str:
    """The HiveD config of ``nodes`` 8-GPU nodes (bench/scheduler.py's generator), as YAML."""
    import scheduler

    return yaml.safe_dump(scheduler.cluster_config(nodes), sort_keys=False)


def vcs_of(nodes: int) -> list[str]:
    import scheduler

    return [vc for vc, share in scheduler.VC_SHARES.items() if int(nodes * share) > 0]


def job_yaml(name: str, vc: str, sleep_s: float) -> str:
    """One task role, one instance, 1 GPU, ``sleep <sleep_s>`` (a hollow node's timer), in ``vc``."""
    return f"""\
protocolVersion: 2
name: {name}
type: job
prerequisites:
  - protocolVersion: 2
    name: img
    type: dockerimage
    uri: python:3.11-slim
taskRoles:
  main:
    instances: 1
    dockerImage: img
    resourcePerInstance: {{cpu: 1, memoryMB: 1024, gpu: 1}}
    commands:
      - sleep {sleep_s:g}
defaults:
  virtualCluster: {vc}
"""


def _pg_module():
    """tests/pg.py (the test suite's private-server helper), loaded by path."""
    spec = importlib.util.spec_from_file_location("apiary_bench_pg", REPO_ROOT / "tests" / "pg.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` (a gone process counts 0), with their reaped children's
    (PostgreSQL's backends that ended: the postmaster reaps them)."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def _postgres_procs(port: int | None) -> list[psutil.Process]:
    """The postmaster listening on ``port`` and its backends."""
    if port is None:
        return []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if cmd and cmd[0].endswith("postgres") and "-p" in cmd and str(port) in cmd:
            try:
                return [p, *p.children(recursive=True)]
            except psutil.Error:
                return [p]
    return []


class CpuWindow:
    """CPU cores (CPU seconds / wall seconds) of groups of processes over one window."""

    def __init__(self, groups: dict[str, object]) -> None:
        self.groups = groups  # name -> callable returning the group's processes now
        self.t0 = time.monotonic()
        self.c0 = {k: cpu_s(f()) for k, f in groups.items()}  # type: ignore[operator]

    def cores(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        return {k: round((cpu_s(f()) - self.c0[k]) / wall, 3) for k, f in self.groups.items()}  # type: ignore[operator]


@dataclass
class Submissions:
    """Accepted submissions' client-side latencies (s), job ids, errors and the wall time."""

    latencies: list[float] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def submit_jobs(api: str, token: str, names: list[str], vcs: list[str], sleep_s: float, *, clients: int,
                rate: float | None, deadline_s: float) -> Submissions:
    """POST one job per name with ``clients`` threads (one keep-alive :class:`ApiaryClient` each),
    round-robin over ``vcs``; at ``rate`` per second (job i not before i/rate s after the start) or,
    with ``rate`` None, as fast as they answer. No submission starts after ``deadline_s`` (a control
    plane slower than the rate ends the run with fewer jobs: the achieved rate says so). A latency:
    ``perf_counter`` around ``submit``."""
    res = Submissions()
    lock = threading.Lock()
    it = iter(enumerate(names))
    cs = [ApiaryClient(api, timeout=SUBMIT_TIMEOUT_S, token=token) for _ in range(clients)]
    t0 = time.perf_counter()

    def worker(c: ApiaryClient) -> None:
        while True:
            with lock:
                nxt = next(it, None)
            if nxt is None:
                return
            i, name = nxt
            if time.perf_counter() - t0 > deadline_s:
                return
            if rate:
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            s = time.perf_counter()
            try:
                job = c.submit(job_yaml(name, vcs[i % len(vcs)], sleep_s))
            except Exception as e:
                with lock:
                    res.errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                res.latencies.append(time.perf_counter() - s)
                res.ids.append(job["id"])

    try:
        with cf.ThreadPoolExecutor(clients) as pool:
            list(pool.map(worker, cs))
        res.wall_s = time.perf_counter() - t0
    finally:
        for c in cs:
            c.close()
    for e in res.errors[:3]:
        logger.warning("submit failed: %s", e)
    return res


@dataclass
class Deployment:
    """The control plane (and PostgreSQL) of one run; :meth:`stop` ends all."""

    home: Path
    api: str
    proc: subprocess.Popen
    pg_port: int | None
    pg_stop: object | None
    startup_s: float
    log: Path
    hollow: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        for p in [*self.hollow, self.proc]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*self.hollow, self.proc]:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        if self.pg_stop is not None:
            self.pg_stop()  # type: ignore[operator]


def start_control_plane(root: Path, nodes: int, database: str, profile: Path | None = None,
                        timeout_s: float = 600.0, auth_cache_ttl_s: float | None = None,
                        leader_elect: bool = False, node_lost_after_s: float = NODE_LOST_AFTER_S) -> Deployment:
    """PostgreSQL (``database="postgresql"``) or SQLite, and ``apiary control-plane`` on a free
    loopback port in ``root/home`` with a generated ``nodes``-node cluster; returns once ``/healthz``
    answers (the bootstrap has written every agent token by then). ``profile``: run the control
    plane under ``cProfile`` writing there on exit (SIGTERM). ``auth_cache_ttl_s``: an experiment, not
    the product: the control plane's verified-token cache kept that long instead of its 5 s.
    ``leader_elect``: ``APIARY_LEADER_ELECT`` (off by default here: with it on, a leader whose lease
    renewal starves under the fleet's load steps down and exits for its supervisor to restart, and
    this benchmark has no supervisor; measured at 5,000 nodes, see bench/README.md)."""
    home = root / "home"
    home.mkdir(mode=0o700)
    (home / "cluster.yaml").write_text(cluster_yaml(nodes))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "PREFECT_"))},
           "APIARY_HOME": str(home), "PYTHONUNBUFFERED": "1", **UNLIMITED,
           "APIARY_LEADER_ELECT": "true" if leader_elect else "false",
           "APIARY_NODE_LOST_AFTER_S": str(node_lost_after_s)}
    pg_port, pg_stop = None, None
    if database == "postgresql":
        pg = _pg_module()
        url, pg_stop = pg.start_postgres(str(root))
        from sqlalchemy.engine import make_url

        pg_port = make_url(url).port
        env["APIARY_DATABASE_URL"] = pg.create_database(url, "apiary_cluster_bench")
    elif database != "sqlite":
        raise ValueError(f"database must be postgresql or sqlite, not {database!r}")
    port = _free_port()
    log = root / "control-plane.log"
    cmd = [sys.executable, "-m", "apiary", "control-plane", "--port", str(port)]
    if profile is not None or auth_cache_ttl_s is not None:
        cmd = [sys.executable, str(_BENCH / "cluster.py"), "--profiled-control-plane", str(profile or ""),
               "--port", str(port), "--auth-cache-ttl", str(auth_cache_ttl_s or 0)]
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)
    api = f"http://127.0.0.1:{port}"
    dep = Deployment(home, api, proc, pg_port, pg_stop, 0.0, log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"control plane exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{api}/healthz", timeout=5).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"control plane not up after {timeout_s} s")
            time.sleep(0.3)
        dep.startup_s = time.monotonic() - t0
    except BaseException:
        dep.stop()
        raise
    return dep


def start_hollow(dep: Deployment, root: Path, processes: int, heartbeat_s: float = HEARTBEAT_S,
                 long_poll_s: float = LONG_POLL_S) -> list[Path]:
    """``processes`` hollow-node processes, shard K/M of every node each, beating every ``heartbeat_s``
    and long-polling up to ``long_poll_s``; returns their stats files."""
    stats = []
    for k in range(processes):
        path = root / f"hollow-{k}.json"
        log = root / f"hollow-{k}.log"
        cmd = [sys.executable, "-m", "apiary.cli.hollow", "--api", dep.api, "--shard", f"{k}/{processes}",
               "--credentials", str(dep.home / "credentials"), "--stats", str(path),
               "--heartbeat-s", str(heartbeat_s), "--long-poll-s", str(long_poll_s)]
        env = {**{k2: v for k2, v in os.environ.items() if not k2.startswith("APIARY_")}, "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            dep.hollow.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root))
        stats.append(path)
    return stats


def wait_ready(client: ApiaryClient, nodes: int, dep: Deployment, timeout_s: float) -> tuple[float, int]:
    """Poll ``GET /api/v2/nodes`` until every node is ready or ``timeout_s``: ``(seconds, most nodes
    seen ready at once)``. A control plane that cannot keep up loses nodes as others join (or does
    not answer the listing at all); the run then goes on with what it has (the figure says so).
    Raises when a hollow process died."""
    t0 = time.monotonic()
    best = 0
    ready = 0
    while True:
        try:
            ready = sum(1 for n in client.nodes() if n.get("ready"))
        except ApiaryError as e:  # an overloaded control plane drops a request now and then: ask again
            logger.warning("listing nodes failed: %s", e)
        best = max(best, ready)
        if ready >= nodes:
            return time.monotonic() - t0, ready
        for p in dep.hollow:
            if p.poll() is not None:
                raise RuntimeError(f"a hollow-node process exited {p.returncode} with {ready}/{nodes} ready")
        if time.monotonic() - t0 > timeout_s:
            logger.warning("only %d/%d hollow nodes ready at once within %.0f s; measuring anyway", best, nodes,
                           timeout_s)
            return time.monotonic() - t0, best
        time.sleep(1.0)


def wait_final(client: ApiaryClient, ids: list[str], timeout_s: float) -> dict[str, int]:
    """Poll until every job of ``ids`` is final or ``timeout_s``; returns their states counted."""
    want = set(ids)
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while True:
        try:
            states = {j["id"]: j["state"] for j in client.list(user=BENCH_USER) if j["id"] in want}
        except ApiaryError as e:  # an overloaded control plane: keep the last answer, ask again
            logger.warning("listing jobs failed: %s", e)
        final = [s for s in states.values() if s in ("SUCCEEDED", "FAILED", "STOPPED")]
        if len(final) == len(want) or time.monotonic() > deadline:
            counts: dict[str, int] = {}
            for s in states.values():
                counts[s] = counts.get(s, 0) + 1
            return counts
        time.sleep(1.0)


#: A run id: ``<job id>.a<attempt>.<task role>.<index>.t<task attempt>`` (apiary.lifecycle).
RUN_ID = re.compile(r"^(?P<job>.+)\.a(?P<attempt>\d+)\.(?P<role>[^.]+)\.(?P<index>\d+)\.t(?P<task_attempt>\d+)$")


def placed_at(client: ApiaryClient) -> dict[tuple[str, int, str, str], float]:
    """(job id, attempt, task role, index) -> the ``time`` of its first ``job.placed`` event (every
    event, paged)."""
    out: dict[tuple[str, int, str, str], float] = {}
    after = 0
    while True:
        try:
            page = client.events(after=after, limit=5000)
        except ApiaryError as e:
            logger.warning("reading events failed after seq %d: %s; delivery measured on what was read", after, e)
            return out
        if not page:
            return out
        for e in page:
            if e["type"] == "job.placed":
                for p in e["data"].get("placements", []):
                    key = (e["jobId"], int(e["data"].get("attempt", 0)), p["taskRole"], str(p["index"]))
                    out.setdefault(key, e["time"])
        after = page[-1]["seq"]


def _window(beats: list[tuple[float, float, str]], t0: float, t1: float, kind: str | None = None) -> list[float]:
    """Round trips (s) of the reports sent in ``[t0, t1)``, of ``kind`` only when given."""
    return [s for t, s, k in beats if t0 <= t < t1 and (kind is None or k == kind)]


def _report_figures(name: str, beats: list[tuple[float, float, str]], kind: str, measured: tuple[float, float],
                    windows: dict[str, tuple[float, float]]) -> dict:
    """``<name>_p50_ms``, ``_p99_ms``, ``_max_ms`` and ``_samples`` of the ``kind`` reports sent in
    ``measured`` (``[t0, t1)``, unix s), and ``<name>_<window>_p99_ms`` for each of ``windows``."""
    values = _window(beats, *measured, kind)
    out = {f"{name}_p50_ms": _ms(values, 50), f"{name}_p99_ms": _ms(values, 99), f"{name}_max_ms": _ms(values, 100),
           f"{name}_samples": len(values)}
    for window, (t0, t1) in windows.items():
        out[f"{name}_{window}_p99_ms"] = _ms(_window(beats, t0, t1, kind), 99)
    return out


def measure_hollow(nodes: int, *, processes: int = 1, database: str = "postgresql", idle_s: float = IDLE_S,
                   stream_rate: float = STREAM_RATE, stream_s: float = STREAM_S, job_sleep_s: float = JOB_SLEEP_S,
                   burst_jobs: int = BURST_JOBS, burst_clients: int = BURST_CLIENTS, profile: Path | None = None,
                   ready_timeout_s: float | None = None, auth_cache_ttl_s: float | None = None,
                   heartbeat_s: float = HEARTBEAT_S, long_poll_s: float = LONG_POLL_S,
                   keep: Path | None = None) -> dict:
    """One run at ``nodes`` hollow nodes; returns the ``cluster.hollow_<nodes>`` object (keys in
    bench/README.md). Raises when the deployment cannot start or a hollow process dies; waits for
    the nodes to be ready at most ``ready_timeout_s`` (default 120 s + 30 ms per node). ``keep``: a
    folder to copy the hollow processes' stats files to (every report's time and latency, every
    failed report's kind: :meth:`apiary.runtime.hollow.HollowReport.to_dict`)."""
    if ready_timeout_s is None:
        ready_timeout_s = 120.0 + 0.03 * nodes
    with tempfile.TemporaryDirectory(prefix="apiary-cluster-bench-") as tmp:
        root = Path(tmp)
        dep = start_control_plane(root, nodes, database, profile=profile, auth_cache_ttl_s=auth_cache_ttl_s)
        try:
            return _measure(dep, root, nodes, processes, database, idle_s, stream_rate, stream_s, job_sleep_s,
                            burst_jobs, burst_clients, ready_timeout_s, heartbeat_s, long_poll_s, keep)
        finally:
            dep.stop()
            # kept for a post-mortem: the temporary directory goes
            for log in (dep.log, *root.glob("hollow-*.log")):
                shutil.copyfile(log, Path(tempfile.gettempdir()) / f"apiary-cluster-bench-{nodes}-{log.name}")


def _measure(dep: Deployment, root: Path, nodes: int, processes: int, database: str, idle_s: float,
             stream_rate: float, stream_s: float, job_sleep_s: float, burst_jobs: int, burst_clients: int,
             ready_timeout_s: float, heartbeat_s: float, long_poll_s: float, keep: Path | None) -> dict:
    admin = ApiaryClient(dep.api, timeout=120, token=(dep.home / "token").read_text().strip())
    admin.create_user(BENCH_USER)
    token = admin.create_token(BENCH_USER, description="bench", expires_in_s=None)["token"]
    client = ApiaryClient(dep.api, timeout=120, token=token)
    cp = psutil.Process(dep.proc.pid)
    groups = {
        "leader": lambda: [cp],
        "postgres": lambda: _postgres_procs(dep.pg_port),
        "hollow": lambda: [psutil.Process(p.pid) for p in dep.hollow if p.poll() is None],
    }
    stats_paths = start_hollow(dep, root, processes, heartbeat_s, long_poll_s)
    t_hollow = time.monotonic()
    ready_s, ready_nodes = wait_ready(admin, nodes, dep, ready_timeout_s)
    logger.info("%d/%d hollow nodes ready after %.1f s", ready_nodes, nodes, ready_s)
    time.sleep(SETTLE_S)

    vcs = vcs_of(nodes)
    w = CpuWindow(groups)
    idle_t0 = time.time()
    time.sleep(idle_s)
    idle_t1 = time.time()
    idle = w.cores()
    logger.info("idle: %s", idle)

    w = CpuWindow(groups)
    n_stream = int(stream_rate * stream_s)
    stream = submit_jobs(dep.api, token, [f"stream-{i:05d}" for i in range(n_stream)], vcs, job_sleep_s,
                         clients=4, rate=stream_rate, deadline_s=stream_s + 5)
    stream_t1 = time.time()
    streaming = w.cores()
    logger.info("stream: %d jobs at %.1f/s, cpu %s", len(stream.ids), len(stream.ids) / stream.wall_s, streaming)

    w = CpuWindow(groups)
    burst = submit_jobs(dep.api, token, [f"burst-{i:05d}" for i in range(burst_jobs)], vcs, job_sleep_s,
                        clients=burst_clients, rate=None, deadline_s=BURST_MAX_S)
    burst_t1 = time.time()
    bursting = w.cores()
    logger.info("burst: %d jobs in %.1f s, cpu %s", len(burst.ids), burst.wall_s, bursting)

    ids = stream.ids + burst.ids
    states = wait_final(client, ids, timeout_s=job_sleep_s + 120)
    try:
        nodes_ready_end: int | None = sum(1 for n in admin.nodes() if n.get("ready"))
    except ApiaryError as e:
        logger.warning("listing nodes failed: %s", e)
        nodes_ready_end = None
    placed = placed_at(admin)
    for p in dep.hollow:
        p.send_signal(signal.SIGTERM)
    for p in dep.hollow:
        p.wait(timeout=120)
    hollow_wall = time.monotonic() - t_hollow
    beats: list[tuple[float, float, str]] = []
    received: dict[str, dict] = {}
    lag: list[float] = []
    errors: list[tuple[float, str]] = []
    hollow_cpu = 0.0
    gc_pauses: list[float] = []
    for path in stats_paths:
        d = json.loads(path.read_text())
        beats += [(t, s, kind) for _, t, s, kind in d["beats"]]
        received.update(d["received"])
        lag += [s for _, s in d["loopLag"]]
        errors += [(t, kind) for _, t, kind in d["reportErrors"]]
        hollow_cpu += d["cpuS"]
        gc_pauses += [s for _, _, s in d["gcPauses"]]
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, keep / path.name)
    windows = {"startup": (0.0, idle_t0), "idle": (idle_t0, idle_t1), "stream": (idle_t1, stream_t1),
               "burst": (stream_t1, burst_t1), "after": (burst_t1, float("inf"))}
    delivery = []
    mine = set(ids)
    for run_id, r in received.items():
        m = RUN_ID.match(run_id)
        if m is None or m["task_attempt"] != "0" or m["job"] not in mine:
            continue  # an in-place retry (t1, ...) is not a placement of its own
        key = (m["job"], int(m["attempt"]), m["role"], m["index"])
        if key in placed:
            delivery.append(r["at"] - placed[key])
    stream_ms = sorted(x * 1000 for x in stream.latencies)
    burst_ms = [x * 1000 for x in burst.latencies]
    out = {
        "nodes": nodes,
        "gpus": nodes * GPUS_PER_NODE,
        "database": database,
        "hollow_processes": processes,
        "leader_elect": False,
        "startup_s": round(dep.startup_s, 1),
        "ready_s": round(ready_s, 1),
        "ready_nodes": ready_nodes,
        "ready_nodes_at_end": nodes_ready_end,
        "leader_cpu_idle_cores": idle["leader"],
        "leader_cpu_stream_cores": streaming["leader"],
        "leader_cpu_burst_cores": bursting["leader"],
        "postgres_cpu_idle_cores": idle["postgres"],
        "postgres_cpu_stream_cores": streaming["postgres"],
        "hollow_cpu_idle_cores": idle["hollow"],
        "hollow_cpu_stream_cores": streaming["hollow"],
        **_report_figures("heartbeat", beats, BARE, (idle_t0, burst_t1),
                          {"idle": (idle_t0, idle_t1), "stream": (idle_t1, stream_t1), "burst": (stream_t1, burst_t1)}),
        **_report_figures("run_report", beats, RUNS, (idle_t0, burst_t1),
                          {"stream": (idle_t1, stream_t1), "burst": (stream_t1, burst_t1)}),
        # Both kinds together: what heartbeat_* measured until 2026-11-29 (bench/README.md).
        "report_p99_ms": _ms(_window(beats, idle_t0, burst_t1), 99),
        "report_burst_p99_ms": _ms(_window(beats, stream_t1, burst_t1), 99),
        "report_errors": len(errors),
        # Failed reports by window (startup: before the idle window, until every node was ready and
        # SETTLE_S more; after: while the jobs finished) and kind (HTTP status or exception class).
        "report_errors_by_window": {
            name: dict(Counter(kind for t, kind in errors if t0 <= t < t1).most_common())
            for name, (t0, t1) in windows.items()
        },
        "assignment_p50_ms": _ms(delivery, 50),
        "assignment_p99_ms": _ms(delivery, 99),
        "assignment_max_ms": _ms(delivery, 100),
        "assignment_samples": len(delivery),
        "stream_rate_per_s": round(len(stream.ids) / stream.wall_s, 1) if stream.wall_s else 0.0,
        "stream_submit_p50_ms": round(percentile(stream_ms, 50) or 0, 1),
        "stream_submit_p99_ms": round(percentile(stream_ms, 99) or 0, 1),
        "submit_per_s": round(len(burst.ids) / burst.wall_s, 1) if burst.wall_s else 0.0,
        "submit_p50_ms": round(percentile(burst_ms, 50) or 0, 1),
        "submit_p99_ms": round(percentile(burst_ms, 99) or 0, 1),
        "submit_errors": len(stream.errors) + len(burst.errors),
        "stream_jobs": len(stream.ids),
        "burst_jobs": len(burst.ids),
        "jobs_submitted": len(ids),
        "jobs_succeeded": states.get("SUCCEEDED", 0),
        "jobs_states": states,
        "hollow_loop_lag_p99_ms": _ms(lag, 99),
        # The hollow processes' cyclic-GC pauses of 5 ms or more (apiary.runtime.hollow.GcPauses).
        "hollow_gc_pauses": len(gc_pauses),
        "hollow_gc_pause_max_ms": _ms(gc_pauses, 100),
        "hollow_cpu_cores_mean": round(hollow_cpu / hollow_wall, 3) if hollow_wall else None,
        "settings": {"idle_s": idle_s, "stream_rate": stream_rate, "stream_s": stream_s, "job_sleep_s": job_sleep_s,
                     "burst_jobs": burst_jobs, "burst_clients": burst_clients, "settle_s": SETTLE_S,
                     "heartbeat_s": heartbeat_s, "long_poll_s": long_poll_s, "node_lost_after_s": NODE_LOST_AFTER_S},
    }
    admin.close()
    client.close()
    return out


SECTION_METHOD = ("hollow_<N>: one control plane against N hollow node agents on this one machine "
                  "(bench/cluster.py); what each figure is: hollow_<N>.method.")


def method(obj: dict) -> str:
    """What was measured for one ``cluster.hollow_<N>`` object, in sentences."""
    st = obj.get("settings") or {}
    db = {"postgresql": "a private PostgreSQL 15 server (fsync off)", "sqlite": "SQLite"}.get(obj.get("database", ""),
                                                                                           obj.get("database"))
    return (
        f"All on ONE machine ({os.cpu_count()} cores), over loopback, not separate hosts: one `apiary control-plane` "
        f"process (the leader; its store {db}) with a generated HiveD cluster of {obj.get('nodes')} nodes x 8 GPUs "
        f"(racks of 40, 4 VCs 40/30/20/10 %), and {obj.get('nodes')} hollow node agents "
        f"(apiary.runtime.hollow: NodeAgent over a timer backend, the real agent's HTTP calls, heartbeat every "
        f"{st.get('heartbeat_s')} s, assignments long poll of up to {st.get('long_poll_s')} s, node-lost grace "
        f"{st.get('node_lost_after_s')} s: Kubernetes' kubelet lease renewal and node-monitor grace) in "
        f"{obj.get('hollow_processes')} process(es), 25 agents to an aiohttp client (FleetClient). "
        f"After every node was ready and {st.get('settle_s')} s more: idle window {st.get('idle_s')} s; then a stream "
        f"of 1-GPU 'sleep {st.get('job_sleep_s')}' jobs at {st.get('stream_rate')}/s for {st.get('stream_s')} s "
        f"(4 paced REST clients; none started after {st.get('stream_s')} + 5 s); then a burst of up to "
        f"{st.get('burst_jobs')} such jobs by {st.get('burst_clients')} clients as fast as answered (none started "
        f"after {BURST_MAX_S:g} s). leader_cpu_*_cores: psutil user+system CPU seconds of the control-plane "
        "process / wall seconds of that window (1.0 = one core; postgres_* and hollow_* likewise for the "
        "postmaster with its backends and the hollow processes). heartbeat_*: every bare heartbeat a hollow agent "
        "sent (a status report without run statuses, output or cannotRecord), perf_counter from the start of "
        "NodeAgent._report_once to the parsed answer, over the idle + stream + burst windows (the hollow "
        "process's own event-loop delay included: hollow_loop_lag_p99_ms; hollow_gc_pause_max_ms: their longest "
        "cyclic-GC pause); run_report_*: the same for the status reports that carried run statuses or output "
        "(applied in a transaction under the plane's lock); report_p99_ms: both kinds together. report_errors: "
        "reports that failed, report_errors_by_window: by window (startup = the fleet joining) and kind. "
        "assignment_*: per task, time.time() when the hollow agent's long poll answer "
        "carrying the RUN assignment reached its reconcile minus the time of the job's job.placed event "
        "(GET /api/v2/events; the control plane's clock when its cycle placed it; same host, same clock). "
        "submit_per_s / submit_p*_ms: the burst's accepted submissions / its wall time, and client-side "
        "latency of each POST /api/v2/jobs; stream_submit_*: the same for the paced stream. jobs_succeeded: of "
        "jobs_submitted, SUCCEEDED when every job was final. Linear-interpolation percentiles."
    )


def _profiled_control_plane(out: Path | None, port: int, auth_cache_ttl_s: float) -> None:
    """``apiary control-plane --port PORT``, under cProfile (its event-loop thread) when ``out`` is
    given, the profile written there on SIGTERM; with ``auth_cache_ttl_s`` > 0, the user directory's
    token cache kept that long (an experiment: how much of the leader's time is token reads)."""
    import cProfile

    from apiary.cli.main import app

    if auth_cache_ttl_s > 0:
        from apiary.auth import directory

        init = directory.Directory.__init__

        def longer(self, sessions, *, clock=time.time, cache_ttl_s=5.0):  # type: ignore[no-untyped-def]
            init(self, sessions, clock=clock, cache_ttl_s=auth_cache_ttl_s)

        directory.Directory.__init__ = longer  # type: ignore[method-assign]
    prof = cProfile.Profile()

    def done(*_: object) -> None:
        if out is not None:
            prof.disable()
            prof.dump_stats(str(out))
        os._exit(0)

    signal.signal(signal.SIGTERM, done)
    if out is not None:
        prof.enable()
    try:
        app(["control-plane", "--port", str(port)])
    finally:
        done()


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--sqlite", action="store_true")
    ap.add_argument("--idle-s", type=float, default=IDLE_S)
    ap.add_argument("--stream-s", type=float, default=STREAM_S)
    ap.add_argument("--burst-jobs", type=int, default=BURST_JOBS)
    ap.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S)
    ap.add_argument("--long-poll-s", type=float, default=LONG_POLL_S)
    ap.add_argument("--profile", type=Path, help="cProfile the control plane into this file")
    ap.add_argument("--keep", type=Path, help="copy the hollow processes' stats files (every report) here")
    ap.add_argument("--auth-cache-ttl", type=float, help="experiment: the control plane's token cache TTL (s)")
    ap.add_argument("--profiled-control-plane", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.profiled_control_plane is not None:
        prof = str(args.profiled_control_plane)
        _profiled_control_plane(Path(prof) if prof not in ("", ".") else None, args.port, args.auth_cache_ttl or 0)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    r = measure_hollow(args.nodes, processes=args.processes, database="sqlite" if args.sqlite else "postgresql",
                       idle_s=args.idle_s, stream_s=args.stream_s, burst_jobs=args.burst_jobs,
                       profile=args.profile.resolve() if args.profile else None,
                       auth_cache_ttl_s=args.auth_cache_ttl, heartbeat_s=args.heartbeat_s,
                       long_poll_s=args.long_poll_s, keep=args.keep)
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
