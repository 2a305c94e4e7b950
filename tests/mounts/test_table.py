"""apiary.mounts.table without file servers: local servers, and the table's bookkeeping with a
tmpfs (or a hanging or failing command) standing in for the mount command of a real server."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from apiary.errors import NotFoundError, ValidationError
from apiary.mounts import table as table_mod
from apiary.mounts.servers import ServerSpec
from apiary.mounts.table import MountError, MountTable, is_mounted, mount_points

GLUSTER = ServerSpec("team", "glusterfs", {"address": "gfs1", "volume": "team"})
KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nsupersecretkeymaterial0123\n"
SECRET_SSH = ServerSpec("ssh", "sshfs", {"address": "h", "user": "u", "rootPath": "/r", "identity": KEY})

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def fake_mount(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Mount commands become a tmpfs mount; returns the list of targets mounted, in order."""
    calls: list[str] = []

    def argv(spec: ServerSpec, target: Path, private: Path) -> list[str]:
        calls.append(str(target))
        return ["mount", "-t", "tmpfs", "-o", "size=1m", "apiary-test", str(target)]

    monkeypatch.setattr(table_mod, "mount_argv", argv)
    return calls


def test_local_server_is_its_directory(tmp_path: Path) -> None:
    t = MountTable(tmp_path / "m")
    spec = ServerSpec("home", "local", {"rootPath": str(tmp_path)})
    assert t.acquire(spec, "run-1") == tmp_path
    assert t.release("run-1") == [] and t.holders() == set()
    with pytest.raises(MountError, match="'gone' \\(local\\).*not a directory"):
        t.acquire(ServerSpec("gone", "local", {"rootPath": str(tmp_path / "nope")}), "run-1")
    with pytest.raises(ValidationError):
        t.acquire(spec, "")


def test_root_layout_modes(tmp_path: Path) -> None:
    t = MountTable(tmp_path / "m")
    assert stat.S_IMODE(t.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(t.private.stat().st_mode) == 0o700


@needs_root
def test_holders_share_one_mount_and_the_last_release_unmounts(mount_table: MountTable, fake_mount: list[str]) -> None:
    a = mount_table.acquire(GLUSTER, "run-a")
    b = mount_table.acquire(GLUSTER, "run-b")
    assert a == b == mount_table.root / GLUSTER.key and is_mounted(a)
    assert fake_mount == [str(a)]  # mounted once
    assert mount_table.holders(GLUSTER) == {"run-a", "run-b"}
    record = mount_table.private / "holders" / f"{GLUSTER.key}.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert json.loads(record.read_text())["holders"] == ["run-a", "run-b"]
    assert mount_table.release("run-a") == [] and is_mounted(a)
    assert mount_table.release("run-b") == [GLUSTER.key]
    assert not is_mounted(a) and not a.exists() and not record.exists()
    assert mount_table.release("run-b") == []  # idempotent


@needs_root
def test_a_restarted_table_knows_its_holders_and_mounts(mount_table: MountTable, fake_mount: list[str]) -> None:
    target = mount_table.acquire(GLUSTER, "run-a")
    (target / "keep").write_text("x")
    again = MountTable(mount_table.root, timeout_s=5)
    assert again.holders() == {"run-a"}
    assert again.acquire(GLUSTER, "run-b") == target and (target / "keep").exists()
    assert len(fake_mount) == 1  # found mounted in mountinfo, not mounted again
    assert again.reconcile({"run-b"}) == [] and again.holders() == {"run-b"}
    assert again.reconcile(set()) == [GLUSTER.key] and not is_mounted(target)


@needs_root
def test_a_vanished_mount_is_made_again(mount_table: MountTable, fake_mount: list[str]) -> None:
    target = mount_table.acquire(GLUSTER, "run-a")
    subprocess.run(["umount", str(target)], check=True)  # a reboot, or an admin
    assert not is_mounted(target)
    assert mount_table.acquire(GLUSTER, "run-b") == target and is_mounted(target)
    assert len(fake_mount) == 2


@needs_root
def test_busy_mount_is_unmounted_lazily(mount_table: MountTable, fake_mount: list[str]) -> None:
    target = mount_table.acquire(GLUSTER, "run-a")
    with open(target / "open-file", "w") as f:  # keeps the tmpfs busy
        assert mount_table.release("run-a") == [GLUSTER.key]
        assert not is_mounted(target)
        f.write("still writable through the open descriptor")


@needs_root
def test_concurrent_acquires_mount_once(mount_table: MountTable, fake_mount: list[str]) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda i=i: results.append(mount_table.acquire(GLUSTER, f"run-{i}")))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(set(results)) == 1 and len(results) == 8 and len(fake_mount) == 1
    assert [p for p in mount_points() if p.startswith(str(mount_table.root))] == [str(results[0])]


def test_a_hanging_mount_command_times_out_and_leaves_nothing(mount_table: MountTable,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    table = MountTable(mount_table.root, timeout_s=1.0)
    # a FUSE daemon that detached from the mount command's group and names the target
    monkeypatch.setattr(table_mod, "mount_argv", lambda spec, target, private: [
        "bash", "-c", f"setsid sleep 300 {target} & sleep 300"])
    t0 = time.monotonic()
    with pytest.raises(MountError, match=r"'team' \(glusterfs\).*did not finish within 1 s"):
        table.acquire(GLUSTER, "run-a")
    assert time.monotonic() - t0 < 1.0 + 5
    assert table.holders() == set()
    deadline = time.monotonic() + 5
    while _processes_naming(table.root / GLUSTER.key) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_naming(table.root / GLUSTER.key)


def test_a_failing_mount_command_names_server_and_scrubs_secrets(mount_table: MountTable,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    key_line = "supersecretkeymaterial0123"
    monkeypatch.setattr(table_mod, "mount_argv", lambda spec, target, private: [
        "bash", "-c", f"echo 'no route to host; key {key_line}' >&2; exit 32"])
    with pytest.raises(MountError) as e:
        mount_table.acquire(SECRET_SSH, "run-a")
    msg = str(e.value)
    assert "'ssh' (sshfs)" in msg and "exit 32" in msg and "no route to host" in msg
    assert key_line not in msg and "<redacted>" in msg
    assert e.value.status_code == 500 and mount_table.holders() == set()


def test_missing_client_is_a_mount_error(mount_table: MountTable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table_mod, "mount_argv", lambda spec, target, private: ["/nonexistent/mount.fancy"])
    with pytest.raises(MountError, match="not found"):
        mount_table.acquire(GLUSTER, "run-a")


def test_subdir_creates_sticky_dirs_and_refuses_escapes(tmp_path: Path) -> None:
    t = MountTable(tmp_path / "m")
    server_root = tmp_path / "srv"
    server_root.mkdir()
    (server_root / "evil").symlink_to("/etc")
    got = t.subdir(server_root, "users/alice", create=True)
    assert got == Path(os.path.realpath(server_root)) / "users" / "alice"
    assert stat.S_IMODE(got.stat().st_mode) == 0o1777
    assert t.subdir(server_root, "", create=False) == Path(os.path.realpath(server_root))
    for bad in ("/etc", "../x", "a/../../x", "a\0b", "evil", "evil/sub"):
        with pytest.raises(ValidationError):
            t.subdir(server_root, bad, create=True)
    assert not Path("/etc/sub").exists()
    with pytest.raises(NotFoundError):
        t.subdir(server_root, "missing", create=False)


def _processes_naming(target: Path) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if str(target) in (p.info.get("cmdline") or []) and p.info.get("status") != psutil.STATUS_ZOMBIE:
            out.append(p.pid)
    return out
