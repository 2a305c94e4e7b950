"""Waking the node agents' long polls (``GET /api/v2/nodes/{node}/assignments?generation=&wait=``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class NodeWaiters:
    """One :class:`asyncio.Event` per node that some long poll waits on, in one event loop.

    :meth:`notifier` binds it to the running loop and returns the callable to install as
    ``ControlPlane.on_nodes_changed``: the plane calls it from any thread after a commit, and it
    wakes every poll of those nodes at once (thread-safe, cheap: one ``call_soon_threadsafe``).
    """

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def notifier(self, loop: asyncio.AbstractEventLoop) -> Callable[[set[str]], None]:
        """The thread-safe ``on_nodes_changed`` hook for ``loop`` (the app's event loop)."""

        def notify(nodes: set[str]) -> None:
            loop.call_soon_threadsafe(self._wake, set(nodes))

        return notify

    def _wake(self, nodes: set[str]) -> None:
        for node in nodes:
            ev = self._events.pop(node, None)
            if ev is not None:
                ev.set()

    async def wait(self, node: str, timeout_s: float) -> None:
        """Return when ``node`` is woken or after ``timeout_s`` seconds, whichever is first."""
        ev = self._events.get(node)
        if ev is None:
            ev = self._events[node] = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), timeout_s)
