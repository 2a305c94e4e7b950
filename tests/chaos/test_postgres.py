"""chaos/kill-postgres.json on a platform whose store is a private PostgreSQL server."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from tests.chaos.conftest import outputs, run_checked, start_platform
from tests.pg import start_postgres_or_skip

from apiary.chaos import processes

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    url, stop_pg = start_postgres_or_skip(tmp_path_factory.mktemp("postgres"), durable=True)
    try:
        p = start_platform(tmp_path_factory.mktemp("pg-home"), env={"APIARY_DATABASE_URL": url})
        try:
            yield p, url
        finally:
            p.stop()
    finally:
        # The experiment started a new postmaster that tests.pg's stop() does not know: stop it first.
        try:
            pm = processes.find_postmaster(url)
            os.kill(pm.pid, signal.SIGINT)  # fast shutdown
            psutil.Process(pm.pid).wait(30)
        except (Exception, psutil.Error):  # noqa: BLE001 - best effort; stop_pg removes the rest
            pass
        stop_pg()


def test_kill_postgres(platform, tmp_path):
    p, url = platform
    old = processes.find_postmaster(url).pid
    journal = run_checked(p, "kill-postgres", tmp_path)
    out = outputs(journal)
    assert out["kill-9-postgres"]["killed"] == [old]
    assert processes.find_postmaster(url).pid == out["kill-9-postgres"]["new_pid"] != old
