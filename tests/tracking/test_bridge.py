"""PrefectBridge against a real Prefect server on loopback (marker ``prefect``)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from tests.support.polling import until

from apiary.tracking.bridge import PrefectBridge
from apiary.tracking.prefect_server import start_prefect_server
from apiary.tracking.source import MemoryEventSource

pytestmark = pytest.mark.prefect


@pytest.fixture(autouse=True)
def _prefect_env(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("prefect-client")
    monkeypatch.setenv("PREFECT_HOME", str(home))
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_prefect_server(tmp_path_factory.mktemp("prefect-server"))
    try:
        yield srv
    finally:
        srv.stop()


def feed_job(src: MemoryEventSource, job_id: str, flow_run_id: str | None = None) -> None:
    """submitted, waiting, placed, started, exited(1), retry, placed, started, exited(0), completed."""
    user, name = job_id.split("~")
    t = time.time()
    src.emit(job_id, "job.submitted", {"user": user, "name": name, "virtualCluster": "default",
                                       "priorityClass": "prod", "flowRunId": flow_run_id}, t)
    src.emit(job_id, "job.waiting", {"attempt": 0, "reason": "insufficient free cells"}, t + 1)
    src.emit(job_id, "job.placed", {"attempt": 0, "placements": [
        {"taskRole": "train", "index": 0, "node": "node-1", "gpus": [0, 1]},
        {"taskRole": "train", "index": 1, "node": "node-2", "gpus": [0, 1]},
        {"taskRole": "ps", "index": 0, "node": "node-1", "gpus": []}]}, t + 2)
    for role, index, node in (("train", 0, "node-1"), ("train", 1, "node-2"), ("ps", 0, "node-1")):
        src.emit(job_id, "task.started", {"attempt": 0, "taskRole": role, "index": index, "node": node,
                                          "gpus": [0, 1]}, t + 3)
    src.write_log(job_id, "train", 0, 0, "stdout", "epoch 1 loss=0.9\n")
    src.write_log(job_id, "train", 0, 0, "stderr", "CUDA error: out of memory\n")
    src.emit(job_id, "task.exited", {"attempt": 0, "taskRole": "train", "index": 0, "exitCode": 1,
                                     "phrase": "UserError"}, t + 4)
    src.emit(job_id, "job.retry", {"attempt": 1, "kind": "user", "reason": "train/0 exited 1", "exitCode": 1}, t + 5)
    src.emit(job_id, "job.placed", {"attempt": 1, "placements": [
        {"taskRole": "train", "index": 0, "node": "node-3", "gpus": [2, 3]},
        {"taskRole": "train", "index": 1, "node": "node-3", "gpus": [4, 5]},
        {"taskRole": "ps", "index": 0, "node": "node-3", "gpus": []}]}, t + 6)
    for role, index in (("train", 0), ("train", 1), ("ps", 0)):
        src.emit(job_id, "task.started", {"attempt": 1, "taskRole": role, "index": index, "node": "node-3",
                                          "gpus": [2, 3]}, t + 7)
    src.write_log(job_id, "train", 0, 1, "stdout", "epoch 1 loss=0.9\nepoch 2 loss=0.5\ndone")
    for role, index in (("train", 0), ("train", 1), ("ps", 0)):
        src.emit(job_id, "task.exited", {"attempt": 1, "taskRole": role, "index": index, "exitCode": 0,
                                         "phrase": "Succeeded"}, t + 8)
    src.emit(job_id, "job.completed", {"state": "SUCCEEDED", "exitCode": 0, "attempt": 1}, t + 9)


async def read_back(api_url: str, job_id: str) -> dict:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterName,
        LogFilter,
        LogFilterFlowRunId,
    )

    async with PrefectClient(api=api_url) as client:
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["apiary-job"])),
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[job_id])),
        )
        out: dict = {"flow_runs": runs}
        if len(runs) == 1:
            fr = runs[0]
            out["task_runs"] = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
            out["logs"] = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))
            out["artifacts"] = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
        return out


# Task runs are the job's periods: each attempt's wait for placement and each taskRole's run.
# (Points - submitted, placed, retried, completed - are flow run states and log lines.)
EXPECTED_TASK_RUNS = {
    "queue": "COMPLETED", "run-train": "FAILED", "run-ps": "FAILED",
    "queue@1": "COMPLETED", "run-train@1": "COMPLETED", "run-ps@1": "COMPLETED",
}


def settled(api_url: str, job_id: str, task_runs: int = len(EXPECTED_TASK_RUNS)) -> dict:
    """read_back once the job's ``task_runs`` task runs are recorded in their final states: the
    bridge sends task runs as events, which the server's task run recorder writes soon after."""
    last: dict = {}

    def ready() -> dict | None:
        nonlocal last
        last = asyncio.run(read_back(api_url, job_id))
        runs = last.get("task_runs") or []
        return last if len(runs) >= task_runs and all(t.state and t.state.is_final() for t in runs) else None

    try:
        return until(ready, 60, f"{task_runs} final task runs of {job_id}", poll_s=0.2)
    except AssertionError:
        seen = [(t.name, t.state_type, t.state.type if t.state else None, t.state_id)
                for t in last.get("task_runs", [])]
        raise AssertionError(f"task runs of {job_id} never all final: {seen}") from None


