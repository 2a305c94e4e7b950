"""chaos/kill-prefect-server.json on a platform with Prefect (its server, bridge and serve)."""

from __future__ import annotations

import pytest
from tests.chaos.conftest import outputs, run_checked, start_platform

pytestmark = [pytest.mark.e2e, pytest.mark.prefect]


@pytest.fixture(scope="module")
def platform(tmp_path_factory, monkeypatch_module):
    home = tmp_path_factory.mktemp("prefect-home")
    # Never the developer's ~/.prefect, never phone home (as tests/e2e's fixtures).
    monkeypatch_module.setenv("PREFECT_HOME", str(home / "prefect-client"))
    monkeypatch_module.setenv("DO_NOT_TRACK", "1")
    monkeypatch_module.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    p = start_platform(home / "apiary", prefect=True)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_kill_prefect_server(platform, tmp_path):
    old = platform.prefect_server.pid
    journal = run_checked(platform, "kill-prefect-server", tmp_path)
    out = outputs(journal)
    assert old in out["kill-9-prefect-server"]["killed"]
    assert out["prefect-back"] is True
    assert platform.prefect_server.pid != old  # the supervisor restarted it
