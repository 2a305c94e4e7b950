"""Users, groups, grants and tokens in the store, and token verification.

The store is the truth; :class:`Directory` keeps a small cache of verified tokens (token id ->
principal) for ``cache_ttl_s`` (a node agent's token for a span between half of ``agent_cache_ttl_s``
and all of it, drawn per token, :meth:`Directory._keep_s`) so a request costs
no query. Every write goes through one
:class:`apiary.store.unit.UnitOfWork` (one commit; a store failure is a 409 ConflictError or a 503
UnavailableError and changes nothing) and clears the cache only after its commit succeeded; reads
use :func:`apiary.store.unit.reading`. A write by another process (there is one control plane, so
only a migration or a manual SQL change) is seen within ``cache_ttl_s``.

Node agents' tokens are kept longer: thousands of agents each report every few seconds, and a
token read per report was most of a fleet's authentication cost. Only the leader authenticates
them (followers forward every agent call, :mod:`apiary.api.replica`), and a revocation is a write
on the leader that clears its cache at once, so the longer time bounds nothing but a manual SQL
change (Kubernetes keeps a webhook's token verdicts 2 min: --authentication-token-webhook-cache-ttl,
the default ``agent_cache_ttl_s`` here). A change of users or groups forgets only user principals;
a revocation forgets that token.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import bindparam, delete, inspect, or_, select
from sqlalchemy.orm import Mapper, Session

from apiary.auth import tokens
from apiary.auth.principal import SERVICES, Kind, Principal
from apiary.auth.sshkeys import SshKeys
from apiary.errors import (
    ConflictError,
    ConflictUserError,
    LastAdminError,
    NoGroupError,
    NoTokenError,
    NoUserError,
    UnauthorizedError,
    ValidationError,
)
from apiary.store.models import Group, GroupGrant, GroupMember, GroupStorageGrant, Token, User
from apiary.store.unit import Sessions, UnitOfWork, reading

logger = logging.getLogger(__name__)

#: OpenPAI user and group names: letters, digits, ``_`` and ``-``.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: Personal tokens last 90 days unless asked otherwise (GitHub's default for fine-grained tokens is 30).
DEFAULT_TOKEN_TTL_S = 90 * 86400.0


def check_name(field: str, name: str) -> str:
    """``name`` unchanged when it matches :data:`NAME_PATTERN` (OpenPAI's rule for user and group
    names); otherwise ValidationError (400) naming ``field``."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValidationError(field, f"invalid name {name!r}: 1-64 letters, digits, '_' or '-'")
    return name


@dataclass(frozen=True)
class NewToken:
    """A created token: ``token`` is shown once; ``info`` is what ``list_tokens`` shows of it."""

    token: str
    info: dict


def _token_info(row: Token) -> dict:
    return {"id": row.id, "kind": row.kind, "subject": row.subject, "description": row.description,
            "created": row.created, "expires": row.expires, "revoked": row.revoked}


def _admin_memberships(s: Session) -> list[tuple[str, str]]:
    """``(group, user)`` for every member of a group with ``admin`` set."""
    rows = s.execute(select(GroupMember.group, GroupMember.user)
                     .join(Group, Group.name == GroupMember.group).where(Group.admin.is_(True)))
    return [(group, user) for group, user in rows]


def _keep_an_admin(s: Session, change: str, *, without_user: str | None = None, without_group: str | None = None,
                   without_member: tuple[str, str] | None = None) -> None:
    """Raise LastAdminError when ``change`` (described for the message) would leave no admin
    where there is one now, that is without user ``without_user``, group ``without_group`` or the
    membership ``(group, user)``: with none, nobody could manage users, groups or tokens again
    until an operator re-seeds the admin (``apiary up`` bootstrap). Callers hold
    ``Directory._admin_writes`` from this check to their commit."""
    rows = _admin_memberships(s)
    now = {user for _, user in rows}
    after = {user for group, user in rows
             if user != without_user and group != without_group and (group, user) != without_member}
    if now and not after:
        raise LastAdminError(
            f"{change} would leave no admin (the admins now: {', '.join(sorted(now))}); nobody could then "
            f"manage users, groups or tokens. Make another user an admin first "
            f"(apiary group add-member <admin group> <user>).")


