"""ProcessBackend: launch, logs, env, idempotency, stop, re-adoption, lost runs (isolation, full disks and
crashes mid-launch: test_process_isolation.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from apiary.errors import PlatformError, ValidationError
from apiary.runtime import BACKENDS, ProcessBackend, TaskLaunch, TaskStatus, backend_class

DEADLINE_S = 20.0


def wait_for(pred: Callable[[], object], timeout: float = DEADLINE_S, what: str = "condition") -> object:
    """Poll ``pred`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def wait_exited(backend: ProcessBackend, run_id: str, timeout: float = DEADLINE_S) -> TaskStatus:
    def done() -> TaskStatus | None:
        st = backend.status(run_id)
        return st if st is not None and st.state == "exited" else None

    return wait_for(done, timeout, f"{run_id} to exit")  # type: ignore[return-value]


def group_members(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def task(run_id: str, *commands: str, **kw: object) -> TaskLaunch:
    fields: dict = dict(
        run_id=run_id,
        job_id="job-1",
        user="alice",
        job_name="mnist",
        task_role="train",
        index=0,
        commands=list(commands),
        env={},
        gpus=[],
    )
    fields.update(kw)
    return TaskLaunch(**fields)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture(autouse=True)
def _unisolated_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # These tests are about tracking runs; as a non-root user the backend cannot switch uids and
    # would refuse every launch (isolation itself: test_process_isolation.py, run as root).
    if os.geteuid() != 0:
        monkeypatch.setenv("APIARY_ALLOW_UNISOLATED_TASKS", "1")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every task uid may write (tasks do not run as the test's user)."""
    d = Path(tempfile.mkdtemp(prefix="apiary-test-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def backend(state_dir: Path) -> Iterator[ProcessBackend]:
    b = ProcessBackend(state_dir)
    yield b
    for st in ProcessBackend(state_dir).list():
        if st.state == "running":
            b.stop(st.run_id, grace_s=0.5)


def test_registry_lists_the_process_backend() -> None:
    assert BACKENDS["process"] is ProcessBackend
    assert backend_class("process") is ProcessBackend
    with pytest.raises(ValidationError, match="unknown backend"):
        backend_class("nope")


def test_exit_code_and_logs_are_captured(backend: ProcessBackend) -> None:
    st = backend.launch(task("alice~mnist.a0.train.0.t0", "echo hi; echo err >&2; exit 3"))
    assert st.state == "running" and st.pid and st.started_at and st.exit_code is None
    final = wait_exited(backend, st.run_id)
    assert final.exit_code == 3 and not final.lost and not final.stopped and not final.succeeded
    assert final.finished_at is not None and final.finished_at >= final.started_at
    assert backend.log_path(st.run_id, "stdout").read_text() == "hi\n"
    assert backend.log_path(st.run_id, "stderr").read_text() == "err\n"
    run_dir = backend.state_dir / st.run_id
    assert (run_dir / "exit_code").read_text().strip() == "3"  # a slot: padded with spaces
    assert {"launch.json", "meta.json", "stdout.log", "stderr.log"} <= {p.name for p in run_dir.iterdir()}


def test_success_is_exit_zero(backend: ProcessBackend) -> None:
    backend.launch(task("ok", "true"))
    assert wait_exited(backend, "ok").succeeded


def test_set_e_semantics_stop_at_first_failing_command(backend: ProcessBackend, shared_dir: Path) -> None:
    tmp_path = shared_dir
    backend.launch(task("sete", "echo first", "false", "echo never > reached", workdir=str(tmp_path)))
    st = wait_exited(backend, "sete")
    assert st.exit_code == 1
    assert backend.log_path("sete", "stdout").read_text() == "first\n"
    assert not (tmp_path / "reached").exists()


def test_env_gpus_and_workdir_reach_the_task(
    backend: ProcessBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APIARY_TEST_AGENT_ONLY", "leak")
    cmd = (
        'echo "job=$PAI_JOB_NAME cuda=$CUDA_VISIBLE_DEVICES nvidia=$NVIDIA_VISIBLE_DEVICES '
        'agent=${APIARY_TEST_AGENT_ONLY:-unset} cwd=$(pwd)"'
    )
    env = {"PAI_JOB_NAME": "alice~mnist", "CUDA_VISIBLE_DEVICES": "overridden-by-gpus"}
    backend.launch(task("env", cmd, env=env, gpus=[1, 3], workdir=str(tmp_path)))
    assert wait_exited(backend, "env").exit_code == 0
    out = backend.log_path("env", "stdout").read_text().strip()
    assert out == f"job=alice~mnist cuda=1,3 nvidia=1,3 agent=unset cwd={tmp_path}"


def test_no_gpus_hides_devices(backend: ProcessBackend) -> None:
    backend.launch(task("nogpu", 'echo "[${CUDA_VISIBLE_DEVICES-unset}] $NVIDIA_VISIBLE_DEVICES"'))
    wait_exited(backend, "nogpu")
    assert backend.log_path("nogpu", "stdout").read_text() == "[] void\n"


def test_task_python_is_the_agents_python(backend: ProcessBackend) -> None:
    backend.launch(task("py", 'python3 -c "import numpy, sys; print(sys.prefix)"'))
    st = wait_exited(backend, "py")
    assert st.exit_code == 0, backend.log_path("py", "stderr").read_text()
    assert backend.log_path("py", "stdout").read_text().strip() == sys.prefix


def test_launch_is_idempotent(backend: ProcessBackend, state_dir: Path, shared_dir: Path) -> None:
    tmp_path = shared_dir
    t = task("once", "echo x >> counter", "sleep 0.3", workdir=str(tmp_path))
    first = backend.launch(t)
    second = backend.launch(t)
    assert second.pid == first.pid
    # A new backend on the same state (an agent restart) does not start it again either.
    third = ProcessBackend(state_dir).launch(t)
    assert third.pid == first.pid
    wait_exited(backend, "once")
    assert backend.launch(t).exit_code == 0
    assert (tmp_path / "counter").read_text() == "x\n"


@pytest.fixture
def group_signals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, float]]:
    """Every signal sent to a process group while the test runs, as ``(pgid, signal,
    time.monotonic())``; the signals are still delivered."""
    sent: list[tuple[int, int, float]] = []
    killpg = os.killpg

    def recording_killpg(pgid: int, sig: int) -> None:
        sent.append((pgid, sig, time.monotonic()))
        killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", recording_killpg)
    return sent


def test_stop_kills_grandchildren_and_reports_143(
    backend: ProcessBackend, group_signals: list[tuple[int, int, float]]
) -> None:
    st = backend.launch(task("tree", "bash -c 'sleep 100 & sleep 100; wait'"))
    pgid = os.getpgid(st.pid)
    assert pgid == st.pid
    wait_for(lambda: len(group_members(pgid)) >= 4, what="wrapper, script, bash -c and two sleeps")
    backend.stop("tree", grace_s=30)
    # SIGTERM reached every process of the group and sufficed: no SIGKILL was needed.
    assert [(g, sig) for g, sig, _ in group_signals] == [(pgid, signal.SIGTERM)]
    assert group_members(pgid) == []
    final = wait_exited(backend, "tree")
    assert final.stopped and final.exit_code == 143 and not final.lost


def test_stop_escalates_to_kill_after_grace(
    backend: ProcessBackend, group_signals: list[tuple[int, int, float]]
) -> None:
    st = backend.launch(task("stubborn", "trap '' TERM", "sleep 100"))
    pgid = st.pid
    wait_for(lambda: any("sleep" in p.name() for p in group_members(pgid)), what="sleep to start")
    backend.stop("stubborn", grace_s=0.5)
    # SIGTERM first; SIGKILL only once the group had outlived the whole grace period.  A lower
    # bound on the monotonic clock, so no load on the machine can break it.
    assert [(g, sig) for g, sig, _ in group_signals] == [(pgid, signal.SIGTERM), (pgid, signal.SIGKILL)]
    (_, _, term_at), (_, _, kill_at) = group_signals
    assert kill_at - term_at >= 0.5
    assert group_members(pgid) == []
    final = wait_exited(backend, "stubborn")
    assert final.stopped and final.exit_code == 137 and not final.lost


def test_stop_is_silent_for_unknown_and_finished_runs(backend: ProcessBackend) -> None:
    backend.stop("never-launched")
    backend.stop("../../etc")
    backend.launch(task("done", "exit 0"))
    wait_exited(backend, "done")
    backend.stop("done")
    st = backend.status("done")
    assert st.exit_code == 0 and not st.stopped


def test_readoption_after_agent_restart(state_dir: Path) -> None:
    a = ProcessBackend(state_dir)
    launched = a.launch(task("adopt", "sleep 2; exit 7"))
    del a
    b = ProcessBackend(state_dir)
    [listed] = b.list()
    assert listed.run_id == "adopt" and listed.state == "running" and listed.pid == launched.pid
    final = wait_exited(b, "adopt")
    assert final.exit_code == 7 and not final.lost


def test_readoption_without_meta_finds_the_wrapper(state_dir: Path) -> None:
    a = ProcessBackend(state_dir)
    launched = a.launch(task("nometa", "sleep 1; exit 5"))
    (state_dir / "nometa" / "meta.json").unlink()  # as if the agent died right after spawning
    b = ProcessBackend(state_dir)
    st = b.status("nometa")
    assert st.state == "running" and st.pid == launched.pid
    assert wait_exited(b, "nometa").exit_code == 5


def test_sigkill_with_wrapper_reads_back_as_lost(backend: ProcessBackend) -> None:
    st = backend.launch(task("lost", "sleep 100"))
    wait_for(lambda: len(group_members(st.pid)) >= 3, what="the task to start")
    os.killpg(st.pid, signal.SIGKILL)
    final = wait_exited(backend, "lost")
    assert final.lost and final.exit_code is None and not final.stopped
    assert ProcessBackend(backend.state_dir).status("lost").lost


def test_spawn_failure_leaves_no_record_and_a_retry_launches_once(
    backend: ProcessBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real_popen = subprocess.Popen

    def failing_popen(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise OSError("fork failed")

    monkeypatch.setattr(subprocess, "Popen", failing_popen)
    with pytest.raises(PlatformError, match="fork failed"):
        backend.launch(task("crash", "echo hi"))
    assert backend.status("crash") is None and backend.list() == []  # nothing started, nothing kept
    monkeypatch.setattr(subprocess, "Popen", real_popen)
    backend.launch(task("crash", "echo hi"))
    assert wait_exited(backend, "crash").exit_code == 0
    assert backend.launch(task("crash", "echo hi")).state == "exited"  # and never again
    assert backend.log_path("crash", "stdout").read_text() == "hi\n"
    assert len(calls) == 1


def test_missing_bash_is_a_platform_error(backend: ProcessBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("apiary.runtime.process.shutil.which", lambda name: None)
    with pytest.raises(PlatformError, match="bash"):
        backend.launch(task("nobash", "true"))
    assert backend.status("nobash") is None  # nothing started, nothing recorded: a retry may launch


def test_bad_workdir_and_gpus_start_nothing(backend: ProcessBackend, tmp_path: Path) -> None:
    with pytest.raises(PlatformError, match="workdir"):
        backend.launch(task("nodir", "true", workdir=str(tmp_path / "missing")))
    with pytest.raises(ValidationError, match="gpus"):
        backend.launch(task("badgpu", "true", gpus=[-1]))
    assert backend.list() == []


def test_pid_reuse_is_not_mistaken_for_the_task(backend: ProcessBackend, state_dir: Path) -> None:
    run_dir = state_dir / "reused"
    run_dir.mkdir()
    meta = f'{{"pid": {os.getpid()}, "pgid": {os.getpgid(0)}, "create_time": 1.0, "started_at": 1.0}}'
    (run_dir / "meta.json").write_text(meta)
    st = backend.status("reused")
    assert st.state == "exited" and st.lost
    backend.stop("reused")  # must not signal the pytest process's group


def test_bad_run_ids(backend: ProcessBackend) -> None:
    for bad in ["", ".hidden", "a/b", "../x", "a b", "x" * 201]:
        with pytest.raises(ValidationError, match="run_id"):
            backend.launch(task(bad, "true"))
        assert backend.status(bad) is None
    assert backend.status("unknown") is None
    assert backend.log_path("unknown", "stdout") is None
    with pytest.raises(ValidationError, match="stream"):
        backend.log_path("unknown", "both")  # type: ignore[arg-type]


def test_forget_keeps_logs_and_idempotency(backend: ProcessBackend) -> None:
    backend.launch(task("busy", "sleep 100"))
    with pytest.raises(PlatformError, match="still running"):
        backend.forget("busy")
    backend.stop("busy", grace_s=1)
    backend.launch(task("fin", "echo out; exit 2"))
    wait_exited(backend, "fin")
    backend.forget("fin")
    backend.forget("fin")
    backend.forget("unknown")
    assert [s.run_id for s in backend.list()] == ["busy"]
    assert backend.status("fin").exit_code == 2
    assert backend.launch(task("fin", "echo again")).exit_code == 2
    assert backend.log_path("fin", "stdout").read_text() == "out\n"


def test_a_wrapper_is_alive_only_as_the_process_psutil_timed(tmp_path: Path) -> None:
    """The liveness check reads /proc/<pid>/stat itself: the process exists, is no zombie, and
    started when psutil said at spawn (a pid reused since is another process), also when its
    command name holds spaces and parentheses, which end the name field only at the last ')'."""
    from apiary.runtime.process import _alive_since

    odd = tmp_path / "a) b ("
    shutil.copy("/bin/sleep", odd)
    proc = subprocess.Popen([str(odd), "30"])
    try:
        created = psutil.Process(proc.pid).create_time()
        assert _alive_since(proc.pid, created)
        assert not _alive_since(proc.pid, created - 5)  # the pid names another process now
        proc.kill()
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _alive_since(proc.pid, created)  # exited, not yet reaped
    finally:
        proc.kill()
        proc.wait()
    assert not _alive_since(proc.pid, created)  # reaped: no such process
