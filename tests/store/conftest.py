"""Store fixtures: a private PostgreSQL server for the ``postgres``-marked tests.

Without PostgreSQL binaries the tests skip locally, but in CI (``CI=true``) they FAIL: CI
installs PostgreSQL (``.ci/run``) and must never silently skip the real database.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.pg import PostgresNotFound, create_database, start_postgres


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (``postgresql+psycopg://…@127.0.0.1:PORT/apiary``) of a server started for this session."""
    try:
        t0 = time.monotonic()
        url, stop = start_postgres(tmp_path_factory.mktemp("postgres"))
    except PostgresNotFound as e:
        if _in_ci():
            pytest.fail(f"CI=true but PostgreSQL is not installed (.ci/run installs it): {e}", pytrace=False)
        pytest.skip(f"PostgreSQL not installed: {e}")
    print(f"\nPostgreSQL started in {time.monotonic() - t0:.2f} s")
    try:
        yield url
    finally:
        stop()


@pytest.fixture
def pg_url(postgres_url: str) -> str:
    """A fresh, empty database of its own on the session's server, for one test."""
    return create_database(postgres_url, f"t_{uuid.uuid4().hex[:16]}")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store's URL, once for SQLite (a file in the test's directory) and once for
    PostgreSQL (:func:`pg_url`; the ``postgres`` mark)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.db"
    return str(request.getfixturevalue("pg_url"))
