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
tasks keep running meanwhile.

Several agents may share one process (``apiary agent --node a --node b``), one asyncio task
group each, over one HTTP client: that is how the embedded platform runs many simulated nodes
without one process per node.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from apiary.errors import PlatformError, UnavailableError, ValidationError
from apiary.lifecycle import EXIT_LAUNCH_FAILED, EXIT_LIVENESS_FAILED
from apiary.runtime.base import RuntimeBackend, TaskLaunch, TaskStatus
from apiary.runtime.probes import Prober, monotonic_from_wall, probes_from_wire

if TYPE_CHECKING:  # imported for real in run_agents: agents without metrics never load it
    from apiary.monitoring import NodeExporter

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
REPORT_POLL_S = 0.25
LONG_POLL_S = 10.0
LOG_CHUNK = 256 * 1024
#: Output sent with a report rather than with POST .../logs: the control plane's cap
#: (apiary.api.schemas.MAX_INLINE_LOG_BYTES; a test keeps the two equal).
MAX_INLINE_LOG_BYTES = 64 * 1024
#: Set for tasks on a GPU with an injected ``degraded`` fault: the slowdown factor (a simulation;
#: examples/stress/bench.py honours it).
SLOWDOWN_ENV = "APIARY_SIMULATED_SLOWDOWN"
_STREAMS: tuple[Literal["stdout"], Literal["stderr"]] = ("stdout", "stderr")
_StreamKey = tuple[str, Literal["stdout", "stderr"]]  # (run id, stream)