def test_job_becomes_one_flow_run_with_task_runs_logs_and_artifact(server, tmp_path):
    src = MemoryEventSource()
    job_id = "alice~mnist-1"
    feed_job(src, job_id)
    bridge = PrefectBridge(src, server.api_url, tmp_path / "bridge.json")
    n = asyncio.run(bridge.sync_once())
    assert n == len(asyncio.run(src.events(0, 1000)))
    assert bridge.cursor == n

    got = settled(server.api_url, job_id)
    assert len(got["flow_runs"]) == 1
    fr = got["flow_runs"][0]
    assert fr.state.type.value == "COMPLETED"
    assert src.flow_runs[job_id] == str(fr.id)
    assert "user:alice" in fr.tags
    # The bridge first saw this job after it had ended: its run was created Completed, one request.
    assert [n for n, _ in asyncio.run(_history(server.api_url, fr.id))] == ["Completed"]

    states = {t.name: t.state.type.value for t in got["task_runs"]}
    assert states == EXPECTED_TASK_RUNS
    assert all(t.state.is_final() for t in got["task_runs"])

    messages = [log.message for log in got["logs"]]
    assert "[train/0] epoch 1 loss=0.9" in messages
    assert "[train/0] CUDA error: out of memory" in messages
    assert "[train/0]@1 epoch 2 loss=0.5" in messages
    assert "[train/0]@1 done" in messages  # the unterminated last line is shipped at exit
    assert any(m.startswith("job.retry attempt=1") for m in messages)
    out_logs = [log for log in got["logs"] if log.message == "[train/0]@1 done"]
    run_train_1 = next(t for t in got["task_runs"] if t.name == "run-train@1")
    assert out_logs[0].task_run_id == run_train_1.id

    queue = next(t for t in got["task_runs"] if t.name == "queue")
    assert "train/1->node-2[0, 1]" in queue.state.message  # the placement ends the wait
    assert queue.start_time is not None and queue.end_time is not None and queue.end_time > queue.start_time
    summaries = [a for a in got["artifacts"] if a.type == "markdown"]
    assert [a.key for a in summaries] == ["job-alice-mnist-1"]
    assert "| 0 | train | 0 | node-1 | [0, 1] | 1 |" in summaries[0].data  # where each instance ran, its exit

    # Nothing new: a second pass does nothing.
    assert asyncio.run(bridge.sync_once()) == 0


def test_restart_does_not_duplicate(server, tmp_path):
    src = MemoryEventSource()
    job_id = "bob~restart-1"
    feed_job(src, job_id)
    state = tmp_path / "bridge.json"
    asyncio.run(PrefectBridge(src, server.api_url, state).sync_once())
    before = settled(server.api_url, job_id)

    # A new bridge on the same state file: nothing left to do.
    assert asyncio.run(PrefectBridge(src, server.api_url, state).sync_once()) == 0
    # Lost state (crash before the first save): replaying every event still does not duplicate.
    state.unlink()
    replay = PrefectBridge(src, server.api_url, state)
    assert asyncio.run(replay.sync_once()) > 0

    after = settled(server.api_url, job_id)
    assert len(after["flow_runs"]) == 1
    assert after["flow_runs"][0].id == before["flow_runs"][0].id
    assert sorted(t.id for t in after["task_runs"]) == sorted(t.id for t in before["task_runs"])


