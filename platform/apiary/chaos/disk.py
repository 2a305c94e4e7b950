"""Fill the store's disk, and free it: only a dedicated, size-limited tmpfs.

:func:`fill` refuses unless the filesystem holding the path is a ``tmpfs`` mounted at the platform
home or below it (a mount the experiment's fixture made for the platform, e.g. ``mount -t tmpfs -o
size=64m tmpfs $APIARY_HOME`` before ``apiary up``) and no larger than ``max_mb``: it never fills
the real disk, ``/tmp``, ``/dev/shm`` or an unbounded ``ramfs``.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from apiary.errors import ValidationError

FILL_NAME = ".apiary-chaos-fill"


@dataclass(frozen=True)
class Mount:
    point: Path
    fstype: str
    size_bytes: int


def mount_of(path: Path) -> Mount:
    """The mount holding ``path`` (the longest mount point above it in ``/proc/self/mountinfo``)."""
    path = path.resolve()
    best: tuple[Path, str] | None = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        point = Path(_unescape(left.split()[4]))
        fstype = right.split()[0]
        if (path == point or point in path.parents) and (best is None or len(point.parts) >= len(best[0].parts)):
            best = (point, fstype)
    if best is None:
        raise ValidationError("path", f"no mount holds {path}")
    st = os.statvfs(best[0])
    return Mount(best[0], best[1], st.f_blocks * st.f_frsize)


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def check_dedicated(path: Path, home: Path, max_mb: float) -> Mount:
    """The mount of ``path`` if it is a tmpfs of at most ``max_mb`` MiB mounted at ``home`` or below
    it; ValidationError naming what is wrong otherwise."""
    m = mount_of(path)
    home = home.resolve()
    if m.fstype != "tmpfs":
        raise ValidationError("path", f"{path} is on {m.fstype} mounted at {m.point}, not a dedicated tmpfs: "
                              "refusing to fill it (mount a small tmpfs at the platform home first)")
    if m.point != home and home not in m.point.parents:
        raise ValidationError("path", f"the tmpfs holding {path} is mounted at {m.point}, outside the platform "
                              f"home {home}: refusing to fill a filesystem the platform does not own")
    if m.size_bytes > max_mb * 1024 * 1024:
        raise ValidationError("max_mb", f"the tmpfs at {m.point} is {m.size_bytes // 2**20} MiB, larger than "
                              f"max_mb={max_mb:g}: refusing to hold that much memory")
    return m


def fill(mount: Mount, leave_kb: int = 0) -> dict:
    """Fill ``mount`` with one file until at most ``leave_kb`` KiB are free; what was written."""
    path = mount.point / FILL_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        st = os.statvfs(mount.point)
        want = st.f_bavail * st.f_frsize - leave_kb * 1024
        if want > 0:
            try:
                os.posix_fallocate(fd, os.fstat(fd).st_size, want)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        if leave_kb == 0:  # the last blocks fallocate's arithmetic left
            chunk = b"\0" * 65536
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        break
                    raise
    finally:
        os.close(fd)
    st = os.statvfs(mount.point)
    return {"file": str(path), "bytes": path.stat().st_size, "free_bytes": st.f_bavail * st.f_frsize}


def free(paths: list[str]) -> list[str]:
    """Remove the fill files (idempotent); the ones removed."""
    removed = []
    for p in paths:
        try:
            os.unlink(p)
            removed.append(p)
        except FileNotFoundError:
            continue
    return removed
