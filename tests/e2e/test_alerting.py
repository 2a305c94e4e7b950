"""Monitoring end to end on real Prometheus and Alertmanager (Debian's binaries) on loopback.

An embedded platform with simulated GPUs is scraped by Prometheus every second; a double-bit ECC
fault injected into hostname-dan's GPU must, within 30 s: fire ApiaryGpuEccDoubleBitError in
Prometheus, reach Apiary through Alertmanager's webhook, cordon the node (new jobs go elsewhere)
and email the admin through a real SMTP server on loopback (aiosmtpd).

One pipeline: the actions config (cordon, email the admin) and the incident's response rule
(cordon, drain, notify owners) both ask for the cordon; it runs once, the admin is paged once,
each action is recorded once in the alert-action log and in the incident's timeline, and the
incident links no Apiary job that does not exist (the alert's `job` label is Prometheus' scrape
job, `apiary-node`).

The same path for GPU health beyond ECC/XID: an injected row-remapping failure cordons the node
with a reason naming the GPU and the cause.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import httpx
import pytest
from tests.support.builders import LAB6, job_text
from tests.support.polling import nodes_ready, task_running, until
from tests.support.stack import require_monitoring

from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded

pytestmark = [pytest.mark.e2e, pytest.mark.prometheus]


@contextlib.contextmanager
def monitored_platform(tmp_path, smtp_port: int, env: dict[str, str] | None = None):
    """An embedded platform (two simulated nodes) scraped every second by Prometheus, its alerts
    routed through Alertmanager; yields (platform, tenants client, Prometheus URL) once Prometheus
    scrapes the control plane and both nodes."""
    p = Embedded(home=tmp_path / "home", cluster=LAB6 / "hived-config-one-vc.yaml", prefect=False,
                 monitoring=True, monitoring_interval_s=1, smtp_smarthost=f"127.0.0.1:{smtp_port}",
                 workdir=str(REPO_ROOT), env=env or {})
    try:
        p.start()
        p.start_supervisor(period_s=0.2)
        c = Tenants(p.client())
        until(lambda: nodes_ready(c, 2), 60, "node agents")
        prom = p.prometheus_url
        until(lambda: _up_targets(prom) >= 3, 60, "Prometheus scraping the control plane and both nodes")
        yield p, c, prom
    finally:
        p.stop()


def test_ecc_fault_fires_alert_cordons_node_and_emails(tmp_path, smtp):
    require_monitoring()
    controller, inbox = smtp
    actions = tmp_path / "actions.yaml"
    actions.write_text(
        "admin_email: ops@example.test\n"
        f"smtp: {{host: 127.0.0.1, port: {controller.port}, sender: apiary@example.test}}\n"
        "rules:\n"
        "  - match_re: {alertname: 'ApiaryGpu(EccDoubleBitError|XidError|CountChanged)'}\n"
        "    actions: [cordon-node, email-admin]\n"
    )
    with monitored_platform(tmp_path, controller.port, {"APIARY_ALERT_ACTIONS": str(actions)}) as (_p, c, prom):
        t0 = time.monotonic()
        c._call("POST", "/api/v2/nodes/hostname-dan/faults", json={"gpu": 0, "eccDbe": 1})
        alert = until(lambda: _firing(prom, "ApiaryGpuEccDoubleBitError"), 30, "the alert firing in Prometheus")
        assert alert["labels"]["node"] == "hostname-dan" and alert["labels"]["severity"] == "fatal"
        until(lambda: next(n for n in c.nodes() if n["name"] == "hostname-dan")["cordoned"], 30 - (time.monotonic()
              - t0), "hostname-dan cordoned by the alert action")
        fault_to_cordon = time.monotonic() - t0
        recorded = c._call("GET", "/api/v2/alerts").json()
        assert any(a["alertname"] == "ApiaryGpuEccDoubleBitError" for a in recorded["alerts"])
        wanted = {("cordon-node", "ok"), ("email-admin", "ok")}
        until(lambda: {(a["action"], a["status"]) for a in c._call("GET", "/api/v2/alerts").json()["actions"]}
              >= wanted, 30, "both actions recorded ok")
        until(lambda: any("ApiaryGpuEccDoubleBitError" in m.content.decode(errors="replace") for m in inbox.messages),
              30, "the email")
        assert "ops@example.test" in {r for m in inbox.messages for r in m.rcpt_tos}
        # New jobs avoid the cordoned node.
        job = c.submit(job_text(5, 2), user="alice")["id"]
        j = until(lambda: task_running(c, job), 60, "the new job running")
        assert j["tasks"][0]["node"] == "hostname-carol"
        assert fault_to_cordon < 30

        # Once: by now Alertmanager has had the time to resend (the job's run took its group_wait
        # and more); the cordon ran and the admin was paged once, each recorded once.
        ecc = [a for a in c._call("GET", "/api/v2/alerts").json()["actions"]
               if a["alertname"] == "ApiaryGpuEccDoubleBitError"]
        runs = Counter(a["action"] for a in ecc)
        assert runs["cordon-node"] == 1 and runs["email-admin"] == 1, ecc
        assert all(a["status"] == "ok" for a in ecc), ecc
        admin_pages = [m for m in inbox.messages if "ops@example.test" in m.rcpt_tos]
        assert len(admin_pages) == 1, [m.content[:300] for m in admin_pages]
        (incident,) = c._call("GET", "/api/v2/incidents").json()["incidents"]
        view = c._call("GET", f"/api/v2/incidents/{incident['id']}").json()
        in_timeline = Counter(e["detail"]["action"] for e in view["timeline"] if e["event"] == "action")
        assert in_timeline == runs, (in_timeline, runs)
        assert "hostname-dan" in view["links"]["nodes"]
        for linked in view["links"]["jobs"]:  # nothing ran on hostname-dan: no job, and no scrape job
            assert c._call("GET", f"/api/v2/jobs/{linked}").status_code == 200, linked
        assert "apiary-node" not in view["links"]["jobs"]


def test_row_remap_failure_fault_cordons_the_node_with_the_gpu_and_the_cause(tmp_path, smtp):
    """The same path for GPU health beyond ECC/XID: an injected row-remapping failure fires
    ApiaryGpuRowRemapFailure (`for: 0s`) in Prometheus, reaches Apiary through Alertmanager, and the
    packaged response rule cordons hostname-dan with a reason naming the GPU and the cause."""
    require_monitoring()
    controller, _ = smtp
    with monitored_platform(tmp_path, controller.port) as (_p, c, prom):
        c._call("POST", "/api/v2/nodes/hostname-dan/faults", json={"gpu": 0, "rowRemapFailure": True})
        alert = until(lambda: _firing(prom, "ApiaryGpuRowRemapFailure"), 30, "the alert firing in Prometheus")
        assert alert["labels"]["node"] == "hostname-dan" and alert["labels"]["gpu"] == "0"
        node = until(lambda: next((n for n in c.nodes() if n["name"] == "hostname-dan" and n["cordoned"]), None),
                     30, "hostname-dan cordoned by the alert pipeline")
        got = c._call("GET", f"/api/v2/nodes/{node['name']}").json()["cordons"]
        assert any("GPU 0 on node hostname-dan" in x["reason"] and "row remapping failed" in x["reason"]
                   for x in got), got


def _up_targets(prom: str) -> int:
    try:
        r = httpx.get(f"{prom}/api/v1/query", params={"query": "up == 1"}, timeout=2).json()
        return len(r["data"]["result"])
    except (httpx.HTTPError, KeyError, ValueError):
        return 0


def _firing(prom: str, name: str) -> dict | None:
    try:
        alerts = httpx.get(f"{prom}/api/v1/alerts", timeout=2).json()["data"]["alerts"]
    except (httpx.HTTPError, KeyError, ValueError):
        return None
    return next((a for a in alerts if a["labels"].get("alertname") == name and a["state"] == "firing"), None)
