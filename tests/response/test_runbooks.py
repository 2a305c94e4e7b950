"""The runbooks against a real API on loopback (a control plane over SQLite, fake agents): each
step through the incident's routes, so each is in the timeline; the GPU reset waits for the node's
agent to apply it (the fake agent applies it when the runbook polls)."""

from __future__ import annotations

from tests.support.auth import Principals
from tests.support.plane import Harness
from tests.support.serving import serving

from apiary.api import create_app
from apiary.auth import Directory
from apiary.client import ApiaryClient
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.response.runbooks import RunbookApi, gpu_node_repair, node_drain


def _platform(tmp_path):
    h = Harness(tmp_path, "one-vc")
    token = Principals(Directory(h.plane.sessions), ["default"]).admin()
    app = create_app(h.plane, AlertReceiver(h.plane, ActionsConfig(), notifiers={}))
    return h, token, app


def test_gpu_node_repair_contains_resets_verifies_and_returns_the_node(tmp_path):
    h, token, app = _platform(tmp_path)
    node = h.nodes[0]
    with serving(app) as url:
        client = ApiaryClient(url, token=token)
        iid = client._call("POST", "/api/v2/incidents", json={"title": "ECC on GPU 0", "severity": "sev2",
                                                               "nodes": [node]}).json()["id"]
        client._call("POST", f"/api/v2/nodes/{node}/faults", json={"gpu": 0, "eccDbe": 1})

        def agent_applies(_s: float) -> None:  # the node's agent takes its queued faults
            faults = h.plane.node_faults(node)
            h.plane.node_report(node, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=[],
                                faults_applied=max(f["id"] for f in faults) if faults else None)

        steps = gpu_node_repair(RunbookApi(client), iid, node, sleep=agent_applies)
        assert [(s.name, s.ok) for s in steps] == [("cordon-node", True), ("drain-node", True),
                                                   ("reset-gpus", True), ("verify", True), ("uncordon-node", True)]
        assert not next(n for n in client.nodes() if n["name"] == node)["cordoned"]
        timeline = client._call("GET", f"/api/v2/incidents/{iid}").json()["timeline"]
        actions = [e["detail"]["action"] for e in timeline if e["event"] == "action"]
        assert actions == ["cordon-node", "drain-node", "uncordon-node"]
        assert "runbook gpu-node-repair" in timeline[-1]["detail"]["text"]


def test_a_reset_the_agent_never_applies_stops_the_runbook_with_the_node_cordoned(tmp_path):
    h, token, app = _platform(tmp_path)
    node = h.nodes[1]
    clock = iter(range(0, 1000, 30))
    with serving(app) as url:
        client = ApiaryClient(url, token=token)
        iid = client._call("POST", "/api/v2/incidents", json={"title": "x", "nodes": [node]}).json()["id"]
        steps = gpu_node_repair(RunbookApi(client), iid, node, verify_s=60, sleep=lambda s: None,
                                clock=lambda: float(next(clock)))
        assert [(s.name, s.ok) for s in steps][-1] == ("verify", False)
        assert next(n for n in client.nodes() if n["name"] == node)["cordoned"]
        assert [(s.name, s.ok) for s in node_drain(RunbookApi(client), iid, node)] == [
            ("cordon-node", True), ("drain-node", True)]
