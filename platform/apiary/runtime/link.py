"""A node agent's link to the control plane: its replicas with failover, and the contact clock
that makes the agent fence itself before the control plane may declare its node lost.

Why self-fencing. The control plane declares a node lost when no report of its agent arrived for
``APIARY_NODE_LOST_AFTER_S`` (the grace; :meth:`apiary.control.node_service.NodeService.check_lost_nodes`)
and places the node's jobs again elsewhere. A node cut off by the network still runs them: without
more, one task instance would run on two nodes at once. So the agent counts the same grace from
its side and stops all its runs :func:`self_fence_margin_s` before the grace can end, the way a
Kubernetes node that lost its API server would need a watchdog to be safe (the kubelet has none;
Slurm's slurmd neither: a partitioned node's jobs run on, which is what this avoids).

Agreement without shared clocks. The control plane tells the agent its grace in every answer to a
report (the :data:`GRACE_HEADER` header), so both sides count the same number. Each side measures
with its own clock only: the control plane from the moment it handled the report, the agent from
the moment it *sent* the last report that was answered (a ``time.monotonic()`` reading). That send
precedes the handling, so the agent's deadline is never later than the control plane's, whatever
the hosts' wall clocks say: no wall-clock time is ever compared across hosts, and a node whose clock
is minutes off behaves the same. The only cross-host assumption is that the two hosts' clocks run
at the same *rate* within the margin (crystal drift is parts per million).

A control plane that restarts grants every node a fresh grace (the time of each node's last report
is memory only), so a restart only lengthens the control plane's side: the agent stays safe.

Persisted contact. The time of the last answered report is kept on disk (:class:`ContactClock`
``record``) with the host's boot id, so an agent restarted during a partition keeps counting from
its predecessor's last contact instead of from its own start (CLOCK_MONOTONIC is the host's, not
the process's: it survives the agent's restart but not a reboot, which the boot id detects; after a
reboot no task survives either).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from apiary.client import is_loopback_host, split_api_urls

logger = logging.getLogger(__name__)

#: Response header of the node-agent routes carrying the control plane's node-lost grace in
#: seconds (``APIARY_NODE_LOST_AFTER_S``), e.g. ``30``. A header rather than a body field so that
#: answers keep their documented schemas.
GRACE_HEADER = "Apiary-Node-Lost-After-S"
#: The grace an agent assumes until a control plane has told it its own (the setting's default).
DEFAULT_NODE_LOST_AFTER_S = 30.0
#: Smallest self-fence margin, seconds: room for the watchdog to wake up (it sleeps until the
#: deadline, so well under a second late on a loaded host), for :data:`FENCE_STOP_GRACE_S` of
#: SIGTERM, and for the backend's SIGKILL and reaping (``RuntimeBackend.stop`` blocks at most its
#: grace "plus about a second").
SELF_FENCE_MARGIN_MIN_S = 3.0
#: The margin's share of the grace for long graces: 20 % (6 s of the default 30 s), so a slow stop
#: on a busy node or a container runtime's slower kill still ends before the grace does.
SELF_FENCE_MARGIN_SHARE = 0.2
#: Below this many seconds between the last answered report and the fence (a grace under 6 s),
#: the agent warns: a report delayed a moment on a busy host stops every run.
MIN_FENCE_AFTER_S = 3.0
#: SIGTERM grace, seconds, of a self-fence stop: short, since the whole kill must end within the
#: margin (a task gets its usual 5 s only when the control plane stops it).
FENCE_STOP_GRACE_S = 1.0
#: Shortest and longest timeout of one exchange with the control plane, seconds (see
#: :meth:`ContactClock.exchange_timeout_s`).
EXCHANGE_TIMEOUT_MIN_S = 2.0
EXCHANGE_TIMEOUT_MAX_S = 30.0

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def self_fence_margin_s(grace_s: float) -> float:
    """How long before the control plane's node-lost grace ``grace_s`` (seconds) an agent out of
    contact stops its runs: ``max(SELF_FENCE_MARGIN_MIN_S, SELF_FENCE_MARGIN_SHARE * grace_s)``.

    The kill (SIGTERM, :data:`FENCE_STOP_GRACE_S`, SIGKILL, reaping) must be over before the
    control plane may place the runs elsewhere; the minimum covers that on a loaded host, the share
    keeps the slack proportional for long graces. 30 s -> 6 s; 8 s -> 3 s."""
    return max(SELF_FENCE_MARGIN_MIN_S, SELF_FENCE_MARGIN_SHARE * grace_s)


def all_loopback(urls: Sequence[str]) -> bool:
    """Whether every URL of ``urls`` names this machine's loopback (see
    :func:`apiary.client.is_loopback_host`)."""
    return all(is_loopback_host(urlsplit(u).hostname or "") for u in urls)


def _boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


class ContactClock:
    """When this agent last had an answered report, and whether it must fence itself now.

    All times are ``clock()`` readings (``time.monotonic`` by default: never the wall clock).
    ``grace_s``: the node-lost grace assumed until the control plane says otherwise
    (:meth:`answered`). ``record``: a JSON file (``{"bootId", "monotonic", "graceS"}``) the last
    contact is kept in, written at most every :attr:`RECORD_EVERY_S`; an older value is only more
    careful (the agent fences earlier after a restart). Without a record, or with one from another
    boot, counting starts now.
    """

    RECORD_EVERY_S = 1.0

    def __init__(self, grace_s: float = DEFAULT_NODE_LOST_AFTER_S, *, record: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.grace_s = grace_s
        self.record = record
        now = clock()
        self.last = now
        self._written = float("-inf")
        if record is not None:
            kept = self._read(record, now)
            if kept is not None:
                self.last, self.grace_s = kept

    def _read(self, record: Path, now: float) -> tuple[float, float] | None:
        try:
            data = json.loads(record.read_text())
            if data.get("bootId") != _boot_id() or not _boot_id():
                return None
            last, grace = float(data["monotonic"]), float(data["graceS"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            logger.warning("contact record %s unreadable, counting from now: %s", record, e)
            return None
        if not (last <= now and grace > 0):
            return None
        return last, grace

    def answered(self, sent_at: float, grace_s: float | None) -> None:
        """A report sent at ``sent_at`` (a ``clock()`` reading taken before sending) was answered;
        ``grace_s``: the grace the answer named (None: it named none). Never moves backwards."""
        if grace_s is not None and grace_s > 0 and grace_s != self.grace_s:
            self.grace_s = grace_s
            logger.info("node-lost grace is %.1f s: self-fencing after %.1f s without contact", grace_s,
                        self.fence_after_s())
            if self.fence_after_s() < MIN_FENCE_AFTER_S:
                logger.warning("a node-lost grace of %.1f s leaves %.1f s before self-fencing: reports delayed "
                               "a moment will stop every run; use APIARY_NODE_LOST_AFTER_S >= %.0f", grace_s,
                               self.fence_after_s(), MIN_FENCE_AFTER_S + SELF_FENCE_MARGIN_MIN_S)
        self.last = max(self.last, sent_at)
        if self.record is not None and self.last - self._written >= self.RECORD_EVERY_S:
            self._write(self.record)

    def _write(self, record: Path) -> None:
        tmp = record.with_name(record.name + ".tmp")
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"bootId": _boot_id(), "monotonic": self.last, "graceS": self.grace_s}))
            tmp.replace(record)
            self._written = self.last
        except OSError as e:  # only a restarted agent would miss it, and it then counts from its start
            logger.warning("contact record %s not written: %s", record, e)

    def fence_after_s(self) -> float:
        """Seconds without an answered report after which the agent fences itself: the grace less
        :func:`self_fence_margin_s`, at least 0."""
        return max(0.0, self.grace_s - self_fence_margin_s(self.grace_s))

    def silent_for(self) -> float:
        """Seconds since the last answered report was sent."""
        return self.clock() - self.last

    def must_fence(self) -> bool:
        """Whether the agent has been out of contact for :meth:`fence_after_s` or longer."""
        return self.silent_for() >= self.fence_after_s()

    def until_fence_s(self) -> float:
        """Seconds left before :meth:`must_fence` turns true (0 once it has)."""
        return max(0.0, self.fence_after_s() - self.silent_for())

    def exchange_timeout_s(self) -> float:
        """Timeout of one report or log upload, seconds: a quarter of :meth:`fence_after_s`,
        between :data:`EXCHANGE_TIMEOUT_MIN_S` and :data:`EXCHANGE_TIMEOUT_MAX_S`, so a replica
        that swallows packets costs the agent at most that before it tries the next one, and
        several replicas get their turn before the agent fences (6 s at the default 30 s grace)."""
        return min(EXCHANGE_TIMEOUT_MAX_S, max(EXCHANGE_TIMEOUT_MIN_S, self.fence_after_s() / 4))


class Replicas:
    """The control-plane replicas' URLs an agent talks to, in order, and the one it uses now.

    ``api_url``: one URL, several comma-separated (``APIARY_API_URL``), or a list of them. A
    transport error or a 502/503/504 on the current URL moves to the next one (:meth:`failed`);
    the agent keeps to a URL as long as it answers. Raises
    :class:`~apiary.errors.ValidationError` (field ``APIARY_API_URL``) for an empty list or a URL
    that is not ``http(s)://HOST[:PORT]``.
    """

    def __init__(self, api_url: str | Sequence[str]) -> None:
        text = api_url if isinstance(api_url, str) else ",".join(api_url)
        self.urls = split_api_urls(text)
        self._current = 0

    @property
    def current(self) -> str:
        """The URL used now (no trailing ``/``)."""
        return self.urls[self._current]

    def failed(self, url: str) -> None:
        """``url`` did not answer: move to the next replica, unless another call already moved
        away from ``url`` (two loops failing on the same replica move once)."""
        if len(self.urls) > 1 and url == self.current:
            self._current = (self._current + 1) % len(self.urls)
            logger.warning("control plane %s unreachable: trying %s", url, self.current)
