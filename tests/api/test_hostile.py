"""The hostile corpus (tests/support/hostile.py) against a live app: each request gets its 4xx, an
error body naming the field or the limit, no trace in the store, and the platform keeps serving.

The platform is test_authz's :class:`World` (a real ControlPlane on Lab 6's two-VC config in a temp
SQLite store, real tokens, alice's job ``alice~secret-train`` running on hostname-carol), shared by
the whole module: every case must leave it as it found it. The corpus runs again on PostgreSQL
(``postgres`` marker), which refuses text that SQLite stores. Timings are not asserted here (speed is
``make bench``'s business).
"""

from __future__ import annotations

import json

import pytest
import yaml
from tests.api import test_authz
from tests.api.test_authz import CAROL, World
from tests.pg import start_postgres_or_skip
from tests.support.hostile import CORPUS, Hostile, job, send

from apiary.store import make_engine

#: What "the store is unchanged" compares: reads that show every kind of record a request could
#: write (jobs with their tasks, the event log, identities, alerts, the nodes' reported state).
SNAPSHOT = ("/api/v2/jobs", "/api/v2/events?limit=5000", "/api/v2/users", "/api/v2/groups", "/api/v2/tokens",
            "/api/v2/alerts?limit=5000")
NODE_FIELDS = ("name", "gpus", "simulatedGpus", "address", "cordoned", "lastHeartbeat", "metricsUrl")


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def world(request, tmp_path_factory):
    """The World on SQLite, and on PostgreSQL (``postgres`` marker): the store where a NUL character
    or a 64-bit overflow used to fail the whole statement (a 500, or a 503 saying "retry later")."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "postgres":
            url, stop = start_postgres_or_skip(tmp_path_factory.mktemp("postgres"))
            request.addfinalizer(stop)
            # World builds its store from a SQLite URL; this module's World uses the server instead
            mp.setattr(test_authz, "make_engine", lambda _sqlite_url: make_engine(url))
        w = World(tmp_path_factory.mktemp("hostile"))
    assert w.engine.dialect.name == {"sqlite": "sqlite", "postgres": "postgresql"}[request.param]
    yield w
    w.close()


def snapshot(w: World) -> dict[str, object]:
    admin = w.headers["admin"]
    got: dict[str, object] = {}
    for path in SNAPSHOT:
        r = w.client.get(path, headers=admin)
        assert r.status_code == 200, (path, r.text)
        got[path] = r.json()
    nodes = w.client.get("/api/v2/nodes", headers=admin).json()
    got["nodes"] = [{k: n[k] for k in NODE_FIELDS} for n in nodes]
    return got


def test_the_corpus_is_what_the_issue_asks_for() -> None:
    assert len(CORPUS) >= 46
    assert len({c.id for c in CORPUS}) == len(CORPUS)
    assert all(400 <= c.expect < 500 and c.names for c in CORPUS)
    statuses = {c.expect for c in CORPUS}
    assert {400, 404, 413} <= statuses


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.id)
def test_hostile_request_is_refused_and_changes_nothing(world: World, case: Hostile) -> None:
    headers = world.headers["agent-carol" if case.principal == "agent" else case.principal]
    before = snapshot(world)

    r = send(world.client, case, headers)

    # 1. the status the corpus expects, in the API's error shape, naming the field or the limit
    assert r.status_code == case.expect, r.text[:500]
    body = r.json()
    assert set(body) <= {"code", "message", "field"} and isinstance(body["code"], str), body
    assert isinstance(body["message"], str) and isinstance(body.get("field", ""), str), body
    assert case.names in body["message"] or case.names in body.get("field", ""), body
    # 2. the refused request left no trace
    assert snapshot(world) == before
    # 3. the platform keeps serving: a normal job is accepted and the job list answers
    normal = yaml.safe_dump(job(name=f"after-{case.id}"), sort_keys=False)
    r = world.client.post("/api/v2/jobs", content=normal, headers={**world.headers["alice"],
                                                                     "Content-Type": "text/yaml"})
    assert r.status_code == 202, r.text
    r = world.client.get("/api/v2/jobs", headers=world.headers["alice"])
    assert r.status_code == 200 and f"alice~after-{case.id}" in [j["id"] for j in r.json()]


def test_the_node_agents_still_work_after_the_corpus(world: World) -> None:
    """The agent of hostname-carol, whose routes the corpus attacked, still reports and polls."""
    assert world.report(CAROL, [{"run_id": world.run_id, "state": "running", "pid": 1, "started_at": 1.0}]) == 200
    assert [a["runId"] for a in world.assignments(CAROL)] == [world.run_id]
    assert world.state() == "RUNNING"


# --------------------------------------------------------------------------- input the agent can always handle


def _json_job(**changes: object) -> bytes:
    """``job(**changes)`` as Python's json.dumps writes it (non-ASCII as \\u escapes)."""
    return json.dumps(job(**changes)).encode()


