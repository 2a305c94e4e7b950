"""The interpreter's thread switch interval in the control-plane process.

Why: the control plane's event loop answers heartbeats and long polls itself, while worker threads
apply reports, submissions and scheduling decisions. Under the GIL, a thread that gave the
interpreter up for a socket call waits to get it back until the running thread gives it up too:
at its next blocking call, or when the switch interval (``sys.setswitchinterval``, CPython's
default 5 ms) forces it. At 5,000 hollow nodes under a burst of submissions the event loop spent
about a quarter of its wall time waiting so after its socket writes (py-spy ``--idle --threads``,
2026-11-28), and the plane's lock was held 95 % of the burst by threads that did the same after
each statement to the store (a timed lock, 2026-11-29).

:data:`SWITCH_INTERVAL_S` is 2 ms. Measured with ``bench/cluster.py --nodes 5000 --processes 2``,
three pairs of runs alternating 5 ms and 2 ms (2026-11-29, 05:59-06:13): bare heartbeats' p99
84, 68, 41 ms at 5 ms against 35, 43, 22 ms at 2 ms; placement -> assignment p99 207, 171, 95 ms
against 112, 128, 62 ms; reports with run statuses 295, 206, 206 ms against 216, 245, 154 ms. The
price is in the ``api`` benchmark (4 clients, the submissions' threads switching more often):
five pairs of runs, 2 ms against 5 ms, gave 594, 600 against 695, 664/s (2026-11-28) and 713,
643, 708 against 664, 692, 645/s (2026-11-29, 06:30-06:33): 652 against 672/s on average, 3 %
fewer, inside the benchmark's spread. 1 ms cost 10-15 % of that rate (2026-11-28).
"""

from __future__ import annotations

import sys

#: Seconds a thread may hold the GIL while another waits for it (CPython's default: 0.005).
SWITCH_INTERVAL_S = 0.002


def install() -> None:
    """Set this process's switch interval to :data:`SWITCH_INTERVAL_S` (process-wide; the
    control-plane process calls it at start, :func:`apiary.wiring.serve`)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
