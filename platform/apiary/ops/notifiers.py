"""Notifier backends: where alert actions send messages.

Both are synchronous and blocking (bounded by ``timeout_s``). Neither retries: a failed send
raises :class:`~apiary.errors.UnavailableError` and the caller records the action as failed;
Alertmanager resends the alert at its ``repeat_interval``, and the action table's uniqueness
keeps a resend from sending twice once a send succeeded. Sends are not idempotent by
themselves (an SMTP server cannot deduplicate), which is why the caller records them.
"""

from __future__ import annotations

import smtplib
from abc import ABC, abstractmethod
from email.message import EmailMessage

import httpx

from apiary.errors import UnavailableError


class Notifier(ABC):
    @abstractmethod
    def send(self, subject: str, body: str, to: list[str]) -> None:
        """Deliver one message; raises UnavailableError when the peer cannot be reached."""


class EmailNotifier(Notifier):
    """SMTP (plain or STARTTLS) to ``host:port``; RFC 5322 message from ``sender``."""

    def __init__(self, host: str, port: int, sender: str, *, starttls: bool = False,
                 username: str | None = None, password: str | None = None, timeout_s: float = 10.0) -> None:
        self.host, self.port, self.sender = host, port, sender
        self.starttls, self.username, self.password, self.timeout_s = starttls, username, password, timeout_s

    def send(self, subject: str, body: str, to: list[str]) -> None:
        msg = EmailMessage()
        msg["Subject"], msg["From"], msg["To"] = subject, self.sender, ", ".join(to)
        msg.set_content(body)
        try:
            with smtplib.SMTP(self.host, self.port, timeout=self.timeout_s) as smtp:
                if self.starttls:
                    smtp.starttls()
                if self.username:
                    smtp.login(self.username, self.password or "")
                smtp.send_message(msg)
        except (OSError, smtplib.SMTPException) as e:
            raise UnavailableError(f"SMTP {self.host}:{self.port} failed: {e}") from e


class ChatWebhookNotifier(Notifier):
    """Posts ``{"text": "*subject*\\nbody"}``: the payload Slack incoming webhooks and Teams'
    legacy connectors both accept. ``to`` is ignored (the webhook URL is the channel)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url, self.timeout_s = url, timeout_s

    def send(self, subject: str, body: str, to: list[str]) -> None:
        try:
            r = httpx.post(self.url, json={"text": f"*{subject}*\n{body}"}, timeout=self.timeout_s)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise UnavailableError(f"chat webhook {self.url} failed: {e}") from e
