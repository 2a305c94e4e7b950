"""When a node agent's next bare heartbeat is due, and how long it waits after a failed report.

A fleet whose agents beat in step sends its heartbeats in bursts: at 5,000 hollow nodes (bench/cluster.py
--keep) every 10 s brought 3-4 s of 900-1,400 heartbeats a second and 5 s of under 200, and the
bursts queued at the control plane while the quiet seconds left it idle. Agents get in step by
going through the same storm: a control plane swamped at start (or restarting) answers its
backlog at once, and agents that retry on a fixed delay retry together. :class:`HeartbeatTimer`
keeps them apart:

* every period is stretched by up to :data:`HEARTBEAT_JITTER`, drawn anew (the kubelet's node
  status loop: ``wait.JitterUntil`` with jitter factor 0.04);
* a failed report is retried after a wait drawn evenly between :data:`REPORT_RETRY_MIN_S` and a
  cap that doubles per failure in a row, up to one period ("full jitter" backoff: AWS
  Architecture Blog, "Exponential Backoff And Jitter", 2015);
* the first report answered, the first after failures and one answered a period or more after it
  was sent start a period of random length (:data:`RECOVERY_PERIOD_MIN` to 1 of a period; a late
  one counted from its answer, else the next heartbeat would be due at once, for every agent the
  same backlog answered). A shorter period is always safe for the self-fence; a late answer of a
  self-fencing agent leaves at most a third of the time before its fence;
* a slow answer (:data:`SLOW_ANSWER` of a period or more, less than a period) starts a period drawn
  from :data:`SLOW_PERIOD_MIN` to 1 of a period, counted from the answer, shortened like a late
  one's for a self-fencing agent: reports sent in step while the control plane was behind stay in
  step otherwise. At 5,000 hollow nodes (bench/cluster.py --keep, 2026-11-29) about 800 nodes that
  had gone through the start-up storm still beat within the same second every 10 s a minute later,
  and those seconds held the slowest heartbeats of the job stream (per-second p99 490-830 ms in
  those seconds, under 230 ms in most others). Counted from the send instead, a period shorter
  than the wait for the answer fell due at once, for every agent of the backlog together, and its
  quick answer put them back in step. The draw is not from :data:`RECOVERY_PERIOD_MIN`: while
  every answer is slow it shortens the mean period by a quarter, not by nearly half.

Monotonic seconds throughout; pure (the caller passes the times and the base period).
"""

from __future__ import annotations

import random

#: Each bare heartbeat comes up to this fraction of the period late, drawn anew each time.
HEARTBEAT_JITTER = 0.04
#: The shortest wait before retrying a failed report, seconds (the cap starts at twice this).
REPORT_RETRY_MIN_S = 0.5
#: The shortest period after a report answered at start, after failures or late, as a fraction of
#: the period (drawn from this to 1).
RECOVERY_PERIOD_MIN = 0.1
#: An answer this fraction of a period or more after its send counts as slow.
SLOW_ANSWER = 0.1
#: The shortest period after a slow answer, as a fraction of the period (drawn from this to 1).
SLOW_PERIOD_MIN = 0.5


class HeartbeatTimer:
    """One agent's heartbeat schedule. ``last``: when the period running now started (monotonic s;
    0.0 before the first answer); ``stretch``: its length as a multiple of the base period;
    ``failures``: reports that failed in a row. ``rng`` draws the random parts."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.last = 0.0
        self.stretch = 1.0
        self.failures = 0
        self._rng = rng or random.Random()

    def period_s(self, base_s: float) -> float:
        """The period running now, seconds: ``base_s`` stretched."""
        return base_s * self.stretch

    def answered(self, sent: float, answered: float, base_s: float, fence_left_s: float | None = None) -> None:
        """A report sent at ``sent`` was answered at ``answered``: start the next period (module
        doc). ``fence_left_s``: a self-fencing agent's time before its fence after this answer
        (None: not fencing)."""
        waited = answered - sent
        late, slow = waited >= base_s, waited >= SLOW_ANSWER * base_s
        if self.failures > 0 or self.last == 0.0 or slow:
            low = RECOVERY_PERIOD_MIN if self.failures > 0 or self.last == 0.0 or late else SLOW_PERIOD_MIN
            self.stretch = self._rng.uniform(low, 1.0)
            if slow and fence_left_s is not None and base_s > 0:
                self.stretch = min(self.stretch, max(0.0, fence_left_s) / 3 / base_s)
            self.last = answered if slow else sent
        else:
            self.stretch = 1.0 + self._rng.uniform(0.0, HEARTBEAT_JITTER)
            self.last = sent
        self.failures = 0

    def retry_s(self, base_s: float) -> float:
        """Seconds to wait before trying again after a report failed (counts the failure): drawn
        evenly from [:data:`REPORT_RETRY_MIN_S`, cap], the cap doubling per failure in a row from
        twice the minimum up to ``base_s``, so an agent whose reports fail never waits longer
        between tries than between heartbeats."""
        self.failures += 1
        cap = min(base_s, REPORT_RETRY_MIN_S * 2.0 ** min(self.failures, 16))
        return self._rng.uniform(REPORT_RETRY_MIN_S, max(REPORT_RETRY_MIN_S, cap))
