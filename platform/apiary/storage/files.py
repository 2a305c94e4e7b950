"""A storage config's files, as the control plane reads and writes them for users.

Addresses are ``CONFIG:PATH``. ``PATH`` is relative to what a task of the config sees: with one
mount info, to its mount point (``home:data/digits.npz`` is ``/mnt/home/data/digits.npz`` in a
task of a config mounted at ``/mnt/home``); with several, it starts with the mount point it is
under, without the leading ``/`` (``team:mnt/a/x``). ``""`` (or ``.``) is the config's top.

The control plane mounts a config's servers on its own host with the same mount table a node
agent uses (:class:`apiary.mounts.table.MountTable`, holder :data:`HOLDER`, kept mounted), and
every file operation goes through :mod:`apiary.mounts.files`, which refuses ``..``, absolute
paths and symlinks that lead out of the mount info's directory (the control plane runs as root;
a task may plant symlinks in shared storage). Who may call what is the router's to check: any
user granted the config reads and writes it; a ``ro`` mount info is written by admins only.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from apiary.errors import ForbiddenError, NoStorageError, ValidationError
from apiary.mounts import files
from apiary.mounts.table import MountTable
from apiary.storage.service import Config, MountInfo, StorageService

#: The mount table's holder for the control plane's own mounts of storage servers.
HOLDER = "control-plane"


class StorageFiles:
    """Files of storage configs (module doc). ``max_upload_bytes``: the largest file a write
    takes (bytes). Thread-safe as its parts are."""

    def __init__(self, service: StorageService, table: MountTable, *, max_upload_bytes: int) -> None:
        self.service = service
        self.table = table
        self.max_upload_bytes = max_upload_bytes

    def close(self) -> None:
        """Unmount what the control plane mounted for files (its process is stopping)."""
        self.table.release(HOLDER)

    def locate(self, config_name: str, path: str) -> tuple[Path, str, MountInfo]:
        """``(directory of the mount info on this host, path relative to it, the mount info)``
        for ``path`` in config ``config_name``. Mounts the server when it is not mounted (raising
        :class:`apiary.mounts.table.MountError`, a 5xx, when it cannot be). Raises NoStorageError
        (unknown config, or a path under none of a multi-mount config's mount points),
        ValidationError (a malformed path)."""
        config: Config = self.service.config(config_name)
        rel = path.strip("/") if path not in ("", ".") else ""
        if "\x00" in rel:
            raise ValidationError("path", "must not hold a NUL character")
        info: MountInfo | None = config.mount_infos[0]
        if len(config.mount_infos) > 1:
            info = next((m for m in config.mount_infos
                         if rel == m.mount_point.lstrip("/") or rel.startswith(m.mount_point.lstrip("/") + "/")), None)
            if info is None:
                points = ", ".join(m.mount_point.lstrip("/") for m in config.mount_infos)
                raise NoStorageError(f"{config_name}:{path} is under none of the config's mount points ({points}).")
            rel = rel[len(info.mount_point.lstrip("/")):].lstrip("/")
        assert info is not None
        root = self.table.acquire(self.service.server(info.server), HOLDER)
        return self.table.subdir(root, info.path, create=True), rel, info

    def list(self, config: str, path: str) -> list[dict]:
        """The entries of a directory (``[{name, type, size, mtime}]``), or of a file its one entry."""
        root, rel, _ = self.locate(config, path)
        return files.list_dir(root, rel)

    def read(self, config: str, path: str) -> tuple[BinaryIO, int]:
        """An open file and its size in bytes (the caller closes it)."""
        root, rel, _ = self.locate(config, path)
        return files.open_read(root, rel)

    def write(self, config: str, path: str, chunks: Iterable[bytes], *, admin: bool, overwrite: bool = True) -> int:
        """Write ``chunks`` to ``path`` (parents made), at most :attr:`max_upload_bytes`; returns the
        bytes written. Nothing is left of a write that fails. ForbiddenError for a ``ro`` mount info
        unless ``admin``."""
        root, rel, info = self.locate(config, path)
        self._writable(config, info, admin)
        if not rel:
            raise ValidationError("path", "name a file to write, e.g. home:data/digits.npz")
        parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if parent:
            files.make_dirs(root, parent)
        return files.write_stream(root, rel, chunks, max_bytes=self.max_upload_bytes, overwrite=overwrite)

    def remove(self, config: str, path: str, *, admin: bool, recursive: bool = False) -> None:
        """Remove a file (or, with ``recursive``, a directory tree). ForbiddenError for a ``ro``
        mount info unless ``admin``; ValidationError for the config's top directory."""
        root, rel, info = self.locate(config, path)
        self._writable(config, info, admin)
        if not rel:
            raise ValidationError("path", "the config's top directory cannot be removed")
        files.remove(root, rel, recursive=recursive)

    @staticmethod
    def _writable(config: str, info: MountInfo, admin: bool) -> None:
        if info.read_only and not admin:
            raise ForbiddenError(f"Storage config {config} mounts {info.mount_point} read-only; only admins "
                                 "may change its files.")
