"""The user directory writes through the store's unit of work: a store that refuses is a 503
naming the operation, for reads (token verification) as for writes, and a refused write changes
neither the store nor what the directory's cache answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from apiary.auth import Directory
from apiary.errors import ConflictUserError, UnauthorizedError, UnavailableError
from apiary.store import make_engine, migrate, session_factory


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path}/directory.db")
    migrate(engine)
    yield engine
    engine.dispose()


def test_token_verification_on_a_broken_store_is_a_503_naming_the_read(engine: Engine) -> None:
    directory = Directory(session_factory(engine))
    directory.create_user("alice")
    token = directory.create_token("user", "alice").token
    with engine.begin() as c:
        c.execute(text("DROP TABLE tokens"))
    with pytest.raises(UnavailableError, match="verify token"):
        directory.authenticate(token)


def test_a_refused_commit_changes_nothing_and_keeps_the_cache(engine: Engine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    directory = Directory(session_factory(engine), clock=lambda: clock[0])
    directory.create_user("alice")
    new = directory.create_token("user", "alice")
    assert directory.authenticate(new.token).name == "alice"

    def refuse(self: Session) -> None:
        raise OperationalError("COMMIT", {}, Exception("disk I/O error"))

    monkeypatch.setattr(Session, "commit", refuse)
    with pytest.raises(UnavailableError, match="revoke token"):
        directory.revoke_token(new.info["id"])
    with pytest.raises(UnavailableError, match="create user"):
        directory.create_user("bob")
    monkeypatch.undo()

    assert directory.token_info(new.info["id"])["revoked"] is None
    assert [u["name"] for u in directory.list_users()] == ["alice"]
    assert directory.authenticate(new.token).name == "alice"
    directory.revoke_token(new.info["id"])
    with pytest.raises(UnauthorizedError):
        directory.authenticate(new.token)


def test_exist_ok_returns_the_existing_user_and_group_unchanged(engine: Engine) -> None:
    directory = Directory(session_factory(engine))
    directory.create_group("team", description="first", virtual_clusters=["vc1"])
    directory.create_user("alice", groups=["team"], email="a@example.org")
    again = directory.create_group("team", description="second", virtual_clusters=["vc2"], exist_ok=True)
    assert (again["description"], again["virtualClusters"]) == ("first", ["vc1"])
    user = directory.create_user("alice", email="other@example.org", exist_ok=True)
    assert (user["email"], user["groups"]) == ("a@example.org", ["team"])
    with pytest.raises(ConflictUserError):
        directory.create_user("alice")
