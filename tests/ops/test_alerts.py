"""Alert intake and actions: Alertmanager webhook v4 payloads in, actions out.

Email goes to a real SMTP server on loopback (aiosmtpd) and is read back from it; the chat
webhook is a real HTTP server on loopback.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.support.auth import with_auth
from tests.support.builders import LAB6, job_text

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.errors import ValidationError
from apiary.ops.alerts import ActionsConfig, AlertmanagerPayload, AlertReceiver, Rule, SmtpConfig
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory
from apiary.tracking.prefect_server import free_port


@pytest.fixture
def chat():
    posts: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook", posts
    server.shutdown()


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    p = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"), tmp_path)
    for node in ("hostname-carol", "hostname-dan"):
        p.node_report(node, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=[])
    return p


def payload(alertname: str, status: str = "firing", fingerprint: str = "f1", **labels) -> dict:
    return {
        "version": "4", "status": status, "receiver": "apiary", "groupKey": "{}:{}",
        "alerts": [{
            "status": status, "labels": {"alertname": alertname, **labels},
            "annotations": {"summary": f"{alertname} on {labels.get('node', '?')}", "description": "details"},
            "startsAt": "2026-11-22T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z", "fingerprint": fingerprint,
        }],
    }


def test_ecc_alert_cordons_the_node_and_emails_the_admin_once(plane, smtp, chat, tmp_path):
    controller, inbox = smtp
    url, posts = chat
    config = ActionsConfig(
        admin_email="ops@example.test", smtp=SmtpConfig(host="127.0.0.1", port=controller.port),
        chat_webhook=url,
        rules=[Rule(match_re={"alertname": "GpuDoubleBitEcc.*"}, actions=["cordon-node", "email-admin", "chat"])],
    )
    client = with_auth(TestClient(create_app(plane, AlertReceiver(plane, config))), plane)
    body = payload("GpuDoubleBitEccError", severity="fatal", node="hostname-dan", gpu="0")
    r = client.post("/api/v2/alerts/webhook", json=body)
    assert r.status_code == 200
    assert [(a["action"], a["status"]) for a in r.json()["actions"]] == [
        ("cordon-node", "ok"), ("email-admin", "ok"), ("chat", "ok")]
    assert next(n for n in plane.list_nodes() if n["name"] == "hostname-dan")["cordoned"] is True
    assert len(inbox.messages) == 1 and inbox.messages[0].rcpt_tos == ["ops@example.test"]
    assert "GpuDoubleBitEccError" in inbox.messages[0].content.decode()
    assert posts and "GpuDoubleBitEccError" in posts[0]["text"]
    # Alertmanager resends the same alert: nothing runs twice.
    assert client.post("/api/v2/alerts/webhook", json=body).json()["actions"] == []
    assert len(inbox.messages) == 1 and len(posts) == 1
    # New jobs avoid the cordoned node (vc1's only node): the job waits.
    job = plane.submit(job_text(0), "alice")["id"]
    plane.cycle()
    assert plane.get_job(job)["tasks"][0]["node"] is None
    recorded = client.get("/api/v2/alerts").json()
    assert recorded["alerts"][0]["alertname"] == "GpuDoubleBitEccError"
    assert {a["action"] for a in recorded["actions"]} == {"cordon-node", "email-admin", "chat"}


def test_per_request_actions_stop_and_tag_the_job_and_email_its_owner(plane, smtp):
    controller, inbox = smtp
    config = ActionsConfig(smtp=SmtpConfig(host="127.0.0.1", port=controller.port))
    receiver = AlertReceiver(plane, config)
    Directory(plane.sessions).create_user("bob", email="bob@example.test")  # the owner's address: the directory's
    job = plane.submit(job_text(1), "bob")["id"]
    body = payload("JobLowGpuUtilization", job_id=job)
    actions = ["tag-job:low-gpu-util", "email-owner", "stop-job"]
    done = receiver.receive(AlertmanagerPayload.model_validate(body), actions)
    assert [d["status"] for d in done] == ["ok", "ok", "ok"]
    j = plane.get_job(job)
    assert j["tags"] == ["low-gpu-util"] and j["state"] == "STOPPED"
    assert inbox.messages[0].rcpt_tos == ["bob@example.test"]


def test_resolved_alerts_are_recorded_and_run_nothing(plane):
    receiver = AlertReceiver(plane, ActionsConfig(rules=[Rule(match={}, actions=["cordon-node"])]), notifiers={})
    body = payload("NodeDown", status="resolved", node="hostname-dan")
    done = receiver.receive(AlertmanagerPayload.model_validate(body))
    assert done == [] and receiver.recent()[0]["status"] == "resolved"


def test_failed_email_is_recorded_and_retried_on_resend(plane):
    config = ActionsConfig(admin_email="ops@example.test", smtp=SmtpConfig(host="127.0.0.1", port=free_port()), rules=[
        Rule(match={"alertname": "X"}, actions=["email-admin"])])
    receiver = AlertReceiver(plane, config)
    body = AlertmanagerPayload.model_validate(payload("X"))
    assert receiver.receive(body)[0]["status"] == "failed"
    assert receiver.receive(body)[0]["status"] == "failed"  # tried again, not skipped


def test_bad_actions_config_names_the_field(tmp_path):
    bad = tmp_path / "a.yaml"
    bad.write_text("rules:\n  - match: {}\n    actions: [reboot-node]\n")
    with pytest.raises(ValidationError) as e:
        ActionsConfig.load(bad)
    assert "rules[0].actions" in str(e.value)
    assert ActionsConfig.load().rules  # the packaged default loads


def test_unsupported_payload_version_is_a_400(plane):
    client = with_auth(TestClient(create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}))), plane)
    r = client.post("/api/v2/alerts/webhook", json={**payload("X"), "version": "3"})
    assert r.status_code == 400 and "version" in r.json()["message"]
