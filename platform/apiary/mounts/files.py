"""File operations under a root directory that nothing inside the root can lead outside of.

The storage files REST API (upload, download, list, remove) runs as root in the control plane
over a storage server's root, which tasks share and write: a task can plant ``data -> /etc`` or a
chain of symlinks ending outside. Every path is therefore resolved by the kernel with
``openat2(2)`` and ``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`` relative to a descriptor of the
root (Linux 5.6+; openat2(2): "any resolution of a path component that would escape the directory
fails with EXDEV"): a symlink that stays inside the root works, anything escaping it (``..``,
an absolute symlink, a chain, ``/proc/self/fd/...`` magic links) is refused atomically, with no
window between a check and the open. Where the kernel has no openat2 (ENOSYS, or a seccomp
filter answering EPERM) each component is opened with ``O_NOFOLLOW`` relative to its parent
instead, and every symlink is refused (:data:`USE_OPENAT2` says which is in use).

Only the final component is then acted on, through its parent's descriptor (``*at`` calls with
a single name): a removal removes a symlink itself, never what it points to.

Paths are relative to the root, ``/``-separated (OpenPAI's storage mountInfo ``path``); ``""``
and ``"."`` name the root. Absolute paths, ``..`` components and NUL are refused with
``ValidationError("path", ...)`` before anything is opened; a missing path raises
:class:`~apiary.errors.NotFoundError`; a symlink leading outside raises ``ValidationError("path",
"... escapes the root")``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import stat as stat_mod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from apiary.errors import ConflictError, NotFoundError, PayloadTooLargeError, ValidationError

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "USE_OPENAT2",
    "check_relative",
    "list_dir",
    "make_dirs",
    "open_dir",
    "open_read",
    "real_path",
    "remove",
    "stat",
    "write_stream",
]

#: Mode of the directories :func:`make_dirs` creates: 1777, /tmp's. Shared storage is written by
#: tasks running as changing unprivileged uids (one per user), and by root (this API): every uid
#: must be able to create entries, and the sticky bit keeps one uid from deleting or renaming
#: another's (chmod(2), "S_ISVTX"). The mode is set with chmod, so the umask does not narrow it.
DIR_MODE = 0o1777
#: Mode of the files :func:`write_stream` writes (owned by root): every task may read them; tasks
#: change uploaded data through the API (overwrite, remove), not in place.
FILE_MODE = 0o644

_SYS_OPENAT2 = 437  # x86_64, aarch64 and every architecture with the unified syscall table
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08
_ATTEMPTS = 8  # openat2 answers EAGAIN when a rename raced the lookup; retry a few times


class _OpenHow(ctypes.Structure):
    # struct open_how (linux/openat2.h): three u64s
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """``openat2(dir_fd, path, {flags, mode, RESOLVE_BENEATH|RESOLVE_NO_MAGICLINKS})``; raises
    OSError with the call's errno."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    encoded = os.fsencode(path)
    for _ in range(_ATTEMPTS):
        fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), ctypes.c_char_p(encoded),
                           ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), path)


def _probe_openat2() -> bool:
    try:
        os.close(_openat2(os.open("/", os.O_PATH | os.O_DIRECTORY), ".", os.O_PATH))
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EPERM):  # no such syscall, or a seccomp filter's answer
            return False
        raise
    return True


#: Whether paths are resolved with openat2 (True: symlinks inside the root work) or with the
#: component-wise ``O_NOFOLLOW`` walk (False: every symlink is refused). Probed at import; tests
#: set it to False to exercise the walk.
USE_OPENAT2 = _probe_openat2()


