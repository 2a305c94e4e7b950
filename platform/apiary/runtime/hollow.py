"""Hollow nodes: node agents whose GPUs are simulated and whose tasks are timers, many per process.

Kubernetes measures its control plane at 5,000 nodes with kubemark: "hollow" kubelets that speak
to the API server exactly as real ones do but run no containers, many of them per pod
(https://github.com/kubernetes/community/blob/master/contributors/devel/sig-scalability/kubemark-guide.md).
This module is Apiary's kubemark:

* :class:`HollowBackend` is a :class:`~apiary.runtime.base.RuntimeBackend` that starts no process.
  A task "runs" for the duration its commands ask (:func:`task_plan`) and then exits 0; a
  :meth:`~HollowBackend.stop` ends it at once with 143 (128 + SIGTERM, what a task killed by the
  stop's SIGTERM reports). Records live in memory only.
* :class:`HollowAgent` is a :class:`~apiary.runtime.agent.NodeAgent` over a hollow backend: the same
  long poll of ``GET /api/v2/nodes/{node}/assignments``, the same ``POST /api/v2/nodes/{node}/status``
  reports and heartbeats (every :data:`~apiary.runtime.agent.HEARTBEAT_S`), the same reconcile; it
  only wakes when something is due (a heartbeat, a timer task's exit, an assignment) instead of
  every :data:`~apiary.runtime.agent.REPORT_POLL_S` (which a real agent needs to notice processes
  that exited), and it records its own latencies (:class:`HollowStats`).
* :func:`run_hollow_nodes` runs many hollow agents in one asyncio process; every
  :data:`AGENTS_PER_CLIENT` of them share one :class:`~apiary.runtime.fleet_http.FleetClient`
  (aiohttp; :mod:`apiary.runtime.fleet_http` says why not httpx) with bounded connections. The
  grouping dates from httpx: httpcore's pool walks all its connections, for each idle one, whenever
  a request starts or ends, so one client for 1,000 long-polling agents burnt a whole core and got
  118 nodes ready in 15 s. It was kept with aiohttp and not measured without.

What each hollow agent measures (all on this host's clocks):

* ``beats``: ``(wall time, seconds, kind)`` of every report that was sent: ``time.perf_counter``
  from entering :meth:`NodeAgent._report_once` to its return after the control plane's answer was
  parsed. The event loop's own delays (a busy hollow process) are in it, as they are for a real
  agent on a busy host; ``loop_lag`` says how busy it was. ``kind`` is :data:`BARE` for a bare
  heartbeat (no run statuses, no output, no ``cannotRecord``: what the control plane may answer in
  memory, :func:`apiary.api.heartbeat.take_bare_heartbeat`) and :data:`RUNS` for a report that
  carries any of them (the plane applies it in a transaction under its lock).
* ``report_errors``: ``(wall time, kind)`` of every report that failed, the kind an HTTP status
  or the exception's class (:func:`report_error_kind`).
* ``received``: for every ``RUN`` assignment the first time it is seen, ``time.time()`` when the
  long poll's answer reached :meth:`NodeAgent._reconcile` (after the JSON was parsed, before the
  launch). Set against the ``job.placed`` event's ``time`` in ``GET /api/v2/events`` (the control
  plane's clock when its scheduling cycle placed the job) this is "placement -> the agent has the
  assignment"; both clocks are one host's clock only when the control plane runs on this host.

Not a drill target: a restarted hollow agent knows no runs (nothing to re-adopt, no state on disk)
and launches its node's assigned runs afresh; hollow nodes are for load, not for failure tests.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import gc
import logging
import random
import re
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from apiary import gcpolicy
from apiary.errors import PlatformError, ValidationError
from apiary.runtime.agent import HEARTBEAT_S, LONG_POLL_S, AgentHttp, NodeAgent
from apiary.runtime.base import LogStream, RuntimeBackend, TaskLaunch, TaskStatus
from apiary.runtime.fleet_http import FleetClient
from apiary.runtime.records import RUN_ID_RE

logger = logging.getLogger(__name__)

#: Environment variable of a task that sets its duration in seconds outright (wins over ``sleep``).
DURATION_ENV = "APIARY_HOLLOW_DURATION_S"
#: How long a task runs when its commands name no ``sleep`` and no DURATION_ENV is set (seconds).
DEFAULT_DURATION_S = 1.0
#: The exit code of a stopped hollow task: 128 + SIGTERM (15), as OpenPAI reports a task the
#: stop's SIGTERM killed (apiary.runtime.base).
EXIT_STOPPED = 143
#: Agents sharing one :class:`~apiary.runtime.fleet_http.FleetClient` (module doc: why not all of them).
AGENTS_PER_CLIENT = 25
#: Connections a client keeps for reports on top of one per agent (each agent's long poll holds one).
REPORT_CONNECTIONS = 4
#: Seconds over which :func:`run_hollow_nodes` starts its agents, per 1,000 nodes: 5,000 agents
#: opening their first long polls and reports in one instant would overflow the server's listen
#: backlog (uvicorn's default: 2,048), something nodes that boot at different times never do.
RAMP_S_PER_1000 = 1.0

_SLEEP = re.compile(r"(?:^|[\s;&|(])sleep\s+(\d+(?:\.\d*)?|\.\d+)(?=$|[\s;&|)])")
_EXIT = re.compile(r"(?:^|[\s;&|(])exit\s+(\d+)(?=$|[\s;&|)])")


def task_plan(commands: Sequence[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """``(duration in seconds, exit code)`` of a hollow task running ``commands``.

    The convention: the duration is the sum of every ``sleep N`` (N seconds, decimals allowed) in the
    commands, or :data:`DEFAULT_DURATION_S` when there is none; ``APIARY_HOLLOW_DURATION_S`` in
    ``env`` overrides it. The exit code is 0, or K for the first ``exit K`` (0-255). Nothing else in
    the commands is read or run. Raises :class:`ValidationError` (field ``env.APIARY_HOLLOW_DURATION_S``)
    for a duration that is not a non-negative number."""
    duration = 0.0
    found = False
    code = 0
    for command in commands:
        for m in _SLEEP.finditer(command):
            duration += float(m.group(1))
            found = True
        if code == 0:
            m2 = _EXIT.search(command)
            if m2 is not None:
                code = min(int(m2.group(1)), 255)
    if not found:
        duration = DEFAULT_DURATION_S
    raw = (env or {}).get(DURATION_ENV)
    if raw is not None:
        try:
            duration = float(raw)
        except ValueError:
            raise ValidationError(f"env.{DURATION_ENV}", f"must be a number of seconds, not {raw!r}") from None
        if not duration >= 0:  # also refuses NaN
            raise ValidationError(f"env.{DURATION_ENV}", f"must be >= 0 seconds, not {raw!r}")
    return duration, code


@dataclass
class _Run:
    started_at: float
    ends_at: float
    exit_code: int
    stopped_at: float | None = None
    forgotten: bool = False


class HollowBackend(RuntimeBackend):
    """Tasks as timers: no process, no file; see the module doc and :func:`task_plan`.

    Follows :class:`~apiary.runtime.base.RuntimeBackend`'s contract within one instance: a ``run_id``
    is started at most once (a second :meth:`launch`, also after :meth:`forget`, returns its status),
    :meth:`stop` returns at once, a stopped task reads ``exited`` with :data:`EXIT_STOPPED` and
    ``stopped=True``. A new instance (a restarted hollow agent) knows nothing: records are in memory
    only. ``pid`` is always None (no process). ``runs_probes`` is True: a timer has nothing to probe,
    so the node agent never probes it. ``clock``: unix seconds (tests pass a fake one)."""

    name = "hollow"
    runs_probes = True

    def __init__(self, gpus: int = 8, *, clock: Callable[[], float] = time.time) -> None:
        self.gpus = gpus  # simulated: only the count exists
        self._clock = clock
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()

    def launch(self, task: TaskLaunch) -> TaskStatus:
        if not isinstance(task.run_id, str) or not RUN_ID_RE.fullmatch(task.run_id) or task.run_id.startswith("."):
            raise ValidationError("run_id", f"{task.run_id!r} must be 1-200 characters of letters, digits and "
                                            "~ . - _, not starting with '.'")
        bad = [g for g in task.gpus if not isinstance(g, int) or not 0 <= g < self.gpus]
        if bad:
            raise ValidationError("gpus", f"GPU indices {bad} are not on this node's {self.gpus} simulated GPUs")
        with self._lock:
            if task.run_id not in self._runs:
                duration, code = task_plan(task.commands, task.env)
                now = self._clock()
                self._runs[task.run_id] = _Run(started_at=now, ends_at=now + duration, exit_code=code)
            return self._status(task.run_id, self._runs[task.run_id])

    def stop(self, run_id: str, grace_s: float = 5.0) -> None:
        with self._lock:
            run = self._runs.get(run_id)
            if run is None or run.stopped_at is not None:
                return
            now = self._clock()
            if now < run.ends_at:
                run.stopped_at = now

    def status(self, run_id: str) -> TaskStatus | None:
        with self._lock:
            run = self._runs.get(run_id) if isinstance(run_id, str) else None
            return None if run is None else self._status(run_id, run)

    def list(self) -> builtins.list[TaskStatus]:
        with self._lock:
            return [self._status(rid, run) for rid, run in sorted(self._runs.items()) if not run.forgotten]

    def log_path(self, run_id: str, stream: LogStream) -> Path | None:
        return None  # a timer writes no output

    def forget(self, run_id: str) -> None:
        """Drop a finished run from :meth:`list`; its status (and so its idempotency) is kept in
        memory. Raises :class:`PlatformError` for a run still running."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return
            if self._status(run_id, run).running:
                raise PlatformError(f"cannot forget {run_id}: it is still running (stop it first)")
            run.forgotten = True

    def next_exit(self) -> float | None:
        """Unix time at which the next running task's timer ends, or None when none runs."""
        now = self._clock()
        with self._lock:
            ends = [r.ends_at for r in self._runs.values() if r.stopped_at is None and r.ends_at > now]
        return min(ends, default=None)

    def _status(self, run_id: str, run: _Run) -> TaskStatus:
        if run.stopped_at is not None:
            return TaskStatus(run_id=run_id, state="exited", exit_code=EXIT_STOPPED, pid=None,
                              started_at=run.started_at, finished_at=run.stopped_at, stopped=True)
        if self._clock() >= run.ends_at:
            return TaskStatus(run_id=run_id, state="exited", exit_code=run.exit_code, pid=None,
                              started_at=run.started_at, finished_at=run.ends_at)
        return TaskStatus(run_id=run_id, state="running", exit_code=None, pid=None, started_at=run.started_at,
                          finished_at=None)


