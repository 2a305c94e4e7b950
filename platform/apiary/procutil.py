"""Process helpers shared by the supervisor and the Prefect server starter."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for a supervised child: SIGTERM it when the process that started it dies.

    The children of ``apiary up`` run in their own sessions (so a signal to one does not hit the
    others), which also means nothing stops them if the supervisor is killed; Linux's
    ``PR_SET_PDEATHSIG`` closes that gap. Task processes never use it: they must outlive their
    agent so a restarted agent can re-adopt them. A no-op where prctl is unavailable.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on (or holds) ``host:port``: a test bind, with SO_REUSEADDR as
    uvicorn binds, so a port left in TIME_WAIT by a platform that just stopped counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