def check_relative(path: str, field: str = "path") -> list[str]:
    """The components of ``path``, a ``/``-separated path relative to a root (``""``, ``"."``:
    the root itself, ``[]``); empty and ``.`` components are dropped. Raises
    ``ValidationError(field, ...)`` for a non-string, an absolute path, a ``..`` component or NUL."""
    if not isinstance(path, str):
        raise ValidationError(field, f"must be a string, got {type(path).__name__}")
    if "\0" in path:
        raise ValidationError(field, "holds a NUL character")
    if path.startswith("/"):
        raise ValidationError(field, f"{path!r} is absolute: give a path relative to the storage root")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValidationError(field, f"{path!r} holds '..'")
    return parts


def _translate(e: OSError, rel: str) -> Exception:
    """The Apiary error for an OSError met while resolving ``rel``."""
    if e.errno == errno.ENOENT:
        return NotFoundError(f"path: {rel!r} does not exist")
    if e.errno == errno.EXDEV:
        return ValidationError("path", f"{rel!r} escapes the root (through a symlink or a mount)")
    if e.errno == errno.ELOOP:
        return ValidationError("path", f"{rel!r} goes through a symlink that is not allowed here")
    if e.errno == errno.ENOTDIR:
        return ValidationError("path", f"{rel!r}: a component is not a directory")
    if e.errno == errno.EISDIR:
        return ValidationError("path", f"{rel!r} is a directory")
    return e


def _walk(root_fd: int, parts: list[str], flags: int, mode: int) -> int:
    """The fallback of :func:`_open_beneath`: open each directory with ``O_NOFOLLOW`` relative to
    its parent (a symlink fails with ELOOP or ENOTDIR: refused, never followed)."""
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            if stat_mod.S_ISLNK(st.st_mode):
                raise OSError(errno.ELOOP, "symlink refused (no openat2)", part)
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        if not parts:
            return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=fd)
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


def _open_beneath(root_fd: int, parts: list[str], flags: int, mode: int = 0) -> int:
    """Open ``parts`` relative to ``root_fd`` so that nothing escapes it; raises OSError."""
    if USE_OPENAT2:
        return _openat2(root_fd, "/".join(parts) or ".", flags, mode)
    return _walk(root_fd, parts, flags, mode)


@contextlib.contextmanager
def _root_fd(root: Path | str) -> Iterator[int]:
    """A descriptor of ``root`` itself (an admin's path: a symlink there is followed)."""
    try:
        fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise NotFoundError(f"storage root {str(root)!r} does not exist") from e
    try:
        yield fd
    finally:
        os.close(fd)


