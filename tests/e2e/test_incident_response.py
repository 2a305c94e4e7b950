"""Incident response end to end on loopback: real Prometheus and Alertmanager (Debian's binaries),
an SMTP server (aiosmtpd), a Slack-style incoming webhook (a local fake: Slack cannot be reached
from here), the embedded platform with simulated GPUs, and the ``apiary`` CLI.

A double-bit ECC fault (with the XIDs that come with it) on the node running a job must:

1. open ONE Sev2 incident, although two alert groups arrive (ApiaryGpuEccDoubleBitError and
   ApiaryGpuXidError: node correlation joins the second);
2. page tier 1 (the DRI on the schedule) by email and IM at once;
3. escalate to tier 2 when nobody acknowledges within the (shortened, 20 s) delay, on time
   (within 5 s) although the control plane was killed with SIGKILL during that wait and
   restarted by the supervisor;
4. stop escalating at ``apiary incident ack`` (the next deadline is gone);
5. cordon and drain the node by its response rule, the job finishing on the other node as a
   platform retry;
6. on ``apiary incident resolve``, draft a postmortem whose timeline holds every step above.
"""

from __future__ import annotations

import email
import email.policy
import json
import os
import subprocess
import sys
import time
from datetime import datetime

import pytest
import yaml
from tests.support.builders import LAB6, job_text
from tests.support.fake_providers import FakeWebhook
from tests.support.polling import nodes_ready, task_running, until
from tests.support.stack import require_monitoring

from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded

pytestmark = [pytest.mark.e2e, pytest.mark.prometheus]

TIER1_DELAY_S = 20
ON_TIME_S = 5.0


def _cluster(tmp_path) -> str:
    """Lab 6's one-VC cluster with two GPUs per node (a GPU for the DBE, another for an XID)."""
    doc = yaml.safe_load((LAB6 / "hived-config-one-vc.yaml").read_text())
    cfg = yaml.safe_load(doc["hivedscheduler"]["config"])
    cfg["physicalCluster"]["cellTypes"]["GPU-NODE"]["childCellNumber"] = 2
    doc["hivedscheduler"]["config"] = yaml.safe_dump(cfg)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _oncall(smtp_port: int, slack_url: str) -> dict:
    people = ("dri-1", "dri-2", "senior", "manager", "alice")
    return {
        "schedules": [{"name": "primary", "layers": [{
            "name": "daily", "users": ["dri-1", "dri-2"], "rotation": "daily", "handoff": "09:00",
            "start": "2026-01-05T09:00:00+00:00", "time_zone": "UTC"}]}],
        "policies": [{"name": "gpu", "tiers": [
            {"level": 1, "targets": [{"schedule": "primary"}], "delay_s": TIER1_DELAY_S},
            {"level": 2, "targets": [{"user": "senior"}], "delay_s": TIER1_DELAY_S},
            {"level": 3, "targets": [{"user": "manager"}], "delay_s": 60}]}],
        "routing": {"working_hours": {"time_zone": "UTC", "start": "09:00", "end": "18:00"},
                    "rules": [{"severities": ["Sev1", "Sev2", "Sev3", "Sev4"], "when": "always",
                               "channels": ["email", "im"], "notify": "all"}]},
        "incidents": {"policy": "gpu"},
        "contacts": {u: {"email": f"{u}@example.test", "im_handle": f"U{i:08d}"} for i, u in enumerate(people)},
        "channels": {"smtp": {"host": "127.0.0.1", "port": smtp_port, "sender": "oncall@example.test"},
                     "slack": {"webhook_url": slack_url}},
    }


def _mails_to(inbox, who: str) -> list[str]:
    """The decoded text of each email to ``who`` (quoted-printable folds long links)."""
    out = []
    for m in inbox.messages:
        if f"{who}@example.test" in m.rcpt_tos:
            msg = email.message_from_bytes(m.content, policy=email.policy.default)
            body = msg.get_body(preferencelist=("plain",))
            out.append(f"{msg['subject']}\n{body.get_content() if body else ''}")
    return out


