"""Which database Prefect's server runs on: SQLite by default, PostgreSQL next to Apiary's (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from apiary.embedded import Embedded
from apiary.tracking.prefect_server import PrefectServer, prefect_database_url, sqlite_url


@pytest.mark.parametrize(
    "apiary_url",
    [None, "", "sqlite:///tmp/apiary.db", "sqlite:////abs/path/apiary.db", "sqlite+pysqlite:///:memory:"],
)
def test_sqlite_or_unset_keeps_prefect_on_its_own_sqlite_file(apiary_url: str | None) -> None:
    assert prefect_database_url(apiary_url) is None
    assert Embedded._prefect_database(apiary_url) is None  # and nothing is connected to


def test_postgresql_gives_a_sibling_database_with_the_asyncpg_driver() -> None:
    url = prefect_database_url("postgresql+psycopg://apiary:secret@127.0.0.1:5433/apiary")
    assert url == "postgresql+asyncpg://apiary:secret@127.0.0.1:5433/apiary_prefect"


@pytest.mark.parametrize("driver", ["postgresql", "postgresql+psycopg", "postgresql+psycopg2", "postgresql+asyncpg"])
def test_any_postgresql_driver_becomes_asyncpg(driver: str) -> None:
    u = make_url(prefect_database_url(f"{driver}://u:p@db.example:5432/jobs"))
    assert (u.drivername, u.host, u.port, u.database, u.username, u.password) == (
        "postgresql+asyncpg",
        "db.example",
        5432,
        "jobs_prefect",
        "u",
        "p",
    )


def test_no_port_stays_without_port() -> None:
    assert (
        prefect_database_url("postgresql://u:p@localhost/apiary") == "postgresql+asyncpg://u:p@localhost/apiary_prefect"
    )


def test_password_with_reserved_characters_survives() -> None:
    src = make_url("postgresql+psycopg://u@h:1/apiary").set(password="p@ss/w:rd%?#")
    url = prefect_database_url(src.render_as_string(hide_password=False))
    assert make_url(url).password == "p@ss/w:rd%?#"
    assert make_url(url).database == "apiary_prefect"


def test_query_keeps_what_asyncpg_takes() -> None:
    url = prefect_database_url(
        "postgresql+psycopg://u:p@h:5432/apiary?sslmode=require&connect_timeout=5&application_name=apiary"
    )
    assert dict(make_url(url).query) == {"ssl": "require"}
    sock = prefect_database_url("postgresql+psycopg://u:p@/apiary?host=/var/run/postgresql")
    assert dict(make_url(sock).query) == {"host": "/var/run/postgresql"}


def test_custom_suffix() -> None:
    assert make_url(prefect_database_url("postgresql://u:p@h/apiary", suffix="_ui")).database == "apiary_ui"


def test_url_without_database_or_with_a_too_long_name_is_refused() -> None:
    with pytest.raises(ValueError, match="database name"):
        prefect_database_url("postgresql+psycopg://u:p@h:5432")
    with pytest.raises(ValueError, match="63 bytes"):
        prefect_database_url("postgresql+psycopg://u:p@h:5432/" + "d" * 56)  # + "_prefect" = 64
    assert prefect_database_url("postgresql+psycopg://u:p@h:5432/" + "d" * 55).endswith("d" * 55 + "_prefect")


def test_server_records_its_database(tmp_path: Path) -> None:
    class Proc:
        pid = 0

    assert PrefectServer(Proc(), "127.0.0.1", 1, tmp_path, tmp_path / "log").database_url == sqlite_url(tmp_path)
    pg = "postgresql+asyncpg://u:p@h/apiary_prefect"
    assert PrefectServer(Proc(), "127.0.0.1", 1, tmp_path, tmp_path / "log", pg).database_url == pg


@pytest.mark.prefect
def test_a_taken_port_is_not_mistaken_for_a_started_server(tmp_path: Path) -> None:
    """Something else answering GET /api/health on the port must not pass for our server."""
    import http.server
    import threading

    from apiary.errors import PlatformError
    from apiary.tracking.prefect_server import free_port, start_prefect_server

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    other = http.server.HTTPServer(("127.0.0.1", port), Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(PlatformError, match="already in use"):
            start_prefect_server(tmp_path / "prefect", port=port, timeout_s=60)
    finally:
        other.shutdown()
        other.server_close()
