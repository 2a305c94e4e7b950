"""Fixtures shared across the suite."""

from __future__ import annotations

import pytest
from aiosmtpd.controller import Controller

from apiary.tracking.prefect_server import free_port


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