def test_ecc_fault_one_incident_pages_escalates_through_a_kill_acks_drains_and_postmortem(tmp_path, smtp):
    require_monitoring()
    controller, inbox = smtp
    slack = FakeWebhook().start()
    oncall = tmp_path / "oncall.yaml"
    oncall.write_text(yaml.safe_dump(_oncall(controller.port, f"{slack.url}/hooks/oncall")))
    actions = tmp_path / "actions.yaml"
    actions.write_text("rules: []\n")  # the incident's response rule acts, not the per-alert actions
    p = Embedded(home=tmp_path / "home", cluster=_cluster(tmp_path), prefect=False, monitoring=True,
                 monitoring_interval_s=1, smtp_smarthost=f"127.0.0.1:{controller.port}", workdir=str(REPO_ROOT),
                 env={"APIARY_ONCALL": str(oncall), "APIARY_ALERT_ACTIONS": str(actions)})
    env = {**os.environ, "APIARY_HOME": str(tmp_path / "home")}
    env.pop("APIARY_TOKEN", None)

    def cli(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "apiary", *args], env=env, cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, f"apiary {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    try:
        p.start()
        p.start_supervisor(period_s=0.2)
        c = Tenants(p.client())
        until(lambda: nodes_ready(c, 2), 60, "node agents")
        job = c.submit(job_text(5, 25), user="alice")["id"]
        running = until(lambda: task_running(c, job), 60, "the job running")
        node = running["tasks"][0]["node"]
        other = next(n["name"] for n in c.nodes() if n["name"] != node)

        c._call("POST", f"/api/v2/nodes/{node}/faults", json={"gpu": 0, "eccDbe": 2, "xid": 48})
        c._call("POST", f"/api/v2/nodes/{node}/faults", json={"gpu": 1, "xid": 79})

        def incidents() -> list[dict]:
            return c._call("GET", "/api/v2/incidents").json()["incidents"]

        first = until(lambda: incidents() or None, 90, "an incident opened by the alerts")[0]
        iid = first["id"]

        def incident() -> dict:
            return c._call("GET", f"/api/v2/incidents/{iid}").json()

        # Tier 1, the DRI on call now, by email and IM at once.
        dri = c._call("GET", "/api/v2/oncall").json()["schedules"]["primary"]
        until(lambda: _mails_to(inbox, dri) or None, 30, f"tier 1 ({dri}) emailed")
        until(lambda: any(f"<@U0000000{0 if dri == 'dri-1' else 1}>" in json.dumps(b) for b in slack.posts) or None,
              30, f"tier 1 ({dri}) mentioned in the IM channel")
        assert f"/api/v2/incidents/{iid}/link/acknowledge?token=" in _mails_to(inbox, dri)[0]

        # SIGKILL the control plane during the wait for tier 2; the supervisor restarts it.
        cp = p.children["control-plane"]
        killed_pid = cp.proc.pid
        killed_at = time.time()
        cp.proc.kill()
        until(lambda: cp.proc.pid != killed_pid and cp.alive(), 30, "the control plane restarted")
        p.wait_api(60)

        escalated = until(lambda: next((e for e in incident()["timeline"] if e["event"] == "escalate"), None),
                          TIER1_DELAY_S + 30, "the escalation to tier 2")
        assert escalated["detail"]["tier"] == 2 and escalated["detail"]["targets"] == ["senior"]
        due = datetime.fromisoformat(escalated["detail"]["dueAt"].replace("Z", "+00:00")).timestamp()
        opened = datetime.fromisoformat(incident()["openedAt"].replace("Z", "+00:00")).timestamp()
        assert due == pytest.approx(opened + TIER1_DELAY_S, abs=0.01)
        at = datetime.fromisoformat(escalated["at"].replace("Z", "+00:00")).timestamp()
        assert killed_at < due, "the control plane must die during the wait, not after the page"
        assert at - due <= ON_TIME_S, f"escalated {at - due:.1f} s late"
        print(f"tier 2 paged {at - due:.3f} s after its deadline, through a SIGKILL of the control plane")
        until(lambda: _mails_to(inbox, "senior") or None, 30, "tier 2 (senior) emailed")

        # One incident for both alert groups, Sev2.
        try:
            view = until(lambda: (lambda v: v if {"ApiaryGpuEccDoubleBitError", "ApiaryGpuXidError"} <= {
                n for e in v["timeline"] for n in e["detail"].get("alertnames", [])} else None)(incident()),
                60, "both alert groups in the incident")
        except AssertionError:
            print(json.dumps(incidents(), indent=1), json.dumps(incident()["timeline"], indent=1)[:6000])
            print(json.dumps(c._call("GET", "/api/v2/alerts").json()["alerts"], indent=1)[:3000])
            raise
        assert len(incidents()) == 1
        assert view["severity"] == "sev2"

        # The acknowledgement stops escalation: tier 3 is never due.
        assert f"incident {iid} acknowledged" in cli("incident", "ack", iid)
        assert incident()["escalation"]["nextAt"] is None
        assert not _mails_to(inbox, "manager")

        # The rule cordoned and drained the node; the job finished on the other node.
        assert next(n for n in c.nodes() if n["name"] == node)["cordoned"]
        done = until(lambda: (lambda j: j if j["state"] in ("SUCCEEDED", "FAILED") else None)(c.get(job)),
                     120, "the drained job finished")
        assert done["state"] == "SUCCEEDED" and done["retryDetails"]["platform"] >= 1
        assert done["tasks"][0]["node"] == other

        assert f"incident {iid} resolved" in cli("incident", "resolve", iid, "--verdict", "actionable",
                                                 "-m", "GPU reset, node back")
        postmortem = cli("incident", "postmortem", iid)
        timeline = postmortem.split("Timeline", 1)[1]
        for step in ("open", "notify", "escalate", "acknowledge", "cordon-node", "drain-node", "resolve",
                     dri, "senior", "email", "im"):
            assert step in timeline, f"{step!r} missing from the postmortem's timeline:\n{timeline}"
        shown = cli("incident", "show", iid)
        assert "resolved" in shown
    finally:
        p.stop()
        slack.close()
