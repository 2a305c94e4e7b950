"""Fixtures for apiary.mounts: a mount table whose mounts are all gone after the test, and real
file servers (a private glusterd with a volume, a private sshd) for the ``dfs``-marked tests.

Without the servers' binaries (or without root) those tests skip locally, but under ``CI=true``
they FAIL: ``.ci/run`` installs glusterfs-server, glusterfs-client, openssh-server,
openssh-client and sshfs, and CI must never silently skip the real servers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.support.dfs import loopback_gluster, require, unmount_all_under

from apiary.hosts.gluster import GlusterVolume
from apiary.hosts.sshd import Sshd, generate_keypair, sshd_available
from apiary.mounts.table import MountTable


def sshfs_available() -> str | None:
    why = sshd_available()
    if why is None and shutil.which("sshfs") is None:
        why = "sshfs not found (Debian: apt-get install sshfs)"
    if why is None and not os.path.exists("/dev/fuse"):
        why = "/dev/fuse is missing"
    return why


@pytest.fixture
def server_dir() -> Iterator[Path]:
    """A fresh directory for servers' state (0711 under the system temp dir, not pytest's 0700
    ones, so a netns host's daemons and other uids can traverse it); removed after the test."""
    root = Path(tempfile.mkdtemp(prefix="apiary-dfs-"))
    os.chmod(root, 0o711)
    yield root
    unmount_all_under(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def mount_table(tmp_path: Path) -> Iterator[MountTable]:
    """A :class:`MountTable` (timeout 10 s) under the test's directory; whatever the test leaves
    mounted there is unmounted after it, pass or fail."""
    table = MountTable(tmp_path / "mounts", timeout_s=10.0)
    yield table
    unmount_all_under(table.root)


@pytest.fixture(scope="module")
def gluster_volume() -> Iterator[GlusterVolume]:
    """A started volume ``apiary`` on a private glusterd on this machine's loopback, for the
    module (glusterd takes ~3 s to start); stopped and deleted after it."""
    with loopback_gluster("apiary") as volume:
        yield volume


@dataclass
class SshServer:
    sshd: Sshd
    identity: str  #: the private key (PEM text) the user logs in with
    public_key: str
    export: Path  #: a directory the tests mount (rootPath)

    def data(self, **extra: object) -> dict:
        """An sshfs storage server's ``data`` for this server, host key pinned."""
        return {"address": self.sshd.address, "port": self.sshd.port, "user": self.sshd.user,
                "rootPath": str(self.export), "identity": self.identity, "hostKey": self.sshd.host_key, **extra}


@pytest.fixture
def ssh_server(server_dir: Path) -> Iterator[SshServer]:
    """A private sshd on a free loopback port letting root in with a fresh ed25519 key, and an
    export directory; stopped after the test."""
    require(sshfs_available())
    identity, public = generate_keypair(server_dir / "id_ed25519")
    export = server_dir / "export"
    export.mkdir()
    with Sshd(server_dir / "sshd", user="root", public_keys=[public]) as sshd:
        yield SshServer(sshd, identity, public, export)
