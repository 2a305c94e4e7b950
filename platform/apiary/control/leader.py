"""Leader election among control-plane replicas, on a lease row in PostgreSQL.

Kubernetes' leader election (client-go ``tools/leaderelection``) over a row of ``leases`` instead
of a ``coordination.k8s.io/v1`` Lease. Every ``retry_period_s`` each replica runs one short
transaction on the row named ``control-plane`` (created empty if missing)::

    SELECT extract(epoch from clock_timestamp())            -- now, by the STORE's clock
    SELECT ... FROM leases WHERE name = 'control-plane' FOR UPDATE

* the row names this replica at the epoch it leads under: renew (``renewed = now``);
* the row is empty, or ``now - renewed > duration_s``: take over (``holder`` = this replica,
  ``holder_url`` = its advertised URL, ``epoch += 1``, ``acquired = renewed = now``); a row that
  names this replica's identity but not an epoch it leads under (a restarted process with a fixed
  ``replica_id``) is taken over at once, with a new epoch, so the two incarnations never share one;
* otherwise it follows and remembers who leads (:attr:`LeaderElector.observed`; followers forward
  writes to ``holder_url``).

Times compared with the lease's are the store's own clock, so hosts' clocks never matter. The
leader measures its renew deadline with :func:`time.monotonic`: when no renew succeeded for
``renew_deadline_s`` (or a renew finds another holder) it steps down. Stepping down does what
kube-controller-manager and kube-scheduler do when they lose their lease (``OnStoppedLeading``:
``klog.Fatalf``): the process exits with a non-zero code and its supervisor starts it again as a
follower, so no half-leader is left with stale memory. The epoch is also the fencing token every
write of the leader checks (:mod:`apiary.store.fencing`): a leader paused past its lease cannot
commit even before it notices.

The parameters are client-go's: ``lease_duration_s`` (``LeaseDuration``, 15 s in client-go, 6 s
here), ``renew_deadline_s`` (``RenewDeadline``, shorter than the duration) and ``retry_period_s``
(``RetryPeriod``, shorter than the deadline). A killed leader is replaced within about
``lease_duration_s + retry_period_s``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select, text
from sqlalchemy.dialects.postgresql import insert

from apiary.errors import ValidationError
from apiary.store.fencing import CONTROL_PLANE_LEASE
from apiary.store.models import Lease
from apiary.store.unit import Sessions, UnitOfWork

logger = logging.getLogger(__name__)

#: Exit code of a replica that stepped down (its supervisor starts it again as a follower).
STEPPED_DOWN_EXIT = 3

_NOW = text("SELECT extract(epoch from clock_timestamp())")


def default_identity(home: Path) -> str:
    """``<hostname>:<home>``: one replica per home and host, the same across its restarts, so a
    restarted replica takes its own lease back at once (with a new epoch: the previous incarnation,
    should it still run, is fenced) instead of waiting ``lease_duration_s`` for it to expire, as a
    single replica on PostgreSQL restarted by ``apiary up``'s supervisor would. Two replicas must
    not share a home on one host (``apiary up`` locks its home)."""
    return f"{socket.gethostname()}:{home.expanduser().resolve()}"


@dataclass(frozen=True, slots=True)
class Observed:
    """The lease as this replica last read it: ``holder`` ("" when empty), its ``holder_url``,
    ``epoch``, whether it had ``expired`` then (by the store's clock), and ``at`` (this process's
    :func:`time.monotonic` when it was read)."""

    holder: str
    holder_url: str
    epoch: int
    expired: bool
    at: float


def check_timings(lease_duration_s: float, renew_deadline_s: float, retry_period_s: float) -> None:
    """client-go's checks (``NewLeaderElector``): the duration exceeds the renew deadline, which
    exceeds the retry period. Raises ValidationError naming the setting."""
    if not lease_duration_s > renew_deadline_s:
        raise ValidationError("APIARY_RENEW_DEADLINE_S", f"must be shorter than APIARY_LEASE_DURATION_S "
                                                         f"({renew_deadline_s} >= {lease_duration_s})")
    if not renew_deadline_s > retry_period_s:
        raise ValidationError("APIARY_RETRY_PERIOD_S", f"must be shorter than APIARY_RENEW_DEADLINE_S "
                                                       f"({retry_period_s} >= {renew_deadline_s})")


class LeaderElector:
    """One replica's side of the election; see the module docstring.

    ``sessions``: a session factory of the store that is NOT fenced (the election's own commits
    must not need the lease they change). ``identity``: this replica in the lease; ``url``: its
    advertised API URL. ``on_started_leading(epoch)`` runs in a thread of its own once the lease is
    taken (start the leader-only work there); ``on_stopped_leading(why)`` runs once when the replica
    steps down, then ``exit(STEPPED_DOWN_EXIT)`` (default :func:`os._exit`; tests inject it).
    ``monotonic`` is the deadline clock (tests inject it). Thread-safe.
    """

    def __init__(self, sessions: Sessions, *, identity: str, url: str, lease_duration_s: float = 6.0,
                 renew_deadline_s: float = 4.0, retry_period_s: float = 1.0, name: str = CONTROL_PLANE_LEASE,
                 on_started_leading: Callable[[int], None] = lambda epoch: None,
                 on_stopped_leading: Callable[[str], None] = lambda why: None,
                 exit: Callable[[int], None] = os._exit, monotonic: Callable[[], float] = time.monotonic) -> None:
        check_timings(lease_duration_s, renew_deadline_s, retry_period_s)
        self.sessions = sessions
        self.identity = identity
        self.url = url
        self.name = name
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self.on_started_leading = on_started_leading
        self.on_stopped_leading = on_stopped_leading
        self.exit = exit
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._epoch: int | None = None  # the epoch this replica leads under; None: it does not lead
        self._renewed_at = 0.0  # monotonic time of the last successful acquire or renew
        self._observed: Observed | None = None
        self._stepped_down = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ state
    @property
    def epoch(self) -> int | None:
        """The epoch this replica leads under, or None while it does not lead (the fence's getter)."""
        with self._lock:
            return self._epoch

    @property
    def leading(self) -> bool:
        with self._lock:
            return self._epoch is not None

    @property
    def stepped_down(self) -> bool:
        with self._lock:
            return self._stepped_down

    @property
    def observed(self) -> Observed | None:
        """The lease as last read (None before the first read)."""
        with self._lock:
            return self._observed

    # ------------------------------------------------------------------ one round
    def try_acquire_or_renew(self) -> bool:
        """One transaction on the lease (module docstring); True when this replica leads after it.
        Raises the store's errors (ConflictError / UnavailableError) when the transaction fails."""
        with self._lock:
            mine = self._epoch
            if self._stepped_down:
                return False
        with UnitOfWork(self.sessions, "leader election") as uow:
            s = uow.s
            # A lock wait or a slow server must not hold the round past the renew deadline.
            s.execute(text(f"SET LOCAL statement_timeout = {max(1, int(self.renew_deadline_s * 1000))}"))
            s.execute(insert(Lease).values(name=self.name, holder="", holder_url="", epoch=0, acquired=0.0,
                                           renewed=0.0, duration_s=self.lease_duration_s)
                      .on_conflict_do_nothing(index_elements=["name"]))
            now = float(s.execute(_NOW).scalar_one())
            row = s.execute(select(Lease).where(Lease.name == self.name).with_for_update()).scalar_one()
            acquired: bool | None
            expired = not row.holder or now - row.renewed > row.duration_s
            if mine is not None and row.holder == self.identity and row.epoch == mine:
                row.renewed = now
                row.duration_s = self.lease_duration_s
                row.holder_url = self.url
                acquired = False
            elif mine is None and (expired or row.holder == self.identity):
                row.holder, row.holder_url = self.identity, self.url
                row.epoch += 1
                row.acquired = row.renewed = now
                row.duration_s = self.lease_duration_s
                acquired = True
            else:  # another replica holds it (and, if this one led, it lost the lease)
                observed = Observed(row.holder, row.holder_url, row.epoch, expired, self.monotonic())
                acquired = None
            epoch = row.epoch
        if acquired is None:
            with self._lock:
                self._observed = observed
            if mine is not None:
                self._step_down(f"the lease names {observed.holder or 'nobody'} at epoch {observed.epoch}, "
                                f"not this replica at epoch {mine}")
            return False
        observed = Observed(self.identity, self.url, epoch, False, self.monotonic())
        # committed: this replica holds the lease at ``epoch`` until renewed + duration by the store's clock
        with self._lock:
            self._observed = observed
            self._renewed_at = observed.at
            if acquired:
                self._epoch = epoch
        if acquired:
            logger.info("leader election: %s leads at epoch %d (lease %s)", self.identity, epoch, self.name)
            threading.Thread(target=self._started, args=(epoch,), name="started-leading", daemon=True).start()
        return True

    def _started(self, epoch: int) -> None:
        try:
            self.on_started_leading(epoch)
        except Exception as e:  # a leader that cannot start its work must not keep the lease
            logger.exception("on_started_leading failed")
            self.step_down(f"starting the leader's work failed: {e}")

    def check_deadline(self) -> bool:
        """Step down when leading and no renew succeeded for ``renew_deadline_s`` (monotonic);
        True when it stepped down now."""
        with self._lock:
            late = self._epoch is not None and self.monotonic() - self._renewed_at > self.renew_deadline_s
            since = self.monotonic() - self._renewed_at
        if late:
            self._step_down(f"no renew succeeded for {since:.1f} s (renew deadline {self.renew_deadline_s} s)")
        return late

    # ------------------------------------------------------------------ stepping down
    def step_down(self, why: str) -> None:
        """Stop leading for ``why`` (a refused write, a failed start): the callbacks, then exit. A
        replica that does not lead has nothing to step down from (its refused write is only refused)."""
        if self.leading:
            self._step_down(why)

    def _step_down(self, why: str) -> None:
        with self._lock:
            if self._stepped_down:
                return
            self._stepped_down = True
            was = self._epoch
            self._epoch = None  # from here every write of this process is refused by the fence
        self._stop.set()
        logger.error("leader election: %s steps down (it led at epoch %s): %s; exiting with code %d so its "
                     "supervisor restarts it as a follower", self.identity, was, why, STEPPED_DOWN_EXIT)
        try:
            self.on_stopped_leading(why)
        except Exception:
            logger.exception("on_stopped_leading failed")
        self.exit(STEPPED_DOWN_EXIT)

    # ------------------------------------------------------------------ threads
    def start(self) -> None:
        """Start the election thread and the deadline watchdog (daemon threads)."""
        self._threads = [threading.Thread(target=self._run, name="leader-election", daemon=True),
                         threading.Thread(target=self._watch, name="leader-deadline", daemon=True)]
        for t in self._threads:
            t.start()

    def stop(self, join_s: float = 5.0) -> None:
        """Stop trying (the lease is left to expire; it is not released)."""
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(join_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.try_acquire_or_renew()
            except Exception as e:  # the store is unreachable: the deadline decides
                logger.warning("leader election: acquiring or renewing the lease failed: %s", e)
            if self._stop.is_set():
                break
            self.check_deadline()
            self._stop.wait(self.retry_period_s)

    def _watch(self) -> None:
        # A round that hangs (a server that stopped answering) must not keep a leader past its deadline.
        while not self._stop.wait(self.retry_period_s / 2):
            self.check_deadline()
