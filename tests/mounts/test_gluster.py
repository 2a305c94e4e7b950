"""GlusterFS mounts through the mount table, against private glusterds (apiary.hosts.gluster):
one on loopback, and two on network-namespace hosts (a replica 2 volume, a host with nothing
listening, a host whose port 24007 answers nothing)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from tests.mounts.conftest import require

from apiary.hosts.gluster import Glusterd, GlusterVolume, create_volume, gluster_available
from apiary.hosts.netns import Hosts, netns_available
from apiary.mounts.servers import ServerSpec
from apiary.mounts.table import MountError, MountTable, is_mounted

pytestmark = pytest.mark.dfs


def test_volume_is_mounted_once_shared_and_released(gluster_volume: GlusterVolume, mount_table: MountTable) -> None:
    spec = ServerSpec("team-gfs", "glusterfs", gluster_volume.server_data())
    root = mount_table.acquire(spec, "run-a")
    assert is_mounted(root)
    (root / "model.bin").write_bytes(b"\x00weights")
    brick = gluster_volume.brick_dirs()[0]
    assert (brick / "model.bin").read_bytes() == b"\x00weights"  # it went through the volume
    assert mount_table.acquire(spec, "run-b") == root
    assert len(_clients(root)) == 1  # one FUSE client for both holders
    assert mount_table.release("run-a") == [] and (root / "model.bin").exists()
    assert mount_table.release("run-b") == [spec.key]
    assert not is_mounted(root)
    _wait_gone(root)


def test_a_restarted_table_finds_the_mount(gluster_volume: GlusterVolume, mount_table: MountTable) -> None:
    spec = ServerSpec("team-gfs", "glusterfs", gluster_volume.server_data())
    root = mount_table.acquire(spec, "run-a")
    again = MountTable(mount_table.root, timeout_s=10)
    assert again.acquire(spec, "run-b") == root and len(_clients(root)) == 1
    assert again.reconcile(set()) == [spec.key] and not is_mounted(root)


def test_an_unknown_volume_fails_with_the_clients_words(gluster_volume: GlusterVolume, mount_table: MountTable) -> None:
    spec = ServerSpec("nope", "glusterfs", {**gluster_volume.server_data(), "volume": "no_such_volume"})
    t0 = time.monotonic()
    with pytest.raises(MountError, match=r"'nope' \(glusterfs\).*failed"):
        mount_table.acquire(spec, "run-a")
    assert time.monotonic() - t0 < mount_table.timeout_s + 5
    assert not is_mounted(mount_table.root / spec.key)
    _wait_gone(mount_table.root / spec.key)


@pytest.fixture
def gluster_hosts(server_dir: Path) -> Iterator[Hosts]:
    """Hosts gfs1, gfs2 (glusterds), dead (nothing listening) and silent (24007 accepts and
    never answers)."""
    require(gluster_available())
    require(netns_available())
    with Hosts(["gfs1", "gfs2", "dead", "silent"], server_dir / "hosts") as hosts:
        yield hosts


@pytest.mark.netns
def test_replica_volume_on_two_hosts(gluster_hosts: Hosts, mount_table: MountTable) -> None:
    servers = [Glusterd(gluster_hosts.state_dir(h) / "glusterd", hosts=gluster_hosts, host=h).start()
               for h in ("gfs1", "gfs2")]
    try:
        volume = create_volume(servers, "team", replica=2)
        spec = ServerSpec("team-gfs", "glusterfs", volume.server_data())
        assert spec.data["backupAddresses"] == [gluster_hosts.address("gfs2")]
        root = mount_table.acquire(spec, "run-a")
        (root / "x.txt").write_text("replicated")
        for brick in volume.brick_dirs():
            assert (brick / "x.txt").read_text() == "replicated"
        assert mount_table.release("run-a") == [spec.key] and not is_mounted(root)
        volume.delete()
    finally:
        for s in servers:
            s.stop()


@pytest.mark.netns
def test_down_and_silent_servers_fail_within_the_timeout(gluster_hosts: Hosts, tmp_path: Path) -> None:
    listener = ("import socket,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                "s.bind(('0.0.0.0',24007));s.listen(64)\nheld=[]\nwhile True: held.append(s.accept())\n")
    gluster_hosts.run("silent", [sys.executable, "-c", listener])
    _wait_listening(gluster_hosts, "silent", 24007)
    table = MountTable(tmp_path / "mounts", timeout_s=4.0)
    for host in ("dead", "silent"):
        spec = ServerSpec(host, "glusterfs", {"address": gluster_hosts.address(host), "volume": "team"})
        t0 = time.monotonic()
        with pytest.raises(MountError, match=rf"'{host}' \(glusterfs\)"):
            table.acquire(spec, "run-a")
        assert time.monotonic() - t0 < table.timeout_s + 5, host
        target = table.root / spec.key
        assert not is_mounted(target) and table.holders() == set()
        _wait_gone(target)


def _clients(target: Path) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if str(target) in (p.info.get("cmdline") or []) and p.info.get("status") != psutil.STATUS_ZOMBIE]


def _wait_gone(target: Path, timeout_s: float = 10.0) -> None:
    """No live process names ``target`` (the FUSE client exits after its unmount), polled."""
    deadline = time.monotonic() + timeout_s
    while _clients(target):
        assert time.monotonic() < deadline, f"clients of {target} still running: {_clients(target)}"
        time.sleep(0.05)


def _wait_listening(hosts: Hosts, host: str, port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while f":{port} " not in hosts.exec(host, ["ss", "-ltnH"]).stdout:
        assert time.monotonic() < deadline, f"nothing listens on {host}:{port}"
        time.sleep(0.05)
