"""GitHub's webhook intake (``POST /api/v2/ci/webhooks/github``, :mod:`apiary.ci`) with GitHub's
real example payloads (``tests/data/github``, from ``@octokit/webhooks-examples`` 7.6.1), signed
here with a test secret as GitHub signs them. The starter is a fake that records its calls (and
can block on an Event); the Prefect starter is checked against a fake Prefect client."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6
from tests.support.polling import until

from apiary.api import create_app
from apiary.auth import Directory
from apiary.ci.intake import WebhookIntake
from apiary.ci.starter import Pending, PipelineStarter, PrefectStarter, Started
from apiary.ci.webhooks import PipelineRequest, sign
from apiary.control import ControlPlane
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

GITHUB = Path(__file__).parent.parent / "data" / "github"
SECRET = "It's a Secret to Everybody"  # GitHub's documentation example secret
URL = "/api/v2/ci/webhooks/github"
PR_SHA = "ec26c3e57ca3a959ca5aad62de7213c562f8c821"
PUSH_SHA = "6113728f27ae82c7b1a177c8d03f9e96e0adf246"
DEADLINE_S = 10.0


def payload(name: str) -> bytes:
    return (GITHUB / f"{name}.json").read_bytes()


class FakeStarter(PipelineStarter):
    """Records each start; blocks on ``gate`` when given one; answers ``outcome``."""

    def __init__(self, gate: threading.Event | None = None, outcome: Started | Pending | None = None) -> None:
        self.gate = gate
        self.outcome = outcome or Started("run-1")
        self.calls: list[tuple[str, PipelineRequest]] = []
        self.entered = threading.Event()

    def start(self, delivery: str, request: PipelineRequest) -> Started | Pending:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(DEADLINE_S), "the test never released the starter"
        self.calls.append((delivery, request))
        return self.outcome


class Harness:
    def __init__(self, tmp: Path, starter: PipelineStarter, secret: str | None = SECRET) -> None:
        self.engine = make_engine(f"sqlite:///{tmp}/a.db")
        migrate(self.engine)
        self.plane = ControlPlane(session_factory(self.engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                                  tmp / "logs")
        self.intake = WebhookIntake(self.plane.sessions, starter, secret)
        self.client = TestClient(create_app(self.plane, AlertReceiver(self.plane, ActionsConfig(), notifiers={}),
                                            ci=self.intake))
        self.admin = bearer(Principals(Directory(self.plane.sessions), ["default"]).admin())

    def deliver(self, event: str, body: bytes, delivery: str | None = None, signature: str | None = "sign",
                **headers: str):
        h = {"Content-Type": "application/json", "X-GitHub-Event": event,
             "X-GitHub-Delivery": delivery or str(uuid.uuid4()), **headers}
        if signature == "sign":
            h["X-Hub-Signature-256"] = sign(SECRET.encode(), body)
        elif signature is not None:
            h["X-Hub-Signature-256"] = signature
        return self.client.post(URL, content=body, headers=h)

    def deliveries(self) -> dict[str, dict[str, Any]]:
        r = self.client.get("/api/v2/ci/deliveries", headers=self.admin)
        assert r.status_code == 200, r.text
        return {d["delivery"]: d for d in r.json()["deliveries"]}

    def state(self, delivery: str, state: str) -> dict[str, Any] | None:
        d = self.deliveries().get(delivery)
        return d if d and d["state"] == state else None


@pytest.fixture
def starter() -> FakeStarter:
    return FakeStarter()


@pytest.fixture
def h(tmp_path: Path, starter: FakeStarter):
    harness = Harness(tmp_path, starter)
    yield harness
    harness.engine.dispose()


@pytest.mark.parametrize(("name", "kind", "pr", "sha", "ref"), [
    ("pull_request.opened", "pr", 2, PR_SHA, "changes"),
    ("pull_request.synchronize", "pr", 2, PR_SHA, "changes"),
    ("push.default-branch", "deploy", None, PUSH_SHA, "master"),
], ids=["pr-opened", "pr-synchronize", "push-default-branch"])
def test_signed_delivery_is_recorded_and_started(h: Harness, starter: FakeStarter, name: str, kind: str,
                                                 pr: int | None, sha: str, ref: str) -> None:
    event = name.split(".")[0]
    r = h.deliver(event, payload(name), delivery="d-1")
    assert r.status_code == 202, r.text
    assert r.json() == {"delivery": "d-1", "event": event, "kind": kind, "accepted": True, "duplicate": False,
                        "reason": ""}
    row = until(lambda: h.state("d-1", "started"), DEADLINE_S, "the delivery started")
    assert (row["repo"], row["prNumber"], row["sha"], row["ref"], row["kind"], row["flowRunId"]) == (
        "Codertocat/Hello-World", pr, sha, ref, kind, "run-1")
    (delivery, request), = starter.calls
    assert delivery == "d-1" and request.kind == kind and request.sha == sha and request.pr_number == pr
    assert request.clone_url == "https://github.com/Codertocat/Hello-World.git"
    assert request.sender == "Codertocat" and request.default_branch == "master"


@pytest.mark.parametrize("signature", [
    None, "", "sha256=" + "0" * 64, "sha1=d03207e4b030cf234e3447bac4d93add4c6643d8",
    sign(SECRET.encode(), b'{"other": "body"}'), sign(b"another secret", payload("pull_request.opened")),
], ids=["missing", "empty", "wrong", "sha1-only", "other-body", "other-secret"])
def test_bad_signature_is_401_and_nothing_recorded(h: Harness, starter: FakeStarter, signature: str | None) -> None:
    r = h.deliver("pull_request", payload("pull_request.opened"), signature=signature)
    assert r.status_code == 401, r.text
    assert "X-Hub-Signature-256" in r.json()["message"]
    assert h.deliveries() == {} and starter.calls == [] and not starter.entered.is_set()


def test_unset_secret_accepts_nothing(tmp_path: Path) -> None:
    starter = FakeStarter()
    h = Harness(tmp_path, starter, secret=None)
    r = h.deliver("pull_request", payload("pull_request.opened"))
    assert r.status_code == 401 and "APIARY_GITHUB_WEBHOOK_SECRET" in r.json()["message"]
    assert h.deliveries() == {} and starter.calls == []
    h.engine.dispose()


def test_duplicate_delivery_starts_once(h: Harness, starter: FakeStarter) -> None:
    body = payload("pull_request.opened")
    assert h.deliver("pull_request", body, delivery="dup").json()["duplicate"] is False
    until(lambda: h.state("dup", "started"), DEADLINE_S, "the first delivery started")
    r = h.deliver("pull_request", body, delivery="dup")
    assert r.status_code == 202 and r.json()["duplicate"] is True
    assert len(starter.calls) == 1 and len(h.deliveries()) == 1


def test_ping_is_answered(h: Harness, starter: FakeStarter) -> None:
    r = h.deliver("ping", payload("ping"), delivery="p-1")
    assert r.status_code == 202 and r.json()["kind"] == "ping" and r.json()["reason"] == "pong"
    assert h.deliveries()["p-1"]["repo"] == "Octocoders/Hello-World" and starter.calls == []


def _push_to_feature_branch() -> bytes:
    # The examples ship no push to another branch: the default-branch push with its ref changed.
    doc = json.loads(payload("push.default-branch"))
    doc["ref"] = "refs/heads/feature"
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("event", "body", "why"), [
    ("pull_request", lambda: payload("pull_request.closed"), "'closed'"),
    ("push", lambda: payload("push.tag"), "refs/tags/simple-tag"),
    ("push", _push_to_feature_branch, "refs/heads/feature"),
    ("issues", lambda: b'{"action": "opened"}', "'issues'"),
], ids=["pr-closed", "push-tag", "push-other-branch", "other-event"])
def test_ignored_deliveries_start_nothing(h: Harness, starter: FakeStarter, event: str, body, why: str) -> None:
    r = h.deliver(event, body(), delivery="i-1")
    assert r.status_code == 202 and r.json()["kind"] == "ignored" and why in r.json()["reason"]
    assert h.deliveries()["i-1"]["state"] == "accepted" and starter.calls == []


def test_answers_before_a_slow_starter_finishes(tmp_path: Path) -> None:
    gate = threading.Event()
    starter = FakeStarter(gate=gate)
    h = Harness(tmp_path, starter)
    try:
        r = h.deliver("pull_request", payload("pull_request.opened"), delivery="slow")
        assert r.status_code == 202  # answered while the starter may still be blocked
        assert starter.entered.wait(DEADLINE_S)
        assert h.deliveries()["slow"]["state"] == "accepted" and starter.calls == []
    finally:
        gate.set()
    until(lambda: h.state("slow", "started"), DEADLINE_S, "the slow start finished")
    h.engine.dispose()


@pytest.mark.parametrize(("headers", "body", "field"), [
    ({"X-GitHub-Event": ""}, b"{}", "X-GitHub-Event"),
    ({"X-GitHub-Delivery": "bad id\x7f"}, b"{}", "X-GitHub-Delivery"),
    ({}, b"payload=%7B%7D", "body"),
    ({}, b"[1, 2]", "body"),
], ids=["no-event", "bad-delivery", "form-encoded", "not-an-object"])
def test_malformed_signed_delivery_is_400_naming_it(h: Harness, headers: dict, body: bytes, field: str) -> None:
    hdrs = {"Content-Type": "application/json", "X-GitHub-Event": "push", "X-GitHub-Delivery": "m-1",
            "X-Hub-Signature-256": sign(SECRET.encode(), body), **headers}
    r = h.client.post(URL, content=body, headers=hdrs)
    assert r.status_code == 400 and r.json()["field"] == field, r.text
    assert h.deliveries() == {}


def test_deliveries_are_admins_only(h: Harness) -> None:
    assert h.client.get("/api/v2/ci/deliveries").status_code == 401


class _FakePrefect:
    """Prefect's sync client, as far as PrefectStarter uses it."""

    def __init__(self, deployments: dict[str, str]) -> None:
        self.deployments = deployments
        self.runs: list[dict[str, Any]] = []

    def __enter__(self) -> _FakePrefect:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def read_deployment_by_name(self, name: str) -> Any:
        from prefect.exceptions import ObjectNotFound

        if name not in self.deployments:
            raise ObjectNotFound(http_exc=Exception(name))
        return type("Deployment", (), {"id": self.deployments[name]})()

    def create_flow_run_from_deployment(self, deployment_id: str, **kw: Any) -> Any:
        self.runs.append({"deployment": deployment_id, **kw})
        return type("FlowRun", (), {"id": uuid.UUID(int=len(self.runs))})()


