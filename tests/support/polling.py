"""Polling with a deadline, for the tests that drive a real platform (tests never sleep to wait).

``until(pred, timeout_s, what)`` returns ``pred()``'s first truthy value and fails the test with
"timed out after N s waiting for <what>" when there is none in time.  The job predicates read an
:class:`apiary.client.ApiaryClient`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from apiary.client import ApiaryClient

T = TypeVar("T")

#: Default deadline: long enough for a Lab 6 job on a loaded CI machine.
TIMEOUT_S = 180.0


def until(pred: Callable[[], T | None], timeout_s: float = TIMEOUT_S, what: str = "condition",
          poll_s: float = 0.1) -> T:
    """``pred()``'s first truthy value, polled every ``poll_s`` seconds; AssertionError after
    ``timeout_s`` seconds without one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def task_running(c: ApiaryClient, job_id: str, count: int = 1) -> dict[str, Any] | None:
    """The job (API form) once at least ``count`` of its tasks are RUNNING, else None."""
    job = c.get(job_id)
    return job if sum(t["state"] == "RUNNING" for t in job["tasks"]) >= count else None


def nodes_ready(c: ApiaryClient, n: int) -> bool:
    """At least ``n`` node agents report ready."""
    return sum(bool(x["ready"]) for x in c.nodes()) >= n


def done(c: ApiaryClient, job_id: str) -> dict[str, Any]:
    """Wait for the job to be final (``ApiaryClient.wait``); its API form."""
    return c.wait(job_id, timeout=TIMEOUT_S, poll_s=0.2)
