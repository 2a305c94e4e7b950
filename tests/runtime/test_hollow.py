"""Hollow nodes (apiary.runtime.hollow): the timer backend's semantics with a fake clock, the hollow
agent's reconcile bookkeeping, and (e2e) 20 hollow nodes against a real control plane on loopback whose
jobs succeed, fail with their exit code, and stop."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from apiary.errors import PlatformError, ValidationError
from apiary.runtime import hollow
from apiary.runtime.base import TaskLaunch
from apiary.runtime.hollow import (
    DEFAULT_DURATION_S,
    EXIT_STOPPED,
    GcPauses,
    HollowAgent,
    HollowBackend,
    report_error_kind,
    run_hollow_nodes,
    task_plan,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def launch(run_id: str, *commands: str, gpus: list[int] | None = None, env: dict | None = None) -> TaskLaunch:
    return TaskLaunch(run_id=run_id, job_id="alice~j", user="alice", job_name="j", task_role="main", index=0,
                      commands=list(commands), gpus=gpus or [0], env=env or {})


@pytest.mark.parametrize(("commands", "env", "plan"), [
    (["sleep 5"], None, (5.0, 0)),
    (["echo hi", "sleep 1.5 && sleep 2"], None, (3.5, 0)),
    (["python train.py"], None, (DEFAULT_DURATION_S, 0)),
    (["sleep 2; exit 3"], None, (2.0, 3)),
    (["sleep 2"], {"APIARY_HOLLOW_DURATION_S": "0.25"}, (0.25, 0)),
    (["nosleep 4", "sleepy 3"], None, (DEFAULT_DURATION_S, 0)),  # only the word sleep counts
])
def test_task_plan_convention(commands: list[str], env: dict | None, plan: tuple[float, int]) -> None:
    assert task_plan(commands, env) == plan


@pytest.mark.parametrize("bad", ["soon", "-1", "nan"])
def test_task_plan_refuses_a_bad_duration_naming_the_variable(bad: str) -> None:
    with pytest.raises(ValidationError) as e:
        task_plan(["sleep 1"], {"APIARY_HOLLOW_DURATION_S": bad})
    assert e.value.field == "env.APIARY_HOLLOW_DURATION_S"


def test_a_task_runs_for_its_duration_then_exits_with_its_code() -> None:
    clock = Clock()
    b = HollowBackend(gpus=8, clock=clock)
    st = b.launch(launch("alice~j.a0.main.0.t0", "sleep 10"))
    assert st.running and st.started_at == clock.now and st.pid is None
    assert b.next_exit() == clock.now + 10
    clock.now += 9.9
    assert b.status("alice~j.a0.main.0.t0").running
    clock.now += 0.2
    st = b.status("alice~j.a0.main.0.t0")
    assert st.state == "exited" and st.exit_code == 0 and st.succeeded and st.finished_at == clock.now - 0.1
    assert b.next_exit() is None
    failing = b.launch(launch("alice~j.a0.main.0.t1", "sleep 1; exit 7"))
    clock.now += 1
    assert b.status(failing.run_id).exit_code == 7 and not b.status(failing.run_id).succeeded


def test_stop_ends_a_running_task_with_the_killed_code_and_is_idempotent() -> None:
    clock = Clock()
    b = HollowBackend(clock=clock)
    b.launch(launch("r1", "sleep 60"))
    clock.now += 3
    b.stop("r1", grace_s=5)
    b.stop("r1")
    b.stop("unknown")  # silent
    st = b.status("r1")
    assert st.state == "exited" and st.stopped and st.exit_code == EXIT_STOPPED == 143
    assert st.finished_at == clock.now
    clock.now += 100  # the timer's end changes nothing once stopped
    assert b.status("r1").exit_code == 143
    # stopping a task that already ended on its own leaves its own exit
    b.launch(launch("r2", "sleep 1"))
    clock.now += 2
    b.stop("r2")
    assert b.status("r2").exit_code == 0 and not b.status("r2").stopped


def test_launch_is_idempotent_list_is_ordered_and_forget_keeps_the_record() -> None:
    clock = Clock()
    b = HollowBackend(clock=clock)
    first = b.launch(launch("r-b", "sleep 5"))
    clock.now += 1
    assert b.launch(launch("r-b", "sleep 99")) == b.status("r-b")  # not started again
    assert b.status("r-b").started_at == first.started_at
    b.launch(launch("r-a", "sleep 1"))
    assert [s.run_id for s in b.list()] == ["r-a", "r-b"]
    with pytest.raises(PlatformError):
        b.forget("r-b")  # still running
    clock.now += 1
    b.forget("r-a")
    b.forget("never")
    assert [s.run_id for s in b.list()] == ["r-b"]
    assert b.status("r-a").exit_code == 0
    assert b.launch(launch("r-a", "sleep 1")).state == "exited"  # never started twice
    assert b.status("unknown") is None and b.log_path("r-a", "stdout") is None


def test_a_new_backend_knows_no_runs_so_a_restarted_hollow_node_adopts_nothing() -> None:
    b = HollowBackend()
    b.launch(launch("r1", "sleep 60"))
    again = HollowBackend()
    assert again.list() == [] and again.status("r1") is None


def test_launch_refuses_bad_run_ids_and_gpus_off_the_node() -> None:
    b = HollowBackend(gpus=2)
    with pytest.raises(ValidationError) as e:
        b.launch(launch(".hidden", "sleep 1"))
    assert e.value.field == "run_id"
    with pytest.raises(ValidationError) as e:
        b.launch(launch("r1", "sleep 1", gpus=[2]))
    assert e.value.field == "gpus"


def test_hollow_agent_records_when_it_first_saw_each_run_assignment() -> None:
    agent = HollowAgent("n1", "http://unused", HollowBackend(gpus=1), client=None)  # type: ignore[arg-type]
    a = {"runId": "alice~j.a0.main.0.t0", "desired": "RUN",
         "launch": {"run_id": "alice~j.a0.main.0.t0", "job_id": "alice~j", "user": "alice", "job_name": "j",
                    "task_role": "main", "index": 0, "commands": ["sleep 30"], "env": {}, "gpus": [0]},
         "labels": {"job": "alice~j", "task_role": "main", "index": "0"}}
    t0 = time.time()
    agent._reconcile([a])
    seen = agent.stats.received["alice~j.a0.main.0.t0"]
    assert seen["job"] == "alice~j" and seen["taskRole"] == "main" and seen["index"] == "0"
    assert t0 <= seen["at"] <= time.time()
    agent._reconcile([a])
    assert agent.stats.received["alice~j.a0.main.0.t0"]["at"] == seen["at"]
    assert [s.run_id for s in agent.backend.list()] == ["alice~j.a0.main.0.t0"]
    with pytest.raises(ValidationError):
        HollowAgent("n1", "http://unused", HollowBackend(), client=None, heartbeat_s=0.5)  # type: ignore[arg-type]



def test_a_failed_report_is_recorded_with_its_time_and_kind() -> None:
    answers = iter([httpx.Response(503, json={"code": "UnavailableError", "message": "busy"}),
                    httpx.ReadTimeout("slow"), httpx.Response(200, json={"ack": []})])

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def go() -> HollowAgent:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            agent = HollowAgent("n1", "http://cp.test", HollowBackend(gpus=1), client=client)
            for _ in range(2):
                with pytest.raises(httpx.HTTPError):
                    await agent._report_once()
            await agent._report_once()
            return agent

    t0 = time.time()
    agent = asyncio.run(go())
    assert [kind for _, kind in agent.stats.report_errors] == ["HTTP 503", "ReadTimeout"]
    assert all(t0 <= t <= time.time() for t, _ in agent.stats.report_errors)
    assert len(agent.stats.beats) == 1  # the third one was answered
    assert agent.stats.beats[0][2] == hollow.BARE  # nothing to tell but the node's facts
    assert report_error_kind(httpx.ConnectError("refused")) == "ConnectError"


def test_a_report_is_bare_only_without_runs_output_or_trouble() -> None:
    facts = {"agentId": "a", "gpus": 8, "simulatedGpus": True, "address": "127.0.0.1", "runs": [],
             "cannotRecord": None}
    assert hollow.report_kind(facts) == hollow.BARE
    assert hollow.report_kind({**facts, "runs": [{"run_id": "r", "state": "running"}]}) == hollow.RUNS
    assert hollow.report_kind({**facts, "logs": [{"runId": "r", "stream": "stdout", "offset": 0, "data": ""}]}) \
        == hollow.RUNS
    assert hollow.report_kind({**facts, "cannotRecord": "disk full"}) == hollow.RUNS
    assert hollow.report_kind(None) == hollow.RUNS


def test_gc_pauses_records_collections_at_least_as_long_as_its_floor() -> None:
    with GcPauses(min_s=0.0) as every:
        gc.collect()
    assert every.pauses and every.pauses[-1][1] == 2 and every.pauses[-1][2] >= 0.0
    assert every._callback not in gc.callbacks  # removed on exit
    with GcPauses(min_s=3600.0) as none:
        gc.collect()
    assert none.pauses == []


def test_the_heap_is_settled_once_after_every_agent_had_a_report_answered(monkeypatch) -> None:
    settled: list[int] = []
    agents = [HollowAgent(f"n{i}", "http://unused", HollowBackend(), client=None)  # type: ignore[arg-type]
              for i in range(3)]

    async def go() -> None:
        monkeypatch.setattr(hollow.gcpolicy, "settle", lambda: settled.append(sum(bool(a.stats.beats) for a in agents)))
        stop = asyncio.Event()
        task = asyncio.create_task(hollow._settle_once_joined(agents, stop, poll_s=0.01))
        for a in agents:
            await asyncio.sleep(0.03)
            assert not settled  # not while an agent has had no answer
            a.stats.beats.append((time.time(), 0.001, hollow.BARE))
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
    assert settled == [3]  # once, with every agent answered

# ---------------------------------------------------------------------- against a real control plane
NODES = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster(nodes: int) -> dict:
    return {
        "physicalCluster": {
            "skuTypes": {"GPU": {"gpu": 1, "cpu": 4, "memory": "32Gi"}},
            "cellTypes": {"NODE": {"childCellType": "GPU", "childCellNumber": 2, "isNodeLevel": True},
                          "POOL": {"childCellType": "NODE", "childCellNumber": nodes}},
            "physicalCells": [{"cellType": "POOL",
                               "cellChildren": [{"cellAddress": f"hn-{i:02d}"} for i in range(nodes)]}],
        },
        "virtualClusters": {"default": {"virtualCells": [{"cellType": "POOL.NODE", "cellNumber": nodes}]}},
    }


def _job(name: str, command: str) -> str:
    return f"""\
