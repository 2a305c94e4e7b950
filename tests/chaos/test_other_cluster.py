"""The experiments on a cluster that is not Lab 6's: one VC (``research``) of two nodes
(``gpu-worker-a``, ``gpu-worker-b``), no VC or node configured. The experiments find their probe VC,
load VC and fault node through the API (apiary.chaos.target.pick_defaults) and pass."""

from __future__ import annotations

import pytest
from tests.chaos.conftest import DATA, outputs, run_checked, start_platform

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    p = start_platform(tmp_path_factory.mktemp("one-vc-home"), cluster=DATA / "one-vc-two-nodes.yaml")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def journals(tmp_path_factory):
    return tmp_path_factory.mktemp("one-vc-journals")


def test_gpu_faults_pick_a_node_of_the_one_vc_and_probe_on_the_other(platform, journals):
    journal = run_checked(platform, "gpu-faults", journals)
    out = outputs(journal)
    assert out["cordon-faulty-node"] == {"node": "gpu-worker-b", "cordoned": True, "cordons": ["chaos:cordon_node"]}
    assert out["xid-79-visible"] == 79
    assert not any(n["cordoned"] for n in platform.client().nodes())  # the rollback uncordoned it


def test_kill_agent_keeps_its_in_flight_job_in_the_one_vc(platform, journals):
    journal = run_checked(platform, "kill-agent", journals)
    job = platform.client().get(outputs(journal)["inflight-job-succeeds-unrestarted"]["job"])
    assert job["virtualCluster"] == "research" and job["state"] == "SUCCEEDED"
