"""One alert pipeline: an Alertmanager group goes through one intake; every action (the actions
config's, a ``?action=`` selector's, an incident response rule's) runs once through the same
pipeline, is recorded once in the alert-action log and in the incident's timeline, and people are
told through the response channels at the user directory's address.

Email goes to a real SMTP server on loopback (aiosmtpd); the control plane is real (SQLite).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.support.auth import with_auth
from tests.support.builders import LAB6, job_text

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.ops.alerts import ActionsConfig, AlertmanagerPayload, AlertReceiver, Rule, SmtpConfig
from apiary.response.config import ResponseConfig
from apiary.response.service import IncidentService
from apiary.response.store import IncidentStore
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

ECC = "ApiaryGpuEccDoubleBitError"


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    p = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"), tmp_path)
    for node in ("hostname-carol", "hostname-dan"):
        p.node_report(node, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=[])
    return p


def payload(alertname: str, fingerprint: str = "f1", **labels: str) -> dict:
    return {
        "version": "4", "status": "firing", "receiver": "apiary", "groupKey": f'{{}}:{{alertname="{alertname}"}}',
        "alerts": [{
            "status": "firing", "labels": {"alertname": alertname, **labels},
            "annotations": {"summary": f"{alertname} on {labels.get('node', '?')}", "description": "details"},
            "startsAt": "2026-11-22T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z", "fingerprint": fingerprint,
        }],
    }


def ecc_payload() -> dict:
    # The labels Prometheus gives the ECC rule's alert: `job` is its own scrape job, not an Apiary job.
    return payload(ECC, node="hostname-dan", gpu="0", severity="fatal", job="apiary-node", instance="127.0.0.1:9")


def ecc_config(port: int) -> ActionsConfig:
    return ActionsConfig(admin_email="ops@example.test", smtp=SmtpConfig(host="127.0.0.1", port=port),
                         rules=[Rule(match_re={"alertname": "ApiaryGpu(EccDoubleBitError|XidError)"},
                                     actions=["cordon-node", "email-admin"])])


def test_the_rule_and_the_actions_config_cordon_once_page_once_and_link_no_scrape_job(plane, smtp):
    controller, inbox = smtp
    client = with_auth(TestClient(create_app(plane, AlertReceiver(plane, ecc_config(controller.port)))), plane)
    r = client.post("/api/v2/alerts/webhook", json=ecc_payload())
    assert r.status_code == 200
    ran = [(a["action"], a["status"]) for a in r.json()["actions"]]
    # The response rule (cordon, drain, notify owners) and the actions config (cordon, email the
    # admin) both ask for the cordon: it runs once, the rule's first.
    assert ran == [("cordon-node", "ok"), ("drain-node", "ok"), ("notify-owners", "ok"), ("email-admin", "ok")]
    assert client.post("/api/v2/alerts/webhook", json=ecc_payload()).json()["actions"] == []  # a resend
    assert next(n for n in plane.list_nodes() if n["name"] == "hostname-dan")["cordoned"] is True
    assert len(inbox.messages) == 1 and inbox.messages[0].rcpt_tos == ["ops@example.test"]
    assert ECC in inbox.messages[0].content.decode()
    logged = Counter(a["action"] for a in client.get("/api/v2/alerts").json()["actions"])
    assert logged == {"cordon-node": 1, "drain-node": 1, "notify-owners": 1, "email-admin": 1}
    (incident,) = client.get("/api/v2/incidents").json()["incidents"]
    view = client.get(f"/api/v2/incidents/{incident['id']}").json()
    in_timeline = Counter(e["detail"]["action"] for e in view["timeline"] if e["event"] == "action")
    assert in_timeline == logged
    assert view["links"]["jobs"] == [] and view["links"]["nodes"] == ["hostname-dan"]


def test_an_incident_that_pages_on_call_skips_the_admin_email(plane, smtp):
    controller, inbox = smtp
    oncall = ResponseConfig.parse({
        "schedules": [{"name": "primary", "layers": [{"name": "w", "users": ["dri"], "rotation": "weekly",
                                                       "handoff": "09:00", "start": "2026-01-05T09:00:00+00:00",
                                                       "time_zone": "UTC"}]}],
        "policies": [{"name": "gpu", "tiers": [{"level": 1, "targets": [{"schedule": "primary"}], "delay_s": 60}]}],
        "incidents": {"policy": "gpu"}})
    incidents = IncidentService(IncidentStore(plane.sessions), oncall, plane=plane)
    receiver = AlertReceiver(plane, ecc_config(controller.port))
    client = with_auth(TestClient(create_app(plane, receiver, incidents=incidents)), plane)
    ran = {a["action"]: a for a in client.post("/api/v2/alerts/webhook", json=ecc_payload()).json()["actions"]}
    assert ran["email-admin"]["status"] == "skipped" and "pages on call" in ran["email-admin"]["detail"]
    assert inbox.messages == []
    (incident,) = incidents.store.recent()
    assert incidents.store.escalation(incident.id)["nextAt"] is not None  # the one page: on call's


def test_selectors_run_only_the_selected_actions_and_unknown_ones_are_a_400(plane):
    receiver = AlertReceiver(plane, ActionsConfig(rules=[Rule(match={}, actions=["stop-job"])]), notifiers={})
    client = with_auth(TestClient(create_app(plane, receiver)), plane)
    job = plane.submit(job_text(1), "bob")["id"]
    body = payload("ApiaryJobLowGpuUtilization", job=job, user="bob")
    r = client.post("/api/v2/alerts/webhook?action=tag-job:idle", json=body)
    assert [(a["action"], a["target"], a["status"]) for a in r.json()["actions"]] == [("tag-job:idle", job, "ok")]
    assert plane.get_job(job)["tags"] == ["idle"] and plane.get_job(job)["state"] != "STOPPED"
    bad = client.post("/api/v2/alerts/webhook?action=reboot-node", json=payload("X", fingerprint="f2"))
    assert bad.status_code == 400 and bad.json()["field"] == "action"


def test_a_job_action_needs_an_apiary_job_id_not_the_scrape_job(plane):
    receiver = AlertReceiver(plane, ActionsConfig(), notifiers={})
    body = AlertmanagerPayload.model_validate(payload("ApiaryServiceDown", job="apiary-node"))
    (done,) = receiver.receive(body, ["stop-job"])
    assert done["status"] == "skipped" and "job id" in done["detail"]


def test_the_owner_is_emailed_at_the_directory_address_and_never_at_an_invented_one(plane, smtp):
    controller, inbox = smtp
    receiver = AlertReceiver(plane, ActionsConfig(smtp=SmtpConfig(host="127.0.0.1", port=controller.port)))
    Directory(plane.sessions).create_user("bob", email="bob@example.test")
    Directory(plane.sessions).create_user("carl")  # no email
    bobs, carls = plane.submit(job_text(1), "bob")["id"], plane.submit(job_text(2), "carl")["id"]
    (told,) = receiver.receive(AlertmanagerPayload.model_validate(payload("Idle", job=bobs)), ["email-owner"])
    (untold,) = receiver.receive(AlertmanagerPayload.model_validate(payload("Idle", "f2", job=carls)), ["email-owner"])
    assert told["status"] == "ok" and untold["status"] == "failed" and "no contact for user carl" in untold["detail"]
    assert [m.rcpt_tos for m in inbox.messages] == [["bob@example.test"]]


def test_a_bare_tag_job_of_the_actions_config_tags_the_job_with_the_alert_s_name(plane):
    """OpenPAI's ``tag-job`` action without a tag names the alert, with or without an incident."""
    config = ActionsConfig(rules=[Rule(match={"alertname": "ApiaryJobLowGpuUtilization"}, actions=["tag-job"])])
    client = with_auth(TestClient(create_app(plane, AlertReceiver(plane, config, notifiers={}))), plane)
    job = plane.submit(job_text(1), "bob")["id"]
    r = client.post("/api/v2/alerts/webhook", json=payload("ApiaryJobLowGpuUtilization", job=job, user="bob"))
    assert r.status_code == 200, r.text
    assert plane.get_job(job)["tags"] == ["ApiaryJobLowGpuUtilization"]


def test_an_action_that_breaks_unexpectedly_is_recorded_failed_and_a_resend_runs_it_again(plane, monkeypatch):
    """Not only Apiary's own errors: any failure finishes the action's claim as failed, so the
    intake answers and Alertmanager's next resend tries again (a claim left running skipped every
    resend for good)."""
    receiver = AlertReceiver(plane, ActionsConfig(), notifiers={})
    job = plane.submit(job_text(1), "bob")["id"]
    body = AlertmanagerPayload.model_validate(payload("ApiaryJobHung", job=job, user="bob"))

    def broken(job_id: str) -> dict:
        raise KeyError("user")

    monkeypatch.setattr(plane, "stop", broken)
    (first,) = receiver.receive(body, ["stop-job"])
    assert first["status"] == "failed" and "KeyError" in first["detail"]
    monkeypatch.undo()
    (again,) = receiver.receive(body, ["stop-job"])
    assert again["status"] == "ok"
    assert [(a["action"], a["status"]) for a in receiver.recent_actions()] == [("stop-job", "ok")]
