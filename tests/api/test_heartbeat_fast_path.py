"""A node agent's bare heartbeat is answered in front of the router exactly as the route answers
it; everything the fast path cannot judge reaches the route with its body intact."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer

from apiary.api import create_app
from apiary.api.routers import agents
from apiary.control import ControlPlane
from apiary.runtime.link import GRACE_HEADER
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

LAB6 = Path(__file__).resolve().parents[2] / "examples" / "lab6"
NODE, OTHER = "hostname-carol", "hostname-dan"
BEAT = {"agentId": "t", "gpus": 1, "simulatedGpus": True, "address": "127.0.0.1", "runs": []}


@pytest.fixture
def setup(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-one-vc.yaml"),
                         tmp_path / "logs")
    app = create_app(plane)
    principals = Principals(app.state.directory, ["default"])
    with TestClient(app) as client:
        yield plane, client, principals
    engine.dispose()


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Nodes whose report reached the route (its handler tells the grace first)."""
    seen: list[str] = []
    real = agents._tell_grace
    monkeypatch.setattr(agents, "_tell_grace", lambda response, plane: seen.append("route") or real(response, plane))
    return seen


def post(client: TestClient, node: str, token: str | None, body: object = None, **kw) -> object:
    headers = bearer(token) if token else {}
    return client.post(f"/api/v2/nodes/{node}/status", json=BEAT if body is None else body,
                       headers={**headers, **kw.pop("headers", {})}, **kw)


def test_a_bare_heartbeat_of_a_known_node_is_answered_before_the_router_as_the_route_would(setup, routed) -> None:
    plane, client, principals = setup
    token = principals.agent(NODE)
    first = post(client, NODE, token)  # registers the node: a write, the route's work
    assert first.status_code == 200 and routed == ["route"]
    before = plane.cache.heard[NODE]
    beat = post(client, NODE, token)  # nothing new: answered in front of the router
    assert routed == ["route"]
    assert beat.status_code == 200 and beat.content == first.content == b'{"ack":[]}'
    assert beat.headers[GRACE_HEADER] == first.headers[GRACE_HEADER]
    assert beat.headers["content-type"] == first.headers["content-type"] == "application/json"
    assert plane.cache.heard[NODE] >= before


@pytest.mark.parametrize(("case", "status"), [
    ("no-token", 401), ("wrong-token", 401), ("another-nodes-token", 403), ("user-token", 403),
    ("malformed-body", 400), ("new-address", 200), ("with-runs", 200), ("query-string", 200),
    ("unknown-node", 404), ("not-json", 400),
])
def test_what_the_fast_path_cannot_judge_gets_the_routes_answer(setup, routed, case: str, status: int) -> None:
    plane, client, principals = setup
    token = principals.agent(NODE)
    assert post(client, NODE, token).status_code == 200  # registered: a bare beat would be taken
    routed.clear()
    node, body, kw = NODE, None, {}
    if case == "no-token":
        token = None
    elif case == "wrong-token":
        token = token[:-4] + ("aaaa" if not token.endswith("aaaa") else "bbbb")
    elif case == "another-nodes-token":
        token = principals.agent(OTHER)
    elif case == "user-token":
        token = principals.user("alice")
    elif case == "malformed-body":
        body = {"gpus": 1}
    elif case == "new-address":
        body = {**BEAT, "address": "198.18.0.9"}
    elif case == "with-runs":
        body = {**BEAT, "runs": [{"run_id": "r-unknown", "state": "running"}]}
    elif case == "query-string":
        kw = {"params": {"x": "1"}}
    elif case == "unknown-node":
        node, token = "hostname-eve", principals.agent("hostname-eve")
    elif case == "not-json":
        r = client.post(f"/api/v2/nodes/{node}/status", content=b"gpus=1",
                        headers={**bearer(token), "Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == status, r.text
        return
    r = post(client, node, token, body, **kw)
    assert r.status_code == status, r.text
    if status == 200:
        assert routed == ["route"]  # the route saw the report, its body intact
    if case == "with-runs":
        assert r.json() == {"ack": ["r-unknown"]}  # an unknown run: the agent should forget it
    if case == "new-address":
        assert {n["name"]: n for n in plane.list_nodes()}[NODE]["address"] == "198.18.0.9"