protocolVersion: 2
name: {name}
type: job
prerequisites:
  - {{protocolVersion: 2, name: img, type: dockerimage, uri: python:3.11-slim}}
taskRoles:
  main:
    instances: 1
    dockerImage: img
    resourcePerInstance: {{cpu: 1, memoryMB: 512, gpu: 1}}
    commands: ["{command}"]
defaults:
  virtualCluster: default
"""


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    """``apiary control-plane`` (SQLite) on a free loopback port, a 20-node x 2-GPU cluster."""
    home = tmp_path_factory.mktemp("hollow") / "home"
    home.mkdir(mode=0o700)
    (home / "cluster.yaml").write_text(yaml.safe_dump(_cluster(NODES)))
    port = _free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("APIARY_")}, "APIARY_HOME": str(home)}
    log = home.parent / "control-plane.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "apiary", "control-plane", "--port", str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{api}/healthz", timeout=5).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "control plane not up: " + log.read_text()[-3000:]
            time.sleep(0.2)
        yield api, home
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_twenty_hollow_nodes_run_jobs_against_a_real_control_plane(control_plane) -> None:
    from apiary.cli.hollow import read_tokens
    from apiary.client import ApiaryClient

    api, home = control_plane
    tokens = read_tokens(home / "credentials")
    nodes = {f"hn-{i:02d}": 2 for i in range(NODES)}
    assert set(nodes) <= set(tokens)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    result: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        result["report"] = loop.run_until_complete(run_hollow_nodes([api], nodes, tokens, stop=stop, ramp_s=0.5))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    admin = ApiaryClient(api, timeout=60, token=(home / "token").read_text().strip())
    try:
        ready = _wait(lambda: [n for n in admin.nodes() if n.get("ready")] if len(
            [n for n in admin.nodes() if n.get("ready")]) == NODES else None, 60, "20 ready nodes")
        assert {n["name"] for n in ready} == set(nodes)
        ok = [admin.submit(_job(f"ok{i}", "sleep 1"))["id"] for i in range(12)]
        bad = admin.submit(_job("bad", "sleep 0.5; exit 3"))["id"]
        long = admin.submit(_job("long", "sleep 300"))["id"]
        _wait(lambda: admin.get(long)["state"] == "RUNNING", 60, "the long job running")
        admin.stop(long)
        final = ("SUCCEEDED", "FAILED", "STOPPED")
        states = _wait(lambda: (s := {j: admin.get(j)["state"] for j in [*ok, bad, long]}) and
                       all(v in final for v in s.values()) and s, 90, "every job final")
        assert all(states[j] == "SUCCEEDED" for j in ok), states
        assert states[bad] == "FAILED" and states[long] == "STOPPED", states
        assert admin.get(bad)["exitCode"] == 3
        placed_nodes = {p["node"] for e in admin.events(limit=1000) if e["type"] == "job.placed"
                        for p in e["data"]["placements"]}
        assert len(placed_nodes) >= 2  # spread over hollow nodes, not one
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)
        admin.close()
    report = result["report"]
    assert set(report.stats) == set(nodes)
    assert all(st.beats for st in report.stats.values())  # every node reported at least once
    # Run statuses went in reports of their own kind; the rest were bare heartbeats.
    assert {kind for st in report.stats.values() for *_, kind in st.beats} == {hollow.BARE, hollow.RUNS}
    received = {r["job"] for st in report.stats.values() for r in st.received.values()}
    assert set(ok) | {bad, long} <= received
    d = report.to_dict()
    assert d["nodes"] == NODES and d["beats"] and d["cpuS"] > 0
    json.dumps(d)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_hollow_nodes_command_runs_a_shard_and_writes_its_stats(control_plane, tmp_path: Path) -> None:
    api, home = control_plane
    stats = tmp_path / "stats.json"
    log = tmp_path / "hollow.log"
    with log.open("wb") as out_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "apiary.cli.hollow", "--api", api, "--count", "4", "--shard", "1/2",
             "--credentials", str(home / "credentials"), "--stats", str(stats)],
            env={k: v for k, v in os.environ.items() if not k.startswith("APIARY_")},
            stdout=out_file, stderr=subprocess.STDOUT,
        )
    try:
        _wait(lambda: "hollow nodes starting" in log.read_text(errors="replace") or proc.poll() is not None, 60,
              "the hollow agents started")
        assert proc.poll() is None, log.read_text()[-2000:]
        time.sleep(3.0)  # more than a heartbeat period: every node has reported
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    out = log.read_text(errors="replace")
    assert proc.returncode == 0, out[-2000:]
    d = json.loads(stats.read_text())
    assert d["nodes"] == 2
    assert {n for n, *_ in d["beats"]} == {"hn-01", "hn-03"}  # shard 1/2 of the first 4 nodes


def test_hollow_nodes_command_refuses_a_bad_shard() -> None:
    import typer

    from apiary.cli.hollow import parse_shard, pick_nodes

    assert parse_shard("0/2") == (0, 2)
    for bad in ("2/2", "x", "1/0", "-1/3"):
        with pytest.raises(typer.BadParameter):
            parse_shard(bad)
    inv = {f"n{i}": 8 for i in range(5)}
    assert list(pick_nodes(inv, [], 4, (0, 2))) == ["n0", "n2"]
    assert list(pick_nodes(inv, ["n4", "n1"], None, (0, 1))) == ["n4", "n1"]
    with pytest.raises(typer.BadParameter):
        pick_nodes(inv, ["nope"], None, (0, 1))