def test_a_batch_tells_apiary_its_new_flow_runs_in_one_call_and_redoes_it_when_apiary_is_away(server, tmp_path):
    from apiary.errors import UnavailableError

    src = MemoryEventSource()
    jobs = [f"carol~batch-{i}" for i in range(3)]
    for job_id in jobs:
        feed_job(src, job_id)
    real = src.set_flow_runs
    calls = {"n": 0}

    async def away_once(links: dict[str, str]) -> list[str]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise UnavailableError("apiary restarting")
        return await real(links)

    src.set_flow_runs = away_once  # type: ignore[method-assign]
    bridge = PrefectBridge(src, server.api_url, tmp_path / "bridge.json")
    asyncio.run(bridge.sync_once())  # logs "unreachable" and backs off
    assert bridge.cursor == 0 and src.flow_runs == {}  # the batch is not done
    asyncio.run(bridge.sync_once())
    assert len(src.link_batches) == 1 and set(src.link_batches[0]) == set(jobs)  # one call for the batch
    assert src.log_batches == 2  # each try of the batch read every instance's output in one call
    for job_id in jobs:
        (fr,) = settled(server.api_url, job_id)["flow_runs"]  # the redone batch made no second run
        assert src.flow_runs[job_id] == str(fr.id)


def test_attaches_to_existing_flow_run_and_leaves_its_state(server, tmp_path):
    from prefect.client.orchestration import PrefectClient
    from prefect.states import Running

    async def make_run():
        async with PrefectClient(api=server.api_url) as client:
            flow_id = await client.create_flow_from_name("apiary-job")
            from prefect.client.schemas.actions import FlowRunCreate

            resp = await client.request("POST", "/flow_runs/", json=FlowRunCreate(
                flow_id=flow_id, name="carol~deployed").model_dump(mode="json", exclude_unset=True))
            fid = resp.json()["id"]
            await client.set_flow_run_state(fid, Running(), force=True)
            return fid

    fid = asyncio.run(make_run())
    src = MemoryEventSource()
    feed_job(src, "carol~deployed", flow_run_id=fid)
    asyncio.run(PrefectBridge(src, server.api_url, tmp_path / "b.json").sync_once())
    got = settled(server.api_url, "carol~deployed")
    assert [str(r.id) for r in got["flow_runs"]] == [fid]
    assert got["flow_runs"][0].state.type.value == "RUNNING"  # the flow engine owns it
    assert {t.name for t in got["task_runs"]} == set(EXPECTED_TASK_RUNS)
    assert "carol~deployed" not in src.flow_runs  # the job already knows its flow run


def test_server_down_then_catch_up(tmp_path):
    home = tmp_path / "prefect"
    srv = start_prefect_server(home)
    port = srv.port
    try:
        src = MemoryEventSource()
        bridge = PrefectBridge(src, srv.api_url, tmp_path / "bridge.json")
        feed_job(src, "dave~first")
        asyncio.run(bridge.sync_once())
        cursor = bridge.cursor
        srv.stop()

        feed_job(src, "dave~second")
        t0 = time.monotonic()
        assert asyncio.run(bridge.sync_once()) == 0
        assert time.monotonic() - t0 < 10
        assert bridge.cursor == cursor
        assert json.loads(Path(tmp_path / "bridge.json").read_text())["cursor"] == cursor

        srv = start_prefect_server(home, port=port)  # same DB, same URL
        assert asyncio.run(bridge.sync_once()) > 0
        assert bridge.cursor == len(asyncio.run(src.events(0, 1000)))
        for job_id in ("dave~first", "dave~second"):
            got = settled(srv.api_url, job_id)
            assert len(got["flow_runs"]) == 1
            assert got["flow_runs"][0].state.type.value == "COMPLETED"
            assert {t.name for t in got["task_runs"]} == set(EXPECTED_TASK_RUNS)
    finally:
        srv.stop()


