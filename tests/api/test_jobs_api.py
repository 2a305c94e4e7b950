"""The REST API (FastAPI TestClient) over a ControlPlane on a temp SQLite file.

The cluster is Lab 6's one-VC config (VC default = hostname-carol + hostname-dan, one GPU each), so
the quota check (a gang of 4 in a 2-GPU VC) can be exercised; valid jobs are Lab 6 files in VC default.
Scheduling cycles and node reports are driven through the API itself, synchronously.
"""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlalchemy import event as sa_event
from tests.support.auth import with_auth
from tests.support.builders import job_text

from apiary.api import create_app
from apiary.api.schemas import FaultRequest
from apiary.control import ControlPlane
from apiary.errors import NotFoundError, ValidationError
from apiary.monitoring.gpu_health import PCIE_GENS, PCIE_WIDTHS, THROTTLE_FAULTS
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

REPO = Path(__file__).resolve().parents[2]
LAB6 = REPO / "examples" / "lab6"
T0 = 1_700_000_000.0
NODES = ("hostname-carol", "hostname-dan")

JOB_FIELDS = {
    "id", "name", "user", "virtualCluster", "priorityClass", "state", "retries", "retryDetails",
    "submissionTime", "launchTime", "completionTime", "exitCode", "waitingReason", "tasks",
}
TASK_FIELDS = {"taskRole", "index", "state", "node", "gpus", "exitCode"}




def renamed_role(n: int, new: str) -> str:
    doc = yaml.safe_load(job_text(n))
    doc["taskRoles"][new] = doc["taskRoles"].pop("train")
    return yaml.safe_dump(doc, sort_keys=False)


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def plane(tmp_path: Path, clock: Clock) -> ControlPlane:
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(
        session_factory(engine),
        load_cluster_config(LAB6 / "hived-config-one-vc.yaml"),
        tmp_path / "logs",
        clock=clock,
    )
    yield plane
    engine.dispose()


@pytest.fixture
def client(plane: ControlPlane):
    with with_auth(TestClient(create_app(plane)), plane) as c:
        yield c


def report(client: TestClient, node: str, runs: list[dict] | None = None) -> dict:
    r = client.post(
        f"/api/v2/nodes/{node}/status",
        json={"agentId": "t", "gpus": 1, "simulatedGpus": True, "address": "127.0.0.1", "runs": runs or []},
    )
    assert r.status_code == 200, r.text
    return r.json()


def submit(client: TestClient, text: str, user: str = "alice"):
    return client.post("/api/v2/jobs", content=text, headers={"X-Test-User": user})


def assignment(client: TestClient, job_id: str) -> tuple[str, dict]:
    for node in NODES:
        for a in client.get(f"/api/v2/nodes/{node}/assignments").json()["assignments"]:
            if a["launch"]["job_id"] == job_id:
                return node, a
    raise AssertionError(f"{job_id} has no assignment")


def run_status(run_id: str, state: str, code: int | None = None) -> dict:
    return {
        "run_id": run_id, "state": state, "exit_code": code, "pid": 7, "started_at": T0 + 1,
        "finished_at": T0 + 5 if state == "exited" else None,
    }


