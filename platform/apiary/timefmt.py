"""Timestamps on the wire: one formatter for every package (no I/O, no clock)."""

from __future__ import annotations

import time


def iso(ts: float | None) -> str | None:
    """``2023-11-14T22:13:22.000Z`` for unix seconds ``ts`` (UTC, milliseconds); None stays None."""
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int((ts % 1) * 1000):03d}Z"
