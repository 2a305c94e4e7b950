"""The unit of work (:mod:`apiary.store.unit`): one commit, callbacks only after it, the store's
failures as 409 / 503 wherever they happen inside the unit."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from apiary.errors import ConflictError, UnavailableError
from apiary.store import make_engine, migrate, session_factory
from apiary.store.models import User
from apiary.store.unit import UnitOfWork, reading


@pytest.fixture
def sessions(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path / 'apiary.db'}")
    migrate(engine)
    yield session_factory(engine)
    engine.dispose()


def test_callbacks_run_after_the_commit_and_never_after_a_failed_one(sessions) -> None:
    seen: list[str] = []
    with UnitOfWork(sessions, "create user") as uow:
        uow.s.add(User(name="ann", created=1.0))
        uow.after_commit(lambda: seen.append("applied"))
        assert seen == []
    assert seen == ["applied"]
    with pytest.raises(ConflictError, match="create user"), UnitOfWork(sessions, "create user") as uow:
        uow.s.add(User(name="ann", created=1.0))  # the same primary key: refused at the commit
        uow.after_commit(lambda: seen.append("applied twice"))
        uow.on_failure(lambda: seen.append("undone"))
    assert seen == ["applied", "undone"]
    with reading(sessions) as s:
        assert [u.name for u in s.query(User)] == ["ann"]


def test_a_statement_of_the_body_that_the_store_refuses_is_a_503_and_writes_nothing(sessions) -> None:
    """A failure before the commit (a locked or full database answering a statement) is the same
    503 as one at the commit, not a bare SQLAlchemy error (which the API would answer with 500)."""
    with pytest.raises(UnavailableError, match="delete user: the store cannot commit"):
        with UnitOfWork(sessions, "delete user") as uow:
            uow.s.add(User(name="bob", created=1.0))
            uow.s.execute(text("DELETE FROM no_such_table"))
    with reading(sessions) as s:
        assert s.get(User, "bob") is None


def test_a_unique_clash_in_a_flush_of_the_body_is_a_409(sessions) -> None:
    with UnitOfWork(sessions, "create user") as uow:
        uow.s.add(User(name="cy", created=1.0))
    with pytest.raises(ConflictError, match="create user: conflicting write"):
        with UnitOfWork(sessions, "create user") as uow:
            uow.s.add(User(name="cy", created=1.0))
            uow.s.flush()  # the session's own flush, not UnitOfWork.flush
