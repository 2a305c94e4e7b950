"""A deployed platform works end to end: it answers, refuses anonymous calls, runs Lab 6's job
(the real MNIST example, in the agent's container) with its logs, and passes Lab 6's scenarios
1-3 (VC safety, priority and preemption, opportunistic) on the two-VC cluster."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from apiary.demo.lab6 import SCENARIOS_TWO_VCS, run_scenarios

pytestmark = pytest.mark.skipif(not os.environ.get("APIARY_STAGING_URL"),
                                reason="no staging platform (APIARY_STAGING_URL unset): the CI pipeline runs these")

LAB6 = Path(__file__).resolve().parents[2] / "examples" / "lab6"


def test_healthz_answers(staging_url):
    resp = httpx.get(f"{staging_url}/healthz", timeout=10)
    assert resp.status_code == 200, resp.text


def test_anonymous_calls_are_refused(staging_url):
    resp = httpx.get(f"{staging_url}/api/v2/jobs", timeout=10)
    assert resp.status_code == 401, resp.text


def test_both_lab6_nodes_are_ready(admin):
    nodes = {n["name"]: n for n in admin.nodes()}
    assert {"hostname-carol", "hostname-dan"} <= set(nodes), nodes
    assert all(n["ready"] for n in nodes.values()), nodes


def test_lab6_job_succeeds_with_its_logs(admin):
    job = admin.submit((LAB6 / "job-config-0.yaml").read_text())
    final = admin.wait(job["id"], timeout=300, poll_s=0.5)
    assert final["state"] == "SUCCEEDED", final
    assert "final test_acc=" in admin.logs(job["id"], "train", 0)


def test_lab6_scenarios_on_the_two_vc_cluster(admin):
    outcomes = run_scenarios(admin, SCENARIOS_TWO_VCS, sleep_s=3)
    failed = [o for o in outcomes if not o.passed]
    assert len(outcomes) == 3 and not failed, failed
