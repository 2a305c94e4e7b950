"""The platform's home holds the jobs' secrets (the store and its WAL, task logs, the agents' launch
records and scripts), so it is kept to the user the platform runs as: the home is 0700 and every
file in it 0600, every directory 0700, for the embedded platform started in process (as ``apiary
demo`` does) and for ``apiary up``, on a fresh home and on one left 0755 by an older version.
Another user (``nobody``) cannot read the secret from the WAL, as it could before.

The unit tests below show the pieces: a SQLite store, its WAL and index are 0600 whatever the
umask, and an existing 0644 store is tightened.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from tests.support.builders import LAB6
from tests.support.polling import nodes_ready, until

from apiary.client import ApiaryClient
from apiary.embedded import REPO_ROOT, Embedded
from apiary.store import make_engine
from apiary.tracking.prefect_server import free_port, start_prefect_server

SECRET = "hunter2-b7c1f0e9d4"  # noqa: S105 - a test value that must not be readable by others
JOB = f"""\
protocolVersion: 2
name: secret-job
type: job
prerequisites:
  - {{type: dockerimage, name: img, uri: ubuntu:22.04}}
secrets:
  password: {SECRET}
taskRoles:
  main:
    instances: 1
    dockerImage: img
    resourcePerInstance: {{cpu: 1, memoryMB: 1024, gpu: 1}}
    commands:
      - echo "password=<% $secrets.password %>"
defaults:
  virtualCluster: default
"""


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual login umask, as a developer or CI runs the tests; restored after."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def open_to_others(home: Path) -> list[str]:
    """``"<mode> <path>"`` of every file or directory under ``home`` (itself included) that its
    group or others may read, write or enter. The storage ``apiary up`` makes (``home/storage/home``,
    1777: tasks of changing uids write their outputs there) is left out, and ``home/storage`` must
    be 0700: tasks reach that directory only through the bind at their mount point."""
    found = []
    storage = home / "storage"
    if storage.exists() and stat.S_IMODE(storage.stat().st_mode) != 0o700:
        found.append(f"{stat.S_IMODE(storage.stat().st_mode):o} {storage.relative_to(home.parent)}")
    for path in [home, *sorted(home.rglob("*"))]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if storage in path.parents and path != storage / ".bootstrapped":
            continue
        if not path.is_symlink() and mode & 0o077:
            found.append(f"{mode:o} {path.relative_to(home.parent)}")
    return found


def assert_private(home: Path) -> None:
    """The home is 0700, nothing in it is open to group or others, and the files that hold the
    secret exist (so the check covered them) and do hold it; first of all, user ``nobody`` cannot
    read the secret from the WAL."""
    assert_nobody_cannot_read(home / "apiary.db-wal")
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert open_to_others(home) == []
    for name in ("apiary.db", "apiary.db-wal", "apiary.db-shm"):
        assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
    run_dirs = list((home / "agents").glob("*/admin~secret-job.*"))
    assert run_dirs, sorted(p.name for p in (home / "agents").rglob("*"))
    launch = run_dirs[0] / "launch.json"
    assert stat.S_IMODE(launch.stat().st_mode) == 0o600 and SECRET in launch.read_text()
    for name in ("script.sh", "stdout.log"):  # where the runtime keeps them in the run's record
        record = run_dirs[0] / name
        assert not record.exists() or stat.S_IMODE(record.stat().st_mode) == 0o600, record
    task_logs = list((home / "task-logs").glob("admin~secret-job.*.stdout.log"))
    assert task_logs and f"password={SECRET}" in task_logs[0].read_text()
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in task_logs)
    store = b"".join((home / n).read_bytes() for n in ("apiary.db", "apiary.db-wal"))
    assert SECRET.encode() in store  # root reads it: the store holds the secret


def nobody_reads(path: Path) -> bool:
    """Whether user ``nobody`` can read ``path`` (``runuser -u nobody -- grep``, as the attack
    was run, or setuid in a forked child where there is no runuser). Skips the test unless root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    runuser = shutil.which("runuser")
    if runuser:
        r = subprocess.run([runuser, "-u", "nobody", "--", "grep", "-c", SECRET, str(path)],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode in (0, 1) or "Permission denied" in r.stderr, (r.returncode, r.stdout, r.stderr)
        return r.returncode in (0, 1)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            path.read_bytes()
            code = 0
        except PermissionError:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 1), f"the reading child failed: {code}"
    return code == 0