def test_run_forever_survives_server_down(tmp_path):
    src = MemoryEventSource()
    feed_job(src, "erin~offline")
    bridge = PrefectBridge(src, "http://127.0.0.1:9/api", tmp_path / "b.json")  # nothing listens

    async def run_a_while():
        task = asyncio.create_task(bridge.run_forever(poll_s=0.05))
        await asyncio.sleep(1.0)
        assert not task.done()  # never raised
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run_a_while())
    assert bridge.cursor == 0


def test_output_of_running_instances_is_shipped_periodically(server, tmp_path):
    src = MemoryEventSource()
    job_id = "frank~long"
    src.emit(job_id, "job.submitted", {"user": "frank", "name": "long", "flowRunId": None})
    src.emit(job_id, "job.placed", {"attempt": 0, "placements": [
        {"taskRole": "train", "index": 0, "node": "node-1", "gpus": [0]}]})
    src.emit(job_id, "task.started", {"attempt": 0, "taskRole": "train", "index": 0, "node": "node-1", "gpus": [0]})
    src.write_log(job_id, "train", 0, 0, "stdout", "step 1\nstep 2 (partial")
    bridge = PrefectBridge(src, server.api_url, tmp_path / "b.json", log_interval_s=0)
    asyncio.run(bridge.sync_once())
    messages = [log.message for log in asyncio.run(read_back(server.api_url, job_id))["logs"]]
    assert "[train/0] step 1" in messages
    assert not any("partial" in m for m in messages)  # only complete lines while running

    src.write_log(job_id, "train", 0, 0, "stdout", ")\nstep 3\n")
    src.emit(job_id, "task.exited", {"attempt": 0, "taskRole": "train", "index": 0, "exitCode": 0})
    src.emit(job_id, "job.completed", {"state": "FAILED", "exitCode": 0, "attempt": 0})
    asyncio.run(bridge.sync_once())
    got = asyncio.run(read_back(server.api_url, job_id))
    messages = [log.message for log in got["logs"]]
    assert messages.count("[train/0] step 1") == 1
    assert "[train/0] step 2 (partial)" in messages and "[train/0] step 3" in messages
    assert got["flow_runs"][0].state.type.value == "FAILED"


# ---------------------------------------------------------------------------- the state mapping

async def _run_of(api_url: str, job_id: str):
    got = await read_back(api_url, job_id)
    assert len(got["flow_runs"]) == 1
    return got["flow_runs"][0]


async def _history(api_url: str, flow_run_id) -> list[tuple[str, str]]:
    from prefect.client.orchestration import PrefectClient

    async with PrefectClient(api=api_url) as client:
        states = await client.read_flow_run_states(flow_run_id)
    return [(s.name, s.message or "") for s in sorted(states, key=lambda s: s.timestamp)]


