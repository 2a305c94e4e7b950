"""Which failures of the bridge are passing (Prefect or Apiary away or busy: redo later), and a
``gather`` that lets every write finish before it raises."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import httpx

from apiary.errors import PlatformError

__all__ = ["TRANSIENT_STATUS", "Transient", "is_transient", "together"]

#: HTTP answers worth trying again later.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class Transient(Exception):
    """Prefect or Apiary is unreachable or overloaded; retry the event later."""


def is_transient(exc: BaseException) -> bool:
    """True for a failure that a later try may not meet: unreachable or timed out, Apiary's 5xx
    (:class:`~apiary.errors.PlatformError`, UnavailableError included) and Prefect's
    :data:`TRANSIENT_STATUS` answers."""
    if isinstance(exc, Transient | PlatformError | httpx.TransportError | OSError | asyncio.TimeoutError):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code in TRANSIENT_STATUS
    return False


async def together(*aws: Awaitable[Any]) -> list[Any]:
    """Await all of ``aws`` concurrently and let every one finish, then raise the first
    non-transient failure, else the first failure (``asyncio.gather`` would raise at once and
    leave the others running). Returns their results in order."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise next((f for f in failures if not is_transient(f)), failures[0])
    return list(results)
