"""The node agent: makes one node run exactly the task runs the control plane assigns it.

Desired-state reconciliation, as a kubelet does: the agent long-polls
``GET /api/v2/nodes/{node}/assignments`` and, for every assignment, launches (``RUN``) or stops
(``STOP``) the run through its :class:`~apiary.runtime.base.RuntimeBackend`; a running run the
control plane no longer lists is stopped. It reports run statuses and a heartbeat with
``POST /api/v2/nodes/{node}/status``; new output up to MAX_INLINE_LOG_BYTES rides in that report
(stored before its statuses), more goes first with ``POST /api/v2/nodes/{node}/logs``, so a
finished job's logs are complete when its exit is recorded.

Never twice: launches are idempotent by run id in the backend (it survives an agent restart), and
a run whose exit the control plane acknowledged is tombstoned here and never launched again, even
if a stale assignment list still names it. Control-plane outages are ridden out with backoff;
tasks keep running meanwhile, up to a point:

Self-fencing (:mod:`apiary.runtime.link` says why and how the timing is safe). An agent whose
reports have not been answered by any control-plane replica for the node-lost grace less
:func:`~apiary.runtime.link.self_fence_margin_s` stops all its runs (SIGTERM,
:data:`~apiary.runtime.link.FENCE_STOP_GRACE_S`, SIGKILL) and launches nothing until a report is
answered again: by then the control plane may have placed them on another node, and a task
instance must never run on two nodes at once. The runs it fenced are reported exited with
EXIT_NODE_LOST (-1001 PodNodeLost), the code the control plane gives the runs of a lost node: if
it already failed them as lost and placed the job elsewhere, the late report is acknowledged and
ignored (the task is final); if the partition ended before the grace, the job is retried as a
platform retry. They are never launched again here. On by default unless every control-plane URL
is loopback (one host: no network can part the agent from the control plane, so losing contact
means the control plane is down, and one that comes back grants a fresh grace).

Replicas: the agent is given every control-plane URL (a list, or comma-separated); a transport
error or a 502/503/504 moves it to the next one. HTTPS is verified as ``run_agents``' ``verify``
says (:func:`apiary.client.http_verify`), and the node's token never goes over plain HTTP to a
host that is not loopback (:func:`apiary.client.check_token_transport`).

An agent survives any launch error: a run whose assignment cannot be launched (a backend error, a
malformed assignment) is reported exited with EXIT_LAUNCH_FAILED, and one failing reconcile is
logged and retried on the next poll, so the watcher never stops while heartbeats go on. An agent
that cannot record its runs (its backend's state directory is not writable, its disk is full)
launches nothing new, says so in every report (``cannotRecord``, which the control plane's
``/healthz`` lists) and in its node's ``/healthz``.

Several agents may share one process (``apiary agent --node a --node b``), one asyncio task
group each, over one HTTP client: that is how the embedded platform runs many simulated nodes
without one process per node.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import os
import ssl
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import httpx

from apiary.client import check_token_transport
from apiary.errors import UnavailableError, ValidationError
from apiary.lifecycle import EXIT_LAUNCH_FAILED, EXIT_LIVENESS_FAILED, EXIT_NODE_LOST
from apiary.procutil import write_probe
from apiary.runtime.base import RuntimeBackend, TaskLaunch, TaskStatus
from apiary.runtime.beat import HeartbeatTimer
from apiary.runtime.faults import SimulatedFaults
from apiary.runtime.isolation import drain_released
from apiary.runtime.link import (
    DEFAULT_NODE_LOST_AFTER_S,
    EXCHANGE_TIMEOUT_MAX_S,
    FENCE_STOP_GRACE_S,
    GRACE_HEADER,
    ContactClock,
    Replicas,
    all_loopback,
)
from apiary.runtime.prelaunch import exit_code_of, settle
from apiary.runtime.probes import ExecAction, Prober, monotonic_from_wall, probes_from_wire
from apiary.runtime.storage import TaskMounts

if TYPE_CHECKING:  # imported for real in run_agents: agents without metrics never load it
    from apiary.monitoring import NodeExporter

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
REPORT_POLL_S = 0.25
LONG_POLL_S = 10.0
LOG_CHUNK = 256 * 1024
#: Longest back-off (seconds) after a watcher iteration that failed for a reason other than the
#: control plane being away (a malformed answer, a bug): the next poll comes at most this late.
WATCH_ERROR_BACKOFF_S = 5.0
#: How long (seconds) a "can record" probe of the backend's state directory is trusted in the report
#: loop; a reconcile that launches something probes again first.
RECORD_PROBE_S = 10.0
#: Bytes written (then removed) by the probe: more than a file's metadata, so a disk with no free
#: block fails it.
RECORD_PROBE_BYTES = 4096
#: Output sent with a report rather than with POST .../logs: the control plane's cap
#: (apiary.api.schemas.MAX_INLINE_LOG_BYTES; a test keeps the two equal).
MAX_INLINE_LOG_BYTES = 64 * 1024
#: Set for tasks on a GPU with an injected ``degraded`` fault: the slowdown factor (a simulation;
#: examples/stress/bench.py honours it).
SLOWDOWN_ENV = "APIARY_SIMULATED_SLOWDOWN"
#: The same per GPU, for the task's degraded GPUs only: ``"<gpu>:<factor>,..."`` (node GPU indices,
#: as in ``CUDA_VISIBLE_DEVICES``), so the benchmark slows the degraded GPU's figures and no other's.
SLOWDOWN_GPUS_ENV = "APIARY_SIMULATED_SLOWDOWN_GPUS"
#: Answers after which the agent tries the next control-plane replica: a proxy or load balancer
#: without a healthy backend (502, 504), a replica that cannot serve now (503).
FAILOVER_STATUSES = frozenset({502, 503, 504})
#: While fenced: seconds between checks that nothing runs, and between assignment polls (each
#: answered at once, not long-polled, so the first one after contact is back applies them).
FENCED_RECHECK_S = 1.0
_STREAMS: tuple[Literal["stdout"], Literal["stderr"]] = ("stdout", "stderr")
_StreamKey = tuple[str, Literal["stdout", "stderr"]]  # (run id, stream)


class AgentHttp(Protocol):
    """What an agent uses of its HTTP client: ``httpx.AsyncClient``, or the hollow fleet's
    :class:`~apiary.runtime.fleet_http.FleetClient`."""

    async def request(self, method: str, url: str, *, content: Any = None, json: Any = None, params: Any = None,
                      headers: Any = None, timeout: Any = None) -> httpx.Response: ...


class NodeAgent:
    """The agent of one node. ``run`` until ``stop`` is set; on stop it leaves tasks running
    unless ``kill_tasks_on_exit`` (a clean shutdown of the embedded platform sets it).

    ``api_url``: the control-plane replicas (one URL, several comma-separated, or a list; see
    :class:`~apiary.runtime.link.Replicas`). ``self_fence``: stop every run after the node-lost
    grace less the margin without an answered report (module doc); None (default): on unless
    every URL is loopback. ``contact``: the :class:`~apiary.runtime.link.ContactClock` to count
    with (default: a new one assuming the default grace, kept in memory only). Raises
    :class:`~apiary.errors.ValidationError` (field ``APIARY_API_URL``) for a malformed URL and
    :class:`~apiary.errors.PlaintextTokenError` when ``token`` would go over plain HTTP to a host
    that is not loopback.
    """

    #: Bare heartbeat period (s) and long-poll wait (s; the API allows <= 60); run_agents sets them from
    #: the agent's settings (a fleet of thousands beats less often, as kubelet renews its lease every 10 s).
    heartbeat_s: float = HEARTBEAT_S
    long_poll_s: float = LONG_POLL_S

    def __init__(
        self,
        node: str,
        api_url: str | Sequence[str],
        backend: RuntimeBackend,
        client: AgentHttp,
        *,
        gpus: int,
        simulated_gpus: bool,
        address: str = "127.0.0.1",
        workdir: str | None = None,
        metrics_url: str | None = None,
        token: str | None = None,
        self_fence: bool | None = None,
        contact: ContactClock | None = None,
        mounts: TaskMounts | None = None,
    ) -> None:
        self.node = node
        #: The node's storage mounts for its tasks (None: this agent mounts no storage, and a run
        #: that needs some fails with EXIT_MOUNT_FAILED).
        self.mounts = mounts
        # What the node has to say about a run it failed before it started (a mount that failed):
        # sent once as the run's stderr.
        self._notes: dict[str, bytes] = {}
        self.replicas = Replicas(api_url)
        for url in self.replicas.urls:
            check_token_transport(url, token)
        # The node's own credential: the control plane lets it act for this node only.
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.self_fence = not all_loopback(self.replicas.urls) if self_fence is None else self_fence
        self.contact = contact or ContactClock()
        #: True from the moment the agent fenced itself until a report is answered again.
        self.fenced = False
        # Set when the grace changed: the fence watchdog sleeping until the old deadline wakes up.
        self._grace_changed = asyncio.Event()
        # Runs stopped by self-fencing, reported with EXIT_NODE_LOST and never launched again.
        self._fenced: set[str] = set()
        self.backend = backend
        self.client = client
        self.gpus = gpus
        self.simulated_gpus = simulated_gpus
        self.address = address
        self.workdir = workdir or os.getcwd()
        self.agent_id = uuid.uuid4().hex[:12]
        self._tombstones: set[str] = set()
        # Runs the backend already has: those launched by this process, and (after the first
        # reconcile's listing) those an earlier agent process launched. A RUN assignment for one of
        # them is not settled (ports, storage) nor launched again. None until that first listing.
        self._launched: set[str] | None = None
        self._adopted: set[str] = set()  # of those, the earlier process's not yet seen in an assignment
        # Statuses the backend cannot give: launch failures and runs stopped before launch.
        self._failed: dict[str, TaskStatus] = {}
        self._stopping: set[str] = set()
        self._sent: dict[str, tuple] = {}
        self._shipped: dict[_StreamKey, int] = {}
        self._inline = True  # output rides in reports (NodeReport.logs) unless the control plane ignores it
        self._report_now = asyncio.Event()
        self.beat = HeartbeatTimer()  # when the next bare heartbeat is due (apiary.runtime.beat)
        self.metrics_url = metrics_url
        self._labels: dict[str, dict] = {}  # run_id -> metric labels and gpus, from the assignments
        self.faults = SimulatedFaults(node)  # injected simulated-GPU faults (apiary.runtime.faults)
        self.prober = Prober()  # Kubernetes-style liveness / readiness probes of running tasks
        self._liveness_failed: dict[str, str] = {}
        # Why the backend cannot record runs (None: it can), and when that was last probed (monotonic).
        self.record_problem: str | None = None
        self._record_probed = float("-inf")
        self._sent_problem: str | None = None

    @property
    def api(self) -> str:
        """The control-plane URL the agent talks to now (no trailing ``/``)."""
        return self.replicas.current

    # ------------------------------------------------------------------ main loops
    async def run(self, stop: asyncio.Event) -> None:
        loops = [asyncio.create_task(self._watch(stop)), asyncio.create_task(self._report(stop))]
        if self.self_fence:
            loops.append(asyncio.create_task(self._fence_watch(stop)))
        await stop.wait()
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)

    async def _request(self, method: str, path: str, *, timeout: float | httpx.Timeout,
                       headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
        """``method`` ``path`` on the current replica with the node's token; a transport error or
        a :data:`FAILOVER_STATUSES` answer moves to the next replica (and raises, as
        ``raise_for_status`` does for any error answer): the caller's loop retries."""
        url = self.replicas.current
        try:
            r = await self.client.request(method, f"{url}{path}", timeout=timeout,
                                          headers={**self._auth, **(headers or {})}, **kw)
        except httpx.TransportError:
            self.replicas.failed(url)
            raise
        if r.status_code in FAILOVER_STATUSES:
            self.replicas.failed(url)
        r.raise_for_status()
        return r

    def heartbeat_period_s(self) -> float:
        """Seconds of the heartbeat period running now: :meth:`base_period_s` with its jitter."""
        return self.beat.period_s(self.base_period_s())

    def base_period_s(self) -> float:
        """Seconds between bare heartbeats before jitter: :attr:`heartbeat_s`, or a third of the time
        before the fence when that is shorter (a short grace), so that two lost heartbeats in a row
        never fence (the jitter stretches a period by 4% at most)."""
        if not self.self_fence:
            return self.heartbeat_s
        return max(0.1, min(self.heartbeat_s, self.contact.fence_after_s() / 3))

    def _exchange_timeout_s(self) -> float:
        """Timeout of one report or log upload, seconds: bounded by the grace while self-fencing
        (:meth:`~apiary.runtime.link.ContactClock.exchange_timeout_s`: a silent replica must not
        use up the time left before the fence), else EXCHANGE_TIMEOUT_MAX_S as ever."""
        return self.contact.exchange_timeout_s() if self.self_fence else EXCHANGE_TIMEOUT_MAX_S

    # ------------------------------------------------------------------ self-fencing
    async def _fence_watch(self, stop: asyncio.Event) -> None:
        """Sleep until the contact clock's deadline (or until the control plane names another
        grace); past it, fence (and, while fenced, check every FENCED_RECHECK_S that nothing
        runs: a stop that failed is tried again)."""
        while not stop.is_set():
            wait = self.contact.until_fence_s()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._grace_changed.wait(), wait)
                self._grace_changed.clear()
                continue
            try:
                await self.fence()
            except Exception as exc:  # a backend error must not end the watchdog: try again
                logger.error("node=%s self-fencing failed, retrying: %s", self.node, describe_error(exc))
            await asyncio.sleep(FENCED_RECHECK_S)

    async def fence(self) -> list[str]:
        """Fence the node now: launch nothing more and stop every running run, each with
        FENCE_STOP_GRACE_S of SIGTERM before SIGKILL, concurrently; returns the run ids stopped.
        Idempotent. Stays fenced until a report is answered (:meth:`_report_once`)."""
        if not self.fenced:
            logger.error("node=%s no control plane answered for %.1f s (node-lost grace %.1f s): "
                         "stopping all runs and launching nothing until one answers (self-fencing)",
                         self.node, self.contact.silent_for(), self.contact.grace_s)
        # Set before listing: a launch that begins from here on is refused, and one already under
        # way stops its run itself when it returns (_launch).
        self.fenced = True
        listed = await asyncio.to_thread(self.backend.list)
        running = [s.run_id for s in listed if s.state == "running"]
        for run_id in running:
            self._fenced.add(run_id)
            self.prober.forget(run_id)  # a probe of a killed task would turn the exit into a liveness failure
        await asyncio.gather(*(asyncio.to_thread(self.backend.stop, run_id, FENCE_STOP_GRACE_S)
                               for run_id in running))
        if running:
            logger.warning("node=%s self-fenced runs=%s", self.node, ",".join(running))
            self._report_now.set()
        return running

    async def stop_all(self) -> None:
        runs = await asyncio.to_thread(self.backend.list)
        await asyncio.gather(
            *(asyncio.to_thread(self.backend.stop, r.run_id, 3.0) for r in runs if r.state == "running")
        )

    async def _watch(self, stop: asyncio.Event) -> None:
        generation: int | None = None
        backoff = 0.2
        failures = 0
        while not stop.is_set():
            try:
                generation, backoff = await self._watch_once(generation, backoff)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # One bad answer or a bug in applying it must not end the watcher while the report
                # loop goes on beating (the node would look healthy and never apply a STOP): log it,
                # back off, poll afresh.
                failures += 1
                logger.error("node=%s applying assignments failed (%d in a row), retrying: %s",
                             self.node, failures, describe_error(exc))
                generation = None
                await asyncio.sleep(min(0.2 * 2 ** min(failures, 5), WATCH_ERROR_BACKOFF_S))

    async def _watch_once(self, generation: int | None, backoff: float) -> tuple[int | None, float]:
        """One long poll of the assignments and their reconcile; returns the next ``(generation,
        backoff)``. Raises whatever applying a malformed answer raises (``_watch`` logs it)."""
        params = {} if generation is None or self.fenced else {"generation": generation, "wait": self.long_poll_s}
        # The connection itself gets the exchange timeout: a replica that swallows packets is
        # left as soon as a report to it would be.
        timeout = httpx.Timeout(self.long_poll_s + 5, connect=min(self.long_poll_s + 5, self._exchange_timeout_s()))
        try:
            r = await self._request("GET", f"/api/v2/nodes/{self.node}/assignments", params=params, timeout=timeout)
            data = r.json()
        except (httpx.HTTPError, ValueError) as e:
            logger.debug("node=%s assignments unavailable: %s", self.node, e)
            await asyncio.sleep(backoff)
            return None, min(backoff * 2, 2.0)
        if self.fenced:
            # Nothing is applied until a report is answered (only that renews the control plane's
            # grace): then the next poll, at most FENCED_RECHECK_S away, applies the assignments.
            await asyncio.sleep(FENCED_RECHECK_S)
            return None, 0.2
        generation = data["generation"]
        # Faults first: a task launched in this reconcile already runs on a degraded GPU
        # queued before it was assigned.
        self._apply_faults(data.get("faults", []))
        await asyncio.to_thread(self._reconcile, data["assignments"])
        self._report_now.set()
        return generation, 0.2

    def health(self) -> tuple[bool, str]:
        """The node's ``/healthz`` verdict: ``(False, reason)`` while its backend cannot record runs."""
        problem = self.record_problem
        return (True, "") if problem is None else (False, f"node {self.node} cannot record runs: {problem}")

    def running_tasks(self) -> list[dict]:
        """The node's running tasks for its task metrics: labels, process group id, GPUs."""
        return [
            {**self._labels[st.run_id], "pid": st.pid}
            for st in self.backend.list()
            if st.state == "running" and st.pid and st.run_id in self._labels
        ]

    @property
    def exporter(self) -> NodeExporter | None:
        """The node's metrics exporter, set by run_agents when metrics are served (faults go to it)."""
        return cast("NodeExporter | None", self.faults.exporter)

    @exporter.setter
    def exporter(self, value: NodeExporter | None) -> None:
        self.faults.exporter = value

    def _apply_faults(self, faults: list[dict]) -> None:
        self.faults.apply(faults)

    def _reconcile(self, assignments: list[dict]) -> None:
        """Make the node run exactly ``assignments`` (the control plane's list of ``{"runId",
        "desired": "RUN"|"STOP", "launch": TaskLaunch fields, "probes", "labels"}``): launch, stop,
        and stop what is running but no longer listed.

        Never raises for one assignment: a run that cannot be launched (the backend refuses it, its
        ``launch`` is malformed) is failed with EXIT_LAUNCH_FAILED; an item without a usable
        ``runId`` is logged and skipped; a stop that fails is tried again on the next poll. While
        the backend cannot record runs (:meth:`check_recording`) nothing new is launched: those
        runs stay unlaunched (STARTING) until it can, so no task runs that could not be recorded.
        """
        wanted: dict[str, dict] = {}
        for a in assignments:
            run_id = a.get("runId") if isinstance(a, dict) else None
            if isinstance(run_id, str) and run_id:
                wanted[run_id] = a
            else:
                logger.error("node=%s ignored an assignment without a run id", self.node)
        for run_id, a in wanted.items():
            labels, launch = a.get("labels"), a.get("launch")
            if isinstance(labels, dict) and isinstance(launch, dict):
                self._labels[run_id] = {**labels, "gpus": list(launch.get("gpus") or [])}
        if self._launched is None:
            try:
                self._launched = {st.run_id for st in self.backend.list()}
                self._adopted = set(self._launched)
            except Exception as exc:  # the next reconcile lists again; launch() stays idempotent
                logger.error("node=%s cannot list its runs: %s", self.node, describe_error(exc))
        # No write probe before launching: a backend writes its run record before it starts
        # anything and refuses the launch when it cannot, and _launch then defers the run.
        for run_id, a in wanted.items():
            if run_id in self._tombstones or run_id in self._failed or run_id in self._fenced:
                continue
            if a.get("desired") == "RUN":
                self._launch(run_id, a)
                continue
            try:
                if self.backend.status(run_id) is None:
                    # Asked to stop a run this node never started (stopped before it was launched):
                    # report it ended so the control plane can finish the attempt, and never launch it.
                    now = time.time()
                    self._failed[run_id] = TaskStatus(
                        run_id=run_id, state="exited", exit_code=None, pid=None, started_at=None,
                        finished_at=now, stopped=True,
                    )
                else:
                    self._stop_async(run_id)
            except Exception as exc:  # the next poll tries again
                logger.error("node=%s run=%s stop failed: %s", self.node, run_id, describe_error(exc))
        try:
            listed = self.backend.list()
        except Exception as exc:
            logger.error("node=%s cannot list its runs: %s", self.node, describe_error(exc))
            listed = []
        if self.mounts is not None:
            # Mounts of runs that ended (or that an earlier agent process left) are released.
            self.mounts.reconcile({st.run_id for st in listed if st.state == "running"})
        for st in listed:
            if st.state == "running" and st.run_id not in wanted:
                logger.warning("node=%s run=%s not assigned here any more: stopping it", self.node, st.run_id)
                try:
                    self._stop_async(st.run_id)
                except Exception as exc:
                    logger.error("node=%s run=%s stop failed: %s", self.node, st.run_id, describe_error(exc))

    def _launch(self, run_id: str, a: dict) -> None:
        """Launch one ``RUN`` assignment. An UnavailableError (the runtime is away) defers it to the
        next poll; so does any error while the backend cannot record runs. Any other error fails the
        run with EXIT_LAUNCH_FAILED (reported exited, never launched again); the log names the
        error's type and message with the assignment's commands, environment values and registry
        credentials blanked out."""
        launched = self._launched
        if launched is None or run_id in launched:
            # Every answer of the long poll lists the node's runs, running ones included. A run the
            # backend has needs nothing more; settling it again would check ports its own task
            # holds and prepare storage it has mounted (a failure there would fail a running task).
            # Until the backend could list its runs (launched None), any run may be one it has.
            try:
                st = self.backend.status(run_id)
            except Exception as exc:  # a running task is never failed for a status read: next poll
                logger.warning("node=%s run=%s status unknown: %s", self.node, run_id, describe_error(exc))
                return
            if st is not None:
                if launched is None or run_id in self._adopted:
                    self._adopted.discard(run_id)
                    self._watch_adopted(run_id, a, st)
                return
            if launched is not None:
                launched.discard(run_id)  # its record is gone: launched afresh below, as before
        try:
            env = node_task_env(a["launch"]["env"], a["launch"].get("gpus"), self.faults, self.backend.name)
            if self.fenced:
                logger.warning("node=%s run=%s launch deferred: the node is self-fenced", self.node, run_id)
                return
            spec = settle(run_id, dict(a["launch"]), env, backend=self.backend, mounts=self.mounts, node=self.node)
            launch = TaskLaunch(**{**spec, "workdir": self.workdir, "env": env})
            st = self.backend.launch(launch)
            if launched is not None:
                launched.add(run_id)
            if self.fenced:  # the node fenced itself while this launch ran: its run must not outlive the fence
                self._fenced.add(run_id)
                self.backend.stop(run_id, FENCE_STOP_GRACE_S)
                return
        except UnavailableError as e:
            # dockerd or the API server is away for a moment: not the task's fault, and
            # -1203 would be permanent. The next assignment poll launches it again.
            logger.warning("node=%s run=%s launch deferred: %s", self.node, run_id, e)
        except Exception as exc:
            why = describe_error(exc, _secret_values(a.get("launch")))
            problem = self.check_recording(0.0)
            if problem is not None:
                logger.warning("node=%s run=%s launch deferred: the node cannot record runs (%s): %s",
                               self.node, run_id, problem, why)
                return
            logger.error("node=%s run=%s launch failed: %s", self.node, run_id, why)
            if self.mounts is not None:
                self.mounts.release(run_id)
            now = time.time()
            code = exit_code_of(exc)
            if code != EXIT_LAUNCH_FAILED:
                self._notes[run_id] = f"apiary: exit code {code}: {why}\n".encode()
            self._failed[run_id] = TaskStatus(run_id=run_id, state="exited", exit_code=code, pid=None,
                                              started_at=now, finished_at=now)
        else:
            if st.state == "running" and a.get("probes") and not self.backend.runs_probes:
                try:
                    watch_probes(self, run_id, a["probes"], st, launch)
                except Exception as exc:  # a malformed probe never fails the task itself
                    logger.error("node=%s run=%s probes not watched: %s", self.node, run_id, describe_error(exc))

    def _watch_adopted(self, run_id: str, a: dict, st: TaskStatus) -> None:
        """Watch the probes of a run an earlier agent process launched (its first assignment here)."""
        if st.state != "running" or not a.get("probes") or self.backend.runs_probes:
            return
        try:
            spec = {k: v for k, v in a["launch"].items() if k not in ("mounts", "mountError")}
            env = node_task_env(a["launch"]["env"], a["launch"].get("gpus"), self.faults, self.backend.name)
            launch = TaskLaunch(**{**spec, "mounts": [], "workdir": self.workdir, "env": env})
            watch_probes(self, run_id, a["probes"], st, launch)
        except Exception as exc:  # a malformed probe never fails the task itself
            logger.error("node=%s run=%s probes not watched: %s", self.node, run_id, describe_error(exc))

    def check_recording(self, max_age_s: float = RECORD_PROBE_S) -> str | None:
        """Why the backend cannot record runs now (:func:`recording_problem`), or None when it can.
        A result younger than ``max_age_s`` seconds is reused. Also kept in :attr:`record_problem`
        (the node's ``/healthz`` and the reports' ``cannotRecord`` read it)."""
        now = time.monotonic()
        if now - self._record_probed < max_age_s:
            return self.record_problem
        self._record_probed = now
        problem = recording_problem(self.backend)
        if problem != self.record_problem:
            if problem is None:
                logger.warning("node=%s can record runs again: launching resumes", self.node)
            else:
                logger.error("node=%s cannot record runs, launching nothing new: %s", self.node, problem)
        self.record_problem = problem
        return problem

    async def _probe(self, run_id: str) -> None:
        res = await asyncio.to_thread(self.prober.check, run_id)
        if res.live_failed and run_id not in self._liveness_failed:
            logger.warning("node=%s run=%s liveness probe failed: %s", self.node, run_id, res.message)
            self._liveness_failed[run_id] = res.message
            self._stop_async(run_id)
            self._report_now.set()

    def _stop_async(self, run_id: str) -> None:
        st = self.backend.status(run_id)
        if st is None or st.state != "running" or run_id in self._stopping:
            return
        self._stopping.add(run_id)

        async def _do() -> None:
            try:
                await asyncio.to_thread(self.backend.stop, run_id, 5.0)
            finally:
                self._stopping.discard(run_id)
                self._report_now.set()

        asyncio.run_coroutine_threadsafe(_do(), self._loop)

    async def _report(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                await asyncio.wait_for(self._report_now.wait(), REPORT_POLL_S)
            except TimeoutError:
                pass
            self._report_now.clear()
            for run_id in self.prober.due():
                if run_id not in self._stopping:
                    asyncio.create_task(self._probe(run_id))
            try:
                await self._report_once()
            except (httpx.HTTPError, ValueError) as e:
                logger.debug("node=%s report failed: %s", self.node, e)
                await asyncio.sleep(self.beat.retry_s(self.base_period_s()))
            except Exception as exc:  # a backend or a bug must not end the heartbeats' loop either
                logger.error("node=%s report failed: %s", self.node, describe_error(exc))
                await asyncio.sleep(self.beat.retry_s(self.base_period_s()))

    async def _report_once(self) -> None:
        problem = await asyncio.to_thread(self.check_recording)
        try:
            statuses = await asyncio.to_thread(self.backend.list)
        except Exception as exc:
            # The heartbeat still goes (with cannotRecord): a node that stopped beating would be
            # declared lost and its runs, still running here, placed again elsewhere.
            logger.error("node=%s cannot list its runs: %s", self.node, describe_error(exc))
            statuses = []
        # A run failed here (its launch raised) is reported as failed even if the backend kept a record.
        statuses = [s for s in statuses if s.run_id not in self._tombstones and s.run_id not in self._failed]
        statuses += list(self._failed.values())
        # A task killed for failing its liveness probe is a failure with the platform's exit code
        # (EXIT_LIVENESS_FAILED), not the 143/137 of the stop itself; one killed by self-fencing
        # ended because its node lost the control plane (EXIT_NODE_LOST), as the control plane
        # records the runs of a lost node. A fenced run that exited on its own keeps its code.
        statuses = [
            dataclasses.replace(s, exit_code=EXIT_NODE_LOST, stopped=False, lost=False)
            if s.state == "exited" and s.run_id in self._fenced and s.stopped else
            dataclasses.replace(s, exit_code=EXIT_LIVENESS_FAILED, stopped=False)
            if s.state == "exited" and s.run_id in self._liveness_failed else s
            for s in statuses
        ]
        for s in statuses:
            if s.state == "exited":
                self.prober.forget(s.run_id)
        changed = [s for s in statuses if self._sent.get(s.run_id) != _key(s)]
        # New output rides in the report while it is small (a short task's output and its exit
        # in one request); more goes first with POST .../logs, chunk by chunk.
        inline, rest = new_output(self.backend, statuses, self._shipped, self._notes,
                                  MAX_INLINE_LOG_BYTES if self._inline else 0)
        sent = self.contact.clock()  # before anything is sent: the contact is counted from here
        await self._ship_logs(rest)
        now = time.monotonic()
        if (not changed and not inline and problem == self._sent_problem
                and now - self.beat.last < self.heartbeat_period_s()):
            return
        body = {
            "agentId": self.agent_id,
            "metricsUrl": self.metrics_url,
            "gpus": self.gpus,
            "simulatedGpus": self.simulated_gpus,
            "address": self.address,
            # The high-water mark of applied fault ids: the control plane drops those from its queue.
            "faultsApplied": self.faults.applied or None,
            # Why this node cannot record runs (it launches nothing new meanwhile); None: it can.
            "cannotRecord": problem,
            "runs": [
                {
                    "run_id": s.run_id, "state": s.state, "exit_code": s.exit_code, "pid": s.pid,
                    "started_at": s.started_at, "finished_at": s.finished_at, "lost": s.lost, "stopped": s.stopped,
                }
                for s in changed
            ],
        }
        if inline:
            body["logs"] = [
                {"runId": run_id, "stream": stream, "offset": offset, "data": base64.b64encode(data).decode()}
                for (run_id, stream), offset, data in inline
            ]
        r = await self._request("POST", f"/api/v2/nodes/{self.node}/status", json=body,
                                timeout=self._exchange_timeout_s())
        self._answered(sent, r)
        self.beat.answered(now, time.monotonic(), self.base_period_s(),
                           self.contact.until_fence_s() if self.self_fence else None)
        self._sent_problem = problem
        answer = r.json()
        if inline and answer.get("logs") is None:
            # A control plane from before NodeReport.logs ignored them (an upgrade under way):
            # send them the old way, now (after the exit this once) and from here on.
            logger.warning("node=%s control plane ignores output in reports; sending it with POST .../logs",
                           self.node)
            self._inline = False
            await self._ship_logs([(key, offset, offset + len(data)) for key, offset, data in inline])
        else:
            for key, offset, data in inline:
                self._shipped[key] = offset + len(data)
        acked = set(answer.get("ack", []))
        for s in changed:
            self._sent[s.run_id] = _key(s)
        for s in statuses:
            if s.run_id in acked and s.state == "exited":
                # The control plane has the exit: never launch this run again, drop local state.
                self._tombstones.add(s.run_id)
                if self._launched is not None:
                    self._launched.discard(s.run_id)
                self._adopted.discard(s.run_id)
                self._failed.pop(s.run_id, None)
                self._notes.pop(s.run_id, None)
                if self.mounts is not None:
                    await asyncio.to_thread(self.mounts.release, s.run_id)
                self._fenced.discard(s.run_id)
                self._labels.pop(s.run_id, None)
                self._liveness_failed.pop(s.run_id, None)
                self._sent.pop(s.run_id, None)
                self._shipped.pop((s.run_id, "stdout"), None)
                self._shipped.pop((s.run_id, "stderr"), None)
                try:
                    await asyncio.to_thread(self.backend.forget, s.run_id)
                except Exception as exc:  # still running (a launch that failed late): stopped as unassigned
                    logger.warning("node=%s run=%s not forgotten: %s", self.node, s.run_id, describe_error(exc))

    def _answered(self, sent: float, r: httpx.Response) -> None:
        """A report sent at ``sent`` (a contact-clock reading) was answered with ``r``: the contact
        clock moves on, takes the grace the control plane named, and a fenced node is fenced no more."""
        try:
            grace: float | None = float(r.headers[GRACE_HEADER])
        except (KeyError, ValueError):
            grace = None  # a control plane that does not say keeps the grace assumed so far
        before = self.contact.grace_s
        self.contact.answered(sent, grace)
        if self.contact.grace_s != before:
            self._grace_changed.set()
        if self.fenced and not self.contact.must_fence():
            self.fenced = False
            logger.warning("node=%s a control plane answers again: self-fencing over, fenced runs=%s are "
                           "reported ended and not launched again", self.node, ",".join(sorted(self._fenced)))

    async def _ship_logs(self, streams: list[tuple[_StreamKey, int, int]]) -> None:
        """Send each stream's bytes ``[offset, size)`` with ``POST .../logs``, LOG_CHUNK at a time."""
        for key, offset, size in streams:
            run_id, stream = key
            path = self.backend.log_path(run_id, stream)
            if path is None:
                continue
            while offset < size:
                with path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read(min(LOG_CHUNK, size - offset))
                if not chunk:
                    break
                await self._request(
                    "POST", f"/api/v2/nodes/{self.node}/logs",
                    params={"runId": run_id, "stream": stream, "offset": offset},
                    content=chunk,
                    headers={"Content-Type": "application/octet-stream"},
                    timeout=self._exchange_timeout_s(),
                )
                offset += len(chunk)
                self._shipped[key] = offset


#: How long a scraper has to finish the TLS handshake with a node's /metrics server, seconds.
METRICS_HANDSHAKE_TIMEOUT_S = 10.0


def watch_probes(agent: NodeAgent, run_id: str, wire: dict, st: TaskStatus, launch: TaskLaunch) -> None:
    """Have ``agent``'s prober watch the liveness and readiness probes ``wire`` (an assignment's
    ``probes``) of its running run ``run_id`` (status ``st``, launched as ``launch``). A malformed
    probe is logged and not watched; a run already watched is left as it is."""
    try:
        live, ready = probes_from_wire(wire)
    except ValidationError as e:  # a malformed probe never blocks the task itself
        logger.error("node=%s run=%s bad probes: %s", agent.node, run_id, e.message)
        return
    # A re-adopted run is watched the first time; the schedule counts from its real start.
    if agent.prober.state(run_id) is not None:
        return
    # An exec probe is a job's command: it runs where and as the task runs (the backend's
    # exec_prefix), never as the agent's user; a backend that cannot say raises, and the
    # probes are then not watched rather than run as root.
    exec_probe = any(isinstance(p.action, ExecAction) for p in (live, ready) if p is not None)
    prefix = agent.backend.exec_prefix(run_id) if exec_probe else []
    agent.prober.watch(run_id, live, ready, started_at_monotonic=monotonic_from_wall(st.started_at),
                       env=launch.env, cwd=launch.workdir or agent.workdir, exec_prefix=prefix)


def node_task_env(env: dict[str, str], gpus: list[int] | None, faults: SimulatedFaults,
                  runtime: str) -> dict[str, str]:
    """A launch's ``env`` as the node gives it to the task on ``gpus``: the simulated slowdown of
    degraded GPUs (``faults``) and, for the ``process`` runtime, the platform's Python on PATH."""
    # A degraded GPU (simulated fault): the task is told how much slower it should run. Only
    # programs that read it slow down (the stress drill's benchmark does); nothing else changes.
    factor = faults.slowdown(list(gpus or []))
    if factor != 1.0:
        env = {**env, SLOWDOWN_ENV: f"{factor:g}"}
    per_gpu = {g: faults.slowdown([g]) for g in gpus or []}
    if any(f != 1.0 for f in per_gpu.values()):
        env = {**env, SLOWDOWN_GPUS_ENV: ",".join(f"{g}:{f:g}" for g, f in sorted(per_gpu.items()) if f != 1.0)}
    # Process mode: the platform's own Python environment is the task's "image", so a job's
    # `python3 ...` finds numpy and scikit-learn. Prepend it to PATH. A container's image
    # brings its own PATH.
    if runtime != "process":
        return env
    bindir = str(Path(sys.executable).parent)
    path = env.get("PATH") or os.environ.get("PATH", "/usr/bin:/bin")
    return {**env, "PATH": f"{bindir}:{path}"}


def metrics_ssl_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The server-side TLS context of a node's ``/metrics``: its serving certificate ``cert`` and
    key ``key`` (PEM; ``apiary agent join`` writes ``node.crt`` and ``node.key``), TLS 1.2 or
    newer. Raises :class:`~apiary.errors.ValidationError` naming ``metrics-cert`` or
    ``metrics-key`` when a file is missing, or ``metrics-cert`` when the pair does not load."""
    for field, path in (("metrics-cert", cert), ("metrics-key", key)):
        if not path.is_file():
            raise ValidationError(field, f"{path} does not exist")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as e:
        raise ValidationError("metrics-cert", f"cannot load {cert} with {key}: {e}") from e
    return context


def _serve_metrics_tls(registry: Any, host: str, port: int, health: Any, context: ssl.SSLContext) -> Any:
    """:func:`apiary.monitoring.serve_metrics` over HTTPS: the same ``/metrics`` and ``/healthz``
    from a threaded ``http.server`` whose connections are wrapped server-side with ``context``.
    Each connection's handshake runs in its own thread (ThreadingMixIn's), so a client that never
    finishes one delays only itself, for at most :data:`METRICS_HANDSHAKE_TIMEOUT_S`."""
    import json
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    from apiary.monitoring.server import check_health

    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Any) -> Any:
        if environ.get("PATH_INFO") == "/healthz":
            status, body = check_health(health)
            start_response(f"{status} {'OK' if status == 200 else 'Service Unavailable'}",
                           [("Content-Type", "application/json")])
            return [json.dumps(body).encode()]
        return metrics(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            pass

    class TlsServer(ThreadingMixIn, WSGIServer):
        daemon_threads = True

        def finish_request(self, request: Any, client_address: Any) -> None:
            request.settimeout(METRICS_HANDSHAKE_TIMEOUT_S)
            try:
                conn = context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):  # not TLS, or a client that does not trust the certificate
                return
            try:
                super().finish_request(conn, client_address)
            finally:
                self.shutdown_request(conn)

    server = make_server(host, port, app, server_class=TlsServer, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-server-tls", daemon=True).start()
    return server


def serve_node_metrics(node: str, registry: Any, host: str, port: int, health: Any = None,
                       tls: ssl.SSLContext | None = None) -> Any:
    """Serve one node's ``/metrics`` and ``/healthz`` on ``host:port``
    (:func:`apiary.monitoring.serve_metrics`; ``health`` as there); if ``port`` is taken, on any free
    port instead (read ``server.server_port``). With ``tls`` (:func:`metrics_ssl_context`) they
    are served over HTTPS only, with the node's serving certificate, so Prometheus scrapes the
    node verified against the platform CA (as it scrapes a kubelet's ``/metrics``).

    Why not fail: the supervisor fixes the ports before the agent starts, and one taken since
    would make every restart fail the same way. The agent reports the real URL to the control
    plane; only a static Prometheus target for this node goes stale (logged)."""
    from apiary.monitoring import serve_metrics

    def serve(at: int) -> Any:
        if tls is not None:
            return _serve_metrics_tls(registry, host, at, health, tls)
        return serve_metrics(registry, host, at, health)[0]

    try:
        server = serve(port)
    except OSError as exc:
        if not port:
            raise
        server = serve(0)
        logger.warning("node=%s metrics port %d taken (%s); serving on %d instead", node, port, exc,
                       server.server_port)
    return server


def metrics_url(host: str, port: int, *, tls: bool, cert: Path | None = None, node: str = "") -> str:
    """The URL of a node's ``/metrics`` as the agent reports it: ``http(s)://HOST:PORT/metrics``.
    HOST is ``host`` unless it binds every address (``0.0.0.0``, ``::``), then, over TLS, the
    first IP address in the certificate ``cert`` (else its first DNS name, else ``node``): a name
    the certificate holds, so a scraper following the URL verifies it."""
    name = host
    if host in ("", "0.0.0.0", "::") and tls and cert is not None:
        from cryptography import x509

        try:
            sans = x509.load_pem_x509_certificate(cert.read_bytes()).extensions.get_extension_for_class(
                x509.SubjectAlternativeName).value
            ips = [str(a) for a in sans.get_values_for_type(x509.IPAddress)]
            name = (ips + sans.get_values_for_type(x509.DNSName) + [node or host])[0]
        except (OSError, ValueError, x509.ExtensionNotFound):
            name = node or host
    if ":" in name:  # an IPv6 address (RFC 3986 section 3.2.2)
        name = f"[{name}]"
    return f"{'https' if tls else 'http'}://{name}:{port}/metrics"


RUNTIMES = ("process", "docker", "kubernetes")


def make_backend(runtime: str, state_dir: Path, node: str, image_map: dict[str, str] | None = None,
                 cluster: str | None = None) -> Any:
    """The :class:`~apiary.runtime.base.RuntimeBackend` named ``runtime`` for ``node``. Raises
    :class:`~apiary.errors.ValidationError` (field ``runtime``) for an unknown name and what the
    backend's constructor raises (:class:`~apiary.errors.UnavailableError`: dockerd is down)."""
    from apiary.runtime.process import ProcessBackend

    if runtime == "process":
        return ProcessBackend(state_dir)
    if runtime == "docker":
        from apiary.runtime.docker import DockerBackend

        return DockerBackend(state_dir, node=node, image_map=image_map, cluster=cluster)
    if runtime == "kubernetes":
        # Pods in APIARY_K8S_NAMESPACE (default apiary-jobs) of the cluster in APIARY_KUBECONFIG,
        # the pod's service account, or ~/.kube/config (apiary.runtime.kubernetes).
        from apiary.runtime.kubernetes import KubernetesBackend

        return KubernetesBackend(state_dir, node=node)
    raise ValidationError("runtime", f"unknown runtime {runtime!r}; one of {', '.join(RUNTIMES)}")


def recording_problem(backend: RuntimeBackend) -> str | None:
    """Why ``backend`` cannot record runs now, or None when it can: for a backend with a
    ``state_dir``, RECORD_PROBE_BYTES are written to a new file there and removed (a directory that
    is not writable or a disk with no free block fails it; the file systems Apiary runs on reserve
    a write's blocks when it is made, so no fsync is needed; a hidden name, never a run id). A
    backend without one is assumed to record."""
    state_dir = getattr(backend, "state_dir", None)
    if state_dir is None:
        return None
    problem = write_probe(state_dir, RECORD_PROBE_BYTES)
    return None if problem is None else f"cannot write to {problem}"


def new_output(backend: RuntimeBackend, statuses: list[TaskStatus], shipped: dict[_StreamKey, int],
               notes: dict[str, bytes], budget: int,
               ) -> tuple[list[tuple[_StreamKey, int, bytes]], list[tuple[_StreamKey, int, int]]]:
    """The runs' output not shipped yet (``shipped``: bytes sent per stream): ``(inline, rest)``.
    ``inline``: ``((run id, stream), offset, bytes)`` to send with the report, at most ``budget``
    bytes in all (0 once the control plane turned out to ignore them); a run's ``notes`` (why the
    node failed it before it started) are its stderr. ``rest``: ``((run id, stream), offset,
    size)`` of the streams that did not fit, for :meth:`NodeAgent._ship_logs`."""
    inline: list[tuple[_StreamKey, int, bytes]] = []
    rest: list[tuple[_StreamKey, int, int]] = []
    for s in statuses:
        note = notes.get(s.run_id)
        if note is not None and shipped.get((s.run_id, "stderr"), 0) == 0 and len(note) <= budget:
            inline.append(((s.run_id, "stderr"), 0, note))
            budget -= len(note)
            continue
        for stream in _STREAMS:
            path = backend.log_path(s.run_id, stream)
            if path is None or not path.exists():
                continue
            key: _StreamKey = (s.run_id, stream)
            offset = shipped.get(key, 0)
            size = path.stat().st_size
            if size <= offset:
                continue
            if size - offset <= budget:
                with path.open("rb") as f:
                    f.seek(offset)
                    data = f.read(size - offset)
                if data:
                    inline.append((key, offset, data))
                    budget -= len(data)
            else:
                rest.append((key, offset, size))
    return inline, rest


def _secret_values(launch: object) -> list[str]:
    """The strings of an assignment's ``launch`` that may carry a job's secrets once substituted:
    its commands, environment values and registry credentials."""
    if not isinstance(launch, dict):
        return []
    values: list[object] = []
    for key in ("commands", "env", "image_auth", "ssh"):
        item = launch.get(key)
        if isinstance(item, dict):
            values += list(item.values())
        elif isinstance(item, list):
            values += item
    return [v for v in values if isinstance(v, str) and len(v) >= 4]


def describe_error(exc: BaseException, secrets: list[str] | None = None) -> str:
    """``"Type: message"`` of ``exc`` for a log line, with every string of ``secrets`` in the message
    replaced by ``***`` and the whole cut to 500 characters (a launch error may quote the command
    that failed)."""
    message = str(exc)
    for value in sorted(secrets or [], key=len, reverse=True):
        message = message.replace(value, "***")
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= 500 else text[:499] + "…"


def _key(s: TaskStatus) -> tuple:
    return (s.state, s.exit_code, s.started_at, s.lost, s.stopped)


async def run_agents(
    api_url: str | Sequence[str],
    nodes: dict[str, int],
    state_dir: Path,
    *,
    simulated_gpus: bool,
    workdir: str | None = None,
    stop: asyncio.Event | None = None,
    kill_tasks_on_exit: bool = False,
    metrics_ports: dict[str, int] | None = None,
    metrics_host: str = "127.0.0.1",
    tokens: dict[str, str] | None = None,
    runtime: str = "process",
    image_map: dict[str, str] | None = None,
    verify: ssl.SSLContext | bool = True,
    self_fence: bool | None = None,
    node_lost_after_s: float = DEFAULT_NODE_LOST_AFTER_S,
    metrics_tls: tuple[Path, Path] | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    long_poll_s: float = LONG_POLL_S,
) -> None:
    """Run one :class:`NodeAgent` per entry of ``nodes`` (name -> GPU count) in this process,
    each with a :class:`~apiary.runtime.process.ProcessBackend` under ``state_dir/<node>``.

    With ``metrics_ports`` (node -> port; 0 = any free port) every node serves its own
    ``/metrics`` and ``/healthz`` (:class:`~apiary.monitoring.NodeExporter`: GPUs, real through
    NVML or simulated, host and task metrics) and reports the URL to the control plane.
    ``metrics_tls``: ``(certificate, key)`` PEM files of this host's serving certificate
    (``apiary agent join`` writes them): ``/metrics`` is then served over HTTPS only and reported as
    ``https://...`` (:func:`metrics_url`); ValidationError naming ``metrics-cert``/``metrics-key``
    when they do not load.
    ``tokens``: node -> that node agent's bearer token. ``runtime``: ``process`` (default),
    ``docker`` (:class:`~apiary.runtime.docker.DockerBackend` on the local dockerd, with
    ``image_map``) or ``kubernetes`` (:class:`~apiary.runtime.kubernetes.KubernetesBackend`);
    each node keeps its records under ``state_dir/<node>`` as before.

    ``api_url``: every control-plane replica (a list or comma-separated), tried in turn.
    ``verify``: what HTTPS is verified against (:func:`apiary.client.http_verify` of the platform
    CA; True: the system's CAs). ``self_fence``: as :class:`NodeAgent` (None: on unless every URL
    is loopback). ``node_lost_after_s``: the grace assumed until a control plane names its own;
    each node's last contact is kept in ``state_dir/<node>.contact.json``
    (:class:`~apiary.runtime.link.ContactClock`). ``heartbeat_s`` / ``long_poll_s``: every agent's
    :attr:`NodeAgent.heartbeat_s` and :attr:`NodeAgent.long_poll_s`. Raises
    :class:`~apiary.errors.PlaintextTokenError` when a token would go over plain HTTP to a host
    that is not loopback, :class:`~apiary.errors.ValidationError` for a malformed URL.
    """
    from apiary.monitoring import NodeExporter

    stop = stop or asyncio.Event()
    tls = metrics_ssl_context(*metrics_tls) if metrics_tls is not None and metrics_ports is not None else None
    limits = httpx.Limits(max_connections=4 * len(nodes) + 10, max_keepalive_connections=4 * len(nodes) + 10)
    urls = Replicas(api_url).urls
    for name in nodes:  # before anything is sent
        for url in urls:
            check_token_transport(url, (tokens or {}).get(name))
    async with httpx.AsyncClient(limits=limits, verify=verify) as client:
        cluster = None
        if runtime == "docker":  # containers are labelled with the platform they belong to
            cluster = (await client.get(f"{urls[0]}/healthz", timeout=30)).json().get("clusterId")
        agents = [
            NodeAgent(
                name, urls, make_backend(runtime, state_dir / name, name, image_map, cluster), client,
                gpus=gpus, simulated_gpus=simulated_gpus, workdir=workdir, token=(tokens or {}).get(name),
                self_fence=self_fence,
                contact=ContactClock(node_lost_after_s, record=state_dir / f"{name}.contact.json"),
                mounts=TaskMounts(state_dir / f"{name}.mounts"),
            )
            for name, gpus in nodes.items()
        ]
        for agent in agents:
            agent.heartbeat_s, agent.long_poll_s = heartbeat_s, long_poll_s
        servers = []
        for agent in agents:
            if metrics_ports is None:
                break
            agent.exporter = NodeExporter(agent.node, agent.running_tasks, gpus=agent.gpus, simulated=simulated_gpus)
            server = serve_node_metrics(agent.node, agent.exporter.registry, metrics_host,
                                        metrics_ports.get(agent.node, 0), health=agent.health, tls=tls)
            servers.append(server)
            agent.metrics_url = metrics_url(metrics_host, server.server_port, tls=tls is not None,
                                            cert=metrics_tls[0] if metrics_tls else None, node=agent.node)
        logger.info("agents started nodes=%d api=%s self_fence=%s", len(agents), ",".join(urls),
                    agents[0].self_fence if agents else None)
        try:
            await asyncio.gather(*(a.run(stop) for a in agents))
            if kill_tasks_on_exit:
                await asyncio.gather(*(a.stop_all() for a in agents))
                for agent in agents:  # their tasks are gone: so are the mounts they held
                    if agent.mounts is not None:
                        await asyncio.to_thread(agent.mounts.reconcile, set())
        finally:
            # Released task uids still queued: kill what runs as them and free their leases now.
            await asyncio.to_thread(drain_released)
            for server in servers:
                server.shutdown()
                server.server_close()
