"""The ports of a task instance: one per name its task role asks for, chosen from its run id.

OpenPAI lets a task role ask for ports by name (``resourcePerInstance.ports: {http: 1}``) and
gives each instance a port per name on its host (``PAI_CONTAINER_HOST_http_PORT_LIST``), which
its peers see as ``PAI_PORT_LIST_<role>_<index>_http``; the runtime refuses to start an instance
whose port is taken (OpenPAI's exit code 253, ``ContainerPortConflict``, a platform failure that
is retried). Apiary chooses each port from a hash of the run id and the name, so the control plane
(every instance's environment, the SSH info, the proxy) and the node agent (the check before
launch) agree on it without asking each other; a retry has a new run id and so new ports.
It is pure: no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

#: The range ports are chosen from: [PORT_BASE, PORT_BASE + PORT_SPAN), below Linux's default
#: ephemeral range (32768-60999, net.ipv4.ip_local_port_range), so outgoing connections of the
#: node's own processes do not take them.
PORT_BASE = 20000
PORT_SPAN = 12000


def task_ports(run_id: str, names: Iterable[str]) -> dict[str, int]:
    """``{name: port}`` for the run ``run_id``, one distinct port per name, each in
    [PORT_BASE, PORT_BASE + PORT_SPAN): sha256 of ``"<run_id>/<name>"``, the next free one within
    the run when two names meet. Names are taken in sorted order, so the answer does not depend on
    the order they are given in."""
    out: dict[str, int] = {}
    used: set[int] = set()
    for name in sorted(set(names)):
        slot = int.from_bytes(hashlib.sha256(f"{run_id}/{name}".encode()).digest()[:8], "big") % PORT_SPAN
        while PORT_BASE + slot in used:
            slot = (slot + 1) % PORT_SPAN
        used.add(PORT_BASE + slot)
        out[name] = PORT_BASE + slot
    return out

