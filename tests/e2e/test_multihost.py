"""Apiary on many hosts: every component on its own host (network namespaces on one bridge),
TLS on every hop that leaves a host, three nodes that joined with bootstrap tokens, two
control-plane replicas over PostgreSQL (apiary.multihost.deployment).

One deployment serves the module's tests, in order: Lab 6's five scenarios (the demo's checks),
a job in the Prefect UI's API, an ECC fault cordoning its node through Prometheus and Alertmanager
on their own host, bootstrap tokens refused, a token refused over plain HTTP, and the leader killed
with kill -9 during 100 submissions.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.chaos.test_multihost_chaos import outputs, run_cli

from apiary.client import Tenants, http_verify
from apiary.demo.lab6 import SCENARIOS_ONE_VC, SCENARIOS_TWO_VCS, job_text, run_scenarios, until
from apiary.errors import ApiaryError, ConflictError, PlaintextTokenError
from apiary.multihost.deployment import API_PORT, REPO_ROOT, Deployment

pytestmark = [pytest.mark.e2e, pytest.mark.netns, pytest.mark.postgres, pytest.mark.prometheus,
              pytest.mark.timeout(900)]

CONFIGS = REPO_ROOT / "examples" / "multihost"
NODES = ["hostname-carol", "hostname-dan", "hostname-erin"]


def _require_root() -> None:
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the multi-host tests need root (network namespaces); CI runs as root")
        pytest.skip("needs root: hosts are network namespaces")


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    _require_root()
    # Not under pytest's 0700 base: the hosts' servers run as their own OS users (PostgreSQL as
    # postgres) and must reach their directories.
    root = Path(tempfile.mkdtemp(prefix="apiary-multihost-"))
    os.chmod(root, 0o711)
    d = Deployment(root=root, cluster=CONFIGS / "hived-config-two-vcs.yaml", nodes=NODES,
                   settings={"APIARY_NODE_LOST_AFTER_S": "20"})
    try:
        with d:
            yield d
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _nodes_ready(d: Deployment, n: int) -> bool:
    return sum(bool(x["ready"]) for x in d.client().nodes()) >= n


def test_lab6_scenarios_pass_against_the_deployment(deployment: Deployment) -> None:
    admin = deployment.client()
    until(lambda: _nodes_ready(deployment, 3), 90, "three joined node agents")
    results = run_scenarios(admin, SCENARIOS_TWO_VCS, 4)
    deployment.apply_cluster_config((CONFIGS / "hived-config-one-vc.yaml").read_text())
    results += run_scenarios(admin, SCENARIOS_ONE_VC, 4)
    failed = [f"{r.scenario}: {r.observed}" for r in results if not r.passed]
    assert len(results) == 5 and not failed, failed


def test_a_job_is_visible_in_the_prefect_ui_api(deployment: Deployment) -> None:
    c = Tenants(deployment.client())
    job = c.submit(job_text(5, 1, name="in-prefect"), user="alice")["id"]
    c.wait(job, timeout=120, poll_s=0.5)
    name = job  # the bridge names a job's flow run by the job's id
    user, password = deployment.prefect_auth.split(":", 1)

    def flow_run() -> dict | None:
        with httpx.Client(verify=http_verify(deployment.ca_cert), auth=(user, password), timeout=10) as http:
            r = http.post(f"{deployment.prefect_api_url}/flow_runs/filter",
                          json={"flow_runs": {"name": {"any_": [name]}}, "limit": 5})
            r.raise_for_status()
            runs = [x for x in r.json() if x["name"] == name]
            return runs[0] if runs and runs[0]["state_type"] == "COMPLETED" else None

    run = until(flow_run, 120, f"job {job} as a COMPLETED flow run in the Prefect API behind TLS")
    assert run["name"] == name


def test_an_ecc_fault_on_an_agent_host_cordons_its_node_through_prometheus_and_alertmanager(
        deployment: Deployment) -> None:
    c = deployment.client()
    until(lambda: _up_targets(deployment) >= 5, 90, "Prometheus scraping both replicas and three nodes")
    t0 = time.monotonic()
    c._call("POST", "/api/v2/nodes/hostname-erin/faults", json={"gpu": 0, "eccDbe": 1})
    # The alert's cordon-node action, or the GPU-hardware response rule of the incident the alert
    # opened (an action both ask for runs once): either way the cordon's source names the alert path.
    cordons = until(lambda: [x for x in c.node("hostname-erin")["cordons"]
                             if x["source"].startswith(("alert:", "incident:"))], 90,
                    "hostname-erin cordoned through Prometheus, Alertmanager and the alert intake")
    alerts = c._call("GET", "/api/v2/alerts").json()["alerts"]
    assert any(a["alertname"] == "ApiaryGpuEccDoubleBitError" for a in alerts), alerts
    assert cordons
    print(f"ECC fault -> cordon across hosts: {time.monotonic() - t0:.1f} s")
    # Leave hostname-erin schedulable for the tests after this one (the kill test's probe runs on
    # it). The incident's response rule runs its actions one after another (cordon, then drain,
    # which cordons again): an uncordon that lands between them is undone, so uncordon until the
    # node stays free of cordons for a few seconds.
    calm: list[float] = []

    def stays_uncordoned() -> bool:
        if c.node("hostname-erin")["cordons"]:
            c.cordon("hostname-erin", False, all=True)
            calm.clear()
            return False
        calm.append(time.monotonic())
        return calm[-1] - calm[0] >= 3.0

    until(stays_uncordoned, 60, "hostname-erin free of cordons after the incident's actions", poll=0.5)


def _up_targets(d: Deployment) -> int:
    try:
        r = httpx.get(f"{d.prometheus_url}/api/v1/targets", timeout=5, verify=http_verify(d.ca_cert))
        return sum(t["health"] == "up" for t in r.json()["data"]["activeTargets"])
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


def test_bootstrap_tokens_reused_expired_or_for_another_node_are_refused(deployment: Deployment) -> None:
    c = deployment.client()
    host = deployment.node_hosts["hostname-erin"]
    creds = deployment.dir(host) / "rejoin"

    def join(token: str, node: str) -> str:
        r = deployment.hosts.exec(host, deployment._cli(  # type: ignore[union-attr]
            "agent", "join", "--api", f"https://cp1:{API_PORT}", "--token", token, "--ca-cert-hash",
            deployment.ca_hash, "--node", node, "--credentials", str(creds)), env=deployment._base_env(host))
        assert r.returncode != 0, f"join of {node} was accepted: {r.stdout}"
        return r.stdout + r.stderr

    # Another node's name: a token bound to hostname-dan used for hostname-erin.
    dan = c.create_bootstrap_token(ttl_s=600, node="hostname-dan")["token"]
    assert "hostname-dan" in join(dan, "hostname-erin")
    # Reused: the token that joined hostname-carol at the start is spent.
    spent = [t for t in c.bootstrap_tokens() if t.get("usedBy") == "hostname-carol"]
    assert spent, c.bootstrap_tokens()
    short = c.create_bootstrap_token(ttl_s=1, node="hostname-erin")["token"]
    time.sleep(1.5)
    assert "expired" in join(short, "hostname-erin")


def test_a_token_is_never_sent_over_plain_http_to_another_host(deployment: Deployment) -> None:
    from apiary.client import ApiaryClient

    with pytest.raises(PlaintextTokenError) as e:
        ApiaryClient(f"http://{deployment.address('cp1')}:{API_PORT}", token=deployment.admin_token)
    assert "APIARY_API_URL" in str(e.value)


def test_kill_9_of_the_leader_during_100_submissions_loses_nothing(deployment: Deployment) -> None:
    """100 jobs submitted through a client of both replicas while the leader is killed: every
    accepted job SUCCEEDS, none is lost, no task instance ran twice at once; prints the failover
    time (kill -> a new submission accepted and scheduled)."""
    c = Tenants(deployment.client())
    leader = until(deployment.leader, 30, "a leader")
    accepted: list[str] = []
    refused: list[str] = []

    def submit_all() -> None:
        for i in range(100):
            text = light_job(f"kill-{i}")
            for _ in range(60):  # a refused submission (no leader yet) is retried, as a user would
                try:
                    accepted.append(c.submit(text, user="alice")["id"])
                    break
                except ConflictError:  # accepted by the leader as it was killed, its answer lost: it exists
                    accepted.append(f"alice~kill-{i}")
                    break
                except ApiaryError as e:
                    refused.append(str(e))
                    time.sleep(0.5)

    t = threading.Thread(target=submit_all)
    t.start()
    until(lambda: len(accepted) >= 20, 120, "20 accepted submissions")
    t_kill = time.monotonic()
    deployment.signal(f"control-plane@{leader}", signal.SIGKILL)
    probe = until(lambda: _submit_quietly(c), 60, "a submission accepted after the kill")
    until(lambda: any(t.get("node") for t in c.get(probe)["tasks"]), 60, "that job placed by the new leader")
    failover_s = time.monotonic() - t_kill
    t.join(300)
    deployment.restart(f"control-plane@{leader}")
    print(f"failover (kill -9 -> submission accepted and scheduled): {failover_s:.2f} s; new leader "
          f"{deployment.leader()}; refused while electing: {len(refused)}")
    assert len(accepted) == 100
    jobs = [c.wait(j, timeout=300, poll_s=1) for j in [*accepted, probe]]
    assert all(j["state"] == "SUCCEEDED" for j in jobs), [(j["id"], j["state"]) for j in jobs if
                                                          j["state"] != "SUCCEEDED"]
    assert failover_s <= 30


def light_job(name: str, vc: str = "default") -> str:
    """Lab 6's job-config-5 with one ``sleep 1`` for its commands (no training), in ``vc``."""
    return job_text(5, **{"name": name, "taskRoles.train.commands": ["sleep 1"], "defaults.virtualCluster": vc})


