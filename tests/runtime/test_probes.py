"""Task probes (apiary.runtime.probes): parsing, the real handlers on loopback, the schedule and
thresholds on an injected clock, and Kubernetes' busybox liveness example on a real ProcessBackend."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from apiary.errors import ValidationError
from apiary.lifecycle import EXIT_LIVENESS_FAILED, classify_exit
from apiary.runtime.base import TaskLaunch
from apiary.runtime.probes import (
    ExecAction,
    HTTPGetAction,
    Prober,
    ProbeSpec,
    TCPSocketAction,
    exec_probe,
    http_probe,
    monotonic_from_wall,
    parse_probes,
    probes_from_wire,
    probes_to_wire,
    tcp_probe,
    validate_probes,
)
from apiary.runtime.process import ProcessBackend
from apiary.spec.job import parse_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "probes" / "liveness-exec.yaml"


def extras_with(role: str = "train", **probes: object) -> dict:
    return {"apiary": {"taskRoles": {role: probes}}}


def spec(**wire: object) -> ProbeSpec:
    return ProbeSpec.model_validate(wire)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Scripted:
    """A fake handler answering from a list of outcomes (then repeating the last); records calls."""

    def __init__(self, *outcomes: bool) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    def __call__(self, action, env, cwd, timeout):  # noqa: ANN001
        ok = self.outcomes[min(self.calls, len(self.outcomes) - 1)]
        self.calls += 1
        return ok, "scripted"


# --------------------------------------------------------------------------- parsing


def test_parse_the_brief_example_with_defaults():
    extras = extras_with(
        livenessProbe={"exec": {"command": ["cat", "/tmp/healthy"]}, "initialDelaySeconds": 5, "periodSeconds": 5},
        readinessProbe={"tcpSocket": {"port": 8080}},
    )
    live, ready = parse_probes(extras, "train")
    assert live is not None and ready is not None
    assert live.action == ExecAction(command=["cat", "/tmp/healthy"])
    assert (live.initial_delay_seconds, live.period_seconds, live.timeout_seconds) == (5, 5, 1)
    assert (live.success_threshold, live.failure_threshold) == (1, 3)
    assert ready.action == TCPSocketAction(port=8080, host="127.0.0.1")
    assert (ready.initial_delay_seconds, ready.period_seconds) == (0, 10)
    assert parse_probes(extras, "other") == (None, None)


def test_http_get_defaults_and_normalisation():
    live, _ = parse_probes(extras_with(livenessProbe={"httpGet": {"port": "http", "path": "healthz", "scheme": "https",
                                                                  "httpHeaders": [{"name": "X-A", "value": "1"}]}}),
                           "train")
    assert isinstance(live.action, HTTPGetAction)
    assert (live.action.path, live.action.scheme, live.action.host, live.action.port) == ("/healthz", "HTTPS",
                                                                                          "127.0.0.1", "http")


@pytest.mark.parametrize("extras", [None, {}, {"apiary": None}, {"apiary": {}}, {"apiary": {"taskRoles": {}}},
                                    {"gangAllocation": True}, extras_with(livenessProbe=None)])
def test_nothing_declared_means_no_probes(extras):
    assert parse_probes(extras, "train") == (None, None)


@pytest.mark.parametrize(
    ("probe", "field", "words"),
    [
        ({"exec": {"command": ["true"]}, "periodSeconds": 0}, "livenessProbe.periodSeconds", "greater than or equal"),
        ({"exec": {"command": ["true"]}, "timeoutSeconds": 0}, "livenessProbe.timeoutSeconds", "greater than"),
        ({"exec": {"command": ["true"]}, "failureThreshold": 0}, "livenessProbe.failureThreshold", "greater than"),
        ({"exec": {"command": ["true"]}, "initialDelaySeconds": -1}, "livenessProbe.initialDelaySeconds", "greater"),
        ({"exec": {"command": ["true"]}, "periodSeconds": "5"}, "livenessProbe.periodSeconds", "integer"),
        ({"exec": {"command": ["true"]}, "periodSeconds": 1.5}, "livenessProbe.periodSeconds", "integer"),
        ({"exec": {"command": ["true"]}, "successThreshold": 2}, "livenessProbe.successThreshold", "must be 1"),
        ({"exec": {"command": ["true"]}, "bogus": 1}, "livenessProbe.bogus", "unknown field"),
        ({"exec": {"command": []}}, "livenessProbe.exec.command", "at least 1"),
        ({"exec": {"command": "cat /tmp/x"}}, "livenessProbe.exec.command", "list"),
        ({"exec": {}}, "livenessProbe.exec.command", "missing"),
        ({"httpGet": {"path": "/"}}, "livenessProbe.httpGet.port", "missing"),
        ({"httpGet": {"port": 70000}}, "livenessProbe.httpGet.port", "1-65535"),
        ({"httpGet": {"port": "80"}}, "livenessProbe.httpGet.port", "port label"),
        ({"httpGet": {"port": 80, "scheme": "ftp"}}, "livenessProbe.httpGet.scheme", "HTTP"),
        ({"httpGet": {"port": 80, "method": "POST"}}, "livenessProbe.httpGet.method", "unknown field"),
        ({"tcpSocket": {"port": True}}, "livenessProbe.tcpSocket.port", "port"),
        ({"tcpSocket": {"port": 22, "host": ""}}, "livenessProbe.tcpSocket.host", "at least 1"),
        ({}, "livenessProbe", "exactly one of exec, httpGet, tcpSocket"),
        ({"exec": {"command": ["true"]}, "tcpSocket": {"port": 1}}, "livenessProbe", "(2 given)"),
        ({"grpc": {"port": 9000}}, "livenessProbe.grpc", "not supported"),
        ("cat /tmp/healthy", "livenessProbe", "mapping"),
    ],
)
def test_validation_errors_name_the_field(probe, field, words):
    with pytest.raises(ValidationError) as info:
        parse_probes(extras_with(livenessProbe=probe), "train")
    assert info.value.field == f"extras.apiary.taskRoles.train.{field}"
    assert words in info.value.message
    assert info.value.message.startswith(info.value.field)


def test_readiness_may_have_a_success_threshold_and_errors_name_it():
    _, ready = parse_probes(extras_with(readinessProbe={"tcpSocket": {"port": 1}, "successThreshold": 3}), "train")
    assert ready.success_threshold == 3
    with pytest.raises(ValidationError) as info:
        parse_probes(extras_with(readinessProbe={"tcpSocket": {"port": 1}, "successThreshold": 0}), "train")
    assert info.value.field == "extras.apiary.taskRoles.train.readinessProbe.successThreshold"


@pytest.mark.parametrize(
    ("extras", "field"),
    [
        ({"apiary": []}, "extras.apiary"),
        ({"apiary": {"taskRoles": ["train"]}}, "extras.apiary.taskRoles"),
        ({"apiary": {"taskRoles": {"train": "probe"}}}, "extras.apiary.taskRoles.train"),
        ({"apiary": {"taskRoles": {"train": {"startupProbe": {"exec": {"command": ["true"]}}}}}},
         "extras.apiary.taskRoles.train.startupProbe"),
    ],
)
def test_malformed_blocks_name_the_field(extras, field):
    with pytest.raises(ValidationError) as info:
        parse_probes(extras, "train")
    assert info.value.field == field


def test_validate_probes_checks_every_role_and_rejects_unknown_roles():
    extras = {"apiary": {"taskRoles": {
        "train": {"livenessProbe": {"exec": {"command": ["true"]}}},
        "ps": {"readinessProbe": {"tcpSocket": {"port": 1}, "periodSeconds": 0}},
    }}}
    with pytest.raises(ValidationError) as info:
        validate_probes(extras, ["train", "ps"])
    assert info.value.field == "extras.apiary.taskRoles.ps.readinessProbe.periodSeconds"
    with pytest.raises(ValidationError) as info:
        validate_probes({"apiary": {"taskRoles": {"trian": {}}}}, ["train"])
    assert info.value.field == "extras.apiary.taskRoles.trian"
    good = validate_probes(extras_with(livenessProbe={"exec": {"command": ["true"]}}), ["train", "ps"])
    assert list(good) == ["train"] and good["train"][1] is None
    assert validate_probes(None, ["train"]) == {}


def test_the_example_job_parses_and_declares_the_busybox_probe():
    job = parse_job(EXAMPLE.read_text())
    assert list(job.task_roles) == ["liveness"]
    for extras in (job.extras, job.to_wire()["extras"]):  # the model or its wire form
        live, ready = parse_probes(extras, "liveness")
        assert ready is None
        assert live.action == ExecAction(command=["sh", "-c", 'cat "/tmp/$PAI_JOB_NAME.healthy"'])
        assert (live.initial_delay_seconds, live.period_seconds, live.failure_threshold) == (5, 5, 3)
    assert validate_probes(job.extras, job.task_roles)["liveness"][0] == live
    assert "sleep 30" in job.render_commands("liveness")[0]


def test_wire_round_trip_for_assignments():
    live, ready = parse_probes(extras_with(
        livenessProbe={"httpGet": {"port": "http", "httpHeaders": [{"name": "A", "value": "b"}]}, "periodSeconds": 2},
        readinessProbe={"exec": {"command": ["true"]}},
    ), "train")
    wire = json.loads(json.dumps(probes_to_wire(live, ready)))
    assert wire["livenessProbe"]["httpGet"]["httpHeaders"] == [{"name": "A", "value": "b"}]
    assert probes_from_wire(wire) == (live, ready)
    assert probes_to_wire(None, None) == {} and probes_from_wire(None) == (None, None)
    assert probes_from_wire({"readinessProbe": wire["readinessProbe"]}) == (None, ready)
    with pytest.raises(ValidationError) as info:
        probes_from_wire({"livenessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 0}})
    assert info.value.field == "probes.livenessProbe.periodSeconds"


# --------------------------------------------------------------------------- handlers, for real


def test_exec_probe_exit_code_env_and_cwd(tmp_path):
    assert exec_probe(ExecAction(command=["true"]), {}, str(tmp_path), 5)[0] is True
    ok, message = exec_probe(ExecAction(command=["false"]), {}, str(tmp_path), 5)
    assert not ok and "exit code 1" in message
    check = ExecAction(command=["sh", "-c", 'test "$FOO" = bar && test "$(pwd -P)" = "$1" && echo fine', "sh",
                                str(tmp_path.resolve())])
    assert exec_probe(check, {"FOO": "bar"}, str(tmp_path), 5) == (True, "fine")
    assert exec_probe(check, {"FOO": "baz"}, str(tmp_path), 5)[0] is False
    ok, message = exec_probe(ExecAction(command=["no-such-command-apiary"]), {}, str(tmp_path), 5)
    assert not ok and "no-such-command-apiary" in message


def test_exec_probe_timeout_kills_the_probe_process_group(tmp_path):
    pidfile = tmp_path / "pids"
    # The probe's shell and a grandchild both record their pid, then hang.
    cmd = ExecAction(command=["sh", "-c", f'sleep 30 & echo $! >> {pidfile}; echo $$ >> {pidfile}; wait'])
    t0 = time.monotonic()
    ok, message = exec_probe(cmd, {}, str(tmp_path), 0.5)
    assert not ok and "timed out" in message
    assert time.monotonic() - t0 < 3
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 3
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "probe processes outlived the timeout"
        time.sleep(0.02)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        routes = {"/ok": 200, "/redirect": 302, "/notfound": 404, "/boom": 500}
        if self.path == "/slow":
            time.sleep(2)
            code = 200
        elif self.path == "/header":
            code = 200 if self.headers.get("X-Probe") == "yes" else 403
        else:
            code = routes.get(self.path, 404)
        self.send_response(code)
        if code == 302:
            self.send_header("Location", "http://192.0.2.1/elsewhere")  # never followed
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("path", "ok"), [("/ok", True), ("/redirect", True), ("/notfound", False), ("/boom", False)])
def test_http_probe_status_ranges(http_port, path, ok):
    result, message = http_probe(HTTPGetAction(port=http_port, path=path), {}, "", 2)
    assert result is ok
    assert "HTTP " in message


def test_http_probe_headers_named_port_refused_and_timeout(http_port):
    with_header = HTTPGetAction.model_validate({"port": http_port, "path": "/header",
                                                "httpHeaders": [{"name": "X-Probe", "value": "yes"}]})
    assert http_probe(with_header, {}, "", 2)[0] is True
    assert http_probe(HTTPGetAction(port=http_port, path="/header"), {}, "", 2)[0] is False
    named = HTTPGetAction(port="http", path="/ok")
    assert http_probe(named, {"PAI_CONTAINER_HOST_http_PORT_LIST": str(http_port)}, "", 2)[0] is True
    assert http_probe(HTTPGetAction(port=free_port()), {}, "", 2)[0] is False
    t0 = time.monotonic()
    ok, message = http_probe(HTTPGetAction(port=http_port, path="/slow"), {}, "", 0.3)
    assert not ok and "timed out" in message
    assert time.monotonic() - t0 < 1.5


def test_tcp_probe_listening_and_closed_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert tcp_probe(TCPSocketAction(port=port), {}, "", 1)[0] is True
        assert tcp_probe(TCPSocketAction(port="svc"), {"PAI_CONTAINER_HOST_svc_PORT_LIST": str(port)}, "", 1)[0]
    ok, message = tcp_probe(TCPSocketAction(port=port), {}, "", 1)
    assert not ok and f"127.0.0.1:{port}" in message


def test_prober_with_real_handlers_and_a_missing_port_label(tmp_path):
    clock = FakeClock()
    prober = Prober(clock=clock)
    prober.watch("r", spec(exec={"command": ["true"]}), spec(tcpSocket={"port": "svc"}),
                 started_at_monotonic=clock.t, env={}, cwd=str(tmp_path))
    result = prober.check("r")
    assert not result.live_failed and result.ready is False
    assert "liveness ok" in result.message and "PAI_CONTAINER_HOST_svc_PORT_LIST" in result.message


def test_prober_bounds_a_hanging_exec_probe_by_its_timeout(tmp_path):
    prober = Prober()
    prober.watch("r", spec(exec={"command": ["sleep", "30"]}, timeoutSeconds=1, failureThreshold=1), None,
                 started_at_monotonic=time.monotonic(), env={}, cwd=str(tmp_path))
    t0 = time.monotonic()
    result = prober.check("r")
    assert time.monotonic() - t0 < 3
    assert result.live_failed and "timed out" in result.message


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_an_exec_probe_runs_as_the_tasks_uid_not_the_agents(tmp_path):
    """The agent is root; a job's liveness command must not be: the runtime's exec_prefix drops it
    to the task's uid, as the task itself runs."""
    backend = ProcessBackend(tmp_path / "state")
    run_id = "alice~probe-uid.a0.train.0.t0"
    backend.launch(TaskLaunch(run_id=run_id, job_id="alice~probe-uid", user="alice", job_name="probe-uid",
                              task_role="train", index=0, commands=["sleep 600"]))
    try:
        clock = FakeClock()
        not_root = spec(exec={"command": ["sh", "-c", 'test "$(id -u)" -ne 0']}, failureThreshold=1)
        bare, prefixed = Prober(clock=clock), Prober(clock=clock)
        bare.watch("r", not_root, None, started_at_monotonic=clock.t, env={}, cwd="/")
        prefixed.watch("r", not_root, None, started_at_monotonic=clock.t, env={}, cwd="/",
                       exec_prefix=backend.exec_prefix(run_id))
        assert bare.check("r").live_failed  # without the prefix it would run as root
        result = prefixed.check("r")
        assert not result.live_failed and "liveness ok" in result.message
    finally:
        backend.stop(run_id, grace_s=1.0)


