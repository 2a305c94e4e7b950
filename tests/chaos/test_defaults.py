"""The experiments' configuration resolution: with no VC or node configured (the experiments'
default, an empty value), the probe VC, load VC and fault node come from the target cluster, read
through the API (a fake answer here), never from Lab 6's names."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
from tests.chaos.conftest import DATA, EXPERIMENTS
from tests.support.builders import LAB6

from apiary.chaos import actions
from apiary.chaos.target import ClusterDefaults, Target, nodes_by_vc, pick_defaults
from apiary.client import ApiaryClient
from apiary.errors import ValidationError
from apiary.spec.cluster import load_cluster_config

ONE_VC = DATA / "one-vc-two-nodes.yaml"


def test_lab6_keeps_its_names() -> None:
    vc_nodes = nodes_by_vc(load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"))
    assert vc_nodes == {"default": ["hostname-carol"], "vc1": ["hostname-dan"]}
    assert pick_defaults(["default", "vc1"], ["hostname-carol", "hostname-dan"], vc_nodes) == ClusterDefaults(
        probe_vc="default", load_vc="vc1", fault_node="hostname-dan")


def test_a_one_vc_cluster_probes_on_one_node_and_faults_the_other() -> None:
    vc_nodes = nodes_by_vc(load_cluster_config(ONE_VC))
    assert pick_defaults(["research"], ["gpu-worker-a", "gpu-worker-b"], vc_nodes) == ClusterDefaults(
        probe_vc="research", load_vc="research", fault_node="gpu-worker-b")


@pytest.mark.parametrize(("vcs", "nodes", "vc_nodes", "expected"), [
    pytest.param(["team"], ["n1"], None, ("team", "team", "n1"), id="one-node: its only node"),
    pytest.param(["b", "a"], ["n1", "n2", "n3"], {"b": ["n2", "n3"], "a": ["n1"]}, ("b", "a", "n1"),
                 id="config-order-not-alphabetical"),
    pytest.param(["x", "y"], ["n1", "n2"], None, ("x", "x", "n2"), id="no-home: every node serves every VC"),
])
def test_pick_defaults(vcs, nodes, vc_nodes, expected) -> None:
    d = pick_defaults(vcs, nodes, vc_nodes)
    assert (d.probe_vc, d.load_vc, d.fault_node) == expected


def test_an_empty_cluster_is_a_validation_error_naming_the_key() -> None:
    with pytest.raises(ValidationError, match="apiary_probe_vc"):
        pick_defaults([], ["n1"])
    with pytest.raises(ValidationError, match="apiary_fault_node"):
        pick_defaults(["v"], [])


@pytest.fixture
def fake_api(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[dict, list[str]]:
    """A home with the one-VC cluster config and a fake API answering for it; returns the
    configuration an experiment would pass (its VC and node keys empty) and the requests seen."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        path = request.url.path
        if path == "/api/v2/cluster/status":
            return httpx.Response(200, json={"virtualClusters": {"research": {}}, "physical": {}, "nodes": {},
                                             "groups": {}, "reservations": {}})
        if path == "/api/v2/nodes":
            return httpx.Response(200, json=[{"name": "gpu-worker-a", "gpus": 1}, {"name": "gpu-worker-b", "gpus": 1}])
        if path.endswith("/cordon"):
            body = json.loads(request.content)
            cordons = [{"source": body["source"], "reason": body.get("reason", "")}] if body["value"] else []
            return httpx.Response(200, json={"name": path.split("/")[-2], "cordoned": body["value"],
                                             "cordons": cordons})
        return httpx.Response(404, json={"code": "NotFoundError", "message": path})

    monkeypatch.setattr(Target, "client", lambda self, timeout=30.0: ApiaryClient(
        self.api_url, token=self.token, transport=httpx.MockTransport(handler)))
    home = tmp_path / "home"
    home.mkdir()
    (home / "cluster.yaml").write_text(ONE_VC.read_text())
    for env in ("APIARY_CHAOS_VC", "APIARY_CHAOS_LOAD_VC", "APIARY_CHAOS_NODE", "APIARY_API_URL"):
        monkeypatch.delenv(env, raising=False)
    configuration = {"apiary_url": f"http://apiary-{uuid.uuid4().hex[:8]}.test", "apiary_token": "t",
                     "apiary_home": str(home), "apiary_probe_vc": "", "apiary_load_vc": "", "apiary_fault_node": ""}
    return configuration, seen


def test_an_experiment_s_empty_names_resolve_to_the_target_cluster_s(fake_api) -> None:
    configuration, seen = fake_api
    t = Target.of(configuration)
    assert (t.probe_vc, t.load_vc, t.fault_node) == ("research", "research", "gpu-worker-b")
    assert seen == ["GET /api/v2/cluster/status", "GET /api/v2/nodes"]
    Target.of(configuration).probe_vc  # noqa: B018 - read once per run: no second request
    assert len(seen) == 2
    # what gpu-faults' "${apiary_fault_node}" becomes when APIARY_CHAOS_NODE is unset
    assert actions.cordon_node("", configuration=configuration) == {
        "node": "gpu-worker-b", "cordoned": True, "cordons": ["chaos:cordon_node"]}
    assert actions.uncordon_node("", configuration=configuration) == {
        "node": "gpu-worker-b", "cordoned": False, "cordons": []}
    assert seen[-1] == "PUT /api/v2/nodes/gpu-worker-b/cordon"


def test_configured_names_win_and_need_no_request(fake_api) -> None:
    configuration, seen = fake_api
    t = Target.of({**configuration, "apiary_probe_vc": "p", "apiary_load_vc": "l", "apiary_fault_node": "n"})
    assert (t.probe_vc, t.load_vc, t.fault_node) == ("p", "l", "n") and seen == []


def test_no_experiment_names_a_lab6_vc_or_node() -> None:
    for path in EXPERIMENTS.glob("*.json"):
        text = path.read_text()
        assert "hostname-" not in text and '"vc1"' not in text and '"default": "default"' not in text, path.name
        config = json.loads(text)["configuration"]
        for key in ("apiary_probe_vc", "apiary_load_vc", "apiary_fault_node"):
            assert config.get(key, {"default": ""})["default"] == "", (path.name, key)

