"""Bootstrap tokens (:mod:`apiary.auth.bootstrap_tokens`): a node joins once, with a token that is
well formed, known, unrevoked, unused, unexpired and for that node, as a node of the cluster config
that has not joined yet; every refusal says why and spends nothing; two joins with one token let
exactly one through."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from apiary.auth import Directory
from apiary.auth.bootstrap_tokens import (
    MAX_TTL_S,
    TOKEN_FORMAT,
    BootstrapTokenError,
    BootstrapTokens,
    NoBootstrapTokenError,
    NodeJoinedError,
    NoNodeError,
)
from apiary.errors import UnauthorizedError, ValidationError
from apiary.store import make_engine, migrate, session_factory
from apiary.store.models import BootstrapToken, Token
from apiary.store.unit import reading

NODES = frozenset({"node-a", "node-b"})
T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class Fixture:
    """A store, its directory and bootstrap tokens on a fake clock."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sessions = session_factory(engine)
        self.clock = Clock()
        self.directory = Directory(self.sessions, clock=self.clock)
        self.tokens = BootstrapTokens(self.sessions, self.directory, clock=self.clock)

    def row(self, token_id: str) -> BootstrapToken:
        with reading(self.sessions) as s:
            row = s.get(BootstrapToken, token_id)
            assert row is not None
            s.expunge(row)
            return row

    def agent_tokens(self, node: str) -> list[Token]:
        with reading(self.sessions) as s:
            rows = list(s.scalars(select(Token).where(Token.kind == "agent", Token.subject == node)))
            s.expunge_all()
            return rows


@pytest.fixture
def f(tmp_path: Path) -> Iterator[Fixture]:
    engine = make_engine(f"sqlite:///{tmp_path}/bt.db")
    migrate(engine)
    yield Fixture(engine)
    engine.dispose()


def test_a_token_joins_one_node_once_and_its_credential_is_that_nodes_agent(f: Fixture) -> None:
    token, shown = f.tokens.create(600, description="rack 3", by="root")
    assert re.fullmatch(TOKEN_FORMAT, token) and shown["id"] == token[:6]
    assert shown["state"] == "valid" and shown["expires"] == T0 + 600 and shown["createdBy"] == "root"
    secret = token[7:]
    assert secret not in str(shown) and secret not in f.row(shown["id"]).digest  # a digest only

    agent = f.tokens.spend(token, "node-a", NODES)
    principal = f.directory.authenticate(agent)
    assert (principal.kind, principal.name) == ("agent", "node-a")
    assert principal.is_agent_of("node-a") and not principal.is_agent_of("node-b")
    row = f.row(shown["id"])
    assert (row.used, row.used_by) == (T0, "node-a")
    assert [t["state"] for t in f.tokens.list()] == ["used"]

    with pytest.raises(BootstrapTokenError, match=rf"^Bootstrap token {shown['id']} was already used \(by node "
                                                  r"node-a at 2027-01-15T08:00:00.000Z\)"):
        f.tokens.spend(token, "node-b", NODES)
    assert f.agent_tokens("node-b") == [] and len(f.agent_tokens("node-a")) == 1


def test_an_expired_token_is_refused_and_stays_unspent(f: Fixture) -> None:
    token, shown = f.tokens.create(60)
    f.clock.now = T0 + 60
    with pytest.raises(BootstrapTokenError, match=rf"Bootstrap token {shown['id']} has expired \(at "):
        f.tokens.spend(token, "node-a", NODES)
    assert f.row(shown["id"]).used is None and f.agent_tokens("node-a") == []
    assert f.tokens.list()[0]["state"] == "expired"


def test_a_revoked_token_is_refused(f: Fixture) -> None:
    token, shown = f.tokens.create(600)
    assert f.tokens.revoke(shown["id"])["state"] == "revoked"
    assert f.tokens.revoke(shown["id"])["revoked"] == T0  # idempotent: the first time stays
    with pytest.raises(BootstrapTokenError, match=rf"Bootstrap token {shown['id']} was revoked"):
        f.tokens.spend(token, "node-a", NODES)
    with pytest.raises(NoBootstrapTokenError, match="zzzzzz not found"):
        f.tokens.revoke("zzzzzz")