# --------------------------------------------------------------------------- schedule and thresholds


def test_initial_delay_and_period_on_an_injected_clock():
    clock, live = FakeClock(100.0), Scripted(True)
    prober = Prober(clock=clock, run_exec=live)
    prober.watch("r", spec(exec={"command": ["x"]}, initialDelaySeconds=5, periodSeconds=3), None,
                 started_at_monotonic=100.0, env={}, cwd="/")
    clock.t = 104.9
    assert prober.due() == [] and prober.check("r").message == "" and live.calls == 0
    assert prober.next_due() == 105.0
    clock.t = 105.0
    assert prober.due() == ["r"]
    assert prober.check("r").live_failed is False and live.calls == 1
    assert prober.due() == []
    clock.t = 107.9
    assert prober.due() == []
    clock.t = 108.2  # polled a little late: the next one stays on the 3 s grid (111), no drift
    prober.check("r")
    assert prober.state("r").liveness.next_due == 111.0
    clock.t = 200.0  # a long stall: one probe, then a period from now (no burst of catch-up probes)
    prober.check("r")
    assert prober.due() == [] and prober.state("r").liveness.next_due == 203.0 and live.calls == 3


def test_liveness_fails_after_failure_threshold_consecutive_failures_only():
    clock = FakeClock(0.0)
    live = Scripted(False, False, True, False, False, False, True)
    prober = Prober(clock=clock, run_exec=live)
    prober.watch("r", spec(exec={"command": ["x"]}, periodSeconds=1, failureThreshold=3), None,
                 started_at_monotonic=0.0, env={}, cwd="/")
    results = []
    for t in range(6):
        clock.t = float(t)
        results.append(prober.check("r").live_failed)
    # F F S resets the count; F F F fails on the third.
    assert results == [False, False, False, False, False, True]
    st = prober.state("r")
    assert st.live_failed and st.liveness.failures == 3
    assert "failed 3 consecutive times" in prober.check("r").message
    # Sticky and never probed again.
    clock.t = 100.0
    assert prober.due() == [] and prober.check("r").live_failed and live.calls == 6


