"""Fencing by epoch: a deposed leader cannot commit.

Leader election (:mod:`apiary.control.leader`) keeps one row of ``leases`` per elected role; every
change of holder raises its ``epoch`` by one. :func:`install_fence` makes every session of a
session factory check, inside the transaction it is about to commit, that the lease still names
this replica at the epoch it leads under::

    SELECT epoch, holder FROM leases WHERE name = :name FOR SHARE

and refuse the commit (:class:`NotLeaderError`, HTTP 503, naming the current holder) when it does
not. ``FOR SHARE`` takes a row lock that conflicts with the ``UPDATE`` of a takeover (PostgreSQL
docs, "Explicit Locking", row-level lock modes), so a takeover waits for the writes in flight: each
write either commits before the new epoch exists or sees the new epoch and is refused. This is the
fencing token of Kleppmann's "How to do distributed locking" carried by the store itself, so a
leader that wakes from a pause (SIGSTOP, a VM stall, a long GC) after its lease expired writes
nothing.

Sessions that only read never commit (:func:`apiary.store.unit.reading`) and are not checked. The
refusal is raised from SQLAlchemy's ``before_commit`` hook, so
:meth:`apiary.store.unit.UnitOfWork.commit` rolls the session back, runs no after-commit callback
(nothing reaches memory) and lets the :class:`NotLeaderError` (an
:class:`~apiary.errors.UnavailableError`) through to the API, which answers 503.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, event, text
from sqlalchemy.orm import Session

from apiary.errors import UnavailableError
from apiary.store.unit import Sessions

logger = logging.getLogger(__name__)

#: The control plane's lease (one leader among the control-plane replicas).
CONTROL_PLANE_LEASE = "control-plane"

_CHECK = text("SELECT epoch, holder FROM leases WHERE name = :name FOR SHARE")


class NotLeaderError(UnavailableError):
    """This replica is not (or no longer) the leader: its write was refused. HTTP 503; the message
    names the lease's current holder, so a client retries against it (or through any replica)."""

    code = "NotLeaderError"


class Fence:
    """The check :func:`install_fence` attaches; see the module docstring.

    ``name``: the lease's name; ``holder``: this replica's identity in it; ``epoch``: returns the
    epoch this replica leads under, or None while it does not lead (then every commit is refused);
    ``on_refused``: called with the reason after a refusal (the elector steps down), outside any
    lock, from the committing thread. :attr:`refused` counts refused commits (thread-safe).
    """

    def __init__(self, name: str, holder: str, epoch: Callable[[], int | None],
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.holder = holder
        self.epoch = epoch
        self.on_refused = on_refused
        self._lock = threading.Lock()
        self._refused = 0

    @property
    def refused(self) -> int:
        """How many commits this fence refused since the process started."""
        with self._lock:
            return self._refused

    def check(self, session: Session) -> None:
        """Raise :class:`NotLeaderError` unless the lease names this replica at its epoch (run in
        the transaction about to commit; the row stays share-locked until it ends)."""
        # Every pending write first, so the share lock is held only from here to the COMMIT (a
        # session's last flush otherwise runs after this hook).
        session.flush()
        mine = self.epoch()
        row = session.execute(_CHECK, {"name": self.name}).first()
        if mine is not None and row is not None and row.epoch == mine and row.holder == self.holder:
            return
        if row is None:
            why = f"the lease {self.name!r} does not exist"
        elif mine is None:
            why = f"this replica ({self.holder}) does not lead; the lease names {row.holder or 'nobody'} " \
                  f"at epoch {row.epoch}"
        else:
            why = f"this replica ({self.holder}) led at epoch {mine}; the lease now names " \
                  f"{row.holder or 'nobody'} at epoch {row.epoch}"
        with self._lock:
            self._refused += 1
        logger.error("fenced write refused: %s", why)
        if self.on_refused is not None:
            try:
                self.on_refused(why)
            except Exception:  # the refusal must reach the caller whatever the listener does
                logger.exception("fence: on_refused failed")
        raise NotLeaderError(f"Not the leader, write refused: {why}; retry (any replica forwards to the leader).")


def install_fence(sessions: Sessions, name: str, holder: str, epoch: Callable[[], int | None], *,
                  on_refused: Callable[[str], None] | None = None) -> Fence:
    """Check the lease ``name`` in every transaction a session of ``sessions`` commits (see the
    module docstring); returns the :class:`Fence` (its :attr:`Fence.refused` count). PostgreSQL
    only: SQLite has no ``FOR SHARE`` and runs one replica."""
    fence = Fence(name, holder, epoch, on_refused)
    event.listen(sessions, "before_commit", fence.check)
    return fence


def bound_idle_transactions(engine: Engine, seconds: float) -> None:
    """End every session of ``engine`` (PostgreSQL) that stays idle inside a transaction for longer
    than ``seconds`` (``idle_in_transaction_session_timeout``, PostgreSQL docs, "Client Connection
    Defaults"): a replica paused in the middle of a transaction (SIGSTOP, a VM stall) would otherwise
    hold its row locks, and with them a takeover of the lease or the new leader's writes, until it
    wakes. Call before the engine's first connection (it applies to connections made afterwards)."""
    ms = max(1, int(seconds * 1000))

    @event.listens_for(engine, "connect")
    def _bound(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"SET idle_in_transaction_session_timeout = {ms}")
        finally:
            cursor.close()
        dbapi_connection.commit()


def remove_fence(sessions: Sessions, fence: Fence) -> None:
    """Detach ``fence`` from ``sessions`` (tests)."""
    event.remove(sessions, "before_commit", fence.check)
