"""Real file servers for tests: helpers the ``dfs``-marked tests share.

Without the servers' binaries (or without root) those tests skip locally, but under ``CI=true``
they FAIL: ``.ci/run`` installs glusterfs-server, glusterfs-client, openssh-server,
openssh-client and sshfs, and CI must never silently skip the real servers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from apiary.hosts.gluster import GlusterVolume, gluster_available, volume_on_loopback
from apiary.mounts.table import mount_points


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require(why: str | None) -> None:
    """Skip the test when ``why`` says something is missing; under CI=true fail it instead."""
    if why is None:
        return
    if in_ci():
        pytest.fail(f"CI=true but {why} (.ci/run installs it)", pytrace=False)
    pytest.skip(why)


def unmount_all_under(root: Path) -> None:
    """Lazily unmount whatever is still mounted under ``root`` (deepest first)."""
    prefix = os.path.realpath(root).rstrip("/") + "/"
    for point in sorted((p for p in mount_points() if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30, check=False)


@contextlib.contextmanager
def loopback_gluster(name: str = "apiary") -> Iterator[GlusterVolume]:
    """A started GlusterFS volume ``name`` on a private glusterd on this machine's loopback
    (:func:`apiary.hosts.gluster.volume_on_loopback`), stopped and deleted afterwards."""
    require(gluster_available())
    root = Path(tempfile.mkdtemp(prefix="apiary-gluster-"))
    try:
        with volume_on_loopback(root / "glusterd", name) as volume:
            yield volume
    finally:
        unmount_all_under(root)
        shutil.rmtree(root, ignore_errors=True)
