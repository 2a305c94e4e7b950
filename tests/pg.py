"""A throwaway PostgreSQL server for tests: ``start_postgres(tmpdir) -> (url, stop)``.

It runs the distribution's binaries (Debian: ``/usr/lib/postgresql/<ver>/bin``; elsewhere
``initdb`` on PATH, or ``$APIARY_PG_BINDIR``) on a fresh data directory, listening only on
127.0.0.1 on a free port with its unix socket inside the data directory. PostgreSQL refuses to
run as root, so as root every server command runs as the ``postgres`` OS user (``runuser``), and
the directory is owned by it. Every wait is bounded. Raises :class:`PostgresNotFound` when no
binaries are installed (callers decide whether that is a skip or a failure).
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["PostgresNotFound", "create_database", "find_bindir", "start_postgres"]

SERVER_USER = "postgres"  # the OS user the Debian package creates; used only when running as root
SUPERUSER = "apiary"  # the database superuser initdb creates
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class PostgresNotFound(RuntimeError):
    """No PostgreSQL server binaries on this machine (or no user to run them as)."""


def find_bindir() -> Path:
    """The directory holding ``initdb``, ``postgres``, ``pg_ctl`` and ``pg_isready``."""
    needed = ("initdb", "postgres", "pg_ctl", "pg_isready")
    candidates: list[Path] = []
    if os.environ.get("APIARY_PG_BINDIR"):
        candidates.append(Path(os.environ["APIARY_PG_BINDIR"]))

    def version(p: Path) -> tuple:
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
        "or on PATH; install them (Debian: apt-get install postgresql) or set APIARY_PG_BINDIR"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def start_postgres(tmpdir: str | os.PathLike | None = None, durable: bool = False,
                   remove_dir: Callable[[Path], None] | None = None) -> tuple[str, Callable[[], None]]:
    """Start a private server; returns ``(url, stop)``. For speed it runs with ``fsync``,
    ``synchronous_commit`` and ``full_page_writes`` off. ``durable=True`` keeps
    ``synchronous_commit`` on: a test that kills the server with SIGKILL must not lose commits the
    way ``synchronous_commit=off`` allows (up to ~3 x wal_writer_delay of them; PostgreSQL docs,
    "Asynchronous Commit"), which a production server never does. fsync stays off: the OS
    survives the kill, so its page cache keeps what was written.

    ``url`` is ``postgresql+psycopg://apiary:<password>@127.0.0.1:<port>/apiary`` (database ``apiary``
    exists, empty). ``stop()`` shuts the server down (fast mode) and removes its directory (with
    ``remove_dir``, when given: the benchmarks defer it); it is idempotent. As root the directory
    goes under the system temp dir when ``postgres`` cannot reach ``tmpdir`` (pytest's tmp dirs
    are mode 0700).
    """
    bindir = find_bindir()
    as_root = os.geteuid() == 0
    owner = None
    if as_root:
        try:
            owner = pwd.getpwnam(SERVER_USER)
        except KeyError as e:
            raise PostgresNotFound(f"running as root but there is no {SERVER_USER!r} OS user to run PostgreSQL") from e
        if not shutil.which("runuser"):
            raise PostgresNotFound("running as root but `runuser` is missing (util-linux)")

    def cmd(*args: str) -> list[str]:
        return ["runuser", "-u", SERVER_USER, "--", *args] if as_root else list(args)

    parent = Path(tmpdir) if tmpdir is not None else None
    if parent is not None and as_root:
        reachable = subprocess.run(cmd("test", "-w", str(parent), "-a", "-x", str(parent)), check=False).returncode
        if reachable != 0:
            parent = None
    base = Path(tempfile.mkdtemp(prefix="apiary-pg-", dir=parent))
    data, sockdir, log = base / "data", base / "sock", base / "postgres.log"
    sockdir.mkdir()
    if owner is not None:
        for p in (base, sockdir):
            os.chown(p, owner.pw_uid, owner.pw_gid)
    password = secrets.token_hex(16)
    pwfile = base / "pw"
    pwfile.write_text(password + "\n")
    if owner is not None:
        os.chown(pwfile, owner.pw_uid, owner.pw_gid)
    os.chmod(pwfile, 0o600)
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PGTZ": "UTC"}
    env.pop("PGDATA", None)
    run = dict(cwd=base, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)

    proc: subprocess.Popen | None = None
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if stopped:
            return
        stopped = True
        if proc is not None and proc.poll() is None:
            subprocess.run(
                cmd(str(bindir / "pg_ctl"), "stop", "-D", str(data), "-m", "fast", "-w", "-t", f"{STOP_TIMEOUT_S:.0f}"),
                check=False, **{**run, "timeout": STOP_TIMEOUT_S + 10},
            )
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if remove_dir is not None:
            remove_dir(base)
        else:
            shutil.rmtree(base, ignore_errors=True)

    try:
        r = subprocess.run(
            cmd(str(bindir / "initdb"), "-D", str(data), "-U", SUPERUSER, "-E", "UTF8", "--locale=C",
                "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}", "--no-sync"),
            check=False, **run,
        )
        pwfile.unlink()
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed ({r.returncode}):\n{r.stdout[-4000:]}")

        port = 0
        for _ in range(5):  # a free port can be taken between probing and binding: try another
            port = _free_port()
            with open(log, "wb") as logf:  # fresh per try: the bind check below reads it
                proc = subprocess.Popen(
                    cmd(str(bindir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port),
                        "-k", str(sockdir), "-c", "fsync=off",
                        "-c", f"synchronous_commit={'on' if durable else 'off'}",
                        "-c", "full_page_writes=off", "-c", "max_connections=100"),
                    cwd=base, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                )
            deadline = time.monotonic() + START_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline:
                ready = subprocess.run(
                    cmd(str(bindir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port), "-t", "2"),
                    check=False, **{**run, "timeout": 10},
                )
                if ready.returncode == 0:
                    break
                time.sleep(0.1)
            else:
                if proc.poll() is None:  # deadline passed with the server still not ready
                    raise RuntimeError(f"PostgreSQL not ready after {START_TIMEOUT_S:.0f} s:\n{_tail(log)}")
                if "could not bind" in _tail(log) or "already in use" in _tail(log):
                    continue
                raise RuntimeError(f"PostgreSQL exited with {proc.returncode}:\n{_tail(log)}")
            break
        else:
            raise RuntimeError(f"PostgreSQL could not bind a free port:\n{_tail(log)}")

        url = f"postgresql+psycopg://{SUPERUSER}:{password}@127.0.0.1:{port}/apiary"
        create_database(url, "apiary")
        return url, stop
    except BaseException:
        stop()
        raise


def create_database(url: str, name: str) -> str:
    """Create database ``name`` on the server of ``url`` (via its ``postgres`` database); returns its URL."""
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    u = make_url(url)
    with psycopg.connect(
        host=u.host, port=u.port, user=u.username, password=u.password, dbname="postgres", autocommit=True,
        connect_timeout=10,
    ) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return u.set(database=name).render_as_string(hide_password=False)


def start_postgres_or_skip(tmpdir: str | os.PathLike | None = None, durable: bool = False
                           ) -> tuple[str, Callable[[], None]]:
    """:func:`start_postgres`, or skip the test without PostgreSQL; under CI=true a missing server
    fails it instead (.ci/run installs one)."""
    import pytest

    try:
        return start_postgres(tmpdir, durable=durable)
    except PostgresNotFound as e:
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true but PostgreSQL is not installed (.ci/run installs it): {e}", pytrace=False)
        pytest.skip(f"PostgreSQL not installed: {e}")
