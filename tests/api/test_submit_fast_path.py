"""A user's submission is answered in front of the router exactly as the route answers it, errors
included; everything the fast path does not judge reaches the route with its body intact.

Each case runs twice on fresh apps: once as it comes (the fast path answers once the user's token is
in the verified-token cache) and once with the fast path passing everything on (the route answers),
and the two answers must match: status, error body, ``Retry-After``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import Request
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import job_text

from apiary.api import auth, create_app, submit_path
from apiary.auth import Principal
from apiary.control import ControlPlane
from apiary.settings import Settings
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

LAB6 = Path(__file__).resolve().parents[2] / "examples" / "lab6"


class Setup:
    def __init__(self, tmp_path: Path, *, fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engine = make_engine(f"sqlite:///{tmp_path}/a.db")
        migrate(self.engine)
        self.plane = ControlPlane(session_factory(self.engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                                  tmp_path / "logs")
        settings = Settings(rate_calls="6/minute", rate_submits="3/hour", max_body_bytes=20_000)
        self.app = create_app(self.plane, settings=settings)
        self.principals = Principals(self.app.state.directory, ["vc1", "vc2"])
        self.principals.directory.create_group("only-vc1", virtual_clusters=["vc1"], exist_ok=True)
        if not fast:
            async def passthrough(self_: submit_path.SubmitFastPath, scope, receive, send) -> None:
                await self_.app(scope, receive, send)
            monkeypatch.setattr(submit_path.SubmitFastPath, "__call__", passthrough)
        self.routed: list[str] = []  # requests that reached the route's dependencies

        async def recording(request: Request) -> Principal:
            self.routed.append(request.url.path)
            return await auth.get_principal(request)

        self.app.dependency_overrides[auth.get_principal] = recording


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    made: list[tuple[Setup, TestClient]] = []

    def factory(fast: bool) -> tuple[Setup, TestClient]:
        s = Setup(tmp_path / ("fast" if fast else "route"), fast=fast, monkeypatch=monkeypatch)
        client = TestClient(s.app)
        client.__enter__()
        made.append((s, client))
        return s, client

    yield factory
    for s, client in made:
        client.__exit__(None, None, None)
        s.engine.dispose()


def submit(client: TestClient, token: str | None, text: str, headers: dict | None = None, **kw) -> object:
    return client.post("/api/v2/jobs", content=text.encode(),
                       headers={"Content-Type": "text/yaml", **(bearer(token) if token else {}), **(headers or {})},
                       **kw)


def test_a_cached_users_submission_is_answered_before_the_router(make) -> None:
    s, client = make(True)
    token = s.principals.user("alice")
    first = submit(client, token, job_text(1, name="first"))  # token not cached yet: the route
    assert first.status_code == 202 and len(s.routed) == 1
    second = submit(client, token, job_text(1, name="second"))
    assert second.status_code == 202 and len(s.routed) == 1  # the fast path answered
    assert second.headers["content-type"] == first.headers["content-type"] == "application/json"
    a, b = first.json(), second.json()
    assert set(a) == set(b) and b["name"] == "second" and b["state"] == "WAITING"
    assert s.plane.get_job("alice~second")["name"] == "second"  # committed


CASES = ["call-limit", "bad-yaml", "vc-not-granted", "unknown-vc", "name-taken", "submit-limit", "body-too-large",
         "admin", "agent-token", "bridge-header", "flow-run-header", "query-string", "wrong-token"]


def _run(s: Setup, client: TestClient, case: str) -> object:
    token = s.principals.user("alice", groups=("only-vc1",))
    assert submit(client, token, job_text(1, name="warm")).status_code == 202  # the token is cached now
    s.routed.clear()
    if case == "call-limit":  # 1 call above, 5 reads: the submission is the 7th call in a minute
        for _ in range(5):
            assert client.get("/api/v2/jobs", headers=bearer(token)).status_code == 200
        s.routed.clear()
        return submit(client, token, job_text(1, name="x"))
    if case == "bad-yaml":
        return submit(client, token, "jobName: [unclosed")
    if case == "vc-not-granted":
        return submit(client, token, job_text(1, name="x", **{"defaults.virtualCluster": "vc2"}))
    if case == "unknown-vc":
        return submit(client, token, job_text(1, name="x", **{"defaults.virtualCluster": "nope"}))
    if case == "name-taken":
        return submit(client, token, job_text(1, name="warm"))
    if case == "submit-limit":
        assert submit(client, token, job_text(1, name="two")).status_code == 202
        assert submit(client, token, job_text(1, name="three")).status_code == 202
        return submit(client, token, job_text(1, name="four"))
    if case == "body-too-large":
        big = (job_text(1, name="big") + "\n#" + "x" * 30_000).encode()
        # Chunked, with no Content-Length: the body limit counts the bytes as they are read.
        return client.post("/api/v2/jobs", content=iter([big[:10_000], big[10_000:]]),
                           headers={"Content-Type": "text/yaml", **bearer(token)})
    if case == "admin":
        admin = s.principals.admin()
        submit(client, admin, job_text(1, name="a0"))
        s.routed.clear()
        return submit(client, admin, job_text(1, name="a1", **{"defaults.virtualCluster": "vc2"}))
    if case == "agent-token":
        agent = s.principals.agent("hostname-dan")
        client.post("/api/v2/nodes/hostname-dan/status", headers=bearer(agent),
                    json={"agentId": "t", "gpus": 1, "simulatedGpus": True, "address": "127.0.0.1", "runs": []})
        return submit(client, agent, job_text(1, name="x"))
    if case == "bridge-header":
        return submit(client, token, job_text(1, name="x"), headers={"X-Apiary-On-Behalf-Of": "bob"})
    if case == "flow-run-header":
        return submit(client, token, job_text(1, name="x"), headers={"X-Apiary-Flow-Run-Id": "r1"})
    if case == "query-string":
        return client.post("/api/v2/jobs?x=1", content=job_text(1, name="q").encode(),
                           headers={"Content-Type": "text/yaml", **bearer(token)})
    if case == "wrong-token":
        return submit(client, token[:-4] + ("aaaa" if not token.endswith("aaaa") else "bbbb"), job_text(1, name="x"))
    raise AssertionError(case)


#: Cases the route must judge (the fast path passes them on).
ROUTED = {"agent-token", "bridge-header", "flow-run-header", "query-string", "wrong-token"}


@pytest.mark.parametrize("case", CASES)
def test_the_fast_path_answers_as_the_route_does(make, case: str) -> None:
    fast_s, fast_client = make(True)  # first: the route's run below turns the fast path off for the test
    got = _run(fast_s, fast_client, case)
    route_s, route_client = make(False)
    want = _run(route_s, route_client, case)
    assert got.status_code == want.status_code, (case, got.text, want.text)
    if got.status_code == 202:
        assert set(got.json()) == set(want.json())
    else:
        assert got.json() == want.json()
    assert got.headers.get("retry-after") == want.headers.get("retry-after")
    assert got.headers.get("www-authenticate") == want.headers.get("www-authenticate")
    assert bool(fast_s.routed) == (case in ROUTED), (case, fast_s.routed)
    assert sorted(j["name"] for j in fast_s.plane.list_jobs()) == sorted(j["name"] for j in route_s.plane.list_jobs())
