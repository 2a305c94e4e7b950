"""Two platforms on one machine: the CLI talks only to its APIARY_HOME's platform (the cluster id
``apiary up`` records there, answered by ``GET /healthz``), and ``apiary up`` refuses an API port
that is taken. Real HTTP servers on loopback (tests.support.serving); no platform process starts."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from tests.support.builders import LAB6
from tests.support.plane import Harness
from tests.support.serving import serving
from typer.testing import CliRunner

from apiary import embedded
from apiary.api import create_app
from apiary.auth import Directory, bootstrap
from apiary.cli import main as cli
from apiary.errors import PlatformError
from apiary.procutil import port_in_use
from apiary.settings import CLUSTER_ID_FILE, Settings, ensure_cluster_id
from apiary.tracking.prefect_server import free_port

MINE, OTHER = "11111111-1111-4111-8111-111111111111", "22222222-2222-4222-8222-222222222222"


@pytest.fixture
def platform(tmp_path: Path, home: Path) -> Callable[[str], AbstractContextManager[str]]:
    """``with platform(cluster_id) as url``: a real control-plane app (over a Harness plane) that
    answers ``cluster_id`` in /healthz; the home holds its admin's token, as after ``apiary up``."""
    plane = Harness(tmp_path).plane
    bootstrap(Directory(plane.sessions), home, nodes=[], virtual_clusters=plane.cluster.virtual_clusters)
    return lambda cluster_id: serving(create_app(plane, cluster_id=cluster_id))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """APIARY_HOME of the CLI under test, with cluster id MINE; no APIARY_API_URL."""
    home = tmp_path / "home"
    (home / "run").mkdir(parents=True)
    (home / CLUSTER_ID_FILE).write_text(MINE + "\n")
    monkeypatch.setenv("APIARY_HOME", str(home))
    monkeypatch.delenv("APIARY_API_URL", raising=False)
    return home


def record(home: Path, url: str) -> None:
    """What a running ``apiary up`` records in its home."""
    (home / "run" / "api_url").write_text(url)


def test_ensure_cluster_id_writes_a_uuid_once(tmp_path: Path) -> None:
    first = ensure_cluster_id(tmp_path / "h")
    assert uuid.UUID(first) and ensure_cluster_id(tmp_path / "h") == first
    assert Settings(home=tmp_path / "h").cluster_id() == first
    assert Settings(home=tmp_path / "none").cluster_id() is None
    assert [p.name for p in (tmp_path / "h").iterdir()] == [CLUSTER_ID_FILE]  # no temporary file left


def test_a_platform_of_another_home_is_refused_naming_both_ids(platform, home: Path) -> None:
    with platform(OTHER) as url:
        record(home, url)
        result = CliRunner().invoke(cli.app, ["job", "list", "--json"])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out
    assert f"the platform at {url} is cluster {OTHER}" in out
    assert f"belongs to cluster {MINE}" in out and "[]" not in out  # no job list printed


def test_a_platform_without_a_cluster_id_is_refused(platform, home: Path) -> None:
    with platform(None) as url:
        record(home, url)
        result = CliRunner().invoke(cli.app, ["node", "list", "--json"])
    assert result.exit_code == 1
    assert "(no cluster id)" in result.output and MINE in " ".join(result.output.split())


def test_the_homes_own_platform_is_used(platform, home: Path) -> None:
    with platform(MINE) as url:
        record(home, url)
        result = CliRunner().invoke(cli.app, ["job", "list", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == []


def test_an_explicit_api_url_is_trusted(platform, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with platform(OTHER) as url:
        monkeypatch.setenv("APIARY_API_URL", url)
        result = CliRunner().invoke(cli.app, ["job", "list", "--json"])
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------------- the port
@pytest.fixture
def listening() -> Iterator[int]:
    """A port something listens on (the first platform)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_port_in_use(listening: int) -> None:
    assert port_in_use(listening)
    assert not port_in_use(free_port())


def test_up_on_a_taken_port_exits_1_and_starts_and_touches_nothing(
    listening: int, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []
    monkeypatch.setattr(embedded.Child, "start", lambda self: started.append(self.name))
    monkeypatch.setattr(cli, "_logging", lambda verbose=False: None)
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)  # up installs a SIGTERM handler
    record(home, f"http://127.0.0.1:{listening}")  # the first platform's, in the same home
    result = CliRunner().invoke(cli.app, ["up", "--no-prefect", "--port", str(listening),
                                          "--cluster", str(LAB6 / "hived-config-two-vcs.yaml")])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out
    assert f"port {listening} on 127.0.0.1 is in use (another Apiary platform?); use --port N" in out
    assert started == []
    assert (home / "run" / "api_url").read_text() == f"http://127.0.0.1:{listening}"  # still the first's
    assert not (home / "cluster.yaml").exists()


def test_start_refuses_an_api_that_answers_as_another_cluster(platform, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The race the port check cannot close: the port was free when checked, then another platform
    # took it, so our control plane could not bind and the other one answers the health checks.
    monkeypatch.setattr(embedded.Child, "start", lambda self: None)
    with platform(OTHER) as url:
        monkeypatch.setattr(embedded, "port_in_use", lambda port: False)
        p = embedded.Embedded(home=tmp_path / "b", cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=False,
                              api_port=int(url.rsplit(":", 1)[1]))
        with pytest.raises(PlatformError, match=f"answers as cluster {OTHER}, not this platform's"):
            p.start()
    assert not (tmp_path / "b" / "run" / "api_url").exists()
