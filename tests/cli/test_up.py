"""``apiary up`` in process (typer's CliRunner; no child may start): it checks the cluster config the
way ``PUT /api/v2/cluster/config`` does before it starts anything, refuses a home another platform
holds, keeps the Prefect UI's port per home, and picks NVML or simulated GPUs for the agents."""

from __future__ import annotations

import fcntl
import json
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.support.builders import LAB6
from typer.testing import CliRunner

from apiary import embedded
from apiary.cli import main as cli
from apiary.errors import PortInUseError
from apiary.monitoring.gpu import NvmlProbe
from apiary.tracking.prefect_server import free_port

# Every VC asks for 3 node cells of a chain that has 1.
OVERSUBSCRIBED = (LAB6 / "hived-config-two-vcs.yaml").read_text().replace("cellNumber: 1", "cellNumber: 3")
FIELD = "virtualClusters.default.virtualCells[0]"
TWO_VCS = LAB6 / "hived-config-two-vcs.yaml"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Names of the children ``up`` tried to start (none may start here)."""
    names: list[str] = []
    monkeypatch.setattr(embedded.Child, "start", lambda self: names.append(self.name))
    monkeypatch.setattr(cli, "_logging", lambda verbose=False: None)
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)  # up installs a SIGTERM handler
    monkeypatch.setenv("APIARY_HOME", str(tmp_path / "home"))
    return names


def test_an_oversubscribed_vc_is_a_400_naming_the_field_and_nothing_starts(started: list[str],
                                                                          tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(OVERSUBSCRIBED)
    result = CliRunner().invoke(cli.app, ["up", "--no-prefect", "--cluster", str(bad)])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out
    assert f"error (400): {FIELD}: VC default does not fit" in out
    assert "500" not in out and "exited with" not in out
    assert started == []
    assert not (tmp_path / "home").exists()  # nothing written either


def test_a_bad_config_left_in_home_is_checked_too(started: list[str], tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "cluster.yaml").write_text(OVERSUBSCRIBED)
    result = CliRunner().invoke(cli.app, ["up", "--no-prefect"])
    assert result.exit_code == 1
    assert f"error (400): {FIELD}" in " ".join(result.output.split())
    assert started == []


# ---------------------------------------------------------------------- GPUs: NVML or simulated
H200 = NvmlProbe(names=("NVIDIA H200",), driver="550.54.15")


@pytest.mark.parametrize(("nodes", "probe", "host", "nvml_nodes", "says"), [
    pytest.param({"gpu-box": 1}, H200, "elsewhere", ("gpu-box",), "NVML on node gpu-box", id="one-node-cluster"),
    pytest.param({"a": 1, "gpu-box": 4}, NvmlProbe(names=("H100",) * 4), "gpu-box.example.org", ("gpu-box",),
                 "the other 1 node simulated", id="the-node-named-like-the-host"),
    pytest.param({"gpu-box": 2}, H200, "gpu-box", (), "node gpu-box has 2 in the cluster config",
                 id="more-gpus-in-the-config-than-nvml-sees"),
    pytest.param({"a": 1, "b": 1}, H200, "gpu-box", (), "no node of the cluster config is this host",
                 id="no-node-is-this-host"),
    pytest.param({"gpu-box": 1}, NvmlProbe(reason="NVMLError_LibraryNotFound: NVML Shared Library Not Found"),
                 "gpu-box", (), "NVML does not answer: NVMLError_LibraryNotFound", id="no-driver"),
    pytest.param({"gpu-box": 1}, None, "gpu-box", (), "asked with --simulated-gpus", id="asked-for-simulated"),
])
def test_up_reads_nvml_only_for_this_hosts_node_when_it_has_the_gpus(
        nodes: dict[str, int], probe: NvmlProbe | None, host: str, nvml_nodes: tuple[str, ...], says: str) -> None:
    choice = embedded.choose_gpus(nodes, probe, host)
    assert choice.nvml_nodes == nvml_nodes
    assert says in choice.note and choice.note.startswith("NVML" if nvml_nodes else "simulated")


# ---------------------------------------------------------------------- one platform per home
def test_up_on_a_home_whose_lock_is_held_exits_1_naming_the_holder(started: list[str], tmp_path: Path) -> None:
    """The lock file's protocol: a live platform holds ``flock`` on ``home/run/lock`` and wrote its
    pid and API URL there; a second ``up`` names both and starts nothing."""
    run = tmp_path / "home" / "run"
    run.mkdir(parents=True)
    with (run / "lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(json.dumps({"pid": 4242, "api": "http://127.0.0.1:9471"}))
        held.flush()
        result = CliRunner().invoke(cli.app, ["up", "--no-prefect", "--cluster", str(TWO_VCS)])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out
    home = tmp_path / "home"
    assert f"APIARY_HOME {home} is in use by the running platform (pid 4242, API http://127.0.0.1:9471)" in out
    assert started == [] and not (tmp_path / "home" / "cluster.yaml").exists()


def test_a_lock_left_by_a_dead_platform_does_not_stop_up(started: list[str], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "home" / "run"
    run.mkdir(parents=True)
    (run / "lock").write_text(json.dumps({"pid": 4242, "api": "http://127.0.0.1:9471"}))  # nobody holds it
    monkeypatch.setattr(embedded.Embedded, "wait_api", lambda self, timeout_s=60.0: {})
    result = CliRunner().invoke(cli.app, ["up", "--no-prefect", "--cluster", str(TWO_VCS)])
    # it went past the lock: it started its control plane (whose stand-in answers as no cluster)
    assert started == ["control-plane"] and "answers as cluster None" in " ".join(result.output.split())


# ---------------------------------------------------------------------- the Prefect UI's port
def test_the_prefect_port_is_kept_per_home_and_moves_only_when_taken(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ports: list[int] = []

    def fake_server(prefect_home, *, database_url=None, auth_string=None, port: int):
        ports.append(port)
        return SimpleNamespace(api_url=f"http://127.0.0.1:{port}/api", port=port)

    monkeypatch.setattr(embedded, "start_prefect_server", fake_server)

    def first_start(**kw) -> int:
        p = embedded.Embedded(home=tmp_path / "home", prefect=True, **kw)
        (tmp_path / "home" / "run").mkdir(parents=True, exist_ok=True)
        p._start_prefect_server({})  # the one step under test
        return ports[-1]

    chosen = first_start()
    assert first_start() == chosen  # restart: same port, so the bookmarked UI and its login still work
    with socket.socket() as s:  # something else took it meanwhile
        s.bind(("127.0.0.1", chosen))
        s.listen()
        moved = first_start()
        assert moved != chosen
    assert first_start() == moved  # the new one is remembered
    assert first_start(prefect_port=free_port()) == (asked := ports[-1]) and first_start() == asked


def test_a_refused_start_frees_the_home_at_once(started: list[str], tmp_path: Path) -> None:
    """A start refused before any child (here a taken port) leaves the home's lock free, so the
    next start in the same process is not told the home is in use."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        first = embedded.Embedded(home=tmp_path / "home", cluster=TWO_VCS, prefect=False, api_port=taken)
        with pytest.raises(PortInUseError):
            first.start()
    with (tmp_path / "home" / "run" / "lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # would raise BlockingIOError if still held
