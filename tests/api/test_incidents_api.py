"""The incident routes on a real app over a fresh store, with real tokens: who may do what, the
actor recorded is the caller, signed links, drills and Events API v2 opening incidents, the
postmortem and the alert-quality report."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.pg import create_database, start_postgres_or_skip
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.response.config import ResponseConfig
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

INCIDENTS = "/api/v2/incidents"
#: alice is on call (a schedule with her alone, since 2026); nobody is paged (no policy).
ALICE_ON_CALL = {"schedules": [{"name": "primary", "layers": [
    {"name": "all", "users": ["alice"], "rotation": "weekly", "start": "2026-01-05T09:00:00+00:00",
     "time_zone": "UTC"}]}]}


@pytest.fixture(scope="module")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, stop = start_postgres_or_skip(tmp_path_factory.mktemp("postgres"))
    try:
        yield url
    finally:
        stop()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, dict[str, str]]]]:
    """A real app over a fresh store: an SQLite file, or a new database on the module's PostgreSQL."""
    if request.param == "postgres":
        url = create_database(request.getfixturevalue("postgres_server"), f"inc_{uuid.uuid4().hex[:16]}")
    else:
        url = f"sqlite:///{tmp_path}/a.db"
    engine = make_engine(url)
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    p = Principals(Directory(plane.sessions), ["default"])
    headers = {"anonymous": {}, "alice": bearer(p.user("alice")), "bob": bearer(p.user("bob")),
               "admin": bearer(p.admin()), "bridge": bearer(p.service("bridge")),
               "alertmanager": bearer(p.service("alertmanager")), "agent": bearer(p.agent("hostname-carol"))}
    app = create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}), link_secret="test-secret")
    with TestClient(app) as client:
        client.app.state.incidents.config = ResponseConfig.parse(ALICE_ON_CALL)
        yield client, headers
    engine.dispose()


def test_the_on_call_opens_incidents_and_the_opener_is_the_caller(api) -> None:
    client, h = api
    assert client.post(INCIDENTS, json={"title": "x"}).status_code == 401
    for who in ("agent", "bob", "bridge"):  # bob is not on call; the bridge is no responder
        assert client.post(INCIDENTS, json={"title": "x"}, headers=h[who]).status_code == 403, who
    for who, actor in (("admin", "root"), ("alertmanager", "alertmanager")):
        r = client.post(INCIDENTS, json={"title": f"by {who}"}, headers=h[who])
        assert r.status_code == 201 and r.json()["timeline"][0]["actor"] == actor, r.text
    r = client.post(INCIDENTS, json={"title": "training stalls on carol", "severity": "sev3",
                                     "nodes": ["hostname-carol"], "jobs": ["alice~bert"]}, headers=h["alice"])
    assert r.status_code == 201, r.text
    incident = r.json()
    assert incident["state"] == "triggered" and incident["timeline"][0]["actor"] == "alice"
    assert incident["links"]["users"] == ["alice"] and incident["deadlines"]["acknowledge"]
    iid = incident["id"]
    # alice sees hers; bob does not; admins see all.
    assert client.get(f"{INCIDENTS}/{iid}", headers=h["alice"]).status_code == 200
    assert client.get(f"{INCIDENTS}/{iid}", headers=h["bob"]).status_code == 403
    assert [i["id"] for i in client.get(INCIDENTS, headers=h["bob"]).json()["incidents"]] == []
    assert iid in [i["id"] for i in client.get(INCIDENTS, headers=h["admin"]).json()["incidents"]]
    # Acting on incidents is for operators (admins); the actor is the caller, not the body.
    assert client.post(f"{INCIDENTS}/{iid}/acknowledge", headers=h["alice"]).status_code == 403
    assert client.post(f"{INCIDENTS}/{iid}/acknowledge", json={"actor": "mallory"},
                       headers=h["admin"]).status_code == 400
    acked = client.post(f"{INCIDENTS}/{iid}/acknowledge", headers=h["admin"]).json()
    assert acked["state"] == "acknowledged" and acked["timeline"][-1]["actor"] == "root"
    # A transition the table does not have is a 409 naming the state.
    again = client.post(f"{INCIDENTS}/{iid}/acknowledge", headers=h["admin"])
    assert again.status_code == 409 and again.json()["field"] == "state"
    assert client.post(f"{INCIDENTS}/{iid}/comment", json={}, headers=h["admin"]).json()["field"] == "message"
    assert client.post(f"{INCIDENTS}/{iid}/resolve", json={"verdict": "maybe"},
                       headers=h["admin"]).status_code == 400
    assert client.get(f"{INCIDENTS}/{iid}/postmortem", headers=h["admin"]).status_code == 404  # a Sev3


