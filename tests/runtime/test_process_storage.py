"""The process runtime's storage: each task gets its storage bound at the mount points in a mount
namespace of its own (apiary.runtime.process), read-only where asked, invisible to the node and to
other tasks. Needs root (uid switching, mount namespaces)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from apiary.runtime import ProcessBackend, TaskLaunch, TaskStatus

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="mount namespaces are Linux's"),
    pytest.mark.skipif(os.geteuid() != 0, reason="binding storage in a task's mount namespace needs root"),
]


def wait_exited(backend: ProcessBackend, run_id: str, timeout: float = 30.0) -> TaskStatus:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = backend.status(run_id)
        if st is not None and st.state == "exited":
            return st
        time.sleep(0.02)
    pytest.fail(f"{run_id} did not exit in {timeout}s")


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path, str]]:
    """(state dir, a storage directory, a mount point that does not exist yet)."""
    d = Path(tempfile.mkdtemp(prefix="apiary-storage-", dir="/tmp"))
    os.chmod(d, 0o755)  # the tasks' uids enter it (their scratch is under it)
    share = d / "share"
    share.mkdir()
    os.chmod(share, 0o777)
    (share / "in.txt").write_text("from storage\n")
    os.chmod(share / "in.txt", 0o644)  # whatever umask an earlier test left: tasks run as other uids
    target = f"/mnt/apiary-test-{os.getpid()}"
    yield d / "state", share, target
    shutil.rmtree(d, ignore_errors=True)
    if os.path.isdir(target):
        os.rmdir(target)


def _task(run_id: str, command: str, mounts: list[dict]) -> TaskLaunch:
    return TaskLaunch(run_id=run_id, job_id="alice~j", user="alice", job_name="j", task_role="train", index=0,
                      commands=[command], mounts=mounts)


def _read(backend: ProcessBackend, run_id: str, stream: str = "stdout") -> str:
    path = backend.log_path(run_id, stream)
    return path.read_text() if path is not None else ""


def test_a_task_reads_and_writes_its_storage_at_the_mount_point(dirs: tuple[Path, Path, str]) -> None:
    state, share, target = dirs
    b = ProcessBackend(state, scratch_root=state.parent / "scratch")
    b.launch(_task("rw", f"cat {target}/in.txt; echo out > {target}/out.txt; id -u",
                   [{"source": str(share), "target": target, "readOnly": False}]))
    st = wait_exited(b, "rw")
    assert st.exit_code == 0, _read(b, "rw", "stderr")
    lines = _read(b, "rw").splitlines()
    assert lines[0] == "from storage" and int(lines[1]) != 0  # read it, as an unprivileged uid
    assert (share / "out.txt").read_text() == "out\n"
    # The bind lived in the task's namespace only: the node's mount point is an empty directory.
    assert os.listdir(target) == []
    assert target not in Path("/proc/self/mountinfo").read_text()


def test_read_only_is_enforced(dirs: tuple[Path, Path, str]) -> None:
    state, share, target = dirs
    b = ProcessBackend(state, scratch_root=state.parent / "scratch")
    b.launch(_task("ro", f"cat {target}/in.txt && touch {target}/new",
                   [{"source": str(share), "target": target, "readOnly": True}]))
    st = wait_exited(b, "ro")
    assert st.exit_code != 0
    assert "Read-only file system" in _read(b, "ro", "stderr")
    assert not (share / "new").exists()


def test_a_task_without_storage_sees_nothing_at_the_mount_point(dirs: tuple[Path, Path, str]) -> None:
    state, share, target = dirs
    b = ProcessBackend(state, scratch_root=state.parent / "scratch")
    b.launch(_task("with", "sleep 30", [{"source": str(share), "target": target, "readOnly": False}]))
    b.launch(_task("without", f"ls -A {target} 2>/dev/null | wc -l", []))
    st = wait_exited(b, "without")
    assert st.exit_code == 0 and _read(b, "without").strip() == "0"
    b.stop("with", grace_s=0.5)
