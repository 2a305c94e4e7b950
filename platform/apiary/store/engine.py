"""Engine creation and schema migration (Alembic) for SQLite and PostgreSQL."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

logger = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).with_name("migrations")


#: What SQLite keeps beside a database file (WAL mode): the write-ahead log and its index.
SQLITE_SIDE_FILES = ("-wal", "-shm")


def private_sqlite_file(path: Path) -> None:
    """Make the SQLite database at ``path`` readable by its owner only: created empty with mode
    0600 if missing (SQLite takes an empty file for a new database), else made 0600, and so are its
    ``-wal`` and ``-shm`` files where they exist. SQLite creates those two with the database file's
    own mode (its unix VFS, ``findCreateFileMode``), so they stay 0600 whatever the umask. A
    directory it creates is 0700. Raises OSError as ``open``/``chmod`` do."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    for name in (path, *(path.with_name(path.name + side) for side in SQLITE_SIDE_FILES)):
        try:
            os.chmod(name, 0o600)
        except FileNotFoundError:
            pass


def make_engine(url: str) -> Engine:
    """An engine for ``url``. SQLite gets WAL and ``synchronous=FULL`` so a committed job
    survives kill -9 and power loss; a busy timeout lets readers wait for the one writer. A SQLite
    file and its WAL hold the jobs' secrets: they are 0600 (:func:`private_sqlite_file`).

    Statements' parameters (a job's YAML with its ``secrets``, token digests) are left out of the
    engine's errors and log lines (SQLAlchemy's ``hide_parameters``): an error logged with its
    traceback, or one whose message reaches a client, names the statement only."""
    if url.startswith("sqlite"):
        path = make_url(url).database
        if path and path != ":memory:" and not path.startswith("file:"):
            private_sqlite_file(Path(path))
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, hide_parameters=True)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # pragma: no cover - trivial
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    connect_args = POSTGRES_CONNECT_ARGS if url.startswith("postgresql") else {}
    return create_engine(url, pool_pre_ping=True, hide_parameters=True, connect_args=connect_args,
                         pool_size=POOL_SIZE, max_overflow=POOL_OVERFLOW)


#: Connections a PostgreSQL engine keeps open (SQLAlchemy's QueuePool), and how many more it opens
#: while more threads than that read or write at once. SQLAlchemy's default keeps 5: under 5,000
#: agents the plane's worker threads wanted more at once, and every connection over the kept ones
#: was opened and closed again for one token lookup: a new PostgreSQL backend (a fork) each time,
#: 15% of the leader's CPU and 0.4 of a core of PostgreSQL's while the fleet was idle (py-spy,
#: bench/cluster.py). 20 at most per process: three replicas stay within PostgreSQL's default
#: ``max_connections`` of 100 with room for the Prefect server's pool.
POOL_SIZE, POOL_OVERFLOW = 15, 5


#: libpq's connection parameters for PostgreSQL (https://www.postgresql.org/docs/current/libpq-connect.html):
#: a server that does not answer a connect within 5 s, or a link that leaves sent data unacknowledged
#: for 2 s (``tcp_user_timeout``, ms: a cut or black-holed route), fails the statement instead of
#: hanging it for TCP's minutes of retransmissions, so the caller gets 503 while it still can
#: answer (a replica cut off from the store steps down within its lease); keepalives find an idle
#: connection's dead peer within about 16 s.
POSTGRES_CONNECT_ARGS: dict[str, int] = {
    "connect_timeout": 5, "tcp_user_timeout": 2000,
    "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 2, "keepalives_count": 3,
}


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision. Idempotent; safe on every start."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def session_factory(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)