def _renamed_role(name: str) -> bytes:
    doc = job()
    doc["taskRoles"] = {name: doc["taskRoles"]["train"]}
    return json.dumps(doc).encode()


_PLUGIN_KEY = "com.microsoft.pai.runtimeplugin"
#: A 30 KB body whose one command references a 10 KB parameter 1,000 times: 10 MB once rendered.
_AMPLIFIER = _json_job(parameters={"big": "x" * 10_000},
                       train={"commands": ["echo " + " ".join(["<% $parameters.big %>"] * 1_000)]})

ADMISSION = [
    Hostile("task-role-name-trailing-newline", "POST", "/api/v2/jobs", _renamed_role("train\n"), "application/json",
            names="task role name"),
    Hostile("command-nul", "POST", "/api/v2/jobs", _json_job(train={"commands": ["echo a\x00b"]}),
            "application/json", names="taskRoles.train.commands[0]"),
    Hostile("secret-key-nul", "POST", "/api/v2/jobs", _json_job(secrets={"k\x00": "v"}), "application/json",
            names="NUL"),
    Hostile("secret-value-nul-yaml", "POST", "/api/v2/jobs",
            yaml.safe_dump(job(secrets={"k": "v\x00"})).encode(), "text/yaml", names="secrets.k"),
    Hostile("protocol-version-float-2", "POST", "/api/v2/jobs", _json_job(protocolVersion=2.0), "application/json",
            names="protocolVersion"),
    Hostile("protocol-version-true", "POST", "/api/v2/jobs", _json_job(protocolVersion=True), "application/json",
            names="protocolVersion"),
    Hostile("commands-render-to-10-mb", "POST", "/api/v2/jobs", _AMPLIFIER, "application/json",
            names="10001005 bytes"),
    Hostile("runtime-plugin-unknown", "POST", "/api/v2/jobs",
            _json_job(extras={_PLUGIN_KEY: [{"plugin": "mlflow_tracker"}]}), "application/json",
            names="mlflow_tracker"),
    Hostile("json-lone-surrogate", "POST", "/api/v2/jobs",
            _json_job(description="\ud800"), "application/json", names="lone surrogate"),
]


@pytest.mark.parametrize("case", ADMISSION, ids=lambda c: c.id)
def test_input_a_node_agent_could_not_handle_is_refused(world: World, case: Hostile) -> None:
    """Each reaches the client as a 400 naming the field, leaves no trace, and the platform serves on."""
    assert len(case.body or b"") < 40_000
    test_hostile_request_is_refused_and_changes_nothing(world, case)


def test_a_secret_value_is_not_echoed_in_the_refusal(world: World) -> None:
    r = world.client.post("/api/v2/jobs", content=_json_job(name="nul-secret", secrets={"k": "hunter2\x00"}),
                          headers={**world.headers["alice"], "Content-Type": "application/json"})
    assert r.status_code == 400 and "hunter2" not in r.text and r.json()["field"] == "secrets.k", r.text


def test_json_with_an_escaped_surrogate_pair_is_accepted(world: World) -> None:
    body = _json_job(name="emoji-json", description="😀")
    assert b"\\ud83d\\ude00" in body
    r = world.client.post("/api/v2/jobs", content=body,
                          headers={**world.headers["alice"], "Content-Type": "application/json"})
    assert r.status_code == 202, r.text
    r = world.client.get("/api/v2/jobs/alice~emoji-json", headers=world.headers["alice"])
    assert r.status_code == 200 and r.json()["name"] == "emoji-json", r.text