def report_error_kind(exc: BaseException) -> str:
    """A failed report's kind, for counting: ``"HTTP <status>"`` for an answer with an error status
    (httpx's ``HTTPStatusError``, what the agent's ``raise_for_status`` raises), else the
    exception's class name (``ReadTimeout``, ``ConnectError``, ...)."""
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return type(exc).__name__


#: A report's kind in :attr:`HollowStats.beats`: a bare heartbeat, or one carrying run statuses,
#: output or ``cannotRecord``.
BARE, RUNS = "bare", "runs"


def report_kind(body: Any) -> str:
    """:data:`BARE` when a status report's JSON ``body`` tells nothing but the node's facts (no
    ``runs``, no ``logs``, no ``cannotRecord``), else :data:`RUNS`."""
    if isinstance(body, dict) and not body.get("runs") and not body.get("logs") and body.get("cannotRecord") is None:
        return BARE
    return RUNS


@dataclass
class HollowStats:
    """One hollow agent's own measurements (module doc says exactly what each is).

    ``beats``: ``(unix time sent, round trip s, kind)`` per report answered, ``kind`` :data:`BARE`
    or :data:`RUNS` (module doc); ``report_errors``: reports that
    failed (HTTP error, timeout), each ``(unix time sent, kind)``, the kind as
    :func:`report_error_kind` names it; ``received``: run id -> ``{"at": unix s, "job", "taskRole",
    "index"}`` for each ``RUN`` assignment, the first time it was seen."""

    beats: list[tuple[float, float, str]] = field(default_factory=list)
    report_errors: list[tuple[float, str]] = field(default_factory=list)
    received: dict[str, dict] = field(default_factory=dict)


