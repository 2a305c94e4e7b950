"""What the control plane's ``GET /healthz`` checks besides "the process serves".

* The store takes a write: a small write in a transaction that is rolled back (an ``UPDATE`` that
  matches no row still takes the write lock: a read-only SQLite file, a read-only PostgreSQL
  transaction or server fail it), and for SQLite a file of :data:`PROBE_BYTES` written and removed
  in the database's directory (a full disk fails it; SQLite's WAL grows there). Probed at most every
  :data:`STORE_PROBE_S` seconds.
* No node's agent says it cannot record its runs (``cannotRecord`` in its reports: its state
  directory is not writable or its disk is full; it launches nothing new meanwhile). A node silent
  for longer than the plane's lost-node grace no longer counts here (``apiary node list`` shows it
  lost).

Either problem makes ``/healthz`` answer 503 with the reasons. A full PostgreSQL disk is not probed
(the server refuses commits; a rolled-back write does not reach its disk).

Beside its health, ``/healthz`` says the replica's role (:class:`ReplicaRole`: ``role`` leader or
follower, ``leader`` the leader's URL, ``epoch`` the lease's epoch, ``replica`` this replica's
identity, ``fencedWrites`` how many of its commits the fence refused); the replica middleware
(:mod:`apiary.api.replica`) adds them to every answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy import text

from apiary.errors import UnavailableError
from apiary.procutil import write_probe
from apiary.store.unit import Sessions, reading

logger = logging.getLogger(__name__)

#: Seconds a store probe's answer is reused: ``/healthz`` may be polled often, by many.
STORE_PROBE_S = 5.0
#: Bytes the SQLite probe writes beside the database: a few pages of WAL, so a disk that cannot take
#: the next commit fails it.
PROBE_BYTES = 64 * 1024
#: The write probe: takes the store's write lock, changes nothing, and is rolled back.
_WRITE_PROBE = text("UPDATE nodes SET name = name WHERE 1 = 0")


def store_write_problem(sessions: Sessions) -> str | None:
    """Why the store behind ``sessions`` cannot take a write now, or None when it can (see the module
    docstring for the probes). Never raises."""
    try:
        with reading(sessions, "health probe") as s:  # rolled back: the probe changes nothing
            s.execute(_WRITE_PROBE)
            bind = s.get_bind()
    except UnavailableError as e:
        cause = e.__cause__
        orig = getattr(cause, "orig", None)
        return f"the store cannot write: {str(orig if orig is not None else cause or e).splitlines()[0]}"
    except Exception as e:  # a probe must answer, whatever breaks
        return f"the store cannot write: {type(e).__name__}: {e}"
    if bind.dialect.name != "sqlite":
        return None
    database = bind.engine.url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    directory = Path(database).absolute().parent
    problem = write_probe(directory, PROBE_BYTES, fsync=True)
    return None if problem is None else f"the store cannot write: {problem}"


class HealthCheck:
    """The control plane's health for ``/healthz``: :meth:`problems` is empty when it is healthy.
    ``sessions``: the store to probe; ``agent_problems``: ``"node N cannot record runs: why"`` for
    each node whose agent says so (the plane's ``recording_problems``). Thread-safe; the store
    probe's answer is reused for :data:`STORE_PROBE_S` seconds."""

    def __init__(self, sessions: Sessions, agent_problems: Callable[[], list[str]], *,
                 probe_s: float | None = None) -> None:
        self.sessions = sessions
        self.agent_problems = agent_problems
        self.probe_s = STORE_PROBE_S if probe_s is None else probe_s
        self._lock = threading.Lock()
        self._probed = float("-inf")
        self._store: str | None = None

    def problems(self) -> list[str]:
        """Every reason the control plane is unhealthy now (the store's first, then the agents')."""
        with self._lock:
            now = time.monotonic()
            if now - self._probed >= self.probe_s:
                problem = store_write_problem(self.sessions)
                if problem != self._store:
                    (logger.error if problem else logger.warning)(
                        "healthz: %s", problem or "the store takes writes again")
                self._store, self._probed = problem, now
            store = self._store
        return ([store] if store else []) + self.agent_problems()


@dataclass(frozen=True, slots=True)
class ReplicaRole:
    """A control-plane replica's place among the replicas, as ``/healthz`` answers it.

    ``role``: ``leader`` (it holds the lease and its leader-only work runs: it serves every request)
    or ``follower`` (it serves reads from the store and forwards the rest to ``leader_url``);
    ``leader_url``: the leader's advertised URL, "" while no leader is known (an empty or expired
    lease, or this replica took the lease and is still rebuilding its memory); ``epoch``: the lease's
    epoch as last read (None before the first read; 0 for the one SQLite replica); ``replica``: this
    replica's identity in the lease; ``fenced_writes``: commits of this process the fence refused.
    """

    role: Literal["leader", "follower"]
    leader_url: str
    epoch: int | None
    replica: str
    fenced_writes: int = 0

    @property
    def leading(self) -> bool:
        return self.role == "leader"

    def fields(self) -> dict:
        """``{"role", "leader", "epoch", "replica", "fencedWrites"}`` for ``/healthz``'s body."""
        return {"role": self.role, "leader": self.leader_url, "epoch": self.epoch, "replica": self.replica,
                "fencedWrites": self.fenced_writes}
