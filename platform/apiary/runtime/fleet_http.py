"""The hollow fleet's HTTP client: what :class:`~apiary.runtime.agent.NodeAgent` needs of
``httpx.AsyncClient`` (``request``), over one ``aiohttp.ClientSession``.

Why not httpx here: a hollow node costs its process what its HTTP client costs, and thousands of
them share one machine with the control plane they measure. Profiled (py-spy, 1,000 hollow nodes
heartbeating every 10 s), httpx with httpcore and AnyIO took 88% of the hollow process's CPU; at
5,000 nodes the two hollow processes took 1.1 of the machine's 2 cores and their event loops lagged
1.75 s (p99), which the measured heartbeat latencies then carried. aiohttp does the same exchange
for a fraction of that. What goes over the wire is the same: the same requests, headers, bodies and
TLS verification. A real agent (one per host) keeps httpx.

:meth:`FleetClient.request` answers an ``httpx.Response`` (status, headers, body, the request), so
the agent's code reads it as ever (``json()``, ``raise_for_status()``, headers); a timeout raises
``httpx.ReadTimeout`` (``httpx.ConnectTimeout`` before the connection was made) and any other
transport failure ``httpx.ConnectError``, so the agent fails over to the next replica as it does
with httpx.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import aiohttp
import httpx


def _client_timeout(timeout: float | httpx.Timeout | None) -> aiohttp.ClientTimeout:
    """httpx's timeout as aiohttp's: a number bounds the whole exchange; an ``httpx.Timeout``
    gives the connect and the read (between bytes) limits."""
    if timeout is None:
        return aiohttp.ClientTimeout(total=None)
    if isinstance(timeout, httpx.Timeout):
        return aiohttp.ClientTimeout(total=None, sock_connect=timeout.connect, sock_read=timeout.read)
    return aiohttp.ClientTimeout(total=float(timeout))


class FleetClient:
    """``request`` as ``httpx.AsyncClient.request`` for the keywords the node agent uses
    (``timeout``, ``headers``, ``params``, ``json``, ``content``). ``verify``: an SSL context
    (the platform CA) or True (the system's CAs); ``max_connections``: the pool's bound (0: none).
    Use as ``async with``; :meth:`aclose` closes the pool."""

    def __init__(self, *, verify: ssl.SSLContext | bool = True, max_connections: int = 0) -> None:
        self._connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, ssl=verify)
        # The body stays as sent (no decompression here): the httpx.Response decodes it by its headers.
        self._session = aiohttp.ClientSession(connector=self._connector, auto_decompress=False)

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._session.close()

    async def request(self, method: str, url: str, *, timeout: float | httpx.Timeout | None = None,
                      headers: dict[str, str] | None = None, params: dict[str, Any] | None = None,
                      json: Any = None, content: bytes | None = None) -> httpx.Response:
        """One exchange; the answer as an ``httpx.Response`` (module doc: errors raised)."""
        query = {k: str(v) for k, v in (params or {}).items()} or None
        request = httpx.Request(method, url, params=query)
        try:
            async with self._session.request(method, url, params=query, headers=headers, json=json, data=content,
                                             timeout=_client_timeout(timeout), allow_redirects=False) as r:
                body = await r.read()
                return httpx.Response(r.status, headers=list(r.raw_headers), content=body, request=request)
        except aiohttp.ServerTimeoutError as e:
            if isinstance(e, aiohttp.ConnectionTimeoutError):
                raise httpx.ConnectTimeout(str(e) or "connect timed out", request=request) from e
            raise httpx.ReadTimeout(str(e) or "read timed out", request=request) from e
        except TimeoutError as e:  # the total timeout
            raise httpx.ReadTimeout("timed out", request=request) from e
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as e:
            raise httpx.ConnectError(f"{type(e).__name__}: {e}", request=request) from e
