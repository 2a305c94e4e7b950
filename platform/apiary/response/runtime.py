"""Assembles incident response for the control-plane process: the config, the store, the
channels and dispatcher, the signed links, the service and its escalation worker."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select

from apiary.response.channels import Attempt, Dispatcher, Message, build_channels
from apiary.response.config import ResponseConfig
from apiary.response.escalator import EscalationWorker, Pager, contacts
from apiary.response.links import LinkSigner, load_secret
from apiary.response.service import IncidentService
from apiary.response.store import IncidentStore
from apiary.response.triage import JobTriage
from apiary.store.models import User

logger = logging.getLogger(__name__)


def _user_email(sessions: Callable) -> Callable[[str], str | None]:
    def lookup(user: str) -> str | None:
        with sessions() as s:
            return s.scalar(select(User.email).where(User.name == user))

    return lookup


def build(plane, home: Path, *, config_path: Path | None, public_url: str, prometheus_url: str | None,
          poll_s: float = 0.5) -> tuple[IncidentService, EscalationWorker]:
    """The service and its (not yet started) worker over ``plane``'s store. ``config_path``: the
    on-call file (None: ``home/oncall.yaml`` when present). Raises ValidationError for a bad file."""
    path = config_path or (home / "oncall.yaml")
    config = ResponseConfig.load(path if path.exists() else None)
    store = IncidentStore(plane.sessions)
    channels = build_channels(config.channels)
    dispatcher = Dispatcher(channels)
    lookup = contacts(config.contacts, _user_email(plane.sessions), config.incidents.user_email_domain)

    def notify_owner(user: str, subject: str, body: str) -> None:
        contact = lookup(user)
        if contact is None:
            logger.info("no contact for job owner %s; not told", user)
            return
        attempts: list[Attempt] = dispatcher.deliver(Message(incident_id="-", severity="sev4", title=subject,
                                                             body=body), contact, ["email", "im"])
        if not any(a.ok for a in attempts):
            logger.warning("could not tell job owner %s: %s", user, attempts[-1].detail if attempts else "no channel")

    service = IncidentService(store, config, plane=plane, notify_owner=notify_owner, prometheus_url=prometheus_url)
    signer = LinkSigner(load_secret(home / "credentials" / "incident-links.key"),
                        config.incidents.public_url or public_url, config.incidents.link_ttl_s)
    service.signer = signer
    triage = JobTriage(service, plane)
    worker = EscalationWorker(service, Pager(service, dispatcher, lookup, signer), poll_s=poll_s,
                              periodic=(30.0, triage.run_once))
    return service, worker