def test_readiness_thresholds_and_it_never_kills():
    clock = FakeClock(0.0)
    ready = Scripted(False, True, True, True, False, False, False, False, False, False, False, False)
    prober = Prober(clock=clock, run_tcp=ready)
    prober.watch("r", None, spec(tcpSocket={"port": 1}, periodSeconds=1, successThreshold=2, failureThreshold=2),
                 started_at_monotonic=0.0, env={}, cwd="/")
    assert prober.ready("r") is False  # not ready before the first probe (Kubernetes: Failure)
    seen = []
    for t in range(12):
        clock.t = float(t)
        result = prober.check("r")
        assert result.live_failed is False
        seen.append(result.ready)
    # F; S (1/2) not yet; S -> ready; S; F (1/2) still ready; F -> unready; ... stays unready, never killed.
    assert seen == [False, False, True, True, True, False, False, False, False, False, False, False]
    assert prober.due() == [] and prober.state("r").readiness.next_due == 12.0


def test_liveness_and_readiness_together_and_defaults():
    clock = FakeClock(0.0)
    prober = Prober(clock=clock, run_exec=Scripted(True), run_http=Scripted(True))
    prober.watch("r", spec(exec={"command": ["x"]}), spec(httpGet={"port": 80}, initialDelaySeconds=2),
                 started_at_monotonic=0.0, env={}, cwd="/")
    first = prober.check("r")
    assert first.ready is False and first.message.startswith("liveness ok")
    clock.t = 2.0
    assert prober.check("r").ready is True
    clock.t = 10.0
    assert prober.due() == ["r"]  # default period 10 s
    assert "liveness ok" in prober.check("r").message


