"""Incident response on a real control plane (the harness: SQLite, fake agents, a fake clock),
without Prefect or the network: recording channels stand in for email and chat.

Checked: an ECC alert group opens one Sev2 incident, diagnosed and mitigated by its rule (node
cordoned, its job re-placed as a platform retry); another alert on the node joins it; tier 1 is
paged on email and IM at once, tier 2 when nobody acknowledges within the delay, and not again
after the acknowledgement; an acknowledgement timeout re-triggers; the escalation survives a
restart of the control plane (a new plane and service over the same store); resolving a Sev2
drafts a postmortem with the whole timeline; signed links act only for their incident and action.
"""

from __future__ import annotations

import pytest
from tests.support.plane import DAN, Harness

from apiary.errors import ForbiddenError
from apiary.incidents import IncidentTransitionError
from apiary.response.actions import ActionPipeline, Outbox, contact_lookup, user_email
from apiary.response.channels import Channel, Contact, Dispatcher, Message
from apiary.response.config import ResponseConfig
from apiary.response.escalator import EscalationWorker, Pager
from apiary.response.links import LinkSigner
from apiary.response.service import IncidentService
from apiary.response.store import IncidentStore

TIER1_DELAY_S = 30
ONCALL = {
    "schedules": [{"name": "primary", "layers": [{"name": "weekly", "users": ["alice", "bob"], "rotation": "weekly",
                                                   "handoff": "09:00", "start": "2023-11-13T09:00:00+00:00",
                                                   "time_zone": "UTC"}]}],
    "policies": [{"name": "gpu", "ack_timeout_s": 600, "tiers": [
        {"level": 1, "targets": [{"schedule": "primary"}], "delay_s": TIER1_DELAY_S},
        {"level": 2, "targets": [{"user": "senior"}], "delay_s": 60}]}],
    "routing": {"working_hours": {"time_zone": "UTC", "start": "00:00", "end": "23:59"},
                "rules": [{"severities": ["Sev1", "Sev2", "Sev3", "Sev4"], "channels": ["email", "im"],
                           "notify": "all"}]},
    "incidents": {"policy": "gpu"},
    "contacts": {u: {"email": f"{u}@example.test"} for u in ("alice", "bob", "senior")},
}


class Recording(Channel):
    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: list[tuple[str, str, str | None]] = []

    def send(self, message: Message, contact: Contact) -> str:
        self.sent.append((contact.name, message.headline, message.ack_url))
        return f"{self.name}-{len(self.sent)}"


def payload(alertname: str, gpu: str, status: str = "firing", node: str = DAN) -> dict:
    labels = {"alertname": alertname, "node": node, "gpu": gpu, "severity": "fatal" if "Ecc" in alertname else "error"}
    return {"version": "4", "status": status, "groupKey": f'{{}}:{{alertname="{alertname}", node="{node}"}}',
            "receiver": "apiary", "groupLabels": {}, "commonLabels": labels,
            "commonAnnotations": {"summary": f"{alertname} on {node}"},
            "alerts": [{"status": status, "labels": labels, "annotations": {}, "startsAt": "2023-11-14T22:13:20Z",
                        "fingerprint": f"{alertname}-{gpu}"}]}


class World:
    def __init__(self, h: Harness) -> None:
        self.h = h
        self.email, self.im = Recording("email"), Recording("im")
        config = ResponseConfig.parse(ONCALL)
        # One set of channels for pages and mitigations, as apiary.response.runtime wires them.
        dispatcher = Dispatcher({"email": self.email, "im": self.im}, sleep=lambda s: None)
        lookup = contact_lookup(config.contacts, user_email(h.plane.sessions))
        pipeline = ActionPipeline(h.plane, Outbox(dispatcher, lookup), clock=h.clock)
        self.service = IncidentService(IncidentStore(h.plane.sessions), config, plane=h.plane, clock=h.clock,
                                       pipeline=pipeline)
        self.service.signer = LinkSigner("test-secret", "http://127.0.0.1:1")
        self.worker = EscalationWorker(self.service, Pager(self.service, dispatcher, config.contacts.get,
                                                           self.service.signer), clock=h.clock)

    def paged(self) -> list[tuple[str, str]]:
        return sorted({(c, who) for c, ch in (("email", self.email), ("im", self.im)) for who, _, _ in ch.sent})

    def events(self, incident_id: str) -> list[str]:
        return [e.event for e in self.service.store.get(incident_id).timeline]


@pytest.fixture
def world(tmp_path) -> World:
    return World(Harness(tmp_path, "one-vc"))  # one VC over both nodes: a drained job has somewhere to go


