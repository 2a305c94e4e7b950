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
from apiary.ci import webhooks
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


# ---------------------------------------------------------------- the edges of a signed delivery
# GitHub's signature covers the body only: not its nesting, not X-GitHub-Event, not X-GitHub-Delivery.

EVENTS = {"ping": "ping", "pull_request.opened": "pull_request", "pull_request.synchronize": "pull_request",
          "pull_request.closed": "pull_request", "push.default-branch": "push", "push.tag": "push"}


def _nested(depth: int) -> bytes:
    """A push-shaped object whose ``commits`` nests arrays ``depth`` levels deep in all (the body is level 1)."""
    doc = json.loads(payload("push.default-branch"))
    doc["commits"] = "@"
    head, tail = json.dumps(doc).encode().split(b'"@"')
    return head + b"[" * (depth - 1) + b"]" * (depth - 1) + tail


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"a": ' + b'{"b": ' * 100_000 + b"1" + b"}" * 100_001,
    _nested(100_000),
], ids=["array", "in-object", "objects", "push-shaped"])
def test_signed_body_nested_100000_deep_is_400_not_500(h: Harness, starter: FakeStarter, body: bytes) -> None:
    r = h.deliver("push", body, delivery="deep")
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "body" and f"deeper than {webhooks.MAX_JSON_DEPTH} levels" in r.json()["message"]
    assert h.deliveries() == {} and starter.calls == []


def test_nesting_up_to_the_limit_is_accepted_one_more_is_not(h: Harness) -> None:
    limit = webhooks.MAX_JSON_DEPTH
    assert h.deliver("push", _nested(limit), delivery="at-limit").status_code == 202
    r = h.deliver("push", _nested(limit + 1), delivery="over-limit")
    assert r.status_code == 400 and r.json()["field"] == "body", r.text


def test_brackets_inside_strings_do_not_count_as_nesting(h: Harness, starter: FakeStarter) -> None:
    doc = json.loads(payload("push.default-branch"))
    doc["head_commit"]["message"] = '\\"[{' * 10_000  # escaped quotes do not end the string either
    r = h.deliver("push", json.dumps(doc).encode(), delivery="brackets")
    assert r.status_code == 202 and r.json()["kind"] == "deploy", r.text


@pytest.mark.parametrize(("body", "depth"), [
    (b"1", 0), (b"{}", 1), (b'[{"a": [1, {"b": []}]}]', 5), (b'{"s": "]]]][[[[{{{"}', 1),
    (b'{"s": "\\\\", "t": [[]]}', 3), (b'{"s": "\\"[[[", "t": []}', 2), (b'{"s": "[[[[', 1),
    (b"[" * 10 + b"]" * 10, 10), (b"[" * 1_000_000, 33),
], ids=["scalar", "empty", "mixed", "in-string", "escaped-backslash", "escaped-quote", "unterminated",
        "ten", "stops-past-limit"])
def test_json_depth_counts_brackets_outside_strings(body: bytes, depth: int) -> None:
    assert webhooks.json_depth(body, limit=32) == depth


@pytest.mark.parametrize("name", sorted(EVENTS))
@pytest.mark.parametrize("event", ["push", "pull_request", "ping"])
def test_event_header_must_match_the_payload(h: Harness, starter: FakeStarter, name: str, event: str) -> None:
    """Every GitHub example of push, pull_request and ping is accepted as its own event and refused
    as each of the other two (a signed pull-request body sent as ``push`` never becomes a deploy)."""
    r = h.deliver(event, payload(name), delivery="e-1")
    if EVENTS[name] == event:
        assert r.status_code == 202, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "X-GitHub-Event" and f"not a {event} payload" in r.json()["message"]
    assert h.deliveries() == {} and starter.calls == [] and not starter.entered.is_set()


def test_push_with_a_mistyped_field_is_400_naming_it(h: Harness) -> None:
    doc = json.loads(payload("push.default-branch"))
    doc["commits"], doc["deleted"] = {}, "false"
    r = h.deliver("push", json.dumps(doc).encode())
    assert r.status_code == 400 and r.json()["field"] == "X-GitHub-Event", r.text
    assert "deleted (boolean), commits (array)" in r.json()["message"]