# ---------------------------------------------------------------------------------- happy path
def test_submit_list_get_run_logs_and_events(client: TestClient) -> None:
    for node in NODES:
        report(client, node)
    r = submit(client, job_text(5))
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["id"] == "alice~job-config-5"
    assert job["state"] == "WAITING"
    jid = job["id"]
    first_seq = client.get("/api/v2/events").json()["events"][-1]["seq"]

    listed = client.get("/api/v2/jobs").json()
    assert [j["id"] for j in listed] == [jid]
    assert client.get("/api/v2/jobs", params={"username": "bob"}).json() == []
    assert [j["id"] for j in client.get("/api/v2/jobs", params={"state": "waiting"}).json()] == [jid]
    assert [j["id"] for j in client.get("/api/v2/jobs", params={"virtualCluster": "default"}).json()] == [jid]
    assert client.get(f"/api/v2/jobs/{jid}").json() == listed[0]

    cycle = client.post("/api/v2/scheduler/cycle").json()
    assert cycle["placed"] == [jid]
    assert set(cycle) == {"placed", "preempted", "waiting", "durationMs"}
    node, a = assignment(client, jid)
    assert a["desired"] == "RUN"
    run_id = a["runId"]
    assert a["launch"]["commands"][0].startswith("python3 examples/mnist/main.py")

    assert report(client, node, [run_status(run_id, "running")]) == {"ack": []}
    job = client.get(f"/api/v2/jobs/{jid}").json()
    assert job["state"] == "RUNNING"
    assert job["launchTime"] == "2023-11-14T22:13:21.000Z"

    r = client.post(
        f"/api/v2/nodes/{node}/logs", params={"runId": run_id, "stream": "stdout", "offset": 0}, content=b"epoch 1\n"
    )
    assert r.json() == {"size": 8}
    r = client.post(
        f"/api/v2/nodes/{node}/logs", params={"runId": run_id, "stream": "stdout", "offset": 0}, content=b"epoch 1\n"
    )
    assert r.json() == {"size": 8}  # resend: idempotent
    r = client.get(f"/api/v2/jobs/{jid}/logs")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert r.text == "epoch 1\n"
    assert client.get(f"/api/v2/jobs/{jid}/logs", params={"taskRole": "train", "index": 0, "offset": 6}).text == "1\n"

    nodes = {n["name"]: n for n in client.get("/api/v2/nodes").json()}
    assert set(nodes) == set(NODES)
    assert nodes[node]["gpusUsed"] == 1 and nodes[node]["ready"] is True and nodes[node]["healthy"] is True
    assert all(n["simulatedGpus"] is True for n in nodes.values())

    assert report(client, node, [run_status(run_id, "exited", 0)]) == {"ack": [run_id]}
    job = client.get(f"/api/v2/jobs/{jid}").json()
    assert job["state"] == "SUCCEEDED" and job["exitCode"] == 0

    events = client.get("/api/v2/events", params={"after": first_seq}).json()["events"]
    assert [e["type"] for e in events] == ["job.placed", "task.started", "task.exited", "job.completed"]
    assert all(e["seq"] > first_seq and e["jobId"] == jid for e in events)
    assert client.get("/api/v2/events", params={"after": events[-1]["seq"]}).json() == {"events": []}
    assert [e["type"] for e in client.get("/api/v2/events", params={"jobId": jid, "limit": 1}).json()["events"]] == [
        "job.submitted"
    ]


