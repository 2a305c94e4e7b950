"""MLflow's tracking server and Model Registry as the platform's model registry: its command and config.

``apiary up`` runs ``mlflow server`` from MLflow's own virtualenv (``.venv-mlflow`` at the
repository root, made by ``make setup`` from ``deploy/mlflow/requirements.txt``: MLflow's pins clash
with the main venv's) as a supervised child, when that venv exists. :func:`plan` decides everything
about it for one home, and :class:`MlflowServer` turns that into the child's argv, environment and
ini file:

- **where**: loopback, a free port remembered in ``home/run/mlflow-port`` (kept while free, so a
  restart keeps the URL tasks were given);
- **backend store**: SQLite ``home/mlflow/mlflow.db``; when Apiary's store is PostgreSQL
  (``APIARY_DATABASE_URL``) a database of its own on that server, ``<apiary db>_mlflow`` (and
  ``<apiary db>_mlflow_auth`` for the auth store), created if missing;
- **artifacts**: ``--serve-artifacts`` with ``--artifacts-destination`` on the platform's storage:
  ``home/storage/home/mlflow-artifacts`` when ``apiary up``'s local storage exists, else
  ``home/mlflow/artifacts``; the directory is 0700 (the platform's uid), so a task that mounts
  ``/mnt/home`` (other uids) cannot read it: artifacts are reached through MLflow only;
- **identity**: ``--app-name basic-auth`` with an ini (``home/mlflow/auth.ini``, 0600) whose
  ``authorization_function`` is :mod:`apiary_mlflow_auth` (``mlflow_plugin/``, on the child's
  ``PYTHONPATH``): Apiary's tokens, not MLflow's passwords; ``default_permission =
  NO_PERMISSIONS``; the ini's admin password is random, kept in ``home/credentials/mlflow-admin``
  (0600) and never logged (no Apiary code path uses it: callers are always Apiary's users).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from apiary.auth.bootstrap import read_token, write_secret
from apiary.errors import UnavailableError
from apiary.procutil import private_dir, remembered_port, write_private

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
#: MLflow's own virtualenv, made by ``make setup``.
MLFLOW_VENV = REPO_ROOT / ".venv-mlflow"
#: The directory of the authorization plugin, put on the server's ``PYTHONPATH``.
PLUGIN_DIR = Path(__file__).resolve().parent / "mlflow_plugin"
PLUGIN_FUNCTION = "apiary_mlflow_auth:authenticate"
#: The ini's admin user: never an Apiary user (the plugin refuses a user of this name).
ADMIN_USER = "apiary-mlflow-admin"
#: Under the home: the remembered port, the admin password, MLflow's own files.
PORT_FILE = Path("run") / "mlflow-port"
PASSWORD_FILE = Path("credentials") / "mlflow-admin"
FLASK_KEY_FILE = Path("credentials") / "mlflow-flask.key"
MLFLOW_DIR = Path("mlflow")
#: The suffix of MLflow's PostgreSQL databases next to Apiary's.
DB_SUFFIX = "_mlflow"


def venv_python(venv: Path = MLFLOW_VENV) -> Path | None:
    """The MLflow venv's interpreter when the venv is complete (``bin/mlflow`` exists), else None."""
    python = venv / "bin" / "python"
    return python if python.exists() and (venv / "bin" / "mlflow").exists() else None


def mlflow_database_urls(apiary_database_url: str | None) -> tuple[str, str] | None:
    """``(tracking, auth)`` SQLAlchemy URLs of MLflow's databases next to Apiary's PostgreSQL store
    (databases ``<name>_mlflow`` and ``<name>_mlflow_auth``, driver psycopg2), or None for SQLite
    or no URL. Pure. Raises ValueError for a PostgreSQL URL without a database name."""
    from sqlalchemy.engine import make_url

    if not apiary_database_url:
        return None
    u = make_url(apiary_database_url)
    if u.get_backend_name() != "postgresql":
        return None
    if not u.database:
        raise ValueError("APIARY_DATABASE_URL: a PostgreSQL URL needs a database name")
    query = {k: v for k, v in u.query.items() if k in ("host", "sslmode")}

    def url(name: str) -> str:
        return u.set(drivername="postgresql+psycopg2", database=name, query=query).render_as_string(hide_password=False)

    return url(f"{u.database}{DB_SUFFIX}"), url(f"{u.database}{DB_SUFFIX}_auth")


