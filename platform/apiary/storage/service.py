"""Storage servers and storage configs in the store (OpenPAI's team-wise storage).

OpenPAI's model: an admin defines storage **servers** (a name, a type, connection data) and
storage **configs** (a name, a ``default`` flag and ``mountInfos``: ``{mountPoint, server, path,
permission}``), and grants configs to groups. This service owns the servers and configs; the
grants are the user directory's (:mod:`apiary.auth.directory`, group -> storage config, as group
-> virtual cluster), and callers pass what a user is granted as plain data.

Every write goes through one :class:`~apiary.store.unit.UnitOfWork`; the in-memory view of the
servers and configs is rebuilt from the store after a committed write and at least every
:data:`CACHE_TTL_S` seconds (a follower replica sees the leader's writes within that).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select

from apiary.errors import ConflictError, ForbiddenError, NoStorageError, ValidationError
from apiary.mounts.servers import ServerSpec, check_server, redacted
from apiary.spec.storage import StorageRequest, check_config_name, check_mount_point
from apiary.store.models import GroupStorageGrant, StorageConfig, StorageServer
from apiary.store.unit import Sessions, UnitOfWork, reading

#: How long the in-memory view may lag a write made elsewhere, in seconds (the directory's token
#: cache keeps user principals as long).
CACHE_TTL_S = 5.0
#: A mount info's ``permission``: read-write or read-only (OpenPAI's values).
PERMISSIONS = ("rw", "ro")


@dataclass(frozen=True)
class MountInfo:
    """One mount of a config: ``server``'s ``path`` (relative to the server's root; ``""`` the
    root itself) at ``mount_point`` in the task; ``read_only`` for ``permission: ro``."""

    mount_point: str
    server: str
    path: str
    read_only: bool

    def to_json(self) -> dict:
        return {"mountPoint": self.mount_point, "server": self.server, "path": self.path,
                "permission": "ro" if self.read_only else "rw"}


@dataclass(frozen=True)
class Config:
    """A storage config: ``name``, ``default``, its ``mount_infos`` in order."""

    name: str
    default: bool
    mount_infos: tuple[MountInfo, ...]

    def to_json(self) -> dict:
        """OpenPAI's shape: ``{name, default, servers, mountInfos}`` (``servers``: the servers the
        mount infos use, in order, each once)."""
        servers = list(dict.fromkeys(m.server for m in self.mount_infos))
        return {"name": self.name, "default": self.default, "servers": servers,
                "mountInfos": [m.to_json() for m in self.mount_infos]}


def check_relative_path(path: Any, field: str) -> str:
    """A server-relative path (a mount info's ``path``): ``""`` or ``a/b`` without ``.``, ``..``,
    empty components, a leading ``/`` or NUL. Returns it; ValidationError naming ``field``."""
    if path is None or path == "":
        return ""
    if not isinstance(path, str) or "\x00" in path or path.startswith("/") or len(path.encode()) > 4096:
        raise ValidationError(field, f"{path!r} must be a relative path on the server, e.g. data/mnist")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ValidationError(field, f"{path!r} must not hold '.', '..' or empty components")
    return path


def _mount_infos(value: Any, servers: dict[str, ServerSpec]) -> tuple[MountInfo, ...]:
    if not isinstance(value, list) or not value:
        raise ValidationError("mountInfos", "must be a non-empty list of {mountPoint, server, path, permission}")
    out: list[MountInfo] = []
    for i, m in enumerate(value):
        field = f"mountInfos[{i}]"
        if not isinstance(m, dict):
            raise ValidationError(field, "must be a mapping {mountPoint, server, path, permission}")
        unknown = sorted(set(m) - {"mountPoint", "server", "path", "permission"})
        if unknown:
            raise ValidationError(f"{field}.{unknown[0]}", "unknown field; a mount info has mountPoint, server, "
                                                           "path and permission")
        point = check_mount_point(m.get("mountPoint"), f"{field}.mountPoint")
        server = m.get("server")
        if not isinstance(server, str) or server not in servers:
            known = ", ".join(sorted(servers)) or "none"
            raise ValidationError(f"{field}.server", f"unknown storage server {server!r} (known: {known})")
        permission = m.get("permission", "rw")
        if permission not in PERMISSIONS:
            raise ValidationError(f"{field}.permission", f"must be rw or ro, got {permission!r}")
        if any(point == o.mount_point or point.startswith(o.mount_point + "/") or o.mount_point.startswith(point + "/")
               for o in out):
            raise ValidationError(f"{field}.mountPoint", f"{point!r} overlaps another mount point of the config")
        out.append(MountInfo(point, server, check_relative_path(m.get("path"), f"{field}.path"),
                             permission == "ro"))
    return tuple(out)


class StorageService:
    """Storage servers and configs (module doc). Thread-safe.

    Raises, besides what each method names: ValidationError (400, naming the field), NoStorageError
    (404), ConflictError (409: in use) and the store's UnavailableError (503).
    """

    def __init__(self, sessions: Sessions, *, clock: Callable[[], float] = time.time) -> None:
        self._sessions = sessions
        self._clock = clock
        self._lock = threading.Lock()
        self._loaded_at: float | None = None
        self._servers: dict[str, ServerSpec] = {}
        self._configs: dict[str, Config] = {}

    # ------------------------------------------------------------------ the in-memory view
    def _view(self) -> tuple[dict[str, ServerSpec], dict[str, Config]]:
        with self._lock:
            now = time.monotonic()
            if self._loaded_at is None or now - self._loaded_at > CACHE_TTL_S:
                with reading(self._sessions, "read storage") as s:
                    servers = {r.name: ServerSpec(r.name, r.type, dict(r.data))
                               for r in s.scalars(select(StorageServer))}
                    configs = {}
                    for r in s.scalars(select(StorageConfig)):
                        infos = tuple(MountInfo(m["mountPoint"], m["server"], m.get("path", ""),
                                                m.get("permission") == "ro") for m in r.mount_infos)
                        configs[r.name] = Config(r.name, bool(r.default), infos)
                self._servers, self._configs, self._loaded_at = servers, configs, now
            return self._servers, self._configs

    def _changed(self) -> None:
        with self._lock:
            self._loaded_at = None

    def config(self, name: str) -> Config:
        """The config ``name``. Raises NoStorageError."""
        found = self._view()[1].get(name)
        if found is None:
            raise NoStorageError(f"Storage config {name} not found.")
        return found

    def server(self, name: str) -> ServerSpec:
        """The server ``name`` with its secrets (for mounting only; answer :func:`redacted`)."""
        found = self._view()[0].get(name)
        if found is None:
            raise NoStorageError(f"Storage server {name} not found.")
        return found

    def has_defaults(self) -> bool:
        """Whether any config is a default one (else a job naming none mounts nothing)."""
        return any(c.default for c in self._view()[1].values())

    # ------------------------------------------------------------------ servers
    def list_servers(self) -> list[dict]:
        """``[{name, type, data}]`` sorted by name, secrets redacted."""
        return [self._server_json(s) for _, s in sorted(self._view()[0].items())]

    def get_server(self, name: str) -> dict:
        return self._server_json(self.server(name))

    @staticmethod
    def _server_json(spec: ServerSpec) -> dict:
        return {"name": spec.name, "type": spec.type, "data": redacted(spec)}

    def put_server(self, name: str, type_: str, data: dict) -> dict:
        """Create or replace server ``name`` (checked by :func:`apiary.mounts.servers.check_server`).
        A replaced server's new data is mounted by tasks launched after the change; nodes keep
        what they mounted for running tasks. Returns it as :meth:`get_server` does."""
        check_config_name(name, "name")
        spec = ServerSpec(name, type_, dict(data))
        check_server(spec)
        with UnitOfWork(self._sessions, "put storage server") as uow:
            row = uow.s.get(StorageServer, name)
            if row is None:
                uow.s.add(StorageServer(name=name, type=type_, data=spec.data, created=self._clock()))
            else:
                row.type, row.data = type_, spec.data
            uow.after_commit(self._changed)
        return self.get_server(name)

    def delete_server(self, name: str) -> None:
        """Delete server ``name``. Raises NoStorageError, ConflictError while a config mounts it."""
        with UnitOfWork(self._sessions, "delete storage server") as uow:
            if uow.s.get(StorageServer, name) is None:
                raise NoStorageError(f"Storage server {name} not found.")
            users = sorted(c.name for c in uow.s.scalars(select(StorageConfig))
                           if any(m.get("server") == name for m in c.mount_infos))
            if users:
                raise ConflictError(f"Storage server {name} is used by config(s) {', '.join(users)}; "
                                    "change or delete them first.")
            uow.s.execute(delete(StorageServer).where(StorageServer.name == name))
            uow.after_commit(self._changed)

    # ------------------------------------------------------------------ configs
    def list_configs(self, visible: Iterable[str] | None = None) -> list[dict]:
        """Configs as OpenPAI shows them, sorted by name: all (``visible`` None: admins) or those
        named in ``visible`` (a user's granted configs)."""
        configs = self._view()[1]
        names = sorted(configs) if visible is None else sorted(set(visible) & set(configs))
        return [configs[n].to_json() for n in names]

    def get_config(self, name: str) -> dict:
        return self.config(name).to_json()

    def put_config(self, name: str, *, default: bool, mount_infos: list) -> dict:
        """Create or replace config ``name``: ``mount_infos`` as OpenPAI's ``mountInfos`` (each server
        must exist; mount points obey :func:`apiary.spec.storage.check_mount_point` and do not
        overlap; ``permission`` rw or ro, default rw; ``path`` relative). Returns it."""
        check_config_name(name, "name")
        with UnitOfWork(self._sessions, "put storage config") as uow:
            servers = {r.name: ServerSpec(r.name, r.type, dict(r.data)) for r in uow.s.scalars(select(StorageServer))}
            infos = [m.to_json() for m in _mount_infos(mount_infos, servers)]
            row = uow.s.get(StorageConfig, name)
            if row is None:
                uow.s.add(StorageConfig(name=name, default=bool(default), mount_infos=infos, created=self._clock()))
            else:
                row.default, row.mount_infos = bool(default), infos
            uow.after_commit(self._changed)
        return self.get_config(name)

    def delete_config(self, name: str) -> None:
        """Delete config ``name``. Raises NoStorageError, ConflictError while a group is granted it."""
        with UnitOfWork(self._sessions, "delete storage config") as uow:
            if uow.s.get(StorageConfig, name) is None:
                raise NoStorageError(f"Storage config {name} not found.")
            groups = sorted(uow.s.scalars(select(GroupStorageGrant.group).where(GroupStorageGrant.config == name)))
            if groups:
                raise ConflictError(f"Storage config {name} is granted to group(s) {', '.join(groups)}; "
                                    "revoke the grants first.")
            uow.s.execute(delete(StorageConfig).where(StorageConfig.name == name))
            uow.after_commit(self._changed)

    # ------------------------------------------------------------------ jobs
    def check_submit(self, requests: tuple[StorageRequest, ...] | None, *, admin: bool,
                     granted: frozenset[str]) -> None:
        """Refuse a job's storage requests (:meth:`apiary.spec.job.JobSpec.storage_requests`) that
        name an unknown config (ValidationError naming the job's field, 400), give a ``mountPath``
        for a config of several mount infos (400), or name a config the user's groups do not grant
        (ForbiddenError naming it, 403; admins may use every config). Unknown names are reported
        before refusals. None (the user's defaults) passes: they are chosen at launch."""
        if not requests:
            return
        configs = self._view()[1]
        for r in requests:
            if r.name not in configs:
                mine = ", ".join(sorted(n for n in configs if admin or n in granted)) or "none"
                raise ValidationError(r.field, f"unknown storage config {r.name!r} (yours: {mine})")
        for r in requests:
            if not admin and r.name not in granted:
                raise ForbiddenError(f"Storage config {r.name} is not granted to any of your groups "
                                     f"(field {r.field}); ask an admin to grant it.")
            if r.mount_path is not None and len(configs[r.name].mount_infos) != 1:
                raise ValidationError(r.field.rsplit(".", 1)[0] + ".mountPath",
                                      f"storage config {r.name!r} has {len(configs[r.name].mount_infos)} mount "
                                      "infos; a mountPath can replace the mount point of a config of one")

    def plan(self, requests: tuple[StorageRequest, ...] | None, *, admin: bool,
             granted: frozenset[str]) -> list[dict]:
        """What a task of a job mounts now: ``[{"config", "server": {name, type, data}, "path",
        "mountPoint", "readOnly"}]`` in order (``data`` with its secrets: for the node that runs the
        task only; ``"optional": true`` on a mount the task runs without when it fails).
        ``requests`` None: every default config the user is granted (admins: every default
        config). Raises NoStorageError for a config or server gone since submission,
        ForbiddenError for a grant revoked since, ValidationError for two mounts on one point."""
        servers, configs = self._view()
        if requests is None:
            chosen = [StorageRequest(c.name, None, "default") for n, c in sorted(configs.items())
                      if c.default and (admin or n in granted)]
        else:
            chosen = list(requests)
        out: list[dict] = []
        points: set[str] = set()
        for r in chosen:
            config = configs.get(r.name)
            if config is None:
                raise NoStorageError(f"Storage config {r.name} no longer exists.")
            if not admin and r.name not in granted:
                raise ForbiddenError(f"Storage config {r.name} is no longer granted to the job's user.")
            for m in config.mount_infos:
                server = servers.get(m.server)
                if server is None:
                    raise NoStorageError(f"Storage server {m.server} of config {r.name} no longer exists.")
                point = r.mount_path or m.mount_point
                if point in points:
                    raise ValidationError("storage", f"two storage configs mount on {point}")
                points.add(point)
                mount = {"config": r.name, "server": {"name": server.name, "type": server.type,
                                                      "data": dict(server.data)},
                         "path": m.path, "mountPoint": point, "readOnly": m.read_only}
                out.append({**mount, "optional": True} if r.optional else mount)
        return out


class MountPlanner:
    """What each task of a job mounts when it launches: :meth:`StorageService.plan` for the job's
    requests with its user's grants as they are now (OpenPAI's storage plugin also reads the
    user's configs when the task starts). ``grants_of(user) -> (admin, granted configs)`` asks the
    user directory (NotFoundError for a user deleted since); answers are kept ``ttl_s`` seconds
    per user, as the directory keeps a verified token, so a busy node's polls cost no query."""

    def __init__(self, service: StorageService, grants_of: Callable[[str], tuple[bool, frozenset[str]]], *,
                 ttl_s: float = CACHE_TTL_S) -> None:
        self.service = service
        self.grants_of = grants_of
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._grants: dict[str, tuple[float, tuple[bool, frozenset[str]]]] = {}

    def _user(self, user: str) -> tuple[bool, frozenset[str]]:
        now = time.monotonic()
        with self._lock:
            kept = self._grants.get(user)
            if kept is not None and now - kept[0] < self.ttl_s:
                return kept[1]
        grants = self.grants_of(user)
        with self._lock:
            if len(self._grants) > 10_000:
                self._grants.clear()
            self._grants[user] = (now, grants)
        return grants

    def plan(self, user: str, requests: tuple[StorageRequest, ...] | None) -> list[dict]:
        """The mounts of a task of ``user``'s job naming ``requests`` (:meth:`StorageService.plan`);
        ``[]`` at once when the job names none and no config is a default one. Raises what
        :meth:`StorageService.plan` and ``grants_of`` raise."""
        if requests == () or (requests is None and not self.service.has_defaults()):
            return []
        admin, granted = self._user(user)
        return self.service.plan(requests, admin=admin, granted=granted)