def test_run_states_follow_the_job_waiting_preempted_running_failed(server, tmp_path):
    src = MemoryEventSource()
    job_id, t = "dora~states", time.time()
    bridge = PrefectBridge(src, server.api_url, tmp_path / "b.json")

    def step(*events):
        for kind, data in events:
            src.emit(job_id, kind, data, t)
        asyncio.run(bridge.sync_once())
        return asyncio.run(_run_of(server.api_url, job_id))

    run = step(("job.submitted", {"user": "dora", "name": "states", "virtualCluster": "vc1", "priorityClass": "test"}),
               ("job.waiting", {"attempt": 0, "reason": "VC vc1 has 0 of 2 GPU leaf cells free"}))
    assert (run.state.type.value, run.state_name) == ("PENDING", "Waiting")
    assert run.state.message == "VC vc1 has 0 of 2 GPU leaf cells free"
    assert run.deployment_id is not None  # a deployment run: the UI offers Cancel and Retry
    assert {"user:dora", "vc:vc1", "priority:test"} <= set(run.tags)
    run = step(("job.waiting", {"attempt": 0, "reason": "a higher-priority job is ahead"}))
    assert run.state.message == "a higher-priority job is ahead"  # updated when the reason changes

    placed = {"attempt": 0, "placements": [{"taskRole": "train", "index": 0, "node": "n1", "gpus": [0]}]}
    run = step(("job.placed", placed), ("task.started", {"attempt": 0, "taskRole": "train", "index": 0,
                                                         "node": "n1", "gpus": [0]}))
    assert (run.state.type.value, run.state_name) == ("RUNNING", "Running")

    run = step(("job.preempted", {"attempt": 0, "by": "erin~prod", "reason": "Preempted by erin~prod."}),
               ("job.retry", {"attempt": 1, "kind": "platform", "reason": "Preempted by erin~prod. retried",
                              "exitCode": -1003}))
    assert (run.state.type.value, run.state_name) == ("PENDING", "AwaitingRetry")
    assert "Preempted by erin~prod" in run.state.message
    run = step(("job.waiting", {"attempt": 1, "reason": "no free cells"}))
    assert run.state_name == "AwaitingRetry" and run.state.message.endswith("waiting: no free cells")

    placed["attempt"] = 1
    run = step(("job.placed", placed), ("task.started", {"attempt": 1, "taskRole": "train", "index": 0,
                                                         "node": "n1", "gpus": [0]}))
    assert run.state_name == "Running"
    run = step(("task.exited", {"attempt": 1, "taskRole": "train", "index": 0, "exitCode": 137}),
               ("job.completed", {"state": "FAILED", "exitCode": 137, "attempt": 1}))
    assert (run.state.type.value, run.state_name) == ("FAILED", "Failed")
    assert "exit code 137: ContainerSigKillReceived" in run.state.message
    names = [n for n, _ in asyncio.run(_history(server.api_url, run.id))]
    assert names[0] == "Submitted" and "AwaitingRetry" in names and names[-1] == "Failed"
    # Started when Apiary accepted the job: a queued job never reads "late" in the UI.
    assert run.start_time is not None and run.estimated_start_time_delta.total_seconds() < 1


def test_cancel_in_the_ui_stops_the_job_and_the_run_ends_cancelled(server, tmp_path):
    from prefect.client.orchestration import PrefectClient
    from prefect.states import Cancelling

    src = MemoryEventSource()
    job_id = "eve~long"
    src.emit(job_id, "job.submitted", {"user": "eve", "name": "long", "virtualCluster": "vc1"})
    src.emit(job_id, "task.started", {"attempt": 0, "taskRole": "train", "index": 0, "node": "n1", "gpus": [0]})
    bridge = PrefectBridge(src, server.api_url, tmp_path / "b.json")
    bridge.cancel_poll_s = 0.0
    asyncio.run(bridge.sync_once())
    run = asyncio.run(_run_of(server.api_url, job_id))

    async def cancel():  # what the UI's Cancel button sends
        async with PrefectClient(api=server.api_url) as client:
            await client.set_flow_run_state(run.id, Cancelling(message="from the UI"))

    asyncio.run(cancel())
    asyncio.run(bridge.sync_once())
    assert src.stops == [job_id]
    asyncio.run(bridge.sync_once())
    assert src.stops == [job_id]  # asked once
    src.emit(job_id, "job.stop_requested", {})
    src.emit(job_id, "job.completed", {"state": "STOPPED", "exitCode": -210, "attempt": 0})
    asyncio.run(bridge.sync_once())
    run = asyncio.run(_run_of(server.api_url, job_id))
    assert (run.state.type.value, run.state_name) == ("CANCELLED", "Cancelled")
    assert "Cancel in the Prefect UI" in run.state.message


