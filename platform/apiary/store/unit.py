"""The unit of work: the only way Apiary opens a store session.

Every package that writes the store (the control plane's services, the user directory, CI
records, incidents) writes through :class:`UnitOfWork`: it opens one session, the caller reads
and adds rows, :meth:`UnitOfWork.commit` commits once and only then runs the callbacks queued
with :meth:`UnitOfWork.after_commit` (in-memory caches, wake-ups, notifications). When the
commit fails the session is rolled back, nothing queued runs, and the failure is raised as
:class:`apiary.errors.ConflictError` (409, a unique-key clash) or
:class:`apiary.errors.UnavailableError` (503, any other store failure: disk full, database
locked, server gone), so memory never claims what the store does not hold.

Readers use :func:`reading`: a session that is rolled back at the end and never commits.

    with UnitOfWork(sessions, "create user") as uow:
        uow.s.add(User(...))
        uow.after_commit(lambda: cache.pop(name, None))
    # committed here (or ConflictError / UnavailableError raised, nothing applied)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from apiary.errors import ConflictError, UnavailableError

logger = logging.getLogger(__name__)

Sessions = sessionmaker[Session]


@contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Turn the store's failures into Apiary errors: a unique-key clash into ConflictError (409), any
    other SQLAlchemy error (disk full, database locked, server gone) into UnavailableError (503)
    naming the cause, so clients retry instead of seeing a bare 500."""
    try:
        yield
    except IntegrityError as e:
        raise ConflictError(f"{what}: conflicting write ({_cause(e)}).") from e
    except SQLAlchemyError as e:
        logger.error("store failed during %s: %s", what, _cause(e))
        raise UnavailableError(f"{what}: the store cannot commit right now ({_cause(e)}); retry later.") from e


def _cause(e: SQLAlchemyError) -> str:
    orig = getattr(e, "orig", None)
    return str(orig if orig is not None else e).splitlines()[0]


@contextmanager
def reading(sessions: Sessions, what: str = "read") -> Iterator[Session]:
    """A session for reads only: rolled back and closed at the end, never committed. The store's
    failures are raised as by :func:`store_errors`."""
    with sessions() as s, store_errors(what):
        try:
            yield s
        finally:
            s.rollback()


class UnitOfWork:
    """One session, one commit, then the queued callbacks; see the module docstring.

    As a context manager it commits on a clean exit and rolls back on an exception (the exception
    propagates; the store's own failures in the body's statements as ConflictError or
    UnavailableError, like the commit's). :meth:`commit` may also be called explicitly, once; the exit then only closes.
    Not thread-safe: one thread uses a unit from start to commit.
    """

    def __init__(self, sessions: Sessions, what: str) -> None:
        self.what = what
        self.s: Session = sessions()
        self._after: list[Callable[[], None]] = []
        self._on_failure: list[Callable[[], None]] = []
        self._done = False

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the commit succeeded (in queue order); never when it failed."""
        self._after.append(fn)

    def on_failure(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` after a failed commit or an exception inside the unit (after the rollback):
        for undoing tentative in-memory decisions made while the unit was open."""
        self._on_failure.append(fn)

    def flush(self) -> None:
        """Send pending writes (to learn generated keys) without committing; store errors as in
        :func:`store_errors`."""
        with store_errors(self.what):
            self.s.flush()

    def commit(self) -> None:
        """Commit, then run the after-commit callbacks. Raises ConflictError or UnavailableError
        (rolled back, nothing run but the failure callbacks) when the store refuses."""
        if self._done:
            raise RuntimeError(f"{self.what}: the unit of work was already committed")
        self._done = True
        try:
            with store_errors(self.what):
                self.s.commit()
        except Exception:
            self._fail()
            raise
        after, self._after = self._after, []
        for fn in after:
            fn()

    def _fail(self) -> None:
        self._done = True
        try:
            self.s.rollback()
        finally:
            for fn in self._on_failure:
                fn()

    def __enter__(self) -> UnitOfWork:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc_type is not None:
                if not self._done:
                    self._fail()
                if isinstance(exc, SQLAlchemyError):  # a statement of the body failed: 409 / 503 as at commit
                    with store_errors(self.what):
                        raise exc
            elif not self._done:
                self.commit()
        finally:
            self.s.close()
