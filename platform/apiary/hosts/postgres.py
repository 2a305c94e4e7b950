"""PostgreSQL on a host of a harness (:mod:`.netns`): the store of a multi-host deployment.

:class:`PostgresServer` runs the distribution's server (Debian: ``/usr/lib/postgresql/<ver>/bin``,
else ``initdb`` on PATH, or ``$APIARY_PG_BINDIR``) inside a host, listening on the host's address
(port 5432 by default) and on a unix socket in its directory, which only the operator (root) uses
to create the role and database. Its files are under the host's state directory::

    <state>/postgres/          owned by the postgres OS user, 0700
        data/                  the cluster (initdb), pg_hba.conf written by this module
        tls/server.crt|.key    the server's certificate and key (key 0600, owned by postgres)
        tls/ca.crt             the CA clients' certificates would be checked against
        sock/                  the unix socket (or a short directory under /tmp when that path
                               would exceed the 107-byte socket path limit)
        postgres.log           the server's output
    <state>/postgres.json      0600, root's: port, role, database, password (for :meth:`attach`)

PostgreSQL refuses to run as root, so every server command runs as the ``postgres`` OS user
(``setpriv``/``runuser``); the key must be owned by it and 0600 (PostgreSQL docs, "Secure TCP/IP
Connections with SSL": "the file must not allow any access to world or group").

Authentication (PostgreSQL docs, "The pg_hba.conf File"): a created role (not a superuser; it owns
its database) logs in over the network with ``scram-sha-256``; with TLS only ``hostssl`` lines
exist and ``hostnossl`` is rejected, so a client without TLS is refused. :meth:`url` is the
SQLAlchemy URL, with ``sslmode=verify-full`` (libpq checks the chain against ``sslrootcert`` and
that the host name it dialled is in the certificate) when TLS is on.

For speed on a shared test machine ``fsync`` and ``full_page_writes`` are off by default (an OS
crash could lose data; a killed or restarted server cannot: ``synchronous_commit`` stays on).
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from apiary.hosts.netns import Hosts, HostsError

__all__ = ["PostgresServer", "PostgresTLS", "find_bindir", "start_postgres"]

SERVER_USER = "postgres"  #: the OS user the Debian package creates
SUPERUSER = "postgres"  #: the database superuser initdb creates (local socket only)
DEFAULT_PORT = 5432
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_SOCKET_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL (unix(7))


class PostgresNotFound(HostsError):
    """No PostgreSQL server binaries on this machine, or no ``postgres`` OS user to run them as."""


@dataclass(frozen=True)
class PostgresTLS:
    """The files of a TLS-serving PostgreSQL (PEM), e.g. from :func:`apiary.pki.issue` with the
    host's name and address. They are copied into the server's directory (the key 0600, owned
    by ``postgres``), so the originals may stay where they were issued."""

    cert_file: Path  #: the server certificate; its SANs must hold the name clients dial (the host name)
    key_file: Path  #: its private key
    ca_file: Path  #: the CA certificate (``ssl_ca_file``; clients pass it as ``sslrootcert``)


def find_bindir() -> Path:
    """The directory holding ``initdb``, ``postgres``, ``pg_ctl`` and ``pg_isready``; raises
    :class:`PostgresNotFound` when there is none."""
    needed = ("initdb", "postgres", "pg_ctl", "pg_isready")
    candidates: list[Path] = []
    if os.environ.get("APIARY_PG_BINDIR"):
        candidates.append(Path(os.environ["APIARY_PG_BINDIR"]))

    def version(p: Path) -> tuple[int, ...]:
        return tuple(int(x) if x.isdigit() else 0 for x in p.parent.name.split("."))

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    for d in candidates:
        if all(os.access(d / b, os.X_OK) for b in needed):
            return d
    raise PostgresNotFound(
        "PostgreSQL server binaries (initdb, postgres, pg_ctl, pg_isready) not found in /usr/lib/postgresql/*/bin "
        "or on PATH; install them (Debian: apt-get install postgresql) or set APIARY_PG_BINDIR")


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


class PostgresServer:
    """A PostgreSQL server on host ``host`` of ``hosts``; :meth:`start` makes and starts it.

    ``user``/``database``: the role and database created at the first start (``password``
    generated when not given, 32 hex characters). ``tls``: serve TLS only (see the module
    docstring). ``fsync``: PostgreSQL's ``fsync`` (and ``full_page_writes``); off by default for
    speed. ``max_connections``: PostgreSQL's (default 100, PostgreSQL's own default).
    """

    def __init__(self, hosts: Hosts, host: str, *, port: int = DEFAULT_PORT, user: str = "apiary",
                 database: str = "apiary", password: str | None = None, tls: PostgresTLS | None = None,
                 fsync: bool = False, max_connections: int = 100) -> None:
        if not 0 < port < 65536:
            raise HostsError(f"port: {port} is not a TCP port")
        self.hosts, self.host, self.port = hosts, host, port
        self.user, self.database = user, database
        self.password = password or secrets.token_hex(16)
        self.tls, self.fsync, self.max_connections = tls, fsync, max_connections
        self.base = hosts.state_dir(host) / "postgres"
        self.data = self.base / "data"
        self.log = self.base / "postgres.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._sockdir: Path | None = None

    # --- the URL -------------------------------------------------------------------------------

    def url(self, *, sslrootcert: Path | None = None, host: str | None = None) -> str:
        """``postgresql+psycopg://<user>:<password>@<host name>:<port>/<database>``, with
        ``?sslmode=verify-full&sslrootcert=<ca>`` when TLS is on. ``sslrootcert`` defaults to
        the CA file given in ``tls`` (pass the copy on the client's host); ``host`` to the
        server's host name (resolvable on every host of the harness, not in the root namespace:
        pass :meth:`Hosts.address` there, which the certificate must then name too)."""
        url = f"postgresql+psycopg://{quote(self.user, safe='')}:{quote(self.password, safe='')}@" \
              f"{host or self.host}:{self.port}/{quote(self.database, safe='')}"
        if self.tls is not None:
            ca = sslrootcert or self.tls.ca_file
            url += f"?sslmode=verify-full&sslrootcert={quote(str(ca), safe='/')}"
        return url

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> PostgresServer:
        """Make the cluster (first time: initdb, pg_hba, role and database), start the server in
        the host and wait until it accepts connections (at most :data:`START_TIMEOUT_S`); returns
        ``self``. Raises :class:`PostgresNotFound` or :class:`HostsError` with the log's tail."""
        bindir = find_bindir()
        owner = self._owner()
        fresh = not (self.data / "PG_VERSION").exists()
        self._prepare_dirs(owner)
        if fresh:
            self._initdb(bindir)
        self._write_config(owner)
        sockdir = self._socket_dir(owner)
        addr = self.hosts.address(self.host)
        settings = {"fsync": self._onoff(self.fsync), "full_page_writes": self._onoff(self.fsync),
                    "synchronous_commit": "on", "max_connections": str(self.max_connections),
                    "password_encryption": "scram-sha-256", "listen_addresses": addr}
        if self.tls is not None:
            tls = self.base / "tls"
            settings |= {"ssl": "on", "ssl_cert_file": str(tls / "server.crt"),
                         "ssl_key_file": str(tls / "server.key"), "ssl_ca_file": str(tls / "ca.crt")}
        argv = [*self._as_server(), str(bindir / "postgres"), "-D", str(self.data), "-p", str(self.port),
                "-k", str(sockdir)]
        for k, v in settings.items():
            argv += ["-c", f"{k}={v}"]
        with open(self.log, "ab") as logf:
            self._process = self.hosts.run(self.host, argv, env=self._env(), stdout=logf,
                                           stderr=subprocess.STDOUT, cwd=self.base)
        self._wait_ready(bindir, sockdir)
        if fresh:
            self._create_role_and_database(sockdir)
        self._save()
        return self

    def stop(self) -> None:
        """Shut the server down in fast mode (``pg_ctl stop -m fast``: clients are disconnected,
        open transactions rolled back, a checkpoint written); SIGKILL if it is not down within
        :data:`STOP_TIMEOUT_S`. Idempotent; the cluster stays for a later :meth:`start`."""
        if (self.data / "postmaster.pid").exists():
            subprocess.run([*self._as_server_cmd(), str(find_bindir() / "pg_ctl"), "stop", "-D", str(self.data),
                            "-m", "fast", "-w", "-t", f"{STOP_TIMEOUT_S:.0f}"],
                           env=self._env(), capture_output=True, check=False, timeout=STOP_TIMEOUT_S + 10)
        if self._process is not None:
            self.hosts.stop(self._process, grace_s=STOP_TIMEOUT_S)
            self._process = None

    def restart(self) -> None:
        """:meth:`stop` then :meth:`start` on the same cluster (a chaos experiment's restart)."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        """Whether the server process this object started is running."""
        return self._process is not None and self._process.poll() is None

    @classmethod
    def attach(cls, hosts: Hosts, host: str, *, tls: PostgresTLS | None = None) -> PostgresServer:
        """The server made on ``host`` by another process (read from ``<state>/postgres.json``),
        to :meth:`stop`, :meth:`restart` or get the :meth:`url` of. Raises :class:`HostsError`
        when there is none."""
        path = hosts.state_dir(host) / "postgres.json"
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise HostsError(f"host: no PostgreSQL recorded on {host} ({path}: {e})") from e
        if tls is None and saved.get("tls"):
            tls = PostgresTLS(*(Path(saved["tls"][k]) for k in ("cert_file", "key_file", "ca_file")))
        return cls(hosts, host, port=saved["port"], user=saved["user"], database=saved["database"],
                   password=saved["password"], tls=tls, fsync=saved.get("fsync", False),
                   max_connections=saved.get("max_connections", 100))

    # --- steps ---------------------------------------------------------------------------------

    @staticmethod
    def _onoff(flag: bool) -> str:
        return "on" if flag else "off"

    @staticmethod
    def _env() -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        return env | {"LC_ALL": "C", "LANG": "C", "PGTZ": "UTC"}

    @staticmethod
    def _owner() -> pwd.struct_passwd:
        try:
            return pwd.getpwnam(SERVER_USER)
        except KeyError as e:
            raise PostgresNotFound(f"there is no {SERVER_USER!r} OS user to run PostgreSQL as") from e

    @staticmethod
    def _as_server() -> list[str]:
        """Run as ``postgres`` by exec (``setpriv``), so the started process is the postmaster."""
        return ["setpriv", f"--reuid={SERVER_USER}", f"--regid={SERVER_USER}", "--init-groups", "--"]

    @staticmethod
    def _as_server_cmd() -> list[str]:
        return ["runuser", "-u", SERVER_USER, "--"]

    def _prepare_dirs(self, owner: pwd.struct_passwd) -> None:
        self.base.mkdir(mode=0o700, exist_ok=True)
        os.chown(self.base, owner.pw_uid, owner.pw_gid)
        os.chmod(self.base, 0o700)
        reach = subprocess.run([*self._as_server_cmd(), "test", "-w", str(self.base)], check=False)
        if reach.returncode != 0:
            raise HostsError(f"root: the {SERVER_USER} OS user cannot reach {self.base}; every directory above it "
                             "must be traversable by others (mode 0711 or wider)")

    def _initdb(self, bindir: Path) -> None:
        r = subprocess.run([*self._as_server_cmd(), str(bindir / "initdb"), "-D", str(self.data), "-U", SUPERUSER,
                            "-E", "UTF8", "--locale=C", "--auth-local=trust", "--auth-host=reject", "--no-sync"],
                           cwd=self.base, env=self._env(), capture_output=True, text=True, check=False, timeout=120)
        if r.returncode != 0:
            raise HostsError(f"initdb on host {self.host} failed ({r.returncode}): {(r.stdout + r.stderr)[-4000:]}")

    def _write_config(self, owner: pwd.struct_passwd) -> None:
        """pg_hba.conf (first match wins; PostgreSQL docs, "The pg_hba.conf File") and the TLS files."""
        net = "hostssl" if self.tls is not None else "host"
        lines = [
            "# written by apiary.hosts.postgres",
            "# TYPE   DATABASE USER ADDRESS    METHOD",
            f"local    all      {SUPERUSER} trust",  # the operator's socket, in a 0700 directory
            "local    all      all  reject",
        ]
        if self.tls is not None:
            lines.append("hostnossl all     all  0.0.0.0/0  reject")
        lines.append(f"{net:<8} all      all  0.0.0.0/0  scram-sha-256")
        hba = self.data / "pg_hba.conf"
        hba.write_text("\n".join(lines) + "\n")
        os.chown(hba, owner.pw_uid, owner.pw_gid)
        os.chmod(hba, 0o600)
        if self.tls is None:
            return
        tls = self.base / "tls"
        tls.mkdir(mode=0o700, exist_ok=True)
        os.chown(tls, owner.pw_uid, owner.pw_gid)
        for src, name, mode in ((self.tls.cert_file, "server.crt", 0o644), (self.tls.key_file, "server.key", 0o600),
                                (self.tls.ca_file, "ca.crt", 0o644)):
            dst = tls / name
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(Path(src).read_bytes())
            os.chown(dst, owner.pw_uid, owner.pw_gid)
            os.chmod(dst, mode)

    def _socket_dir(self, owner: pwd.struct_passwd) -> Path:
        if self._sockdir is not None and self._sockdir.is_dir():
            return self._sockdir
        sockdir = self.base / "sock"
        if len(str(sockdir / f".s.PGSQL.{self.port}")) > _SOCKET_PATH_MAX:
            sockdir = Path(tempfile.mkdtemp(prefix="apiary-pgsock-"))
        sockdir.mkdir(mode=0o700, exist_ok=True)
        os.chown(sockdir, owner.pw_uid, owner.pw_gid)
        os.chmod(sockdir, 0o700)
        self._sockdir = sockdir
        return sockdir

    def _wait_ready(self, bindir: Path, sockdir: Path) -> None:
        assert self._process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise HostsError(f"PostgreSQL on host {self.host} exited with {self._process.returncode}:\n"
                                 f"{_tail(self.log)}")
            ready = subprocess.run([str(bindir / "pg_isready"), "-q", "-h", str(sockdir), "-p", str(self.port),
                                    "-t", "2"], env=self._env(), check=False, timeout=10)
            if ready.returncode == 0:
                return
            time.sleep(0.1)
        self.stop()
        raise HostsError(f"PostgreSQL on host {self.host} not ready after {START_TIMEOUT_S:.0f} s:\n{_tail(self.log)}")

    def _create_role_and_database(self, sockdir: Path) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(host=str(sockdir), port=self.port, user=SUPERUSER, dbname="postgres",
                             autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(self.user), sql.Literal(self.password)))
            conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                sql.Identifier(self.database), sql.Identifier(self.user)))

    def _save(self) -> None:
        saved: dict[str, Any] = {"port": self.port, "user": self.user, "database": self.database,
                                 "password": self.password, "fsync": self.fsync,
                                 "max_connections": self.max_connections,
                                 "tls": None if self.tls is None else {
                                     "cert_file": str(self.tls.cert_file), "key_file": str(self.tls.key_file),
                                     "ca_file": str(self.tls.ca_file)}}
        path = self.hosts.state_dir(self.host) / "postgres.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(saved, f, indent=2)


def start_postgres(hosts: Hosts, host: str, **options: Any) -> PostgresServer:
    """Make and start :class:`PostgresServer` ``(hosts, host, **options)``; returns it (its
    :meth:`~PostgresServer.url` is the SQLAlchemy URL). Stopped by :meth:`~PostgresServer.stop`,
    or with the other processes of the host at :meth:`Hosts.down`."""
    return PostgresServer(hosts, host, **options).start()
