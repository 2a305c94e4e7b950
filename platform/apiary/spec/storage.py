"""What storage a job asks for, in OpenPAI's two forms, and the rule for a mount point.

OpenPAI lets a job name team-wise storage configs in two ways, and Apiary reads both:

* ``extras.storages: [{name, mountPath}]`` (OpenPAI v1's storage form; ``mountPath`` optional):
  each config by name, optionally mounted at ``mountPath`` instead of its own mount points;
* ``extras.com.microsoft.pai.runtimeplugin: [{plugin: teamwise_storage, parameters:
  {storageConfigNames: [...]}}]`` (OpenPAI's runtime plugin ``teamwise_storage``): configs by
  name, at their mount points.

A job with neither gets its user's default configs (:func:`storage_requests` answers ``None``);
a job that lists an empty list gets none. Which configs exist and who may use them is the
storage service's and the directory's to say at submission (:mod:`apiary.storage`): this module
only reads the job. It is pure: no I/O.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any

from apiary.errors import ValidationError

#: The key of OpenPAI's runtime plugin list in ``extras`` (as :mod:`apiary.spec.admission`'s).
_PLUGINS = "com.microsoft.pai.runtimeplugin"
#: OpenPAI's team-wise storage runtime plugin.
TEAMWISE_STORAGE = "teamwise_storage"
#: A storage config's name: letters, digits, ``_``, ``-`` and ``.`` (OpenPAI's configs are
#: Kubernetes secret keys, e.g. ``PAI_SHARE``), 1-100 characters.
CONFIG_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
#: Directories a storage may not be mounted on or under, in a task: the system's own (the FHS's
#: top-level directories). The process runtime binds storage in the task's mount namespace
#: before it drops to the task's uid, so a mount over ``/usr`` or ``/etc`` would let a user's
#: files stand in for the programs and configuration that still run as root there.
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/root",
               "/run", "/sbin", "/sys", "/usr", "/var")


#: A runtime plugin's ``failurePolicy`` (OpenPAI's plugins): ``fail`` (the default) fails the task
#: when the plugin does; ``ignore`` runs the commands without what failed.
FAILURE_POLICIES = ("fail", "ignore")


@dataclass(frozen=True)
class StorageRequest:
    """One storage config a job names: ``name``; ``mount_path`` where to mount it (None: the
    config's own mount points); ``field``: the job's field that named it (for errors);
    ``optional``: named by a ``teamwise_storage`` entry with ``failurePolicy: ignore`` (a mount of
    it that fails is left out and the task runs without it)."""

    name: str
    mount_path: str | None
    field: str
    optional: bool = False


def check_mount_point(path: Any, field: str) -> str:
    """``path`` when it may be a mount point in a task, else ValidationError naming ``field``.

    The rule: an absolute POSIX path of at most 4,096 bytes, already normal (no ``.``, ``..``,
    empty or trailing components), neither ``/`` nor on or under one of :data:`SYSTEM_DIRS`.
    """
    if not isinstance(path, str) or not path:
        raise ValidationError(field, "must be an absolute path, e.g. /mnt/data")
    if not path.startswith("/") or len(path.encode()) > 4096:
        raise ValidationError(field, f"{path!r} must be an absolute path of at most 4096 bytes, e.g. /mnt/data")
    if posixpath.normpath(path) != path or path.startswith("//") or "/./" in path + "/" or "/../" in path + "/":
        raise ValidationError(field, f"{path!r} must be a normal path: no '.', '..', '//' or trailing '/'")
    if path == "/":
        raise ValidationError(field, "a storage cannot be mounted on /")
    for system in SYSTEM_DIRS:
        if path == system or path.startswith(system + "/"):
            raise ValidationError(field, f"{path!r} is on or under {system}, a system directory a storage may "
                                         f"not cover; use a path such as /mnt/<name>")
    return path


def check_config_name(name: Any, field: str) -> str:
    """``name`` when it is a valid storage config name (:data:`CONFIG_NAME`), else ValidationError."""
    if not isinstance(name, str) or not CONFIG_NAME.fullmatch(name):
        raise ValidationError(field, f"invalid storage config name {name!r}: 1-100 letters, digits, '_', '-' or '.'")
    return name


def _from_storages(value: Any) -> list[StorageRequest]:
    base = "extras.storages"
    if not isinstance(value, list):
        raise ValidationError(base, f"must be a list of {{name, mountPath}}, got {type(value).__name__}")
    out = []
    for i, entry in enumerate(value):
        field = f"{base}[{i}]"
        if not isinstance(entry, dict):
            raise ValidationError(field, "each storage is a mapping {name: <config>, mountPath: <path>}")
        unknown = sorted(set(entry) - {"name", "mountPath"})
        if unknown:
            raise ValidationError(f"{field}.{unknown[0]}", "unknown field; a storage has name and mountPath")
        name = check_config_name(entry.get("name"), f"{field}.name")
        path = entry.get("mountPath")
        out.append(StorageRequest(name, None if path is None else check_mount_point(path, f"{field}.mountPath"),
                                  f"{field}.name"))
    return out


def _from_plugin(plugins: Any) -> list[StorageRequest] | None:
    """The configs ``teamwise_storage`` entries name; None when no entry names any (no entry, or
    entries without ``storageConfigNames``: OpenPAI's plugin then mounts the user's defaults)."""
    if not isinstance(plugins, list):
        return None  # admission refuses a plugin list that is not a list, naming its field
    found: list[StorageRequest] | None = None
    for i, entry in enumerate(plugins):
        if not isinstance(entry, dict) or entry.get("plugin") != TEAMWISE_STORAGE:
            continue
        base = f"extras.{_PLUGINS}[{i}].parameters"
        policy = entry.get("failurePolicy", "fail")
        if policy not in FAILURE_POLICIES:
            raise ValidationError(f"extras.{_PLUGINS}[{i}].failurePolicy", f"must be fail or ignore, got {policy!r}")
        params = entry.get("parameters")
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValidationError(base, "must be a mapping {storageConfigNames: [...]}")
        if "storageConfigNames" not in params:
            continue
        names = params["storageConfigNames"]
        if not isinstance(names, list):
            raise ValidationError(f"{base}.storageConfigNames", "must be a list of storage config names")
        found = (found or []) + [
            StorageRequest(check_config_name(n, f"{base}.storageConfigNames[{j}]"), None,
                           f"{base}.storageConfigNames[{j}]", policy == "ignore")
            for j, n in enumerate(names)]
    return found


def storage_requests(extras: dict[str, Any] | None) -> tuple[StorageRequest, ...] | None:
    """The storage configs the job names, in order, each once; None when it names none in either
    form (then its user's default configs apply); ``()`` when it lists none (``storages: []``).
    ``extras``: the job's ``extras`` as plain data.

    A config named in both forms is mounted once: the ``extras.storages`` entry wins (it may carry
    a ``mountPath``). Raises ValidationError for a malformed entry (its field: ``extras.storages[0].name``,
    ``extras.com.microsoft.pai.runtimeplugin[0].parameters.storageConfigNames[1]``) and for a config
    named twice in ``extras.storages``.
    """
    if not extras:
        return None
    listed = _from_storages(extras["storages"]) if "storages" in extras else None
    plugin = _from_plugin(extras.get(_PLUGINS))
    if listed is None and plugin is None:
        return None
    out: dict[str, StorageRequest] = {}
    for r in listed or []:
        if r.name in out:
            raise ValidationError(r.field, f"storage config {r.name!r} is named twice in extras.storages")
        out[r.name] = r
    for r in plugin or []:
        out.setdefault(r.name, r)
    return tuple(out.values())
