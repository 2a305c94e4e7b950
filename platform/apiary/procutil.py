"""Process helpers shared by the supervisor and the Prefect server starter, and the modes of
what the platform writes.

The platform's state (``APIARY_HOME``: the store and its WAL, task logs, the agents' launch
records, credentials, Prefect's database) holds the jobs' ``secrets``, so it is kept to the user
the platform runs as: the home and every directory in it are 0700, every file 0600. The
platform's processes run with :data:`PRIVATE_UMASK` (set at their entry points and passed to every
child they start), which gives that to whatever they or the tools they run (SQLite, Prefect,
Prometheus) create; :func:`private_dir` and :func:`open_private` give it explicitly where a file
is written by a process whose umask is not the platform's (a test or ``apiary demo`` running the
embedded platform in process).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Literal

_PR_SET_PDEATHSIG = 1

#: The umask of the platform's processes: files 0600, directories 0700 (group and other get nothing).
PRIVATE_UMASK = 0o077


def use_private_umask() -> int:
    """Set this process's umask to :data:`PRIVATE_UMASK` for good (an entry point of one of the
    platform's processes: ``apiary up``, ``apiary control-plane``, ``apiary agent``, ``apiary
    prefect-bridge``); returns the previous umask. Inherited by every process it starts."""
    return os.umask(PRIVATE_UMASK)


@contextmanager
def private_umask() -> Iterator[None]:
    """:data:`PRIVATE_UMASK` while the block runs, the previous umask after it. The umask is the
    process's, not the thread's: for an embedded platform started inside another program (a test,
    ``apiary demo``), whose own files keep that program's umask."""
    old = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(old)


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents, each 0700) if needed and make it 0700, also when it
    existed with a wider mode; returns ``path``. Raises OSError as ``mkdir``/``chmod`` do."""
    path = Path(path)
    if not path.is_dir():
        missing = [p for p in (path, *path.parents) if not p.exists()]
        for p in reversed(missing):
            p.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def open_private(path: Path, mode: Literal["ab", "wb"] = "ab") -> IO[bytes]:
    """Open ``path`` for appending (``ab``) or writing (``wb``), created 0600 whatever the umask;
    an existing file is made 0600 too. Its directory must exist."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "ab" else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path``, replacing it, readable by its owner only (0600)."""
    with open_private(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def replace_file(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably: a temp file beside it (mkstemp:
    0600), fsync-ed, then renamed over it; readers see the old file or the new one, never a mix,
    and a crash after the rename keeps the new one. The temp file is removed on any failure.
    Raises OSError."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def die_with_parent() -> None:
    """``preexec_fn`` for a supervised child: SIGTERM it when the process that started it dies.

    The children of ``apiary up`` run in their own sessions (so a signal to one does not hit the
    others), which also means nothing stops them if the supervisor is killed; Linux's
    ``PR_SET_PDEATHSIG`` closes that gap. Task processes never use it: they must outlive their
    agent so a restarted agent can re-adopt them. A no-op where prctl is unavailable.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on (or holds) ``host:port``: a test bind, with SO_REUSEADDR as
    uvicorn binds, so a port left in TIME_WAIT by a platform that just stopped counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def remembered_port(path: Path, choose: Callable[[], int], taken: Collection[int] = (),
                    what: str = "a server") -> int:
    """The port kept in ``path`` while it is free (:func:`port_in_use`) and not in ``taken``, else
    ``choose()`` (a free port, logged as a move when the kept one is taken); written to ``path``
    (0600) either way, so a server's address survives restarts."""
    try:
        kept = int(path.read_text().strip()) if path.exists() else 0
    except ValueError:
        kept = 0
    usable = 0 < kept < 65536 and kept not in taken and not port_in_use(kept)
    if kept and not usable:
        logging.getLogger(__name__).warning("%s: port %d (kept in %s) is taken; it moves to a new port",
                                            what, kept, path)
    port = kept if usable else int(choose())
    private_dir(path.parent)
    write_private(path, str(port))
    return port


def write_probe(directory: Path | str, nbytes: int, *, fsync: bool = False) -> str | None:
    """Whether ``directory`` takes a write now: ``nbytes`` written to a new hidden file there
    (``.apiary-write-probe-<pid>-<thread>``, 0600), then removed. Returns None when it does, else
    ``"<directory>: <strerror>"`` (not writable, no free block: ENOSPC). ``fsync`` flushes the
    bytes before closing (file systems that reserve blocks at write time need none)."""
    probe = Path(directory) / f".apiary-write-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * nbytes)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{directory}: {exc.strerror or exc}"
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None
