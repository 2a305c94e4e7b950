"""API benchmarks of the control plane with tokens on (issue "Tenancy and security").

* :func:`measure_submit`: ``POST /api/v2/jobs`` throughput and latency, 4 REST clients at once,
  each with the ``bench`` user's bearer token, 500 submissions: first at an empty queue, then with
  1,000 jobs already queued. Every accepted job (202) must be in ``GET /api/v2/jobs`` afterwards.
  On an embedded platform on a generated 2-node x 1-GPU simulated cluster kept full, so every
  measured job stays queued.
* :func:`measure_hostile`: every request of the hostile corpus (tests/support/hostile.py: YAML
  bombs, oversized bodies, out-of-range numbers, ...) sent to a live server on the cluster the
  corpus assumes (Lab 6's two VCs), each timed until it is refused.

Each starts its own embedded platform (``prefect=False``: this measures the control plane, not the
bridge) in a temporary home, on loopback, always stopped in ``finally``. Runs alone too:
``.venv/bin/python bench/api_submit.py [--quick] [--hostile-only]`` (prints, writes nothing).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import logging
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import httpx
import psutil

_BENCH = Path(__file__).resolve().parent
for _p in (str(_BENCH.parent / "platform"), str(_BENCH)):  # run alone: python bench/api_submit.py
    if _p not in sys.path:
        sys.path.insert(0, _p)

from apiary.client import ApiaryClient  # noqa: E402
from lifecycle import (  # noqa: E402
    FINAL_STATES,
    Platform,
    cpu_seconds,
    job_yaml,
    percentile,
    platform_processes,
    start_platform,
)

logger = logging.getLogger("bench.api_submit")

REPO_ROOT = Path(__file__).resolve().parents[1]
HOSTILE = REPO_ROOT / "tests" / "support" / "hostile.py"

#: The cluster: 2 nodes x 1 GPU, both GPUs held by ``sleep 600`` jobs before anything is measured,
#: so every measured 1-GPU job stays WAITING (the queue really grows and the scheduling loop walks it).
NODES, GPUS_PER_NODE = 2, 1
HOLD_COMMAND = "sleep 600"
JOB_COMMAND = "sleep 600"  # never runs: the cluster stays full


# ---------------------------------------------------------------------- one run of submissions
@dataclass
class SubmitRun:
    """One run of ``submissions`` POSTs by ``threads`` clients; latencies in seconds."""

    submissions: int
    threads: int
    queue_before: int = 0
    settle_s: float = 0.0  # waited before the run: every queued job decided, the scheduling loop idle
    latencies: list[float] = field(default_factory=list)  # accepted submissions (202), client side
    ids: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds over the run, by process
    cycles: int = 0  # scheduling cycles the control plane ran during the run
    cycles_s: float = 0.0  # their summed duration

    def to_dict(self, prefix: str) -> dict:
        ms = sorted(x * 1000 for x in self.latencies)
        return {
            f"{prefix}_per_s": round(len(self.ids) / self.wall_s, 1) if self.wall_s > 0 else 0.0,
            f"{prefix}_p50_ms": round(percentile(ms, 50), 1),
            f"{prefix}_p99_ms": round(percentile(ms, 99), 1),
            f"{prefix}_max_ms": round(ms[-1], 1),
            f"{prefix}_wall_s": round(self.wall_s, 2),
            f"{prefix}_submissions": self.submissions,
            f"{prefix}_accepted": len(self.ids),
            f"{prefix}_errors": len(self.errors),
            f"{prefix}_queue_before": self.queue_before,
            f"{prefix}_settle_s": round(self.settle_s, 2),
            f"{prefix}_cycles": self.cycles,
            f"{prefix}_cycle_ms_mean": round(self.cycles_s * 1000 / self.cycles, 1) if self.cycles else None,
            # CPU per accepted submission, by process (control plane; the benchmark's own clients).
            **{f"{prefix}_cpu_ms_per_submit_{k}": round(v * 1000 / max(1, len(self.ids)), 2)
               for k, v in self.cpu_s.items()},
        }


def submit_run(api_url: str, token: str, prefix: str, submissions: int, threads: int,
               processes: dict[str, list[psutil.Process]] | None = None) -> SubmitRun:
    """``submissions`` jobs ``<prefix>-<i>`` (1 GPU, :data:`JOB_COMMAND`) POSTed by ``threads``
    threads, each with its own :class:`ApiaryClient` (one keep-alive connection) and ``token``.
    The threads start together (a barrier, after each client's first connection is open) and take
    the next index from a shared counter until all are sent. A latency is the client's
    ``perf_counter`` around ``ApiaryClient.submit`` (request, the 202, its JSON body parsed); the
    wall time runs from the barrier to the last answer. ``processes``: CPU seconds of each over the
    run go to ``cpu_s`` (the benchmark process itself is added as ``bench``)."""
    res = SubmitRun(submissions=submissions, threads=threads)
    clients = [ApiaryClient(api_url, timeout=120, token=token) for _ in range(threads)]
    for c in clients:
        c.health()  # open the connection outside the measurement
    lock = threading.Lock()
    next_i = iter(range(submissions))
    barrier = threading.Barrier(threads + 1)
    done_at: list[float] = []

    def worker(c: ApiaryClient) -> None:
        lat: list[float] = []
        ids: list[str] = []
        errs: list[str] = []
        barrier.wait()
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                break
            t0 = time.perf_counter()
            try:
                job = c.submit(job_yaml(f"{prefix}-{i:05d}", JOB_COMMAND))
            except Exception as e:  # counted, the run goes on
                errs.append(f"{type(e).__name__}: {e}")
                continue
            lat.append(time.perf_counter() - t0)
            ids.append(job["id"])
        t_end = time.perf_counter()
        with lock:
            res.latencies.extend(lat)
            res.ids.extend(ids)
            res.errors.extend(errs)
            done_at.append(t_end)

    pool = [threading.Thread(target=worker, args=(c,), name=f"submit-{k}") for k, c in enumerate(clients)]
    try:
        for t in pool:
            t.start()
        procs = {**(processes or {}), "bench": [psutil.Process()]}
        cpu0 = {k: cpu_seconds(v, children=False) for k, v in procs.items()}
        cycles0 = cycle_counts(api_url)
        barrier.wait()
        t0 = time.perf_counter()
        for t in pool:
            t.join()
        res.wall_s = max(done_at) - t0
        res.cpu_s = {k: cpu_seconds(v, children=False) - cpu0[k] for k, v in procs.items()}
        cycles1 = cycle_counts(api_url)
        res.cycles, res.cycles_s = int(cycles1[0] - cycles0[0]), cycles1[1] - cycles0[1]
    finally:
        for c in clients:
            c.close()
    for e in res.errors[:5]:
        logger.warning("submit failed: %s", e)
    return res


def cycle_counts(api_url: str) -> tuple[float, float]:
    """(scheduling cycles run, their summed seconds) from the control plane's ``/metrics``
    (``apiary_scheduling_cycle_seconds``; public by default, (0, 0) when it does not answer)."""
    try:
        text = httpx.get(f"{api_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0, 0.0
    got = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("apiary_scheduling_cycle_seconds_count", "apiary_scheduling_cycle_seconds_sum"):
            got[name] = float(value)
    return got.get("apiary_scheduling_cycle_seconds_count", 0.0), got.get("apiary_scheduling_cycle_seconds_sum", 0.0)


def queued(client: ApiaryClient) -> int:
    """Jobs in state WAITING, from the API."""
    return len(client.list(state="WAITING"))


#: A job's waiting reason until its first scheduling cycle (apiary.lifecycle.reducer).
FIRST_REASON = "Waiting for the next scheduling cycle."


#: The scheduling loop counts as idle over a window of QUIET_WINDOW_S in which its cycles took less
#: than QUIET_CYCLE_S in all (it ticks every second even when nothing changed).
QUIET_WINDOW_S, QUIET_CYCLE_S = 1.0, 0.05


def settle(client: ApiaryClient, timeout_s: float = 120.0) -> float:
    """Wait until every WAITING job has had its first scheduling decision (its waiting reason is the
    scheduler's, no longer :data:`FIRST_REASON`) and the scheduling loop is idle (its cycles took
    under :data:`QUIET_CYCLE_S` of a :data:`QUIET_WINDOW_S` window, ``apiary_scheduling_cycle_seconds``),
    so a run starts on a quiet control plane, not behind the cycles still catching up with the jobs
    just queued or stopped: a stopped job changes the scheduler's state, and the next cycle asks
    every queued job again (about half a second for 1,000). Returns the seconds waited; raises
    TimeoutError after ``timeout_s``."""
    t0 = time.monotonic()

    def check_deadline(what: str) -> None:
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} after {timeout_s} s")

    while any(j.get("waitingReason") == FIRST_REASON for j in client.list(state="WAITING")):
        check_deadline("queued jobs still without a scheduling decision")
        time.sleep(0.2)
    url = client.api_url.rstrip("/")
    _, spent0 = cycle_counts(url)
    while True:
        time.sleep(QUIET_WINDOW_S)
        _, spent = cycle_counts(url)
        if spent - spent0 < QUIET_CYCLE_S:
            return time.monotonic() - t0
        spent0 = spent
        check_deadline("the scheduling loop still busy")


# ---------------------------------------------------------------------- the submit benchmark
@dataclass
class SubmitResult:
    empty: SubmitRun
    queued: SubmitRun
    queued_jobs: int  # jobs put in the queue before the second run
    warmup: int = 0  # jobs submitted (and stopped) before the first run, not measured
    listed: dict[str, int] = field(default_factory=dict)  # per case: accepted ids found in GET /jobs
    total_jobs: dict[str, int] = field(default_factory=dict)  # per case: every job GET /jobs lists after
    startup_s: float = 0.0
    restarts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d: dict = {}
        for name, run in (("empty", self.empty), ("queued", self.queued)):
            d.update(run.to_dict(name))
            d[f"{name}_listed"] = self.listed.get(name, 0)
            d[f"{name}_lost"] = len(run.ids) - self.listed.get(name, 0)
            d[f"{name}_jobs_after"] = self.total_jobs.get(name, 0)
        # The thresholds judge the worse case.
        d["submit_per_s"] = min(d["empty_per_s"], d["queued_per_s"])
        d["submit_p99_ms"] = max(d["empty_p99_ms"], d["queued_p99_ms"])
        d["submit_threads"] = self.queued.threads
        d["submit_queued_jobs"] = self.queued_jobs
        d["submit_warmup"] = self.warmup
        d["nodes"], d["gpus_per_node"] = NODES, GPUS_PER_NODE
        d.update(server_stack())
        return d


def server_stack() -> dict[str, str]:
    """What uvicorn serves the control plane with, as its ``http="auto"`` and ``loop="auto"``
    choose in this environment (the platform's children run from the same one): the HTTP parser
    (``httptools`` when importable, else the pure-Python ``h11``) and the event loop (``uvloop``
    when importable, else ``asyncio``). Both change the control plane's CPU per request."""
    def have(module: str) -> bool:
        return importlib.util.find_spec(module) is not None

    return {"http_parser": "httptools" if have("httptools") else "h11",
            "event_loop": "uvloop" if have("uvloop") else "asyncio"}


def _check_listed(client: ApiaryClient, ids: list[str]) -> tuple[int, int]:
    """(how many of ``ids`` ``GET /api/v2/jobs`` lists, how many jobs it lists in all)."""
    listed = {j["id"] for j in client.list()}
    return len(set(ids) & listed), len(listed)


def fill_cluster(plat: Platform, stamp: int, timeout_s: float = 60.0) -> None:
    """Submit one ``sleep 600`` job per GPU and wait until every one runs: the cluster is full."""
    ids = [plat.client.submit(job_yaml(f"hold-{stamp}-{i}", HOLD_COMMAND))["id"]
           for i in range(NODES * GPUS_PER_NODE)]
    deadline = time.monotonic() + timeout_s
    while True:
        states = {plat.client.get(i)["state"] for i in ids}
        if states == {"RUNNING"}:
            return
        if states & set(FINAL_STATES):
            raise RuntimeError(f"a hold job ended: {states}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"hold jobs not all running after {timeout_s} s: {states}")
        time.sleep(0.1)


class _Pool:
    """Untimed bulk calls by ``threads`` threads, one ApiaryClient (the bench user's token) each."""

    def __init__(self, api_url: str, token: str, threads: int) -> None:
        self.api_url, self.token, self.threads = api_url, token, threads
        self._local = threading.local()
        self._made: list[ApiaryClient] = []
        self._lock = threading.Lock()

    def client(self) -> ApiaryClient:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = ApiaryClient(self.api_url, timeout=120, token=self.token)
            with self._lock:
                self._made.append(c)
        return c

    def map(self, fn, items: list) -> list:
        """``fn(client, item)`` for every item, in order; exceptions propagate."""
        with cf.ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(lambda item: fn(self.client(), item), items))

    def stop(self, ids: list[str]) -> None:
        self.map(lambda c, job_id: c.stop(job_id), ids)

    def submit(self, prefix: str, n: int) -> list[str]:
        return self.map(lambda c, i: c.submit(job_yaml(f"{prefix}-{i:05d}", JOB_COMMAND))["id"], list(range(n)))

    def close(self) -> None:
        for c in self._made:
            c.close()


def measure_submit(submissions: int = 500, queued_jobs: int = 1000, *, threads: int = 4,
                   warmup: int = 20) -> SubmitResult:
    """The two runs of :func:`submit_run` on one embedded platform (:data:`NODES` x :data:`GPUS_PER_NODE`):

    0. the cluster is filled (:func:`fill_cluster`); ``warmup`` jobs are submitted and stopped (not
       measured: the server's first requests warm its caches), so the queue is empty;
    1. empty queue: ``submissions`` jobs by ``threads`` clients (they all queue);
    2. those jobs are stopped (the queue is empty again), ``queued_jobs`` more are submitted (by
       ``threads`` clients, not measured) and stay WAITING; then ``submissions`` jobs again.

    After each run every accepted id is looked up in ``GET /api/v2/jobs``."""
    plat = start_platform(NODES, GPUS_PER_NODE, prefect=False)
    api, token = plat.emb.api_url, plat.bench_token
    bulk = _Pool(api, token, threads)
    try:
        stamp = int(time.time())
        fill_cluster(plat, stamp)
        bulk.stop(bulk.submit(f"warmup-{stamp}", warmup))
        procs = {k: v for k, v in platform_processes(plat.emb).items() if k == "control-plane"}
        listed: dict[str, int] = {}
        total: dict[str, int] = {}

        # 1. Empty queue.
        settled_s = settle(plat.client)
        before = queued(plat.client)
        empty = submit_run(api, token, f"empty-{stamp}", submissions, threads, procs)
        empty.queue_before, empty.settle_s = before, settled_s
        if not empty.ids:
            raise RuntimeError(f"no submission was accepted: {empty.errors[:1]}")
        listed["empty"], total["empty"] = _check_listed(plat.client, empty.ids)
        logger.info("empty queue: %d accepted in %.1f s", len(empty.ids), empty.wall_s)

        # 2. Stop the first run's jobs, queue ``queued_jobs``, measure again.
        bulk.stop(empty.ids)
        t0 = time.monotonic()
        filled = bulk.submit(f"queue-{stamp}", queued_jobs)
        submitted_s = time.monotonic() - t0
        settled_s = settle(plat.client)
        logger.info("queued %d jobs in %.1f s, all decided %.1f s later", len(filled), submitted_s, settled_s)
        before = queued(plat.client)
        deep = submit_run(api, token, f"queued-{stamp}", submissions, threads, procs)
        if not deep.ids:
            raise RuntimeError(f"no submission was accepted behind the queue: {deep.errors[:1]}")
        deep.queue_before, deep.settle_s = before, settled_s
        listed["queued"], total["queued"] = _check_listed(plat.client, deep.ids)
        logger.info("%d queued: %d accepted in %.1f s", before, len(deep.ids), deep.wall_s)
        res = SubmitResult(empty=empty, queued=deep, queued_jobs=queued_jobs, warmup=warmup, listed=listed,
                           total_jobs=total, startup_s=plat.startup_s)
        res.restarts = {name: c.restarts for name, c in plat.emb.children.items()}
        return res
    finally:
        bulk.close()
        plat.close()


# ---------------------------------------------------------------------- hostile requests
def load_hostile() -> ModuleType | None:
    """tests/support/hostile.py (``CORPUS``, ``send(client, case, headers)``), or None when it is
    not there. Imported by path: tests/ is not a package the benchmarks import from."""
    if not HOSTILE.exists():
        return None
    spec = importlib.util.spec_from_file_location("apiary_bench_hostile", HOSTILE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {HOSTILE}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@dataclass
class HostileResult:
    cases: int = 0
    repeats: int = 0
    samples: list[float] = field(default_factory=list)  # seconds, every send
    by_case: dict[str, float] = field(default_factory=dict)  # case id -> slowest of its sends (s)
    unexpected: dict[str, str] = field(default_factory=dict)  # case id -> what came instead of its 4xx
    startup_s: float = 0.0

    def to_dict(self) -> dict:
        ms = sorted(x * 1000 for x in self.samples)
        slowest = sorted(self.by_case.items(), key=lambda kv: -kv[1])[:5]
        return {
            "hostile_max_ms": round(ms[-1], 1),
            "hostile_p99_ms": round(percentile(ms, 99), 1),
            "hostile_p50_ms": round(percentile(ms, 50), 1),
            "hostile_cases": self.cases,
            "hostile_repeats": self.repeats,
            "hostile_samples": len(self.samples),
            # Sends not answered with the status the corpus expects (a 2xx would be a hole).
            "hostile_unexpected": len(self.unexpected),
            "hostile_slowest_ms": {k: round(v * 1000, 1) for k, v in slowest},
        }


#: The cluster the hostile corpus assumes (its node and VC names).
LAB6_TWO_VCS = REPO_ROOT / "examples" / "lab6" / "hived-config-two-vcs.yaml"


def measure_hostile(repeats: int = 3, ready_timeout_s: float = 120.0) -> HostileResult:
    """Every case of tests/support/hostile.py's ``CORPUS``, ``repeats`` rounds, sent with its own
    ``send`` to a live embedded platform (``prefect=False``) on the cluster the corpus assumes
    (Lab 6's two VCs), as the principal it names (``admin``: home/token; ``agent``: the node agent's
    own token file). A sample is ``perf_counter`` around ``send`` (request written, answer read),
    one ``httpx.Client`` with a keep-alive connection. Raises FileNotFoundError when the corpus is
    not there."""
    mod = load_hostile()
    if mod is None:
        raise FileNotFoundError(f"{HOSTILE} is not there yet")
    from apiary.auth.bootstrap import agent_token_path, read_token
    from apiary.embedded import Embedded

    res = HostileResult(cases=len(mod.CORPUS), repeats=repeats)
    tmp = tempfile.TemporaryDirectory(prefix="apiary-bench-hostile-")
    root = Path(tmp.name)
    (root / "work").mkdir()
    emb = Embedded(home=root / "home", cluster=LAB6_TWO_VCS, prefect=False, workdir=str(root / "work"))
    t0 = time.monotonic()
    try:
        emb.start()
        emb.start_supervisor()
        tokens = {"admin": read_token(emb.home / "token"),
                  "agent": read_token(agent_token_path(emb.home / "credentials", mod.NODE))}
        admin = emb.client(timeout=60)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while len([n for n in admin.nodes() if n.get("ready")]) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Lab 6 nodes not ready after {ready_timeout_s} s")
                time.sleep(0.2)
        finally:
            admin.close()
        res.startup_s = time.monotonic() - t0
        with httpx.Client(base_url=emb.api_url, timeout=60) as http:
            for _ in range(5):
                http.get("/healthz")  # the connection is open before the first sample
            for _ in range(repeats):
                for case in mod.CORPUS:
                    headers = {"Authorization": f"Bearer {tokens[case.principal]}"}
                    t1 = time.perf_counter()
                    try:
                        got = str(mod.send(http, case, headers).status_code)
                    except httpx.HTTPError as e:  # e.g. the server closed the socket on a huge body
                        got = f"{type(e).__name__}: {e}"
                    dt = time.perf_counter() - t1
                    res.samples.append(dt)
                    res.by_case[case.id] = max(dt, res.by_case.get(case.id, 0.0))
                    if got != str(case.expect):
                        res.unexpected[case.id] = got
        for case_id, got in list(res.unexpected.items())[:10]:
            logger.warning("hostile case %s answered %s", case_id, got)
        return res
    finally:
        try:
            emb.stop()
        finally:
            tmp.cleanup()


# ---------------------------------------------------------------------- method
def method(section: dict) -> str:
    """Sentences saying exactly what the ``api`` section's numbers are."""
    out = []
    if "submit_per_s" in section:
        out.append(
            "submit_per_s / submit_p99_ms: the worse of two runs, empty_* and queued_*, on one embedded platform "
            f"without Prefect on a generated {section.get('nodes')}-node x {section.get('gpus_per_node')}-GPU "
            "simulated cluster kept full by 'sleep 600' jobs, so every measured 1-GPU job stays WAITING and each "
            "submission wakes a scheduling cycle. Each run: "
            f"{section.get('empty_submissions')} jobs (YAML) POSTed to /api/v2/jobs over loopback HTTP by "
            f"{section.get('submit_threads')} threads at once, each with its own ApiaryClient (one keep-alive "
            "connection) and the bench user's bearer token (rate limits lifted); a latency is the client's "
            "perf_counter around one submit (request to parsed 202); p50/p99 (linear interpolation)/max over the "
            "accepted ones; per_s = accepted / wall time from a start barrier to the last answer. "
            f"{section.get('submit_warmup')} warm-up submissions (stopped again) come first, not measured. "
            "empty_*: no job queued at the start (the run's own jobs queue up); queued_*: after the first run's "
            f"jobs were stopped and {section.get('submit_queued_jobs')} more queued. Before each run the runner "
            "waits until every queued job has had its first scheduling decision and the scheduling loop is idle "
            "(its cycles took under 50 ms of a 1 s window; *_settle_s: how long). "
            "*_queue_before: WAITING jobs in GET /api/v2/jobs?state=WAITING just before the run; *_listed / "
            "*_lost: accepted ids found / missing in GET /api/v2/jobs right after it; *_jobs_after: jobs it lists "
            "in all; *_cycles / "
            "*_cycle_ms_mean: scheduling cycles during the run (the control plane's "
            "apiary_scheduling_cycle_seconds); *_cpu_ms_per_submit_<process>: CPU time of the control-plane "
            "process (and of the benchmark process, the clients) over the run / accepted submissions. "
            f"http_parser / event_loop: uvicorn's HTTP parser ({section.get('http_parser')}) and event loop "
            f"({section.get('event_loop')}) in the environment the control plane ran in."
        )
    if "hostile_max_ms" in section:
        out.append(
            f"hostile_max_ms / hostile_p99_ms / hostile_p50_ms: each of the {section.get('hostile_cases')} requests "
            "of tests/support/hostile.py's CORPUS, sent "
            f"{section.get('hostile_repeats')} times with its send() helper to a live embedded platform without "
            "Prefect on Lab 6's two-VC cluster (the one the corpus assumes), as the principal the case names "
            "(the admin's token, or the node agent's), one httpx client with a keep-alive connection; a sample "
            "is perf_counter around send (request written to answer read); max, 99th percentile and median over "
            "every send. hostile_unexpected: sends not answered with the status the corpus expects."
        )
    return " ".join(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="40 submissions, 50 queued")
    ap.add_argument("--submissions", type=int)
    ap.add_argument("--queued", type=int)
    ap.add_argument("--hostile-only", action="store_true", help="only the hostile corpus")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    n = args.submissions or (40 if args.quick else 500)
    q = args.queued if args.queued is not None else (50 if args.quick else 1000)
    if not args.hostile_only:
        for k, v in measure_submit(n, q).to_dict().items():
            print(f"{k}: {v}")
    for k, v in measure_hostile(1 if args.quick else 3).to_dict().items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