def test_attached_run_gets_the_job_tags_and_never_loses_its_final_state(server, tmp_path):
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.actions import FlowRunCreate
    from prefect.states import Completed, Running

    async def make_run():
        async with PrefectClient(api=server.api_url) as client:
            flow_id = await client.create_flow_from_name("apiary-job")
            resp = await client.request("POST", "/flow_runs/", json=FlowRunCreate(
                flow_id=flow_id, name="fay~ui", tags=["apiary"]).model_dump(mode="json", exclude_unset=True))
            fid = resp.json()["id"]
            await client.set_flow_run_state(fid, Running(), force=True)
            return fid

    async def end(fid):
        async with PrefectClient(api=server.api_url) as client:
            await client.set_flow_run_state(fid, Completed(), force=True)

    fid = asyncio.run(make_run())
    src = MemoryEventSource()
    src.emit("fay~ui", "job.submitted", {"user": "fay", "name": "ui", "virtualCluster": "vc2",
                                         "priorityClass": "prod", "flowRunId": fid})
    src.emit("fay~ui", "job.waiting", {"attempt": 0, "reason": "queued behind 3 jobs"})
    bridge = PrefectBridge(src, server.api_url, tmp_path / "b.json")
    asyncio.run(bridge.sync_once())
    run = asyncio.run(_run_of(server.api_url, "fay~ui"))
    assert run.state_name == "Waiting" and run.state.message == "queued behind 3 jobs"
    assert {"apiary", "user:fay", "vc:vc2", "priority:prod"} <= set(run.tags)
    asyncio.run(end(fid))  # the flow engine ended the run; the bridge is behind
    src.emit("fay~ui", "task.started", {"attempt": 0, "taskRole": "train", "index": 0, "node": "n1", "gpus": [0]})
    asyncio.run(bridge.sync_once())
    assert asyncio.run(_run_of(server.api_url, "fay~ui")).state_name == "Completed"


def test_a_version_1_state_file_is_read_with_its_open_task_runs_named_as_created(tmp_path):
    state = tmp_path / "b.json"
    state.write_text(json.dumps({"version": 1, "cursor": 7, "jobs": {"gil~old": {
        "flowRunId": "3f1c8e0e-0000-4000-8000-000000000001", "owned": True, "lastSeq": 7, "done": False,
        "running": True, "open": {"queue:1": "a", "run:train:0": "b"}, "inst": {}, "logOff": {}, "user": "gil"}}}))
    bridge = PrefectBridge(MemoryEventSource(), "http://127.0.0.1:9/api", state)
    assert bridge.cursor == 7 and bridge.state["version"] == 2
    job = bridge.state["jobs"]["gil~old"]
    assert job["open"] == {
        "queue:1": {"id": "a", "name": "queue@1", "dynamicKey": "queue:1", "attempt": 1},
        "run:train:0": {"id": "b", "name": "run-train", "dynamicKey": "run:train:0", "attempt": 0},
    }
    assert "submitted" in job  # not bootstrapped again: its run exists


def test_a_batch_reads_its_output_from_apiary_while_its_flow_runs_are_written(server, tmp_path):
    # The two wait on different servers. Here the output read waits until a flow run of the
    # batch exists: one-after-the-other (reads first) would time out and redo the batch.
    src = MemoryEventSource()
    feed_job(src, "dave~overlap")
    bridge = PrefectBridge(src, server.api_url, tmp_path / "bridge.json")
    real = src.logs_many
    seen: list[bool] = []

    async def read_after_a_run_exists(reads):
        deadline = time.monotonic() + 20
        while not bridge.new_links and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        seen.append(bool(bridge.new_links))
        return await real(reads)

    src.logs_many = read_after_a_run_exists  # type: ignore[method-assign]
    asyncio.run(bridge.sync_once())
    assert seen == [True]
    assert bridge.cursor == len(src._events)
    # What this test is about is the output: wait for it, and for every task run's final state
    # type. (settled() also waits for each task run's state object; in one clean-clone run the
    # server returned all six of this job's task runs without one for 60 s, with state_type final
    # and state_id set. Not understood yet; the tests that use settled() still check it.)
    def output() -> dict | None:
        got = asyncio.run(read_back(server.api_url, "dave~overlap"))
        runs = got.get("task_runs") or []
        done = len(runs) >= len(EXPECTED_TASK_RUNS) and all(
            t.state_type is not None and t.state_type.value in {"COMPLETED", "FAILED"} for t in runs)
        return got if done and any("CUDA error: out of memory" in log.message for log in got["logs"]) else None

    got = until(output, 60, "the output and final task runs of dave~overlap", poll_s=0.2)
    assert {t.name: t.state_type.value for t in got["task_runs"]} == EXPECTED_TASK_RUNS


