"""Users' SSH public keys in the store (OpenPAI's user extension ``sshKeys``: title, value, time).

A user keeps public keys on their account (``apiary user ssh-key add``, ``/api/v2/users/{name}/sshKeys``);
every task of their jobs with the ssh runtime plugin lets them in (:mod:`apiary.control.jobssh`).
Each key is one checked authorized_keys line (:func:`apiary.spec.ssh.check_public_key`: no options,
no control characters), under a title unique per user. Writes go through one
:class:`apiary.store.unit.UnitOfWork`; reads through :func:`apiary.store.unit.reading`.
:class:`apiary.auth.directory.Directory` answers them; nothing here is cached.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session

from apiary.errors import ConflictError, NoSshKeyError, NoUserError, ValidationError
from apiary.spec.ssh import check_public_key
from apiary.store.models import User, UserSshKey
from apiary.store.unit import Sessions, UnitOfWork, reading

logger = logging.getLogger(__name__)

#: A key's title: letters, digits, ``_ - . @`` (1-100), e.g. ``laptop`` or ``alice@desk``.
TITLE = re.compile(r"^[A-Za-z0-9_.@-]{1,100}$")
#: Most keys one user may keep (OpenPAI sets no bound; the authorized_keys of a task stays small).
MAX_KEYS_PER_USER = 50


def fingerprint(value: str) -> str:
    """OpenSSH's fingerprint of a public key line: ``SHA256:<base64 of the blob's SHA-256, unpadded>``."""
    blob = base64.b64decode(value.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _json(row: UserSshKey) -> dict:
    return {"title": row.title, "value": row.value, "fingerprint": fingerprint(row.value), "created": row.created}


def user_keys(s: Session, user: str) -> list[str]:
    """The key lines of ``user`` in title order, read in the caller's session ``s``."""
    return list(s.scalars(select(UserSshKey.value).where(UserSshKey.user == user).order_by(UserSshKey.title)))


class SshKeys:
    """Users' SSH public keys over ``sessions``. Thread-safe (no state but the session factory)."""

    def __init__(self, sessions: Sessions, clock: Callable[[], float]) -> None:
        self._sessions = sessions
        self._clock = clock

    def list(self, user: str) -> list[dict]:
        """``[{"title", "value", "fingerprint", "created"}]`` of ``user`` by title. Raises NoUserError."""
        with reading(self._sessions, "list ssh keys") as s:
            if s.get(User, user) is None:
                raise NoUserError(f"User {user} not found.")
            rows = s.scalars(select(UserSshKey).where(UserSshKey.user == user).order_by(UserSshKey.title))
            return [_json(r) for r in rows]

    def add(self, user: str, title: str, value: str) -> dict:
        """Keep key ``value`` under ``title`` on ``user``'s account; returns it as :meth:`list` shows
        it. Raises ValidationError (a bad title or key: field ``title`` / ``value``), NoUserError,
        ConflictError (the title, or the same key, is already there; more than
        :data:`MAX_KEYS_PER_USER` keys)."""
        if not isinstance(title, str) or not TITLE.fullmatch(title):
            raise ValidationError("title", "must be 1-100 letters, digits, '_', '-', '.' or '@'")
        line = check_public_key(value, "value")
        with UnitOfWork(self._sessions, "add ssh key") as uow:
            s = uow.s
            if s.get(User, user) is None:
                raise NoUserError(f"User {user} not found.")
            if s.get(UserSshKey, (user, title)) is not None:
                raise ConflictError(f"User {user} already has an SSH key titled {title!r}; remove it first.")
            existing = user_keys(s, user)
            blob = line.split()[1]
            if any(v.split()[1] == blob for v in existing):
                raise ConflictError(f"User {user} already has this SSH key (under another title).")
            if len(existing) >= MAX_KEYS_PER_USER:
                raise ConflictError(f"User {user} has {len(existing)} SSH keys, the most one may keep.")
            row = UserSshKey(user=user, title=title, value=line, created=self._clock())
            s.add(row)
            out = _json(row)
        logger.info("ssh key added user=%s title=%s fingerprint=%s", user, title, out["fingerprint"])
        return out

    def remove(self, user: str, title: str) -> None:
        """Remove ``user``'s key ``title``. Raises NoUserError, NoSshKeyError (no such key)."""
        with UnitOfWork(self._sessions, "remove ssh key") as uow:
            s = uow.s
            if s.get(User, user) is None:
                raise NoUserError(f"User {user} not found.")
            row = s.get(UserSshKey, (user, title))
            if row is None:
                raise NoSshKeyError(f"User {user} has no SSH key titled {title!r}.")
            s.delete(row)
        logger.info("ssh key removed user=%s title=%s", user, title)
