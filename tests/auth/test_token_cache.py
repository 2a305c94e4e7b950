"""The verified-token cache: a user's token is read from the store again after ``cache_ttl_s``, a
node agent's after the longer ``agent_cache_ttl_s``, and a revocation takes effect at once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import update

from apiary.auth import Directory
from apiary.errors import UnauthorizedError
from apiary.store import make_engine, migrate, session_factory
from apiary.store.models import Token
from apiary.store.unit import UnitOfWork


class Clock:
    now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Directory, Clock, object]]:
    engine = make_engine(f"sqlite:///{tmp_path}/t.db")
    migrate(engine)
    clock = Clock()
    sessions = session_factory(engine)
    yield Directory(sessions, clock=clock, cache_ttl_s=5.0, agent_cache_ttl_s=60.0), clock, sessions
    engine.dispose()


def test_agent_tokens_are_kept_longer_than_user_tokens(world) -> None:
    directory, clock, sessions = world
    directory.create_user("alice")
    user = directory.create_token("user", "alice").token
    agent = directory.create_token("agent", "node-1").token
    assert directory.authenticate(user).name == "alice" and directory.authenticate(agent).name == "node-1"
    with UnitOfWork(sessions, "test") as uow:  # revoked by another process: only the store knows
        uow.s.execute(update(Token).values(revoked=clock.now))
        uow.commit()
    clock.now += 6
    with pytest.raises(UnauthorizedError):
        directory.authenticate(user)  # past the user TTL: read again, revoked
    assert directory.authenticate_cached(agent) is not None  # still within the agent TTL
    clock.now += 55
    assert directory.authenticate_cached(agent) is None  # due for a store read
    with pytest.raises(UnauthorizedError):
        directory.authenticate(agent)


def test_a_revocation_through_the_directory_is_seen_at_once(world) -> None:
    directory, _, _ = world
    new = directory.create_token("agent", "node-1")
    assert directory.authenticate(new.token).kind == "agent"
    directory.revoke_token(new.info["id"])
    assert directory.authenticate_cached(new.token) is None  # forgotten: the next call reads the store
    with pytest.raises(UnauthorizedError):
        directory.authenticate(new.token)


def test_agent_tokens_cached_at_one_instant_fall_due_over_the_second_half_of_the_ttl(world) -> None:
    directory, clock, _ = world
    fleet = [directory.create_token("agent", f"node-{i}").token for i in range(200)]
    for token in fleet:  # a fleet's first calls, all at once
        directory.authenticate(token)
    start, due_by = clock.now, {}
    for after in (29.0, 45.0, 60.0):
        clock.now = start + after
        due_by[after] = sum(directory.authenticate_cached(t) is None for t in fleet)
    assert due_by[29.0] == 0  # none before half the TTL
    assert 0 < due_by[45.0] < 200  # some by three quarters: spread, not one burst
    assert due_by[60.0] == 200  # every one by the TTL


def test_a_group_change_forgets_user_principals_but_keeps_the_fleets_agent_tokens(world) -> None:
    directory, _, _ = world
    directory.create_user("alice")
    user = directory.create_token("user", "alice").token
    agents = [directory.create_token("agent", f"node-{i}").token for i in range(3)]
    for token in (user, *agents):
        directory.authenticate(token)
    directory.create_group("team", virtual_clusters=["vc1"])
    directory.set_member("team", "alice")
    assert directory.authenticate_cached(user) is None  # her groups changed: read again
    assert directory.authenticate(user).virtual_clusters == frozenset({"vc1"})
    assert all(directory.authenticate_cached(t) is not None for t in agents)  # no fleet-wide re-read


def test_revoking_one_token_forgets_that_token_only(world) -> None:
    directory, _, _ = world
    first, second = directory.create_token("agent", "node-1"), directory.create_token("agent", "node-2")
    for new in (first, second):
        directory.authenticate(new.token)
    directory.revoke_token(first.info["id"])
    assert directory.authenticate_cached(first.token) is None
    assert directory.authenticate_cached(second.token) is not None
    with pytest.raises(UnauthorizedError):
        directory.authenticate(first.token)
