"""MLflow on a PostgreSQL-backed platform: its tracking and auth stores are databases of their own
beside Apiary's (``<db>_mlflow``, ``<db>_mlflow_auth``), created at the start; nothing is kept in
SQLite under the home, and the password is not on the server's command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool
from tests.pg import start_postgres_or_skip
from tests.support.mlflow import IdentityStub, mlflow_server, needs_mlflow

pytestmark = [pytest.mark.mlflow, pytest.mark.postgres, needs_mlflow, pytest.mark.timeout(600)]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "mnist"))
import mlflow_rest  # noqa: E402  (examples/mnist is no package)


def test_mlflow_keeps_its_runs_and_users_in_databases_beside_apiarys(tmp_path: Path) -> None:
    url, stop = start_postgres_or_skip(tmp_path / "pg")
    stub = IdentityStub({"alice-token": {"user": "alice", "admin": False, "groups": []}})
    try:
        with mlflow_server(tmp_path / "home", stub.url, apiary_database_url=url) as server:
            password = url.split(":")[2].split("@")[0]
            assert not any(password in a for a in server.argv())
            alice = mlflow_rest.Client(server.url, "alice-token")
            info = alice.create_run(alice.experiment_id("users/alice"), "pg", {"apiary.job": "alice~pg"})
            alice.log_batch(info["run_id"], {"acc": 0.5}, step=1)
            alice.end_run(info["run_id"])
            assert alice.register_version("pg-model", info["artifact_uri"], info["run_id"])["version"] == "1"
        engine = create_engine(url, poolclass=NullPool)
        with engine.connect() as c:
            names = {r[0] for r in c.execute(text("SELECT datname FROM pg_database"))}
        engine.dispose()
        assert {"apiary_mlflow", "apiary_mlflow_auth"} <= names
        mlflow_db = create_engine(url.rsplit("/", 1)[0] + "/apiary_mlflow", poolclass=NullPool)
        with mlflow_db.connect() as c:
            assert c.execute(text("SELECT count(*) FROM model_versions WHERE name = 'pg-model'")).scalar() == 1
        mlflow_db.dispose()
        auth_db = create_engine(url.rsplit("/", 1)[0] + "/apiary_mlflow_auth", poolclass=NullPool)
        with auth_db.connect() as c:
            users = {r[0] for r in c.execute(text("SELECT username FROM users"))}
        auth_db.dispose()
        assert "alice" in users
        assert not list((tmp_path / "home").rglob("*.db"))
    finally:
        stub.close()
        stop()