def test_missing_prefect_deployment_leaves_the_delivery_pending(tmp_path: Path) -> None:
    prefect = _FakePrefect({})
    h = Harness(tmp_path, PrefectStarter(client_factory=lambda: prefect))
    assert h.deliver("pull_request", payload("pull_request.opened"), delivery="nf").status_code == 202
    row = until(lambda: h.state("nf", "pending"), DEADLINE_S, "the delivery pending")
    assert "platform-ci/pr does not exist" in row["reason"] and row["flowRunId"] is None
    h.engine.dispose()


def test_prefect_starter_creates_an_idempotent_flow_run(tmp_path: Path) -> None:
    prefect = _FakePrefect({"platform-deploy/main": "dep-1"})
    h = Harness(tmp_path, PrefectStarter(client_factory=lambda: prefect))
    assert h.deliver("push", payload("push.default-branch"), delivery="dp").status_code == 202
    row = until(lambda: h.state("dp", "started"), DEADLINE_S, "the deploy started")
    (run,) = prefect.runs
    assert row["flowRunId"] == str(uuid.UUID(int=1)) and run["deployment"] == "dep-1"
    assert run["idempotency_key"] == "github-delivery-dp" and run["parameters"]["request"]["sha"] == PUSH_SHA
    h.engine.dispose()
