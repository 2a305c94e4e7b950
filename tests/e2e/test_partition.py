"""A node partitioned from the control plane past the node-lost grace, then healed, on loopback.

A real control plane (``apiary control-plane``, SQLite, Lab 6's one-VC cluster: both nodes in VC
``default``) declares nodes lost after :data:`GRACE_S`; two node agents run in this process, each
reaching it through its own :class:`Relay`, a TCP relay that can be cut (a cut relay swallows every
byte, in both directions, as a dead link does: requests time out rather than being refused). A
job runs on one node; that node's relay is cut; its agent fences itself and stops the run; the
control plane loses the node and places the job on the other, where it succeeds; healed, the
first agent reports the run it fenced and never starts it again. Throughout, a watcher samples
both nodes' backends: the job never runs on both at once, and the first run's end (its backend
record) precedes the second's start.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.support.builders import LAB6, job_text
from tests.support.polling import nodes_ready, until

from apiary.auth.bootstrap import agent_token_path, read_token
from apiary.client import ApiaryClient, Tenants
from apiary.embedded import REPO_ROOT
from apiary.lifecycle import EXIT_NODE_LOST
from apiary.runtime.agent import NodeAgent
from apiary.runtime.link import ContactClock
from apiary.runtime.process import ProcessBackend
from apiary.tracking.prefect_server import free_port

pytestmark = pytest.mark.e2e

GRACE_S = 8.0
NODES = ("hostname-carol", "hostname-dan")
JOB_S = 10  # the job's sleep: long enough to be cut mid-run, short enough to finish on the other node


class Relay:
    """A TCP relay from ``127.0.0.1:<port>`` to ``127.0.0.1:<target>``, in a thread of its own.

    :meth:`cut` makes it a dead link: bytes of open connections and of new ones are read and
    dropped, nothing is answered (the agent's calls time out, as across a real partition);
    :meth:`heal` relays again (connections cut meanwhile stay broken; the agent opens new ones)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.is_cut = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name=f"relay-{self.port}", daemon=True)
        self.thread.start()

    def cut(self) -> None:
        self.is_cut = True

    def heal(self) -> None:
        self.is_cut = False

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._relay, sock=self.sock))
        self.loop.run_forever()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up: asyncio.StreamWriter | None = None
        try:
            if self.is_cut:
                while await reader.read(65536):
                    pass  # swallowed
                return
            ur, up = await asyncio.open_connection("127.0.0.1", self.target)
            await asyncio.gather(self._pump(reader, up), self._pump(ur, writer))
        except OSError:
            pass
        finally:
            for w in (writer, up):
                if w is not None:
                    w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if not self.is_cut:
                    writer.write(data)
                    await writer.drain()
        finally:
            writer.close()


class Agents:
    """The two node agents, in one asyncio loop on a thread of this process, each through its relay."""

    def __init__(self, api_port: int, home: Path, state: Path) -> None:
        self.relays = {n: Relay(api_port) for n in NODES}
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.agents: dict[str, NodeAgent] = {}
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)

            async def main() -> None:
                async with httpx.AsyncClient() as client:
                    for n in NODES:
                        self.agents[n] = NodeAgent(
                            n, f"http://127.0.0.1:{self.relays[n].port}", ProcessBackend(state / n), client,
                            gpus=1, simulated_gpus=True, workdir=str(REPO_ROOT),
                            token=read_token(agent_token_path(home / "credentials", n)),
                            self_fence=True,  # on loopback it is off by default
                            contact=ContactClock(record=state / f"{n}.contact.json"),
                        )
                    ready.set()
                    await asyncio.gather(*(a.run(self.stop) for a in self.agents.values()))
                    await asyncio.gather(*(a.stop_all() for a in self.agents.values()))

            self.loop.run_until_complete(main())

        self.thread = threading.Thread(target=run, name="agents", daemon=True)
        self.thread.start()
        assert ready.wait(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        for relay in self.relays.values():
            relay.close()


def running(agents: Agents, job_id: str) -> dict[str, list[str]]:
    """node -> the job's runs running there now (from each backend's records)."""
    return {n: [s.run_id for s in a.backend.list() if s.state == "running" and s.run_id.startswith(job_id + ".")]
            for n, a in agents.agents.items()}


@pytest.fixture
def control_plane(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    shutil.copy(LAB6 / "hived-config-one-vc.yaml", home / "cluster.yaml")
    port = free_port()
    env = {**os.environ, "APIARY_HOME": str(home), "APIARY_NODE_LOST_AFTER_S": str(GRACE_S), "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "control-plane.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "apiary", "control-plane", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def answers() -> bool:
        assert proc.poll() is None, (tmp_path / "control-plane.log").read_text()[-3000:]
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until(answers, 60, "the control plane")
        yield port, home
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_a_node_partitioned_past_the_grace_never_runs_the_job_at_the_same_time_as_its_new_node(
        control_plane, tmp_path):
    port, home = control_plane
    admin = ApiaryClient(f"http://127.0.0.1:{port}", token=read_token(home / "token"))
    agents = Agents(port, home, tmp_path / "agents")
    both: list[tuple[float, dict]] = []  # moments the job ran on two nodes
    seen: dict[str, set[str]] = {n: set() for n in NODES}  # node -> the job's runs ever seen running there
    watching = threading.Event()
    try:
        until(lambda: nodes_ready(admin, 2), 60, "both node agents")
        job_id = Tenants(admin).submit(
            job_text(0, taskRoles__train__commands=[f"sleep {JOB_S}"], defaults__virtualCluster="default"), "alice",
        )["id"]

        def watch() -> None:
            while not watching.is_set():
                now = running(agents, job_id)
                for n, runs in now.items():
                    seen[n].update(runs)
                if all(now.values()):
                    both.append((time.time(), now))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, name="watcher", daemon=True)
        watcher.start()
        first_node, first_run = until(lambda: next(((n, r[0]) for n, r in running(agents, job_id).items() if r), None),
                                      60, "the job to run")
        other = next(n for n in NODES if n != first_node)
        cut_at = time.monotonic()
        agents.relays[first_node].cut()
        cut_off = agents.agents[first_node]

        # Self-fencing: the run stops before the control plane may place it elsewhere.
        until(lambda: cut_off.backend.status(first_run).state == "exited", 3 * GRACE_S, "the partitioned node to fence")
        fenced_after = time.monotonic() - cut_at
        first = cut_off.backend.status(first_run)
        assert cut_off.fenced and first.stopped and fenced_after < GRACE_S, fenced_after

        # The control plane loses the node and places the job on the other one.
        second_run = until(lambda: next(iter(running(agents, job_id)[other]), None), 60, "the job on the other node")
        second = agents.agents[other].backend.status(second_run)
        assert second_run != first_run
        assert first.finished_at < second.started_at, (first, second)

        agents.relays[first_node].heal()
        until(lambda: first_run in cut_off._tombstones, 60, "the healed agent to report the run it fenced")
        assert not cut_off.fenced
        job = admin.wait(job_id, timeout=120, poll_s=0.2)
        assert job["state"] == "SUCCEEDED", job
        assert job["retryDetails"] == {"user": 0, "platform": 1}
        events = admin.events(job_id=job_id)
        exits = [(e["data"]["attempt"], e["data"]["exitCode"]) for e in events if e["type"] == "task.exited"]
        assert exits == [(0, EXIT_NODE_LOST), (1, 0)], exits
    finally:
        watching.set()
        agents.close()
    assert both == [], f"the job ran on both nodes at once: {both[:3]}"
    assert seen == {first_node: {first_run}, other: {second_run}}, seen  # never started again after the heal
