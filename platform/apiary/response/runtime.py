"""Assembles incident response for the control-plane process: the config, the store, the
channels and dispatcher (one set, shared by pages and the action pipeline), the person lookup,
the signed links, the service and its escalation worker."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from apiary.client import http_verify
from apiary.response.actions import ActionPipeline, Outbox, contact_lookup, user_email
from apiary.response.channels import Dispatcher, build_channels
from apiary.response.config import ResponseConfig
from apiary.response.escalator import EscalationWorker, Pager
from apiary.response.links import LinkSigner, load_secret
from apiary.response.service import IncidentService
from apiary.response.store import IncidentStore
from apiary.response.triage import JobTriage

logger = logging.getLogger(__name__)


def build(plane: Any, home: Path, *, config_path: Path | None, public_url: str, prometheus_url: str | None,
          poll_s: float = 0.5, ca_cert: Path | None = None) -> tuple[IncidentService, EscalationWorker]:
    """The service and its (not yet started) worker over ``plane``'s store. ``config_path``: the
    on-call file (None: ``home/oncall.yaml`` when present); ``ca_cert``: the platform CA a
    Prometheus served over HTTPS is verified against. Raises ValidationError for a bad file."""
    path = config_path or (home / "oncall.yaml")
    config = ResponseConfig.load(path if path.exists() else None)
    store = IncidentStore(plane.sessions)
    dispatcher = Dispatcher(build_channels(config.channels))
    lookup = contact_lookup(config.contacts, user_email(plane.sessions))
    # The actions send once through breakers of their own: an owner's bad address or a broken
    # actions-config SMTP must not open the circuit that on-call pages go through.
    pipeline = ActionPipeline(plane, Outbox(Dispatcher(dispatcher.channels, attempts=1), lookup))
    service = IncidentService(store, config, plane=plane, prometheus_url=prometheus_url, pipeline=pipeline)
    service.prometheus_verify = http_verify(ca_cert)
    signer = LinkSigner(load_secret(home / "credentials" / "incident-links.key"),
                        config.incidents.public_url or public_url, config.incidents.link_ttl_s)
    service.signer = signer
    triage = JobTriage(service, plane)
    worker = EscalationWorker(service, Pager(service, dispatcher, lookup, signer), poll_s=poll_s,
                              periodic=(30.0, triage.run_once))
    return service, worker