def assert_nobody_cannot_read(path: Path) -> None:
    """``nobody`` cannot read ``path``, though it can reach a world-readable file beside the home
    (without that control, a private temporary directory above the home would pass the test)."""
    probe = path.parent.parent / "probe"
    probe.write_text(SECRET)
    os.chmod(probe, 0o644)
    assert nobody_reads(probe), f"nobody cannot reach {probe.parent}: the test cannot tell anything"
    assert not nobody_reads(path), f"nobody read {path}"


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    """A fresh directory that any user may pass through (0711), for a home that only its own modes
    protect; removed after. (pytest's temporary directories are 0700 and would hide a 0755 home.)"""
    path = Path(tempfile.mkdtemp(prefix="apiary-home-modes-"))
    os.chmod(path, 0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def this_checkout_first() -> str:
    """``PYTHONPATH`` for the platform's processes: this checkout's ``platform/`` before whatever
    copy of apiary the interpreter has installed (so a checkout of older code tests that code)."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT / "platform"), os.environ.get("PYTHONPATH")]))


def run_secret_job(client: ApiaryClient) -> None:
    job = client.submit(JOB)
    done = client.wait(job["id"], timeout=180, poll_s=0.2)
    assert done["state"] == "SUCCEEDED", done


# ---------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_the_embedded_platform_keeps_its_home_and_every_file_in_it_private(
        reachable_dir: Path, umask_022: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", this_checkout_first())
    home = reachable_dir / "home"  # left 0755 with a 0644 store by an older version
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    sqlite3.connect(home / "apiary.db").close()
    os.chmod(home / "apiary.db", 0o644)
    platform = Embedded(home=home, cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=False,
                        workdir=str(REPO_ROOT))
    try:
        platform.start()
        assert _umask() == 0o022  # the program that embeds the platform keeps its own umask
        client = platform.client()
        until(lambda: nodes_ready(client, 2), 90, "node agents")
        run_secret_job(client)
        assert_private(home)
    finally:
        platform.stop()


@pytest.mark.e2e
def test_apiary_up_keeps_its_home_and_every_file_in_it_private(tmp_path: Path, reachable_dir: Path,
                                                               umask_022: None) -> None:
    home = reachable_dir / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    port = free_port()
    env = {**os.environ, "APIARY_HOME": str(home), "PREFECT_HOME": str(tmp_path / "ph"), "DO_NOT_TRACK": "1",
           "PYTHONPATH": this_checkout_first()}
    env.pop("APIARY_API_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "apiary", "up", "--no-prefect", "--port", str(port), "--cluster",
         str(LAB6 / "hived-config-two-vcs.yaml")],
        env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        until(lambda: (home / "run" / "api_url").exists() or proc.poll() is not None, 90, "apiary up")
        assert proc.poll() is None, f"apiary up exited with {proc.returncode}"
        client = ApiaryClient(f"http://127.0.0.1:{port}", token=(home / "token").read_text().strip(), timeout=30)
        until(lambda: nodes_ready(client, 2), 90, "node agents")
        run_secret_job(client)
        assert_private(home)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


@pytest.mark.prefect
def test_the_prefect_server_keeps_its_home_private(reachable_dir: Path, umask_022: None) -> None:
    """Prefect's database holds flow runs' parameters (a job YAML pasted into submit-yaml, secrets
    included): ``apiary up`` keeps it in ``APIARY_HOME/prefect``."""
    home = reachable_dir / "prefect"
    server = start_prefect_server(home)
    try:
        assert (home / "prefect.db").exists()
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        assert open_to_others(home) == []
    finally:
        server.stop()


# ---------------------------------------------------------------------- the store
def _write_job_row(url: str) -> None:
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS t (v TEXT)"))
        conn.execute(text("INSERT INTO t VALUES (:v)"), {"v": SECRET})
    engine.dispose()


def test_a_new_sqlite_store_and_its_wal_are_0600_under_a_022_umask(tmp_path: Path, umask_022: None) -> None:
    db = tmp_path / "state" / "apiary.db"
    engine = make_engine(f"sqlite:///{db}")
    with engine.begin() as conn:  # keeps the WAL and its index while the connection is open
        conn.execute(text("CREATE TABLE t (v TEXT)"))
        conn.execute(text("INSERT INTO t VALUES (:v)"), {"v": SECRET})
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in db.parent.iterdir()}
    engine.dispose()
    assert modes == {"apiary.db": 0o600, "apiary.db-wal": 0o600, "apiary.db-shm": 0o600}
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700


def test_an_existing_0644_store_and_wal_are_made_0600(tmp_path: Path, umask_022: None) -> None:
    db = tmp_path / "apiary.db"
    conn = sqlite3.connect(db)  # an older platform's store, WAL left behind by a kill -9
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (v TEXT)")
    conn.commit()
    for p in tmp_path.glob("apiary.db*"):
        os.chmod(p, 0o644)
    try:
        _write_job_row(f"sqlite:///{db}")
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("apiary.db*")}
    finally:
        conn.close()
    assert modes == {"apiary.db": 0o600, "apiary.db-wal": 0o600, "apiary.db-shm": 0o600}


def test_store_errors_do_not_carry_the_statement_parameters(tmp_path: Path) -> None:
    """An error of the store (logged with its traceback by whoever catches it) names the statement,
    never its parameters: a job's YAML, with its secrets, is one."""
    engine = make_engine(f"sqlite:///{tmp_path}/apiary.db")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (v TEXT UNIQUE)"))
    with pytest.raises(IntegrityError) as failed, engine.begin() as conn:
        for _ in range(2):
            conn.execute(text("INSERT INTO t VALUES (:v)"), {"v": f"secrets: {{password: {SECRET}}}"})
    engine.dispose()
    assert "INSERT INTO t" in str(failed.value)
    assert SECRET not in str(failed.value)