def _dir_fd(root: Path | str, rel: str) -> int:
    """A new descriptor of directory ``rel`` under ``root``; raises as :func:`open_dir`."""
    parts = check_relative(rel)
    with _root_fd(root) as rfd:
        try:
            return _open_beneath(rfd, parts, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise _translate(e, rel) from e


@contextlib.contextmanager
def open_dir(root: Path | str, rel: str) -> Iterator[int]:
    """A descriptor (``O_RDONLY | O_DIRECTORY``) of directory ``rel`` under ``root``, closed when
    the block ends. Raises NotFoundError, or ValidationError (``path``) for a bad or escaping path
    or one that is not a directory."""
    fd = _dir_fd(root, rel)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _parent(root: Path | str, rel: str) -> Iterator[tuple[int, str]]:
    """``(descriptor of rel's parent directory, rel's last component)``; refuses the root itself."""
    parts = check_relative(rel)
    if not parts:
        raise ValidationError("path", "names the storage root itself")
    with open_dir(root, "/".join(parts[:-1])) as fd:
        yield fd, parts[-1]


def _kind(mode: int) -> str:
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    if stat_mod.S_ISDIR(mode):
        return "dir"
    if stat_mod.S_ISREG(mode):
        return "file"
    return "other"


def _entry(name: str, st: os.stat_result) -> dict[str, Any]:
    return {"name": name, "type": _kind(st.st_mode), "size": st.st_size, "mtime": st.st_mtime}


def stat(root: Path | str, rel: str) -> dict[str, Any]:
    """``{"name", "type": "file"|"dir"|"symlink"|"other", "size": bytes, "mtime": seconds since
    the epoch (float)}`` of ``rel`` itself (a symlink is reported as one, not followed); the root
    is ``name ""``, ``type "dir"``. Raises NotFoundError, ValidationError."""
    parts = check_relative(rel)
    if not parts:
        with open_dir(root, "") as fd:
            return _entry("", os.fstat(fd))
    with _parent(root, rel) as (fd, name):
        try:
            return _entry(name, os.stat(name, dir_fd=fd, follow_symlinks=False))
        except OSError as e:
            raise _translate(e, rel) from e


def list_dir(root: Path | str, rel: str) -> list[dict[str, Any]]:
    """The entries of directory ``rel`` (``""``: the root), sorted by name, each as :func:`stat`
    gives it (symlinks in it not followed; a symlink ``rel`` inside the root is, with openat2);
    for a file ``rel`` its one entry (``ls``). Raises NotFoundError, ValidationError."""
    try:
        fd = _dir_fd(root, rel)
    except ValidationError as e:
        if isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.ENOTDIR:
            return [_file_entry(root, rel)]
        raise
    out = []
    try:
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    out.append(_entry(entry.name, entry.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue  # removed while we listed
    finally:
        os.close(fd)
    return sorted(out, key=lambda e: e["name"])


def _file_entry(root: Path | str, rel: str) -> dict[str, Any]:
    """The entry of ``rel`` resolved as :func:`open_read` resolves it (a symlink inside the root
    followed with openat2, refused by the walk); raises as it does."""
    parts = check_relative(rel)
    with _root_fd(root) as rfd:
        try:
            fd = _open_beneath(rfd, parts, os.O_PATH)
        except OSError as e:
            raise _translate(e, rel) from e
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if stat_mod.S_ISLNK(st.st_mode):  # the walk opened the link itself (O_PATH | O_NOFOLLOW)
        raise ValidationError("path", f"{rel!r} goes through a symlink that is not allowed here")
    return _entry(parts[-1] if parts else "", st)


def open_read(root: Path | str, rel: str) -> tuple[BinaryIO, int]:
    """``(binary file open for reading, its size in bytes)`` for regular file ``rel``; the caller
    closes it. A symlink inside the root is followed (with openat2). Raises NotFoundError, and
    ValidationError for a directory, a FIFO or device (opened non-blocking, so a FIFO cannot hang
    the caller) or an escaping path."""
    parts = check_relative(rel)
    with _root_fd(root) as rfd:
        try:
            fd = _open_beneath(rfd, parts, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise _translate(e, rel) from e
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise ValidationError("path", f"{rel!r} is not a regular file ({_kind(st.st_mode)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def _too_large(max_bytes: int) -> PayloadTooLargeError:
    err = PayloadTooLargeError(max_bytes)
    err.message = f"file larger than {max_bytes} bytes (the upload limit)"
    err.args = (err.message,)
    return err


def write_stream(root: Path | str, rel: str, chunks: Iterable[bytes], *, max_bytes: int,
                 overwrite: bool = False, mode: int = FILE_MODE) -> int:
    """Write ``chunks`` to file ``rel`` (its directory must exist) and return the bytes written.

    The bytes go to a hidden temporary file in the same directory (``.<name>.upload-<hex>``),
    which is fsynced and then renamed over ``rel`` within the directory's descriptor, so readers
    see the old file or the whole new one, never a part. Without ``overwrite`` an existing ``rel``
    raises :class:`~apiary.errors.ConflictError` (decided atomically: the temporary file is
    hard-linked to the name, which fails if it exists; file systems without hard links fall back
    to a check, then the rename). More than ``max_bytes`` raises
    :class:`~apiary.errors.PayloadTooLargeError` (HTTP 413) as soon as the limit is passed. Any
    failure removes the temporary file: nothing partial is left. ``mode``: the new file's mode
    (default :data:`FILE_MODE`, set with fchmod so the umask does not narrow it).
    """
    with _parent(root, rel) as (dfd, name):
        tmp = f".{name[:200]}.upload-{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        done = False
        try:
            written = 0
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    written += len(chunk)
                    if written > max_bytes:
                        raise _too_large(max_bytes)
                    f.write(chunk)
                f.flush()
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())
            _place(dfd, tmp, name, rel, overwrite)
            done = True
            os.fsync(dfd)
            return written
        finally:
            if not done:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)


def _place(dfd: int, tmp: str, name: str, rel: str, overwrite: bool) -> None:
    """Move ``tmp`` to ``name`` in directory ``dfd``; raises ConflictError where it may not."""
    try:
        existing = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        existing = None
    if existing is not None and stat_mod.S_ISDIR(existing.st_mode):
        raise ConflictError(f"path: {rel!r} is a directory")
    if overwrite:
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        return
    try:
        os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    except FileExistsError as e:
        raise ConflictError(f"path: {rel!r} exists (overwrite not asked)") from e
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        if existing is not None:  # no hard links here: a check, then the rename (not atomic)
            raise ConflictError(f"path: {rel!r} exists (overwrite not asked)") from e
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        return
    os.unlink(tmp, dir_fd=dfd)


def make_dirs(root: Path | str, rel: str, *, mode: int = DIR_MODE) -> None:
    """Create directory ``rel`` and its missing parents under ``root`` (``mkdir -p``); each new
    one gets ``mode`` (default :data:`DIR_MODE`, 1777; set with fchmod, not narrowed by the umask).
    Existing directories are left as they are. Raises ValidationError for a bad or escaping path or
    a component that exists and is not a directory."""
    parts = check_relative(rel)
    with _root_fd(root) as rfd:
        for i in range(len(parts)):
            sub = parts[: i + 1]
            try:
                with contextlib.suppress(FileExistsError):
                    with _dir_of(rfd, sub[:-1], rel) as pfd:
                        os.mkdir(sub[-1], 0o700, dir_fd=pfd)
                        # the new directory: opened beneath (not by name: it could be replaced)
                        nfd = os.open(sub[-1], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                      dir_fd=pfd)
                        try:
                            os.fchmod(nfd, mode)
                        finally:
                            os.close(nfd)
                with _dir_of(rfd, sub, rel):
                    pass  # it is (now) a directory beneath the root
            except OSError as e:
                raise _translate(e, rel) from e


@contextlib.contextmanager
def _dir_of(rfd: int, parts: list[str], rel: str) -> Iterator[int]:
    fd = _open_beneath(rfd, parts, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def real_path(root: Path | str, rel: str) -> Path:
    """The path, free of symlinks, of directory ``rel`` under ``root`` as the kernel resolved it
    beneath the root (its descriptor's ``/proc/self/fd`` link). Raises as :func:`open_dir`, and
    ValidationError when the result is not under ``root``'s own real path (a mount moved)."""
    with open_dir(root, rel) as fd:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
    base = Path(os.path.realpath(root))
    if path != base and base not in path.parents:
        raise ValidationError("path", f"{rel!r} resolved to {path}, outside {base}")
    return path


def remove(root: Path | str, rel: str, *, recursive: bool = False) -> None:
    """Remove ``rel``: a file or a symlink (the link itself, never its target), or a directory:
    empty unless ``recursive`` (then its whole tree, walked by descriptors with ``shutil.rmtree``'s
    symlink-attack-safe implementation: a symlink inside is removed, not followed). The root itself
    cannot be removed (ValidationError). Raises NotFoundError, ConflictError for a non-empty
    directory without ``recursive``."""
    with _parent(root, rel) as (dfd, name):
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat_mod.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=dfd)
            elif recursive:
                shutil.rmtree(name, dir_fd=dfd)
            else:
                os.rmdir(name, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ENOTEMPTY:
                raise ConflictError(f"path: {rel!r} is a directory that is not empty (remove it recursively)") from e
            raise _translate(e, rel) from e
