"""PostgreSQL with ``sslmode=verify-full`` against the platform CA checks the host name too: a
certificate of the right CA that does not name the dialled host is refused (verify-ca would take
it). The chain itself (right CA, another CA, no TLS) is tested in tests/hosts/test_postgres.py."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from apiary import pki
from apiary.hosts.netns import hosts, netns_available
from apiary.hosts.postgres import PostgresNotFound, PostgresServer, PostgresTLS, find_bindir

pytestmark = [pytest.mark.netns, pytest.mark.postgres]

CLIENT = """
import sys
import sqlalchemy as sa
with sa.create_engine(sys.argv[1]).connect() as c:
    print(c.execute(sa.text("select ssl from pg_stat_ssl where pid = pg_backend_pid()")).scalar())
"""


def _need(why: str | None) -> None:
    if why is not None:
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true but {why}", pytrace=False)
        pytest.skip(why)


def test_verify_full_refuses_a_certificate_that_does_not_name_the_host_dialled() -> None:
    _need(netns_available())
    try:
        find_bindir()
    except PostgresNotFound as e:
        _need(str(e))
    root = Path(tempfile.mkdtemp(prefix="apiary-pki-pg-"))
    os.chmod(root, 0o711)  # the postgres OS user traverses it
    try:
        with hosts(["db", "cp1"], root) as h:
            ca = pki.init_ca(root / "ca")
            cert, key = pki.issue(root / "ca", root / "issued", "db", ["db"])  # the name only, not the address
            pg = PostgresServer(h, "db", tls=PostgresTLS(cert, key, ca)).start()
            try:
                client_ca = shutil.copy(ca, h.state_dir("cp1") / "ca.crt")

                def connect(url: str) -> tuple[int, str]:
                    r = h.exec("cp1", [sys.executable, "-c", CLIENT, url], timeout=60)
                    return r.returncode, (r.stdout + r.stderr).strip()

                assert connect(pg.url(sslrootcert=client_ca)) == (0, "True")
                by_address = pg.url(sslrootcert=client_ca, host=h.address("db"))
                rc, out = connect(by_address)
                assert rc != 0 and "does not match host name" in out
                # verify-ca checks the chain only, so it would have taken this certificate
                assert connect(by_address.replace("verify-full", "verify-ca")) == (0, "True")
            finally:
                pg.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
