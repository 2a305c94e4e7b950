"""Fixtures for the deploy/ tests: the Prometheus tools, found by :func:`tests.deploy.tools.require_tool`.

A test that asks for ``promtool`` or ``amtool`` carries the ``prometheus`` marker (tests/conftest.py);
the deploy tests that only read the files stay in ``make test-fast``.
"""

from __future__ import annotations

import pytest
from tests.deploy.tools import require_tool


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool")


@pytest.fixture(scope="session")
def amtool() -> str:
    return require_tool("amtool")
