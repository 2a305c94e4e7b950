"""Cordons with reasons: a node holds a set of cordons keyed by who set them (admin, alert,
incident, drill, chaos), each with when, by whom and why; an uncordon removes its own source's
only; the node is unschedulable while it holds any (through the HTTP API over a real plane)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.drills.fakes import FakeApi, job
from tests.support.auth import with_auth
from tests.support.plane import CAROL, DAN, Harness

from apiary.api import create_app
from apiary.client import ApiaryClient
from apiary.drills.diagnosis import load_rules
from apiary.drills.stress import stress
from apiary.ops.alerts import ActionsConfig, AlertmanagerPayload, AlertReceiver, Rule


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path, "one-vc")


@pytest.fixture
def client(h: Harness) -> TestClient:
    return with_auth(TestClient(create_app(h.plane)), h.plane)  # the admin's token unless told otherwise


def node_of(client: TestClient, name: str = DAN) -> dict:
    r = client.get(f"/api/v2/nodes/{name}")
    assert r.status_code == 200, r.text
    return r.json()


def held(client: TestClient, name: str = DAN) -> dict[str, str]:
    """source -> reason of the node's cordons, as the API lists them."""
    return {c["source"]: c["reason"] for c in node_of(client, name)["cordons"]}


def cordon(client: TestClient, body: dict, name: str = DAN) -> dict:
    r = client.put(f"/api/v2/nodes/{name}/cordon", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def incident_action(client: TestClient, incident: str, action: str) -> dict:
    r = client.post(f"/api/v2/incidents/{incident}/actions", json={"action": action, "node": DAN})
    assert r.status_code == 200, r.text
    return r.json()


def test_an_incident_s_undo_leaves_an_admin_s_cordon_in_place(client: TestClient) -> None:
    cordon(client, {"value": True, "reason": "fan replaced, burn-in first"})
    r = client.post("/api/v2/incidents", json={"title": "GPU fell off the bus", "severity": "sev2"})
    assert r.status_code in (200, 201), r.text
    incident = str(r.json()["id"])
    assert incident_action(client, incident, "cordon-node")["result"] == "ok"
    assert held(client) == {"admin": "fan replaced, burn-in first",
                            f"incident:{incident}": f"incident {incident}: GPU fell off the bus"}
    by = {c["source"]: c["by"] for c in node_of(client)["cordons"]}
    assert by[f"incident:{incident}"] == "root"  # the responder who ran the action
    undo = incident_action(client, incident, "uncordon-node")
    assert undo["result"] == "ok" and "still cordoned by admin" in undo["detail"]
    n = node_of(client)
    assert held(client) == {"admin": "fan replaced, burn-in first"}
    assert (n["cordoned"], n["schedulable"]) == (True, False)
    (admin,) = n["cordons"]
    assert admin["by"] == "root" and admin["at"].endswith("Z")


def test_an_alert_action_s_cordon_is_listed_with_its_reason_and_its_undo_leaves_the_admin_s(
        h: Harness, client: TestClient) -> None:
    receiver = AlertReceiver(h.plane, ActionsConfig(rules=[Rule(match={}, actions=["cordon-node"])]), notifiers={})
    body = {"version": "4", "status": "firing", "receiver": "apiary", "groupKey": "{}", "alerts": [{
        "status": "firing", "labels": {"alertname": "ApiaryGpuXidError", "node": DAN},
        "annotations": {"summary": "XID 79 on GPU 0"}, "startsAt": "2026-11-22T00:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z", "fingerprint": "f1"}]}
    (done,) = receiver.receive(AlertmanagerPayload.model_validate(body))
    assert done["status"] == "ok"
    cordon(client, {"value": True, "reason": "memory test"})
    n = node_of(client)
    assert {c["source"]: (c["reason"], c["by"]) for c in n["cordons"]} == {
        "alert:ApiaryGpuXidError": ("ApiaryGpuXidError: XID 79 on GPU 0", "alertmanager"),
        "admin": ("memory test", "root")}
    # The same alert's uncordon (an Alertmanager receiver selecting it) lifts its own cordon only.
    (undo,) = receiver.receive(AlertmanagerPayload.model_validate({**body, "alerts": [
        {**body["alerts"][0], "fingerprint": "f2"}]}), ["uncordon-node"])
    assert undo["status"] == "ok"
    assert held(client) == {"admin": "memory test"} and node_of(client)["cordoned"] is True


def test_a_stress_drill_s_cordon_is_listed_with_the_failed_rules(h: Harness, client: TestClient) -> None:
    real = ApiaryClient("http://testserver", transport=client._transport)
    real._http.auth = client.auth

    class Wired(FakeApi):  # the drill's jobs are faked; its cordon goes to the real API
        def cordon(self, node: str, value: bool = True, **kw: object) -> dict:
            return real.cordon(node, value, **kw)  # type: ignore[arg-type]

    def ran_on_its_node(doc: dict) -> list[dict]:
        sku = doc["extras"]["hivedScheduler"]["taskRoles"]["bench"]["skuType"]
        where = {"GPU-C": CAROL, "GPU-D": DAN}[sku]
        return [job(doc["id"], "SUCCEEDED", node=where, started=1.0, completed=2.0)]

    def bench(matmul: float) -> str:
        return json.dumps({"apiary_bench": 1, "ok": True, "metrics": {"matmul_gflops": matmul,
                                                                     "mem_bandwidth_gbps": 10.0}})

    nodes = [{"name": n, "gpus": 1, "skuType": s, "schedulable": True, "cordoned": False, "simulatedGpus": True}
             for n, s in ((CAROL, "GPU-C"), (DAN, "GPU-D"))]
    api = Wired(ran_on_its_node, nodes=nodes, logs={CAROL: bench(40), DAN: bench(4)})
    rep = stress(api, load_rules(), image="python:3.11", clock=lambda: 0.0, sleep=lambda s: None)
    assert rep.cordoned == [DAN]
    (c,) = node_of(client)["cordons"]
    assert c["source"] == "drill:stress" and c["by"] == "root"
    assert c["reason"].startswith("stress drill failed: matmul-below-baseline")
    # An admin's uncordon is not the drill's: the node stays out until its own source is lifted.
    assert cordon(client, {"value": False})["cordoned"] is True
    assert cordon(client, {"value": False, "source": "drill:stress"})["cordons"] == []


def test_an_admin_s_uncordon_clears_the_admin_s_only_and_all_clears_every_cordon(client: TestClient) -> None:
    cordon(client, {"value": True, "reason": "first"})
    cordon(client, {"value": True, "source": "chaos:cordon_node", "reason": "experiment"})
    again = cordon(client, {"value": True, "reason": "second"})  # the same source: one cordon, the new reason
    assert [(c["source"], c["reason"]) for c in again["cordons"]] == [("admin", "second"),
                                                                      ("chaos:cordon_node", "experiment")]
    assert [c["source"] for c in cordon(client, {"value": False})["cordons"]] == ["chaos:cordon_node"]
    cordon(client, {"value": True})
    cleared = cordon(client, {"value": False, "all": True})
    assert (cleared["cordons"], cleared["cordoned"], cleared["schedulable"]) == ([], False, True)


@pytest.mark.parametrize(("body", "field"), [
    ({"value": True, "all": True}, "all"),
    ({"value": True, "source": "somebody"}, "source"),
    ({"value": True, "source": "incident:"}, "source"),
    ({"value": True, "reason": "x" * 501}, "reason"),
])
def test_a_bad_cordon_request_is_a_400_naming_its_field(client: TestClient, body: dict, field: str) -> None:
    r = client.put(f"/api/v2/nodes/{DAN}/cordon", json=body)
    assert r.status_code == 400 and field in r.json()["message"], r.text
    assert node_of(client)["cordons"] == []


def test_only_admins_cordon_and_anyone_may_read_a_node(client: TestClient) -> None:
    as_bob = {"X-Test-User": "bob"}
    assert client.put(f"/api/v2/nodes/{DAN}/cordon", json={"value": True}, headers=as_bob).status_code == 403
    assert client.get(f"/api/v2/nodes/{DAN}", headers=as_bob).json()["cordons"] == []
    assert client.get("/api/v2/nodes/no-such-node").status_code == 404


def test_the_scheduler_places_nothing_on_a_node_with_any_cordon_until_the_last_is_gone(h: Harness) -> None:
    h.plane.cordon(DAN, reason="disk")
    h.plane.cordon(DAN, source="incident:7", reason="incident 7: ECC")
    first = h.submit(0, user="alice", defaults__virtualCluster="default")
    second = h.submit(0, user="bob", defaults__virtualCluster="default")
    result = h.cycle()
    assert result.placed == [first] and h.task(first)["node"] == CAROL and second in result.waiting
    h.plane.cordon(DAN, False, source="incident:7")  # the incident's undo: the admin's cordon holds
    assert second in h.cycle().waiting
    h = h.restart()  # the cordons are durable, and so is what is left
    h.report_all()
    assert second in h.cycle().waiting
    assert [c["source"] for c in next(n for n in h.plane.list_nodes() if n["name"] == DAN)["cordons"]] == ["admin"]
    h.plane.cordon(DAN, False)
    assert h.cycle().placed == [second] and h.task(second)["node"] == DAN


def test_an_incident_with_the_longest_title_still_cordons_its_node(client: TestClient) -> None:
    """A cordon's reason holds 500 characters; an incident's title may be 500 too: the reason is
    cut, the cordon is not refused."""
    r = client.post("/api/v2/incidents", json={"title": "x" * 495, "severity": "sev2"})
    assert r.status_code in (200, 201), r.text
    incident = str(r.json()["id"])
    assert incident_action(client, incident, "cordon-node")["result"] == "ok"
    reason = held(client)[f"incident:{incident}"]
    assert reason.startswith(f"incident {incident}: xxx") and len(reason) == 500
