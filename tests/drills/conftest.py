"""Fixtures of the drill tests: promtool (tests/deploy/tools.py finds it; a test asking for it gets
the ``prometheus`` marker), and Prefect kept away from the developer's ~/.prefect."""

from __future__ import annotations

import pytest
from tests.deploy.tools import require_tool


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool")


@pytest.fixture(autouse=True)
def _prefect_env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect-home")))
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
