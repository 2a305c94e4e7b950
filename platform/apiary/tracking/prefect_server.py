"""Start and stop a local Prefect server (``prefect server start``) as a subprocess.

The server runs in its own process group with a SQLite database under ``home`` (its
``PREFECT_HOME``) by default, or on PostgreSQL when given a ``database_url``
(``postgresql+asyncpg://...``; :func:`prefect_database_url` derives one from Apiary's own
PostgreSQL URL and :func:`ensure_database` creates it), telemetry off and the UI served from the
installed wheel (no network). Used by tests, by ``apiary up`` and by anyone who wants the Prefect
UI next to Apiary.

Measured here (Prefect 3.8.8, 2 CPUs): start to first healthy ``GET /api/health`` takes
about 7.4 s on a fresh home (the database migrations run on first start) and about 2.8 s on
an existing one; stop takes 0.1-0.2 s. :func:`start_prefect_server` waits up to ``timeout_s``.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from apiary.errors import PlatformError, UnavailableError
from apiary.procutil import PRIVATE_UMASK, die_with_parent, open_private, private_dir

logger = logging.getLogger(__name__)

__all__ = [
    "PREFECT_DB_SUFFIX",
    "PrefectServer",
    "ensure_database",
    "free_port",
    "prefect_database_url",
    "prefect_env",
    "sqlite_url",
    "start_prefect_server",
]

#: Prefect's database on Apiary's PostgreSQL server is Apiary's database name plus this.
PREFECT_DB_SUFFIX = "_prefect"
_PG_MAX_IDENTIFIER = 63  # PostgreSQL truncates longer names (NAMEDATALEN - 1)


#: Server settings for Apiary's load, applied unless ``settings`` says otherwise. Prefect's task
#: run recorder writes one transaction per task run event by default (batch size 1) and its event
#: persister 20 events at a time; Apiary's bridge sends a batch's task runs as one request of
#: events, so both take up to 200 per transaction, flushed at least every second (default 5 s).
SERVER_TUNING = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
    # A request answered 503 (e.g. SQLite busy) leaves its traceback in server.log; Prefect
    # logs only the 500s by default, and the UI then shows just "Oops. Something went wrong."
    "PREFECT_SERVER_LOG_RETRYABLE_ERRORS": "true",
}


def free_port(host: str = "127.0.0.1", *, avoid: set[int] | None = None) -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it; racy by nature), and
    not in ``avoid``: the OS may hand a just-released port out again, so a caller that chooses
    several ports before binding any passes the ones it already holds."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if not avoid or port not in avoid:
            return port
    raise OSError("no free port outside the avoided set after 100 tries")


def new_auth_string() -> str:
    """A fresh ``user:password`` for Prefect's basic auth (``server.api.auth_string``)."""
    return f"apiary:{secrets.token_urlsafe(24)}"


