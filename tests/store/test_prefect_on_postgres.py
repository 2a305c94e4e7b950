"""Prefect's server on PostgreSQL next to Apiary's store (what ``apiary up`` does when
``APIARY_DATABASE_URL`` is PostgreSQL): the sibling database is created, migrated by Prefect,
healthy, and takes flow runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from apiary.embedded import Embedded
from apiary.tracking.prefect_server import ensure_database, start_prefect_server

pytestmark = [pytest.mark.postgres, pytest.mark.prefect]


@pytest.fixture(autouse=True)
def _prefect_env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect-client")))
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _tables(url: str) -> set[str]:
    u = make_url(url)
    with psycopg.connect(
        host=u.host, port=u.port, user=u.username, password=u.password, dbname=u.database, connect_timeout=10
    ) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {r[0] for r in rows}


def test_prefect_server_runs_on_a_sibling_postgresql_database(pg_url: str, tmp_path: Path) -> None:
    url = Embedded._prefect_database(pg_url)  # creates "<db>_prefect"
    assert url is not None
    u = make_url(url)
    assert u.drivername == "postgresql+asyncpg"
    assert u.database == f"{make_url(pg_url).database}_prefect"
    assert ensure_database(pg_url, u.database) is False  # exists now: a second start creates nothing
    assert Embedded._prefect_database(pg_url) == url

    server = start_prefect_server(tmp_path / "prefect", database_url=url, timeout_s=120)
    try:
        assert server.database_url == url
        import httpx

        health = httpx.get(f"{server.api_url}/health", timeout=10)
        assert health.status_code == 200 and health.json() is True

        from prefect.client.orchestration import PrefectClient
        from prefect.states import Pending

        async def create_and_read() -> tuple:
            async with PrefectClient(api=server.api_url) as client:
                flow_id = await client.create_flow_from_name("apiary-job")
                from prefect.client.schemas.actions import FlowRunCreate
                from prefect.states import to_state_create

                resp = await client.request(
                    "POST",
                    "/flow_runs/",
                    json=FlowRunCreate(
                        flow_id=flow_id,
                        name="alice~pg",
                        state=to_state_create(Pending(message="hi")),
                    ).model_dump(mode="json", exclude_unset=True),
                )
                run = await client.read_flow_run(resp.json()["id"])
                states = await client.read_flow_run_states(run.id)
                return run, states

        run, states = asyncio.run(create_and_read())
        assert run.name == "alice~pg" and run.state.is_pending()
        assert [s.type.value for s in states] == ["PENDING"]
        # Prefect migrated and wrote its own database, not SQLite and not Apiary's.
        assert "flow_run" in _tables(url)
        assert "flow_run" not in _tables(pg_url)
        assert not (tmp_path / "prefect" / "prefect.db").exists()
    finally:
        server.stop()