def test_a_signed_link_acknowledges_as_its_recipient_and_a_forged_one_does_not(api) -> None:
    client, h = api
    iid = client.post(INCIDENTS, json={"title": "gpu", "severity": "sev2"}, headers=h["admin"]).json()["id"]
    signer = client.app.state.incidents.signer
    url = signer.url(iid, "acknowledge", "carol").split("/api/v2", 1)[1]
    page = client.get(f"/api/v2{url}")
    assert page.status_code == 200 and "<form method=\"post\"" in page.text
    assert client.get(f"{INCIDENTS}/{iid}", headers=h["admin"]).json()["state"] == "triggered"  # GET changes nothing
    forged = url.rsplit("=", 1)[0] + "=eyJpIjoiMSJ9.forged.sig"
    assert client.post(f"/api/v2{forged}").status_code == 403
    other = signer.url(iid, "resolve", "carol").split("token=", 1)[1]
    assert client.post(f"{INCIDENTS}/{iid}/link/acknowledge?token={other}").status_code == 403
    assert client.post(f"/api/v2{url}").status_code == 200
    view = client.get(f"{INCIDENTS}/{iid}", headers=h["admin"]).json()
    assert view["state"] == "acknowledged" and view["timeline"][-1]["actor"] == "carol (signed link)"


def test_a_failed_drill_opens_an_incident_and_its_pass_resolves_it(api) -> None:
    client, h = api
    report = {"drill": "stress-drill", "result": "failed", "startedAt": 1_800_000_000, "finishedAt": 1_800_000_060,
              "summary": "hostname-dan below its benchmark", "nodeFailures": [
                  {"node": "hostname-dan", "rule": "slow-gpu", "detail": "x0.4"}]}
    assert client.post("/api/v2/drills/results", json=report, headers=h["bridge"]).status_code == 200
    [incident] = client.get(INCIDENTS, headers=h["admin"]).json()["incidents"]
    assert incident["severity"] == "sev3" and incident["nodes"] == ["hostname-dan"]
    client.post("/api/v2/drills/results", json={**report, "result": "passed", "nodeFailures": []},
                headers=h["bridge"])
    assert client.get(f"{INCIDENTS}/{incident['id']}", headers=h["admin"]).json()["state"] == "resolved"


def test_events_api_v2_and_the_quality_report(api) -> None:
    client, h = api
    event = {"event_action": "trigger", "dedup_key": "aiops:node-failure:hostname-carol",
             "payload": {"summary": "carol may fail", "severity": "info", "source": "hostname-carol",
                         "component": "node", "class": "node-failure"}}
    assert client.post(f"{INCIDENTS}/events", json=event, headers=h["alice"]).status_code == 403
    r = client.post(f"{INCIDENTS}/events", json=event, headers=h["bridge"])
    assert r.status_code == 202 and r.json()["action"] == "open"
    bad = client.post(f"{INCIDENTS}/events", json={**event, "event_action": "explode"}, headers=h["bridge"])
    assert bad.status_code == 400 and bad.json()["field"] == "event_action"
    iid = r.json()["incident"]
    client.post(f"{INCIDENTS}/{iid}/resolve", json={"verdict": "noise"}, headers=h["admin"])
    report = client.get(f"{INCIDENTS}/quality", headers=h["admin"]).json()
    [rule] = report["report"]["rules"]
    assert rule["alertname"] == "node-failure" and rule["noise"] == 1
    assert "node-failure" in report["markdown"]
    metrics = client.get("/metrics").text
    assert 'apiary_incidents_total{severity="sev4"} 1.0' in metrics