def _submit_quietly(c: Tenants) -> str | None:
    # In VC spare (hostname-erin, idle): the probe is placed as soon as a leader schedules, not
    # after the stream queued ahead of it in VC default.
    try:
        return c.submit(light_job(f"probe-{time.monotonic_ns()}", vc="spare"), user="alice")["id"]
    except ApiaryError:
        return None



def test_a_leader_paused_past_its_lease_is_fenced_and_steps_down(deployment: Deployment,
                                                                  tmp_path: Path) -> None:
    """SIGSTOP of the leader past its lease (chaos/leader-freeze.json through `apiary chaos run`
    against this deployment): the other replica leads, the old one's write after SIGCONT is refused
    by the fence and it exits; a stream of submissions loses nothing."""
    out = outputs(run_cli(deployment.root, "leader-freeze", tmp_path))
    frozen, elected = out["sigstop-the-leader"], out["new-leader-elected"]
    assert elected["leader"] != frozen["host"] and elected["epoch"] > frozen["epoch"]
    assert out["old-leader-stepped-down"]["pid"] == frozen["pid"]
    assert out["submit-stream"]["accepted"] == out["stream-jobs-succeed"]["succeeded"]


def test_an_agent_host_partitioned_past_the_grace_and_healed(deployment: Deployment, tmp_path: Path) -> None:
    """All links of a running job's node host down past the node-lost grace
    (chaos/agent-partition.json): its agent stops the run itself, the job is re-placed and
    succeeds on another node, no instance ran on two nodes at once, and after the heal the run is
    not restarted."""
    out = outputs(run_cli(deployment.root, "agent-partition", tmp_path))
    replaced, lost = out["job-re-placed-and-succeeds"], out["node-declared-lost"]
    assert replaced["node"] != replaced["lost_node"] == lost["node"] and replaced["attempt"] >= 1
    assert out["heal-the-partition"]["healed"] == [out["partition-the-job-s-node"]["host"]]
