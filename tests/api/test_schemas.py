"""The API's declared shapes (``/openapi.json``, :mod:`apiary.api.schemas`) against what it answers.

Every route documents a non-empty 2xx body; every answer of a real ControlPlane (temp SQLite,
Lab 6's two-VC cluster, injected clock) round-trips through its response model unchanged, and the
reads equal the plane's own dicts, so a field the plane adds or renames without the model fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, TypeAdapter
from tests.support.auth import with_auth
from tests.support.builders import LAB6, job_text

from apiary.api import create_app
from apiary.api import schemas as s
from apiary.control import ControlPlane
from apiary.control.config import check_cluster_config
from apiary.errors import ValidationError
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

T0 = 1_700_000_000.0
NODES = ("hostname-carol", "hostname-dan")
# Lab 6's two-VC config with every VC asking for 3 node cells of which 1 exists.
OVERSUBSCRIBED = (LAB6 / "hived-config-two-vcs.yaml").read_text().replace("cellNumber: 1", "cellNumber: 3")
OVERSUBSCRIBED_FIELD = "virtualClusters.default.virtualCells[0]"
PROBE = {"exec": {"command": ["true"]}, "periodSeconds": 5}


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs", clock=lambda: T0)
    yield plane
    engine.dispose()


@pytest.fixture
def client(plane: ControlPlane):
    with with_auth(TestClient(create_app(plane, AlertReceiver(plane, ActionsConfig()))), plane) as c:
        yield c


def shaped(body: object, model: object, *, exclude_unset: bool = False) -> object:
    """``body`` after a round trip through ``model`` (a model class or a type such as ``list[M]``)."""
    adapter = TypeAdapter(model)
    return adapter.dump_python(adapter.validate_python(body), mode="json", exclude_unset=exclude_unset)


def ok(r, status: int = 200) -> object:
    assert r.status_code == status, r.text
    return r.json()


def report(client: TestClient, node: str, runs: list[dict] | None = None, **extra) -> dict:
    body = {"agentId": "t", "gpus": 1, "simulatedGpus": True, "address": "127.0.0.1", "runs": runs or [], **extra}
    return ok(client.post(f"/api/v2/nodes/{node}/status", json=body))


# ------------------------------------------------------------------------------ the documents
def test_every_route_documents_its_answer(client: TestClient) -> None:
    spec = ok(client.get("/openapi.json"))
    seen = 0
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            answers = {code: r for code, r in op["responses"].items() if code.startswith("2")}
            assert answers, f"{method} {path} documents no 2xx answer"
            for code, answer in answers.items():
                if code == "204":
                    assert not answer.get("content"), f"{method} {path} 204 with a body"
                    continue
                schemas = [c.get("schema") for c in answer.get("content", {}).values()]
                assert schemas and all(schemas), f"{method} {path} {code} has no response schema"
            if path not in ("/metrics", "/healthz"):
                # Errors are documented as ErrorBody, not as FastAPI's 422 (Apiary answers 400 naming the field).
                assert "422" not in op["responses"], f"{method} {path}"
                for code in ("4XX", "5XX"):
                    assert "application/json" in op["responses"][code]["content"], f"{method} {path} {code}"
            seen += 1
    assert seen == 103  # 26 job, cluster, node, agent and alert routes; 17 identity routes; 2 drill routes; 7 CI
    # routes; 11 incident and on-call routes (the signed-link pages are left out: they are for browsers); 5 routes
    # of joining nodes; 12 storage routes; 4 ssh routes (a user's keys, a job's SSH info); 5 methods of the proxy
    # to a task's port; 3 image catalogue routes; 6 template routes; 5 model registry routes (4 models, 1 identity)
    props = spec["components"]["schemas"]
    assert {"retryDetails", "tasks", "waitingReason"} <= set(props["JobJson"]["properties"])
    assert "faultsApplied" in props["NodeReport"]["properties"]
    assert set(props["ClusterStatus"]["properties"]) == {"virtualClusters", "physical", "nodes", "groups",
                                                         "reservations"}
    assert set(props["ErrorBody"]["properties"]) == {"code", "message", "field"}


@pytest.mark.parametrize("model", [m for m in vars(s).values()
                                   if isinstance(m, type) and issubclass(m, BaseModel) and m is not BaseModel],
                         ids=lambda m: m.__name__)
def test_models_keep_the_wire_names(model: type[BaseModel]) -> None:
    # camelCase for Apiary's own JSON, the agent's snake_case records as they are: no aliases anywhere.
    assert all(f.alias is None for f in model.model_fields.values())


# ------------------------------------------------------------------------------ the answers
def test_answers_round_trip_through_their_models_and_equal_the_plane(client: TestClient, plane: ControlPlane) -> None:
    for node in NODES:
        assert shaped(report(client, node), s.NodeReportAck, exclude_unset=True) == {"ack": []}
    probed = job_text(5, **{"extras.apiary.taskRoles.train.livenessProbe": PROBE})
    job = ok(client.post("/api/v2/jobs", content=probed, headers={"X-Test-User": "alice"}), 202)
    jid = job["id"]
    assert shaped(job, s.JobJson) == job == plane.get_job(jid)
    assert job["state"] == "WAITING" and job["tasks"][0]["node"] is None

    cycle = ok(client.post("/api/v2/scheduler/cycle"))
    assert shaped(cycle, s.CycleResultJson) == cycle and cycle["placed"] == [jid]

    fault = ok(client.post("/api/v2/nodes/hostname-dan/faults", json={"gpu": 0, "eccDbe": 2}))
    assert shaped(fault, s.Fault, exclude_unset=True) == fault == {"id": fault["id"], "gpu": 0, "ecc_dbe": 2}
    cleared = ok(client.post("/api/v2/nodes/hostname-dan/faults", json={"gpu": 0, "clear": True}))
    assert cleared == {"id": fault["id"] + 1, "gpu": 0, "clear": True}

    runs = {}
    for node in NODES:
        got = ok(client.get(f"/api/v2/nodes/{node}/assignments"))
        assert shaped(got, s.Assignments, exclude_unset=True) == got
        assert got == {"generation": plane.node_generation(node), "assignments": plane.assignments(node),
                       "faults": plane.node_faults(node)}
        runs.update({a["runId"]: node for a in got["assignments"]})
    (run_id, node), = runs.items()
    assignment = ok(client.get(f"/api/v2/nodes/{node}/assignments"))["assignments"][0]
    assert assignment["probes"]["livenessProbe"]["exec"] == {"command": ["true"]}
    # Every field but the storage and ssh ones, which a launch carries only when the job has them.
    assert set(assignment["launch"]) == set(s.TaskLaunch.model_fields) - {"mounts", "mountError", "ssh"}
    assert ok(client.get("/api/v2/nodes/hostname-dan/assignments"))["faults"] == [fault, cleared]

    running = {"run_id": run_id, "state": "running", "pid": 7, "started_at": T0}
    assert report(client, node, [running]) == {"ack": []}
    size = ok(client.post(f"/api/v2/nodes/{node}/logs", params={"runId": run_id, "stream": "stdout", "offset": 0},
                          content=b"epoch 1\n"))
    assert shaped(size, s.LogAppended) == size == {"size": 8}

    job = ok(client.get(f"/api/v2/jobs/{jid}"))
    assert shaped(job, s.JobJson) == job == plane.get_job(jid)
    assert job["tasks"][0]["state"] == "RUNNING" and job["retryDetails"] == {"user": 0, "platform": 0}
    jobs = ok(client.get("/api/v2/jobs"))
    assert shaped(jobs, list[s.JobJson]) == jobs == plane.list_jobs() == [job]

    events = ok(client.get("/api/v2/events"))
    assert shaped(events, s.EventsPage) == events == {"events": plane.events()}

    for vc in (None, "default"):
        status = ok(client.get("/api/v2/cluster/status", params={"vc": vc} if vc else None))
        assert shaped(status, s.ClusterStatus) == status == plane.cluster_status(vc)
    assert status["groups"][jid]["placements"][0]["node"] == node

    nodes = ok(client.get("/api/v2/nodes"))
    assert shaped(nodes, list[s.NodeJson]) == nodes == plane.list_nodes()
    cordoned = ok(client.put("/api/v2/nodes/hostname-carol/cordon", json={"value": True}))
    assert shaped(cordoned, s.NodeJson) == cordoned and cordoned["cordoned"] is True

    applied = ok(client.put("/api/v2/cluster/config", content=(LAB6 / "hived-config-two-vcs.yaml").read_text()))
    assert shaped(applied, s.ReconfigureResult) == applied == {"kept": [jid], "stopped": {}}

    stopped = ok(client.put(f"/api/v2/jobs/{jid}/executionType", json={"value": "STOP"}))
    assert shaped(stopped, s.JobJson) == stopped and stopped["executionType"] == "STOP"

    alert = {"status": "firing", "labels": {"alertname": "GpuHot", "node": "hostname-dan"},
             "startsAt": "2026-01-01T00:00:00Z", "fingerprint": "f1"}
    hook = ok(client.post("/api/v2/alerts/webhook", params={"action": "cordon-node"},
                          json={"version": "4", "status": "firing", "alerts": [alert]}))
    assert shaped(hook, s.WebhookResult) == hook and hook["actions"][0]["status"] == "ok"
    alerts = ok(client.get("/api/v2/alerts"))
    assert shaped(alerts, s.AlertsPage) == alerts and len(alerts["alerts"]) == len(alerts["actions"]) == 1

    health = ok(client.get("/healthz"))
    assert shaped(health, s.Health) == health and health["status"] == "ok"


def test_node_report_passes_the_fault_high_water_mark(client: TestClient, plane: ControlPlane,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []  # reports node_report took, or bare_heartbeat when it changes nothing stored
    real_report, real_beat = plane.node_report, plane.bare_heartbeat
    monkeypatch.setattr(plane, "node_report", lambda node, **kw: seen.append(kw) or real_report(node, **kw))
    monkeypatch.setattr(plane, "bare_heartbeat", lambda node, **kw: real_beat(node, **kw) and not seen.append(kw))
    report(client, "hostname-dan", faultsApplied=3)
    report(client, "hostname-dan")
    assert [kw["faults_applied"] for kw in seen] == [3, None]


def test_validation_errors_name_their_field_in_the_body(client: TestClient) -> None:
    r = client.post("/api/v2/nodes/hostname-carol/status", json={"gpus": 1})
    assert r.status_code == 400 and r.json() == {
        "code": "InvalidParametersError", "message": "agentId: Field required", "field": "agentId"}
    r = client.get("/api/v2/jobs/alice~nope")
    assert r.status_code == 404 and set(r.json()) == {"code", "message"}


def test_an_oversubscribed_config_is_the_same_400_live_and_at_startup(client: TestClient) -> None:
    with pytest.raises(ValidationError) as startup:
        check_cluster_config(OVERSUBSCRIBED)
    assert startup.value.field == OVERSUBSCRIBED_FIELD
    r = client.put("/api/v2/cluster/config", content=OVERSUBSCRIBED)
    assert r.status_code == 400
    assert r.json() == startup.value.to_dict()