def prefect_env(home: Path, api_url: str | None = None, auth_string: str | None = None) -> dict[str, str]:
    """Environment variables for a Prefect client process rooted at ``home``.

    ``PREFECT_HOME`` is ``home``; telemetry is off (``DO_NOT_TRACK=1``,
    ``PREFECT_SERVER_ANALYTICS_ENABLED=false``) because only loopback is reachable here;
    ``PREFECT_API_URL`` is set when ``api_url`` is given, ``PREFECT_API_AUTH_STRING`` (the
    server's basic auth, ``user:password``) when ``auth_string`` is.
    """
    env = {
        "PREFECT_HOME": str(home),
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    if api_url:
        env["PREFECT_API_URL"] = api_url
    if auth_string:
        env["PREFECT_API_AUTH_STRING"] = auth_string
    return env


def prefect_database_url(apiary_database_url: str | None, suffix: str = PREFECT_DB_SUFFIX) -> str | None:
    """The URL of Prefect's own database next to Apiary's, or None for the SQLite default.

    ``apiary_database_url`` is Apiary's SQLAlchemy URL (``APIARY_DATABASE_URL``). For a
    PostgreSQL one (any driver: ``postgresql://``, ``postgresql+psycopg://``...) the answer is the
    same server and credentials, database ``<name><suffix>``, driver ``asyncpg`` (the one Prefect's
    server runs on). ``sslmode`` becomes asyncpg's ``ssl``; ``host`` (a socket directory) is kept;
    other query parameters are libpq/psycopg options asyncpg does not take and are dropped. None,
    empty or SQLite gives None (Prefect keeps its zero-setup SQLite file). Pure: no I/O.

    Raises ValueError for a URL without a database name, or one whose derived name exceeds
    PostgreSQL's 63 bytes.
    """
    from sqlalchemy.engine import make_url

    if not apiary_database_url:
        return None
    u = make_url(apiary_database_url)
    if u.get_backend_name() != "postgresql":
        return None
    if not u.database:
        raise ValueError(f"PostgreSQL URL without a database name: {u.render_as_string(hide_password=True)}")
    name = f"{u.database}{suffix}"
    if len(name.encode()) > _PG_MAX_IDENTIFIER:
        raise ValueError(f"Prefect database name {name!r} is longer than {_PG_MAX_IDENTIFIER} bytes")
    query: dict[str, str | tuple[str, ...]] = {}
    if "host" in u.query:
        query["host"] = u.query["host"]
    if "ssl" in u.query:
        query["ssl"] = u.query["ssl"]
    elif "sslmode" in u.query:
        query["ssl"] = u.query["sslmode"]
    return u.set(drivername="postgresql+asyncpg", database=name, query=query).render_as_string(hide_password=False)


def ensure_database(admin_url: str, name: str, timeout_s: float = 10.0) -> bool:
    """Create database ``name`` on the PostgreSQL server of ``admin_url`` unless it exists.

    ``admin_url`` is any database on that server the caller may connect to (Apiary's own, with
    its synchronous driver); the role needs CREATEDB when the database is missing. Returns True
    if it was created. Safe against a concurrent creator (``duplicate_database`` is success).
    Raises :class:`~apiary.errors.PlatformError` when the server refuses.
    """
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import DBAPIError, ProgrammingError
    from sqlalchemy.pool import NullPool

    libpq = make_url(admin_url).get_driver_name() in ("psycopg", "psycopg2")
    engine = create_engine(
        admin_url,
        isolation_level="AUTOCOMMIT",
        poolclass=NullPool,
        connect_args={"connect_timeout": max(1, int(timeout_s))} if libpq else {},
    )
    try:
        with engine.connect() as conn:
            exists = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first()
            if exists:
                return False
            quoted = conn.dialect.identifier_preparer.quote_identifier(name)
            try:
                conn.execute(text(f"CREATE DATABASE {quoted}"))
            except ProgrammingError as e:  # created meanwhile by someone else: fine
                if getattr(e.orig, "sqlstate", None) == "42P04":
                    return False
                raise
            logger.info("created PostgreSQL database %s for Prefect", name)
            return True
    except DBAPIError as e:
        raise PlatformError(f"cannot create PostgreSQL database {name!r} for Prefect: {e.orig!r}") from e
    finally:
        engine.dispose()


class PrefectServer:
    """A running ``prefect server start`` subprocess.

    ``api_url`` is ``http://HOST:PORT/api``, ``ui_url`` is ``http://HOST:PORT``; ``home`` is
    its ``PREFECT_HOME`` (output in ``home/server.log``); ``database_url`` is what it runs on
    (default the SQLite file ``home/prefect.db``).
    """

    def __init__(
        self, proc: subprocess.Popen, host: str, port: int, home: Path, log_path: Path, database_url: str | None = None,
        auth_string: str | None = None,
    ) -> None:
        self._proc = proc
        self.host = host
        self.port = port
        self.home = home
        self.log_path = log_path
        self.ui_url = f"http://{host}:{port}"
        self.api_url = f"{self.ui_url}/api"
        self.database_url = database_url or sqlite_url(home)
        #: ``user:password`` of its basic auth (None: unprotected); clients send it as
        #: PREFECT_API_AUTH_STRING, the UI asks for it once per browser.
        self.auth_string = auth_string

    @property
    def pid(self) -> int:
        """Process id of the server (also its process group id)."""
        return self._proc.pid

    def alive(self) -> bool:
        """True while the server process has not exited."""
        return self._proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL after ``timeout_s``.

        Idempotent: stopping a stopped server does nothing.
        """
        if self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("prefect server did not stop on TERM; killing pid=%s", self.pid)
                self._signal_group(signal.SIGKILL)
                self._proc.wait(timeout=timeout_s)
        # The group may keep children (uvicorn workers) after the leader exits.
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> PrefectServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"PrefectServer(api_url={self.api_url!r}, pid={self.pid}, home={str(self.home)!r})"


def sqlite_url(home: Path) -> str:
    """The default database of a server rooted at ``home``: ``home/prefect.db``."""
    return f"sqlite+aiosqlite:///{Path(home) / 'prefect.db'}"


def server_command(home: Path, host: str, port: int, *, database_url: str | None = None,
                   settings: dict[str, str] | None = None, auth_string: str | None = None,
                   ui_api_url: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ``prefect server start`` on ``host:port`` rooted at ``home``
    (see :func:`start_prefect_server` for what each argument means). ``ui_api_url``: the API's URL
    as a browser reaches it (default ``http://host:port/api``; behind a TLS terminator, its
    ``https://`` address). For starting the server somewhere else, e.g. inside a network namespace
    (:mod:`apiary.hosts`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(prefect_env(home))
    env.update(
        {
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url or sqlite_url(home),
            "PREFECT_SERVER_API_HOST": host,
            "PREFECT_SERVER_API_PORT": str(port),
            # The UI must call the API on the address it is served from.
            "PREFECT_UI_API_URL": ui_api_url or f"http://{host}:{port}/api",
            **SERVER_TUNING,
        }
    )
    if auth_string:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth_string
    env.update(settings or {})
    return [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)], env


def start_prefect_server(
    home: Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    timeout_s: float = 60,
    database_url: str | None = None,
    settings: dict[str, str] | None = None,
    auth_string: str | None = None,
) -> PrefectServer:
    """Start ``prefect server start`` on ``host:port`` and wait until ``GET /api/health`` answers.

    ``home`` is created if needed, made 0700, and becomes ``PREFECT_HOME``; the server runs with
    umask 077, so its database and log (which hold flow runs' parameters) are 0600. The database is
    ``database_url`` (``PREFECT_SERVER_DATABASE_CONNECTION_URL``, e.g.
    ``postgresql+asyncpg://user:pw@host:port/db``; the database must exist, Prefect migrates it)
    or by default the SQLite file ``home/prefect.db``, so a second start on the same home sees
    the same runs. ``settings`` are more ``PREFECT_*`` variables for the server (e.g. service
    batch sizes); the caller's own ``PREFECT_*`` variables are not passed on. ``auth_string``
    (``user:password``) protects the API and the UI with Prefect's basic auth
    (``PREFECT_SERVER_API_AUTH_STRING``; ``/api/health`` stays open). ``port`` defaults
    to a free one. Takes about 7.4 s (fresh home) / 2.8 s
    (existing) here on SQLite.

    Raises :class:`~apiary.errors.PlatformError` if the process exits early and
    :class:`~apiary.errors.UnavailableError` if it is not healthy within ``timeout_s``
    (in both cases the process group is stopped and the log tail is in the message).
    """
    home = Path(home)
    private_dir(home)
    port = port or free_port(host)
    cmd, env = server_command(home, host, port, database_url=database_url, settings=settings,
                              auth_string=auth_string)
    log_path = home / "server.log"
    log_file = open_private(log_path)  # the child keeps its own copy; ours is closed below
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=str(home),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() signals the whole tree
            preexec_fn=die_with_parent,  # and it goes when whoever started it goes
            umask=PRIVATE_UMASK,
        )
    finally:
        log_file.close()
    server = PrefectServer(proc, host, port, home, log_path, database_url, auth_string)
    health = f"{server.api_url}/health"
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise PlatformError(
                    f"prefect server exited with code={proc.returncode} port={port}: {_tail(log_path)}"
                )
            try:
                # Healthy, and it is our server that answered: a port taken between free_port()
                # and the bind would otherwise pass for a started server (ours then exits).
                if client.get(health).status_code == 200 and _listens(proc.pid, port):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                server.stop()
                raise UnavailableError(
                    f"prefect server not healthy after timeout_s={timeout_s} port={port}: {_tail(log_path)}"
                )
            time.sleep(0.1)
    logger.info(
        "prefect server started api_url=%s pid=%s home=%s database=%s seconds=%.2f",
        server.api_url,
        server.pid,
        home,
        "sqlite" if database_url is None else _redact(database_url),
        time.monotonic() - t0,
    )
    return server


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on TCP ``port`` (True when that cannot be checked)."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # a malformed URL still must not leak a password into the log
        return "<url>"


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "<no log>"
