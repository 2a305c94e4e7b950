"""A node agent survives any launch error and any bad answer, and launches nothing it cannot record.

The agent runs its real loops (``NodeAgent.run``) over a real :class:`ProcessBackend`, against a fake
control plane (an ``httpx.MockTransport``) whose assignments the test changes; every report the
agent sends is kept. Deadlines are generous: the machine running the suite may be busy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from apiary.lifecycle import EXIT_LAUNCH_FAILED
from apiary.runtime.agent import NodeAgent
from apiary.runtime.base import TaskLaunch, TaskStatus
from apiary.runtime.process import ProcessBackend

SECRET = "s3cr3t-value-9d2e"
GOOD = "alice~j.a0.train.0.t0"
BAD = "alice~j.a0.train.1.t0"  # the backend's launch raises ValueError for it
MALFORMED = "alice~j.a0.train.2.t0"  # its launch has a field TaskLaunch does not take
NEWLINE = "alice~j.a0.train\n.0.t0"  # a task role "train\n" that got through to the node
DEADLINE_S = 30.0


def assignment(run_id: str, desired: str = "RUN", **launch: object) -> dict:
    return {
        "runId": run_id,
        "desired": desired,
        "launch": {
            "run_id": run_id, "job_id": "alice~j", "user": "alice", "job_name": "j", "task_role": "train",
            "index": 0, "commands": [f"echo {SECRET} >/dev/null", "sleep 60"], "env": {"TOKEN": SECRET},
            "gpus": [], "image": None, "cpu": 1, "memory_mb": 1, **launch,
        },
        "labels": {"job": "alice~j", "user": "alice", "virtual_cluster": "default", "task_role": "train",
                   "index": "0"},
    }


class Backend(ProcessBackend):
    """A process backend whose ``launch`` raises ValueError for :data:`BAD` (after the run id checks
    a real backend makes), as a bug in a backend or a library under it would."""

    def launch(self, task: TaskLaunch) -> TaskStatus:
        if task.run_id == BAD:
            raise ValueError(f"cannot launch: command {task.commands[0]!r} is odd")
        return super().launch(task)


class FakePlane:
    """Answers the agent's long polls with ``self.answer`` (a new generation when it changes) and
    acknowledges every exited run it is told about; ``reports`` keeps each report's body."""

    def __init__(self, answer: dict) -> None:
        self.answer = answer
        self.generation = 1
        self.reports: list[dict] = []
        self.polls = 0

    def set(self, answer: dict) -> None:
        self.answer = answer
        self.generation += 1

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/assignments"):
            self.polls += 1
            if request.url.params.get("generation") == str(self.generation):
                await asyncio.sleep(0.05)  # a long poll with nothing new, shortened
            return httpx.Response(200, json={"generation": self.generation, **self.answer})
        if request.url.path.endswith("/status"):
            body = json.loads(request.content)
            self.reports.append(body)
            acked = [r["run_id"] for r in body["runs"] if r["state"] == "exited"]
            return httpx.Response(200, json={"ack": acked, "logs": [0] * len(body.get("logs", []))})
        return httpx.Response(200, json={"size": 0})

    def last(self, run_id: str) -> dict | None:
        """The newest status of ``run_id`` the agent reported, or None."""
        for body in reversed(self.reports):
            for run in body["runs"]:
                if run["run_id"] == run_id:
                    return run
        return None


def make_agent(tmp_path: Path, plane: FakePlane, backend: ProcessBackend | None = None) -> NodeAgent:
    client = httpx.AsyncClient(transport=httpx.MockTransport(plane.handle))
    return NodeAgent("n1", "http://plane", backend or Backend(tmp_path / "state"), client, gpus=1,
                     simulated_gpus=True, workdir=str(tmp_path))


