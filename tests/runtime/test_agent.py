"""Node agent reconciliation rules that need no control plane (its HTTP side is covered end to end)."""

from __future__ import annotations

from apiary.runtime.agent import NodeAgent
from apiary.runtime.process import ProcessBackend


def assignment(run_id: str, desired: str) -> dict:
    return {
        "runId": run_id,
        "desired": desired,
        "launch": {
            "run_id": run_id, "job_id": "alice~j", "user": "alice", "job_name": "j", "task_role": "train",
            "index": 0, "commands": ["sleep 30"], "env": {}, "gpus": [0], "image": None, "cpu": 1, "memory_mb": 1,
        },
    }


def make_agent(tmp_path) -> NodeAgent:
    return NodeAgent("n1", "http://unused", ProcessBackend(tmp_path), client=None, gpus=1, simulated_gpus=True,
                     workdir=str(tmp_path))


def test_stop_of_a_never_launched_run_is_reported_and_never_launched(tmp_path):
    agent = make_agent(tmp_path)
    agent._reconcile([assignment("alice~j.a0.train.0.t0", "STOP")])
    status = agent._failed["alice~j.a0.train.0.t0"]
    assert status.state == "exited" and status.stopped and status.started_at is None
    # A stale list that still says RUN must not start it.
    agent._reconcile([assignment("alice~j.a0.train.0.t0", "RUN")])
    assert agent.backend.status("alice~j.a0.train.0.t0") is None


def test_run_assignment_launches_once(tmp_path):
    agent = make_agent(tmp_path)
    agent._reconcile([assignment("alice~j.a0.train.0.t1", "RUN")])
    agent._reconcile([assignment("alice~j.a0.train.0.t1", "RUN")])
    runs = agent.backend.list()
    assert [r.run_id for r in runs] == ["alice~j.a0.train.0.t1"] and runs[0].state == "running"
    agent.backend.stop("alice~j.a0.train.0.t1", grace_s=1)


def test_a_taken_metrics_port_falls_back_to_a_free_one():
    """The supervisor fixes each node's metrics port once; if something takes it before the agent
    binds, the agent serves elsewhere instead of crash-looping on the same port forever."""
    import socket

    import httpx
    from prometheus_client import CollectorRegistry

    from apiary.runtime.agent import serve_node_metrics

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        server = serve_node_metrics("n1", CollectorRegistry(), "127.0.0.1", taken)
        try:
            assert server.server_port not in (taken, 0)
            assert httpx.get(f"http://127.0.0.1:{server.server_port}/healthz", timeout=5).status_code == 200
        finally:
            server.shutdown()
            server.server_close()


def test_free_port_avoids_ports_already_handed_out():
    from apiary.tracking.prefect_server import free_port

    held: set[int] = set()
    for _ in range(50):
        port = free_port(avoid=held)
        assert port not in held
        held.add(port)


def test_a_runtime_that_is_away_defers_the_launch_instead_of_failing_the_task(tmp_path):
    """dockerd or the Kubernetes API down for a moment: -1203 would be permanent (never retried),
    so the agent leaves the run unlaunched and launches it on a later poll."""
    from apiary.errors import UnavailableError

    agent = make_agent(tmp_path)
    real = agent.backend.launch
    calls = []

    def away_once(task):
        calls.append(task.run_id)
        if len(calls) == 1:
            raise UnavailableError("dockerd does not answer")
        return real(task)

    agent.backend.launch = away_once  # type: ignore[method-assign]
    run = "alice~j.a0.train.0.t9"
    agent._reconcile([assignment(run, "RUN")])
    assert run not in agent._failed and agent.backend.status(run) is None
    agent._reconcile([assignment(run, "RUN")])
    assert agent.backend.status(run).running and calls == [run, run]
    agent.backend.stop(run, grace_s=1)


def test_the_agent_leaves_probing_to_a_runtime_that_runs_probes(tmp_path):
    agent = make_agent(tmp_path)
    probes = {"livenessProbe": {"exec": {"command": ["true"]}}}
    agent._reconcile([{**assignment("alice~j.a0.train.0.t10", "RUN"), "probes": probes}])
    assert agent.prober.state("alice~j.a0.train.0.t10") is not None
    agent.backend.runs_probes = True
    agent._reconcile([{**assignment(r, "RUN"), "probes": probes}
                      for r in ("alice~j.a0.train.0.t10", "alice~j.a0.train.0.t11")])
    assert agent.prober.state("alice~j.a0.train.0.t11") is None
    for run in ("alice~j.a0.train.0.t10", "alice~j.a0.train.0.t11"):
        agent.backend.stop(run, grace_s=1)


