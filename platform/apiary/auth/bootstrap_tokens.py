"""Bootstrap tokens: how a node joins the cluster (Kubernetes' bootstrap tokens, ``kubeadm join``).

An admin creates a short-lived token ``<id>.<secret>`` (:data:`TOKEN_FORMAT`, Kubernetes' format:
6 + 16 characters of ``[a-z0-9]``; https://kubernetes.io/docs/reference/access-authn-authz/bootstrap-tokens/);
the store keeps the id and a SHA-256 digest of the secret only. A new node presents it once
(``POST /api/v2/nodes/{node}/join``) and gets its own agent credential (a :class:`~apiary.store.models.Token`
of kind ``agent`` whose subject is the node), which it keeps from then on; the bootstrap token is
then spent. The token authenticates nothing else: it is no principal of any other route.

:meth:`BootstrapTokens.spend` decides a join in one unit of work: the token must exist with that
secret, be neither revoked nor used nor expired, the node must be in the cluster config, be the
token's node when the token names one, and not have joined already (no live agent token for it: a
node cannot take over another node's name; an admin revokes the node's credential first to join
it again). It marks the token used and adds the agent token in the same commit. Two joins with
one token: the conditional ``UPDATE ... WHERE used IS NULL`` lets exactly one of them through
(PostgreSQL re-checks the condition on the row the other one committed; SQLite has one writer).
Two joins of one node with two tokens at once: on PostgreSQL a transaction-level advisory lock on
the node's name orders them (https://www.postgresql.org/docs/current/explicit-locking.html#ADVISORY-LOCKS),
and the second sees the first one's agent token; in one process a lock does the same.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import string
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from apiary.auth.directory import Directory
from apiary.auth.tokens import digest
from apiary.errors import ConflictError, NotFoundError, UnauthorizedError, ValidationError
from apiary.store.models import BootstrapToken
from apiary.store.unit import Sessions, UnitOfWork, reading
from apiary.timefmt import iso

logger = logging.getLogger(__name__)

#: Kubernetes' bootstrap token format: ``<token-id>.<token-secret>``.
TOKEN_FORMAT = r"[a-z0-9]{6}\.[a-z0-9]{16}"
_TOKEN = re.compile(r"^(?P<id>[a-z0-9]{6})\.(?P<secret>[a-z0-9]{16})$")
_ALPHABET = string.ascii_lowercase + string.digits
#: A token lasts one hour unless asked otherwise, and one day at most (kubeadm's default ``--ttl``
#: is 24 h; a join needs minutes, so less lies around).
DEFAULT_TTL_S = 3600.0
MAX_TTL_S = 86400.0
MAX_DESCRIPTION = 1000
#: What an unknown token id is compared against, so that it costs what a wrong secret costs.
_NO_DIGEST = digest("0" * 16)


class BootstrapTokenError(UnauthorizedError):
    """A join refused for its bootstrap token: malformed, unknown or wrong, revoked, used,
    expired, or for another node. HTTP 401; the message says which."""

    code = "BootstrapTokenError"


class NoBootstrapTokenError(NotFoundError):
    """No bootstrap token with that id. HTTP 404."""

    code = "NoBootstrapTokenError"


class NoNodeError(NotFoundError):
    """The cluster config has no node of that name. HTTP 404."""

    code = "NoNodeError"


class NodeJoinedError(ConflictError):
    """The node has joined already: an agent credential of it is live. HTTP 409."""

    code = "NodeJoinedError"


@dataclass(frozen=True)
class Minted:
    """A new bootstrap token: ``token`` (``id.secret``) is the only copy of the secret."""

    id: str
    token: str
    digest: str


def mint() -> Minted:
    """A fresh random token in :data:`TOKEN_FORMAT` (``secrets``: 6 + 16 characters of 36)."""
    token_id = "".join(secrets.choice(_ALPHABET) for _ in range(6))
    secret = "".join(secrets.choice(_ALPHABET) for _ in range(16))
    return Minted(token_id, f"{token_id}.{secret}", digest(secret))


def split(token: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a well-formed token, None for anything else (never raises)."""
    m = _TOKEN.match(token.strip()) if isinstance(token, str) else None
    return (m["id"], m["secret"]) if m else None


