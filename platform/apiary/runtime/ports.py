"""The check a node makes before it launches a task: are the task's named ports free here?

A task's ports are chosen from its run id (:mod:`apiary.spec.ports`) and reach it in its
environment (``PAI_CONTAINER_HOST_PORT_LIST``, ``name:port;name2:port2``). The process and Docker
runtimes share the node's network, so a port another process holds would make the task fail in a
way that looks like its own fault. OpenPAI's runtime refuses such a launch with exit code 253
(``ContainerPortConflict``: a platform failure, retried; the retry's new run id has new ports).
"""

from __future__ import annotations

import errno
import socket

#: OpenPAI's exit code 253 "ContainerPortConflict" (PLATFORM_FAILURE, TRANSIENT, ALWAYS_RETRY).
EXIT_PORT_CONFLICT = 253


def own_ports(env: dict[str, str]) -> dict[str, int]:
    """``{name: port}`` from ``PAI_CONTAINER_HOST_PORT_LIST`` (``{}`` when absent or malformed)."""
    out: dict[str, int] = {}
    for item in env.get("PAI_CONTAINER_HOST_PORT_LIST", "").split(";"):
        name, sep, port = item.partition(":")
        if sep and port.isdigit():
            out[name] = int(port)
    return out


def taken(ports: dict[str, int]) -> list[str]:
    """``"name:port"`` of each port some process on this node holds (a TCP bind on every address
    fails with EADDRINUSE), in name order."""
    busy = []
    for name, port in sorted(ports.items()):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))  # noqa: S104 - the question is whether any address holds it
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    busy.append(f"{name}:{port}")
    return busy