def test_together_lets_every_step_finish_before_it_raises_and_prefers_a_lasting_failure():
    from apiary.tracking.transient import together

    finished: list[str] = []

    async def step(name: str, delay: float, exc: BaseException | None = None) -> str:
        await asyncio.sleep(delay)
        finished.append(name)
        if exc is not None:
            raise exc
        return name

    assert asyncio.run(together(step("a", 0.02), step("b", 0))) == ["a", "b"]
    finished.clear()
    with pytest.raises(ValueError):  # not transient: the batch is not simply redone
        asyncio.run(together(step("slow", 0.05), step("away", 0, OSError("reset")), step("bad", 0.01, ValueError())))
    assert sorted(finished) == ["away", "bad", "slow"]  # the slow write was not left running
    finished.clear()
    with pytest.raises(OSError):
        asyncio.run(together(step("slow", 0.05), step("away", 0, OSError("reset"))))
    assert sorted(finished) == ["away", "slow"]


def _attached_run(api_url: str, name: str) -> str:
    """A Running flow run of ``apiary-job``, as a flow engine runs it (the Prefect form's)."""
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.actions import FlowRunCreate
    from prefect.states import Running

    async def make():
        async with PrefectClient(api=api_url) as client:
            flow_id = await client.create_flow_from_name("apiary-job")
            resp = await client.request("POST", "/flow_runs/", json=FlowRunCreate(
                flow_id=flow_id, name=name, tags=["apiary"]).model_dump(mode="json", exclude_unset=True))
            fid = resp.json()["id"]
            await client.set_flow_run_state(fid, Running(), force=True)
            return fid

    return asyncio.run(make())


def _feed_stopped(src: MemoryEventSource, job_id: str, fid: str, t: float) -> None:
    user, name = job_id.split("~")
    src.emit(job_id, "job.submitted", {"user": user, "name": name, "virtualCluster": "vc1", "priorityClass": "prod",
                                       "flowRunId": fid}, t)
    src.emit(job_id, "task.started", {"attempt": 0, "taskRole": "train", "index": 0, "node": "n1", "gpus": [0]}, t)
    src.emit(job_id, "job.stop_requested", {}, t + 1)
    src.emit(job_id, "job.completed", {"state": "STOPPED", "exitCode": -210, "attempt": 0}, t + 1)


def test_an_attached_run_its_engine_left_running_ends_with_its_job_after_a_restart(server, tmp_path):
    # The form's run is run by a flow engine in prefect-serve, which a restart of the platform ends.
    fid = _attached_run(server.api_url, "hal~form")
    src = MemoryEventSource()
    _feed_stopped(src, "hal~form", fid, time.time() - 5)
    state = tmp_path / "b.json"
    asyncio.run(PrefectBridge(src, server.api_url, state, settle_after_s=3600).sync_once())
    run = asyncio.run(_run_of(server.api_url, "hal~form"))
    assert run.state_name == "Running"  # the engine's to end while it may be alive
    assert "settle" in json.loads(state.read_text())["jobs"]["hal~form"]  # kept across a restart
    asyncio.run(PrefectBridge(src, server.api_url, state, settle_after_s=0).sync_once())  # a restarted bridge
    run = asyncio.run(_run_of(server.api_url, "hal~form"))
    assert (run.state.type.value, run.state_name) == ("CANCELLED", "Cancelled")
    assert "job STOPPED" in run.state.message
    assert "hal~form" not in json.loads(state.read_text())["jobs"]  # nothing left to do: a tombstone
    tombs = [json.loads(line) for line in (tmp_path / "b.json.tombs").read_text().splitlines()]
    assert tombs == [["hal~form", {"flowRunId": fid, "lastSeq": 4, "done": True, "owned": False,
                                   "final": tombs[0][1]["final"]}]]
    assert tombs[0][1]["final"]["type"] == "CANCELLED"


def test_an_attached_run_its_engine_ended_keeps_the_engines_state(server, tmp_path):
    from prefect.client.orchestration import PrefectClient
    from prefect.states import Cancelled

    fid = _attached_run(server.api_url, "ida~form")

    async def end():
        async with PrefectClient(api=server.api_url) as client:
            await client.set_flow_run_state(fid, Cancelled(message="ended by its engine"), force=True)

    asyncio.run(end())
    src = MemoryEventSource()
    _feed_stopped(src, "ida~form", fid, time.time() - 60)
    asyncio.run(PrefectBridge(src, server.api_url, tmp_path / "b.json", settle_after_s=0).sync_once())
    run = asyncio.run(_run_of(server.api_url, "ida~form"))
    assert run.state_name == "Cancelled" and run.state.message == "ended by its engine"