def parse(token: str | None) -> tuple[str, str]:
    """``(id, secret)`` of a bootstrap token as a request carries it; raises
    :class:`BootstrapTokenError` (401) when it is missing or not ``<id>.<secret>``."""
    if not token:
        raise BootstrapTokenError("Missing bootstrap token: send 'Authorization: Bearer <id>.<secret>'.")
    parts = split(token)
    if parts is None:
        raise BootstrapTokenError("Malformed bootstrap token: expected <id>.<secret>, 6 and 16 characters of "
                                  "[a-z0-9], as `apiary node bootstrap-token create` prints it.")
    return parts


def state(row: BootstrapToken, now: float) -> str:
    """``revoked``, ``used``, ``expired`` or ``valid`` (in that order of precedence)."""
    if row.revoked is not None:
        return "revoked"
    if row.used is not None:
        return "used"
    return "expired" if row.expires <= now else "valid"


def info(row: BootstrapToken, now: float) -> dict:
    """What an admin sees of a token (never its secret): ``{"id", "node", "description",
    "createdBy", "created", "expires", "used", "usedBy", "revoked", "state"}``; times in unix seconds."""
    return {"id": row.id, "node": row.node, "description": row.description, "createdBy": row.created_by,
            "created": row.created, "expires": row.expires, "used": row.used, "usedBy": row.used_by,
            "revoked": row.revoked, "state": state(row, now)}


