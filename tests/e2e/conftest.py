"""Fixtures that start the embedded platform (``apiary up``'s supervisor) on loopback."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.support.builders import LAB6
from tests.support.polling import nodes_ready, until

from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded


@pytest.fixture(autouse=True)
def _prefect_env(tmp_path_factory, monkeypatch):
    # Never touch the developer's ~/.prefect or phone home.
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect-home")))
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture
def platform_factory(tmp_path: Path) -> Callable[..., tuple[Embedded, Tenants]]:
    """Start an embedded platform on a Lab 6 cluster config; stopped at teardown."""
    started: list[Embedded] = []

    def start(cluster: str = "hived-config-two-vcs.yaml", prefect: bool = False, **kw) -> tuple[Embedded, Tenants]:
        p = Embedded(home=tmp_path / f"home{len(started)}", cluster=LAB6 / cluster, prefect=prefect,
                     workdir=str(REPO_ROOT), **kw)
        started.append(p)
        p.start()
        p.start_supervisor(period_s=0.2)
        c = Tenants(p.client())
        until(lambda: nodes_ready(c, 2), 60, "node agents")
        return p, c

    yield start
    for p in started:
        p.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