#: :meth:`Directory._load`'s statements, built once (their compiled forms are cached).
_TOKEN_READ = select(Token.digest, Token.kind, Token.subject, Token.expires, Token.revoked).where(
    Token.id == bindparam("token_id"))
_USER_EXISTS = select(User.name).where(User.name == bindparam("name"))


class Directory:
    """Identity over ``sessions``. Thread-safe. Writes raise ValidationError (bad name),
    NotFoundError (:class:`~apiary.errors.NoUserError`, ``NoGroupError``, ``NoTokenError``),
    ConflictUserError (exists), LastAdminError (a change that would leave no admin),
    UnavailableError (503: the store cannot commit)."""

    def __init__(self, sessions: Sessions, *, clock: Callable[[], float] = time.time,
                 cache_ttl_s: float = 5.0, agent_cache_ttl_s: float = 120.0) -> None:
        self._sessions = sessions
        self._clock = clock
        self._ttl = cache_ttl_s
        self._agent_ttl = agent_cache_ttl_s
        self._cache: dict[str, tuple[str, Principal, float]] = {}  # token id -> (digest, principal, until)
        self._spread = random.Random()  # agent tokens' cache spans (:meth:`_keep_s`), not a secret
        self._lock = threading.Lock()
        # Held from the last-admin check to the commit of a write that may remove an admin: two
        # admins removing each other at once would otherwise both see the other still there.
        self._admin_writes = threading.Lock()
        #: Users' SSH public keys (:class:`apiary.auth.sshkeys.SshKeys`: list, add, remove).
        self.ssh_keys = SshKeys(sessions, clock)

    # ------------------------------------------------------------------ verification
    def authenticate(self, token: str | None) -> Principal:
        """The principal ``token`` stands for. Raises UnauthorizedError for a missing, malformed,
        unknown, wrong, expired or revoked token (one message for all but expiry: no oracle).
        Reads the store when the token is not in the cache: blocking (call it from a thread)."""
        principal = self._verify(token, load=True)
        if principal is None:  # not reached: with load=True a miss is loaded or refused
            raise UnauthorizedError("Invalid token.")
        return principal

    def authenticate_cached(self, token: str | None) -> Principal | None:
        """As :meth:`authenticate` from the verified-token cache only: None when the token is not
        cached (the caller then calls :meth:`authenticate` off its event loop). Never blocks on
        the store; raises UnauthorizedError as :meth:`authenticate` for what it can judge."""
        return self._verify(token, load=False)

    def _verify(self, token: str | None, *, load: bool) -> Principal | None:
        if not token:
            raise UnauthorizedError("Missing credential: send 'Authorization: Bearer <token>'.")
        parts = tokens.split(token)
        if parts is None:
            raise UnauthorizedError("Invalid token.")
        token_id, secret = parts
        now = self._clock()
        with self._lock:
            hit = self._cache.get(token_id)
        if hit is not None and now < hit[2]:
            stored, principal = hit[0], hit[1]
        elif not load:
            return None
        else:
            loaded = self._load(token_id, now)
            if loaded is None:
                raise UnauthorizedError("Invalid token.")
            stored, principal = loaded
            with self._lock:
                self._cache[token_id] = (stored, principal, now + self._keep_s(principal))
        if not tokens.matches(secret, stored):
            raise UnauthorizedError("Invalid token.")
        if principal.expires is not None and principal.expires <= now:
            raise UnauthorizedError(f"Token {token_id} expired; create a new one (apiary token create).")
        return principal

    def _keep_s(self, principal: Principal) -> float:
        """How long a verified token stays cached: ``cache_ttl_s``, or for a node agent's a span
        drawn evenly from the second half of ``agent_cache_ttl_s``. A fleet's agents first call
        within seconds of each other (a control plane's start, a partition healed); with one TTL
        for all, every one of their tokens would fall due in the same seconds a TTL later, and
        again after each TTL: 5,000 store reads in a burst that stalled the leader's answers for
        seconds (bench/cluster.py). Spread, they fall due over half a TTL and drift apart."""
        if principal.kind != "agent":
            return self._ttl
        return self._agent_ttl * self._spread.uniform(0.5, 1.0)

    def _load(self, token_id: str, now: float) -> tuple[str, Principal] | None:
        # The token's columns with Core, not the ORM's Session.get: a fleet's agent tokens fall due
        # about 50 times a second at 5,000 nodes, and the ORM's loading was most of each read.
        with reading(self._sessions, "verify token") as s:
            row = s.execute(_TOKEN_READ, {"token_id": token_id}).first()
            if row is None or row.revoked is not None:
                return None
            if row.kind == "user":
                if s.execute(_USER_EXISTS, {"name": row.subject}).first() is None:
                    return None
                principal = self._user_principal(s, row.subject, token_id, row.expires)
            else:
                principal = Principal(kind=row.kind, name=row.subject, token_id=token_id, expires=row.expires)
            return row.digest, principal

    @staticmethod
    def _user_principal(s: Session, name: str, token_id: str, expires: float | None) -> Principal:
        groups = list(s.scalars(select(Group).join(GroupMember, GroupMember.group == Group.name)
                                .where(GroupMember.user == name)))
        names = frozenset(g.name for g in groups)
        vcs = frozenset(s.scalars(select(GroupGrant.virtual_cluster).where(GroupGrant.group.in_(names)))) \
            if names else frozenset()
        storage = frozenset(s.scalars(select(GroupStorageGrant.config).where(GroupStorageGrant.group.in_(names)))) \
            if names else frozenset()
        return Principal(kind="user", name=name, token_id=token_id, admin=any(g.admin for g in groups),
                         groups=names, virtual_clusters=vcs, expires=expires, storage_configs=storage)

    def user_principal(self, name: str) -> Principal:
        """The principal of user ``name`` acting through a service (the Prefect portal's submit).
        Raises NotFoundError for a user that does not exist."""
        with reading(self._sessions, "read user") as s:
            if s.get(User, name) is None:
                raise NoUserError(f"User {name} not found.")
            return self._user_principal(s, name, token_id="", expires=None)

    def storage_grants(self, name: str) -> tuple[bool, frozenset[str]]:
        """``(admin, the storage configs user name's groups grant)``; NoUserError for no such user
        (what :class:`apiary.storage.service.MountPlanner` asks when a task launches)."""
        who = self.user_principal(name)
        return who.admin, who.storage_configs

    def _users_changed(self) -> None:
        """After a commit that changed users, groups, memberships or grants: forget the cached user
        principals (their groups and VCs may be stale). Agents' and services' principals name no
        group, so a fleet's thousands of agent tokens stay cached (clearing them all made every
        agent's next report read the store at once)."""
        with self._lock:
            self._cache = {k: v for k, v in self._cache.items() if v[1].kind != "user"}

    def _token_revoked(self, token_id: str) -> None:
        with self._lock:
            self._cache.pop(token_id, None)

    # ------------------------------------------------------------------ users and groups
    def _user_json(self, s: Session, u: User) -> dict:
        p = self._user_principal(s, u.name, "", None)
        return {"name": u.name, "email": u.email, "groups": sorted(p.groups),
                "virtualClusters": sorted(p.virtual_clusters), "storageConfigs": sorted(p.storage_configs),
                "admin": p.admin}

    def list_users(self) -> list[dict]:
        """``[{"name", "email", "groups", "virtualClusters", "admin"}]`` sorted by name."""
        with reading(self._sessions, "list users") as s:
            return [self._user_json(s, u) for u in s.scalars(select(User).order_by(User.name))]

    def get_user(self, name: str) -> dict:
        """One user as :meth:`list_users` shows them. Raises NotFoundError."""
        with reading(self._sessions, "read user") as s:
            u = s.get(User, name)
            if u is None:
                raise NoUserError(f"User {name} not found.")
            return self._user_json(s, u)

    def create_user(self, name: str, *, groups: Iterable[str] = (), email: str | None = None,
                    exist_ok: bool = False) -> dict:
        """Create user ``name`` in ``groups`` (which must exist); returns it as :meth:`get_user`
        shows it. ``exist_ok``: an existing user is returned unchanged instead of ConflictUserError."""
        check_name("username", name)
        groups = [check_name("groups", g) for g in groups]
        with UnitOfWork(self._sessions, "create user") as uow:
            s = uow.s
            existing = s.get(User, name)
            if existing is not None:
                if exist_ok:
                    return self._user_json(s, existing)
                raise ConflictUserError(f"User {name} already exists.")
            for g in groups:
                if s.get(Group, g) is None:
                    raise NoGroupError(f"Group {g} not found.")
            s.add(User(name=name, email=email, created=self._clock()))
            uow.flush()
            for g in groups:
                s.add(GroupMember(group=g, user=name))
            uow.after_commit(self._users_changed)
        logger.info("user created name=%s groups=%s", name, ",".join(groups))
        return self.get_user(name)

    def delete_user(self, name: str) -> None:
        """Delete the user, their memberships, and revoke their tokens. Their jobs stay. Raises
        NoUserError, LastAdminError (``name`` is the last admin)."""
        with self._admin_writes, UnitOfWork(self._sessions, "delete user") as uow:
            s = uow.s
            if s.get(User, name) is None:
                raise NoUserError(f"User {name} not found.")
            _keep_an_admin(s, f"Deleting user {name}", without_user=name)
            s.execute(delete(GroupMember).where(GroupMember.user == name))
            for t in s.scalars(select(Token).where(Token.kind == "user", Token.subject == name,
                                                   Token.revoked.is_(None))):
                t.revoked = self._clock()
            s.execute(delete(User).where(User.name == name))
            uow.after_commit(self._users_changed)

    def list_groups(self, name: str | None = None) -> list[dict]:
        """``[{"name", "admin", "description", "members", "virtualClusters", "storageConfigs"}]`` sorted by name
        (only group ``name`` if given)."""
        with reading(self._sessions, "list groups") as s:
            mq, gq, sq, q = select(GroupMember), select(GroupGrant), select(GroupStorageGrant), select(Group)
            if name is not None:
                mq, gq, q = mq.where(GroupMember.group == name), gq.where(GroupGrant.group == name), q.where(
                    Group.name == name)
                sq = sq.where(GroupStorageGrant.group == name)
            members: dict[str, list[str]] = {}
            for m in s.scalars(mq.order_by(GroupMember.user)):
                members.setdefault(m.group, []).append(m.user)
            grants: dict[str, list[str]] = {}
            for gr in s.scalars(gq.order_by(GroupGrant.virtual_cluster)):
                grants.setdefault(gr.group, []).append(gr.virtual_cluster)
            storage: dict[str, list[str]] = {}
            for sg in s.scalars(sq.order_by(GroupStorageGrant.config)):
                storage.setdefault(sg.group, []).append(sg.config)
            return [{"name": g.name, "admin": g.admin, "description": g.description,
                     "members": members.get(g.name, []), "virtualClusters": grants.get(g.name, []),
                     "storageConfigs": storage.get(g.name, [])}
                    for g in s.scalars(q.order_by(Group.name))]

    def get_group(self, name: str) -> dict:
        """One group as :meth:`list_groups` shows it. Raises NotFoundError."""
        found = self.list_groups(name)
        if not found:
            raise NoGroupError(f"Group {name} not found.")
        return found[0]

    def create_group(self, name: str, *, admin: bool = False, description: str = "",
                     virtual_clusters: Iterable[str] = (), exist_ok: bool = False) -> dict:
        """Create group ``name`` granting ``virtual_clusters`` (the caller checks they exist); returns
        it as :meth:`get_group` shows it. ``exist_ok``: an existing group is returned unchanged
        instead of ConflictUserError."""
        check_name("groupname", name)
        with UnitOfWork(self._sessions, "create group") as uow:
            s = uow.s
            if s.get(Group, name) is not None:
                if not exist_ok:
                    raise ConflictUserError(f"Group {name} already exists.")
            else:
                s.add(Group(name=name, admin=admin, description=description, created=self._clock()))
                uow.flush()
                for vc in sorted(set(virtual_clusters)):
                    s.add(GroupGrant(group=name, virtual_cluster=vc))
                uow.after_commit(self._users_changed)
        return self.get_group(name)

    def delete_group(self, name: str) -> None:
        """Delete the group, its memberships and grants. Raises NoGroupError, LastAdminError (an
        admin group whose members are the last admins)."""
        with self._admin_writes, UnitOfWork(self._sessions, "delete group") as uow:
            s = uow.s
            if s.get(Group, name) is None:
                raise NoGroupError(f"Group {name} not found.")
            _keep_an_admin(s, f"Deleting group {name}", without_group=name)
            s.execute(delete(GroupMember).where(GroupMember.group == name))
            s.execute(delete(GroupGrant).where(GroupGrant.group == name))
            s.execute(delete(GroupStorageGrant).where(GroupStorageGrant.group == name))
            s.execute(delete(Group).where(Group.name == name))
            uow.after_commit(self._users_changed)

    def set_member(self, group: str, user: str, member: bool = True) -> dict:
        """Add ``user`` to ``group`` (or remove them). Idempotent. Raises NoGroupError,
        NoUserError, LastAdminError (removing the last admin from the last admin group they are in)."""
        with self._admin_writes, UnitOfWork(self._sessions, "group membership") as uow:
            s = uow.s
            if s.get(Group, group) is None:
                raise NoGroupError(f"Group {group} not found.")
            if s.get(User, user) is None:
                raise NoUserError(f"User {user} not found.")
            row = s.get(GroupMember, (group, user))
            if member and row is None:
                s.add(GroupMember(group=group, user=user))
            elif not member and row is not None:
                _keep_an_admin(s, f"Removing user {user} from group {group}", without_member=(group, user))
                s.delete(row)
            uow.after_commit(self._users_changed)
        return self.get_group(group)

    def set_grant(self, group: str, virtual_cluster: str, granted: bool = True) -> dict:
        """Grant ``group`` the use of ``virtual_cluster`` (or take it back). Idempotent."""
        return self._set_group_row(group, GroupGrant(group=group, virtual_cluster=virtual_cluster), granted,
                                   "group grant")

    def set_storage_grant(self, group: str, config: str, granted: bool = True) -> dict:
        """Grant ``group`` the use of storage config ``config`` (or take it back; the caller checks
        the config exists). Idempotent. Raises NoGroupError."""
        return self._set_group_row(group, GroupStorageGrant(group=group, config=config), granted,
                                   "group storage grant")

    def _set_group_row(self, group: str, row: GroupGrant | GroupStorageGrant, present: bool, what: str) -> dict:
        """Make ``row`` (a grant of ``group``, keyed by its primary key) present or absent, in one unit
        of work; the group as :meth:`get_group` shows it. Raises NoGroupError."""
        with UnitOfWork(self._sessions, what) as uow:
            s = uow.s
            if s.get(Group, group) is None:
                raise NoGroupError(f"Group {group} not found.")
            mapper: Mapper = inspect(type(row))
            stored = s.get(type(row), mapper.primary_key_from_instance(row))
            if present and stored is None:
                s.add(row)
            elif not present and stored is not None:
                s.delete(stored)
            uow.after_commit(self._users_changed)
        return self.get_group(group)

    # ------------------------------------------------------------------ tokens
    def create_token(self, kind: Kind, subject: str, *, description: str = "",
                     expires_in_s: float | None = None) -> NewToken:
        """A new token for ``subject`` (a user, node or service name). ``expires_in_s`` None:
        never expires. Raises NotFoundError for an unknown user, ValidationError for an unknown
        service or a non-positive lifetime."""
        try:
            with UnitOfWork(self._sessions, "create token") as uow:
                new = self.add_token(uow, kind, subject, description=description, expires_in_s=expires_in_s)
        except ConflictError as e:  # 48-bit id collision: astronomically rare, still an error
            raise ConflictError("token id collision; try again") from e
        logger.info("token created id=%s kind=%s subject=%s", new.info["id"], kind, subject)
        return new

    def add_token(self, uow: UnitOfWork, kind: Kind, subject: str, *, description: str = "",
                  expires_in_s: float | None = None) -> NewToken:
        """:meth:`create_token` inside the caller's unit of work ``uow``: the token exists once
        ``uow`` commits, together with the caller's other writes, and not at all if it fails (a
        node's join spends its bootstrap token and gets its agent token in one commit). Raises as
        :meth:`create_token`; an id collision is the unit's ConflictError at its commit."""
        if expires_in_s is not None and expires_in_s <= 0:
            raise ValidationError("expiresInS", "must be positive (seconds)")
        if kind == "service" and subject not in SERVICES:
            raise ValidationError("subject", f"unknown service {subject!r}; one of {', '.join(SERVICES)}")
        if kind == "user" and uow.s.get(User, subject) is None:
            raise NoUserError(f"User {subject} not found.")
        minted = tokens.mint()
        now = self._clock()
        row = Token(id=minted.id, digest=minted.digest, kind=kind, subject=subject, description=description,
                    created=now, expires=None if expires_in_s is None else now + expires_in_s)
        uow.s.add(row)  # nothing to clear: the verified-token cache holds only tokens that exist
        return NewToken(minted.token, _token_info(row))

    def live_tokens(self, s: Session, kind: Kind, subject: str) -> list[str]:
        """Ids of ``subject``'s tokens of ``kind`` that still authenticate (neither revoked nor
        expired now), read in the caller's session ``s`` (a unit of work deciding on them)."""
        now = self._clock()
        q = select(Token.id).where(Token.kind == kind, Token.subject == subject, Token.revoked.is_(None),
                                   or_(Token.expires.is_(None), Token.expires > now))
        return sorted(s.scalars(q))

    def list_tokens(self, *, kind: Kind | None = None, subject: str | None = None) -> list[dict]:
        """Token metadata (never the secret), newest first."""
        with reading(self._sessions, "list tokens") as s:
            q = select(Token).order_by(Token.created.desc())
            if kind:
                q = q.where(Token.kind == kind)
            if subject:
                q = q.where(Token.subject == subject)
            return [_token_info(t) for t in s.scalars(q)]

    def token_info(self, token_id: str) -> dict:
        """One token's metadata as :meth:`list_tokens` shows it. Raises NoTokenError (404)."""
        with reading(self._sessions, "read token") as s:
            row = s.get(Token, token_id)
            if row is None:
                raise NoTokenError(f"Token {token_id} not found.")
            return _token_info(row)

    def revoke_token(self, token_id: str) -> dict:
        """Revoke a token (idempotent); it stops working at once in this process."""
        with UnitOfWork(self._sessions, "revoke token") as uow:
            row = uow.s.get(Token, token_id)
            if row is None:
                raise NoTokenError(f"Token {token_id} not found.")
            if row.revoked is None:
                row.revoked = self._clock()
            info = _token_info(row)
            uow.after_commit(lambda: self._token_revoked(token_id))
        logger.info("token revoked id=%s", token_id)
        return info

    def principal_or_none(self, token: str | None) -> Principal | None:
        """The principal ``token`` stands for now, or None (bootstrap keeps a token file that works)."""
        try:
            return self.authenticate(token)
        except UnauthorizedError:
            return None
