"""The control-plane process has one composition root (:mod:`apiary.wiring`), and an app built
without it never signs incident links with a secret of its own making."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.support.builders import LAB6

from apiary.api import create_app
from apiary.control import ControlPlane
from apiary.errors import ForbiddenError
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.settings import Settings
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory
from apiary.wiring import app_of, wire


def _settings(home: Path) -> Settings:
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(LAB6 / "hived-config-two-vcs.yaml", home / "cluster.yaml")
    return Settings(home=home, github_webhook_secret=None, public_url=None, prometheus_url=None, oncall=None,
                    alert_actions=None, users_file=None, database_url=None)


def test_the_wired_process_signs_links_with_its_homes_secret_across_restarts(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "home")
    first = wire(settings, public_url="http://127.0.0.1:1")
    link = first.incidents.signer.url("7", "acknowledge", "carol")
    token = link.split("token=", 1)[1]
    assert link.startswith("http://127.0.0.1:1/api/v2/incidents/7/link/acknowledge")
    # A restart of the process (a new wiring of the same home) accepts the links the first one mailed.
    again = wire(settings, public_url="http://127.0.0.1:1")
    assert again.incidents.signer.verify("7", "acknowledge", token) == "carol"
    assert (settings.credentials_dir / "incident-links.key").stat().st_mode & 0o077 == 0
    # Every piece the app serves is the wiring's: nothing is built twice.
    app = app_of(again)
    assert app.state.incidents is again.incidents and app.state.receiver is again.receiver
    assert app.state.directory is again.directory and app.state.ci is again.ci and app.state.drills is again.drills
    with TestClient(app) as c:
        health = c.get("/healthz")
    assert health.status_code == 200 and health.json()["clusterId"] == again.cluster_id == first.cluster_id


def test_an_app_built_without_a_link_secret_makes_and_accepts_no_link(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    app = create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}))
    signer = app.state.incidents.signer
    with pytest.raises(RuntimeError, match="link secret"):
        signer.url("1", "acknowledge", "carol")
    with pytest.raises(ForbiddenError):
        signer.verify("1", "acknowledge", "anything")
    with TestClient(app) as c:
        r = c.post("/api/v2/incidents/1/link/acknowledge?token=eyJpIjoiMSJ9.forged.sig")
    assert r.status_code == 403, r.text
    # With the secret given, links are signed with it and only it.
    signed = create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}), link_secret="s3cret")
    token = signed.state.incidents.signer.url("1", "acknowledge", "carol").split("token=", 1)[1]
    assert signed.state.incidents.signer.verify("1", "acknowledge", token) == "carol"