class HollowAgent(NodeAgent):
    """A :class:`NodeAgent` over a :class:`HollowBackend`: same HTTP calls, own latencies in
    :attr:`stats`. ``heartbeat_s``: the period of bare heartbeats (default and minimum: the real
    agent's :data:`~apiary.runtime.agent.HEARTBEAT_S`); ``phase_s``: delay before the first report
    (spreads many agents' heartbeats over the period, as independently booted nodes are);
    ``long_poll_s``: the assignments long poll's wait (:attr:`NodeAgent.long_poll_s`)."""

    def __init__(self, node: str, api_url: str, backend: HollowBackend, client: AgentHttp, *,
                 token: str | None = None, heartbeat_s: float = HEARTBEAT_S, phase_s: float = 0.0,
                 long_poll_s: float = LONG_POLL_S) -> None:
        if heartbeat_s < HEARTBEAT_S:
            raise ValidationError("heartbeat_s", f"must be >= the agent's {HEARTBEAT_S} s")
        super().__init__(node, api_url, backend, client, gpus=backend.gpus, simulated_gpus=True,
                         address="127.0.0.1", token=token)
        self.hollow = backend
        self.heartbeat_s, self.long_poll_s = heartbeat_s, long_poll_s
        self.phase_s = phase_s
        self.stats = HollowStats()
        self._sent_kind = RUNS  # the kind of the status report being sent (report_kind)

    def _reconcile(self, assignments: list[dict]) -> None:
        now = time.time()
        for a in assignments:
            if not isinstance(a, dict) or a.get("desired") != "RUN":
                continue
            run_id, labels = a.get("runId"), a.get("labels")
            if isinstance(run_id, str) and run_id not in self.stats.received and isinstance(labels, dict):
                self.stats.received[run_id] = {"at": now, "job": labels.get("job"),
                                               "taskRole": labels.get("task_role"), "index": labels.get("index")}
        super()._reconcile(assignments)

    async def _request(self, method: str, path: str, *, timeout: float | httpx.Timeout,
                       headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
        if path.endswith("/status"):
            self._sent_kind = report_kind(kw.get("json"))
        return await super()._request(method, path, timeout=timeout, headers=headers, **kw)

    async def _report_once(self) -> None:
        before = self.beat.last
        t0 = time.perf_counter()
        sent = time.time()
        self._sent_kind = RUNS
        try:
            await super()._report_once()
        except Exception as exc:
            self.stats.report_errors.append((sent, report_error_kind(exc)))
            raise
        if self.beat.last != before:  # a report was sent and answered
            self.stats.beats.append((time.time(), time.perf_counter() - t0, self._sent_kind))

    def _wake_in(self) -> float:
        """Seconds until the next report is due: a heartbeat or the end of a timer task."""
        due = self.beat.last + self.heartbeat_period_s() - time.monotonic()
        ends = self.hollow.next_exit()
        if ends is not None:
            due = min(due, ends - time.time())
        return max(due, 0.005)

    async def _report(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        if self.phase_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.phase_s)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._report_now.wait(), self._wake_in())
            self._report_now.clear()
            try:
                await self._report_once()
            except (httpx.HTTPError, ValueError) as e:
                logger.debug("node=%s report failed: %s", self.node, e)
                await asyncio.sleep(self.beat.retry_s(self.base_period_s()))
            except Exception as exc:
                logger.error("node=%s report failed: %s: %s", self.node, type(exc).__name__, exc)
                await asyncio.sleep(self.beat.retry_s(self.base_period_s()))


class InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs what is submitted at once, in the caller's thread. Installed as the event loop's default
    executor by :func:`run_hollow_nodes`: the node agent hands every backend call to a thread
    (``asyncio.to_thread``), which for a backend in memory costs far more than the call, 5,000
    agents over. Only for a process whose every executor job is short and non-blocking (hollow
    agents; the HTTP client's address resolution of an IP literal)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting coroutine, as a thread would
            fut.set_exception(exc)
        return fut


@dataclass
class HollowReport:
    """What :func:`run_hollow_nodes` measured: every agent's :class:`HollowStats` by node,
    ``loop_lag``: ``(unix time, s)`` by which a 0.1 s sleep of the event loop overshot (how busy
    the hollow process was), ``cpu_s``: this process's CPU seconds (user + system) while it ran,
    ``wall_s``: how long it ran, ``gc_pauses``: :class:`GcPauses`' ``(unix time, generation, s)``."""

    stats: dict[str, HollowStats]
    loop_lag: list[tuple[float, float]]
    cpu_s: float
    wall_s: float
    gc_pauses: list[tuple[float, int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready: ``{"beats": [[node, t, s, kind], ...], "reportErrors": [[node, t, kind], ...],
        "received": {run id: {..., "node"}}, "loopLag": [[t, s], ...], "gcPauses": [[t, generation, s],
        ...], "cpuS", "wallS", "nodes"}``."""
        return {
            "nodes": len(self.stats),
            "beats": [[n, round(t, 4), round(s, 6), k] for n, st in self.stats.items() for t, s, k in st.beats],
            "reportErrors": [[n, round(t, 4), kind] for n, st in self.stats.items() for t, kind in st.report_errors],
            "received": {rid: {**r, "node": n} for n, st in self.stats.items() for rid, r in st.received.items()},
            "loopLag": [[round(t, 4), round(s, 6)] for t, s in self.loop_lag],
            "gcPauses": [[round(t, 4), g, round(s, 6)] for t, g, s in self.gc_pauses],
            "cpuS": round(self.cpu_s, 3),
            "wallS": round(self.wall_s, 3),
        }


class GcPauses:
    """The cyclic collector's pauses in this process while entered: ``pauses`` holds ``(unix time,
    generation, seconds)`` of every collection that took at least ``min_s`` (gc.callbacks' start
    and stop, on ``time.perf_counter``). A long one stalls every hollow agent of the process at once."""

    def __init__(self, min_s: float = 0.005) -> None:
        self.min_s = min_s
        self.pauses: list[tuple[float, int, float]] = []
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif (took := time.perf_counter() - self._t0) >= self.min_s:
            self.pauses.append((time.time(), int(info.get("generation", -1)), took))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


async def _settle_once_joined(agents: Sequence[HollowAgent], stop: asyncio.Event, poll_s: float = 1.0) -> None:
    """Once every agent has had a report answered (the fleet's long-lived state, its connections
    included, exists), collect and freeze the whole heap once (:func:`apiary.gcpolicy.settle`; a
    no-op where the policy is not installed): the pause comes while the fleet joins, not at some later
    moment of the measured run, where full collections of the grown heap took up to 0.65 s
    (``hollow_gc_pause_max_ms`` at 5,000 nodes), stalling every agent of the process at once."""
    while not stop.is_set() and not all(a.stats.beats for a in agents):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
    if not stop.is_set():
        gcpolicy.settle()


async def _watch_loop_lag(stop: asyncio.Event, out: list[tuple[float, float]], period_s: float = 0.1) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t0 = loop.time()
        await asyncio.sleep(period_s)
        out.append((time.time(), max(0.0, loop.time() - t0 - period_s)))


async def run_hollow_nodes(
    api_urls: str | Sequence[str],
    nodes: dict[str, int],
    tokens: dict[str, str],
    *,
    stop: asyncio.Event | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    long_poll_s: float = LONG_POLL_S,
    ramp_s: float | None = None,
    agents_per_client: int = AGENTS_PER_CLIENT,
    report_connections: int = REPORT_CONNECTIONS,
    ca_cert: Path | None = None,
    inline_executor: bool = True,
    seed: int = 0,
) -> HollowReport:
    """Run one :class:`HollowAgent` per entry of ``nodes`` (name -> simulated GPU count) in this event
    loop until ``stop`` is set; return what they measured.

    ``api_urls``: the control plane's URL(s); node ``i`` (in ``nodes``' order) talks to
    ``api_urls[i % len]``. ``tokens``: node -> that node agent's bearer token (a missing one: no
    token sent, the control plane answers 401 and the node never becomes ready). Every
    ``agents_per_client`` agents share one :class:`~apiary.runtime.fleet_http.FleetClient` with at
    most ``agents_per_client + report_connections`` connections: each agent's long poll holds one,
    reports share the rest.
    ``ca_cert``: verify HTTPS against this CA (one SSL context for all clients).
    Agents start ``ramp_s`` apart in all (default :data:`RAMP_S_PER_1000` per 1,000 nodes), each
    with a random first-heartbeat phase in ``[0, heartbeat_s)`` (``seed`` seeds it); each long poll
    waits up to ``long_poll_s``.
    ``inline_executor``: install :class:`InlineExecutor` as the loop's default executor (for good:
    run hollow nodes in a process or loop of their own). Raises ValidationError for an empty
    ``api_urls``, ``agents_per_client`` below 1 or a ``heartbeat_s`` below the agent's.
    """
    urls = [api_urls] if isinstance(api_urls, str) else list(api_urls)
    if not urls:
        raise ValidationError("api_urls", "give at least one control-plane URL")
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    ramp = RAMP_S_PER_1000 * len(nodes) / 1000 if ramp_s is None else ramp_s
    if inline_executor:
        loop.set_default_executor(InlineExecutor(max_workers=1))
    if agents_per_client < 1:
        raise ValidationError("agents_per_client", "must be >= 1")
    cap = agents_per_client + report_connections
    verify: Any = ssl.create_default_context(cafile=str(ca_cert) if ca_cert is not None else None)
    import psutil

    me = psutil.Process()
    cpu0, t0 = sum(me.cpu_times()[:2]), time.monotonic()
    lag: list[tuple[float, float]] = []
    gc_pauses = GcPauses()
    async with contextlib.AsyncExitStack() as clients:
        clients.enter_context(gc_pauses)
        agents: list[HollowAgent] = []
        for i, (name, gpus) in enumerate(nodes.items()):
            if i % agents_per_client == 0:
                client = await clients.enter_async_context(FleetClient(verify=verify, max_connections=cap))
            agents.append(HollowAgent(name, urls[i % len(urls)], HollowBackend(gpus), client, token=tokens.get(name),
                                      heartbeat_s=heartbeat_s, phase_s=rng.uniform(0, heartbeat_s),
                                      long_poll_s=long_poll_s))
        logger.info("hollow nodes starting: %d agents over %.1f s, %d clients, api=%s", len(agents), ramp,
                    -(-len(agents) // agents_per_client), ", ".join(urls))

        async def start(i: int, agent: HollowAgent) -> None:
            if ramp > 0 and len(agents) > 1:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), ramp * i / len(agents))
            if not stop.is_set():
                await agent.run(stop)

        lag_task = asyncio.create_task(_watch_loop_lag(stop, lag))
        settle_task = asyncio.create_task(_settle_once_joined(agents, stop))
        await asyncio.gather(*(start(i, a) for i, a in enumerate(agents)))
        await lag_task
        await settle_task
    return HollowReport({a.node: a.stats for a in agents}, lag, sum(me.cpu_times()[:2]) - cpu0,
                        time.monotonic() - t0, gc_pauses.pauses)
