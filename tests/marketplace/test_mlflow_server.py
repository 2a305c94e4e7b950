"""The MLflow server's command line and config (apiary.marketplace.mlflow_server): loopback and a
remembered port, SQLite under the home or databases of its own beside a PostgreSQL store,
artifacts on the platform's storage, the basic-auth app with Apiary's plugin, NO_PERMISSIONS, and
secrets kept 0600 that never reach the argv."""

from __future__ import annotations

from pathlib import Path

import pytest

from apiary.marketplace import mlflow_server as ms
from apiary.tracking.prefect_server import free_port

PY = Path("/opt/mlflow/bin/python")


def test_argv_and_ini_of_a_sqlite_home(tmp_path: Path) -> None:
    s = ms.plan(tmp_path, api_url="http://127.0.0.1:8470", port=5001, python=PY)
    argv = s.argv()
    assert argv[:4] == [str(PY), "-m", "mlflow", "server"]
    assert argv[argv.index("--app-name") + 1] == "basic-auth"
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "5001"
    assert "--backend-store-uri" not in argv  # in the environment: a PostgreSQL one holds a password
    assert s.env({})["MLFLOW_BACKEND_STORE_URI"] == f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    assert "--serve-artifacts" in argv
    assert argv[argv.index("--artifacts-destination") + 1] == str(tmp_path / "mlflow" / "artifacts")
    assert s.url == "http://127.0.0.1:5001"

    s.prepare()
    ini = s.ini_path.read_text()
    assert "default_permission = NO_PERMISSIONS" in ini
    assert f"authorization_function = {ms.PLUGIN_FUNCTION}" in ini
    assert f"database_uri = sqlite:///{tmp_path}/mlflow/auth.db" in ini
    password = (tmp_path / ms.PASSWORD_FILE).read_text().strip()
    assert len(password) >= 32 and f"admin_password = {password}" in ini
    for secret in (s.ini_path, tmp_path / ms.PASSWORD_FILE, tmp_path / ms.FLASK_KEY_FILE):
        if secret.exists():
            assert secret.stat().st_mode & 0o777 == 0o600, secret
    assert s.artifacts.stat().st_mode & 0o777 == 0o700
    # The password is made once: a second prepare keeps it; it is never on the command line.
    s.prepare()
    assert (tmp_path / ms.PASSWORD_FILE).read_text().strip() == password
    assert not any(password in a for a in argv)


def test_env_carries_the_plugin_and_no_platform_secret(tmp_path: Path) -> None:
    s = ms.plan(tmp_path, api_url="http://127.0.0.1:8470", port=5001, python=PY)
    env = s.env({"PATH": "/bin", "APIARY_TOKEN": "admin-token", "APIARY_DATABASE_URL": "postgresql://u:pw@h/db",
                 "MLFLOW_TRACKING_TOKEN": "x", "PYTHONPATH": "/elsewhere"})
    assert env["MLFLOW_AUTH_CONFIG_PATH"] == str(s.ini_path)
    assert env["PYTHONPATH"] == str(ms.PLUGIN_DIR)
    assert (ms.PLUGIN_DIR / "apiary_mlflow_auth.py").is_file()
    assert env["APIARY_API_URL"] == "http://127.0.0.1:8470"
    assert "APIARY_TOKEN" not in env and "APIARY_DATABASE_URL" not in env and "MLFLOW_TRACKING_TOKEN" not in env
    key = (tmp_path / ms.FLASK_KEY_FILE)
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"] == key.read_text().strip()
    assert key.stat().st_mode & 0o777 == 0o600


def test_artifacts_go_to_the_platforms_local_storage_when_it_exists(tmp_path: Path) -> None:
    (tmp_path / "storage" / "home").mkdir(parents=True)
    s = ms.plan(tmp_path, api_url="http://x", port=1, python=PY)
    assert s.artifacts == tmp_path / "storage" / "home" / "mlflow-artifacts"


@pytest.mark.parametrize(("apiary", "want"), [
    pytest.param(None, None, id="none"),
    pytest.param("sqlite:////tmp/a.db", None, id="sqlite"),
    pytest.param("postgresql+psycopg://u:p%40ss@db.example:5433/apiary?sslmode=require&application_name=x",
                 ("postgresql+psycopg2://u:p%40ss@db.example:5433/apiary_mlflow?sslmode=require",
                  "postgresql+psycopg2://u:p%40ss@db.example:5433/apiary_mlflow_auth?sslmode=require"), id="pg"),
])
def test_postgresql_stores_are_databases_of_their_own(apiary: str | None, want: tuple | None) -> None:
    assert ms.mlflow_database_urls(apiary) == want


def test_a_postgresql_url_without_a_database_is_refused() -> None:
    with pytest.raises(ValueError, match="database name"):
        ms.mlflow_database_urls("postgresql://u@h/")


def test_no_venv_no_server(tmp_path: Path) -> None:
    assert ms.for_home(tmp_path, api_url="http://x", choose_port=free_port, venv=tmp_path / "none") is None
    assert not (tmp_path / ms.PORT_FILE).exists()