def test_same_body_under_a_new_delivery_id_is_a_duplicate(h: Harness, starter: FakeStarter) -> None:
    body = payload("push.default-branch")
    assert h.deliver("push", body, delivery="first").json()["duplicate"] is False
    until(lambda: h.state("first", "started"), DEADLINE_S, "the first delivery started")
    r = h.deliver("push", body, delivery="replay")
    assert r.status_code == 202, r.text
    assert r.json()["duplicate"] is True and r.json()["delivery"] == "replay"
    assert "the same body as delivery first" in r.json()["reason"]
    assert list(h.deliveries()) == ["first"] and len(starter.calls) == 1


def test_same_body_is_a_duplicate_per_event(h: Harness) -> None:
    body = b'{"action": "opened"}'
    assert h.deliver("issues", body, delivery="i-1").json()["duplicate"] is False
    assert h.deliver("issues", body, delivery="i-2").json()["duplicate"] is True
    assert h.deliver("label", body, delivery="l-1").json()["duplicate"] is False
    assert set(h.deliveries()) == {"i-1", "l-1"}


def test_a_replayed_body_is_a_duplicate_after_a_restart(tmp_path: Path) -> None:
    body = payload("pull_request.opened")
    first = Harness(tmp_path, FakeStarter())
    assert first.deliver("pull_request", body, delivery="before").json()["duplicate"] is False
    until(lambda: first.state("before", "started"), DEADLINE_S, "the delivery started")
    first.engine.dispose()
    starter = FakeStarter()
    again = Harness(tmp_path, starter)  # a new control plane on the same store
    try:
        r = again.deliver("pull_request", body, delivery="after")
        assert r.status_code == 202 and r.json()["duplicate"] is True, r.text
        assert list(again.deliveries()) == ["before"] and starter.calls == []
    finally:
        again.engine.dispose()


def test_concurrent_replays_record_and_start_one(h: Harness) -> None:
    body = payload("pull_request.opened")
    digest = webhooks.body_sha256(body)
    doc = json.loads(body)
    barrier = threading.Barrier(4)
    answers: list[bool] = []

    def accept(n: int) -> None:
        barrier.wait(DEADLINE_S)
        answers.append(h.intake.accept("pull_request", f"race-{n}", doc, digest).duplicate)

    threads = [threading.Thread(target=accept, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert sorted(answers) == [False, True, True, True]
    assert len(h.deliveries()) == 1


def test_rows_from_before_body_hashes_stay_and_do_not_collide(tmp_path: Path) -> None:
    """A store migrated before bodies were hashed keeps its deliveries (no hash: never a duplicate)."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import text

    from apiary.store.engine import MIGRATIONS

    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0007")
        for n in (1, 2):
            conn.execute(text("INSERT INTO ci_deliveries (delivery, event, kind, state, reason, received_at) "
                              f"VALUES ('old-{n}', 'push', 'ignored', 'accepted', '', {n})"))
    engine.dispose()
    h = Harness(tmp_path, FakeStarter())  # migrates to the newest revision
    try:
        assert h.deliver("push", payload("push.tag"), delivery="new").json()["duplicate"] is False
        assert set(h.deliveries()) == {"old-1", "old-2", "new"}
    finally:
        h.engine.dispose()


def test_a_signed_body_with_a_lone_surrogate_is_400_not_500(h: Harness, starter: FakeStarter) -> None:
    """``"\\ud800"`` is valid JSON but no UTF-8 text: stored as the delivery's action it failed the
    insert with a UnicodeEncodeError, a 500."""
    body = b'{"action": "\\ud800", "number": 1, "pull_request": {}, "repository": {}}'
    r = h.deliver("pull_request", body, delivery="surrogate")
    assert r.status_code == 400 and r.json()["field"] == "body" and "surrogate" in r.json()["message"], r.text
    assert h.deliveries() == {} and starter.calls == []