def test_a_token_for_one_node_joins_no_other(f: Fixture) -> None:
    token, shown = f.tokens.create(600, node="node-a")
    with pytest.raises(BootstrapTokenError, match=rf"Bootstrap token {shown['id']} is for node node-a, not node-b"):
        f.tokens.spend(token, "node-b", NODES)
    assert f.row(shown["id"]).used is None  # refused: still good for node-a
    assert f.directory.authenticate(f.tokens.spend(token, "node-a", NODES)).name == "node-a"


def test_a_node_outside_the_cluster_config_is_a_404_naming_it(f: Fixture) -> None:
    token, shown = f.tokens.create(600)
    with pytest.raises(NoNodeError, match="Node node-z is not in the cluster config") as e:
        f.tokens.spend(token, "node-z", NODES)
    assert e.value.status_code == 404 and f.row(shown["id"]).used is None
    with pytest.raises(NoNodeError, match="node-z"):
        f.tokens.create(600, node="node-z", known_nodes=NODES)


def test_a_node_that_joined_cannot_join_again_until_its_credential_is_revoked(f: Fixture) -> None:
    """No node joins under a name in use: the live agent token must go first."""
    first, _ = f.tokens.create(600)
    f.tokens.spend(first, "node-a", NODES)
    second, shown = f.tokens.create(600)
    with pytest.raises(NodeJoinedError, match="Node node-a has joined already") as e:
        f.tokens.spend(second, "node-a", NODES)
    assert e.value.status_code == 409 and f.row(shown["id"]).used is None
    (live,) = f.agent_tokens("node-a")
    f.directory.revoke_token(live.id)
    assert f.directory.authenticate(f.tokens.spend(second, "node-a", NODES)).name == "node-a"


def test_an_expired_agent_token_does_not_count_as_joined(f: Fixture) -> None:
    f.directory.create_token("agent", "node-b", expires_in_s=10)
    token, _ = f.tokens.create(600)
    f.clock.now = T0 + 10
    assert f.directory.authenticate(f.tokens.spend(token, "node-b", NODES)).name == "node-b"


@pytest.mark.parametrize("text", [
    pytest.param(None, id="missing"),
    pytest.param("", id="empty"),
    pytest.param("abcdef", id="no-secret"),
    pytest.param("abcdef.0123456789abcde", id="short-secret"),
    pytest.param("ABCDEF.0123456789abcdef", id="upper-case"),
    pytest.param("abcdef:0123456789abcdef", id="wrong-separator"),
    pytest.param("apiary_0123456789ab_" + "a" * 43, id="an-apiary-token"),
])
def test_malformed_tokens_are_refused(f: Fixture, text: str | None) -> None:
    with pytest.raises(BootstrapTokenError, match="Missing bootstrap token|Malformed bootstrap token") as e:
        f.tokens.spend(text, "node-a", NODES)
    assert isinstance(e.value, UnauthorizedError) and e.value.status_code == 401


def test_an_unknown_id_and_a_wrong_secret_get_the_same_answer(f: Fixture) -> None:
    token, shown = f.tokens.create(600)
    f.tokens.revoke(shown["id"])  # a wrong secret must not reveal even this
    wrong = token[:7] + ("0" if token[7] != "0" else "1") + token[8:]
    messages = []
    for text in (wrong, "zzzzzz.0123456789abcdef"):
        with pytest.raises(BootstrapTokenError) as e:
            f.tokens.spend(text, "node-a", NODES)
        messages.append(e.value.message.replace(text[:6], "ID"))
    assert messages == ["Invalid bootstrap token ID: no such token, or a wrong secret."] * 2


