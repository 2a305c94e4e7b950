"""Probes run inside a harness's hosts (tests/hosts/probe.py, stdlib only, started with this
interpreter): ICMP echo and TCP connect, answering "ok" or why not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from apiary.hosts.netns import Hosts

PROBE = Path(__file__).with_name("probe.py")


def probe(hosts: Hosts, name: str, *args: str, timeout: float = 30.0) -> str:
    """Run ``probe.py ARGS`` inside host ``name``; its stdout, stripped."""
    r = hosts.exec(name, [sys.executable, str(PROBE), *args], timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def ping(hosts: Hosts, name: str, *targets: str, timeout_s: float = 2.0) -> dict[str, str]:
    """One ICMP echo from host ``name`` to each target: target -> "ok" or why not
    ("timeout", "ENETUNREACH", ...)."""
    return json.loads(probe(hosts, name, "ping", *targets, "--timeout", str(timeout_s)))


def connect(hosts: Hosts, name: str, host: str, port: int, timeout_s: float = 2.0) -> str:
    """One TCP connect from host ``name`` to ``host:port``: "ok" or the errno's name."""
    return probe(hosts, name, "connect", host, str(port), "--timeout", str(timeout_s))
