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


def test_the_cache_only_check_never_reads_the_store_and_a_miss_is_loaded_off_the_event_loop(
        engine: Engine) -> None:
    """``authenticate_cached`` answers from the verified-token cache only (None on a miss, no store
    read); the API's ``get_principal`` then loads the token in a worker thread, never on the event
    loop, where a store read would hold up every other request."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from apiary.api.auth import get_principal

    d = Directory(session_factory(engine))
    d.create_user("ann")
    token = d.create_token("user", "ann").token
    loads: list[str] = []
    real_load = d._load

    def load(token_id: str, now: float):  # noqa: ANN202 - a spy
        loads.append(threading.current_thread().name)
        return real_load(token_id, now)

    d._load = load  # type: ignore[method-assign]
    assert d.authenticate_cached(token) is None and loads == []
    with pytest.raises(UnauthorizedError):
        d.authenticate_cached("apiary_nope")  # malformed: judged without the store
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(directory=d)), state=SimpleNamespace(),
                              headers={"authorization": f"Bearer {token}"})

    async def call() -> tuple[str, str]:
        principal = await get_principal(request)  # type: ignore[arg-type]
        return principal.name, threading.current_thread().name

    name, loop_thread = asyncio.run(call())
    assert name == "ann" and len(loads) == 1 and loads[0] != loop_thread
    assert d.authenticate_cached(token).name == "ann" and len(loads) == 1  # type: ignore[union-attr]
