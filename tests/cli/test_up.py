"""``apiary up`` checks the cluster config the way ``PUT /api/v2/cluster/config`` does, before it
starts any child process (typer's CliRunner, in process; no child may start)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.builders import LAB6
from typer.testing import CliRunner

from apiary import embedded
from apiary.cli import main as cli

# Every VC asks for 3 node cells of a chain that has 1.
OVERSUBSCRIBED = (LAB6 / "hived-config-two-vcs.yaml").read_text().replace("cellNumber: 1", "cellNumber: 3")
FIELD = "virtualClusters.default.virtualCells[0]"


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