class BootstrapTokens:
    """Bootstrap tokens over ``sessions``; ``directory`` issues the joined nodes' agent tokens.
    ``clock``: unix seconds (tests pass a fake one). Thread-safe."""

    def __init__(self, sessions: Sessions, directory: Directory, *,
                 clock: Callable[[], float] = time.time) -> None:
        self._sessions = sessions
        self._directory = directory
        self._clock = clock
        self._joins = threading.Lock()  # one join at a time in this process (SQLite has no advisory lock)

    def create(self, ttl_s: float = DEFAULT_TTL_S, node: str | None = None, description: str = "",
               by: str = "", known_nodes: Collection[str] | None = None) -> tuple[str, dict]:
        """A new token valid ``ttl_s`` seconds (0 < ttl_s <= :data:`MAX_TTL_S`), for node ``node``
        only when given (which must be in ``known_nodes`` when that is given), created by ``by``.
        Returns ``(token, info)``: the token is shown once. Raises ValidationError naming
        ``ttlSeconds`` or ``description``, NoNodeError."""
        if not ttl_s > 0 or ttl_s > MAX_TTL_S:
            raise ValidationError("ttlSeconds", f"must be more than 0 and at most {MAX_TTL_S:.0f} seconds (24 h); "
                                                f"got {ttl_s}")
        if len(description) > MAX_DESCRIPTION:
            raise ValidationError("description", f"at most {MAX_DESCRIPTION} characters")
        if node is not None and known_nodes is not None and node not in known_nodes:
            raise NoNodeError(f"Node {node} is not in the cluster config.")
        minted = mint()
        now = self._clock()
        try:
            with UnitOfWork(self._sessions, "create bootstrap token") as uow:
                row = BootstrapToken(id=minted.id, digest=minted.digest, node=node, description=description,
                                     created_by=by, created=now, expires=now + ttl_s)
                uow.s.add(row)
                shown = info(row, now)
        except ConflictError as e:  # a clash of 6-character ids: rare, and an error all the same
            raise ConflictError("bootstrap token id collision; try again") from e
        logger.info("bootstrap token created id=%s node=%s ttl_s=%s by=%s", minted.id, node, ttl_s, by)
        return minted.token, shown

    def list(self) -> list[dict]:
        """Every token's :func:`info`, newest first (used and revoked ones stay, for the audit trail)."""
        now = self._clock()
        with reading(self._sessions, "list bootstrap tokens") as s:
            return [info(r, now) for r in s.scalars(select(BootstrapToken).order_by(BootstrapToken.created.desc()))]

    def revoke(self, token_id: str) -> dict:
        """Revoke token ``token_id`` (idempotent); returns its :func:`info`. Raises NoBootstrapTokenError."""
        now = self._clock()
        with UnitOfWork(self._sessions, "revoke bootstrap token") as uow:
            row = uow.s.get(BootstrapToken, token_id)
            if row is None:
                raise NoBootstrapTokenError(f"Bootstrap token {token_id} not found.")
            if row.revoked is None:
                row.revoked = now
            shown = info(row, now)
        logger.info("bootstrap token revoked id=%s", token_id)
        return shown

    def spend(self, token: str | None, node: str, known_nodes: Collection[str],
              approve: Callable[[], None] | None = None) -> str:
        """Join ``node`` with bootstrap token ``token``: returns the node's new agent token.

        Checks, in order (module doc): the token is well formed (BootstrapTokenError), exists
        with that secret (one message for an unknown id and a wrong secret), is not revoked, not
        used (the message names the node that used it and when), not expired; ``node`` is in
        ``known_nodes`` (NoNodeError, 404); the token names no other node (BootstrapTokenError);
        ``node`` has no live agent token (NodeJoinedError, 409). Then ``approve()`` (if given) runs
        and may refuse by raising (a join's certificate signing request naming another node: the
        refusal leaves the token unspent). Only then, in the same commit, the token is marked used
        by ``node`` and the agent token added. A refusal changes nothing.
        """
        token_id, secret = parse(token)
        now = self._clock()
        with self._joins, UnitOfWork(self._sessions, "join node") as uow:
            s = uow.s
            row = s.get(BootstrapToken, token_id)
            right = hmac.compare_digest(digest(secret), row.digest if row is not None else _NO_DIGEST)
            if row is None or not right:
                raise BootstrapTokenError(f"Invalid bootstrap token {token_id}: no such token, or a wrong secret.")
            self._check(row, node, known_nodes, now)
            _lock_node(s, node)
            live = self._directory.live_tokens(s, "agent", node)
            if live:
                raise NodeJoinedError(
                    f"Node {node} has joined already: its agent credential {live[0]} is live. A node cannot join "
                    f"under a name in use; to join it again, an admin revokes that credential first "
                    f"(apiary token revoke {live[0]}).")
            if approve is not None:
                approve()
            claimed = s.execute(update(BootstrapToken)
                                .where(BootstrapToken.id == token_id, BootstrapToken.used.is_(None),
                                       BootstrapToken.revoked.is_(None))
                                .values(used=now, used_by=node))
            if claimed.rowcount != 1:  # type: ignore[attr-defined]  # another join spent it after our read
                row = s.get(BootstrapToken, token_id, populate_existing=True)
                if row is not None:  # (rows are never deleted) the refusal naming who spent it
                    self._check(row, node, known_nodes, now)
                raise BootstrapTokenError(f"Bootstrap token {token_id} was already used.")
            new = self._directory.add_token(uow, "agent", node,
                                            description=f"node agent of {node}, joined with bootstrap token {token_id}")
        logger.info("node joined node=%s bootstrap_token=%s agent_token=%s", node, token_id, new.info["id"])
        return new.token

    @staticmethod
    def _check(row: BootstrapToken, node: str, known_nodes: Collection[str], now: float) -> None:
        """Raise the refusal for spending ``row`` as ``node`` at ``now``, if any (see :meth:`spend`)."""
        if row.revoked is not None:
            raise BootstrapTokenError(f"Bootstrap token {row.id} was revoked (at {iso(row.revoked)}).")
        if row.used is not None:
            raise BootstrapTokenError(f"Bootstrap token {row.id} was already used (by node {row.used_by} at "
                                      f"{iso(row.used)}); a bootstrap token joins one node once.")
        if row.expires <= now:
            raise BootstrapTokenError(f"Bootstrap token {row.id} has expired (at {iso(row.expires)}); create a new "
                                      f"one (apiary node bootstrap-token create).")
        if node not in known_nodes:
            raise NoNodeError(f"Node {node} is not in the cluster config.")
        if row.node is not None and row.node != node:
            raise BootstrapTokenError(f"Bootstrap token {row.id} is for node {row.node}, not {node}.")


def _lock_node(s: Session, node: str) -> None:
    """On PostgreSQL, hold a transaction-level advisory lock on ``node``'s joins until the commit,
    so a second join of the node (another replica, another token) waits and then sees this one's
    agent token. SQLite has one writer at a time and no such lock."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": f"apiary.join:{node}"})
