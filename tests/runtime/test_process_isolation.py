"""ProcessBackend's isolation and durability: tasks run as uids of their own and cannot touch the
agent or each other, records are private whatever the umask, a full disk cannot lose an exit
code, and an agent killed at any step of a launch never leaves a run that reads as exited
without a start or that runs twice. Needs root (uid switching, tmpfs mounts)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from apiary.errors import PlatformError
from apiary.runtime import ProcessBackend, TaskLaunch, TaskStatus

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="process backend semantics are tested on Linux"),
    pytest.mark.skipif(os.geteuid() != 0, reason="switching tasks to other uids needs root"),
]

DEADLINE_S = 30.0


def until(pred: Callable[[], object], what: str, timeout: float = DEADLINE_S) -> object:
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def wait_exited(backend: ProcessBackend, run_id: str) -> TaskStatus:
    def done() -> TaskStatus | None:
        st = backend.status(run_id)
        return st if st is not None and st.state == "exited" else None

    return until(done, f"{run_id} to exit")  # type: ignore[return-value]


def task(run_id: str, *commands: str, **kw: object) -> TaskLaunch:
    fields: dict = dict(run_id=run_id, job_id="job-1", user="alice", job_name="mnist", task_role="train",
                        index=0, commands=list(commands))
    fields.update(kw)
    return TaskLaunch(**fields)


def uid_processes(uid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["uids"]):
        if p.info["uids"] is not None and uid in p.info["uids"]:
            out.append(p)
    return out


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory under /tmp that every uid may enter (tmp_path's parents are root's, 0700)."""
    d = Path(tempfile.mkdtemp(prefix="apiary-iso-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def backends() -> Iterator[list[ProcessBackend]]:
    made: list[ProcessBackend] = []
    yield made
    for b in made:
        for st in b.list():
            if st.state == "running":
                b.stop(st.run_id, grace_s=0.5)


def test_a_task_runs_as_its_own_uid_and_cannot_read_signal_or_forge_the_agents_files(
    open_dir: Path, backends: list[ProcessBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent's state sits in a directory anyone may enter, so only the records' own modes and
    # the task's uid stand between the task and them.
    monkeypatch.setenv("APIARY_SECRET_IN_AGENT_ENV", "s3cret")
    state = open_dir / "state"
    secret = open_dir / "token"
    secret.write_text("admin-token\n")
    os.chmod(secret, 0o600)
    b = ProcessBackend(state)
    backends.append(b)
    probes = {
        "launch": f"cat {state}/iso/launch.json",
        "script": f"cat {state}/iso/script.sh",
        "token": f"cat {secret}",
        "environ": f"cat /proc/{os.getpid()}/environ",
        "signal": "kill -0 $PPID",  # the wrapper, root's
        "forge": f"echo 0 > {state}/iso/exit_code",
    }
    commands = ["echo uid=$(id -u) gid=$(id -g) groups=$(id -G)", "echo home=$HOME cwd=$(pwd)",
                "touch \"$HOME/mine\" && echo home-writable"]
    commands += [f"if {cmd} >/dev/null 2>&1; then echo GOT-{name}; else echo denied-{name}; fi"
                 for name, cmd in probes.items()]
    commands.append("exit 4")
    b.launch(task("iso", *commands))
    final = wait_exited(b, "iso")
    out = b.log_path("iso", "stdout").read_text()
    assert final.exit_code == 4 and not final.lost, out  # the wrapper, not the task, recorded it
    fields = dict(w.split("=", 1) for w in out.split() if "=" in w)
    uid = int(fields["uid"])
    assert uid != 0 and fields["gid"] == str(uid) and fields["groups"] == str(uid), out
    assert json.loads((state / "iso" / "launch.json").read_text())["task_uid"] == uid
    assert fields["home"] == fields["cwd"] and not fields["home"].startswith(str(state)), out
    assert "home-writable" in out
    assert [line for line in out.splitlines() if line.startswith("GOT-")] == [], out
    assert {f"denied-{name}" for name in probes} <= set(out.splitlines())
    assert "s3cret" not in out


def test_concurrent_tasks_get_different_uids_and_cannot_read_each_others_environment(
    open_dir: Path, backends: list[ProcessBackend]
) -> None:
    meet = open_dir / "meet"
    meet.mkdir()
    os.chmod(meet, 0o1777)
    b = ProcessBackend(open_dir / "state")
    backends.append(b)

    def peer(me: str, other: str) -> TaskLaunch:
        return task(me, f"echo $$ > {meet}/{me}.pid", f"until [ -s {meet}/{other}.pid ]; do sleep 0.05; done",
                    "id -u",
                    f"if cat /proc/$(cat {meet}/{other}.pid)/environ >/dev/null 2>&1; then echo GOT; "
                    "else echo denied; fi",
                    f"touch {meet}/{me}.done", f"until [ -e {meet}/{other}.done ]; do sleep 0.05; done",
                    env={"JOB_SECRET": f"secret-of-{me}"})

    b.launch(peer("a", "b"))
    b.launch(peer("b", "a"))
    outs = [(wait_exited(b, r), b.log_path(r, "stdout").read_text().split()) for r in ("a", "b")]
    assert all(st.exit_code == 0 for st, _ in outs), outs
    uids = {int(out[0]) for _, out in outs}
    assert len(uids) == 2 and 0 not in uids, outs
    assert [out[1] for _, out in outs] == ["denied", "denied"]


def test_an_ended_task_leaves_nothing_running_as_its_uid_and_its_home_is_removed(
    backends: list[ProcessBackend], tmp_path: Path
) -> None:
    b = ProcessBackend(tmp_path / "state")
    backends.append(b)
    # setsid: the daemon leaves the task's process group, so only the uid still finds it.
    b.launch(task("daemon", "setsid sleep 300 </dev/null >/dev/null 2>&1 &", "echo $HOME; id -u"))
    assert wait_exited(b, "daemon").exit_code == 0
    home, uid = b.log_path("daemon", "stdout").read_text().split()
    assert int(uid) != 0
    until(lambda: not uid_processes(int(uid)), "the daemon of the ended task to be killed")
    until(lambda: not Path(home).exists(), "the ended task's home to be removed")  # released in the background


def test_records_are_private_to_root_whatever_the_umask(
    tmp_path: Path, backends: list[ProcessBackend]
) -> None:
    old = os.umask(0)
    try:
        b = ProcessBackend(tmp_path / "state")
        backends.append(b)
        b.launch(task("private", "echo out; echo err >&2"))
        wait_exited(b, "private")
        b.stop("private")
        b.forget("private")
    finally:
        os.umask(old)
    state = tmp_path / "state"
    seen = {}
    for path in [state, *state.rglob("*")]:
        st = path.lstat()
        seen[path.name] = oct(stat.S_IMODE(st.st_mode))
        assert st.st_uid == 0 and st.st_gid == 0, path
        assert stat.S_IMODE(st.st_mode) == (0o700 if path.is_dir() else 0o600), (path, seen[path.name])
    assert {"launch.json", "script.sh", "wrapper.sh", "env", "stdout.log", "stderr.log", "exit_code",
            "meta.json", "forgotten"} <= set(seen)


def test_a_non_root_agent_refuses_tasks_unless_unisolated_tasks_are_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backends: list[ProcessBackend]
) -> None:
    monkeypatch.delenv("APIARY_ALLOW_UNISOLATED_TASKS", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # an agent that cannot switch uids
    b = ProcessBackend(tmp_path / "state")
    backends.append(b)
    with pytest.raises(PlatformError, match="APIARY_ALLOW_UNISOLATED_TASKS"):
        b.launch(task("refused", "echo ran"))
    assert b.status("refused") is None and list((tmp_path / "state").iterdir()) == []
    monkeypatch.setenv("APIARY_ALLOW_UNISOLATED_TASKS", "1")
    dev = ProcessBackend(tmp_path / "state")
    backends.append(dev)
    dev.launch(task("refused", "id -u"))
    assert wait_exited(dev, "refused").exit_code == 0
    assert dev.log_path("refused", "stdout").read_text() == "0\n"  # the agent's own user (root here)


# --------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted at teardown."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path) -> None:
    for i, bs in enumerate(("64k", "512", "1")):  # to the last byte
        subprocess.run(["dd", "if=/dev/zero", f"of={disk}/fill{i}", f"bs={bs}"], capture_output=True)
    assert os.statvfs(disk).f_bavail == 0


def test_a_task_that_ends_while_the_disk_is_full_keeps_its_exit_code_and_never_runs_again(
    small_disk: Path, open_dir: Path, backends: list[ProcessBackend]
) -> None:
    gate = open_dir / "go"
    b = ProcessBackend(small_disk / "state")
    backends.append(b)
    b.launch(task("full", f"until [ -e {gate} ]; do sleep 0.05; done", "exit 3"))
    until(lambda: (b.status("full") or b).started_at, "the task to start")  # type: ignore[union-attr]
    fill(small_disk)
    gate.touch()
    final = wait_exited(b, "full")
    assert (final.exit_code, final.lost, final.started_at is not None) == (3, False, True), final
    assert os.statvfs(small_disk).f_bavail == 0  # still full: the slot needed no space
    again = ProcessBackend(small_disk / "state")  # a restarted agent reads the same
    assert again.status("full").exit_code == 3  # type: ignore[union-attr]
    assert again.launch(task("full", "exit 0")).exit_code == 3  # and never runs it again


def test_a_launch_on_a_full_disk_is_refused_and_starts_nothing(
    small_disk: Path, open_dir: Path, backends: list[ProcessBackend]
) -> None:
    os.chmod(open_dir, 0o1777)  # the task writes its marker there
    b = ProcessBackend(small_disk / "state")
    backends.append(b)
    fill(small_disk)
    with pytest.raises(PlatformError):
        b.launch(task("refused", f"touch {open_dir}/refused-ran"))
    assert b.status("refused") is None and b.list() == []  # nothing recorded: a retry may launch
    assert not (open_dir / "refused-ran").exists()
    for f in small_disk.glob("fill*"):
        f.unlink()
    b.launch(task("refused", f"touch {open_dir}/refused-ran"))
    assert wait_exited(b, "refused").exit_code == 0
    assert (open_dir / "refused-ran").exists()


# --------------------------------------------------------------------------- crashes mid-launch

# Runs one launch in a child process that SIGKILLs itself right after the n-th step of the
# launch (each write, the uid lease, the spawn) -- an agent dying at that point.
_CRASHING_AGENT = textwrap.dedent(r"""
    import os, signal, subprocess, sys
    import apiary.runtime.process as P
    from apiary.runtime.base import TaskLaunch

    state, kill_at, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    steps = [0]

    def step(fn):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            steps[0] += 1
            if steps[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        return wrapped

    if mode == "steps":
        for name in ("_write_atomic", "_write_private", "_preallocate_slot", "_open_private"):
            if hasattr(P, name):
                setattr(P, name, step(getattr(P, name)))
        if hasattr(P, "UidPool"):
            P.UidPool.acquire = step(P.UidPool.acquire)
            P.UidPool.write_script = step(P.UidPool.write_script)
        subprocess.Popen = step(subprocess.Popen)
    else:  # killed while writing meta.json: its temporary file written, not yet renamed
        real_replace = os.replace
        def replace(src, dst):
            if str(dst).endswith("meta.json"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst)
        os.replace = replace
    backend = P.ProcessBackend(state)
    backend.launch(TaskLaunch(run_id="crash", job_id="j", user="alice", job_name="n", task_role="t",
                              index=0, commands=["echo ran"]))
    print("launched", steps[0])
""")


def crashing_launch(state: Path, kill_at: int, mode: str = "steps") -> bool:
    """True if the child agent finished the launch, False if it was killed mid-way."""
    done = subprocess.run([sys.executable, "-c", _CRASHING_AGENT, str(state), str(kill_at), mode],
                          capture_output=True, text=True, timeout=60)
    if done.returncode == -signal.SIGKILL:
        return False
    assert done.returncode == 0 and "launched" in done.stdout, done.stderr
    return True


def ran(state: Path) -> int:
    log = state / "crash" / "stdout.log"
    return log.read_text().count("ran\n") if log.exists() else 0


def assert_recovers_exactly_once(state: Path, backends: list[ProcessBackend]) -> None:
    """What a restarted agent must find after a crash mid-launch (module doc of process.py)."""
    b = ProcessBackend(state)
    backends.append(b)
    first = b.status("crash")
    if first is None:  # not launched: the task never ran, and a retry launches it once
        assert ran(state) == 0
        assert [s.run_id for s in b.list()] == []
        b.launch(task("crash", "echo ran"))
    else:
        assert first.started_at is not None, f"{first} reads as run without a start"
        assert [s.run_id for s in b.list()] == ["crash"]
    final = wait_exited(b, "crash")
    assert (final.exit_code, final.lost, final.started_at is not None) == (0, False, True), final
    assert b.launch(task("crash", "echo ran")).state == "exited"
    assert ran(state) == 1


def test_an_agent_killed_at_any_step_of_a_launch_never_runs_a_task_twice_or_without_a_start(
    tmp_path: Path, backends: list[ProcessBackend]
) -> None:
    kill_at = 1
    while True:
        state = tmp_path / f"state{kill_at}"
        finished = crashing_launch(state, kill_at)
        assert_recovers_exactly_once(state, backends)
        if finished:
            break
        kill_at += 1
        assert kill_at < 40, "the launch never finished"
    assert kill_at > 5  # every step was tried: records, lease, spawn, meta.json


def test_an_agent_killed_while_recording_the_spawn_leaves_a_run_with_its_start(
    tmp_path: Path, backends: list[ProcessBackend]
) -> None:
    state = tmp_path / "state"
    assert not crashing_launch(state, 0, mode="meta")
    assert (state / "crash" / ".meta.json.tmp").exists() and not (state / "crash" / "meta.json").exists()
    until(lambda: ran(state), "the task to run")
    st = ProcessBackend(state).status("crash")
    # Before, this read "exited 0" with no start time, and the control plane refused it.
    assert st is not None and st.started_at is not None, st
    assert_recovers_exactly_once(state, backends)


def test_exec_prefix_runs_a_command_as_the_tasks_uid(tmp_path: Path, backends: list[ProcessBackend]) -> None:
    b = ProcessBackend(tmp_path / "state")
    backends.append(b)
    b.launch(task("probed", "id -u", "sleep 30"))
    until(lambda: b.log_path("probed", "stdout").read_text(), "the task's uid")  # type: ignore[union-attr]
    uid = b.log_path("probed", "stdout").read_text().strip()  # type: ignore[union-attr]
    probe = subprocess.run([*b.exec_prefix("probed"), "id", "-u"], capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == uid != "0"
    with pytest.raises(PlatformError):
        b.exec_prefix("never-launched")


def test_releasing_a_uid_does_not_wait_on_its_zombies() -> None:
    """A task's child that died but was not reaped (its parent gone first, and init reaping slowly,
    as in a container) is a zombie of the task's uid: it runs nothing and cannot be killed, so the
    release must not wait for it (it did, 2 s each, which delayed every stopped job's exit)."""
    import time

    from apiary.runtime.isolation import kill_uid

    uid = 1999999999  # outside the default task range: no task of a concurrent test has it
    zombie = subprocess.Popen(["true"], user=uid, group=uid)  # never waited for below: a zombie
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        assert kill_uid(uid, timeout_s=1.0) is True
        assert time.monotonic() - t0 < 0.5
    finally:
        zombie.wait()


def test_a_run_recorded_before_the_started_slot_reads_lost_not_unlaunched(tmp_path: Path) -> None:
    """An agent upgraded over a run of the older layout (launch.json without task_uid, no started
    slot) whose wrapper ran and died unrecorded: lost, as before. Reading it as never launched would
    let the agent start it a second time."""
    backend = ProcessBackend(tmp_path / "state")
    run_dir = tmp_path / "state" / "bob~old.a0.train.0.t0"
    run_dir.mkdir()
    (run_dir / "launch.json").write_text(json.dumps({"run_id": run_dir.name, "commands": ["true"]}))
    st = backend.status(run_dir.name)
    assert st is not None and st.state == "exited" and st.lost


def test_background_releases_share_a_scan_and_keep_their_uids_leased_until_done(tmp_path: Path) -> None:
    """release(wait=False) returns at once; until the drainer has killed what runs as the uid and
    deleted the lease, the uid is not leased again; then both daemons are gone and both leases too,
    killed by one kill_uids for both uids (one /proc scan a round, not one per release)."""
    import time

    from apiary.runtime import isolation

    pool = isolation.UidPool(tmp_path / "scratch", 1999999980, 1999999982)
    runs = [tmp_path / "run-a", tmp_path / "run-b", tmp_path / "run-c"]
    for run in runs:  # a lease whose run directory is gone is stale: reclaimed by the next acquire
        run.mkdir()
    runs = runs[:2]
    idents = [pool.acquire(run) for run in runs]
    daemons = [subprocess.Popen(["sleep", "300"], user=i.uid, group=i.uid, start_new_session=True)
               for i in idents]
    batches: list[set[int]] = []
    real = isolation.kill_uids

    def recorded(targets: set[int], timeout_s: float = 2.0) -> set[int]:
        batches.append(set(targets))
        return real(targets, timeout_s)

    drainer = isolation._Drainer(delay_s=0.3)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(isolation, "_DRAINER", drainer)
            mp.setattr(isolation, "kill_uids", recorded)
            t0 = time.monotonic()
            assert all(pool.release(i.uid, run, wait=False) for i, run in zip(idents, runs, strict=True))
            assert time.monotonic() - t0 < 0.2 and all(d.poll() is None for d in daemons)
            assert all(i.lease.exists() for i in idents)
            third = pool.acquire(tmp_path / "run-c")  # not one of the two still draining
            assert third.uid not in {i.uid for i in idents}
            until(lambda: all(d.poll() is not None for d in daemons), "both daemons to be killed")
            until(lambda: not any(i.lease.exists() for i in idents), "both leases to be deleted")
            assert not drainer.waiting(idents[0].lease)
            mine = {i.uid for i in idents}
            # Both releases in one kill_uids, its scans serving both. (Earlier tests' runs, released
            # by the process's own drainer, may call the patched kill_uids meanwhile.)
            assert [b for b in batches if b & mine] == [mine]
    finally:
        for d in daemons:
            if d.poll() is None:
                d.kill()
            d.wait()


def test_a_queued_release_leaves_alone_a_lease_another_agent_took_over_meanwhile(tmp_path: Path) -> None:
    """Another agent process may reclaim a queued lease (its run had recorded its exit) and lease
    the uid to a run of its own before the drainer gets to it: that run's processes and lease stay."""
    from apiary.runtime import isolation

    pool = isolation.UidPool(tmp_path / "scratch", 1999999983, 1999999983)
    mine, theirs = tmp_path / "run-mine", tmp_path / "run-theirs"
    mine.mkdir()
    theirs.mkdir()
    ident = pool.acquire(mine)
    drainer = isolation._Drainer(delay_s=60)  # drained below, by hand
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(isolation, "_DRAINER", drainer)
        assert pool.release(ident.uid, mine, wait=False)
        (ident.lease / "owner").write_text(f"{theirs}\n")  # what the other agent's re-lease leaves
        daemon = subprocess.Popen(["sleep", "300"], user=ident.uid, group=ident.uid, start_new_session=True)
        try:
            drainer.flush()
            assert daemon.poll() is None and ident.lease.exists()
            assert not drainer.waiting(ident.lease)
        finally:
            daemon.kill()
            daemon.wait()


def test_a_sweep_leaves_a_just_exited_runs_lease_to_its_agent_and_reclaims_one_left_behind(tmp_path: Path) -> None:
    """An acquire's sweep reclaims the lease of a run that recorded its exit long ago (its agent
    ended before releasing it) but not one whose run exited just now (its own agent releases it
    after reading the exit; reclaiming it meant a /proc scan per lease, racing that release), and
    the stale ones of a sweep share one kill_uids."""
    import time

    from apiary.runtime import isolation

    pool = isolation.UidPool(tmp_path / "scratch", 1999999970, 1999999979)
    runs = [tmp_path / f"run-{i}" for i in range(4)]
    for run in runs:
        run.mkdir()
    idents = [pool.acquire(run) for run in runs]
    (runs[0] / "exit_code").write_text("0\n")  # exited just now: its agent's to release
    (runs[1] / "exit_code").write_text("1\n")  # exited long ago: left behind
    old = time.time() - isolation._EXITED_GRACE_S - 5
    os.utime(runs[1] / "exit_code", (old, old))
    shutil.rmtree(runs[2])  # its records deleted: left behind
    batches: list[set[int]] = []
    real = isolation.kill_uids

    def recorded(targets: set[int], timeout_s: float = 2.0) -> set[int]:
        batches.append(set(targets))
        return real(targets, timeout_s)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(isolation, "kill_uids", recorded)
        mp.setattr(isolation, "_swept_at", {})  # due now
        pool.acquire(tmp_path / "run-new")
    assert idents[0].lease.exists() and idents[3].lease.exists()
    assert not idents[1].lease.exists() and not idents[2].lease.exists()
    assert batches == [{idents[1].uid, idents[2].uid}]


def test_an_acquire_sweeps_at_most_once_a_second_unless_no_uid_is_free(tmp_path: Path) -> None:
    """Back-to-back acquires sweep the scratch root once, not each time; when every uid of the
    range is leased, an acquire reclaims the lease of a run that has just exited at once rather
    than fail."""
    from apiary.runtime import isolation

    pool = isolation.UidPool(tmp_path / "scratch", 1999999960, 1999999962)
    sweeps: list[float] = []
    real = isolation.UidPool._sweep

    def counted(self: isolation.UidPool, *args: object, **kw: object) -> None:
        sweeps.append(kw.get("grace_s", isolation._EXITED_GRACE_S))  # type: ignore[arg-type]
        real(self, *args, **kw)  # type: ignore[arg-type]

    runs = [tmp_path / f"run-{i}" for i in range(4)]
    for run in runs:
        run.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(isolation.UidPool, "_sweep", counted)
        mp.setattr(isolation, "_swept_at", {})
        mp.setattr(isolation, "_SWEEP_EVERY_S", 3600.0)
        idents = [pool.acquire(run) for run in runs[:3]]
        assert sweeps == [isolation._EXITED_GRACE_S]  # the first acquire's only
        (runs[1] / "exit_code").write_text("0\n")  # exited just now, not released yet
        fourth = pool.acquire(runs[3])
    assert sweeps == [isolation._EXITED_GRACE_S, 0.0]
    assert fourth.uid == idents[1].uid and (fourth.lease / "owner").read_text().strip() == str(runs[3])
    with pytest.raises(PlatformError, match="no free task uid"):
        pool.acquire(tmp_path / "run-more")


def test_the_next_uid_hint_is_rewritten_in_place_not_replaced(tmp_path: Path) -> None:
    """The walk's hint is one file overwritten in place: a new file and a rename per lease left a
    deleted inode per task behind, which ext4 without a journal makes every later creation step
    over. An older hint file (a shorter line) still reads."""
    from apiary.runtime import isolation

    pool = isolation.UidPool(tmp_path / "scratch", 1999999950, 1999999954)
    runs = [tmp_path / f"run-{i}" for i in range(3)]
    for run in runs:
        run.mkdir()
    first = pool.acquire(runs[0])
    hint = tmp_path / "scratch" / ".next"
    inode = hint.stat().st_ino
    second = pool.acquire(runs[1])
    assert second.uid == first.uid + 1
    assert hint.stat().st_ino == inode and int(hint.read_text()) == second.uid + 1
    assert stat.S_IMODE(hint.stat().st_mode) == 0o600
    hint.write_text(f"{1999999954}\n")  # as write_atomic left it
    assert pool.acquire(runs[2]).uid == 1999999954
    assert int(hint.read_text()) == 1999999950  # wrapped around to the range's first
