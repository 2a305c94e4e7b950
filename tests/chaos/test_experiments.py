"""The CI experiments of chaos/ on one live embedded platform (no Prefect), in order; each leaves
the platform in its steady state (that is what it checks), so the next one starts from it.

Plus: an experiment whose rollback is broken is reported as failed, naming that rollback (through
``apiary chaos run``, which also prints the table and exits 1).
"""

from __future__ import annotations

import json
import shutil

import pytest
from tests.chaos.conftest import DATA, is_root, outputs, run_checked, start_platform
from typer.testing import CliRunner

from apiary.cli.main import app

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    p = start_platform(tmp_path_factory.mktemp("chaos-home"))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def journals(tmp_path_factory):
    return tmp_path_factory.mktemp("journals")


def test_kill_control_plane(platform, journals):
    old = platform.children["control-plane"].proc.pid
    journal = run_checked(platform, "kill-control-plane", journals)
    killed = outputs(journal)["kill-9-control-plane"]
    assert killed["killed"] == [old] and killed["new_pid"] == platform.children["control-plane"].proc.pid
    assert outputs(journal)["inflight-job-succeeds"]["attempt"] == 0


def test_kill_agent(platform, journals):
    old = platform.children["agent"].proc.pid
    journal = run_checked(platform, "kill-agent", journals)
    assert outputs(journal)["kill-9-agent"]["killed"] == [old]
    assert platform.children["agent"].proc.pid != old


def test_node_freeze(platform, journals):
    journal = run_checked(platform, "node-freeze", journals)
    out = outputs(journal)
    assert out["freeze-agent-and-tasks"]["agent_pid"] == platform.children["agent"].proc.pid
    assert sorted(out["nodes-declared-lost"]) == ["hostname-carol", "hostname-dan"]
    # its node was lost while it ran: retried as a platform retry, never counted against the user
    assert out["inflight-job-succeeds"]["retryDetails"]["user"] == 0


def test_gpu_faults(platform, journals):
    journal = run_checked(platform, "gpu-faults", journals)
    out = outputs(journal)
    assert out["xid-79-visible"] == 79 and out["temperature-visible"] == 95
    dan = next(n for n in platform.client().nodes() if n["name"] == "hostname-dan")
    assert not dan["cordoned"]


def test_gpu_oom_job(platform, journals):
    journal = run_checked(platform, "gpu-oom-job", journals)
    failed = outputs(journal)["fails-as-cuda-oom"]
    assert (failed["exitCode"], failed["exitPhrase"]) == (226, "ContainerCudaOOMKilled")
    assert failed["job"].startswith("chaos-user~cuda-oom-") and failed["retryDetails"]["user"] == 0


@pytest.mark.skipif(not is_root() or shutil.which("ip") is None, reason="network namespaces need root and `ip`")
def test_network_degraded(platform, journals):
    journal = run_checked(platform, "network-degraded", journals)
    out = outputs(journal)
    assert out["attach-netns-node"]["node"] == "chaos-net-0"
    assert out["degrade-network"]["loss_pct"] == 10
    assert "iptables_dropped_packets" in out["restore-network"]  # (random: usually > 0, not always)
    assert "chaos-net-0" not in {n["name"] for n in platform.client().nodes()}  # detached: config restored


def test_a_broken_rollback_fails_the_verdict_naming_it(platform, journals):
    token = (platform.home / "token").read_text().strip()
    r = CliRunner().invoke(app, [
        "chaos", "run", str(DATA / "broken-rollback.json"), "--target", platform.api_url, "--token", token,
        "--home", str(platform.home), "--journal-dir", str(journals), "--json"])
    assert r.exit_code == 1, r.output
    (verdict,) = json.loads(r.stdout)
    assert verdict["passed"] is False
    assert len(verdict["reasons"]) == 1
    assert verdict["reasons"][0].startswith("rollback uncordon-a-node-that-does-not-exist failed: ")
    assert "no-such-node" in verdict["reasons"][0]
    journal = json.loads(open(verdict["journal"]).read())
    # chaostoolkit itself calls this run a success: only the journal's rollbacks tell
    assert journal["status"] == "completed" and not journal["deviated"] and verdict["exit_code"] == 0