async def until(what: str, check: Callable[[], object], deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        await asyncio.sleep(0.05)


def run_agent(agent: NodeAgent, scenario: Callable[[], object]) -> None:
    """Run ``agent`` while the coroutine ``scenario()`` plays; stop it and its tasks afterwards."""

    async def main() -> None:
        stop = asyncio.Event()
        loops = asyncio.create_task(agent.run(stop))
        try:
            await scenario()  # type: ignore[misc]
        finally:
            stop.set()
            await loops
            await agent.stop_all()
            await agent.client.aclose()

    asyncio.run(main())


@pytest.mark.e2e  # real task processes
def test_an_agent_survives_launch_errors_and_still_applies_a_stop(tmp_path: Path, caplog) -> None:
    """A backend's ValueError, a launch with a field TaskLaunch does not know (TypeError) and a run
    id with a newline (the backend's ValidationError) each fail their own run with EXIT_LAUNCH_FAILED;
    the good run beside them launches, and a later STOP of it is still applied."""
    caplog.set_level(logging.INFO, logger="apiary.runtime.agent")
    plane = FakePlane({"assignments": [assignment(BAD), assignment(MALFORMED, bogus=1), assignment(NEWLINE),
                                       assignment(GOOD)], "faults": []})
    agent = make_agent(tmp_path, plane)

    async def scenario() -> None:
        await until("the good run reported running", lambda: (plane.last(GOOD) or {}).get("state") == "running")
        for run_id in (BAD, MALFORMED, NEWLINE):
            await until(f"{run_id!r} reported failed", lambda r=run_id: plane.last(r) is not None)
            run = plane.last(run_id)
            assert run is not None
            assert (run["state"], run["exit_code"], run["lost"]) == ("exited", EXIT_LAUNCH_FAILED, False)
        plane.set({"assignments": [assignment(GOOD, "STOP")], "faults": []})
        await until("the good run reported stopped", lambda: (plane.last(GOOD) or {}).get("state") == "exited")
        assert plane.last(GOOD)["stopped"] is True

    run_agent(agent, scenario)
    # The failed runs were never started; nothing of them is left running.
    assert [s.run_id for s in agent.backend.list() if s.state == "running"] == []
    failures = [r.getMessage() for r in caplog.records if "launch failed" in r.getMessage()]
    assert len(failures) == 3 and any("ValueError" in m for m in failures) and any("TypeError" in m for m in failures)
    assert not any(SECRET in r.getMessage() for r in caplog.records)


@pytest.mark.e2e  # real task processes
def test_the_watcher_outlives_an_answer_it_cannot_apply(tmp_path: Path, monkeypatch) -> None:
    """An assignments answer that makes applying it raise (a malformed fault, no ``assignments``)
    is logged and polled again; the watcher does not end while the heartbeats go on."""
    monkeypatch.setattr("apiary.runtime.agent.WATCH_ERROR_BACKOFF_S", 0.3)
    plane = FakePlane({"faults": [{"id": "not-a-number", "gpu": 0}], "assignments": []})
    agent = make_agent(tmp_path, plane)

    async def scenario() -> None:
        await until("a heartbeat", lambda: plane.reports)
        polls = plane.polls
        await until("the watcher polls again after the bad answer", lambda: plane.polls >= polls + 2)
        plane.set({"faults": []})  # no "assignments" at all
        polls = plane.polls
        await until("the watcher polls again", lambda: plane.polls >= polls + 2)
        plane.set({"assignments": [assignment(GOOD)], "faults": []})
        await until("the good run launched", lambda: (plane.last(GOOD) or {}).get("state") == "running")

    run_agent(agent, scenario)


@pytest.mark.e2e  # real task processes
def test_an_agent_that_cannot_record_launches_nothing_and_says_so(tmp_path: Path) -> None:
    """Its state directory unusable (here a file where the directory was: refused even to root), the
    agent leaves a new run unlaunched (not failed: nothing of it ran), reports ``cannotRecord`` and
    its node's /healthz says unhealthy; once it can record again the run launches."""
    state = tmp_path / "state"
    plane = FakePlane({"assignments": [], "faults": []})
    agent = make_agent(tmp_path, plane, ProcessBackend(state))

    async def scenario() -> None:
        await until("a heartbeat", lambda: plane.reports)
        assert plane.reports[-1].get("cannotRecord") is None and agent.health() == (True, "")
        shutil.rmtree(state)
        state.write_text("not a directory")
        plane.set({"assignments": [assignment(GOOD)], "faults": []})
        await until("cannotRecord reported", lambda: plane.reports[-1].get("cannotRecord"))
        ok, reason = agent.health()
        assert not ok and "cannot record" in reason
        await asyncio.sleep(0.5)  # reconciles come and go: still nothing launched, nothing failed
        assert plane.last(GOOD) is None and GOOD not in agent._failed
        state.unlink()
        state.mkdir()
        plane.set({"assignments": [assignment(GOOD)], "faults": []})
        await until("the run launched", lambda: (plane.last(GOOD) or {}).get("state") == "running")
        await until("cannotRecord cleared", lambda: plane.reports[-1].get("cannotRecord") is None)
        assert agent.health() == (True, "")

    run_agent(agent, scenario)


@pytest.mark.parametrize("secret", [SECRET, "x" * 600])
def test_describe_error_blanks_secrets_and_stays_short(secret: str) -> None:
    from apiary.runtime.agent import describe_error

    text = describe_error(ValueError(f"bad command {secret!r}"), [secret])
    assert secret not in text and text.startswith("ValueError: bad command") and len(text) <= 500


def test_the_nodes_healthz_answers_503_while_its_agent_cannot_record(tmp_path: Path) -> None:
    """What ``run_agents`` serves for a node: ``/healthz`` is the agent's verdict."""
    from prometheus_client import CollectorRegistry

    from apiary.runtime.agent import serve_node_metrics

    agent = make_agent(tmp_path, FakePlane({"assignments": []}))
    server = serve_node_metrics("n1", CollectorRegistry(), "127.0.0.1", 0, health=agent.health)
    try:
        url = f"http://127.0.0.1:{server.server_port}/healthz"
        assert httpx.get(url, timeout=5).status_code == 200
        agent.record_problem = "cannot write to /var/lib/apiary: No space left on device"
        r = httpx.get(url, timeout=5)
        assert r.status_code == 503 and "n1 cannot record runs" in r.json()["reason"]
    finally:
        server.shutdown()
        server.server_close()
        asyncio.run(agent.client.aclose())