def test_summaries_go_out_while_events_keep_coming(server, tmp_path):
    # A bridge that keeps up with a steady stream rarely reads an empty batch: its finished jobs'
    # summaries must still go out then, not wait for the stream to stop.
    src = MemoryEventSource()
    feed_job(src, "ned~first")
    bridge = PrefectBridge(src, server.api_url, tmp_path / "bridge.json")
    real, reads, queued = src.events, [0], []

    async def streaming(after: int, limit: int = 500) -> list[dict]:
        reads[0] += 1
        queued.append(len(bridge.ledger.artifacts(100)))
        if reads[0] <= 3:  # a new job's events arrive before every read, three times
            src.emit(f"ned~next{reads[0]}", "job.submitted", {"user": "ned", "name": f"next{reads[0]}"})
        return await real(after, limit)

    src.events = streaming  # type: ignore[method-assign]
    asyncio.run(bridge.sync_once())
    # Queued by the first batch, sent with the second (the bridge was not behind), before the third read.
    assert reads[0] == 4 and queued == [0, 1, 0, 0]
    got = settled(server.api_url, "ned~first")
    assert len(got["artifacts"]) == 1


def test_a_bridge_behind_reads_bigger_batches_so_a_job_it_first_sees_there_is_created_final(server, tmp_path):
    src = MemoryEventSource()
    feed_job(src, "oz~first")  # its first five events fill the first batch: the bridge is behind
    feed_job(src, "oz~second")  # all of it in the next, bigger batch
    limits: list[int] = []
    real = src.events

    async def recorded(after: int, limit: int = 500) -> list[dict]:
        limits.append(limit)
        return await real(after, limit)

    src.events = recorded  # type: ignore[method-assign]
    bridge = PrefectBridge(src, server.api_url, tmp_path / "bridge.json", batch_size=5, catch_up_batch_size=50)
    asyncio.run(bridge.sync_once())
    assert limits[:3] == [5, 50, 5]  # back to small batches once a read no longer fills its batch
    runs = {job: settled(server.api_url, job)["flow_runs"][0] for job in ("oz~first", "oz~second")}
    assert [n for n, _ in asyncio.run(_history(server.api_url, runs["oz~second"].id))] == ["Completed"]
    assert len(asyncio.run(_history(server.api_url, runs["oz~first"].id))) > 1  # created before it ended


def test_a_bridge_behind_writes_more_flow_runs_at_once_than_one_keeping_up(server, tmp_path, monkeypatch):
    from apiary.tracking.flowruns import FlowRunWriter

    src = MemoryEventSource()
    for i in range(15):
        src.emit(f"sal~j{i}", "job.submitted", {"user": "sal", "name": f"j{i}"})
    in_flight, peaks = [0], [[0]]
    real_events = src.events

    async def events(after: int, limit: int = 500) -> list[dict]:
        peaks.append([0])
        return await real_events(after, limit)

    async def flush_run(self, job_id: str, job: dict) -> None:  # counts the writes in flight
        in_flight[0] += 1
        peaks[-1][0] = max(peaks[-1][0], in_flight[0])
        await asyncio.sleep(0.05)
        in_flight[0] -= 1

    src.events = events  # type: ignore[method-assign]
    monkeypatch.setattr(FlowRunWriter, "flush_run", flush_run)
    bridge = PrefectBridge(src, server.api_url, tmp_path / "bridge.json", concurrency=2, catch_up_concurrency=5,
                           batch_size=6, catch_up_batch_size=6)
    asyncio.run(bridge.sync_once())
    # Reads of 6 (full: behind), 6 (full), then 3 (keeping up); what follows the empty fourth
    # read (the runs this fake left wanted) is written as one keeping up.
    assert [p[0] for p in peaks[1:4]] == [5, 5, 2] and max(p[0] for p in peaks[4:]) <= 2