def test_run_without_readiness_probe_reports_none_and_unwatched_runs():
    prober = Prober(clock=FakeClock(0.0), run_exec=Scripted(True))
    prober.watch("nothing", None, None, started_at_monotonic=0.0, env={}, cwd="/")
    assert prober.watching() == []
    prober.watch("r", spec(exec={"command": ["x"]}), None, started_at_monotonic=0.0, env={}, cwd="/")
    assert prober.check("r").ready is None
    assert prober.check("unknown") == prober.check("unknown") and prober.check("unknown").ready is None
    prober.forget("r")
    prober.forget("r")
    assert prober.due() == [] and prober.state("r") is None and prober.check("r").message == "not watched"


def test_a_raising_handler_is_a_failure():
    def broken(action, env, cwd, timeout):  # noqa: ANN001
        raise RuntimeError("kaboom")

    prober = Prober(clock=FakeClock(0.0), run_http=broken)
    prober.watch("r", spec(httpGet={"port": 80}, failureThreshold=1), None, started_at_monotonic=0.0, env={}, cwd="/")
    result = prober.check("r")
    assert result.live_failed and "RuntimeError: kaboom" in result.message


def test_a_check_in_progress_is_not_run_twice_and_forget_drops_its_result():
    entered, release = threading.Event(), threading.Event()
    calls = []

    def slow(action, env, cwd, timeout):  # noqa: ANN001
        calls.append(1)
        entered.set()
        release.wait(5)
        return False, "no"

    prober = Prober(clock=FakeClock(0.0), run_exec=slow)
    prober.watch("r", spec(exec={"command": ["x"]}, failureThreshold=1), None, started_at_monotonic=0.0, env={},
                 cwd="/")
    results = []
    worker = threading.Thread(target=lambda: results.append(prober.check("r")))
    worker.start()
    assert entered.wait(5)
    assert prober.due() == []  # in flight
    assert prober.check("r").live_failed is False and len(calls) == 1  # no second run
    prober.forget("r")
    release.set()
    worker.join(5)
    assert results[0].live_failed is False and results[0].message == "forgotten while probing"


