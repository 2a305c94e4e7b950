"""What ``apiary up`` creates so that every call can carry a credential.

On every start (idempotent):

* group ``admin`` (an admin group) with user ``admin`` in it; group ``default`` granting every
  virtual cluster of the cluster config, unless the users file defines ``default`` itself;
* the groups and users of the static users file (``APIARY_USERS_FILE``), if any::

      groups:
        - {name: ml-team, virtualClusters: [vc1], admin: false, description: "..."}
      users:
        - {name: alice, groups: [ml-team], email: alice@example.com}

* token files, mode 0600, each kept while it still authenticates and replaced otherwise:
  ``home/token`` (user ``admin``: the CLI's), ``home/credentials/agent-<node>.token`` (one per
  node), ``home/credentials/bridge.token`` and ``home/credentials/alertmanager.token``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from apiary.auth.directory import Directory
from apiary.auth.principal import ALERTMANAGER, BRIDGE, Kind
from apiary.errors import ValidationError
from apiary.spec.safeyaml import load as safe_load_yaml

ADMIN_USER = "admin"
ADMIN_GROUP = "admin"
DEFAULT_GROUP = "default"


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600, also when it existed); a
    directory it creates is 0700."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)


def agent_token_path(credentials: Path, node: str) -> Path:
    return credentials / f"agent-{node}.token"


def read_token(path: Path) -> str | None:
    return path.read_text(encoding="utf-8").strip() or None if path.exists() else None


def _ensure_token(directory: Directory, path: Path, kind: Kind, subject: str, description: str) -> None:
    p = directory.principal_or_none(read_token(path))
    if p is not None and p.kind == kind and p.name == subject:
        return
    write_secret(path, directory.create_token(kind, subject, description=description).token)


def seed_users(directory: Directory, text: str, virtual_clusters: Iterable[str]) -> None:
    """Create the groups and users of a users file (YAML, see the module doc). Existing ones get
    the file's grants and memberships added. Raises ValidationError naming the bad entry."""
    data = safe_load_yaml(text, field="usersFile") or {}
    if not isinstance(data, dict):
        raise ValidationError("usersFile", "must be a mapping with 'groups' and 'users'")
    known = set(virtual_clusters)
    for i, g in enumerate(data.get("groups") or []):
        if not isinstance(g, dict) or "name" not in g:
            raise ValidationError(f"usersFile.groups[{i}]", "needs a name")
        vcs = list(g.get("virtualClusters") or [])
        unknown = sorted(set(vcs) - known)
        if unknown:
            raise ValidationError(f"usersFile.groups[{i}].virtualClusters", f"unknown virtual clusters {unknown}")
        directory.create_group(g["name"], admin=bool(g.get("admin")), description=str(g.get("description") or ""),
                               exist_ok=True)
        for vc in vcs:
            directory.set_grant(g["name"], vc)
    for i, u in enumerate(data.get("users") or []):
        if not isinstance(u, dict) or "name" not in u:
            raise ValidationError(f"usersFile.users[{i}]", "needs a name")
        directory.create_user(u["name"], email=u.get("email"), exist_ok=True)
        for g in u.get("groups") or []:
            directory.set_member(g, u["name"])


def bootstrap(directory: Directory, home: Path, *, nodes: Iterable[str], virtual_clusters: Iterable[str],
              users_file: Path | None = None) -> None:
    """Ensure the admin, the default group, the users file's entries and every token file (module doc)."""
    vcs = sorted(virtual_clusters)
    directory.create_group(ADMIN_GROUP, admin=True, description="Platform administrators.", exist_ok=True)
    directory.create_user(ADMIN_USER, exist_ok=True)
    directory.set_member(ADMIN_GROUP, ADMIN_USER)
    seeded = users_file.read_text(encoding="utf-8") if users_file is not None else ""
    if seeded:
        seed_users(directory, seeded, vcs)
    if DEFAULT_GROUP not in {g["name"] for g in directory.list_groups()}:
        directory.create_group(DEFAULT_GROUP, description="Every user created without a group.",
                               virtual_clusters=vcs)
    _ensure_token(directory, home / "token", "user", ADMIN_USER, "apiary up: the first admin")
    creds = home / "credentials"
    for node in nodes:
        _ensure_token(directory, agent_token_path(creds, node), "agent", node, f"node agent of {node}")
    _ensure_token(directory, creds / "bridge.token", "service", BRIDGE, "Prefect bridge and flows")
    _ensure_token(directory, creds / "alertmanager.token", "service", ALERTMANAGER, "Alertmanager webhook")
