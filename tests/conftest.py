"""Fixtures shared across the suite, and the markers of the tests that need real services."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller

from apiary.tracking.prefect_server import free_port

_TESTS = Path(__file__).parent

#: A test that asks for one of these fixtures uses a real service: it gets that service's marker
#: (pyproject's [tool.pytest.ini_options] markers), so `make test-fast` leaves it out even where
#: its module says nothing.  Modules mark themselves too (pytestmark) where they need no such fixture.
SERVICE_FIXTURES = {
    "postgres_url": "postgres",  # tests/store/conftest.py: a private PostgreSQL server
    "pg_url": "postgres",
    "promtool": "prometheus",  # tests/deploy/conftest.py: the Prometheus tools
    "amtool": "prometheus",
    "platform_factory": "e2e",  # tests/e2e/conftest.py: the embedded platform
}
#: Every test under these directories carries the marker.
SERVICE_DIRS = {_TESTS / "e2e": "e2e"}


def pytest_configure(config: pytest.Config) -> None:
    """A developer who is not root cannot give tasks uids of their own (apiary.runtime.isolation):
    the suite then lets the process runtime run them as that developer, as its docs allow. CI runs
    as root, where every task of the suite runs isolated. Set here, before any platform starts, so
    the agents the tests start as subprocesses inherit it."""
    if os.geteuid() != 0:
        os.environ.setdefault("APIARY_ALLOW_UNISOLATED_TASKS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = {SERVICE_FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in SERVICE_FIXTURES}
        names |= {m for d, m in SERVICE_DIRS.items() if d in item.path.parents}
        for name in sorted(names):
            item.add_marker(getattr(pytest.mark, name))


class Inbox:
    """Messages a real SMTP server on loopback (aiosmtpd) received."""

    def __init__(self) -> None:
        self.messages: list = []

    async def handle_DATA(self, server, session, envelope):  # aiosmtpd handler hook
        self.messages.append(envelope)
        return "250 OK"


@pytest.fixture
def smtp():
    """``(controller, inbox)``: an SMTP server on 127.0.0.1:``controller.port``."""
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=free_port())
    controller.start()
    yield controller, inbox
    controller.stop()
