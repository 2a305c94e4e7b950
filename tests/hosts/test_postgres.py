"""PostgreSQL on a host of the harness (apiary.hosts.postgres), reached from another host over TLS
with sslmode=verify-full against the platform CA (apiary.pki), and restarted in place."""

from __future__ import annotations

import os
import shutil
import stat
import sys

import pytest

from apiary import pki
from apiary.hosts.netns import hosts
from apiary.hosts.postgres import PostgresNotFound, PostgresServer, PostgresTLS, find_bindir

pytestmark = [pytest.mark.netns, pytest.mark.postgres]

# Run inside a host: connect with SQLAlchemy to the URL in argv[1] and print whether the session is
# encrypted, its protocol, and the row count of a table written by an earlier run.
CLIENT = """
import sys
import sqlalchemy as sa
with sa.create_engine(sys.argv[1]).connect() as c:
    ssl, version = c.execute(sa.text("select ssl, version from pg_stat_ssl where pid = pg_backend_pid()")).one()
    c.execute(sa.text("create table if not exists t (x int)"))
    c.execute(sa.text("insert into t values (1)"))
    c.commit()
    print(ssl, version, c.execute(sa.text("select count(*) from t")).scalar())
"""


@pytest.fixture
def bindir():
    try:
        return find_bindir()
    except PostgresNotFound as e:
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true but PostgreSQL is not installed (.ci/run installs it): {e}", pytrace=False)
        pytest.skip(str(e))


def test_postgres_on_a_host_serves_verify_full_tls_to_another_host_and_restarts(netns_root, bindir):
    with hosts(["db", "cp1"], netns_root) as h:
        ca_dir = netns_root / "ca"  # the operator's: only copies of ca.crt and db's files go to hosts
        ca = pki.init_ca(ca_dir)
        cert, key = pki.issue(ca_dir, netns_root / "issued", "db", ["db", h.address("db")])
        pg = PostgresServer(h, "db", tls=PostgresTLS(cert, key, ca)).start()
        try:
            tls_dir = h.state_dir("db") / "postgres" / "tls"
            server_key = (tls_dir / "server.key").stat()
            assert stat.S_IMODE(server_key.st_mode) == 0o600 and server_key.st_uid != 0  # postgres's own
            client_ca = shutil.copy(ca, h.state_dir("cp1") / "ca.crt")
            url = pg.url(sslrootcert=client_ca)
            assert url.startswith("postgresql+psycopg://apiary:") and "@db:5432/apiary?sslmode=verify-full&" in url

            def client(u: str) -> tuple[int, str, str]:
                r = h.exec("cp1", [sys.executable, "-c", CLIENT, u], timeout=60)
                return r.returncode, r.stdout.strip(), r.stderr

            assert client(url)[:2] == (0, "True TLSv1.3 1")
            rc, _, stderr = client(url.replace("sslmode=verify-full", "sslmode=disable"))
            assert rc != 0 and "no encryption" in stderr  # hostssl only
            rc, _, stderr = client(url.replace(pg.password, "wrong"))
            assert rc != 0 and "password authentication failed" in stderr
            other_ca = pki.init_ca(netns_root / "other-ca")  # a CA that did not sign db's certificate
            wrong_ca = shutil.copy(other_ca, h.state_dir("cp1") / "other-ca.crt")
            rc, _, stderr = client(url.replace(str(client_ca), str(wrong_ca)))
            assert rc != 0 and "certificate verify failed" in stderr

            pg.restart()  # same cluster, same role: the row written before is still there
            assert client(url)[:2] == (0, "True TLSv1.3 2")
            again = PostgresServer.attach(h, "db")  # from another process's point of view
            assert again.url(sslrootcert=client_ca) == url
        finally:
            pg.stop()
        assert not pg.running and not (pg.data / "postmaster.pid").exists()


def test_postgres_without_tls_takes_scram_passwords(netns_root, bindir):
    with hosts(["db", "cp1"], netns_root) as h:
        pg = PostgresServer(h, "db", user="store", database="jobs", port=6543).start()
        url = pg.url()
        assert url == f"postgresql+psycopg://store:{pg.password}@db:6543/jobs"
        query = "select rolname, rolsuper from pg_roles where rolname = current_user"
        code = ("import sys, sqlalchemy as sa\n"
                "with sa.create_engine(sys.argv[1]).connect() as c:\n"
                f"    print(c.execute(sa.text({query!r})).one())")
        r = h.exec("cp1", [sys.executable, "-c", code, url], timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "('store', False)"
        assert pg.running
    assert not pg.running  # the hosts' teardown stopped the server nobody stopped