@pytest.mark.parametrize("ttl", [0, -1, MAX_TTL_S + 1, float("nan")])
def test_a_lifetime_outside_0_to_24_hours_is_refused_naming_ttl_seconds(f: Fixture, ttl: float) -> None:
    with pytest.raises(ValidationError, match="ttlSeconds") as e:
        f.tokens.create(ttl)
    assert e.value.field == "ttlSeconds"
    assert f.tokens.list() == []


def test_the_claim_is_conditional_a_join_that_read_the_token_unused_loses_to_the_one_that_spent_it(
        f: Fixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between this join's read of the token and its claim, another one (another replica: its own
    service and lock) spends the token: the ``UPDATE ... WHERE used IS NULL`` claims no row, so
    this join is refused naming the winner, and the node has one credential."""
    token, shown = f.tokens.create(600)
    other = BootstrapTokens(f.sessions, f.directory, clock=f.clock)
    live_tokens = f.directory.live_tokens
    won: list[str] = []
    started = threading.Event()

    def interleaved(s, kind, subject):  # called after the read, before the claim
        if not started.is_set():  # this join, not the other one
            started.set()
            t = threading.Thread(target=lambda: won.append(other.spend(token, "node-b", NODES)))
            t.start()
            t.join(timeout=30)
            assert won, "the other join did not finish"
        return live_tokens(s, kind, subject)

    monkeypatch.setattr(f.directory, "live_tokens", interleaved)
    with pytest.raises(BootstrapTokenError, match=r"was already used \(by node node-b at "):
        f.tokens.spend(token, "node-a", NODES)
    assert f.row(shown["id"]).used_by == "node-b"
    assert f.agent_tokens("node-a") == [] and len(f.agent_tokens("node-b")) == 1


# --------------------------------------------------------------------------- races on PostgreSQL


def _race(jobs: list[Callable[[], str]]) -> list[object]:
    """Run the callables at once (released together by a barrier): each one's result or error."""
    barrier = threading.Barrier(len(jobs))
    results: list[object] = [None] * len(jobs)

    def run(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            results[i] = jobs[i]()
        except Exception as e:  # the race's loser: examined by the caller
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_two_replicas_joining_with_one_token_at_once_one_wins_on_postgresql(pg_url: str) -> None:
    engine = make_engine(pg_url)
    migrate(engine)
    try:
        f = Fixture(engine)
        replicas = [BootstrapTokens(f.sessions, f.directory, clock=f.clock) for _ in range(2)]
        for n in range(5):
            token, shown = f.tokens.create(600)
            nodes = [f"n{n}-a", f"n{n}-b"]
            known = set(nodes)
            results = _race([partial(r.spend, token, node, known) for r, node in zip(replicas, nodes, strict=True)])
            wins = [x for x in results if isinstance(x, str)]
            losses = [x for x in results if isinstance(x, BootstrapTokenError)]
            assert len(wins) == 1 and len(losses) == 1, results
            assert "was already used (by node" in losses[0].message
            winner = f.row(shown["id"]).used_by
            assert f.directory.authenticate(wins[0]).name == winner
            assert sum(len(f.agent_tokens(node)) for node in nodes) == 1
    finally:
        engine.dispose()


def test_one_node_joining_twice_at_once_with_two_tokens_joins_once_on_postgresql(pg_url: str) -> None:
    """The advisory lock on the node's name: the second join sees the first one's agent token."""
    engine = make_engine(pg_url)
    migrate(engine)
    try:
        f = Fixture(engine)
        replicas = [BootstrapTokens(f.sessions, f.directory, clock=f.clock) for _ in range(2)]
        for n in range(5):
            node = f"n{n}"
            tokens = [f.tokens.create(600)[0] for _ in replicas]
            results = _race([partial(r.spend, t, node, {node}) for r, t in zip(replicas, tokens, strict=True)])
            assert sorted(type(x).__name__ for x in results) == ["NodeJoinedError", "str"], results
            assert len(f.agent_tokens(node)) == 1
    finally:
        engine.dispose()