def test_stop_through_execution_type(client: TestClient) -> None:
    jid = submit(client, job_text(5)).json()["id"]
    r = client.put(f"/api/v2/jobs/{jid}/executionType", json={"value": "STOP"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "STOPPED"
    assert r.json()["executionType"] == "STOP"
    r = client.put(f"/api/v2/jobs/{jid}/executionType", json={"value": "stop"})  # idempotent, any case
    assert r.status_code == 200 and r.json()["state"] == "STOPPED"


def test_stop_running_job_through_the_api(client: TestClient) -> None:
    for node in NODES:
        report(client, node)
    jid = submit(client, job_text(5)).json()["id"]
    client.post("/api/v2/scheduler/cycle")
    node, a = assignment(client, jid)
    report(client, node, [run_status(a["runId"], "running")])
    r = client.put(f"/api/v2/jobs/{jid}/executionType", json={"value": "STOP"})
    assert r.json()["state"] == "RUNNING"
    assert assignment(client, jid)[1]["desired"] == "STOP"
    report(client, node, [{**run_status(a["runId"], "exited"), "stopped": True}])
    assert client.get(f"/api/v2/jobs/{jid}").json()["state"] == "STOPPED"


def test_job_json_has_every_field_the_cli_needs(client: TestClient) -> None:
    for node in NODES:
        report(client, node)
    jid = submit(client, job_text(6)).json()["id"]
    client.post("/api/v2/scheduler/cycle")
    job = client.get(f"/api/v2/jobs/{jid}").json()
    assert JOB_FIELDS <= set(job)
    assert job["id"] == "alice~job-config-6"
    assert (job["name"], job["user"], job["virtualCluster"], job["priorityClass"]) == (
        "job-config-6", "alice", "default", "prod",
    )
    assert job["state"] == "WAITING"
    assert job["retries"] == 0
    assert job["retryDetails"] == {"user": 0, "platform": 0}
    assert job["submissionTime"] == "2023-11-14T22:13:20.000Z"
    assert job["launchTime"] is None and job["completionTime"] is None and job["exitCode"] is None
    assert job["waitingReason"] is None  # both instances placed
    assert len(job["tasks"]) == 2
    for i, t in enumerate(job["tasks"]):
        assert TASK_FIELDS <= set(t)
        assert (t["taskRole"], t["index"], t["state"], t["exitCode"]) == ("train", i, "STARTING", None)
        assert t["node"] in NODES
        assert t["gpus"] == [0]
    assert {t["node"] for t in job["tasks"]} == set(NODES)
    # the list carries the same full JSON
    assert client.get("/api/v2/jobs").json() == [job]


def test_assignments_long_poll_answers_at_once_when_the_generation_moved(client: TestClient) -> None:
    report(client, "hostname-carol")
    r = client.get("/api/v2/nodes/hostname-carol/assignments", params={"generation": -1, "wait": 5})
    assert r.status_code == 200
    assert r.json() == {"generation": 0, "assignments": [], "faults": []}
    r = client.get("/api/v2/nodes/hostname-carol/assignments", params={"generation": 0, "wait": 61})
    assert r.status_code == 400
    assert "wait" in r.json()["message"]


def test_healthz(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"


# ---------------------------------------------------------------------------------- bad input
BAD_SUBMITS = [
    pytest.param("name: [unclosed\n  - x: {", "alice", 400, "body", id="broken-yaml"),
    pytest.param("- just\n- a list\n", "alice", 400, "body", id="yaml-not-a-mapping"),
    pytest.param(b"\xff\xfe not utf-8", "alice", 400, "body", id="not-utf8"),
    pytest.param(job_text(5, color="blue"), "alice", 400, "color", id="unknown-top-level-field"),
    pytest.param(job_text(5, taskRoles__train__bogus=1), "alice", 400, "taskRoles.train.bogus",
                 id="unknown-task-role-field"),
    pytest.param(job_text(5, taskRoles__train__resourcePerInstance__gpu=-1), "alice", 400,
                 "taskRoles.train.resourcePerInstance.gpu", id="negative-gpu"),
    pytest.param(job_text(5, defaults__virtualCluster="vc9"), "alice", 400, "defaults.virtualCluster",
                 id="unknown-virtual-cluster"),
    pytest.param(renamed_role(5, "train-worker"), "alice", 400, "taskRoles.train-worker",
                 id="task-role-name-with-dash"),
    pytest.param(job_text(6, taskRoles__train__instances=4), "alice", 400,
                 "Job requests 4 SKUs, exceeds maximum 2 SKUs in VC default.", id="gang-quota-overflow"),
    pytest.param(job_text(5, protocolVersion=3), "alice", 400, "protocolVersion", id="protocol-version-3"),
    pytest.param(job_text(5, taskRoles__train__dockerImage="nope"), "alice", 400, "taskRoles.train.dockerImage",
                 id="docker-image-not-a-prerequisite"),
]


@pytest.mark.parametrize(("body", "user", "status", "needle"), BAD_SUBMITS)
def test_bad_submission_is_a_4xx_naming_the_field(
    client: TestClient, body: str | bytes, user: str | None, status: int, needle: str
) -> None:
    before_jobs = client.get("/api/v2/jobs").json()
    before_events = client.get("/api/v2/events").json()
    headers = {"X-Test-User": user} if user is not None else {}
    r = client.post("/api/v2/jobs", content=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) in ({"code", "message"}, {"code", "message", "field"})  # "field": ValidationErrors only
    assert needle in err["message"]
    assert err.get("field", "") in err["message"]
    # nothing half-written, and the API still serves
    assert client.get("/api/v2/jobs").json() == before_jobs
    assert client.get("/api/v2/events").json() == before_events
    r = submit(client, job_text(5))
    assert r.status_code == 202, r.text
    assert [j["id"] for j in client.get("/api/v2/jobs").json()] == ["alice~job-config-5"]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "needle"),
    [
        pytest.param("put", "/api/v2/jobs/{jid}/executionType", {"json": {"value": "BOGUS"}}, 400, "value",
                     id="executionType-BOGUS"),
        pytest.param("put", "/api/v2/jobs/{jid}/executionType", {"json": {"value": "START"}}, 400, "value",
                     id="executionType-START"),
        pytest.param("put", "/api/v2/jobs/{jid}/executionType", {"json": {}}, 400, "value",
                     id="executionType-missing-value"),
        pytest.param("get", "/api/v2/jobs/alice~nope", {}, 404, "alice~nope", id="get-unknown-job"),
        pytest.param("put", "/api/v2/jobs/alice~nope/executionType", {"json": {"value": "STOP"}}, 404,
                     "alice~nope", id="stop-unknown-job"),
        pytest.param("get", "/api/v2/jobs/alice~nope/logs", {}, 404, "alice~nope", id="logs-unknown-job"),
        pytest.param("get", "/api/v2/jobs/{jid}/logs", {"params": {"taskRole": "nope"}}, 400, "taskRole",
                     id="logs-unknown-task-role"),
        pytest.param("get", "/api/v2/jobs/{jid}/logs", {"params": {"stream": "bogus"}}, 400, "stream",
                     id="logs-bad-stream"),
        pytest.param("get", "/api/v2/jobs/{jid}/logs", {"params": {"index": "x"}}, 400, "index",
                     id="logs-index-not-an-int"),
        pytest.param("post", "/api/v2/nodes/hostname-eve/status", {"json": {"agentId": "t"}}, 404, "hostname-eve",
                     id="report-from-unknown-node"),
        pytest.param("post", "/api/v2/nodes/hostname-carol/status", {"json": {"gpus": 1}}, 400, "agentId",
                     id="report-without-agent-id"),
        pytest.param("post", "/api/v2/nodes/hostname-carol/logs", {"params": {"runId": "r", "stream": "x",
                     "offset": 0}, "content": b"x"}, 400, "stream", id="log-upload-bad-stream"),
    ],
)
def test_bad_request_is_a_4xx_naming_the_field(
    client: TestClient, method: str, path: str, kwargs: dict, status: int, needle: str
) -> None:
    jid = submit(client, job_text(5)).json()["id"]
    before = client.get("/api/v2/jobs").json()
    r = client.request(method.upper(), path.format(jid=jid), **kwargs)
    assert r.status_code == status, r.text
    assert needle in r.json()["message"]
    assert client.get("/api/v2/jobs").json() == before
    assert submit(client, job_text(6)).status_code == 202


def test_duplicate_submission_conflicts(client: TestClient) -> None:
    assert submit(client, job_text(5)).status_code == 202
    r = submit(client, job_text(5))
    assert r.status_code == 409
    assert r.json()["code"] == "ConflictJobError"
    assert "job-config-5" in r.json()["message"]
    assert submit(client, job_text(5), user="bob").status_code == 202
    assert len(client.get("/api/v2/jobs").json()) == 2


def test_the_user_is_the_token_s_never_a_query_or_header_the_client_sets(client: TestClient) -> None:
    r = client.post("/api/v2/jobs", params={"user": "bob"}, content=job_text(5),
                    headers={"X-Test-User": "alice", "X-Apiary-User": "bob"})
    assert r.status_code == 202
    assert r.json()["id"] == "alice~job-config-5"


def test_all_bad_inputs_in_a_row_leave_the_api_serving(client: TestClient) -> None:
    for p in BAD_SUBMITS:
        body, user, status, _ = p.values
        r = client.post("/api/v2/jobs", content=body, headers={"X-Test-User": user} if user else {})
        assert r.status_code == status
    assert client.get("/api/v2/jobs").json() == []
    assert client.get("/api/v2/events").json() == {"events": []}
    assert submit(client, job_text(5)).status_code == 202
    assert client.post("/api/v2/scheduler/cycle").status_code == 200


def test_cluster_status_per_vc_and_config_apply(client: TestClient) -> None:
    full = client.get("/api/v2/cluster/status").json()
    assert set(full["virtualClusters"]) == {"default"}
    one = client.get("/api/v2/cluster/status", params={"vc": "default"}).json()
    assert one["virtualClusters"]["default"]["quota"] == 2
    r = client.get("/api/v2/cluster/status", params={"vc": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["message"]
    bad = client.put("/api/v2/cluster/config", content=b"physicalCluster: [", headers={"Content-Type": "text/yaml"})
    assert bad.status_code == 400
    two = (LAB6 / "hived-config-two-vcs.yaml").read_bytes()
    r = client.put("/api/v2/cluster/config", content=two, headers={"Content-Type": "text/yaml"})
    assert r.status_code == 200 and r.json() == {"kept": [], "stopped": {}}
    assert set(client.get("/api/v2/cluster/status").json()["virtualClusters"]) == {"default", "vc1"}


def test_platform_metrics_and_fault_queue(client: TestClient) -> None:
    submit(client, (LAB6 / "job-config-5.yaml").read_text())
    text = client.get("/metrics").text
    assert 'apiary_jobs{state="WAITING",virtual_cluster="default"} 1.0' in text
    assert "apiary_job_waiting_seconds{" in text and "apiary_vc_cells{" in text
    r = client.post("/api/v2/nodes/hostname-dan/faults", json={"gpu": 0, "eccDbe": 1})
    assert r.status_code == 200 and r.json()["ecc_dbe"] == 1
    assert client.get("/api/v2/nodes/hostname-dan/assignments").json()["faults"][0]["ecc_dbe"] == 1
    assert client.post("/api/v2/nodes/hostname-dan/faults", json={"gpu": 3, "eccDbe": 1}).status_code == 400
    assert client.post("/api/v2/nodes/hostname-dan/faults", json={"gpu": 0}).status_code == 400
    assert client.post("/api/v2/nodes/nope/faults", json={"gpu": 0, "clear": True}).status_code == 404


def test_gpu_health_fault_kinds_are_queued_for_the_agent(client: TestClient) -> None:
    body = {"gpu": 0, "rowRemapFailure": True, "rowRemapPending": False, "retiredPages": 2, "throttle": "thermal",
            "pcieGen": 3, "pcieWidth": 8}
    r = client.post("/api/v2/nodes/hostname-dan/faults", json=body)
    assert r.status_code == 200, r.text
    queued = {"row_remap_failure": True, "row_remap_pending": False, "retired_pages": 2, "throttle": "thermal",
              "pcie_gen": 3, "pcie_width": 8}
    assert r.json() == {"id": r.json()["id"], "gpu": 0, **queued}
    # The agent passes these keys to SimulatedGpus.inject as they are (apiary.runtime.faults).
    assert client.get("/api/v2/nodes/hostname-dan/assignments").json()["faults"][-1] == r.json()


@pytest.mark.parametrize(("body", "field"), [
    pytest.param({"throttle": "cold"}, "throttle", id="unknown-throttle-reason"),
    pytest.param({"pcieGen": 0}, "pcieGen", id="gen-zero"),
    pytest.param({"pcieGen": 7}, "pcieGen", id="gen-above-6"),
    pytest.param({"pcieWidth": 3}, "pcieWidth", id="width-not-a-lane-count"),
    pytest.param({"retiredPages": -1}, "retiredPages", id="negative-pages"),
    pytest.param({"rowRemapFailure": "maybe"}, "rowRemapFailure", id="flag-not-a-bool"),
    pytest.param({"rowRemapFailur": True}, "rowRemapFailur", id="misspelt-kind"),
])
def test_bad_gpu_health_fault_values_are_a_400_naming_the_field(client: TestClient, body: dict, field: str) -> None:
    r = client.post("/api/v2/nodes/hostname-dan/faults", json={"gpu": 0, **body})
    assert r.status_code == 400, r.text
    assert field in r.text
    assert client.get("/api/v2/nodes/hostname-dan/assignments").json()["faults"] == []


def test_fault_request_literals_match_the_simulator() -> None:
    """The API's allowed throttle reasons and link widths are the simulator's (apiary.api does not
    import apiary.monitoring, so they are written twice)."""
    def allowed(name: str) -> set:
        return {a for t in get_args(FaultRequest.model_fields[name].annotation) for a in get_args(t)}

    assert allowed("throttle") == set(THROTTLE_FAULTS)
    assert allowed("pcieWidth") == set(PCIE_WIDTHS)
    gen = FaultRequest.model_fields["pcieGen"].metadata
    assert (min(PCIE_GENS), max(PCIE_GENS)) == (next(m.ge for m in gen if hasattr(m, "ge")),
                                                next(m.le for m in gen if hasattr(m, "le")))


def test_clone_submits_the_same_spec_under_the_next_free_retry_name(client: TestClient) -> None:
    jid = submit(client, job_text(5)).json()["id"]
    client.put(f"/api/v2/jobs/{jid}/executionType", json={"value": "STOP"})
    r = client.post(f"/api/v2/jobs/{jid}/clone", headers={"X-Apiary-Flow-Run-Id": "run-7"})
    assert r.status_code == 202, r.text
    first = r.json()
    assert (first["id"], first["state"], first["flowRunId"]) == ("alice~job-config-5-retry1", "WAITING", "run-7")
    original = client.get(f"/api/v2/jobs/{jid}").json()
    assert (first["virtualCluster"], first["priorityClass"]) == (original["virtualCluster"], original["priorityClass"])
    again = client.post(f"/api/v2/jobs/{first['id']}/clone").json()
    assert again["id"] == "alice~job-config-5-retry2"  # flat, not job-config-5-retry1-retry1
    assert client.post("/api/v2/jobs/alice~nope/clone").status_code == 404


def test_flow_run_link_is_recorded_and_an_unknown_job_is_404(client: TestClient) -> None:
    job = submit(client, job_text(5)).json()
    assert client.put(f"/api/v2/jobs/{job['id']}/flowRun", json={"id": "run-42"}).status_code == 204
    assert client.get(f"/api/v2/jobs/{job['id']}").json()["flowRunId"] == "run-42"
    r = client.put("/api/v2/jobs/alice~nope/flowRun", json={"id": "run-43"})
    assert r.status_code == 404 and "alice~nope" in r.text


def test_log_query_reads_several_instances_as_the_per_job_route_does(client: TestClient, plane) -> None:
    for node in NODES:
        report(client, node)
    job = submit(client, job_text(5)).json()["id"]
    assert client.post("/api/v2/scheduler/cycle").json()["placed"] == [job]
    node, a = assignment(client, job)
    plane.append_log(a["runId"], "stdout", 0, b"epoch 1\nepoch 2\n", node=node)
    plane.append_log(a["runId"], "stderr", 0, b"warn\n", node=node)
    reads = [{"jobId": job, "taskRole": "train", "index": 0, "attempt": 0, "stream": "stdout", "offset": 8},
             {"jobId": job, "taskRole": "train", "index": 0, "attempt": 0, "stream": "stderr"},
             {"jobId": "alice~nope", "taskRole": "train", "index": 0, "attempt": 0, "stream": "stdout"},
             {"jobId": job, "taskRole": "nosuchrole", "index": 0, "attempt": 0, "stream": "stdout"}]
    r = client.post("/api/v2/logs/query", json={"reads": reads})
    assert r.status_code == 200 and r.json() == {"texts": ["epoch 2\n", "warn\n", None, None]}
    single = client.get(f"/api/v2/jobs/{job}/logs", params={"offset": 8, "attempt": 0}).text
    assert single == r.json()["texts"][0]
    r = client.post("/api/v2/logs/query", json={"reads": [{**reads[0], "stream": "both"}]})
    assert r.status_code in (400, 422) and "stream" in r.text


def test_log_query_answers_a_batch_from_two_store_queries_whatever_its_size(client: TestClient, plane) -> None:
    for node in NODES:
        report(client, node)
    jobs = [submit(client, job_text(5, name=f"job-logs-{i}")).json()["id"] for i in range(2)]
    assert sorted(client.post("/api/v2/scheduler/cycle").json()["placed"]) == sorted(jobs)
    for i, job in enumerate(jobs):
        node, a = assignment(client, job)
        plane.append_log(a["runId"], "stdout", 0, f"out {i}\n".encode(), node=node)
        plane.append_log(a["runId"], "stderr", 0, f"err {i}\n".encode(), node=node)
    reads = [(job, role, 0, attempt, stream, 0) for job in [*jobs, "alice~nope"]
             for role in ("train", None, "nosuchrole") for attempt in (0, None, 1)
             for stream in ("stdout", "stderr", "all", "both")]
    one_by_one = []
    for job, role, index, attempt, stream, offset in reads:
        try:
            one_by_one.append(plane.read_logs(job, task_role=role, index=index, attempt=attempt, stream=stream,
                                              offset=offset))
        except (NotFoundError, ValidationError):
            one_by_one.append(None)
    selects: list[str] = []

    def count(_conn, _cursor, statement, *_args) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            selects.append(statement)

    sa_event.listen(Engine, "before_cursor_execute", count)
    try:
        batch = plane.read_logs_many(reads)
    finally:
        sa_event.remove(Engine, "before_cursor_execute", count)
    assert batch == one_by_one and "out 1\nerr 1\n" in batch and None in batch
    assert len(selects) == 2, selects  # the jobs, then their tasks: not a session per read


def test_a_report_with_an_exit_and_its_output_finds_its_run_without_a_lookup_by_run_id(client: TestClient,
                                                                                      plane) -> None:
    import base64

    for node in NODES:
        report(client, node)
    job = submit(client, job_text(5)).json()["id"]
    assert client.post("/api/v2/scheduler/cycle").json()["placed"] == [job]
    node, a = assignment(client, job)
    placement_reads: list[str] = []

    def count(_conn, _cursor, statement, *_args) -> None:
        if "FROM tasks" in statement and "tasks.run_id IN" in statement:
            placement_reads.append(statement)

    sa_event.listen(Engine, "before_cursor_execute", count)
    try:
        r = client.post(f"/api/v2/nodes/{node}/status", json={
            "agentId": "t", "gpus": 1, "simulatedGpus": True, "address": "127.0.0.1",
            "runs": [run_status(a["runId"], "exited", 0)],
            "logs": [{"runId": a["runId"], "stream": "stdout", "offset": 0,
                      "data": base64.b64encode(b"done\n").decode()}]})
    finally:
        sa_event.remove(Engine, "before_cursor_execute", count)
    assert r.status_code == 200 and r.json() == {"ack": [a["runId"]], "logs": [5]}, r.text
    assert client.get(f"/api/v2/jobs/{job}").json()["state"] == "SUCCEEDED"
    assert client.get(f"/api/v2/jobs/{job}/logs").text == "done\n"
    # The run id names its job: the job's record, loaded for the exit, says where the run is placed,
    # for the exit and for the output's check alike.
    assert placement_reads == [], placement_reads


def test_a_report_decides_nothing_for_runs_that_are_not_its_nodes_own(client: TestClient, plane) -> None:
    """Reported runs are found through the job their run id names; what is not the reporting node's
    current run is acknowledged (the agent forgets it) and changes nothing: a run placed on the
    other node, a run id of the job that no run has, one not of a run id's shape, and an unknown job's."""
    for node in NODES:
        report(client, node)
    job = submit(client, job_text(5)).json()["id"]
    assert client.post("/api/v2/scheduler/cycle").json()["placed"] == [job]
    node, a = assignment(client, job)
    other = next(n for n in NODES if n != node)
    strangers = [a["runId"].rsplit(".", 1)[0] + ".t9", "not-a-run-id", "nobody~nothing.a0.train.0.t0"]
    answer = report(client, other, [run_status(r, "exited", 1) for r in (a["runId"], *strangers)])
    assert sorted(answer["ack"]) == sorted([a["runId"], *strangers])
    assert client.get(f"/api/v2/jobs/{job}").json()["state"] == "WAITING"  # placed, nothing started
    assert report(client, node, [run_status(a["runId"], "exited", 0)])["ack"] == [a["runId"]]
    assert client.get(f"/api/v2/jobs/{job}").json()["state"] == "SUCCEEDED"


def test_flow_run_links_of_a_batch_are_recorded_at_once_and_unknown_jobs_named(client: TestClient) -> None:
    a = submit(client, job_text(5)).json()["id"]
    b = submit(client, job_text(5, name="job-config-5b")).json()["id"]
    links = [{"jobId": a, "flowRunId": "run-1"}, {"jobId": "alice~nope", "flowRunId": "run-2"},
             {"jobId": b, "flowRunId": "run-3"}, {"jobId": a, "flowRunId": "run-4"}]  # a twice: the last wins
    r = client.put("/api/v2/flowRuns", json={"links": links})
    assert r.status_code == 200 and r.json() == {"recorded": 2, "unknown": ["alice~nope"]}
    assert [client.get(f"/api/v2/jobs/{j}").json()["flowRunId"] for j in (a, b)] == ["run-4", "run-3"]
    assert client.put("/api/v2/flowRuns", json={"links": links}).json()["recorded"] == 2  # idempotent
    too_many = [{"jobId": a, "flowRunId": f"run-{i}"} for i in range(1001)]
    r = client.put("/api/v2/flowRuns", json={"links": too_many})
    assert r.status_code in (400, 422) and "links" in r.text
    assert client.get(f"/api/v2/jobs/{a}").json()["flowRunId"] == "run-4"  # the refused body changed nothing