def _running_job(h: Harness) -> tuple[str, str]:
    job = h.submit(0, **{"defaults.virtualCluster": "default"})
    h.cycle()
    h.start(job)
    return job, h.find(job)["node"]


def test_an_ecc_alert_opens_one_sev2_incident_mitigated_by_its_rule(world):
    h = world.h
    job, node = _running_job(h)
    h.tick(1800)  # half an hour of work on one GPU, lost to the drain
    h.report_all()  # the agents kept reporting meanwhile
    world.service.drill_results = lambda: {"drills": [{"drill": "stress-drill", "result": "failed"}],
                                           "nodeFailures": [{"node": node, "rule": "slow-gpu", "detail": "x0.4"}]}
    out = world.service.ingest_alertmanager(payload("ApiaryGpuEccDoubleBitError", "0", node=node))
    assert out["action"] == "open"
    iid = out["incident"]
    incident = world.service.store.get(iid)
    assert incident.severity.value == "sev2" and incident.state.value == "triggered"
    actions = [e.detail for e in incident.timeline if e.event == "action"]
    assert [(a["action"], a["result"]) for a in actions] == [
        ("cordon-node", "ok"), ("drain-node", "ok"), ("notify-owners", "ok")]
    assert actions[0]["undo"] == "uncordon-node"
    diagnosis = next(e.detail for e in incident.timeline if e.detail.get("diagnosis"))
    assert diagnosis["runbook"] == "runbook/gpu-node-repair"
    assert diagnosis["drills"] == {"nodeFailures": [{"node": node, "rule": "slow-gpu", "detail": "x0.4"}],
                                   "lastRuns": {"stress-drill": "failed"}}
    assert diagnosis["suspectedCause"] == f"node {node}"
    assert next(n for n in h.plane.list_nodes() if n["name"] == node)["cordoned"]
    assert job in incident.links.jobs and "alice" in incident.links.users
    assert incident.links.gpu_hours_lost == pytest.approx(0.5)
    # The drained job is re-placed elsewhere as a platform retry (no user retry spent).
    h.cycle()
    after = h.job(job)
    assert after["retryDetails"]["platform"] == 1 and after["retryDetails"]["user"] == 0
    assert h.find(job)["node"] not in (None, node)

    # Another alert on the same node within the window joins it: no second incident, no new page.
    joined = world.service.ingest_alertmanager(payload("ApiaryGpuXidError", "1", node=node))
    assert joined == {"incident": iid, "action": "attach", "reason": joined["reason"]}
    assert "node" in joined["reason"]
    assert len(world.service.store.recent()) == 1


def test_escalation_pages_tier_1_then_tier_2_and_stops_at_the_acknowledgement(world):
    h = world.h
    iid = world.service.ingest_alertmanager(payload("ApiaryGpuEccDoubleBitError", "0"))["incident"]
    assert world.worker.tick() == 1
    on_call = world.service.config.oncall.schedules[0]
    from datetime import UTC, datetime

    from apiary.oncall import on_call as who
    dri = who(on_call, datetime.fromtimestamp(h.clock(), UTC))
    assert world.paged() == [("email", dri), ("im", dri)]  # "notify: all": both channels
    assert world.email.sent[0][2].startswith(f"http://127.0.0.1:1/api/v2/incidents/{iid}/link/acknowledge?token=")
    h.tick(TIER1_DELAY_S - 1)
    assert world.worker.tick() == 0  # not yet
    h.tick(1)
    assert world.worker.tick() == 1
    assert ("email", "senior") in world.paged()
    escalate = next(e for e in world.service.store.get(iid).timeline if e.event == "escalate")
    assert escalate.detail["tier"] == 2 and escalate.detail["targets"] == ["senior"]

    world.service.act(iid, "acknowledge", "senior")
    sent = len(world.email.sent)
    h.tick(60)
    assert world.worker.tick() == 0
    assert len(world.email.sent) == sent
    # The policy's acknowledgement timeout (600 s) re-triggers and pages tier 1 again.
    h.tick(600)
    assert world.worker.tick() == 1
    assert world.service.store.get(iid).state.value == "triggered"
    assert "retrigger" in world.events(iid)
    assert len(world.email.sent) == sent + 1


def test_a_restarted_control_plane_still_escalates(world):
    h = world.h
    iid = world.service.ingest_alertmanager(payload("ApiaryGpuEccDoubleBitError", "0"))["incident"]
    world.worker.tick()
    # kill -9 during the wait: a new plane and service over the same store, nothing in memory.
    h2 = h.restart()
    h2.tick(TIER1_DELAY_S + 2)  # the deadline passed while it was down
    fresh = World(h2)
    assert fresh.worker.tick() == 1
    assert ("email", "senior") in fresh.paged()
    escalate = next(e for e in fresh.service.store.get(iid).timeline if e.event == "escalate")
    assert escalate.detail["lateS"] == pytest.approx(2.0)