class NodeAgent:
    """The agent of one node. ``run`` until ``stop`` is set; on stop it leaves tasks running
    unless ``kill_tasks_on_exit`` (a clean shutdown of the embedded platform sets it)."""

    def __init__(
        self,
        node: str,
        api_url: str,
        backend: RuntimeBackend,
        client: httpx.AsyncClient,
        *,
        gpus: int,
        simulated_gpus: bool,
        address: str = "127.0.0.1",
        workdir: str | None = None,
        metrics_url: str | None = None,
        token: str | None = None,
    ) -> None:
        self.node = node
        # The node's own credential: the control plane lets it act for this node only.
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.api = api_url.rstrip("/")
        self.backend = backend
        self.client = client
        self.gpus = gpus
        self.simulated_gpus = simulated_gpus
        self.address = address
        self.workdir = workdir or os.getcwd()
        self.agent_id = uuid.uuid4().hex[:12]
        self._tombstones: set[str] = set()
        # Statuses the backend cannot give: launch failures and runs stopped before launch.
        self._failed: dict[str, TaskStatus] = {}
        self._stopping: set[str] = set()
        self._sent: dict[str, tuple] = {}
        self._shipped: dict[tuple[str, str], int] = {}
        self._inline = True  # output rides in reports (NodeReport.logs) unless the control plane ignores it
        self._report_now = asyncio.Event()
        self._last_beat = 0.0
        self.metrics_url = metrics_url
        self.exporter: NodeExporter | None = None  # set by run_agents when metrics are served
        self._labels: dict[str, dict] = {}  # run_id -> metric labels and gpus, from the assignments
        self._faults_applied = 0
        self._degraded: dict[int, float] = {}  # GPU -> simulated slowdown factor (fault `degraded`)
        self.prober = Prober()  # Kubernetes-style liveness / readiness probes of running tasks
        self._liveness_failed: dict[str, str] = {}

    # ------------------------------------------------------------------ main loops
    async def run(self, stop: asyncio.Event) -> None:
        watch = asyncio.create_task(self._watch(stop))
        report = asyncio.create_task(self._report(stop))
        await stop.wait()
        for t in (watch, report):
            t.cancel()
        await asyncio.gather(watch, report, return_exceptions=True)

    async def stop_all(self) -> None:
        runs = await asyncio.to_thread(self.backend.list)
        await asyncio.gather(
            *(asyncio.to_thread(self.backend.stop, r.run_id, 3.0) for r in runs if r.state == "running")
        )

    async def _watch(self, stop: asyncio.Event) -> None:
        generation: int | None = None
        backoff = 0.2
        while not stop.is_set():
            params = {} if generation is None else {"generation": generation, "wait": LONG_POLL_S}
            try:
                r = await self.client.get(
                    f"{self.api}/api/v2/nodes/{self.node}/assignments", params=params, timeout=LONG_POLL_S + 5,
                    headers=self._auth,
                )
                r.raise_for_status()
                data = r.json()
            except (httpx.HTTPError, ValueError) as e:
                logger.debug("node=%s assignments unavailable: %s", self.node, e)
                generation = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.2
            generation = data["generation"]
            # Faults first: a task launched in this reconcile already runs on a degraded GPU
            # queued before it was assigned.
            self._apply_faults(data.get("faults", []))
            await asyncio.to_thread(self._reconcile, data["assignments"])
            self._report_now.set()

    def running_tasks(self) -> list[dict]:
        """The node's running tasks for its task metrics: labels, process group id, GPUs."""
        return [
            {**self._labels[st.run_id], "pid": st.pid}
            for st in self.backend.list()
            if st.state == "running" and st.pid and st.run_id in self._labels
        ]

    def _apply_faults(self, faults: list[dict]) -> None:
        """Apply injected simulated-GPU faults queued by the control plane, each once, in order.

        ``degraded`` (a slowdown factor) is also kept here, exporter or not: tasks launched later on
        that GPU get ``APIARY_SIMULATED_SLOWDOWN`` (:meth:`slowdown`); ``clear`` resets it."""
        for f in faults:
            if f["id"] <= self._faults_applied:
                continue
            self._faults_applied = f["id"]
            if f.get("clear"):
                self._degraded.pop(f["gpu"], None)
            elif f.get("degraded") is not None:
                self._degraded[f["gpu"]] = float(f["degraded"])
                logger.info("node=%s gpu=%s degraded x%s (simulated)", self.node, f["gpu"], f["degraded"])
            if self.exporter is None or self.exporter.simulated is None:
                if f.get("degraded") is None:
                    logger.warning("node=%s fault %s ignored: no simulated GPUs", self.node, f)
                continue
            kinds = {k: v for k, v in f.items() if k not in ("id", "gpu", "clear")}
            try:
                if f.get("clear"):
                    self.exporter.clear(f["gpu"])
                else:
                    self.exporter.inject(f["gpu"], **kinds)
                logger.info("node=%s fault applied %s", self.node, f)
            except (ValueError, TypeError) as e:
                logger.warning("node=%s fault %s rejected: %s", self.node, f, e)

    def _reconcile(self, assignments: list[dict]) -> None:
        wanted: dict[str, dict] = {a["runId"]: a for a in assignments}
        for run_id, a in wanted.items():
            if "labels" in a:
                self._labels[run_id] = {**a["labels"], "gpus": list(a["launch"].get("gpus", []))}
        for run_id, a in wanted.items():
            if run_id in self._tombstones or run_id in self._failed:
                continue
            if a["desired"] == "RUN":
                env = self._env(a["launch"]["env"], a["launch"].get("gpus"))
                launch = TaskLaunch(**{**a["launch"], "workdir": self.workdir, "env": env})
                try:
                    st = self.backend.launch(launch)
                    if st.state == "running" and a.get("probes") and not self.backend.runs_probes:
                        self._watch_probes(run_id, a["probes"], st, launch)
                except UnavailableError as e:
                    # dockerd or the API server is away for a moment: not the task's fault, and
                    # -1203 would be permanent. The next assignment poll launches it again.
                    logger.warning("node=%s run=%s launch deferred: %s", self.node, run_id, e)
                except PlatformError as e:
                    logger.error("node=%s run=%s launch failed: %s", self.node, run_id, e)
                    now = time.time()
                    self._failed[run_id] = TaskStatus(
                        run_id=run_id, state="exited", exit_code=EXIT_LAUNCH_FAILED, pid=None,
                        started_at=now, finished_at=now,
                    )
            elif self.backend.status(run_id) is None:
                # Asked to stop a run this node never started (stopped before it was launched):
                # report it ended so the control plane can finish the attempt, and never launch it.
                now = time.time()
                self._failed[run_id] = TaskStatus(
                    run_id=run_id, state="exited", exit_code=None, pid=None, started_at=None, finished_at=now,
                    stopped=True,
                )
            else:
                self._stop_async(run_id)
        for st in self.backend.list():
            if st.state == "running" and st.run_id not in wanted:
                logger.warning("node=%s run=%s not assigned here any more: stopping it", self.node, st.run_id)
                self._stop_async(st.run_id)

    def _watch_probes(self, run_id: str, wire: dict, st: TaskStatus, launch: TaskLaunch) -> None:
        try:
            live, ready = probes_from_wire(wire)
        except ValidationError as e:  # a malformed probe never blocks the task itself
            logger.error("node=%s run=%s bad probes: %s", self.node, run_id, e.message)
            return
        # watch() ignores repeats, so re-adopted runs are covered too; the schedule counts from the
        # run's real start.
        self.prober.watch(run_id, live, ready, started_at_monotonic=monotonic_from_wall(st.started_at),
                          env=launch.env, cwd=launch.workdir or self.workdir)

    async def _probe(self, run_id: str) -> None:
        res = await asyncio.to_thread(self.prober.check, run_id)
        if res.live_failed and run_id not in self._liveness_failed:
            logger.warning("node=%s run=%s liveness probe failed: %s", self.node, run_id, res.message)
            self._liveness_failed[run_id] = res.message
            self._stop_async(run_id)
            self._report_now.set()

    def slowdown(self, gpus: list[int]) -> float:
        """The simulated slowdown factor of a task on ``gpus`` (the largest ``degraded`` fault among
        them; for a task without GPUs, the node's largest); 1.0 when none is degraded."""
        factors = [self._degraded.get(g, 1.0) for g in gpus] if gpus else list(self._degraded.values())
        return max(factors, default=1.0)

    def _env(self, env: dict[str, str], gpus: list[int] | None = None) -> dict[str, str]:
        # A degraded GPU (simulated fault): the task is told how much slower it should run. Only
        # programs that read it slow down (the stress drill's benchmark does); nothing else changes.
        factor = self.slowdown(list(gpus or []))
        if factor != 1.0:
            env = {**env, SLOWDOWN_ENV: f"{factor:g}"}
        # Process mode: the platform's own Python environment is the task's "image", so a job's
        # `python3 ...` finds numpy and scikit-learn. Prepend it to PATH. A container's image
        # brings its own PATH.
        if self.backend.name != "process":
            return env
        bindir = str(Path(sys.executable).parent)
        path = env.get("PATH") or os.environ.get("PATH", "/usr/bin:/bin")
        return {**env, "PATH": f"{bindir}:{path}"}

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
                await asyncio.sleep(0.5)

    async def _report_once(self) -> None:
        statuses = await asyncio.to_thread(self.backend.list)
        statuses = [s for s in statuses if s.run_id not in self._tombstones] + list(self._failed.values())
        # A task killed for failing its liveness probe is a failure with the platform's exit code
        # (EXIT_LIVENESS_FAILED), not the 143/137 of the stop itself.
        statuses = [
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
        inline, rest = self._new_output(statuses)
        await self._ship_logs(rest)
        now = time.monotonic()
        if not changed and not inline and now - self._last_beat < HEARTBEAT_S:
            return
        body = {
            "agentId": self.agent_id,
            "metricsUrl": self.metrics_url,
            "gpus": self.gpus,
            "simulatedGpus": self.simulated_gpus,
            "address": self.address,
            # The high-water mark of applied fault ids: the control plane drops those from its queue.
            "faultsApplied": self._faults_applied or None,
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
        r = await self.client.post(f"{self.api}/api/v2/nodes/{self.node}/status", json=body, timeout=30,
                                   headers=self._auth)
        r.raise_for_status()
        self._last_beat = now
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
                self._failed.pop(s.run_id, None)
                self._labels.pop(s.run_id, None)
                self._liveness_failed.pop(s.run_id, None)
                self._sent.pop(s.run_id, None)
                self._shipped.pop((s.run_id, "stdout"), None)
                self._shipped.pop((s.run_id, "stderr"), None)
                await asyncio.to_thread(self.backend.forget, s.run_id)

    def _new_output(
        self, statuses: list[TaskStatus],
    ) -> tuple[list[tuple[_StreamKey, int, bytes]], list[tuple[_StreamKey, int, int]]]:
        """The runs' output not shipped yet: ``(inline, rest)``. ``inline``: ``((run id, stream),
        offset, bytes)`` to send with the report, at most MAX_INLINE_LOG_BYTES in all (none once the
        control plane turned out to ignore them); ``rest``: ``((run id, stream), offset, size)`` of
        the streams that did not fit, for :meth:`_ship_logs`."""
        inline: list[tuple[_StreamKey, int, bytes]] = []
        rest: list[tuple[_StreamKey, int, int]] = []
        budget = MAX_INLINE_LOG_BYTES if self._inline else 0
        for s in statuses:
            for stream in _STREAMS:
                path = self.backend.log_path(s.run_id, stream)
                if path is None or not path.exists():
                    continue
                key: _StreamKey = (s.run_id, stream)
                offset = self._shipped.get(key, 0)
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
                r = await self.client.post(
                    f"{self.api}/api/v2/nodes/{self.node}/logs",
                    params={"runId": run_id, "stream": stream, "offset": offset},
                    content=chunk,
                    headers={"Content-Type": "application/octet-stream", **self._auth},
                    timeout=30,
                )
                r.raise_for_status()
                offset += len(chunk)
                self._shipped[key] = offset


def serve_node_metrics(node: str, registry: Any, host: str, port: int) -> Any:
    """Serve one node's ``/metrics`` on ``host:port`` (:func:`apiary.monitoring.serve_metrics`);
    if ``port`` is taken, on any free port instead (read ``server.server_port``).

    Why not fail: the supervisor fixes the ports before the agent starts, and one taken since
    would make every restart fail the same way. The agent reports the real URL to the control
    plane; only a static Prometheus target for this node goes stale (logged)."""
    from apiary.monitoring import serve_metrics

    try:
        server, _ = serve_metrics(registry, host, port)
    except OSError as exc:
        if not port:
            raise
        server, _ = serve_metrics(registry, host, 0)
        logger.warning("node=%s metrics port %d taken (%s); serving on %d instead", node, port, exc,
                       server.server_port)
    return server


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


def _key(s: TaskStatus) -> tuple:
    return (s.state, s.exit_code, s.started_at, s.lost, s.stopped)


async def run_agents(
    api_url: str,
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
) -> None:
    """Run one :class:`NodeAgent` per entry of ``nodes`` (name -> GPU count) in this process,
    each with a :class:`~apiary.runtime.process.ProcessBackend` under ``state_dir/<node>``.

    With ``metrics_ports`` (node -> port; 0 = any free port) every node serves its own
    ``/metrics`` and ``/healthz`` (:class:`~apiary.monitoring.NodeExporter`: GPUs, real through
    NVML or simulated, host and task metrics) and reports the URL to the control plane.
    ``tokens``: node -> that node agent's bearer token. ``runtime``: ``process`` (default),
    ``docker`` (:class:`~apiary.runtime.docker.DockerBackend` on the local dockerd, with
    ``image_map``) or ``kubernetes`` (:class:`~apiary.runtime.kubernetes.KubernetesBackend`);
    each node keeps its records under ``state_dir/<node>`` as before.
    """
    from apiary.monitoring import NodeExporter

    stop = stop or asyncio.Event()
    limits = httpx.Limits(max_connections=4 * len(nodes) + 10, max_keepalive_connections=4 * len(nodes) + 10)
    async with httpx.AsyncClient(limits=limits) as client:
        cluster = None
        if runtime == "docker":  # containers are labelled with the platform they belong to
            cluster = (await client.get(f"{api_url}/healthz", timeout=30)).json().get("clusterId")
        agents = [
            NodeAgent(
                name, api_url, make_backend(runtime, state_dir / name, name, image_map, cluster), client,
                gpus=gpus, simulated_gpus=simulated_gpus, workdir=workdir, token=(tokens or {}).get(name),
            )
            for name, gpus in nodes.items()
        ]
        servers = []
        for agent in agents:
            if metrics_ports is None:
                break
            agent.exporter = NodeExporter(agent.node, agent.running_tasks, gpus=agent.gpus, simulated=simulated_gpus)
            server = serve_node_metrics(agent.node, agent.exporter.registry, metrics_host,
                                        metrics_ports.get(agent.node, 0))
            servers.append(server)
            agent.metrics_url = f"http://{metrics_host}:{server.server_port}/metrics"
        logger.info("agents started nodes=%d api=%s", len(agents), api_url)
        try:
            await asyncio.gather(*(a.run(stop) for a in agents))
            if kill_tasks_on_exit:
                await asyncio.gather(*(a.stop_all() for a in agents))
        finally:
            for server in servers:
                server.shutdown()
                server.server_close()
