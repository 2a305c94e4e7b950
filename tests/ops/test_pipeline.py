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
from tests.monitoring.helpers import parse
from tests.support.auth import with_auth
from tests.support.builders import LAB6, job_text

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.monitoring import NodeExporter
from apiary.ops.alerts import ActionsConfig, AlertmanagerPayload, AlertReceiver, Rule, SmtpConfig
from apiary.response.config import ResponseConfig
from apiary.response.service import IncidentService
from apiary.response.store import IncidentStore
from apiary.runtime.faults import SimulatedFaults
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


# ------------------------------------------------------------------ GPU health faults to a cordon


def _agent_applies(plane: ControlPlane, node: str) -> dict[str, list]:
    """What the node's agent does with its queued faults (apiary.runtime.faults over a simulated
    NodeExporter), then the samples Prometheus would scrape from it."""
    exporter = NodeExporter(node, lambda: [], gpus=1, simulated=True)
    faults = SimulatedFaults(node)
    faults.exporter = exporter
    faults.apply(plane.node_faults(node))
    return parse(exporter.render().decode())


def _gpu0(samples: dict[str, list], name: str) -> str:
    (s,) = [x for x in samples[name] if x.labels["gpu"] == "0"]
    return f"{s.value:.0f}"


def _row_remap_summary(s: dict[str, list]) -> str | None:
    if _gpu0(s, "DCGM_FI_DEV_ROW_REMAP_FAILURE") == "0":
        return None
    return "GPU 0 on node hostname-dan: row remapping failed (no spare memory row left)"


def _pcie_summary(s: dict[str, list]) -> str | None:
    gen, width, max_gen, max_width = (_gpu0(s, f"DCGM_FI_DEV_PCIE_{k}") for k in
                                      ("LINK_GEN", "LINK_WIDTH", "MAX_LINK_GEN", "MAX_LINK_WIDTH"))
    if int(width) >= int(max_width):  # idle GPU: the generation does not count (gpu.yml)
        return None
    return f"GPU 0 on node hostname-dan: PCIe link degraded to gen {gen} x{width} (max gen {max_gen} x{max_width})"


@pytest.mark.parametrize(("fault", "alertname", "summary_of", "cause"), [
    pytest.param({"rowRemapFailure": True}, "ApiaryGpuRowRemapFailure", _row_remap_summary, "row remapping failed",
                 id="row-remap-failure"),
    pytest.param({"pcieWidth": 8}, "ApiaryGpuPcieLinkDegraded", _pcie_summary, "PCIe link degraded to gen 4 x8",
                 id="pcie-width"),
])
def test_an_injected_gpu_health_fault_cordons_the_node_with_the_gpu_and_the_cause(plane, smtp, fault, alertname,
                                                                                   summary_of, cause):
    """Fault -> metrics -> alert -> cordon with the packaged configs, without Prometheus: the operator's
    fault (REST) reaches the agent's simulated GPUs; the alert its rule raises on those samples (its
    expression and rendered summary are promtool-tested in deploy/prometheus/tests/gpu_test.yml,
    mirrored here by ``summary_of``) goes through the one alert pipeline: the default actions config
    and the default response rules both cordon, once, with a reason naming the GPU and the cause.
    tests/e2e/test_alerting.py runs the same path through a real Prometheus and Alertmanager."""
    controller, _ = smtp
    config = ActionsConfig.load().model_copy(update={"smtp": SmtpConfig(host="127.0.0.1", port=controller.port)})
    client = with_auth(TestClient(create_app(plane, AlertReceiver(plane, config))), plane)
    healthy = _agent_applies(plane, "hostname-dan")
    assert summary_of(healthy) is None  # the rule does not fire on a healthy GPU

    assert client.post("/api/v2/nodes/hostname-dan/faults", json={"gpu": 0, **fault}).status_code == 200
    summary = summary_of(_agent_applies(plane, "hostname-dan"))
    assert summary is not None
    body = payload(alertname, node="hostname-dan", gpu="0", severity="error", job="apiary-node",
                   instance="127.0.0.1:9")
    body["alerts"][0]["annotations"]["summary"] = summary
    body["commonAnnotations"] = body["alerts"][0]["annotations"]  # one alert: Alertmanager's common ones
    ran = client.post("/api/v2/alerts/webhook", json=body).json()["actions"]
    assert [a["action"] for a in ran].count("cordon-node") == 1, ran
    node = client.get("/api/v2/nodes/hostname-dan").json()
    assert node["cordoned"] is True
    (reason,) = [c["reason"] for c in node["cordons"]]
    assert alertname in reason and "GPU 0 on node hostname-dan" in reason and cause in reason, reason


def test_throttling_warns_but_does_not_cordon(plane, smtp):
    controller, _ = smtp
    config = ActionsConfig.load().model_copy(update={"smtp": SmtpConfig(host="127.0.0.1", port=controller.port)})
    client = with_auth(TestClient(create_app(plane, AlertReceiver(plane, config))), plane)
    for i, name in enumerate(("ApiaryGpuThermalThrottling", "ApiaryGpuPowerThrottling", "ApiaryGpuHwSlowdown")):
        body = payload(name, f"t{i}", node="hostname-dan", gpu="0", severity="warn", job="apiary-node")
        assert client.post("/api/v2/alerts/webhook", json=body).status_code == 200
    assert next(n for n in plane.list_nodes() if n["name"] == "hostname-dan")["cordoned"] is False