def test_resolving_a_sev2_drafts_its_postmortem_with_every_step(world):
    h = world.h
    iid = world.service.ingest_alertmanager(payload("ApiaryGpuEccDoubleBitError", "0"))["incident"]
    world.worker.tick()
    h.tick(5)
    world.service.act(iid, "acknowledge", "alice")
    h.tick(5)
    world.service.act(iid, "resolve", "alice", message="GPU 0 reset", verdict="actionable")
    markdown = world.service.store.row(iid)["postmortem"]
    assert markdown is not None
    for word in ("cordon-node", "drain-node", "acknowledge", "resolve", "notify"):
        assert word in markdown, word
    items = world.service.store.action_items(iid)
    assert any("uncordon" in i["text"].lower() or DAN in i["text"] for i in items)
    # Edited by a person: the table is re-read, items stay tracked.
    edited = markdown.replace("| open |", "| done |", 1)
    after = world.service.set_postmortem(iid, edited)
    assert any(i["status"] == "done" for i in after)
    with pytest.raises(IncidentTransitionError):
        world.service.act(iid, "acknowledge", "alice")
    assert world.service.store.row(iid)["verdict"] == "actionable"


def test_signed_links_act_only_for_their_incident_and_action(world):
    signer = world.service.signer
    url = signer.url("7", "acknowledge", "alice")
    token = url.split("token=", 1)[1]
    assert signer.verify("7", "acknowledge", token) == "alice"
    with pytest.raises(ForbiddenError):
        signer.verify("8", "acknowledge", token)
    with pytest.raises(ForbiddenError):
        signer.verify("7", "resolve", token)
    with pytest.raises(ForbiddenError):
        LinkSigner("another-secret", "http://x").verify("7", "acknowledge", token)


def test_a_resolved_alert_resolves_and_a_refire_within_the_window_reopens(world):
    h = world.h
    iid = world.service.ingest_alertmanager(payload("ApiaryGpuEccDoubleBitError", "0"))["incident"]
    h.tick(10)
    out = world.service.ingest_alertmanager(payload("ApiaryGpuEccDoubleBitError", "0", status="resolved"))
    assert out["action"] == "resolve" and world.service.store.get(iid).state.value == "resolved"
    h.tick(700)  # past the node window, inside the reopen window
    again = world.service.ingest_alertmanager(payload("ApiaryGpuEccDoubleBitError", "0"))
    assert again == {"incident": iid, "action": "reopen", "reason": again["reason"]}
    assert world.service.store.get(iid).state.value == "triggered"
    assert world.service.store.escalation(iid)["nextAt"] == pytest.approx(h.clock())


def test_a_failure_prediction_opens_a_sev4_warning_with_its_evidence(world):
    from apiary.aiops import Finding, finding_to_event

    finding = Finding(rule="node-failure", subject="hostname-carol", kind="node", t=world.h.clock(), score=0.93,
                      summary="hostname-carol is likely to fail within 2 h",
                      evidence={"ecc_sbe_rate": 41.0, "xid_events": 2})
    out = world.service.ingest_event(finding_to_event(finding), actor="aiops")
    assert out["action"] == "open"
    incident = world.service.store.get(out["incident"])
    assert incident.severity.value == "sev4" and incident.links.nodes == ("hostname-carol",)
    assert incident.timeline[0].detail["evidence"]["ecc_sbe_rate"] == 41.0
    # The same prediction again is the same problem (its dedup key): no second incident.
    again = world.service.ingest_event(finding_to_event(finding), actor="aiops")
    assert again["incident"] == out["incident"] and again["action"] == "attach"


def test_notify_all_falls_back_without_paging_a_channel_twice(world):
    from apiary.errors import UnavailableError

    class Down(Recording):
        def send(self, message: Message, contact: Contact) -> str:
            raise UnavailableError("SMTP server unreachable")

    down, im = Down("email"), Recording("im")
    world.worker.pager.dispatcher = Dispatcher({"email": down, "im": im}, sleep=lambda s: None)
    world.service.ingest_alertmanager(payload("ApiaryGpuEccDoubleBitError", "0"))
    assert world.worker.tick() == 1
    # email failed (3 tries) and fell back to im; im's own turn does not page the DRI again.
    assert len(im.sent) == 1
