"""sshfs mounts through the mount table against a private sshd (apiary.hosts.sshd) on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from tests.mounts.conftest import SshServer

from apiary.mounts.servers import ServerSpec
from apiary.mounts.table import MountError, MountTable, is_mounted

pytestmark = pytest.mark.dfs


def test_sshfs_mount_is_shared_and_released(ssh_server: SshServer, mount_table: MountTable) -> None:
    (ssh_server.export / "hello.txt").write_text("from the server")
    spec = ServerSpec("team-ssh", "sshfs", ssh_server.data())
    root = mount_table.acquire(spec, "run-a")
    assert is_mounted(root) and (root / "hello.txt").read_text() == "from the server"
    (root / "out.txt").write_text("from a task")
    assert (ssh_server.export / "out.txt").read_text() == "from a task"
    assert mount_table.acquire(spec, "run-b") == root
    assert mount_table.release("run-a") == [] and is_mounted(root)
    assert mount_table.release("run-b") == [spec.key]
    assert not is_mounted(root)
    assert not (mount_table.private / spec.key).exists()  # the key files go with the mount


def test_accept_new_without_a_host_key(ssh_server: SshServer, mount_table: MountTable) -> None:
    data = ssh_server.data()
    del data["hostKey"]
    spec = ServerSpec("tofu", "sshfs", data)
    root = mount_table.acquire(spec, "run-a")
    assert is_mounted(root)
    known = (mount_table.private / spec.key / "known_hosts").read_text()
    assert ssh_server.sshd.host_key.split()[1] in known
    mount_table.release("run-a")


def test_a_wrong_host_key_is_refused(ssh_server: SshServer, mount_table: MountTable) -> None:
    wrong = " ".join(ssh_server.public_key.split()[:2])  # the user's key, not the server's
    spec = ServerSpec("mitm", "sshfs", ssh_server.data(hostKey=wrong))
    with pytest.raises(MountError, match=r"(?s)'mitm' \(sshfs\).*[Hh]ost key verification failed") as e:
        mount_table.acquire(spec, "run-a")
    assert ssh_server.identity.splitlines()[1] not in str(e.value)
    assert not is_mounted(mount_table.root / spec.key) and mount_table.holders() == set()


def test_a_stopped_sshd_fails_fast(ssh_server: SshServer, mount_table: MountTable) -> None:
    spec = ServerSpec("down", "sshfs", ssh_server.data())
    ssh_server.sshd.stop()
    t0 = time.monotonic()
    with pytest.raises(MountError, match=r"'down' \(sshfs\)"):
        mount_table.acquire(spec, "run-a")
    assert time.monotonic() - t0 < mount_table.timeout_s + 5
    assert not is_mounted(mount_table.root / spec.key)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never says a word (a hung server)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(5)
    for c in held:
        c.close()
    srv.close()


def test_a_silent_server_times_out_and_leaves_nothing(ssh_server: SshServer, tmp_path: Path, silent_port: int) -> None:
    table = MountTable(tmp_path / "mounts", timeout_s=3.0)
    spec = ServerSpec("silent", "sshfs", ssh_server.data(port=silent_port))
    t0 = time.monotonic()
    with pytest.raises(MountError, match=r"'silent' \(sshfs\)"):
        table.acquire(spec, "run-a")
    assert time.monotonic() - t0 < table.timeout_s + 5
    target = table.root / spec.key
    assert not is_mounted(target) and table.holders() == set()
    deadline = time.monotonic() + 5
    while _alive_naming(target) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive_naming(target)


def _alive_naming(target: Path) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if str(target) in (p.info.get("cmdline") or []) and p.info.get("status") != psutil.STATUS_ZOMBIE]