def test_monotonic_from_wall():
    assert monotonic_from_wall(990.0, clock=lambda: 50.0, wall=lambda: 1000.0) == 40.0
    assert monotonic_from_wall(None, clock=lambda: 50.0, wall=lambda: 1000.0) == 50.0
    assert monotonic_from_wall(1005.0, clock=lambda: 50.0, wall=lambda: 1000.0) == 50.0  # wall clock skew


# --------------------------------------------------------------------------- the busybox example, for real


@pytest.mark.skipif(sys.platform != "linux", reason="process backend semantics are tested on Linux")
@pytest.mark.e2e  # a real task and real probes on the wall clock: about 5 s
def test_busybox_liveness_example_with_process_backend(tmp_path):
    """Kubernetes' liveness-exec example, shortened: healthy for 3 s (the seed: 30 s), probed
    every 1 s after 1 s with failureThreshold 2. The loop below is what the agent does."""
    work = Path(tempfile.mkdtemp(prefix="apiary-probe-", dir="/tmp"))
    os.chmod(work, 0o1777)  # the task runs as a uid of its own, and mkdtemp makes the dir 0700
    healthy = work / "healthy"
    backend = ProcessBackend(tmp_path / "state")
    run_id = "alice~liveness-exec.a0.liveness.0.t0"
    try:
        backend.launch(TaskLaunch(
            run_id=run_id, job_id="alice~liveness-exec", user="alice", job_name="liveness-exec",
            task_role="liveness", index=0, workdir=str(work),
            commands=[f"touch {healthy}; sleep 3; rm -f {healthy}; sleep 600"],
        ))
        status = backend.status(run_id)
        started = monotonic_from_wall(status.started_at)
        liveness = spec(exec={"command": ["cat", str(healthy)]}, initialDelaySeconds=1, periodSeconds=1,
                        failureThreshold=2)
        prober = Prober()
        prober.watch(run_id, liveness, None, started_at_monotonic=started, env={"PATH": os.environ["PATH"]},
                     cwd=str(work))

        failed_at = None
        deadline = started + 10.0
        while failed_at is None:
            now = time.monotonic()
            assert now < deadline, f"liveness never failed: {prober.state(run_id)}"
            if now - started < 2.5:  # the file exists for the first 3 s: healthy and running
                assert backend.status(run_id).running
                assert prober.state(run_id).liveness.failures == 0
            for rid in prober.due():
                result = prober.check(rid)
                if result.live_failed:
                    failed_at = time.monotonic()
                    backend.stop(rid, 1.0)
            time.sleep(0.05)

        track = prober.state(run_id).liveness
        assert track.runs >= 4 and track.failures == 2
        # The first failing probe runs after the file is removed (>= 3 s); two in a row at 1 s apart.
        assert 3.0 <= failed_at - started <= 3.0 + 2 * 1 + 2.0
        final = backend.status(run_id)
        assert final.state == "exited" and final.stopped and final.exit_code in (143, 137)
        # What the agent reports for it instead of 143: a platform failure, retried to the max.
        assert classify_exit(EXIT_LIVENESS_FAILED).reaction == "RETRY_TO_MAX"
        prober.forget(run_id)
        backend.forget(run_id)
    finally:
        backend.stop(run_id, 0.5)
        shutil.rmtree(work, ignore_errors=True)


def test_exec_probes_run_inside_a_docker_tasks_container_and_nowhere_else(monkeypatch: pytest.MonkeyPatch):
    """The agent runs a job's exec probe behind the backend's exec_prefix: ``docker exec`` into the
    run's container for the Docker runtime (it ran on the host, as the agent's root, before), and a
    refusal from a backend that cannot say where the task runs."""
    from apiary.errors import PlatformError
    from apiary.runtime.base import RuntimeBackend
    from apiary.runtime.docker import DockerBackend, container_name

    run_id = "alice~p.a0.train.0.t0"
    monkeypatch.setattr("apiary.runtime.docker.shutil.which", lambda name: f"/usr/bin/{name}")
    docker = object.__new__(DockerBackend)  # exec_prefix needs no daemon
    assert docker.exec_prefix(run_id) == ["/usr/bin/docker", "exec", container_name(run_id)]
    with pytest.raises(PlatformError):
        docker.exec_prefix("../etc")
    with pytest.raises(PlatformError):
        RuntimeBackend.exec_prefix(docker, run_id)  # the default: refuse