def _agent_over_a_recorder(tmp_path, *, takes_inline_logs: bool = True):
    """An agent whose HTTP client answers every call itself and records it (no control plane).
    ``takes_inline_logs=False`` answers as a control plane from before NodeReport.logs did (it
    ignored the field: no ``logs`` in its answer)."""
    import json

    import httpx

    calls: list[tuple[str, dict | bytes]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/status"):
            body = json.loads(request.content)
            calls.append(("status", body))
            stored = [c["offset"] + len(c["data"]) for c in body.get("logs", [])]  # any list will do
            return httpx.Response(200, json={"ack": [], "logs": stored} if takes_inline_logs and stored
                                  else {"ack": []})
        calls.append(("logs", request.content))
        return httpx.Response(200, json={"size": 0})

    agent = make_agent(tmp_path)
    agent.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return agent, calls


def _launch_and_wait(agent, run: str, command: str) -> None:
    from tests.support.polling import until

    a = assignment(run, "RUN")
    a["launch"]["commands"] = [command]
    agent._reconcile([a])
    until(lambda: agent.backend.status(run).state == "exited", 30, f"{run} exited")


def test_a_short_tasks_output_rides_in_the_report_of_its_exit(tmp_path):
    import asyncio
    import base64

    agent, calls = _agent_over_a_recorder(tmp_path)
    run = "alice~j.a0.train.0.t2"
    _launch_and_wait(agent, run, "echo hi; echo oops >&2")
    asyncio.run(agent._report_once())
    assert [kind for kind, _ in calls] == ["status"]  # one request: no POST .../logs
    body = calls[0][1]
    assert [(r["run_id"], r["state"]) for r in body["runs"]] == [(run, "exited")]
    sent = {c["stream"]: (c["offset"], base64.b64decode(c["data"])) for c in body["logs"]}
    assert sent == {"stdout": (0, b"hi\n"), "stderr": (0, b"oops\n")}
    calls.clear()
    asyncio.run(agent._report_once())  # nothing new: nothing sent again (the heartbeat is not due)
    assert calls == []


def test_output_over_the_inline_cap_goes_first_with_post_logs(tmp_path):
    import asyncio

    from apiary.api.schemas import MAX_INLINE_LOG_BYTES
    from apiary.runtime.agent import MAX_INLINE_LOG_BYTES as AGENT_CAP

    assert AGENT_CAP == MAX_INLINE_LOG_BYTES  # what the agent sends is what the control plane takes
    agent, calls = _agent_over_a_recorder(tmp_path)
    run = "alice~j.a0.train.0.t3"
    _launch_and_wait(agent, run, f"head -c {MAX_INLINE_LOG_BYTES + 1} /dev/zero")
    asyncio.run(agent._report_once())
    assert [kind for kind, _ in calls] == ["logs", "status"]  # the output before the exit
    assert len(calls[0][1]) == MAX_INLINE_LOG_BYTES + 1 and "logs" not in calls[1][1]


def test_an_older_control_plane_that_ignores_output_in_reports_still_gets_it(tmp_path):
    """During an upgrade a new agent may meet the old control plane, which drops unknown fields:
    its answer has no ``logs``, so the agent sends that output with POST .../logs and, from then
    on, sends output that way first."""
    import asyncio

    agent, calls = _agent_over_a_recorder(tmp_path, takes_inline_logs=False)
    first, second = "alice~j.a0.train.0.t4", "alice~j.a0.train.0.t5"
    _launch_and_wait(agent, first, "echo one")
    asyncio.run(agent._report_once())
    assert [kind for kind, _ in calls] == ["status", "logs"] and calls[1][1] == b"one\n"
    calls.clear()
    _launch_and_wait(agent, second, "echo two")
    asyncio.run(agent._report_once())
    assert [kind for kind, _ in calls] == ["logs", "status"] and calls[0][1] == b"two\n"
    assert "logs" not in calls[1][1]


def test_storage_that_cannot_be_mounted_fails_the_run_as_the_platforms_with_the_reason(tmp_path):
    """A launch whose storage cannot be mounted (the control plane's ``mountError``, or a server that
    refuses) is reported exited with EXIT_MOUNT_FAILED (-1006, a platform failure the lifecycle
    retries) and the reason as the run's stderr; nothing was started."""
    import asyncio
    import base64

    from apiary.lifecycle import EXIT_MOUNT_FAILED, classify_exit
    from apiary.runtime.storage import TaskMounts

    agent, calls = _agent_over_a_recorder(tmp_path / "a")
    agent.mounts = TaskMounts(tmp_path / "mounts", timeout_s=5)
    gone = assignment("alice~j.a0.train.0.t5", "RUN")
    gone["launch"]["mountError"] = "storage of job alice~j cannot be mounted: Storage config share no longer exists."
    down = assignment("alice~j.a0.train.0.t6", "RUN")
    down["launch"]["mounts"] = [{"config": "share", "server": {"name": "nfs1", "type": "nfs", "data": {
        "address": "198.18.255.254", "rootPath": "/export"}}, "path": "", "mountPoint": "/mnt/s", "readOnly": False}]
    agent._reconcile([gone, down])
    assert agent.backend.list() == []
    for run in ("alice~j.a0.train.0.t5", "alice~j.a0.train.0.t6"):
        assert agent._failed[run].exit_code == EXIT_MOUNT_FAILED
    assert classify_exit(EXIT_MOUNT_FAILED).type == "PLATFORM_FAILURE"
    asyncio.run(agent._report_once())
    body = calls[0][1]
    logs = {c["runId"]: base64.b64decode(c["data"]).decode() for c in body["logs"] if c["stream"] == "stderr"}
    assert "no longer exists" in logs["alice~j.a0.train.0.t5"]
    assert "nfs1" in logs["alice~j.a0.train.0.t6"]
    assert agent.mounts.table.holders() == set()


def test_a_mount_the_job_marked_failurepolicy_ignore_is_left_out_and_the_task_runs(tmp_path):
    """OpenPAI's plugins' ``failurePolicy: ignore``: a storage mount that fails is left out."""
    from apiary.runtime.storage import TaskMounts

    agent = make_agent(tmp_path / "a")
    agent.mounts = TaskMounts(tmp_path / "mounts", timeout_s=5)
    a = assignment("alice~j.a0.train.0.t7", "RUN")
    a["launch"]["mounts"] = [{"config": "share", "server": {"name": "nfs1", "type": "nfs", "data": {
        "address": "198.18.255.254", "rootPath": "/export"}}, "path": "", "mountPoint": "/mnt/s", "readOnly": False,
        "optional": True}]
    agent._reconcile([a])
    runs = agent.backend.list()
    assert [r.run_id for r in runs] == ["alice~j.a0.train.0.t7"] and runs[0].state == "running"
    agent.backend.stop("alice~j.a0.train.0.t7", grace_s=1)


def test_a_running_task_that_holds_its_named_ports_is_not_failed_by_a_later_poll(tmp_path):
    """Every answer of the long poll reconciles the node's whole list, running runs included. A run
    whose task already listens on its named ports must not read as a port conflict (OpenPAI's 253,
    which fails and retries it): it was a JupyterLab job retried mid-test when its node's list
    changed 10 s after the launch."""
    import socket

    from apiary.spec.ports import task_ports

    agent = make_agent(tmp_path)
    run = "alice~j.a0.train.0.t2"
    port = task_ports(run, ["http"])["http"]
    a = assignment(run, "RUN")
    a["launch"]["env"] = {"PAI_CONTAINER_HOST_PORT_LIST": f"http:{port}"}
    agent._reconcile([a])
    assert agent.backend.status(run).state == "running"
    with socket.socket() as held:  # the task now listens on its port
        held.bind(("0.0.0.0", port))  # noqa: S104 - as a task binding every address would
        held.listen()
        agent._reconcile([a])
        assert run not in agent._failed and agent.backend.status(run).state == "running"
        # A run not launched yet whose port another process holds is still refused with 253.
        other = "alice~j.a0.train.0.t3"
        b = assignment(other, "RUN")
        b["launch"]["env"] = {"PAI_CONTAINER_HOST_PORT_LIST": f"http:{port}"}
        agent._reconcile([a, b])
        assert agent._failed[other].exit_code == 253 and agent.backend.status(other) is None
    agent.backend.stop(run, grace_s=1)


def test_a_later_poll_neither_settles_nor_fails_a_run_the_backend_already_has(tmp_path):
    """Each answer of the long poll lists the node's running runs again. Their storage is prepared
    once, at the launch: a storage server that fails later must not fail (nor unmount) a task that
    runs. A new agent process adopts what the last one launched the same way."""
    calls: list[str] = []

    class Mounts:
        """TaskMounts' interface: the first prepare binds, every later one fails."""

        def prepare(self, run_id: str, planned: list[dict]) -> list[dict]:
            calls.append(run_id)
            if len(calls) > 1:
                from apiary.runtime.storage import MountFailed
                raise MountFailed("server nfs1 does not answer")
            return []

        def release(self, run_id: str) -> None:
            calls.append(f"release {run_id}")

        def reconcile(self, live: set[str]) -> None:
            pass

    agent = make_agent(tmp_path)
    agent.mounts = Mounts()
    run = "alice~j.a0.train.0.t8"
    a = assignment(run, "RUN")
    a["launch"]["mounts"] = [{"config": "share", "server": {"name": "nfs1", "type": "nfs", "data": {
        "address": "198.18.255.254", "rootPath": "/export"}}, "path": "", "mountPoint": "/mnt/s", "readOnly": False}]
    agent._reconcile([a])
    agent._reconcile([a])
    assert calls == [run]
    assert run not in agent._failed and agent.backend.status(run).state == "running"
    # A new agent process on the same node (the backend's records survive it) adopts the run: no
    # storage prepared again, and its probes watched from the first assignment that names them.
    again = make_agent(tmp_path)
    again.mounts = Mounts()
    a["probes"] = {"readinessProbe": {"tcpSocket": {"port": "http"}}}
    again._reconcile([a])
    assert calls == [run] and run not in again._failed and again.backend.status(run).state == "running"
    assert again.prober.state(run) is not None and agent.prober.state(run) is None
    agent.backend.stop(run, grace_s=1)