@dataclass(frozen=True)
class MlflowServer:
    """One home's MLflow server. ``python``: the MLflow venv's interpreter; ``api_url``: the Apiary
    API the plugin asks (loopback); ``backend_uri`` / ``auth_uri``: the tracking and auth stores;
    ``artifacts``: the artifacts destination directory."""

    home: Path
    python: Path
    port: int
    api_url: str
    backend_uri: str = field(repr=False)  # a PostgreSQL one holds its password
    auth_uri: str = field(repr=False)
    artifacts: Path
    host: str = "127.0.0.1"
    workers: int = 1
    #: Apiary's PostgreSQL URL, to create MLflow's databases beside it (None: SQLite).
    apiary_database_url: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The tracking URI (tasks on this host, the control plane and the UI use it)."""
        return f"http://{self.host}:{self.port}"

    @property
    def ini_path(self) -> Path:
        return self.home / MLFLOW_DIR / "auth.ini"

    def argv(self) -> list[str]:
        """``mlflow server`` with the basic-auth app (MLflow's own CLI module, run by the venv's python).
        The backend store is in the environment (``MLFLOW_BACKEND_STORE_URI``), not here: a
        PostgreSQL URL holds a password, and a command line is visible to every user of the host."""
        return [str(self.python), "-m", "mlflow", "server", "--app-name", "basic-auth",
                "--host", self.host, "--port", str(self.port), "--workers", str(self.workers),
                "--serve-artifacts", "--artifacts-destination", str(self.artifacts)]

    def ini_text(self, admin_password: str) -> str:
        """The auth app's ini (the secret inside: write it 0600)."""
        return "\n".join([
            "[mlflow]",
            "default_permission = NO_PERMISSIONS",
            f"database_uri = {self.auth_uri}",
            f"admin_username = {ADMIN_USER}",
            f"admin_password = {admin_password}",
            f"authorization_function = {PLUGIN_FUNCTION}",
            "grant_default_workspace_access = false",
            "",
        ])

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The child's environment: ``base`` without Apiary's own secrets (``APIARY_TOKEN``,
        ``APIARY_DATABASE_URL``, MLflow tokens), plus the ini, the plugin's path and the Apiary URL."""
        env = {k: v for k, v in base.items()
               if not k.startswith(("MLFLOW_", "PYTHON")) and k not in ("APIARY_TOKEN", "APIARY_DATABASE_URL")}
        env.update({
            "MLFLOW_AUTH_CONFIG_PATH": str(self.ini_path),
            "MLFLOW_BACKEND_STORE_URI": self.backend_uri,
            "PYTHONPATH": str(PLUGIN_DIR),
            "PYTHONUNBUFFERED": "1",
            "APIARY_API_URL": self.api_url,
            "APIARY_MLFLOW_ADMIN_USER": ADMIN_USER,
            # No job runner (GenAI judges, trace rollups): seven huey consumers Apiary does not use.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            # Flask's session/CSRF key of the auth app (home/credentials/mlflow-flask.key, 0600).
            "MLFLOW_FLASK_SERVER_SECRET_KEY": kept_secret(self.home / FLASK_KEY_FILE),
        })
        return env

    def prepare(self) -> None:
        """Write the ini (0600) with the home's admin password (made once, 0600) and make MLflow's
        directories (0700). Creates the PostgreSQL databases when the stores are PostgreSQL."""
        private_dir(self.home / MLFLOW_DIR)
        private_dir(self.artifacts)
        os.chmod(self.artifacts, 0o700)
        write_private(self.ini_path, self.ini_text(kept_secret(self.home / PASSWORD_FILE)))
        if self.apiary_database_url:
            from sqlalchemy.engine import make_url

            from apiary.tracking.prefect_server import ensure_database

            for uri in (self.backend_uri, self.auth_uri):
                if uri.startswith("postgresql"):  # created from Apiary's own connection (its driver)
                    ensure_database(self.apiary_database_url, str(make_url(uri).database))

    def wait(self, timeout_s: float = 120.0, alive: object = None) -> None:
        """Wait until ``/health`` answers 200. ``alive``: a callable, False once the process died.
        Raises UnavailableError after ``timeout_s`` or when the process died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if callable(alive) and not alive():
                raise UnavailableError(f"MLflow exited while starting; see {self.home / 'logs' / 'mlflow.log'}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise UnavailableError(f"MLflow not answering at {self.url} after {timeout_s:.0f} s")


def kept_secret(path: Path) -> str:
    """A random secret kept in ``path`` (0600, its directory 0700), made on the first call: the
    ini's admin password (:data:`PASSWORD_FILE`), Flask's key (:data:`FLASK_KEY_FILE`)."""
    value = read_token(path)
    if value is None:
        value = secrets.token_urlsafe(32)
        write_secret(path, value)
    return value


def artifacts_dir(home: Path) -> Path:
    """Where MLflow keeps artifacts: on ``apiary up``'s local storage (``home/storage/home``) when it
    exists, else under the home's MLflow directory."""
    storage = home / "storage" / "home"
    return storage / "mlflow-artifacts" if storage.is_dir() else home / MLFLOW_DIR / "artifacts"


def plan(home: Path, *, api_url: str, port: int, python: Path,
         apiary_database_url: str | None = None) -> MlflowServer:
    """The MLflow server of ``home`` (see the module doc). Pure but for the artifacts directory
    check. Raises ValueError for a PostgreSQL ``apiary_database_url`` without a database name."""
    home = Path(home)
    pg = mlflow_database_urls(apiary_database_url)
    backend, auth = pg if pg else (f"sqlite:///{home / MLFLOW_DIR / 'mlflow.db'}",
                                   f"sqlite:///{home / MLFLOW_DIR / 'auth.db'}")
    return MlflowServer(home=home, python=python, port=port, api_url=api_url, backend_uri=backend,
                        auth_uri=auth, artifacts=artifacts_dir(home),
                        apiary_database_url=apiary_database_url if pg else None)


def for_home(home: Path, *, api_url: str, choose_port: Callable[[], int], taken: set[int] | None = None,
             apiary_database_url: str | None = None, venv: Path = MLFLOW_VENV) -> MlflowServer | None:
    """The MLflow server ``apiary up`` runs for ``home`` (port remembered, :func:`apiary.procutil.remembered_port`),
    or None, said in the log, when MLflow's venv is missing (``make setup`` makes it)."""
    python = venv_python(venv)
    if python is None:
        logger.warning("mlflow: not installed (no %s; make setup makes it): running without a model registry", venv)
        return None
    port = remembered_port(home / PORT_FILE, choose_port, taken or set(), what="mlflow")
    return plan(home, api_url=api_url, port=port, python=python, apiary_database_url=apiary_database_url)
