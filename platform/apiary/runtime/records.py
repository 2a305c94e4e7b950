"""The run records every backend keeps under ``state_dir/<run_id>/``: the run id rule,
crash-safe files (written to a temporary name, renamed over the old one, so a reader sees the
old record or the new one, never half of one; fsync-ed first when asked) and fixed-size *slots*.

Whether to fsync: a record must outlive the process that wrote it (an agent killed with
``kill -9``), which the page cache already gives. fsync adds survival of a machine crash, which
matters for a record that outlives the run (a job's final state) but not for one that describes
processes: a crash ends them too, and a run whose records were lost with it reads as not
launched or lost, and is launched again or retried either way. The process runtime's launch
records are therefore written without fsync (``durable=False``): measured on ext4 here, eight
fsyncs a launch were a fifth of the agent's CPU at 20 launches/s.

Records hold job specs, commands and their substituted secrets, so every file here is created
mode 0600 and every directory 0700, whatever the process umask (:func:`private_dir`).

A slot is a file of a fixed size written full of spaces when a run is launched and later
overwritten in place (:func:`write_slot`, or ``printf ... 1<>slot`` from a shell). Overwriting
bytes that are already allocated needs no new disk blocks, so a value that must survive a full
disk -- a task's exit code -- is still recorded when nothing else can be written. (True of
ext4, xfs and tmpfs; copy-on-write filesystems such as btrfs and zfs allocate on every write.)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

#: A run id: 1-200 ASCII letters, digits and ``~ . - _``, not starting with ``.`` (it names a
#: directory: no ``/``, no ``..``, no hidden file).
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_~\-][A-Za-z0-9_~.\-]{0,199}$")


def valid_run_id(run_id: object) -> bool:
    return isinstance(run_id, str) and bool(RUN_ID_RE.fullmatch(run_id))


FILE_MODE = 0o600
DIR_MODE = 0o700


def open_private(path: Path, flags: int) -> int:
    """``os.open(path, flags | O_CREAT | O_CLOEXEC | O_NOFOLLOW)`` with mode 0600 whatever the
    umask (an existing file is ``fchmod``-ed to 0600 too). Returns the fd. Raises OSError."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def private_dir(path: Path, *, parents: bool = False, exist_ok: bool = True) -> None:
    """Create ``path`` (and with ``parents`` its missing parents) and make it mode 0700, whatever
    the umask; an existing directory is chmod-ed to 0700. Raises OSError (FileExistsError when
    it exists and ``exist_ok`` is false)."""
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        if not exist_ok or not path.is_dir():
            raise
    os.chmod(path, DIR_MODE)


def write_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    """Replace ``path`` with ``text`` atomically, as a mode-0600 file; with ``durable`` (the
    default) fsync-ed before the rename, so it also survives a machine crash (module doc).
    Raises OSError."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def preallocate_slot(path: Path, size: int, *, durable: bool = True) -> None:
    """Create ``path`` as a mode-0600 slot of ``size`` bytes (spaces, then a newline). The write
    itself claims the slot's space: ext4 and xfs reserve the blocks of delayed allocation when
    the data is written (a full disk fails this ``write`` with ENOSPC, not a later writeback),
    tmpfs allocates the pages then. With ``durable`` the slot is fsync-ed too (module doc).
    Raises OSError (e.g. ENOSPC)."""
    fd = open_private(path, os.O_WRONLY | os.O_TRUNC)
    try:
        data = b" " * (size - 1) + b"\n"
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {path}")
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_slot(path: Path, text: str) -> None:
    """Overwrite the slot ``path`` in place with ``text`` (padded with spaces to the slot's
    size), needing no new blocks. Raises OSError if there is no slot or ``text`` does not fit."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        data = text.encode("utf-8")
        if len(data) >= size:
            raise OSError(f"{len(data)} bytes do not fit the {size}-byte slot {path}")
        data = data + b" " * (size - 1 - len(data)) + b"\n"
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_slot(path: Path) -> str | None:
    """What the slot ``path`` holds, stripped; ``None`` when missing, unreadable or still blank."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        return None
    return text or None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """:func:`write_atomic` of ``data`` as one line of JSON."""
    write_atomic(path, json.dumps(data) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; ``None`` when missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
